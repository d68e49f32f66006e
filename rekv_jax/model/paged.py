"""The decode side's paged cache on the device: a pool of pages for every layer, writing a
contiguous KV into a request's pages, and one batched decode step over requests at different
positions.

The pool holds keys and values `[K, L, P, page_size, H]` (kv head, layer, page, slot, head dim):
the layout of JAX's Pallas paged-attention kernel, `[K, pages, page_size, H]`, with the layers
folded into its page axis, so that the kernel reads any layer's pages without a copy. A request
owns some pages (its block table, `rekv_jax.serving.pages`): its position `p` lives at page
`table[p // page_size]`, slot `p % page_size`, which the host names by its row
`page * page_size + slot` of a layer.

`decode_step` is one program for all L layers (a scan over the stacked layer weights), one per
(batch, width) shape. It computes each request exactly as the contiguous
`transformer.decode_step` computes a batch of one. On XLA:CPU a dot's bits depend on its row
count (one row runs XLA's matrix-vector code, more rows YNNPACK's tiled kernels, whose bits
change again with the count), and the softmax's sum depends on the attention width. So every
dot of the step runs each request's row alone (a loop over the batch inside the layer, sharing
the layer's weights), and each request attends over its own power-of-two bucket of positions
(one branch per bucket), never the batch's. A request's logits are then bitwise the same
whatever shares its batch, in any slot, and equal to the contiguous decode of it alone on a
cache whose capacity cuts no bucket. With `attention="pallas"` (a GPU) attention is JAX's
Pallas paged-attention kernel over the BF16 pages instead, with its own bits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import paged as pallas_paged
from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.model.layers import causal_mask, rope_tables, row_blocks, xla_attention
from rekv_jax.model.param_spec import layer_def
from rekv_jax.model.transformer import Params, _checked, _logits

# How the step attends: each request's pages gathered for XLA (any platform), or JAX's Pallas
# paged-attention kernel, compiled (a CUDA GPU) or interpreted (anywhere; slow)
PAGED_ATTENTIONS = ("xla", "pallas", "pallas-interpret")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePool:
    """Every layer's pages: keys and values `[K, L, P, page_size, H]` of `dtype`, held as its raw
    bits (unsigned ints of its width). XLA:CPU writes rows into a 16-bit float array by
    converting all of it to float32 and back; into an integer array, in place."""

    k: jax.Array
    v: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


def new_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype) -> PagePool:
    """An all-zero pool of `num_pages` pages of `page_size` positions for every layer."""
    shape = (cfg.num_kv_heads, cfg.num_layers, num_pages, page_size, cfg.head_dim)
    bits = jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")
    return PagePool(jnp.zeros(shape, bits), jnp.zeros(shape, bits), np.dtype(dtype))


@functools.partial(jax.jit, donate_argnames="pool")
def _write(pool: PagePool, layer: jax.Array, rows: jax.Array, k: jax.Array, v: jax.Array
           ) -> PagePool:
    K, L, P, S, H = pool.k.shape

    def put(pages: jax.Array, x: jax.Array) -> jax.Array:  # x [1, T, K, H] at `rows` of `layer`
        flat = pages.reshape(K, L * P * S, H)
        return flat.at[:, layer * P * S + rows].set(_bits(x[0].transpose(1, 0, 2))
                                                    ).reshape(K, L, P, S, H)

    return PagePool(put(pool.k, k), put(pool.v, v), pool.dtype)


def write_layer(pool: PagePool, layer: int, rows: np.ndarray, k: jax.Array, v: jax.Array
                ) -> PagePool:
    """Write one layer's contiguous k, v `[1, T, K, H]` (a restored prefix layer, a recomputed
    suffix layer, or a token chunk of one) at its `rows` [T] (`BlockTable.rows`). The pool is
    donated: written in place; use the one returned. One program per T."""
    if k.shape != v.shape or k.ndim != 4 or k.shape[0] != 1 or len(rows) != k.shape[1]:
        raise ValueError(f"need k, v [1, T, K, H] and T rows, got {k.shape}, {v.shape} and "
                         f"{len(rows)} rows")
    if k.dtype != pool.dtype:
        raise ValueError(f"the pool holds {pool.dtype.name}, the cache is {k.dtype}")
    rows = np.asarray(rows, np.int32)
    if len(rows) and not 0 <= rows.min() <= rows.max() < pool.num_pages * pool.page_size:
        raise ValueError(f"rows must be in 0..{pool.num_pages * pool.page_size - 1} (a row past "
                         f"a layer's pages would land in the next layer's)")
    return _write(pool, np.int32(layer), rows, k, v)


def write_cache(pool: PagePool, kv: KVCache, first: int, rows: np.ndarray) -> PagePool:
    """Write layers first..first+n-1 of a contiguous cache `[n, 1, T, K, H]` at `rows` [T]."""
    for i, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
        pool = write_layer(pool, first + i, rows, k, v)
    return pool


@jax.jit
def _read(pool: PagePool, layer: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    K, L, P, S, H = pool.k.shape

    def get(pages: jax.Array) -> jax.Array:  # -> [1, T, K, H]
        got = pages.reshape(K, L * P * S, H)[:, layer * P * S + rows]
        return jax.lax.bitcast_convert_type(got.transpose(1, 0, 2)[None], pool.dtype)

    return get(pool.k), get(pool.v)


def read_layer(pool: PagePool, layer: int, rows: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """One layer's k, v `[1, T, K, H]` at `rows` [T] (a copy)."""
    return _read(pool, np.int32(layer), np.asarray(rows, np.int32))


# ---------------------------------------------------------------------------- the decode step


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepWeights:
    """What a decode step reads: the layers' weights stacked (leaves `[L, ...]`) and the rest of
    the params (embedding, final norm, LM head). The stack holds the bits of `dtype`, like the
    pool: slicing a layer out of a 16-bit float stack in the loop over layers makes XLA:CPU
    convert the whole stack to float32 ahead of the loop, every step."""

    layers: dict
    head: dict
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))


@jax.jit
def _stack(layers: list[dict]) -> dict:
    return jax.tree.map(lambda *w: _bits(jnp.stack(w)), *layers)


def stack_weights(cfg: ModelConfig, params: Params) -> StepWeights:
    """The step's weights from model params (checked against `cfg`): a stacked copy."""
    _checked(cfg, params)
    return StepWeights(_stack(params["layers"]),
                       {name: w for name, w in params.items() if name != "layers"},
                       np.dtype(params["embed"].dtype))


def _rows(f: Callable, *xs: jax.Array):
    """f on each request alone: xs [B, ...] -> f's outputs stacked [B, ...]; f sees [1, ...]."""
    return jax.lax.map(lambda r: jax.tree.map(lambda y: y[0], f(*(x[None] for x in r))), xs)


def _bucket(position: jax.Array) -> jax.Array:
    """log2 of `attention_width(position + 1)` (never capped): which power of two it is."""
    return 32 - jax.lax.clz(position.astype(jnp.uint32)).astype(jnp.int32)


def _attend_width(q: jax.Array, k: jax.Array, v: jax.Array, position: jax.Array, *, w: int
                  ) -> jax.Array:
    """The contiguous decode's attention: q [1, 1, N, H] over positions 0..w-1 of k, v."""
    return xla_attention(q, k[:, :w], v[:, :w], causal_mask(position, 1, w))


def _attend_xla(pages: tuple[jax.Array, jax.Array], dtype: np.dtype, q: jax.Array,
                positions: jax.Array, tables: jax.Array, width: int) -> jax.Array:
    """Each request gathers its pages and attends over its own bucket: q [B, 1, N, H], pages
    [K, pages, page_size, H] as bits, tables [B, n] -> [B, 1, N, H]."""
    K, _, _, H = pages[0].shape
    branches = [functools.partial(_attend_width, w=1 << i) for i in range(width.bit_length())]

    def one(q: jax.Array, position: jax.Array, table: jax.Array) -> jax.Array:
        # gathered as bits, so that XLA converts (for the score dot) this request's pages, not
        # the whole pool once per layer outside the loop over requests
        k, v = (jax.lax.bitcast_convert_type(p[:, table[0]], dtype).reshape(K, -1, H)
                .transpose(1, 0, 2)[None] for p in pages)
        return jax.lax.switch(_bucket(position[0]), branches, q, k, v, position[0])

    return _rows(one, q, positions, tables)


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A step's per-request inputs on the device, for every layer."""

    positions: jax.Array  # [B]
    tables: jax.Array  # [B, n] pages
    rows: jax.Array  # [B]: the row of a layer each request's new K/V go to
    rope: tuple[jax.Array, jax.Array]  # cos, sin [B, 1, 1, H/2]


def _layer_step(cfg: ModelConfig, attention: str, width: int, pool_shape: tuple[int, ...],
                dtype: np.dtype, batch: _Batch, carry: tuple, xs: tuple) -> tuple[tuple, None]:
    """One layer for every request: carry x [B, 1, D] and the pages [K, L * P * S, H] as bits;
    xs this layer's weights and index."""
    K, L, P, S, H = pool_shape
    x, pages_k, pages_v = carry
    weights = jax.tree.map(lambda w: jax.lax.bitcast_convert_type(w, dtype), xs[0])
    index = xs[1]
    layer = nnx.merge(layer_def(cfg), weights)
    q, k, v = row_blocks(lambda x, c, s: layer.attn.project(layer.input_norm(x), (c, s)),
                         x, *batch.rope)  # q [B, 1, N, H]; k, v [B, 1, K, H]
    at = index * P * S + batch.rows
    pages_k = pages_k.at[:, at].set(_bits(k[:, 0].transpose(1, 0, 2)))
    pages_v = pages_v.at[:, at].set(_bits(v[:, 0].transpose(1, 0, 2)))
    by_page = (pages_k.reshape(K, L * P, S, H), pages_v.reshape(K, L * P, S, H))
    tables = batch.tables + index * P  # the pages of this layer
    if attention == "xla":
        out = _attend_xla(by_page, dtype, q, batch.positions, tables, width)
    else:
        k_pages, v_pages = (jax.lax.bitcast_convert_type(p, dtype) for p in by_page)
        out = pallas_paged.paged_attention(q[:, 0], k_pages, v_pages, tables, batch.positions + 1,
                                           interpret=attention == "pallas-interpret")[:, None]
    x = row_blocks(lambda x, o: layer.finish(x, layer.attn.output(o)), x, out)
    return (x, pages_k, pages_v), None


@functools.partial(jax.jit, static_argnames=("cfg", "width", "attention"),
                   donate_argnames="pool")
def _step(cfg: ModelConfig, weights: StepWeights, pool: PagePool, tokens: jax.Array,
          positions: jax.Array, tables: jax.Array, *, width: int, attention: str
          ) -> tuple[jax.Array, PagePool]:
    K, L, P, S, H = pool.k.shape
    page = jnp.take_along_axis(tables, (positions // S)[:, None], axis=1)[:, 0]
    batch = _Batch(positions, tables, page * S + positions % S,
                   rope_tables(cfg, positions[:, None]))
    step = functools.partial(_layer_step, cfg, attention, width, pool.k.shape, pool.dtype, batch)
    x = weights.head["embed"][tokens][:, None]  # [B, 1, D]
    flat = (pool.k.reshape(K, L * P * S, H), pool.v.reshape(K, L * P * S, H))
    (x, k, v), _ = jax.lax.scan(step, (x, *flat), (weights.layers, jnp.arange(L)))
    logits = row_blocks(lambda x: _logits(cfg, weights.head, x[:, -1]), x)  # [B, V] f32
    return logits, PagePool(k.reshape(pool.k.shape), v.reshape(pool.v.shape), pool.dtype)


def decode_step(cfg: ModelConfig, weights: StepWeights, pool: PagePool, tokens: jax.Array,
                positions: jax.Array, tables: jax.Array, width: int,
                attention: str | None = None) -> tuple[jax.Array, PagePool]:
    """One decode step of B requests: tokens [B] int32 at positions [B], each attending over
    its pages `tables` [B, n]; `width`, a power of two at least every position + 1 and at most
    n * page_size, sets the program (`serving.pages.width_bucket`). The pool is donated (each
    new K/V is written in place): use the one returned. Returns (logits [B, V] f32, the pool).
    Positions are checked when they are host arrays (device ones are never pulled).
    `attention`: one of PAGED_ATTENTIONS, default Pallas on a GPU, else XLA."""
    attention = attention or ("pallas" if jax.default_backend() == "gpu" else "xla")
    if attention not in PAGED_ATTENTIONS:
        raise ValueError(f"unknown paged attention {attention!r}; expected one of "
                         f"{PAGED_ATTENTIONS}")
    B = tokens.shape[0]
    if tokens.shape != (B,) or positions.shape != (B,) or tables.ndim != 2 or len(tables) != B:
        raise ValueError(f"need tokens [B], positions [B] and tables [B, n], got "
                         f"{tokens.shape}, {positions.shape} and {tables.shape}")
    if pool.dtype != weights.dtype:
        raise ValueError(f"the pool holds {pool.dtype.name}, the weights are {weights.dtype.name}")
    if width & (width - 1) or not width <= tables.shape[1] * pool.page_size:
        raise ValueError(f"width must be a power of two within the tables' "
                         f"{tables.shape[1]} pages of {pool.page_size}, got {width}")
    if isinstance(positions, np.ndarray) and not 0 <= positions.min() <= positions.max() < width:
        raise ValueError(f"positions must be in 0..{width - 1} (the width), got "
                         f"{positions.min()}..{positions.max()}")
    return _step(cfg, weights, pool, tokens, positions, tables, width=width,
                 attention=attention)
