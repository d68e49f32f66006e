"""Pallas GPU kernels for group quantization of the prefix KV, bit-identical to the reference.

Backend: the Triton lowering, chosen by passing Triton `CompilerParams`. Mosaic GPU, the default
GPU lowering in jax 0.10-0.11, has no reductions along an axis and no sub-byte types, and a
64-element group max and Q4 packing need both; the Triton lowering is deprecated in 0.11 but
present in both versions. The kernel bodies call the reference's block functions
(`rekv_jax.quantize.group_absmax`, `f16_scale`, `group_code_bits`, `dequantize_block`), which
stay inside Triton's limits (no `round`, no sub-byte casts, no float max, no reliance on IEEE
division, reductions as even/odd `unstack` trees), so interpret mode on CPU runs the arithmetic
the GPU runs. Only Q4 packing differs in form: pairs are split with `unstack` here, where the
XLA reference uses a uint16 view (Triton has no mixed-width bitcast).

Layout: leading axes are flattened to rows `[R, H]`; each program owns `block_rows` rows (a power
of two, as Triton requires) and masks the rows past R, so ragged counts (8191 tokens) are exact.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rekv_jax.quantize import (
    QuantizedTensor,
    check_args,
    dequantize_block,
    f16_scale,
    group_absmax,
    group_code_bits,
)
from rekv_jax.sizes import GROUP_SIZE

BLOCK_ELEMENTS = 4096  # elements of x per program (32 rows of head_dim 128): 32 per thread
NUM_WARPS = 4
# Triton's CompilerParams: `CompilerParams` in jax 0.10-0.11, `TritonCompilerParams` before.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams


def _block_rows(h: int, group_size: int, block_rows: int | None) -> int:
    """Rows per program; Triton blocks need power-of-two sizes, so H, G and it must be ones."""
    br = block_rows or max(1, BLOCK_ELEMENTS // h)
    for name, v in (("last dim", h), ("group_size", group_size), ("block_rows", br)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"the Pallas kernels need a power-of-two {name}, got {v}")
    return br


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


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_rows", "interpret"))
def quantize(x: jax.Array, bits: int, group_size: int = GROUP_SIZE, *,
             block_rows: int | None = None, interpret: bool = False) -> QuantizedTensor:
    """Pallas quantizer of `x [..., H]` (contract of `rekv_jax.quantize`; no finiteness check)."""
    check_args(x.shape, x.dtype, bits, group_size)
    *lead, h = x.shape
    br = _block_rows(h, group_size, block_rows)
    rows = math.prod(lead)
    width, n = h * bits // 8, h // group_size
    values, scales = pl.pallas_call(
        functools.partial(_quantize_kernel, rows=rows, bits=bits, group_size=group_size),
        out_shape=(jax.ShapeDtypeStruct((rows, width), jnp.int8 if bits == 8 else jnp.uint8),
                   jax.ShapeDtypeStruct((rows, n), jnp.float16)),
        grid=(pl.cdiv(rows, br),),
        in_specs=_row_specs(br, h),
        out_specs=_row_specs(br, width, n),
        compiler_params=_TritonParams(num_warps=NUM_WARPS),
        interpret=interpret,
        name=f"rekv_quantize_q{bits}",
    )(x.reshape(rows, h))
    return QuantizedTensor(values.reshape(*lead, width), scales.reshape(*lead, n), bits,
                           group_size, jnp.dtype(x.dtype))


@functools.partial(jax.jit, static_argnames=("dtype", "block_rows", "interpret"))
def dequantize(q: QuantizedTensor, dtype: jnp.dtype | None = None, *,
               block_rows: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas dequantizer: `code * scale` cast to `dtype` (default: the quantized dtype)."""
    *lead, h = q.shape
    br = _block_rows(h, q.group_size, block_rows)
    rows = math.prod(lead)
    out = pl.pallas_call(
        functools.partial(_dequantize_kernel, rows=rows, bits=q.bits, group_size=q.group_size),
        out_shape=jax.ShapeDtypeStruct((rows, h), jnp.dtype(dtype or q.dtype)),
        grid=(pl.cdiv(rows, br),),
        in_specs=_row_specs(br, q.values.shape[-1], q.scales.shape[-1]),
        out_specs=_row_specs(br, h)[0],
        compiler_params=_TritonParams(num_warps=NUM_WARPS),
        interpret=interpret,
        name=f"rekv_dequantize_q{q.bits}",
    )(q.values.reshape(rows, -1), q.scales.reshape(rows, -1))
    return out.reshape(*lead, h)
