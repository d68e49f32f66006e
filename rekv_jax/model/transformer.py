"""Qwen2 / Qwen3 / Llama decoder split at a static layer cut (paper §2.2, §2.4): the functional API.

Every entry point is a Python composition of a few jitted programs: the embedding, one program
per decoder layer shape and mode (`_prompt_layer`; `_cache_layer` when decoding on a cache),
called once per layer with that layer's own weights, and the head (final norm + LM head).
`prefill` runs layers `0..L-1`; `run_prefix` runs `0..c-1` and returns the residual `h_c`;
`run_suffix` runs `c..L-1` from `h_c`; with `chunks=N` both `prefill` and `run_suffix` are chunked
prefills (token chunk i attends to chunks 0..i through a cache: `run_chunk`, `token_chunks`), the
reference of the chunked handoffs. Layer `l` runs the same executable on the same inputs in
all of them, so the recomputed suffix KV and logits are bitwise equal to a full prefill's by
construction (tested property). Nothing is sliced out of a weight stack, no loop hides a trip
count from the compiler (no host sync per layer on a GPU), and the number of compiled programs
does not depend on the cuts used.

Params are a plain pytree (`model.param_spec`: their layout, checks and initialization).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.model.layers import (
    Past,
    rms_norm,
    rope_tables,
    row_blocks,
    xla_attention,  # noqa: F401 (part of this module's API)
)
from rekv_jax.model.param_spec import (  # noqa: F401 (this module's API too)
    Params,
    attention_backend,
    check_params,
    check_tokens,
    choose_attention,
    init_params,
    layer_def,
)
from rekv_jax.sizes import attention_width, token_chunks  # noqa: F401 (this module's API too)


def _checked(cfg: ModelConfig, params: Params, tokens: jax.Array | None = None,
             cut: int | None = None, values: bool = True) -> ModelConfig:
    """Validate the inputs; return `cfg` with its attention backend resolved (a jit key)."""
    if cut is not None:
        cfg.check_cut(cut)
    check_params(cfg, params)
    if tokens is not None:
        check_tokens(cfg, tokens, values)
    return dataclasses.replace(cfg, attention=attention_backend(cfg, params["embed"].dtype))


# ---------------------------------------------------------------------------- the programs


def _layer(cfg: ModelConfig, weights: dict, x: jax.Array, positions: jax.Array,
           past: Past | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer on x [B, T, D] at positions [B, T] -> (x, k, v) (see DecoderLayer)."""
    with jax.named_scope("decoder_layer"):
        return nnx.merge(layer_def(cfg), weights)(x, rope_tables(cfg, positions), past)


def _logits(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """x [..., D] -> float32 logits [..., V] (final norm, then LM head)."""
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]  # [D, V]
    x = rms_norm(x, params["final_norm"]["weight"], cfg.rms_norm_eps)
    return jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)


@jax.jit
def _embed(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """Token ids [B, T] (or a decode step's [B]) -> x [B, T, D] ([B, 1, D])."""
    x = embed[tokens]
    return x if tokens.ndim == 2 else x[:, None]


# The one program of a layer in a prompt pass: every entry point runs layer l through it.
_prompt_layer = jax.jit(_layer, static_argnums=0)


@functools.partial(jax.jit, static_argnames=("cfg", "width"), donate_argnames=("k", "v"))
def _cache_layer(cfg: ModelConfig, weights: dict, x: jax.Array, k: jax.Array, v: jax.Array,
                 start: jax.Array, *, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer on x [B, T, D] at positions start..start+T-1 of this layer's cache k, v
    [B, C, K, H], donated: the new K/V are written in place; attention reads `width` positions."""
    B, T = x.shape[:2]
    positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    return _layer(cfg, weights, x, positions, (k, v, start, width))


@functools.partial(jax.jit, static_argnames=("cfg", "width"), donate_argnames=("k", "v"))
def _step_layer(cfg: ModelConfig, weights: dict, x: jax.Array, k: jax.Array, v: jax.Array,
                start: jax.Array, *, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer of a decode step: x [B, 1, D] at position `start` of this layer's cache k, v
    [B, C, K, H], donated; every dot on blocks of ROW_BLOCK rows (`row_blocks`), attention over
    `width` positions, as the paged step computes each request."""
    layer = nnx.merge(layer_def(cfg), weights)
    rope = rope_tables(cfg, jnp.full((x.shape[0], 1), start, jnp.int32))
    with jax.named_scope("decoder_layer"):
        q, new_k, new_v = row_blocks(
            lambda x, c, s: layer.attn.project(layer.input_norm(x), (c, s)), x, *rope)
        out, k, v = layer.attn.attend(q, new_k, new_v, (k, v, start, width))
        x = row_blocks(lambda x, o: layer.finish(x, layer.attn.output(o)), x, out)
    return x, k, v


@functools.partial(jax.jit, static_argnames="cfg")
def _step_head(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """A decode step's logits [B, V] f32 from x [B, 1, D], on blocks of ROW_BLOCK rows."""
    return row_blocks(lambda x: _logits(cfg, params, x[:, -1]), x)


@functools.partial(jax.jit, static_argnames=("cfg", "last"))
def _head(cfg: ModelConfig, params: Params, x: jax.Array, *, last: bool) -> jax.Array:
    """Logits [B, V] of the last position (`last`) or [B, T, V] of all, f32."""
    return _logits(cfg, params, x[:, -1] if last else x)


def _head_params(params: Params) -> Params:
    return {k: w for k, w in params.items() if k != "layers"}  # the head reads no layer


def _positions(shape: tuple[int, int], positions: jax.Array | None) -> jax.Array:
    """Positions [B, T] int32 (default 0..T-1), on the device once for all layers."""
    if positions is None:
        return jnp.asarray(np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape))
    return jnp.broadcast_to(jnp.asarray(positions, jnp.int32), shape)


def _run_layers(cfg: ModelConfig, params: Params, x: jax.Array, positions: jax.Array,
                first: int, stop: int) -> tuple[jax.Array, KVCache]:
    """Layers first..stop-1, one `_prompt_layer` call each: (x entering `stop`, their KV)."""
    keys, values = [], []
    for weights in params["layers"][first:stop]:
        x, k, v = _prompt_layer(cfg, weights, x, positions)  # k, v [B, T, K, H]
        keys.append(k)
        values.append(v)
    B, T = x.shape[:2]
    empty = None if keys else ((B, T, cfg.num_kv_heads, cfg.head_dim), np.dtype(x.dtype))
    return x, KVCache(tuple(keys), tuple(values), empty)


# ---------------------------------------------------------------------------- functional API


def prefill(cfg: ModelConfig, params: Params, tokens: jax.Array, chunks: int = 1
            ) -> tuple[KVCache, jax.Array]:
    """All L layers on tokens [B, S]: (KV [L, B, S, K, H], last-position logits [B, V] f32).
    `chunks` > 1: a chunked prefill, chunk i attending to chunks 0..i (`token_chunks`)."""
    cfg = _checked(cfg, params, tokens)
    if chunks > 1:
        return _chunked(cfg, params, tokens, 0, chunks)
    x = _embed(params["embed"], tokens)
    x, kv = _run_layers(cfg, params, x, _positions(tokens.shape, None), 0, cfg.num_layers)
    return kv, _head(cfg, _head_params(params), x, last=True)


def run_prefix(cfg: ModelConfig, params: Params, tokens: jax.Array, cut: int
               ) -> tuple[jax.Array, KVCache]:
    """Layers 0..cut-1: (h_c [B, S, D], the residual entering layer `cut`; KV [cut, B, S, K, H])."""
    cfg = _checked(cfg, params, tokens, cut)
    x = _embed(params["embed"], tokens)
    return _run_layers(cfg, params, x, _positions(tokens.shape, None), 0, cut)


def run_suffix(cfg: ModelConfig, params: Params, h_c: jax.Array, cut: int,
               positions: jax.Array | None = None, chunks: int = 1) -> tuple[KVCache, jax.Array]:
    """Layers cut..L-1 from h_c [B, S, D]: (KV [L-cut, B, S, K, H], last-position logits [B, V]).
    `chunks` > 1: a chunked prefill of the suffix at positions 0..S-1, with its own cache."""
    cfg = _checked(cfg, params, cut=cut)
    if h_c.ndim != 3 or h_c.shape[-1] != cfg.hidden_size:
        raise ValueError(f"h_c must be [B, S, {cfg.hidden_size}], got {h_c.shape}")
    if chunks > 1:
        if positions is not None:
            raise ValueError("a chunked suffix runs at positions 0..S-1: give no positions")
        return _chunked(cfg, params, h_c, cut, chunks)
    x, kv = _run_layers(cfg, params, h_c, _positions(h_c.shape[:2], positions), cut,
                        cfg.num_layers)
    return kv, _head(cfg, _head_params(params), x, last=True)


@dataclasses.dataclass(frozen=True)
class LayerPrograms:
    """One model's programs, its params checked once (`of`), for a caller that dispatches a
    pass one layer at a time (a reception's budgeted suffix): each call is one program, the
    one `prefill`, `run_suffix` and `run_chunk` run for that layer, so a pass assembled from
    them is theirs bit for bit."""

    cfg: ModelConfig  # its attention backend resolved
    params: Params

    @classmethod
    def of(cls, cfg: ModelConfig, params: Params) -> LayerPrograms:
        return cls(_checked(cfg, params), params)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token ids [B, T] -> x [B, T, D]."""
        return _embed(self.params["embed"], tokens)

    def positions(self, x: jax.Array) -> jax.Array:
        """Positions 0..T-1 [B, T] of x [B, T, ...] (a prompt pass's, on the device once)."""
        return _positions(x.shape[:2], None)

    def prompt(self, x: jax.Array, layer: int, positions: jax.Array
               ) -> tuple[jax.Array, KVCache]:
        """Layer `layer` of a prompt pass on x [B, T, D]: (x entering the next, its KV)."""
        return _run_layers(self.cfg, self.params, x, positions, layer, layer + 1)

    def chunk(self, x: jax.Array, kv: KVCache, layer: int, start: int
              ) -> tuple[jax.Array, KVCache]:
        """Layer `layer` of a chunked prefill: x [B, T, D] at start.. through its cache kv
        [1, B, C, K, H] (donated), as `run_chunk` runs it."""
        return _cache_layers(self.cfg, self.params, x, kv, layer, start)

    def head(self, x: jax.Array) -> jax.Array:
        """The last position's logits [B, V] f32 of x [B, T, D] (after the last layer)."""
        return _head(self.cfg, _head_params(self.params), x, last=True)


# ---------------------------------------------------------------------------- token chunks


def new_cache(cfg: ModelConfig, layers: int, batch: int, capacity: int, dtype: jnp.dtype
              ) -> KVCache:
    """An all-zero cache of `layers` layers [B, C, K, H] for a chunked prefill to write into."""
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    if not layers:
        return KVCache((), (), (shape, np.dtype(dtype)))
    return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(layers)))


def run_chunk(cfg: ModelConfig, params: Params, x: jax.Array, kv: KVCache, first: int,
              start: int) -> tuple[jax.Array, KVCache]:
    """One step of a chunked prefill: layers first..first+n-1 (n = kv.num_layers) on the chunk
    x [B, T, D] (token ids [B, T] when first is 0) at positions start..start+T-1, attending to
    the cache's positions before it. `kv` (capacity C) is donated; returns (x entering layer
    first+n, the updated cache). Steps over `token_chunks` are `run_suffix(chunks=N)` (from ids:
    `prefill(chunks=N)`), bitwise."""
    ids = x.ndim == 2
    cfg = _checked(cfg, params, x if ids else None)
    if not 0 <= first <= first + kv.num_layers <= cfg.num_layers or (ids and first):
        raise ValueError(f"layers {first}..{first + kv.num_layers - 1} are not in the model, "
                         f"or token ids do not enter layer {first}")
    if ids:
        x = _embed(params["embed"], x)  # [B, T, D]
    return _cache_layers(cfg, params, x, kv, first, start)


def _cache_layers(cfg: ModelConfig, params: Params, x: jax.Array, kv: KVCache, first: int,
                  start: int | jax.Array, width: int | None = None, step: bool = False
                  ) -> tuple[jax.Array, KVCache]:
    """Layers first..first+n-1 on x [B, T, D] at start.. of kv [n, B, C, K, H] (donated), one
    `_cache_layer` call each (a decode `step`: `_step_layer`); attention reads `width` positions
    (default its bucket)."""
    T, C = x.shape[1], kv.seq_len
    width = attention_width(int(start) + T, C) if width is None else width
    start = np.int32(start) if isinstance(start, int | np.integer) else start
    program = _step_layer if step else _cache_layer
    keys, vals = [], []
    for weights, k, v in zip(params["layers"][first:first + kv.num_layers], kv.keys, kv.values,
                             strict=True):
        x, k, v = program(cfg, weights, x, k, v, start, width=width)  # k, v [B, C, K, H]
        keys.append(k)
        vals.append(v)
    return x, KVCache(tuple(keys), tuple(vals), kv.empty, kv.bits)


def _chunked(cfg: ModelConfig, params: Params, inputs: jax.Array, first: int, chunks: int
             ) -> tuple[KVCache, jax.Array]:
    """A chunked prefill of layers first..L-1 on token ids [B, S] (first 0) or a residual
    [B, S, D]: (KV [L-first, B, S, K, H], last-position logits [B, V])."""
    B, S = inputs.shape[:2]
    dtype = params["embed"].dtype
    kv = new_cache(cfg, cfg.num_layers - first, B, S, dtype)
    x = inputs
    for start, stop in token_chunks(S, chunks):
        x, kv = run_chunk(cfg, params, inputs[:, start:stop], kv, first, start)
    return kv, _head(cfg, _head_params(params), x, last=True)


def run_layers(cfg: ModelConfig, params: Params, x: jax.Array, first: int, stop: int,
               positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Layers first..stop-1 on the residual x [B, S, D]: (x entering layer `stop`, KV
    [stop-first, B, S, K, H]). Steps chained after `run_prefix` equal `prefill` bitwise."""
    if not 0 <= first <= stop <= cfg.num_layers:
        raise ValueError(f"need 0 <= first <= stop <= {cfg.num_layers}, got {first}, {stop}")
    cfg = _checked(cfg, params)
    if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x must be [B, S, {cfg.hidden_size}], got {x.shape}")
    return _run_layers(cfg, params, x, _positions(x.shape[:2], positions), first, stop)


def _extend(cfg: ModelConfig, params: Params, kv: KVCache, tokens: jax.Array, start: int,
            step: bool) -> tuple[jax.Array, KVCache]:
    """`extend` on tokens [B, T]; a decode `step` takes tokens [B] (values unchecked: no host
    pull) and returns the logits [B, V], without an op outside the programs."""
    if step and (tokens.ndim != 1 or not jnp.issubdtype(tokens.dtype, jnp.integer)):
        raise ValueError(f"token must be integer ids [B], got {tokens.dtype}{tokens.shape}")
    cfg = _checked(cfg, params, None if step else tokens)
    if kv.num_layers != cfg.num_layers:
        raise ValueError(f"cache holds {kv.num_layers} layers, the model has {cfg.num_layers}")
    T, C = 1 if step else tokens.shape[1], kv.seq_len
    concrete = isinstance(start, int | np.integer)
    if concrete and not 0 <= start <= C - T:
        raise ValueError(f"start={start} + {T} tokens does not fit a cache of capacity {C}; grow "
                         "it with KVCache.pad")
    x = _embed(params["embed"], tokens)  # [B, T, D]
    x, kv = _cache_layers(cfg, params, x, kv, 0, start, None if concrete else C, step)
    head = _head_params(params)
    return (_step_head(cfg, head, x) if step else _head(cfg, head, x, last=False)), kv


def extend(cfg: ModelConfig, params: Params, kv: KVCache, tokens: jax.Array, start: int
           ) -> tuple[jax.Array, KVCache]:
    """Run tokens [B, T] at positions start..start+T-1 on a cache of capacity C >= start + T.

    Returns (logits [B, T, V] f32, the cache with the new K/V written in). The cache's buffers
    are donated (updated in place): `kv` is unusable afterwards, use the returned cache. Entries
    of `kv` at or after `start` are ignored (masked), so a cache padded with `KVCache.pad` can be
    reused step after step, one compiled program per attention bucket (`attention_width`).
    """
    return _extend(cfg, params, kv, tokens, start, step=False)


def decode_step(cfg: ModelConfig, params: Params, kv: KVCache, token: jax.Array, position: int
                ) -> tuple[jax.Array, KVCache]:
    """One autoregressive step: token [B] at `position` -> (logits [B, V] f32, updated cache).
    `kv` is donated (see `extend`); the token's value is not checked (no host pull per step)."""
    return _extend(cfg, params, kv, token, position, step=True)


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens]  # [B, S, D]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    for weights in params["layers"]:  # one fused, differentiable program
        x, _, _ = _layer(cfg, weights, x, positions)
    return _logits(cfg, params, x)


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits at every position [B, S, V] f32 (training and teacher-forced scoring)."""
    return _forward(_checked(cfg, params, tokens), params, tokens)


@jax.jit
def greedy_token(logits: jax.Array) -> jax.Array:
    """The greedy token of each row of logits [B, V]: their argmax [B] int32."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def greedy_tokens(cfg: ModelConfig, params: Params, kv: KVCache, token: jax.Array, steps: int,
                  capacity: int | None = None) -> Iterator[jax.Array]:
    """`steps` greedy tokens [B], `token` first, continuing a prompt cache [L, B, S, K, H], each
    yielded as soon as it is dispatched (the next step runs once the caller asks for it). The
    steps decode on a copy padded to `capacity` (default: the power of two covering S + steps,
    so that every step attends over its whole bucket, `attention_width`, as a paged step does:
    a step's bits then do not depend on how many tokens were asked for)."""
    S = kv.seq_len
    kv = kv.pad(capacity or attention_width(S + steps, 2 * (S + steps))).held_as_bits()
    for i in range(steps):
        yield token
        if i + 1 < steps:  # the last token needs no step of its own
            logits, kv = decode_step(cfg, params, kv, token, S + i)
            token = greedy_token(logits)


def greedy_decode(cfg: ModelConfig, params: Params, kv: KVCache, logits: jax.Array, steps: int
                  ) -> jax.Array:
    """Greedy tokens [B, steps] after a prompt cache [L, B, S, K, H] and its last logits [B, V].
    `kv` stays usable: the steps decode on a padded copy."""
    first = greedy_token(logits)
    return jnp.stack(list(greedy_tokens(cfg, params, kv, first, steps)), axis=1)
