"""The decoder layer of Qwen2 / Qwen3 / Llama in Flax NNX (attention, MLP, norms, RoPE).

`rekv_jax.model` compiles one program per layer shape and mode from `DecoderLayer` and runs the
stack as a Python composition of those programs (see its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rekv_jax.config import ModelConfig

# One layer's cache: k, v [B, C, K, H], the write offset `start` (int32 scalar) and the static
# number of cache positions attention reads (`width`, start + T <= width <= C)
Past = tuple[jax.Array, jax.Array, jax.Array, int]
INIT = nnx.initializers.normal(0.02)
# Rows of every dot in a decode step (R): a step's batch runs in blocks of exactly R rows
ROW_BLOCK = 8


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] * rsqrt(mean(x^2) + eps) in float32, cast back, times weight [D]."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(INIT(rngs.params(), shape, dtype))


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
        """x [B, T, D] -> (out [B, T, D], k, v): k/v [B, T, K, H], or with a past the updated
        cache [B, C, K, H] (attention reads its first `width` positions only)."""
        out, k, v = self.attend(*self.project(x, rope), past)
        return self.output(out), k, v  # [B, T, D]

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, past: Past | None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of q [B, T, N, H] over this step's k, v [B, T, K, H] (and, with a past, the
        cache they are written into) -> (out [B, T, N, H], k, v as `__call__` returns them)."""
        start, seen_k, seen_v = 0, k, v
        if past is not None:  # write at `start` into a capacity-C cache (in place when donated)
            past_k, past_v, start, width = past
            k, seen_k = write_positions(past_k, k, start, width)  # [B, C, K, H], [B, W, K, H]
            v, seen_v = write_positions(past_v, v, start, width)
        mask = causal_mask(start, q.shape[1], seen_k.shape[1])  # [T, W]
        # `attention` is concrete here (the public functions resolve `auto`)
        if self.cfg.attention != "cudnn":
            return xla_attention(q, seen_k, seen_v, mask), k, v  # [B, T, N, H]
        if past is None:  # causal prompt: cuDNN's CAUSAL mask type, never a materialized mask
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation="cudnn"), k, v
        # cuDNN adds the [T, W] mask as a bias (flash-capable): its causal mask is top-left
        # aligned, so it cannot express the offset `start` (see docs/gpu.md)
        return jax.nn.dot_product_attention(q, seen_k, seen_v, mask=mask[None, None],
                                            implementation="cudnn"), k, v

    def project(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> q [B, T, N, H] and this step's k, v [B, T, K, H], after RoPE."""
        q = jnp.einsum("btd,dnh->btnh", x, self.q_proj[...])  # [B, T, N, H]
        k = jnp.einsum("btd,dkh->btkh", x, self.k_proj[...])  # [B, T, K, H]
        v = jnp.einsum("btd,dkh->btkh", x, self.v_proj[...])  # [B, T, K, H]
        if self.cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def output(self, out: jax.Array) -> jax.Array:
        """Attention's heads out [B, T, N, H] -> [B, T, D] (the output projection)."""
        return jnp.einsum("btnh,nhd->btd", out, self.o_proj[...])


def bits_of(x: jax.Array) -> jax.Array:
    """x's raw bits: the unsigned ints of its width (a view, no rounding)."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


def write_positions(cache: jax.Array, new: jax.Array, start: int | jax.Array, width: int
                    ) -> tuple[jax.Array, jax.Array]:
    """Write new [B, T, K, H] at positions start.. of cache [B, C, K, H] -> (the cache, its first
    `width` positions [B, W, K, H] as new's dtype). A cache of unsigned ints holds the raw bits
    of new's dtype (`KVCache.held_as_bits`): XLA:CPU writes into a 16-bit float array by
    converting all of it to float32 and back, a cost that grows with the capacity, and into an
    integer array in place."""
    if cache.dtype == new.dtype:
        cache = jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=1)
        return cache, cache[:, :width]
    cache = jax.lax.dynamic_update_slice_in_dim(cache, bits_of(new), start, axis=1)
    return cache, jax.lax.bitcast_convert_type(cache[:, :width], new.dtype)


def row_blocks(f: Callable, *xs: jax.Array):
    """f on blocks of ROW_BLOCK rows: xs [B, ...] -> f's outputs [B, ...], f seeing [R, ...]
    (B padded with zero rows to a multiple of R; more than R rows run as a loop over blocks).

    XLA:CPU gives a dot's row other bits as the row count M changes (M = 1 runs XLA's own
    matrix-vector code, M >= 2 YNNPACK's tiled kernels, whose bits change again with M); at a
    fixed M a row's result depends neither on its slot nor on the other rows (the tests check
    it). So every dot of a decode step runs at M = R whatever the batch: a request's bits never
    depend on what shares its step, and a batch of one is padded like any other."""
    B, R = xs[0].shape[0], ROW_BLOCK
    n = -(-B // R)
    blocks = [jnp.pad(x, [(0, n * R - B)] + [(0, 0)] * (x.ndim - 1)).reshape(n, R, *x.shape[1:])
              for x in xs]
    if n == 1:
        out = jax.tree.map(lambda y: y[None], f(*(b[0] for b in blocks)))
    else:
        out = jax.lax.map(lambda b: f(*b), blocks)
    return jax.tree.map(lambda y: y.reshape(n * R, *y.shape[2:])[:B], out)


def causal_mask(start: int | jax.Array, tokens: int, width: int) -> jax.Array:
    """[T, W] bool: token t, at position start + t, sees cache positions 0..start+t."""
    return jnp.arange(width)[None, :] <= start + jnp.arange(tokens)[:, None]


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
        return self.finish(x, attn_out), k, v

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        """The rest of the block after attention: x [B, T, D] + attn_out, then + its MLP."""
        x = x + attn_out
        with jax.named_scope("mlp"):
            return x + self.mlp(self.post_attn_norm(x))


# ---------------------------------------------------------------------------- RoPE


def inverse_frequencies(cfg: ModelConfig, dtype: np.dtype = np.float32) -> np.ndarray:
    """RoPE inverse frequencies [H/2] (computed in float64, returned as `dtype`: float32 is what
    the model rotates by), with Llama-3.1 rescaling when configured."""
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
    return inv.astype(dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> (cos, sin), each [B, T, 1, H/2] float32."""
    angles = positions[..., None].astype(jnp.float32) * inverse_frequencies(cfg)  # [B, T, H/2]
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention) on x [B, T, n, H], computed in float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, n, H/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
