"""Prefix formats: the keys of a Q8/Q4 prefix transformed around the paper's group quantizer
(the `FORMAT` of `PREC:CUT/FORMAT`, `action.PREFIX_FORMATS`), and each format's error bound.

The paper's format quantizes keys `[n, B, S, K, H]` in groups of 64 along head_dim, so a group
is one head of one token: one channel far larger than the others (Qwen2/Qwen2.5's k_proj bias at
its boundary layers) sets the group's scale, and at 4 bits the rest of the head rounds to zero.
The transforms (`action.Transform`), applied in this order before quantizing and undone in the
reverse order after restoring:
  * debias: `K - RoPE(b_k, pos)` in float32. `K = RoPE(x W_k + b_k) = RoPE(x W_k) + RoPE(b_k)`,
    and both sides hold the weights and know the positions, so the bias costs no byte on the
    wire; the decode side adds `RoPE(b_k, pos)` back in float32 and casts once.
  * hadamard: each 64-channel group of a key times the normalized Hadamard matrix (entries
    +-1/8; symmetric and orthogonal, so its own inverse), in float32: one large channel is spread
    over all 64.
  * per-channel: keys regrouped so that a group is 64 consecutive tokens of one channel (KIVI's
    key grouping): codes `[n, B, G, K, H, 64 b/8]`, scales `[n, B, G, K, H, 1]` with
    `G = ceil(S / 64)`. A last, partial group is padded with zero tokens (they change no group's
    max) that the decode side drops (`sizes.key_tokens`).
Values always travel in the paper's format. The quantizer (`rekv_jax.quantize`: the Pallas
kernels on a GPU, the XLA reference elsewhere) runs unchanged, with its contract, on the
transformed keys: the forward transform is one jitted program before it and the inverse one
after the dequantizer, all on the device (no host round trip).

What debias needs beyond the keys is where the payload sits in the cache: its first layer
(`layer`: 0 for a whole prefix or a token chunk, the layer itself for a streamed one) and its
first token's position (`start`: 0, or a token chunk's first token). `PrefixCodec` holds the rest:
every layer's k_proj bias and the model's RoPE.

`key_error_bound` bounds |restored - K| per element for every format, in float64 from the
reference keys and the bias alone (numpy; none of the jitted code here), as
`quantize.error_bound` does the paper's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.action import PAPER, Action, Transform, transforms_of
from rekv_jax.config import ModelConfig
from rekv_jax.model.layers import apply_rope, inverse_frequencies, rope_tables
from rekv_jax.model.transformer import Params
from rekv_jax.quantize import (
    QuantizedTensor,
    code_error,
    dequantize,
    quantize_unchecked,
    quantized_specs,
)
from rekv_jax.sizes import GROUP_SIZE, key_tokens

DEBIAS, HADAMARD, PER_CHANNEL = Transform.DEBIAS, Transform.HADAMARD, Transform.PER_CHANNEL
_ARITHMETIC = frozenset({DEBIAS, HADAMARD})  # transforms computed in float32
_U = 2.0**-24  # unit roundoff of float32


def _sylvester(n: int) -> np.ndarray:
    """The n x n Hadamard matrix of +-1 (n a power of two), Sylvester's construction."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


# The normalized 64 x 64 Hadamard matrix: entries +-1/8, exact in float32
HADAMARD_64 = (_sylvester(GROUP_SIZE) / np.sqrt(GROUP_SIZE)).astype(np.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key_bias"],
                   meta_fields=["bits", "format", "cfg"])
@dataclasses.dataclass(frozen=True)
class PrefixCodec:
    """How one action's prefix is encoded: its precision and format and, for a debiased one,
    the model (whose RoPE the bias is rotated by) and every layer's k_proj bias."""

    bits: int
    format: str = PAPER
    cfg: ModelConfig | None = None  # debias only
    key_bias: jax.Array | None = None  # debias only: [L, K, H] float32

    @classmethod
    def of(cls, cfg: ModelConfig, params: Params, action: Action) -> PrefixCodec:
        """The codec of `action` for a model; debias needs a model with a k_proj bias."""
        if DEBIAS not in action.transforms:
            return cls(action.bits, action.format)
        if not cfg.qkv_bias:
            raise ValueError(f"prefix format {action.format!r} takes the k_proj bias out of the "
                             f"keys; {cfg.name} has no k_proj bias")
        bias = jnp.stack([layer["attn"]["k_bias"] for layer in params["layers"]])
        return cls(action.bits, action.format, cfg, bias.astype(jnp.float32))

    @property
    def transforms(self) -> frozenset[Transform]:
        return transforms_of(self.format)

    def encode_keys(self, k: jax.Array, layer: jax.Array, start: jax.Array, backend: str
                    ) -> QuantizedTensor:
        """One layer's keys [B, T, K, H] (layer `layer`, first token at position `start`), in
        the format, quantized (traceable: the finiteness of its scales is the caller's)."""
        if self.format == PAPER:
            return quantize_unchecked(k, self.bits, GROUP_SIZE, backend=backend)
        x = _forward(k[None], self.key_bias, layer, start, cfg=self.cfg, parts=self.transforms)
        return quantize_unchecked(x[0], self.bits, GROUP_SIZE, backend=backend)

    def decode_keys(self, codes: jax.Array, scales: jax.Array, seq_len: int, dtype: jnp.dtype,
                    layer: jax.Array, start: jax.Array, backend: str) -> jax.Array:
        """Inverse of `encode_keys`: one layer's keys [B, seq_len, K, H] in `dtype`."""
        parts = self.transforms
        inner = jnp.float32 if parts & _ARITHMETIC else dtype
        y = dequantize(QuantizedTensor(codes, scales, self.bits, GROUP_SIZE, inner),
                       backend=backend)
        if self.format == PAPER:
            return y
        return _inverse(y[None], self.key_bias, layer, start, cfg=self.cfg, parts=parts,
                        seq_len=seq_len, dtype=jnp.dtype(dtype))[0]


def key_specs(shape: tuple[int, ...], bits: int, fmt: str
              ) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of (codes, scales) of keys `shape = [n, B, S, K, H]` in `fmt`."""
    if PER_CHANNEL not in transforms_of(fmt):
        return quantized_specs(shape, bits, GROUP_SIZE)
    n, b, s, k, h = shape
    groups = key_tokens(s, fmt) // GROUP_SIZE
    return quantized_specs((n, b, groups, k, h, GROUP_SIZE), bits, GROUP_SIZE)


# ---------------------------------------------------------------------------- the transforms


def _rope_bias(cfg: ModelConfig, key_bias: jax.Array, layer: jax.Array, n: int, start: jax.Array,
               seq_len: int) -> jax.Array:
    """RoPE(b_k, pos) of layers `layer..layer+n-1` at positions `start..`, [n, S, K, H] float32,
    by the model's own RoPE."""
    bias = jax.lax.dynamic_slice_in_dim(key_bias, layer, n)  # [n, K, H]
    positions = (start + jnp.arange(seq_len, dtype=jnp.int32))[None]  # [1, S]
    cos, sin = rope_tables(cfg, positions)  # [1, S, 1, H/2]
    return apply_rope(jnp.broadcast_to(bias[:, None], (n, seq_len, *bias.shape[1:])), cos, sin)


def _rotate(x: jax.Array) -> jax.Array:
    """Each 64-channel group of x [..., H] (float32) times HADAMARD_64 (its own inverse)."""
    groups = x.reshape(*x.shape[:-1], -1, GROUP_SIZE)
    out = jnp.einsum("...gi,ij->...gj", groups, HADAMARD_64,
                     precision=jax.lax.Precision.HIGHEST)  # float32 on a GPU too (no TF32)
    return out.reshape(x.shape)


def _channel_groups(x: jax.Array) -> jax.Array:
    """[n, B, S, K, H] -> [n, B, G, K, H, 64]: each row 64 tokens of one channel (zero-padded)."""
    n, b, s, k, h = x.shape
    pad = -s % GROUP_SIZE
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape(n, b, -1, GROUP_SIZE, k, h).transpose(0, 1, 2, 4, 5, 3)


def _token_rows(y: jax.Array, seq_len: int) -> jax.Array:
    """Inverse of `_channel_groups`: [n, B, G, K, H, 64] -> [n, B, seq_len, K, H]."""
    n, b, g, k, h, _ = y.shape
    return y.transpose(0, 1, 2, 5, 3, 4).reshape(n, b, g * GROUP_SIZE, k, h)[:, :, :seq_len]


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def _forward(k: jax.Array, key_bias: jax.Array | None, layer: jax.Array, start: jax.Array, *,
             cfg: ModelConfig | None, parts: frozenset[Transform]) -> jax.Array:
    """The quantizer's input for keys k [n, B, S, K, H]: debiased, rotated, regrouped."""
    x = k
    if DEBIAS in parts:
        x = x.astype(jnp.float32) - _rope_bias(cfg, key_bias, layer, k.shape[0], start,
                                               k.shape[2])[:, None]
    if HADAMARD in parts:
        x = _rotate(x.astype(jnp.float32))
    if PER_CHANNEL in parts:
        x = _channel_groups(x)
    return x


@functools.partial(jax.jit, static_argnames=("cfg", "parts", "seq_len", "dtype"))
def _inverse(y: jax.Array, key_bias: jax.Array | None, layer: jax.Array, start: jax.Array, *,
             cfg: ModelConfig | None, parts: frozenset[Transform], seq_len: int,
             dtype: jnp.dtype) -> jax.Array:
    """Keys [n, B, S, K, H] in `dtype` from the dequantized `_forward` output (float32 where a
    transform computes)."""
    if PER_CHANNEL in parts:
        y = _token_rows(y, seq_len)
    if HADAMARD in parts:
        y = _rotate(y)
    if DEBIAS in parts:
        y = y + _rope_bias(cfg, key_bias, layer, y.shape[0], start, seq_len)[:, None]
    return y.astype(dtype)


# ---------------------------------------------------------------------------- error bounds


@dataclasses.dataclass(frozen=True)
class KeyBias:
    """What a debiased prefix's error bound needs of the model, in float64: every layer's k_proj
    bias and RoPE's inverse frequencies."""

    bias: np.ndarray  # [L, K, H]
    inv_freq: np.ndarray  # [H/2]

    @classmethod
    def of(cls, cfg: ModelConfig, params: Params) -> KeyBias | None:
        """The model's, or None without a k_proj bias."""
        if not cfg.qkv_bias:
            return None
        bias = np.stack([np.asarray(layer["attn"]["k_bias"], np.float64)
                         for layer in params["layers"]])
        return cls(bias, inverse_frequencies(cfg, np.float64))

    def rope(self, layers: slice, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """RoPE(b_k, pos) of `layers` at `positions` [S], [n, S, K, H], and a
        bound on how far the float32 evaluation of `_rope_bias` lies from it: the angle
        `pos * inv_freq` rounded twice (2.5 ulp, < 2**-22 of the angle), cos/sin and the rotation's
        products and sum (< 2**-17 generously), each times |b_i| + |b_j| of the rotated pair."""
        b = self.bias[layers][:, None]  # [n, 1, K, H]
        theta = np.asarray(positions, np.float64)[:, None] * self.inv_freq  # [S, H/2]
        cos, sin = (f(theta)[None, :, None] for f in (np.cos, np.sin))  # [1, S, 1, H/2]
        b1, b2 = np.split(b, 2, axis=-1)
        rope = np.concatenate([b1 * cos - b2 * sin, b2 * cos + b1 * sin], axis=-1)
        pair = np.abs(b1) + np.abs(b2)
        err = pair * (2.0**-22 * theta + 2.0**-17)[None, :, None]
        return rope, np.concatenate([err, err], axis=-1)


def _group_sum(e: np.ndarray) -> np.ndarray:
    """Each element's 64-channel group's sum of e [..., H], per element."""
    groups = e.reshape(*e.shape[:-1], -1, GROUP_SIZE)
    return np.broadcast_to(groups.sum(-1, keepdims=True), groups.shape).reshape(e.shape)


def _rotated(y: np.ndarray) -> np.ndarray:
    groups = y.reshape(*y.shape[:-1], -1, GROUP_SIZE)
    return (groups @ HADAMARD_64.astype(np.float64)).reshape(y.shape)


def _channel_window_max(mag: np.ndarray) -> np.ndarray:
    """Per element of mag [n, B, S, K, H], the max of its channel over the aligned 64-token blocks
    next to its own: every run of <= 64 tokens holding it lies there, so this bounds its group's
    max whatever token the payload starts at (a whole prefix, a token chunk)."""
    n, b, s, k, h = mag.shape
    padded = np.zeros((n, b, key_tokens(s, PER_CHANNEL), k, h))
    padded[:, :, :s] = mag
    blocks = padded.reshape(n, b, -1, GROUP_SIZE, k, h).max(axis=3)  # [n, B, G, K, H]
    ext = np.pad(blocks, ((0, 0), (0, 0), (1, 1), (0, 0), (0, 0)))
    window = np.maximum(np.maximum(ext[:, :, :-2], ext[:, :, 1:-1]), ext[:, :, 2:])
    return np.repeat(window, GROUP_SIZE, axis=2)[:, :, :s]


def _group_error(mag: np.ndarray, bits: int, per_channel: bool) -> np.ndarray:
    """`quantize.code_error` per element of quantizer inputs whose |value| is at most `mag`."""
    if per_channel:
        return code_error(_channel_window_max(mag), bits)
    groups = mag.reshape(*mag.shape[:-1], -1, GROUP_SIZE)
    group_max = np.broadcast_to(groups.max(-1, keepdims=True), groups.shape)
    return code_error(group_max, bits).reshape(mag.shape)


def key_error_bound(keys: np.ndarray, bits: int, fmt: str, dtype: np.dtype,
                    bias: KeyBias | None = None, layer: int = 0, start: int = 0) -> np.ndarray:
    """Per element of keys `[n, B, S, K, H]` (of layers `layer..`, at positions `start..`), the
    largest |restored - keys| a round trip in `fmt` to `dtype` may have, in float64.

    Let y be the quantizer's input computed exactly (keys, minus RoPE(b_k, pos), rotated) and
    `slack` a bound on how far its float32 value lies from y. The quantizer then errs by
    `code_error` of a group max of |y| + slack, and the inverse transform moves that error:
    rotation by at most the group's sum / 8 (|H e|_i <= sum_j |e_j| / 8), plus float32 rounding
    (a 64-term sum: 64 ulp of the sum of |terms|; each add and subtract of RoPE(b): one ulp).
    Casting to `dtype` adds half an ulp. A debias bound needs the model's `bias`.
    """
    parts = transforms_of(fmt)
    x = np.asarray(keys, np.float64)
    y, slack, err = x, np.zeros_like(x), np.zeros_like(x)  # err: carried to the end
    if DEBIAS in parts:
        if bias is None:
            raise ValueError(f"the error bound of prefix format {fmt!r} needs the k_proj bias")
        n, s = x.shape[0], x.shape[2]
        rope, rope_err = bias.rope(slice(layer, layer + n), np.arange(start, start + s))
        y = x - rope[:, None]
        err = _U * (np.abs(y) + rope_err[:, None])  # K - RoPE(b) rounded to float32
        slack = rope_err[:, None] + err
    if HADAMARD in parts:
        gamma = GROUP_SIZE * _U * 1.01
        forward = gamma * _group_sum(np.abs(y) + slack) / GROUP_SIZE**0.5
        y, slack = _rotated(y), _group_sum(slack) / GROUP_SIZE**0.5 + forward
        quantized = _group_error(np.abs(y) + slack, bits, False)
        back = gamma * _group_sum(np.abs(y) + slack + quantized) / GROUP_SIZE**0.5
        err = err + _group_sum(forward + quantized) / GROUP_SIZE**0.5 + back
    else:
        err = err + _group_error(np.abs(y) + slack, bits, PER_CHANNEL in parts)
    if DEBIAS in parts:
        err = err + _U * (np.abs(x) + err)  # + RoPE(b) in float32
    half_ulp = float(jnp.finfo(dtype).eps) / 2
    return err * (1 + half_ulp) + np.abs(x) * half_ulp
