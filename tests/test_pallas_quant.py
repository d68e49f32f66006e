"""Pallas quantization kernels: bit-identical to the XLA reference (interpret mode on CPU), and
lowerable for CUDA from this CPU-only machine, so a kernel that cannot compile fails here."""

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


def check_same_as_reference(x: jax.Array, bits: int, block_rows: int | None = None) -> None:
    ref = Q.quantize_xla(x, bits)
    got = P.quantize(x, bits, block_rows=block_rows, interpret=True)
    assert_bitwise_equal(got.values, ref.values)
    assert_bitwise_equal(got.scales, ref.scales)
    assert (got.bits, got.group_size, got.dtype) == (ref.bits, ref.group_size, ref.dtype)
    for dtype in (None, jnp.float32, jnp.float16):
        assert_bitwise_equal(P.dequantize(got, dtype, block_rows=block_rows, interpret=True),
                             Q.dequantize_xla(ref, dtype))


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 70), heads=st.integers(1, 8),
       head_dim=st.sampled_from([64, 128]), bits=st.sampled_from([8, 4]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]), block_rows=st.sampled_from([8, 32]))
def test_interpret_matches_reference_bitwise(seed, tokens, heads, head_dim, bits, dtype,
                                             block_rows):
    # KV layout [B, S, K, H]; rows = S * K are rarely a multiple of block_rows (ragged blocks).
    check_same_as_reference(random_groups(seed, (1, tokens, heads, head_dim), dtype), bits,
                            block_rows)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_interpret_matches_reference_on_extremes(bits, dtype):
    check_same_as_reference(extreme_groups(bits, dtype), bits, block_rows=8)


def test_nan_through_the_pallas_backend_raises():
    x = jnp.ones((9, 128), jnp.bfloat16).at[8, 0].set(jnp.inf)
    with pytest.raises(ValueError, match="non-finite scale"):
        Q.quantize(x, 8, backend="pallas-interpret")


@pytest.mark.parametrize("shape, block_rows, match", [
    ((4, 192), None, "power-of-two last dim"),
    ((4, 128), 24, "power-of-two block_rows"),
])
def test_kernel_shape_limits_raise(shape, block_rows, match):
    with pytest.raises(ValueError, match=match):
        P.quantize(jnp.ones(shape, jnp.float32), 8, block_rows=block_rows, interpret=True)


@pytest.mark.parametrize("tokens", [8192, 8191])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernels_lower_for_cuda(tokens, bits):
    """Qwen2.5-7B KV layer shape [S, K=4, H=128] in bf16, full and ragged, lowered for CUDA."""
    x = jax.ShapeDtypeStruct((tokens, 4, 128), jnp.bfloat16)
    q = jax.eval_shape(lambda x: P.quantize(x, bits), x)
    grid = -(-tokens * 4 // (P.BLOCK_ELEMENTS // 128))
    for fn, arg, name in ((lambda x: P.quantize(x, bits), x, f"rekv_quantize_q{bits}"),
                          (lambda q: P.dequantize(q), q, f"rekv_dequantize_q{bits}")):
        text = jax.jit(fn).trace(arg).lower(lowering_platforms=("cuda",)).as_text()
        # one GPU kernel call (Triton), named after our kernel, over every row block
        assert "custom_call @__gpu$" in text and name in text
        assert f"grid_x = {grid} : i32" in text
