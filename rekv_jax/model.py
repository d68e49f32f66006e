"""Qwen2 / Qwen3 / Llama decoder in Flax NNX, split at a static layer cut (paper §2.2, §2.4).

The layer stack is stored stacked (`[L, ...]` leaves, or `[1, ...]` when every layer shares one
set of weights) and run with one `lax.while_loop` whose body is the same program for every entry
point.
`prefill` runs layers `0..L-1`; `run_prefix` runs `0..c-1` and returns the residual `h_c`;
`run_suffix` runs `c..L-1` from `h_c`. Because the loop's trip count is hidden from XLA and each
layer is fenced by optimization barriers, XLA compiles the per-layer computation identically in
all three, so the recomputed suffix KV and logits are bitwise equal to a full prefill's (tested
property).

Params are a plain nested dict of arrays (`nnx.to_pure_dict` of the `Transformer` state), so
they work with optax, orbax and tree utilities directly; the functions below `nnx.merge` them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rekv_jax.config import ATTENTION_BACKENDS, ATTENTION_ENV, ModelConfig
from rekv_jax.kv import KVCache

Params = dict  # nested dict of arrays, the pure-dict state of `Transformer`
Past = tuple[jax.Array, jax.Array, jax.Array]  # one layer's cache k, v [B, C, K, H] and start
_INIT = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(_INIT(rngs.params(), shape, dtype))


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _param(rngs, (D, N, H), dtype)
        self.k_proj = _param(rngs, (D, K, H), dtype)
        self.v_proj = _param(rngs, (D, K, H), dtype)
        self.o_proj = _param(rngs, (N, H, D), dtype)
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((N, H), dtype))
            self.k_bias = nnx.Param(jnp.zeros((K, H), dtype))
            self.v_bias = nnx.Param(jnp.zeros((K, H), dtype))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.cfg = cfg

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], past: Past | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> (out [B, T, D], k, v): k/v [B, T, K, H], or [B, C, K, H] with a past."""
        q = jnp.einsum("btd,dnh->btnh", x, self.q_proj[...])  # [B, T, N, H]
        k = jnp.einsum("btd,dkh->btkh", x, self.k_proj[...])  # [B, T, K, H]
        v = jnp.einsum("btd,dkh->btkh", x, self.v_proj[...])  # [B, T, K, H]
        if self.cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        start = 0
        if past is not None:  # write at `start` into a capacity-C cache
            past_k, past_v, start = past
            k = jax.lax.dynamic_update_slice_in_dim(past_k, k, start, axis=1)  # [B, C, K, H]
            v = jax.lax.dynamic_update_slice_in_dim(past_v, v, start, axis=1)  # [B, C, K, H]
        T, C = q.shape[1], k.shape[1]
        mask = jnp.arange(C)[None, :] <= start + jnp.arange(T)[:, None]  # [T, C]: t sees 0..start+t
        # `attention` is concrete here (the public functions resolve `auto`)
        if self.cfg.attention != "cudnn":
            out = xla_attention(q, k, v, mask)  # [B, T, N, H]
        elif past is None:  # causal prompt: cuDNN's CAUSAL mask type, never a materialized mask
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:  # cuDNN adds the [T, C] mask as a bias (flash-capable): its causal mask is top-left
            # aligned, so it cannot express the offset `start` (see the README)
            out = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None],
                                               implementation="cudnn")
        return jnp.einsum("btnh,nhd->btd", out, self.o_proj[...]), k, v  # [B, T, D]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention in plain XLA: q [B, T, N, H], k/v [B, S, K, H], mask [T, S] ->
    [B, T, N, H]; scores and softmax in float32.

    Bitwise what `jax.nn.dot_product_attention(implementation="xla")` computes on CPU, without
    its explicit BF16_BF16_F32 dot algorithm, which XLA:CPU cannot compile once the score dot
    degenerates to a vector product (one query, one key, one head per device: a 1-token prompt).
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]: the G query heads of each KV head
    # [B, K, G, T, S]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * np.float32(H ** -0.5), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, S]
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, N, H)  # [B, T, N, H]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _param(rngs, (D, F), dtype)
        self.up_proj = _param(rngs, (D, F), dtype)
        self.down_proj = _param(rngs, (F, D), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.einsum("btd,df->btf", x, self.gate_proj[...])  # [B, T, F]
        up = jnp.einsum("btd,df->btf", x, self.up_proj[...])  # [B, T, F]
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.down_proj[...])  # [B, T, D]


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); also returns this layer's K, V."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, rngs, dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, rngs, dtype)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], past: Past | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        with jax.named_scope("attn"):  # profile labels: decoder_layer/attn, decoder_layer/mlp
            attn_out, k, v = self.attn(self.input_norm(x), rope, past)
        x = x + attn_out
        with jax.named_scope("mlp"):
            return x + self.mlp(self.post_attn_norm(x)), k, v


class Transformer(nnx.Module):
    """Embedding, a stacked layer stack (`[L]` or shared `[1]`), final norm, LM head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.bfloat16,
                 repeat_layers: bool = False):
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # [V, D]

        @nnx.split_rngs(splits=1 if repeat_layers else cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, rngs, dtype)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)  # [D, V]
        self.cfg = cfg

    def run_layers(self, x: jax.Array, positions: jax.Array, first: int, stop: int,
                   past: KVCache | None = None, differentiable: bool = False
                   ) -> tuple[jax.Array, KVCache]:
        """Layers `first..stop-1` on x [B, T, D] at `positions` [B, T]; returns their K/V.

        With `past` (a capacity-C cache of all layers) the new K/V are written at `positions[0, 0]`
        and the returned cache is the updated one. `differentiable` (training) runs the same body
        with static loop bounds, which reverse-mode differentiation needs.
        """
        layer_def, stacked = nnx.split(self.layers)
        shared = jax.tree.leaves(stacked)[0].shape[0] == 1
        rope = rope_tables(self.cfg, positions)
        B, T, _ = x.shape
        S = T if past is None else past.seq_len
        n = stop - first
        kv_shape = (n, B, S, self.cfg.num_kv_heads, self.cfg.head_dim)  # [n, B, S, K, H]
        if n == 0:  # cut 0 prefix / cut L suffix: no layer to run
            return x, KVCache(jnp.zeros(kv_shape, x.dtype), jnp.zeros(kv_shape, x.dtype))
        # The loop bounds are hidden from XLA, so it can neither inline a 1-trip loop nor unroll
        # a short one: every entry point runs the same compiled loop body, whatever its length.
        first_layer, count = jax.lax.optimization_barrier((jnp.int32(first), jnp.int32(n)))

        def body(carry):
            i, x, ks, vs = carry
            layer = first_layer + i
            weights = jax.tree.map(lambda w: w[0 if shared else layer], stacked)
            layer_past = None if past is None else (past.k[layer], past.v[layer], positions[0, 0])
            # The barriers fence one layer: XLA cannot fuse it with its neighbours (embedding,
            # head), so each entry point computes it identically, bit for bit.
            x, weights, layer_rope, layer_past = jax.lax.optimization_barrier(
                (x, weights, rope, layer_past))
            with jax.named_scope("decoder_layer"):  # one loop body serves every layer
                x, k, v = nnx.merge(layer_def, weights)(x, layer_rope, layer_past)
            x, k, v = jax.lax.optimization_barrier((x, k, v))
            ks = jax.lax.dynamic_update_index_in_dim(ks, k, i, axis=0)
            vs = jax.lax.dynamic_update_index_in_dim(vs, v, i, axis=0)
            return i + 1, x, ks, vs

        empty = jnp.zeros(kv_shape, x.dtype)
        init = (jnp.int32(0), x, empty, empty)
        if differentiable:
            _, x, k, v = jax.lax.fori_loop(0, n, lambda _, c: body(c), init)
        else:
            _, x, k, v = jax.lax.while_loop(lambda c: c[0] < count, body, init)
        return x, KVCache(k, v)

    def logits(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> float32 logits [..., V] (final norm, then LM head)."""
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]  # [D, V]
        return jnp.einsum("...d,dv->...v", self.final_norm(x), head,
                          preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------- RoPE


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [H/2] (float32), with Llama-3.1 rescaling when configured."""
    H = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    s = cfg.rope_scaling
    if s is not None:
        wavelen = 2 * math.pi / inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)
    return inv.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> (cos, sin), each [B, T, 1, H/2] float32."""
    angles = positions[..., None].astype(jnp.float32) * inverse_frequencies(cfg)  # [B, T, H/2]
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention) on x [B, T, n, H], computed in float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, n, H/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ---------------------------------------------------------------------------- functional API


@functools.lru_cache(maxsize=64)
def _graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))[0]


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
    """{"layers/attn/q_proj": shape, ...} for a nested dict of arrays."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(x.shape) for p, x in leaves}


@functools.lru_cache(maxsize=64)
def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return _shapes(nnx.to_pure_dict(nnx.state(abstract)))


def _model(cfg: ModelConfig, params: Params) -> Transformer:
    return nnx.merge(_graphdef(cfg), params)


def check_params(cfg: ModelConfig, params: Params) -> None:
    """Raise ValueError unless `params` has exactly the entries and shapes `cfg` implies."""
    expected = _expected_shapes(cfg)
    try:
        got = _shapes(params)
    except AttributeError:
        raise ValueError("params must be a nested dict of arrays (see init_params)") from None
    if got.keys() != expected.keys():
        raise ValueError(f"params do not match config {cfg.name!r}: missing "
                         f"{sorted(expected.keys() - got.keys())}, unexpected "
                         f"{sorted(got.keys() - expected.keys())}")
    stacks = {shape[0] for name, shape in got.items() if name.startswith("layers/")}
    if len(stacks) != 1 or not stacks <= {1, cfg.num_layers}:
        raise ValueError(f"layer stack sizes {sorted(stacks)} must all be {cfg.num_layers} "
                         "(or 1 for weights shared by every layer)")
    for name, want in expected.items():
        have = got[name]
        if name.startswith("layers/"):
            want, have = want[1:], have[1:]
        if want != have:
            raise ValueError(f"params[{name}] has shape {have}, config {cfg.name!r} needs {want}")


def check_tokens(cfg: ModelConfig, tokens: jax.Array) -> None:
    """Raise ValueError unless tokens are int ids [B, S] in 0..V-1 (values checked if concrete)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers [B, S], got {tokens.dtype}{tokens.shape}")
    if tokens.shape[1] == 0:
        raise ValueError("tokens must hold at least one position")
    if not isinstance(tokens, jax.core.Tracer):
        host = np.asarray(tokens)
        if host.min() < 0 or host.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be in 0..{cfg.vocab_size - 1}, got range "
                             f"{host.min()}..{host.max()}")


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16,
                repeat_layers: bool = False) -> Params:
    """Synthetic weights (N(0, 0.02), unit norms); `repeat_layers` shares one layer's weights."""

    @jax.jit
    def make(key):
        model = Transformer(cfg, nnx.Rngs(key), dtype, repeat_layers)
        return nnx.to_pure_dict(nnx.state(model))

    return make(key)


def choose_attention(requested: str, platform: str, dtype: jnp.dtype) -> str:
    """The concrete attention backend (`xla` or `cudnn`) for a request on a platform and dtype.

    `auto`: cuDNN flash attention on a GPU for bf16/f16 (it refuses float32), XLA otherwise.
    `cudnn` where it cannot run is a ValueError with the reason, not a JAX traceback.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; expected one of "
                         f"{ATTENTION_BACKENDS}")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if requested == "auto":
        return "cudnn" if platform == "gpu" and half else "xla"
    if requested == "cudnn" and not (platform == "gpu" and half):
        raise ValueError(f"attention backend 'cudnn' needs a CUDA GPU and bfloat16/float16 "
                         f"weights; here: {platform}, {jnp.dtype(dtype).name} (use xla or auto)")
    return requested


def attention_backend(cfg: ModelConfig, dtype: jnp.dtype) -> str:
    """The backend this process runs `cfg` with: `cfg.attention`, else $REKV_ATTENTION, else
    `auto`, resolved for this process's platform and the weights' dtype."""
    requested = cfg.attention if cfg.attention != "auto" else os.environ.get(ATTENTION_ENV, "auto")
    return choose_attention(requested, jax.default_backend(), dtype)


def _checked(cfg: ModelConfig, params: Params, tokens: jax.Array | None = None,
             cut: int | None = None) -> ModelConfig:
    """Validate the inputs; return `cfg` with its attention backend resolved (a jit key)."""
    if cut is not None:
        cfg.check_cut(cut)
    check_params(cfg, params)
    if tokens is not None:
        check_tokens(cfg, tokens)
    return dataclasses.replace(cfg, attention=attention_backend(cfg, params["embed"].dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "first", "stop", "head", "differentiable"))
def _run(cfg: ModelConfig, params: Params, inputs: jax.Array, start: jax.Array,
         positions: jax.Array | None = None, past: KVCache | None = None, *, first: int,
         stop: int, head: str, differentiable: bool = False) -> tuple[jax.Array, KVCache]:
    """The one jitted entry: layers `first..stop-1`, then the head; returns (out, KV).

    `inputs` are token ids [B, T] (embedded here) or a residual [B, T, D]; positions default to
    `start..start+T-1`. `head`: "last" (logits [B, V] of the last position), "all" ([B, T, V]) or
    "none" (the residual leaving layer `stop - 1`, i.e. `h_stop`).
    """
    model = _model(cfg, params)
    x = model.embed[...][inputs] if jnp.issubdtype(inputs.dtype, jnp.integer) else inputs
    B, T = inputs.shape[:2]
    if positions is None:
        positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    x, kv = model.run_layers(x, positions, first, stop, past, differentiable)
    out = {"last": lambda: model.logits(x[:, -1]), "all": lambda: model.logits(x),
           "none": lambda: x}[head]()
    return out, kv


_ZERO = np.int32(0)


def prefill(cfg: ModelConfig, params: Params, tokens: jax.Array) -> tuple[KVCache, jax.Array]:
    """All L layers on tokens [B, S]: (KV [L, B, S, K, H], last-position logits [B, V] f32)."""
    cfg = _checked(cfg, params, tokens)
    logits, kv = _run(cfg, params, tokens, _ZERO, first=0, stop=cfg.num_layers, head="last")
    return kv, logits


def run_prefix(cfg: ModelConfig, params: Params, tokens: jax.Array, cut: int
               ) -> tuple[jax.Array, KVCache]:
    """Layers 0..cut-1: (h_c [B, S, D], the residual entering layer `cut`; KV [cut, B, S, K, H])."""
    cfg = _checked(cfg, params, tokens, cut)
    return _run(cfg, params, tokens, _ZERO, first=0, stop=cut, head="none")


def run_suffix(cfg: ModelConfig, params: Params, h_c: jax.Array, cut: int,
               positions: jax.Array | None = None) -> tuple[KVCache, jax.Array]:
    """Layers cut..L-1 from h_c [B, S, D]: (KV [L-cut, B, S, K, H], last-position logits [B, V])."""
    cfg = _checked(cfg, params, cut=cut)
    if h_c.ndim != 3 or h_c.shape[-1] != cfg.hidden_size:
        raise ValueError(f"h_c must be [B, S, {cfg.hidden_size}], got {h_c.shape}")
    if positions is not None:
        positions = jnp.broadcast_to(positions, h_c.shape[:2])
    logits, kv = _run(cfg, params, h_c, _ZERO, positions, first=cut, stop=cfg.num_layers,
                      head="last")
    return kv, logits


def run_layers(cfg: ModelConfig, params: Params, x: jax.Array, first: int, stop: int,
               positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Layers first..stop-1 on the residual x [B, S, D]: (x entering layer `stop`, KV
    [stop-first, B, S, K, H]). Steps chained after `run_prefix` equal `prefill` bitwise."""
    if not 0 <= first <= stop <= cfg.num_layers:
        raise ValueError(f"need 0 <= first <= stop <= {cfg.num_layers}, got {first}, {stop}")
    cfg = _checked(cfg, params)
    if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x must be [B, S, {cfg.hidden_size}], got {x.shape}")
    if positions is not None:
        positions = jnp.broadcast_to(positions, x.shape[:2])
    return _run(cfg, params, x, _ZERO, positions, first=first, stop=stop, head="none")


def extend(cfg: ModelConfig, params: Params, kv: KVCache, tokens: jax.Array, start: int
           ) -> tuple[jax.Array, KVCache]:
    """Run tokens [B, T] at positions start..start+T-1 on a cache of capacity C >= start + T.

    Returns (logits [B, T, V] f32, the cache with the new K/V written in). Entries of `kv` at
    or after `start` are ignored (masked), so a cache padded with `KVCache.pad` can be reused
    step after step with one compiled program.
    """
    cfg = _checked(cfg, params, tokens)
    if kv.num_layers != cfg.num_layers:
        raise ValueError(f"cache holds {kv.num_layers} layers, the model has {cfg.num_layers}")
    if isinstance(start, int) and not 0 <= start <= kv.seq_len - tokens.shape[1]:
        raise ValueError(f"start={start} + {tokens.shape[1]} tokens does not fit a cache of "
                         f"capacity {kv.seq_len}; grow it with KVCache.pad")
    return _run(cfg, params, tokens, jnp.asarray(start, jnp.int32), past=kv, first=0,
                stop=cfg.num_layers, head="all")


def decode_step(cfg: ModelConfig, params: Params, kv: KVCache, token: jax.Array, position: int
                ) -> tuple[jax.Array, KVCache]:
    """One autoregressive step: token [B] at `position` -> (logits [B, V] f32, updated cache)."""
    logits, kv = extend(cfg, params, kv, token[:, None], position)
    return logits[:, 0], kv


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits at every position [B, S, V] f32 (training and teacher-forced scoring)."""
    cfg = _checked(cfg, params, tokens)
    return _run(cfg, params, tokens, _ZERO, first=0, stop=cfg.num_layers, head="all",
                differentiable=True)[0]


def greedy_decode(cfg: ModelConfig, params: Params, kv: KVCache, logits: jax.Array, steps: int
                  ) -> jax.Array:
    """Greedy tokens [B, steps] after a prompt cache [L, B, S, K, H] and its last logits [B, V]."""
    S = kv.seq_len
    kv = kv.pad(S + steps)
    tokens = []
    for i in range(steps):
        tokens.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        if i + 1 < steps:  # the last token needs no step of its own
            logits, kv = decode_step(cfg, params, kv, tokens[-1], S + i)
    return jnp.stack(tokens, axis=1)
