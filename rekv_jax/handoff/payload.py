"""The prefix on the wire (paper §2.2, Eq. 7): each layer's K and V as BF16 buffers, or as codes
and FP16 scales, packed and restored by one program per layer shape.

A prefix of any number of layers, tokens chunk or streamed layer is a list of per-layer buffers
(`[K, V]` or `[K codes, K scales, V codes, V scales]` per layer, each `[B, T, K, *]`): no program
stacks layers, so a handoff at a new cut compiles nothing new. Quantizing also counts the groups
whose FP16 scale is not finite (a NaN/Inf input, or a scale that overflows), in the same program;
the sender reads that count once its messages are on the link (`check_finite`), outside the
critical path of the handoff it sends."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.quantize import (
    QuantizedTensor,
    dequantize,
    finite_error,
    quantize_unchecked,
    quantized_specs,
    resolve_backend,
)
from rekv_jax.sizes import GROUP_SIZE


@functools.partial(jax.jit, static_argnames=("bits", "backend"))
def _pack_layer(k: jax.Array, v: jax.Array, bits: int, backend: str
                ) -> tuple[list[jax.Array], jax.Array]:
    """One layer's K, V [B, T, K, H] -> ([K codes, K scales, V codes, V scales], the number of
    non-finite scales)."""
    qk, qv = (quantize_unchecked(x, bits, GROUP_SIZE, backend=backend) for x in (k, v))
    bad = sum(jnp.sum(~jnp.isfinite(q.scales)) for q in (qk, qv))
    return [qk.values, qk.scales, qv.values, qv.scales], bad


@functools.partial(jax.jit, static_argnames=("bits", "dtype", "backend"))
def _unpack_layer(buffers: list[jax.Array], bits: int, dtype: jnp.dtype, backend: str
                  ) -> tuple[jax.Array, jax.Array]:
    kc, ks, vc, vs = buffers
    return tuple(dequantize(QuantizedTensor(c, s, bits, GROUP_SIZE, dtype), backend=backend)
                 for c, s in ((kc, ks), (vc, vs)))


def pack_prefix(prefix: KVCache, bits: int, backend: str | None = None
                ) -> tuple[list[jax.Array], list[jax.Array]]:
    """The prefix as per-layer buffers (BF16: each layer's [K, V]; Q8/Q4: each layer's codes
    and FP16 scales of K, then of V), and the per-layer counts of non-finite scales (none for
    BF16), dispatched, not awaited."""
    if bits == 16:
        return [x for k, v in zip(prefix.keys, prefix.values, strict=True) for x in (k, v)], []
    backend = resolve_backend(backend)
    buffers, bad = [], []
    for k, v in zip(prefix.keys, prefix.values, strict=True):
        layer, count = _pack_layer(k, v, bits, backend)
        buffers += layer
        bad.append(count)
    return buffers, bad


def check_finite(bad: list[jax.Array], bits: int) -> None:
    """Raise ValueError if a prefix packed at `bits` had a non-finite scale (a host sync: call
    it once the prefix is on the link)."""
    total = sum(int(b) for b in bad)
    if total:
        raise ValueError(finite_error(total, bits))


def unpack_prefix(buffers: list[jax.Array], bits: int, dtype: jnp.dtype,
                  backend: str | None = None) -> KVCache:
    """Inverse of `pack_prefix`: the restored prefix in `dtype`, one layer at a time."""
    per = 2 if bits == 16 else 4
    layers = [buffers[i:i + per] for i in range(0, len(buffers), per)]
    if bits == 16:
        return KVCache(tuple(k for k, _ in layers), tuple(v for _, v in layers))
    backend = resolve_backend(backend)
    restored = [_unpack_layer(layer, bits, jnp.dtype(dtype), backend) for layer in layers]
    return KVCache(tuple(k for k, _ in restored), tuple(v for _, v in restored))


def round_trip(prefix: KVCache, bits: int) -> KVCache:
    """What the decode side restores of a prefix sent at `bits`: `pack_prefix`, then
    `unpack_prefix` (identity for BF16)."""
    buffers, bad = pack_prefix(prefix, bits)
    check_finite(bad, bits)
    return unpack_prefix(buffers, bits, prefix.dtype)


def prefix_specs(cfg: ModelConfig, bits: int, batch: int, tokens: int, layers: int,
                 dtype: jnp.dtype) -> list[jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the buffers of a prefix of `layers` layers and `tokens` tokens."""
    kv = jax.ShapeDtypeStruct((batch, tokens, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(dtype))
    layer = [kv, kv] if bits == 16 else [*quantized_specs(kv.shape, bits, GROUP_SIZE)] * 2
    return layer * layers
