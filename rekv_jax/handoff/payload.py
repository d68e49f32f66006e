"""The prefix payload on the wire (paper §2.2, Eq. 7): packing the prefix KV into a few
contiguous buffers (BF16, or codes + FP16 scales), their specs, and receiving and restoring one."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.quantize import QuantizedTensor, dequantize, quantize, quantized_specs
from rekv_jax.sizes import GROUP_SIZE
from rekv_jax.transport import Transport


def pack_prefix(prefix: KVCache, bits: int, backend: str | None = None) -> list[jax.Array]:
    """The prefix as a few contiguous buffers: [K, V] in BF16, or [K codes, K scales, V codes,
    V scales] for Q8/Q4 (codes [c, B, S, K, H*b/8], scales [c, B, S, K, H/64] float16)."""
    if bits == 16:
        return [prefix.k, prefix.v]
    qk, qv = quantize(prefix.k, bits, backend=backend), quantize(prefix.v, bits, backend=backend)
    return [qk.values, qk.scales, qv.values, qv.scales]


def unpack_prefix(buffers: list[jax.Array], bits: int, dtype: jnp.dtype,
                  backend: str | None = None) -> KVCache:
    """Inverse of `pack_prefix`: the restored prefix KV [c, B, S, K, H] in `dtype`."""
    if bits == 16:
        return KVCache.stacked(*buffers)
    kc, ks, vc, vs = buffers
    return KVCache.stacked(
        dequantize(QuantizedTensor(kc, ks, bits, GROUP_SIZE, dtype), backend=backend),
        dequantize(QuantizedTensor(vc, vs, bits, GROUP_SIZE, dtype), backend=backend))


def round_trip(prefix: KVCache, bits: int) -> KVCache:
    """What the decode side restores of a prefix [c, B, S, K, H] sent at `bits`: `pack_prefix`,
    then `unpack_prefix` (identity for BF16)."""
    return unpack_prefix(pack_prefix(prefix, bits), bits, prefix.k.dtype)


def prefix_specs(cfg: ModelConfig, action: Action, batch: int, seq_len: int, dtype: jnp.dtype,
                 layers: int | None = None) -> list[jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the prefix buffers the decode side must receive (of `layers`
    layers: default the whole prefix, 1 for one streamed layer)."""
    c = action.cut if layers is None else layers
    kv = jax.ShapeDtypeStruct((c, batch, seq_len, cfg.num_kv_heads, cfg.head_dim),
                              jnp.dtype(dtype))
    if action.bits == 16:
        return [kv, kv]
    return [*quantized_specs(kv.shape, action.bits, GROUP_SIZE)] * 2


def recv_prefix(transport: Transport, cfg: ModelConfig, action: Action,
                shape: tuple[int, int, int], dtype: jnp.dtype, tag: str, backend: str | None,
                timeout: float, paced_after: threading.Event | None = None) -> KVCache:
    """Receive and restore one prefix payload of shape (B, tokens, layers): the whole prefix, a
    streamed layer or a token chunk (`paced_after`: `Transport.recv`'s)."""
    specs = prefix_specs(cfg, action, shape[0], shape[1], dtype, shape[2])
    return unpack_prefix(transport.recv(tag, specs, timeout, paced_after), action.bits, dtype,
                         backend)


def send_prefix(transport: Transport, tag: str, prefix: KVCache, bits: int,
                backend: str | None, timeout: float) -> float:
    """Quantize (Q) one prefix payload (a streamed layer, a token chunk) and hand it to the link
    as message `tag`, which moves it while the caller computes on; the quantize ms (0 in BF16)."""
    start = time.perf_counter()
    payload = jax.block_until_ready(pack_prefix(prefix, bits, backend))
    quantize_ms = 1e3 * (time.perf_counter() - start) if bits != 16 else 0.0
    transport.send(tag, payload, timeout)
    return quantize_ms
