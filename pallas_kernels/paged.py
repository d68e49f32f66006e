"""Decode attention over a paged KV cache by the Pallas kernel JAX ships
(`jax.experimental.pallas.ops.gpu.paged_attention`, Triton), self-contained (nothing from
`rekv_jax`).

The kernel reads pages `[K, pages, page_size, H]` through a block table per request and masks
each request's positions past its length. It does not scale the scores, so the queries are
scaled by `H ** -0.5` here (in float32, rounded once to the query dtype). Its tiling must divide
a request's `n` pages: `k_splits` partitions of `n // k_splits` pages, walked in compute blocks of
`pages_per_compute_block` pages; both are the largest powers of two (at most the kernel's
defaults, 16 and 8) that divide. Its bits are its own (an online softmax in f32 over blocks);
they are not those of XLA's attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as shipped

MAX_SPLITS = 16  # the kernel's default k_splits
MAX_BLOCK_PAGES = 8  # its default pages_per_compute_block


def tiling(pages_per_request: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for requests of `n` pages: powers of two dividing n
    and n // k_splits, at most the kernel's defaults."""
    splits = min(pages_per_request & -pages_per_request, MAX_SPLITS)
    per_split = pages_per_request // splits
    return splits, min(per_split & -per_split, MAX_BLOCK_PAGES)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                    lengths: jax.Array, interpret: bool = False) -> jax.Array:
    """q [B, N, H] of each request's one new token; k, v pages [K, pages, page_size, H]; tables
    [B, n] int32 page ids; lengths [B] int32 positions each request sees -> [B, N, H]."""
    splits, block = tiling(tables.shape[1])
    scaled = (q.astype(jnp.float32) * np.float32(q.shape[-1] ** -0.5)).astype(q.dtype)
    return shipped.paged_attention(scaled, k_pages, v_pages, tables, lengths, k_splits=splits,
                                   pages_per_compute_block=block, interpret=interpret)
