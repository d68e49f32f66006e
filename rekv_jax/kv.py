"""The one KV layout shared by the model, the quantizer, the transports and the planner.

A cache holds one key and one value array per layer (`[B, S, K, H]` each), not a stacked
`[L, ...]` array: the model's per-layer program writes each layer's K/V on its own (in place, by
buffer donation, when decoding), so selecting and joining layer ranges (`layers`, `concat`) are
free tuple operations and never compile a program per range. `k` / `v` stack on read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _stack(arrays: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.stack(arrays)  # [n, B, S, K, H]


@jax.jit
def _unstack(stacked: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.unstack(stacked))  # n x [B, S, K, H]


@functools.partial(jax.jit, static_argnums=1)
def _pad(x: jax.Array, capacity: int) -> jax.Array:
    # lax.pad, not jnp.pad: a new buffer even when nothing is added (jnp.pad would return `x`)
    widths = [(0, 0, 0), (0, capacity - x.shape[1], 0), (0, 0, 0), (0, 0, 0)]
    return jax.lax.pad(x, jnp.zeros((), x.dtype), widths)  # [B, C, K, H]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _span(x: jax.Array, start: int, stop: int) -> jax.Array:
    return x[:, start:stop]  # [B, stop - start, K, H]


@jax.jit
def _as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


@functools.partial(jax.jit, static_argnums=1)
def _from_bits(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype)


@jax.jit
def _join(parts: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.concatenate(parts, axis=1)  # [B, S, K, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys (after RoPE) and values of a range of layers, one `[B, S, K, H]` array per layer.

    `empty` is the layer shape `[B, S, K, H]` and dtype of a cache that holds no layer (the cut-0
    prefix, the cut-L suffix), so that it still knows its sequence length and stacked shape.
    `bits` is set on a cache held as raw bits (`held_as_bits`): its arrays are the unsigned ints
    of that dtype's width, and `dtype`, `k` and `v` are that dtype's.
    """

    keys: tuple[jax.Array, ...]  # L x [B, S, K, H]
    values: tuple[jax.Array, ...]  # L x [B, S, K, H]
    empty: tuple[tuple[int, ...], np.dtype] | None = dataclasses.field(
        default=None, metadata=dict(static=True))
    bits: np.dtype | None = dataclasses.field(default=None, metadata=dict(static=True))

    @staticmethod
    def stacked(k: jax.Array, v: jax.Array) -> KVCache:
        """From stacked `k`, `v` `[L, B, S, K, H]` (a received payload, a reference cache)."""
        if k.shape[0] == 0:
            return KVCache((), (), (tuple(k.shape[1:]), np.dtype(k.dtype)))
        return KVCache(_unstack(k), _unstack(v))

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def _layer_shape(self) -> tuple[tuple[int, ...], np.dtype]:
        return self.empty if not self.keys else (self.keys[0].shape, np.dtype(self.keys[0].dtype))

    @property
    def seq_len(self) -> int:
        return self._layer_shape[0][1]

    @property
    def dtype(self) -> np.dtype:
        return self.bits or self._layer_shape[1]

    @property
    def k(self) -> jax.Array:
        """Keys stacked `[L, B, S, K, H]` (a copy)."""
        return self._stack(self.keys)

    @property
    def v(self) -> jax.Array:
        """Values stacked `[L, B, S, K, H]` (a copy)."""
        return self._stack(self.values)

    def _stack(self, arrays: tuple[jax.Array, ...]) -> jax.Array:
        if arrays:
            return _from_bits(_stack(arrays), self.bits) if self.bits else _stack(arrays)
        shape, dtype = self.empty
        return jnp.zeros((0, *shape), dtype)

    def on_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values stacked `[L, B, S, K, H]` in host memory (numpy stacks: no program
        per layer count)."""
        shape, dtype = self._layer_shape
        return tuple(np.stack([np.asarray(x) for x in xs]) if xs else np.zeros((0, *shape), dtype)
                     for xs in (self.keys, self.values))

    @property
    def buffers(self) -> list[jax.Array]:
        """The per-layer keys, then values: the arrays themselves, as transports checksum them."""
        return [*self.keys, *self.values]

    def layers(self, start: int, stop: int) -> KVCache:
        """Layers `start..stop-1` (the same arrays, nothing copied)."""
        keys, values = self.keys[start:stop], self.values[start:stop]
        return KVCache(keys, values, None if keys else self._layer_shape, self.bits)

    def span(self, start: int, stop: int) -> KVCache:
        """Positions `start..stop-1` of every layer (a token chunk; new buffers; >= 1 layer;
        one program per layer shape, whatever the layer count)."""
        return KVCache(tuple(_span(k, start, stop) for k in self.keys),
                       tuple(_span(v, start, stop) for v in self.values), bits=self.bits)

    @staticmethod
    def join_spans(*parts: KVCache) -> KVCache:
        """Join token chunks of the same layers (>= 1) in order (a pipelined prefix's)."""
        return KVCache(tuple(_join(layer) for layer in zip(*(p.keys for p in parts), strict=True)),
                       tuple(_join(layer) for layer in zip(*(p.values for p in parts),
                                                            strict=True)))

    def pad(self, capacity: int) -> KVCache:
        """Zero-extend the sequence axis to `capacity` positions (room for decoding); always
        new buffers, so decoding (which donates them) leaves this cache intact."""
        if capacity < self.seq_len:
            raise ValueError(f"capacity {capacity} < current length {self.seq_len}")
        if not self.keys:
            shape, dtype = self.empty
            return KVCache((), (), ((shape[0], capacity, *shape[2:]), dtype))
        return KVCache(tuple(_pad(k, capacity) for k in self.keys),
                       tuple(_pad(v, capacity) for v in self.values), bits=self.bits)

    def held_as_bits(self) -> KVCache:
        """The cache held as raw bits (new buffers; itself if it already is): a decode cache,
        which each `decode_step` writes a position of in place. XLA:CPU writes into a 16-bit
        float array by converting all of it to float32 and back, into an integer one in place,
        so a step on a float cache costs more the larger its capacity."""
        if self.bits or not self.keys:
            return self
        return KVCache(tuple(map(_as_bits, self.keys)), tuple(map(_as_bits, self.values)),
                       bits=self.dtype)

    @staticmethod
    def concat(*parts: KVCache) -> KVCache:
        """Join layer ranges in order, e.g. a restored prefix and a recomputed suffix."""
        if len({p.bits for p in parts}) > 1:
            raise ValueError("cannot join a cache held as bits with one that is not")
        keys = tuple(k for p in parts for k in p.keys)
        values = tuple(v for p in parts for v in p.values)
        return KVCache(keys, values, None if keys else parts[0].empty, parts[0].bits)
