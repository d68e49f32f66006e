"""Pallas quantization kernels and their block math: bit-identical to the XLA reference
(interpret mode everywhere; compiled Triton kernels on a GPU, skipped with a reason elsewhere),
`f16_scale` against every bfloat16, and lowerable for CUDA from a CPU-only machine, so a
kernel that cannot compile fails here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_data import extreme_groups, random_groups

from pallas_kernels import quant as P
from rekv_jax import quantize as Q


def assert_bitwise_equal(a: jax.Array, b: jax.Array) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    a, b = np.asarray(a), np.asarray(b)
    assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


# the kernels interpreted, and compiled (Triton) where a GPU is present
INTERPRET = [True, pytest.param(False, marks=pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="compiled Pallas (Triton) kernels need a CUDA GPU"))]


def check_same_as_reference(x: jax.Array, bits: int, block_rows: int, interpret: bool) -> None:
    # the reference on the CPU device: XLA:GPU departs from the contract (see rekv_jax/quantize.py)
    ref = P.quantize_xla(jax.device_put(x, jax.devices("cpu")[0]), bits, 64)
    block = block_rows * x.shape[-1]
    got = P.quantize(x, bits, 64, block_elements=block, interpret=interpret)
    assert_bitwise_equal(got.values, ref.values)
    assert_bitwise_equal(got.scales, ref.scales)
    assert (got.bits, got.group_size, got.dtype) == (ref.bits, ref.group_size, ref.dtype)
    for dtype in (None, jnp.float32, jnp.float16):
        assert_bitwise_equal(P.dequantize(got, dtype, block_elements=block, interpret=interpret),
                             P.dequantize_xla(ref, dtype))


@pytest.mark.parametrize("interpret", INTERPRET)
@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 70), heads=st.integers(1, 8),
       head_dim=st.sampled_from([64, 128]), bits=st.sampled_from([8, 4]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]), block_rows=st.sampled_from([8, 32]))
def test_kernels_match_reference_bitwise(interpret, seed, tokens, heads, head_dim, bits, dtype,
                                        block_rows):
    # KV layout [B, S, K, H]; rows = S * K are rarely a multiple of block_rows (ragged blocks).
    check_same_as_reference(random_groups(seed, (1, tokens, heads, head_dim), dtype), bits,
                            block_rows, interpret)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_match_reference_on_extremes(interpret, bits, dtype):
    check_same_as_reference(extreme_groups(bits, dtype), bits, 8, interpret)


def test_nan_through_the_pallas_backend_raises():
    x = jnp.ones((9, 128), jnp.bfloat16).at[8, 0].set(jnp.inf)
    with pytest.raises(ValueError, match="non-finite scale"):
        Q.quantize(x, 8, backend="pallas-interpret")


@pytest.mark.parametrize("shape, block_elements, match", [
    ((4, 192), P.BLOCK_ELEMENTS, "power-of-two last dim"),
    ((4, 128), 24 * 128, "power-of-two block_elements"),
])
def test_kernel_shape_limits_raise(shape, block_elements, match):
    with pytest.raises(ValueError, match=match):
        P.quantize(jnp.ones(shape, jnp.float32), 8, 64, block_elements=block_elements,
                   interpret=True)


@pytest.mark.parametrize("tokens, block_elements, num_warps", [
    (8192, P.BLOCK_ELEMENTS, P.NUM_WARPS), (8191, P.BLOCK_ELEMENTS, P.NUM_WARPS),
    (8191, 16384, 8)])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernels_lower_for_cuda(tokens, block_elements, num_warps, bits):
    """Qwen2.5-7B KV layer shape [S, K=4, H=128] in bf16, full and ragged, lowered for CUDA, at
    the default block and at one `scripts/bench_quant.py` can sweep to."""
    x = jax.ShapeDtypeStruct((tokens, 4, 128), jnp.bfloat16)
    tuning = dict(block_elements=block_elements, num_warps=num_warps)
    q = jax.eval_shape(lambda x: P.quantize(x, bits, 64), x)
    grid = -(-tokens * 4 // (block_elements // 128))
    for fn, arg, name in ((lambda x: P.quantize(x, bits, 64, **tuning), x,
                           f"rekv_quantize_q{bits}"),
                          (lambda q: P.dequantize(q, **tuning), q, f"rekv_dequantize_q{bits}")):
        text = jax.jit(fn).trace(arg).lower(lowering_platforms=("cuda",)).as_text()
        # one GPU kernel call (Triton), named after our kernel, over every row block
        assert "custom_call @__gpu$" in text and name in text
        assert f"grid_x = {grid} : i32" in text
        assert f"num_warps = {num_warps} : i32" in text


@pytest.mark.parametrize("bits", [8, 4])
def test_f16_scale_rounds_every_bfloat16_and_every_tie(bits):
    qmax = P.QMAX[bits]
    bf16 = np.arange(0x7F81, dtype=np.uint16)  # +0 ... +inf, and one NaN
    mid = _f16_midpoints() * np.float32(qmax)  # a / qmax halfway between float16s (exact)
    a = np.concatenate([(bf16.astype(np.uint32) << 16).view(np.float32), mid,
                        np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    got = np.asarray(jax.jit(P.f16_scale, static_argnums=1)(jnp.asarray(a), bits))
    with np.errstate(over="ignore"):
        want = (a.astype(np.float64) / qmax).astype(np.float16)  # exact quotient, rounded once
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def _f16_midpoints() -> np.ndarray:
    """float32 midpoints between consecutive finite non-negative float16 values."""
    f = np.arange(0x7BFF + 1, dtype=np.uint16).view(np.float16).astype(np.float32)
    return (f[:-1] + f[1:]) / 2
