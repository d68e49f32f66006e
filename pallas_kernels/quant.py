"""Group quantization of the prefix KV (paper §2.2, Eq. 7): contract, block math, Pallas GPU
kernels and the XLA reference, side by side and self-contained (nothing from `rekv_jax`).

Contract (the kernels and the reference below meet it bit for bit). A tensor
`x [..., H]` is cut into groups of `G` (64) consecutive elements along H; per group:
  * `a = max |x|`; stored scale `s = float16(a / qmax)`, round to nearest even, with `qmax` 127
    (Q8) or 7 (Q4);
  * code = round-half-away-from-zero of the exact quotient `x / s`, clipped to `[-qmax, qmax]`;
    `s == 0` (all-zero group, or `a < qmax * 2**-25`) gives code 0, which restores to zero;
  * Q8 codes are int8; Q4 codes are packed two per uint8, the even element in the low nibble;
  * `dequantize` returns `code * s` (exact in float32) cast to the requested dtype.
NaN/Inf input or a scale that overflows float16 makes that group's scale non-finite, and
`quantize` raises ValueError (a cache is never silently NaN).

The arithmetic never relies on a division being correctly rounded: scales and codes start from
a reciprocal estimate and are fixed by exact float32 comparisons (products of a float16 with a
small integer). XLA rewrites division by a constant as a reciprocal multiply and Triton divides
approximately; the kernels run these same block functions, so neither can make them differ.

Backend: the Triton lowering, chosen by passing Triton `CompilerParams`. Mosaic GPU, the default
GPU lowering in jax 0.10-0.11, has no reductions along an axis and no sub-byte types, and a
64-element group max and Q4 packing need both; the Triton lowering is deprecated in 0.11 but
present in both versions. The kernel bodies call the block functions below (`group_absmax`,
`f16_scale`, `group_code_bits`, `dequantize_block`), as the XLA reference does; they stay
inside Triton's limits (no `round`, no sub-byte casts, no float max, no reliance on IEEE
division, reductions as even/odd `unstack` trees), so interpret mode on CPU runs the arithmetic
the GPU runs. Only Q4 packing differs in form: pairs are split with `unstack` here, where the
XLA reference uses a uint16 view (Triton has no mixed-width bitcast).

Layout: leading axes are flattened to rows `[R, H]`; each program owns `block_elements // H` rows
(a power of two, as Triton requires) and masks the rows past R, so ragged counts (8191 tokens)
are exact. `block_elements` and `num_warps` are parameters so `scripts/bench_quant.py` can sweep
them; the defaults are not yet chosen by a GPU measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

QMAX = {8: 127, 4: 7}
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
F16_TO_INF = 65520.0  # float16(y) is inf for y >= this, so a group overflows at a >= qmax * this
BLOCK_ELEMENTS = 4096  # elements of x per program (32 rows of head_dim 128): 32 per thread
NUM_WARPS = 4
# Triton's CompilerParams: `CompilerParams` in jax 0.10-0.11, `TritonCompilerParams` before.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"],
                   meta_fields=["bits", "group_size", "dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Codes and float16 group scales of a tensor `[..., H]`, plus what restores it."""

    values: jax.Array  # Q8: int8 [..., H]; Q4: uint8 [..., H // 2] (even element in low nibble)
    scales: jax.Array  # float16 [..., H // group_size]
    bits: int
    group_size: int
    dtype: np.dtype  # dtype of the quantized input, the default of `dequantize`

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the original tensor."""
        return (*self.values.shape[:-1], self.values.shape[-1] * 8 // self.bits)

    @property
    def nbytes(self) -> int:
        """Payload bytes, codes plus scales (what `sizes.quantized_bytes` predicts)."""
        return self.values.nbytes + self.scales.nbytes


def check_args(shape: tuple[int, ...], dtype: jnp.dtype, bits: int, group_size: int) -> None:
    """Raise ValueError for inputs outside the contract (shared by every backend)."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4 for quantization, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 \
            or group_size % 2:
        raise ValueError(f"group_size must be a positive even integer, got {group_size!r}")
    if jnp.dtype(dtype) not in INPUT_DTYPES:
        raise ValueError(f"cannot quantize dtype {dtype}; expected bfloat16, float16 or float32")
    if not shape or math.prod(shape) == 0:
        raise ValueError(f"nothing to quantize: shape {shape}")
    if shape[-1] % group_size:
        raise ValueError(f"last dim {shape[-1]} is not divisible by the group size {group_size}")


def quantized_specs(shape: tuple[int, ...], bits: int, group_size: int
                    ) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of (values, scales) for an input `[..., H]`: every backend's output, so a
    receiver can size its buffers without tracing one."""
    *lead, h = shape
    codes = jnp.int8 if bits == 8 else jnp.uint8
    return (jax.ShapeDtypeStruct((*lead, h * bits // 8), codes),
            jax.ShapeDtypeStruct((*lead, h // group_size), jnp.float16))


# ---- block functions: jnp on `[..., H]`, valid under XLA and inside a Pallas Triton kernel.

_UNDER = 1.0 - 2.0**-19  # biases the reciprocal low (see `group_code_bits`)
_MAGIC = 12582912.0  # 1.5 * 2**23: for integer-valued |n| < 2**22, n + _MAGIC holds n in its
#                      low mantissa bits, so the bits' low byte is n in two's complement


def group_absmax(x: jax.Array, group_size: int) -> jax.Array:
    """max |x| per group, float32 `[..., H // G]`; NaN if the group holds a NaN.

    An integer max of the magnitude bits (NaN > Inf > finite), by a tree over even/odd pairs:
    exact and NaN-propagating on every backend (Triton's float max drops NaN), and XLA:CPU fuses
    it into one fast loop (its generic reduce is several times slower).
    """
    ints = lax.bitcast_convert_type(x, jnp.int16 if x.dtype.itemsize == 2 else jnp.int32)
    m = (ints & jnp.iinfo(ints.dtype).max).reshape(*x.shape[:-1], -1, group_size)
    while m.shape[-1] > 1:
        even, odd = jnp.unstack(m.reshape(*m.shape[:-1], -1, 2), axis=-1)
        m = jnp.maximum(even, odd)
    return lax.bitcast_convert_type(m.reshape(m.shape[:-1]), x.dtype).astype(jnp.float32)


def _f16(bits: jax.Array) -> jax.Array:
    """The float16 with bit pattern `bits` (int32 holding 16 bits), as float32."""
    return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(jnp.float32)


def f16_scale(a: jax.Array, bits: int) -> jax.Array:
    """Scales `float16(a / qmax)`, round to nearest even, without dividing (float32 `a >= 0`).

    (XLA rewrites `a / 127.0` as `a * (1 / 127.0)`, which misrounds ties, and Triton divides
    approximately.) A guess from a reciprocal is within one float16 step; it moves to a neighbour
    when `a` lies beyond (or, for an odd guess, on) the midpoint. midpoint * qmax has at most 21
    significant bits, so the comparisons are exact. NaN stays NaN; overflow is set explicitly.
    """
    qmax = QMAX[bits]
    guess = (a * (1.0 / qmax)).astype(jnp.float16)
    b = lax.bitcast_convert_type(guess, jnp.int16).astype(jnp.int32)
    mid_up = (_f16(b) + _f16(b + 1)) * (0.5 * qmax)
    mid_down = (_f16(b) + _f16(jnp.maximum(b - 1, 0))) * (0.5 * qmax)
    odd = (b & 1) == 1
    up = (a > mid_up) | ((a == mid_up) & odd)
    down = (a < mid_down) | ((a == mid_down) & odd)
    s = _f16(b + up.astype(jnp.int32) - down.astype(jnp.int32))
    return jnp.where(a >= F16_TO_INF * qmax, jnp.inf, s).astype(jnp.float16)


def group_code_bits(x: jax.Array, scales: jax.Array, bits: int, group_size: int) -> jax.Array:
    """int32 `[..., H]` whose low byte is each element's code (contract above).

    With `inv` an underestimate of 1/s (relative error < 2**-18, also with an approximate
    division), `n = floor(|x| * inv + 1/2)` is `floor(|x|/s + 1/2)` or one less; the exact test
    `2|x| >= (2n + 1) s` settles it ((2n+1) has <= 9 bits and s 11, so the product is exact).
    """
    qmax = QMAX[bits]
    *lead, h = x.shape
    xg = x.astype(jnp.float32).reshape(*lead, h // group_size, group_size)
    s = scales.astype(jnp.float32)[..., None]  # [..., n, 1]
    live = s > 0
    inv = jnp.where(live, (1.0 / jnp.where(live, s, 1.0)) * _UNDER, 0.0)
    s_live = jnp.where(live, s, jnp.inf)  # dead group: n stays 0
    ax = jnp.abs(xg)
    n = jnp.floor(ax * inv + 0.5)
    n = jnp.where(ax + ax >= (n + n + 1.0) * s_live, n + 1.0, n)
    n = jnp.minimum(n, float(qmax))  # only a float16-subnormal scale can give n > qmax
    signed = jnp.where(xg < 0, -n, n) + _MAGIC
    return lax.bitcast_convert_type(signed, jnp.int32).reshape(*lead, h)


def dequantize_block(values: jax.Array, scales: jax.Array, bits: int, group_size: int,
                     dtype: jnp.dtype) -> jax.Array:
    """`code * scale` (exact in float32) cast to `dtype`, `[..., H]`."""
    if bits == 4:
        p = values.astype(jnp.int32)
        lo, hi = ((p & 0xF) ^ 8) - 8, ((p >> 4) ^ 8) - 8  # sign-extended nibbles
        codes = jnp.stack([lo, hi], axis=-1).reshape(*values.shape[:-1], -1)
    else:
        codes = values.astype(jnp.int32)
    *lead, h = codes.shape
    cg = codes.astype(jnp.float32).reshape(*lead, h // group_size, group_size)
    return (cg * scales.astype(jnp.float32)[..., None]).reshape(*lead, h).astype(dtype)


# ---- XLA reference.

def quantize_xla(x: jax.Array, bits: int, group_size: int) -> QuantizedTensor:
    """XLA reference quantizer (no finiteness check; see `quantize`).

    Two executables on purpose: inside one, XLA:CPU fuses the per-group scale math into the
    per-element loop and recomputes it for every element (5-10x slower).
    """
    check_args(x.shape, x.dtype, bits, group_size)
    scales = _xla_scales(x, bits, group_size)
    return QuantizedTensor(_xla_codes(x, scales, bits, group_size), scales, bits, group_size,
                           jnp.dtype(x.dtype))


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _xla_scales(x: jax.Array, bits: int, group_size: int) -> jax.Array:
    return f16_scale(group_absmax(x, group_size), bits)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _xla_codes(x: jax.Array, scales: jax.Array, bits: int, group_size: int) -> jax.Array:
    codes = group_code_bits(x, scales, bits, group_size).astype(jnp.int8)  # keeps the low byte
    if bits == 8:
        return codes
    # Pack pairs through a uint16 view (low byte = even element): contiguous, so XLA:CPU
    # vectorizes it; the Triton kernel packs with `unstack` instead (no mixed-width bitcast).
    w = lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], -1, 2), jnp.uint16)
    return ((w & 0xF) | ((w >> 4) & 0xF0)).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_xla(q: QuantizedTensor, dtype: jnp.dtype | None = None) -> jax.Array:
    """XLA reference dequantizer."""
    dtype = jnp.dtype(dtype or q.dtype)
    if q.bits == 4 and dtype.itemsize == 2:
        return _dequantize_q4_pairs(q, dtype)
    return dequantize_block(q.values, q.scales, q.bits, q.group_size, dtype)


def _dequantize_q4_pairs(q: QuantizedTensor, dtype: jnp.dtype) -> jax.Array:
    """Q4 to a 16-bit dtype as one uint32 (two outputs) per packed byte: contiguous, so XLA:CPU
    vectorizes it (10x faster than the interleaving `stack` of `dequantize_block`)."""
    p = q.values.astype(jnp.int32)  # [..., H/2]
    s = jnp.repeat(q.scales.astype(jnp.float32), q.group_size // 2, axis=-1)  # [..., H/2]

    def bits16(nibble: jax.Array) -> jax.Array:
        value = (((nibble & 0xF) ^ 8) - 8).astype(jnp.float32) * s
        return lax.bitcast_convert_type(value.astype(dtype), jnp.uint16).astype(jnp.uint32)

    pairs = bits16(p) | (bits16(p >> 4) << 16)  # even element in the low half
    return lax.bitcast_convert_type(pairs, dtype).reshape(q.shape)


# ---- Pallas kernels.

def _block_rows(h: int, group_size: int, block_elements: int) -> int:
    """Rows per program; Triton blocks need power-of-two sizes, so H, G and the block too."""
    for name, v in (("last dim", h), ("group_size", group_size),
                    ("block_elements", block_elements)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"the Pallas kernels need a power-of-two {name}, got {v}")
    return max(1, block_elements // h)


def _row_mask(rows: int, shape: tuple[int, ...]) -> jax.Array:
    """`shape` mask of this program's rows that exist (the last block may be ragged)."""
    first = pl.program_id(0) * shape[0]
    return jnp.broadcast_to((first + jnp.arange(shape[0]) < rows)[:, None], shape)


def _quantize_kernel(x_ref, v_ref, s_ref, *, rows: int, bits: int, group_size: int) -> None:
    x = plgpu.load(x_ref, mask=_row_mask(rows, x_ref.shape))  # [block_rows, H]
    scales = f16_scale(group_absmax(x, group_size), bits)  # [block_rows, H // G]
    codes = group_code_bits(x, scales, bits, group_size)  # int32, code in the low byte
    if bits == 4:
        even, odd = jnp.unstack(codes.reshape(codes.shape[0], -1, 2), axis=-1)
        codes = (even & 0xF) | ((odd & 0xF) << 4)
    plgpu.store(v_ref, codes.astype(v_ref.dtype), mask=_row_mask(rows, v_ref.shape))
    plgpu.store(s_ref, scales, mask=_row_mask(rows, s_ref.shape))


def _dequantize_kernel(v_ref, s_ref, o_ref, *, rows: int, bits: int, group_size: int) -> None:
    values = plgpu.load(v_ref, mask=_row_mask(rows, v_ref.shape))
    scales = plgpu.load(s_ref, mask=_row_mask(rows, s_ref.shape))
    out = dequantize_block(values, scales, bits, group_size, o_ref.dtype)
    plgpu.store(o_ref, out, mask=_row_mask(rows, o_ref.shape))


def _row_specs(block_rows: int, *widths: int) -> list[pl.BlockSpec]:
    return [pl.BlockSpec((block_rows, w), lambda i: (i, 0)) for w in widths]


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_elements", "num_warps",
                                             "interpret"))
def quantize(x: jax.Array, bits: int, group_size: int, *, block_elements: int = BLOCK_ELEMENTS,
             num_warps: int = NUM_WARPS, interpret: bool = False) -> QuantizedTensor:
    """Pallas quantizer of `x [..., H]` (the contract above; no finiteness check)."""
    check_args(x.shape, x.dtype, bits, group_size)
    *lead, h = x.shape
    br = _block_rows(h, group_size, block_elements)
    rows = math.prod(lead)
    width, n = h * bits // 8, h // group_size
    values, scales = pl.pallas_call(
        functools.partial(_quantize_kernel, rows=rows, bits=bits, group_size=group_size),
        out_shape=(jax.ShapeDtypeStruct((rows, width), jnp.int8 if bits == 8 else jnp.uint8),
                   jax.ShapeDtypeStruct((rows, n), jnp.float16)),
        grid=(pl.cdiv(rows, br),),
        in_specs=_row_specs(br, h),
        out_specs=_row_specs(br, width, n),
        compiler_params=_TritonParams(num_warps=num_warps),
        interpret=interpret,
        name=f"rekv_quantize_q{bits}",
    )(x.reshape(rows, h))
    return QuantizedTensor(values.reshape(*lead, width), scales.reshape(*lead, n), bits,
                           group_size, jnp.dtype(x.dtype))


@functools.partial(jax.jit, static_argnames=("dtype", "block_elements", "num_warps", "interpret"))
def dequantize(q: QuantizedTensor, dtype: jnp.dtype | None = None, *,
               block_elements: int = BLOCK_ELEMENTS, num_warps: int = NUM_WARPS,
               interpret: bool = False) -> jax.Array:
    """Pallas dequantizer: `code * scale` cast to `dtype` (default: the quantized dtype)."""
    *lead, h = q.shape
    br = _block_rows(h, q.group_size, block_elements)
    rows = math.prod(lead)
    out = pl.pallas_call(
        functools.partial(_dequantize_kernel, rows=rows, bits=q.bits, group_size=q.group_size),
        out_shape=jax.ShapeDtypeStruct((rows, h), jnp.dtype(dtype or q.dtype)),
        grid=(pl.cdiv(rows, br),),
        in_specs=_row_specs(br, q.values.shape[-1], q.scales.shape[-1]),
        out_specs=_row_specs(br, h)[0],
        compiler_params=_TritonParams(num_warps=num_warps),
        interpret=interpret,
        name=f"rekv_dequantize_q{q.bits}",
    )(q.values.reshape(rows, -1), q.scales.reshape(rows, -1))
    return out.reshape(*lead, h)
