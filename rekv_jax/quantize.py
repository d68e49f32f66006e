"""Group quantization of the prefix KV (paper §2.2, Eq. 7): the library's API and backend choice.

The contract, the block math, the Pallas GPU kernels and the XLA reference live together in
`pallas_kernels/quant.py`; this module picks a backend, checks finiteness, and is what the rest
of `rekv_jax` imports (`quantize`, `dequantize`, `QuantizedTensor`).

Backends: Pallas on a GPU, the XLA reference on CPU. `xla` is refused on a GPU: on an H200 the
XLA reference run on the GPU departed from the contract (float32 Gaussian Q4: 3 of 16384 scales
one float16 step off; groups with float16-subnormal scales differed) while the Pallas kernels
were bit-identical. Hypothesis, not yet tested: XLA:GPU flushes float32 subnormals to zero
(the midpoints and quotients of tiny scales) and/or contracts `a * b + c` into an FMA, so the
"exact float32 comparisons" of `f16_scale` / `group_code_bits` see differently rounded operands.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant as kernels
from pallas_kernels.quant import F16_TO_INF, QMAX, QuantizedTensor, quantized_specs
from rekv_jax.sizes import GROUP_SIZE

__all__ = ["BACKENDS", "BACKEND_ENV", "QMAX", "QuantizedTensor", "check_finite", "code_error",
           "dequantize", "error_bound", "finite_error", "quantize", "quantize_unchecked",
           "quantized_specs",
           "resolve_backend"]
BACKENDS = ("xla", "pallas", "pallas-interpret")
BACKEND_ENV = "REKV_QUANT_BACKEND"


def resolve_backend(backend: str | None = None) -> str:
    """`backend`, else $REKV_QUANT_BACKEND, else Pallas on a GPU and XLA elsewhere."""
    on_gpu = jax.default_backend() == "gpu"
    choice = backend or os.environ.get(BACKEND_ENV) or ("pallas" if on_gpu else "xla")
    if choice not in BACKENDS:
        raise ValueError(f"unknown quantization backend {choice!r}; expected one of {BACKENDS}")
    if choice == "xla" and on_gpu:
        raise ValueError("quantization backend 'xla' is not bit-exact on a GPU (its scales "
                         "departed from the contract on an H200); use pallas")
    return choice


def quantize_unchecked(x: jax.Array, bits: int, group_size: int = GROUP_SIZE, *,
                       backend: str | None = None) -> QuantizedTensor:
    """Quantize with the chosen backend; traceable under jit. Pass the result to `check_finite`."""
    choice = resolve_backend(backend)
    if choice == "xla":
        return kernels.quantize_xla(x, bits, group_size)
    return kernels.quantize(x, bits, group_size, interpret=choice == "pallas-interpret")


def check_finite(q: QuantizedTensor) -> QuantizedTensor:
    """Raise ValueError if a scale is NaN/Inf (NaN/Inf input, or a float16 scale overflow)."""
    bad = int(_count_nonfinite(q.scales))  # one small reduction and one host sync
    if bad:
        raise ValueError(finite_error(bad, q.bits, q.group_size))
    return q


def finite_error(bad: int, bits: int, group_size: int = GROUP_SIZE) -> str:
    """The error of `bad` groups whose scale is not finite."""
    return (f"quantize: {bad} group(s) of {group_size} have a non-finite scale: the input holds "
            f"NaN/Inf, or a group's max |x| is >= {F16_TO_INF * QMAX[bits]:.0f} (its float16 "
            "scale overflows)")


@jax.jit
def _count_nonfinite(scales: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(scales))


def quantize(x: jax.Array, bits: int, group_size: int = GROUP_SIZE, *,
             backend: str | None = None) -> QuantizedTensor:
    """Quantize `x [..., H]` to `bits` (8 or 4) in groups along H; ValueError on bad input."""
    return check_finite(quantize_unchecked(jnp.asarray(x), bits, group_size, backend=backend))


def dequantize(q: QuantizedTensor, dtype: jnp.dtype | None = None, *,
               backend: str | None = None) -> jax.Array:
    """Restore `q` as `dtype` (default: the quantized input's dtype)."""
    choice = resolve_backend(backend)
    dtype = jnp.dtype(dtype or q.dtype)
    if choice == "xla":
        return kernels.dequantize_xla(q, dtype)
    return kernels.dequantize(q, dtype, interpret=choice == "pallas-interpret")


def code_error(group_max: np.ndarray, bits: int) -> np.ndarray:
    """The largest |code * s - x| the contract allows for an element of a group whose max |x| is
    `group_max` (float64, before any cast of the restored value).

    The stored scale is float16(a / qmax): within 2**-11 relative (2**-25 absolute where float16
    is subnormal) of a / qmax, so |x| / s stays below qmax + 1/2 and rounding the code costs at
    most s / 2 (a clipped code, or a scale flushed to zero, at most qmax * 2**-24).
    """
    qmax = QMAX[bits]
    scale = np.asarray(group_max, np.float64) / qmax * (1 + 2.0**-11)  # the largest stored
    return scale / 2 + qmax * 2.0**-24


def error_bound(x: np.ndarray, bits: int, dtype: jnp.dtype, group_size: int = GROUP_SIZE
                ) -> np.ndarray:
    """Per element of `x [..., H]`, the largest |restored - x| the contract allows after a
    quantize/dequantize round trip to `dtype`, computed in float64 from `x` alone (no kernel):
    `code_error` of its group, plus half an ulp for casting `code * s` to `dtype`, |y| * eps / 2.
    """
    x64 = np.abs(np.asarray(x, np.float64))
    groups = x64.reshape(*x64.shape[:-1], -1, group_size)  # [..., H // G, G]
    code = code_error(groups.max(axis=-1, keepdims=True), bits)  # [..., H // G, 1]
    half_ulp = float(jnp.finfo(dtype).eps) / 2
    return (code * (1 + half_ulp) + groups * half_ulp).reshape(x64.shape)
