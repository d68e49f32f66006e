"""Reference group quantizer: the contract against a float64 numpy oracle, accuracy, errors,
byte-exact payloads, and backend dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_data import random_groups

from rekv_jax import quantize as Q
from rekv_jax import sizes
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.payload import prefix_specs
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.kv import KVCache


def oracle(x: jax.Array, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int [..., H], scales float16 [..., H/64]) from the contract, in float64."""
    qmax = Q.QMAX[bits]
    xg = np.asarray(x.astype(jnp.float32), np.float64).reshape(*x.shape[:-1], -1, 64)
    a = np.abs(xg).max(-1)
    s = (a / qmax).astype(np.float16)  # float64 -> float16 rounds the exact quotient correctly
    s64 = s.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.floor(np.abs(xg) / s64 + 0.5)  # exact: quotients sit >= 2**-35 off a half-integer
    n = np.where(s64 > 0, np.minimum(n, qmax), 0)
    return (np.sign(xg) * n).astype(np.int64).reshape(x.shape), s


def codes_of(q: Q.QuantizedTensor) -> np.ndarray:
    """Signed codes `[..., H]` read back from the stored layout (numpy, independent of Q)."""
    v = np.asarray(q.values)
    if q.bits == 8:
        return v.astype(np.int64)
    nib = np.stack([v & 0xF, v >> 4], axis=-1).astype(np.int64)  # even element = low nibble
    return ((nib ^ 8) - 8).reshape(*v.shape[:-1], -1)


shapes = st.tuples(st.integers(1, 40), st.integers(1, 8), st.sampled_from([64, 128]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, bits=st.sampled_from([8, 4]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]))
def test_matches_float64_oracle(seed, shape, bits, dtype):
    x = random_groups(seed, shape, dtype)
    q = Q.quantize(x, bits)
    codes, scales = oracle(x, bits)
    assert q.scales.dtype == jnp.float16 and q.shape == x.shape and q.dtype == x.dtype
    assert np.array_equal(np.asarray(q.scales).view(np.uint16), scales.view(np.uint16))
    assert np.array_equal(codes_of(q), codes)
    assert q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)


@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_away_from_zero_and_exact_quotient(bits):
    qmax = Q.QMAX[bits]
    s = np.float32(np.float16(0.0078125 * 1.375))  # 11-bit float16 scale, exact in float32
    k = np.arange(qmax, dtype=np.float32)
    ties = (k + np.float32(0.5)) * s  # exactly k + 1/2 times the scale
    below = np.nextafter(ties, np.float32(0))  # the float32 just under each tie
    row = np.zeros(64, np.float32)
    row[0] = qmax * s  # pins the scale to s exactly
    for vals in (ties, -ties, below, -below):
        x = np.tile(row, (len(vals), 1))
        x[:, 1] = vals
        q = Q.quantize(jnp.asarray(x), bits)
        assert np.all(np.asarray(q.scales, np.float32) == s)
        expect = np.sign(vals) * np.where(np.abs(vals) == ties, k + 1, k)
        assert np.array_equal(codes_of(q)[:, 1], expect.astype(np.int64))


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_and_tiny_groups_restore_to_zero(bits):
    tiny = Q.QMAX[bits] * 2.0**-25 * 0.99  # a / qmax rounds to a zero float16 scale
    x = jnp.asarray(np.stack([np.zeros(64), np.full(64, tiny), -np.full(64, tiny)]), jnp.float32)
    q = Q.quantize(x, bits)
    assert np.all(np.asarray(q.scales) == 0) and np.all(codes_of(q) == 0)
    assert np.all(np.asarray(Q.dequantize(q)) == 0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, bits=st.sampled_from([8, 4]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]))
def test_error_within_half_a_scale_plus_scale_rounding(seed, shape, bits, dtype):
    qmax = Q.QMAX[bits]
    x = random_groups(seed, shape, dtype)
    q = Q.quantize(x, bits)
    xg = np.asarray(x.astype(jnp.float32), np.float64).reshape(*shape[:-1], -1, 64)
    err = np.abs(xg - np.asarray(Q.dequantize(q, jnp.float32), np.float64).reshape(xg.shape))
    s = np.asarray(q.scales, np.float64)
    a = np.abs(xg).max(-1)
    # |x - n s| <= s/2 unless n is clipped to qmax, which costs at most qmax * |a/qmax - s|
    # (the float16 rounding of the scale, times qmax; written |a - qmax s| to stay exact).
    bound = np.maximum(s / 2, np.abs(a - qmax * s))
    assert np.all(err <= bound[..., None])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_idempotent_on_representable_values(bits, dtype):
    qmax = Q.QMAX[bits]
    rng = np.random.default_rng(bits)
    codes = rng.integers(-qmax, qmax + 1, (50, 2, 64))
    codes[..., 0] = qmax * rng.choice([-1, 1], (50, 2))  # each group reaches +-qmax
    if dtype == jnp.bfloat16:  # n * s must be exact in bfloat16: powers of two
        s = np.exp2(rng.integers(-20, 10, (50, 2))).astype(np.float16)
    else:
        s = rng.uniform(1e-3, 10, (50, 2)).astype(np.float16)
    x = jnp.asarray(codes * s.astype(np.float64)[..., None], dtype).reshape(50, 128)
    q = Q.quantize(x, bits)
    assert np.array_equal(np.asarray(q.scales).reshape(50, 2), s)
    assert np.array_equal(codes_of(q).reshape(codes.shape), codes)
    assert np.array_equal(np.asarray(Q.dequantize(q)), np.asarray(x))
    again = Q.quantize(Q.dequantize(q), bits)
    assert np.array_equal(np.asarray(again.values), np.asarray(q.values))


@pytest.mark.parametrize("bits", [8, 4])
def test_overflow_threshold_is_exact(bits):
    limit = Q.F16_TO_INF * Q.QMAX[bits]  # a / qmax = 65520 rounds (to even) to inf
    ok = np.zeros((1, 64), np.float32)
    ok[0, 0] = np.nextafter(np.float32(limit), np.float32(0))
    assert float(Q.quantize(jnp.asarray(ok), bits).scales[0, 0]) == 65504.0
    ok[0, 0] = limit
    with pytest.raises(ValueError, match="float16 scale overflows"):
        Q.quantize(jnp.asarray(ok), bits)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_nan_inf_input_raises(bad, dtype):
    x = np.ones((3, 128), np.float32)
    x[2, 100] = bad
    with pytest.raises(ValueError, match="1 group"):
        Q.quantize(jnp.asarray(x, dtype), 8)


@pytest.mark.parametrize("args, match", [
    ((np.ones((4, 96), np.float32), 8), "not divisible by the group size"),
    ((np.ones((4, 128), np.float32), 6), "bits must be 8 or 4"),
    ((np.ones((4, 128), np.int32), 8), "cannot quantize dtype"),
    ((np.ones((0, 128), np.float32), 8), "nothing to quantize"),
    ((np.ones((4, 128), np.float32), 8, 63), "group_size"),
])
def test_bad_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        Q.quantize(jnp.asarray(args[0]), *args[1:])


def test_usable_under_jit_with_deferred_check():
    x = jnp.ones((4, 128), jnp.bfloat16).at[1, 3].set(jnp.nan)
    q = jax.jit(lambda x: Q.quantize_unchecked(x, 8))(x)
    assert isinstance(q, Q.QuantizedTensor) and jax.tree.leaves(q) == [q.values, q.scales]
    with pytest.raises(ValueError, match="non-finite scale"):
        Q.check_finite(q)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("cut", [3, 6])
def test_serialized_prefix_equals_byte_formula(bits, cut):
    cfg = ModelConfig.preset("tiny")
    B, S = 2, 96
    k1, k2, k3 = jax.random.split(jax.random.key(cut), 3)
    kv_shape = (cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim)
    kv = KVCache.stacked(jax.random.normal(k1, kv_shape, jnp.bfloat16),
                         jax.random.normal(k2, kv_shape, jnp.bfloat16))
    h_c = jax.random.normal(k3, (B, S, cfg.hidden_size), jnp.bfloat16)
    prefix = kv.layers(0, cut)
    if bits == 16:
        parts = [prefix.k, prefix.v]
    else:
        qk, qv = Q.quantize(prefix.k, bits), Q.quantize(prefix.v, bits)
        parts = [qk.values, qk.scales, qv.values, qv.scales]
        assert qk.nbytes + qv.nbytes == sizes.prefix_bytes(cfg, S, cut, bits, B)
    if cut < cfg.num_layers:
        parts.append(h_c)  # interior cut: the BF16 boundary travels too
    sent = sum(len(np.asarray(p).tobytes()) for p in parts)
    assert sent == sizes.handoff_bytes(cfg, S, bits, cut, B).total_bytes


def test_xla_backend_is_refused_on_a_gpu(monkeypatch):
    monkeypatch.delenv(Q.BACKEND_ENV, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert Q.resolve_backend() == "pallas"
    with pytest.raises(ValueError, match="'xla' is not bit-exact on a GPU"):
        Q.resolve_backend("xla")
    monkeypatch.setenv(Q.BACKEND_ENV, "xla")
    with pytest.raises(ValueError, match="'xla' is not bit-exact on a GPU"):
        Q.resolve_backend()


def test_receiver_sizes_quantized_buffers_without_a_backend(monkeypatch):
    """The decode side sizes Q8/Q4 buffers from the contract, not by tracing a backend: on a GPU,
    where `xla` is refused, tracing it once failed every quantized receive."""
    cfg = ModelConfig.preset("tiny")
    x = jnp.ones((1, 8, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)  # one layer [B, S, K, H]
    monkeypatch.delenv(Q.BACKEND_ENV, raising=False)
    for bits in (8, 4):
        q = Q.quantize(x, bits)
        layer = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q.values, q.scales)] * 2
        with monkeypatch.context() as gpu:
            gpu.setattr(jax, "default_backend", lambda: "gpu")
            assert prefix_specs(cfg, PrefixCodec(bits), 1, 8, 2, jnp.bfloat16) == layer * 2


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv(Q.BACKEND_ENV, raising=False)
    assert Q.resolve_backend() == ("pallas" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setenv(Q.BACKEND_ENV, "pallas-interpret")
    assert Q.resolve_backend() == "pallas-interpret"
    assert Q.resolve_backend("xla") == "xla"  # the argument wins over the environment
    monkeypatch.setenv(Q.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="unknown quantization backend"):
        Q.resolve_backend()


@pytest.mark.parametrize("backend, pallas", [("xla", False), ("pallas-interpret", True)])
def test_dispatch_routes_to_the_backend(backend, pallas):
    x = jnp.ones((8, 128), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: Q.quantize_unchecked(x, 8, backend=backend).values)(x))
    assert ("pallas_call" in jaxpr) == pallas
    q = Q.quantize(x, 8, backend=backend)
    jaxpr = str(jax.make_jaxpr(lambda q: Q.dequantize(q, backend=backend))(q))
    assert ("pallas_call" in jaxpr) == pallas
