"""The prefix on the wire (paper §2.2, Eq. 7): each layer's K and V as BF16 buffers, or as codes
and FP16 scales with the keys in the action's prefix format (`prefix_format`), packed and
restored by one program per layer shape and format.

A prefix of any number of layers, token chunk or streamed layer is a list of per-layer buffers
(`[K, V]` or `[K codes, K scales, V codes, V scales]` per layer): no program stacks layers, so a
handoff at a new cut compiles nothing new. A payload knows where it sits in the cache (its first
layer and its first token's position), which a debiased format needs; both are traced, so no
program depends on them either. Quantizing also counts the groups whose FP16 scale is not finite
(a NaN/Inf input, or a scale that overflows), in the same program; the sender reads that count
once its messages are on the link (`check_finite`), outside the critical path of the handoff."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.config import ModelConfig
from rekv_jax.handoff.prefix_format import PrefixCodec, key_specs
from rekv_jax.kv import KVCache
from rekv_jax.plan import Message, Part
from rekv_jax.quantize import (
    QuantizedTensor,
    dequantize,
    finite_error,
    quantize_unchecked,
    quantized_specs,
    resolve_backend,
)
from rekv_jax.sizes import GROUP_SIZE


@functools.partial(jax.jit, static_argnames=("backend",))
def _pack_layer(k: jax.Array, v: jax.Array, codec: PrefixCodec, layer: jax.Array,
                start: jax.Array, backend: str) -> tuple[list[jax.Array], jax.Array]:
    """One layer's K, V [B, T, K, H] -> ([K codes, K scales, V codes, V scales], the number of
    non-finite scales)."""
    qk = codec.encode_keys(k, layer, start, backend)
    qv = quantize_unchecked(v, codec.bits, GROUP_SIZE, backend=backend)
    bad = sum(jnp.sum(~jnp.isfinite(q.scales)) for q in (qk, qv))
    return [qk.values, qk.scales, qv.values, qv.scales], bad


@functools.partial(jax.jit, static_argnames=("dtype", "backend"))
def _unpack_layer(buffers: list[jax.Array], codec: PrefixCodec, layer: jax.Array,
                  start: jax.Array, dtype: jnp.dtype, backend: str
                  ) -> tuple[jax.Array, jax.Array]:
    kc, ks, vc, vs = buffers
    k = codec.decode_keys(kc, ks, vc.shape[1], dtype, layer, start, backend)
    v = dequantize(QuantizedTensor(vc, vs, codec.bits, GROUP_SIZE, dtype), backend=backend)
    return k, v


def pack_prefix(prefix: KVCache, codec: PrefixCodec, backend: str | None = None,
                layer: int = 0, start: int = 0) -> tuple[list[jax.Array], list[jax.Array]]:
    """The prefix (its first layer `layer`, its first token at position `start`) as per-layer
    buffers (BF16: each layer's [K, V]; Q8/Q4: each layer's codes and FP16 scales of K, in the
    codec's format, then of V), and the per-layer counts of non-finite scales (none for BF16),
    dispatched, not awaited."""
    if codec.bits == 16:
        return [x for k, v in zip(prefix.keys, prefix.values, strict=True) for x in (k, v)], []
    backend = resolve_backend(backend)
    buffers, bad = [], []
    for i, (k, v) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
        layer_buffers, count = _pack_layer(k, v, codec, np.int32(layer + i), np.int32(start),
                                           backend)
        buffers += layer_buffers
        bad.append(count)
    return buffers, bad


def check_finite(bad: list[jax.Array], bits: int) -> None:
    """Raise ValueError if a prefix packed at `bits` had a non-finite scale (a host sync: call
    it once the prefix is on the link)."""
    total = sum(int(b) for b in bad)
    if total:
        raise ValueError(finite_error(total, bits))


def unpack_prefix(buffers: list[jax.Array], codec: PrefixCodec, dtype: jnp.dtype,
                  backend: str | None = None, layer: int = 0, start: int = 0) -> KVCache:
    """Inverse of `pack_prefix`: the restored prefix in `dtype`, one layer at a time."""
    per = 2 if codec.bits == 16 else 4
    layers = [buffers[i:i + per] for i in range(0, len(buffers), per)]
    if codec.bits == 16:
        return KVCache(tuple(k for k, _ in layers), tuple(v for _, v in layers))
    backend = resolve_backend(backend)
    restored = [_unpack_layer(buffers, codec, np.int32(layer + i), np.int32(start),
                              jnp.dtype(dtype), backend) for i, buffers in enumerate(layers)]
    return KVCache(tuple(k for k, _ in restored), tuple(v for _, v in restored))


def round_trip(prefix: KVCache, codec: PrefixCodec, start: int = 0) -> KVCache:
    """What the decode side restores of a prefix (from layer 0, its first token at `start`):
    `pack_prefix`, then `unpack_prefix` (identity for BF16)."""
    buffers, bad = pack_prefix(prefix, codec, start=start)
    check_finite(bad, codec.bits)
    return unpack_prefix(buffers, codec, prefix.dtype, start=start)


def prefix_specs(cfg: ModelConfig, codec: PrefixCodec, batch: int, tokens: int, layers: int,
                 dtype: jnp.dtype) -> list[jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the buffers of a prefix of `layers` layers and `tokens` tokens."""
    kv = jax.ShapeDtypeStruct((batch, tokens, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(dtype))
    if codec.bits == 16:
        return [kv, kv] * layers
    keys = [jax.ShapeDtypeStruct(s.shape[1:], s.dtype)
            for s in key_specs((1, *kv.shape), codec.bits, codec.format)]
    return [*keys, *quantized_specs(kv.shape, codec.bits, GROUP_SIZE)] * layers


def message_specs(cfg: ModelConfig, codec: PrefixCodec, message: Message, batch: int,
                  seq_len: int, dtype: jnp.dtype, first: list[jax.ShapeDtypeStruct]
                  ) -> list[jax.ShapeDtypeStruct]:
    """The buffers a handoff's `message` carries, its parts in order: the ids [B, S] int32, the
    first-token part's `first`, h_c's token range [B, T, D], the prefix part's per-layer
    buffers."""
    start, stop = message.tokens
    specs = {Part.TOKENS: [jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)],
             Part.FIRST: first,
             Part.BOUNDARY: [jax.ShapeDtypeStruct((batch, stop - start, cfg.hidden_size), dtype)]}
    out = []
    for part in message.parts:
        out += specs[part] if part != Part.PREFIX else prefix_specs(
            cfg, codec, batch, stop - start, message.layers[1] - message.layers[0], dtype)
    return out
