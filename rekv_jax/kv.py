"""The one KV layout shared by the model, the quantizer, the transports and the planner."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys (after RoPE) and values of a stack of layers: `k`, `v` are `[L, B, S, K, H]`."""

    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def seq_len(self) -> int:
        return self.k.shape[2]

    def layers(self, start: int, stop: int) -> KVCache:
        """Layers `start..stop-1` (a view-like slice along L)."""
        return KVCache(self.k[start:stop], self.v[start:stop])

    def pad(self, capacity: int) -> KVCache:
        """Zero-extend the sequence axis to `capacity` positions (room for decoding)."""
        if capacity < self.seq_len:
            raise ValueError(f"capacity {capacity} < current length {self.seq_len}")
        widths = [(0, 0), (0, 0), (0, capacity - self.seq_len), (0, 0), (0, 0)]
        return KVCache(jnp.pad(self.k, widths), jnp.pad(self.v, widths))

    @staticmethod
    def concat(*parts: KVCache) -> KVCache:
        """Join layer ranges in order, e.g. a restored prefix and a recomputed suffix."""
        return KVCache(jnp.concatenate([p.k for p in parts]), jnp.concatenate([p.v for p in parts]))
