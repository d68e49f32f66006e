"""The prefix payload on the wire (paper §2.2, Eq. 7): packing the prefix KV into a few
contiguous buffers (BF16, or codes + FP16 scales, the keys in the action's prefix format), their
specs, and receiving and restoring one."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.prefix_format import PrefixCodec, key_specs
from rekv_jax.kv import KVCache
from rekv_jax.quantize import QuantizedTensor, dequantize, quantize, quantized_specs
from rekv_jax.sizes import GROUP_SIZE
from rekv_jax.transport import Transport


def pack_prefix(prefix: KVCache, codec: PrefixCodec, backend: str | None = None,
                layer: int = 0, start: int = 0) -> list[jax.Array]:
    """The prefix as a few contiguous buffers: [K, V] in BF16, or [K codes, K scales, V codes,
    V scales] for Q8/Q4 (codes [c, B, S, K, H*b/8], scales [c, B, S, K, H/64] float16; the keys
    in the codec's format, `prefix_format`). `layer` and `start`: the first layer and the first
    token's position of the payload (a streamed layer's, a token chunk's)."""
    if codec.bits == 16:
        return [prefix.k, prefix.v]
    qk = codec.pack_keys(prefix.k, backend, layer, start)
    qv = quantize(prefix.v, codec.bits, backend=backend)
    return [qk.values, qk.scales, qv.values, qv.scales]


def unpack_prefix(buffers: list[jax.Array], codec: PrefixCodec, dtype: jnp.dtype,
                  backend: str | None = None, layer: int = 0, start: int = 0) -> KVCache:
    """Inverse of `pack_prefix`: the restored prefix KV [c, B, S, K, H] in `dtype`."""
    if codec.bits == 16:
        return KVCache.stacked(*buffers)
    kc, ks, vc, vs = buffers
    return KVCache.stacked(
        codec.unpack_keys(kc, ks, vc.shape[2], dtype, backend, layer, start),
        dequantize(QuantizedTensor(vc, vs, codec.bits, GROUP_SIZE, dtype), backend=backend))


def round_trip(prefix: KVCache, codec: PrefixCodec, start: int = 0) -> KVCache:
    """What the decode side restores of a prefix [c, B, S, K, H] at positions `start..`:
    `pack_prefix`, then `unpack_prefix` (identity for BF16)."""
    return unpack_prefix(pack_prefix(prefix, codec, start=start), codec, prefix.k.dtype,
                         start=start)


def prefix_specs(cfg: ModelConfig, action: Action, batch: int, seq_len: int, dtype: jnp.dtype,
                 layers: int | None = None) -> list[jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the prefix buffers the decode side must receive (of `layers`
    layers: default the whole prefix, 1 for one streamed layer)."""
    return _specs(cfg, action.bits, action.format, (batch, seq_len,
                                                   action.cut if layers is None else layers), dtype)


def _specs(cfg: ModelConfig, bits: int, fmt: str, shape: tuple[int, int, int], dtype: jnp.dtype
           ) -> list[jax.ShapeDtypeStruct]:
    """`prefix_specs` of a payload of shape (B, tokens, layers) at `bits` in format `fmt`."""
    batch, seq_len, layers = shape
    kv = jax.ShapeDtypeStruct((layers, batch, seq_len, cfg.num_kv_heads, cfg.head_dim),
                              jnp.dtype(dtype))
    if bits == 16:
        return [kv, kv]
    return [*key_specs(kv.shape, bits, fmt), *quantized_specs(kv.shape, bits, GROUP_SIZE)]


def recv_prefix(transport: Transport, cfg: ModelConfig, codec: PrefixCodec,
                shape: tuple[int, int, int], dtype: jnp.dtype, tag: str, backend: str | None,
                timeout: float, paced_after: threading.Event | None = None, layer: int = 0,
                start: int = 0) -> KVCache:
    """Receive and restore one prefix payload of shape (B, tokens, layers) whose first layer is
    `layer` and first token `start`: the whole prefix, a streamed layer or a token chunk
    (`paced_after`: `Transport.recv`'s)."""
    specs = _specs(cfg, codec.bits, codec.format, shape, dtype)
    return unpack_prefix(transport.recv(tag, specs, timeout, paced_after), codec, dtype,
                         backend, layer, start)


def send_prefix(transport: Transport, tag: str, prefix: KVCache, codec: PrefixCodec,
                backend: str | None, timeout: float, layer: int = 0, start: int = 0) -> float:
    """Quantize (Q) one prefix payload (a streamed layer `layer`, a token chunk from `start`) and
    hand it to the link as message `tag`, which moves it while the caller computes on; the
    quantize ms (0 in BF16)."""
    began = time.perf_counter()
    payload = jax.block_until_ready(pack_prefix(prefix, codec, backend, layer, start))
    quantize_ms = 1e3 * (time.perf_counter() - began) if codec.bits != 16 else 0.0
    transport.send(tag, payload, timeout)
    return quantize_ms
