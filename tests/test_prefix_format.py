"""Prefix formats: each against a float64 reference written here (its own Hadamard matrix, RoPE
and group quantizer; nothing from `prefix_format`), their error bounds, byte counts and specs,
and the formats in actions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rekv_jax import sizes
from rekv_jax.action import PAPER, PREFIX_FORMATS, Action, action_space, parse_actions
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.payload import pack_prefix, prefix_specs, unpack_prefix
from rekv_jax.handoff.prefix_format import KeyBias, PrefixCodec, key_error_bound
from rekv_jax.kv import KVCache

FORMATS = [f for f in PREFIX_FORMATS if f != PAPER]
QMAX = {8: 127, 4: 7}
LAYERS, THETA = 3, 10000.0


def config(k: int, h: int) -> ModelConfig:
    return ModelConfig("fmt", "qwen2", LAYERS, k * h, k, k, h, 128, 64, rope_theta=THETA,
                       rms_norm_eps=1e-6, qkv_bias=True)


# ---- the float64 reference


def walsh(n: int) -> np.ndarray:
    """The normalized n x n Hadamard matrix by its closed form: (-1)^popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    bits = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return (-1.0) ** bits / np.sqrt(n)


def rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [n, S, K, H] at positions [S] as the model defines it: angles
    rounded to float32 (position times the float32 inverse frequency), the rest in float64."""
    h = x.shape[-1]
    inv = (THETA ** (-np.arange(0, h, 2) / h)).astype(np.float32)
    theta = (positions.astype(np.float32)[:, None] * inv).astype(np.float64)  # [S, H/2]
    cos, sin = np.cos(theta)[None, :, None], np.sin(theta)[None, :, None]
    a, b = x[..., :h // 2], x[..., h // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def group_round_trip(y: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(code * scale, scale) per element of y [..., 64] quantized in groups along the last axis,
    by the paper's contract: scale float16(max / qmax), codes rounded half away from zero."""
    qmax = QMAX[bits]
    s = (np.abs(y).max(-1, keepdims=True) / qmax).astype(np.float16).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(s > 0, np.minimum(np.floor(np.abs(y) / s + 0.5), qmax), 0)
    return np.sign(y) * n * s, np.broadcast_to(s, y.shape)


def rope_bias(x: np.ndarray, fmt: str, bias: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """RoPE(b_k, pos) broadcast to keys x [n, B, S, K, H] (zero unless the format debiases)."""
    if "debias" not in fmt:
        return np.zeros_like(x)
    n, s = x.shape[0], x.shape[2]
    return np.broadcast_to(rope(np.broadcast_to(bias[:, None], (n, s, *bias.shape[1:])),
                                positions)[:, None], x.shape)


def rotated(y: np.ndarray, fmt: str) -> np.ndarray:
    if "hadamard" not in fmt:
        return y
    return (y.reshape(*y.shape[:-1], -1, 64) @ walsh(64)).reshape(y.shape)


def grouped(y: np.ndarray, fmt: str) -> np.ndarray:
    """y [n, B, S, K, H] as rows of its quantization groups: 64 channels of a token, or (per
    channel) 64 tokens of a channel with the last group zero-padded."""
    if "per-channel" not in fmt:
        return y.reshape(*y.shape[:-1], -1, 64)
    n, b, s, k, h = y.shape
    padded = np.zeros((n, b, -(-s // 64) * 64, k, h))
    padded[:, :, :s] = y
    return padded.reshape(n, b, -1, 64, k, h).transpose(0, 1, 2, 4, 5, 3)


def ungrouped(rows: np.ndarray, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    if "per-channel" not in fmt:
        return rows.reshape(shape)
    n, b, s, k, h = shape
    return rows.transpose(0, 1, 2, 5, 3, 4).reshape(n, b, -1, k, h)[:, :, :s]


def wire_keys(buffers: list[jax.Array], bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(code * scale, scale) of the key buffers as sent (per layer: K codes, K scales, V codes,
    V scales), decoded here from their bytes, as rows [groups, 64] in the order of their
    scales, layer after layer."""
    codes, scales = (np.stack([np.asarray(b) for b in buffers[i::4]]) for i in (0, 1))
    if bits == 4:
        nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).astype(np.int64)
        codes = (nibbles ^ 8) - 8
    s = scales.astype(np.float64).reshape(-1, 1)
    return codes.reshape(-1, 64) * s, np.broadcast_to(s, (s.shape[0], 64))


# ---- the property


def keys_with_outliers(rng: np.random.Generator, shape, bias, positions) -> np.ndarray:
    """K = RoPE(x W + b) as a Qwen2 layer makes it: Gaussian projections plus the bias (whose
    low-frequency channels hold outliers), rotated at `positions`, in bfloat16."""
    n, b, s, k, h = shape
    proj = rng.standard_normal(shape) * np.exp2(rng.uniform(-4, 4, (n, 1, 1, k, 1)))
    pre = proj + bias[:, None, None]
    rotated = np.stack([rope(pre[:, i], positions) for i in range(b)], axis=1)
    return np.asarray(jnp.asarray(rotated, jnp.bfloat16).astype(jnp.float32), np.float64)


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from(FORMATS), bits=st.sampled_from([8, 4]),
       seq=st.sampled_from([1, 37, 64, 100]), kh=st.sampled_from([(1, 64), (2, 128)]),
       n=st.integers(1, 2))
def test_round_trip_against_float64_reference(seed, fmt, bits, seq, kh, n):
    rng = np.random.default_rng(seed)
    (k, h), layer, start = kh, int(rng.integers(0, LAYERS - n + 1)), int(rng.integers(0, 4000))
    cfg, shape = config(k, h), (n, 2, seq, k, h)
    bias = np.asarray(jnp.asarray(rng.standard_normal((LAYERS, k, h)), jnp.bfloat16), np.float64)
    bias[:, :, [h // 2 - 1, h - 1]] *= rng.uniform(50, 1000)  # Qwen2.5-like outliers
    positions = np.arange(start, start + seq, dtype=np.float64)
    x = keys_with_outliers(rng, shape, bias[layer:layer + n], positions)
    codec = PrefixCodec(bits, fmt, cfg, jnp.asarray(bias, jnp.float32))
    prefix = KVCache.stacked(jnp.asarray(x, jnp.bfloat16), jnp.asarray(x, jnp.bfloat16))
    buffers, _ = pack_prefix(prefix, codec, layer=layer, start=start)
    restored = np.asarray(unpack_prefix(buffers, codec, jnp.bfloat16, layer=layer,
                                        start=start).k, np.float64)

    # the wire holds the reference's quantizer input within half a step of its own scale, up to
    # float32 arithmetic (generously: 2**-20 of what is added, 2**-15 of what is rotated)
    rb = rope_bias(x, fmt, bias[layer:layer + n], positions)
    groups = grouped(rotated(x - rb, fmt), fmt)
    y = groups.reshape(-1, 64)
    sent, scale = wire_keys(buffers, bits)
    ref, ref_scale = group_round_trip(y, bits)
    assert sent.shape == y.shape
    noise = 2.0**-20 * grouped(np.abs(x) + np.abs(rb), fmt).reshape(-1, 64).max(-1, keepdims=True)
    if "hadamard" in fmt:
        noise = noise + 2.0**-15 * grouped(np.abs(x - rb), fmt).reshape(-1, 64).max(
            -1, keepdims=True)
    clip = np.abs(np.abs(y).max(-1, keepdims=True) - QMAX[bits] * scale)  # a clipped code's
    assert np.all(np.abs(sent - y) <= np.maximum(scale / 2, clip) + noise)
    assert np.all(np.abs(scale - ref_scale) <= 2.0**-10 * ref_scale + noise)
    # where the scales agree, a code differs from the reference's only next to a rounding tie
    same = np.broadcast_to(scale == ref_scale, y.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        off_tie = np.abs(np.abs(y) / scale % 1 - 0.5) > noise / scale
    assert not np.any(same & off_tie & (sent != ref))
    assert np.mean(same) > 0.9

    # the round trip lies within the format's bound, and so does the float64 reference's
    bound = key_error_bound(x, bits, fmt, jnp.bfloat16,
                            KeyBias(bias, THETA ** (-np.arange(0, h, 2) / h)), layer, start)
    assert np.all(np.abs(restored - x) <= bound)
    back = ungrouped(ref.reshape(groups.shape), fmt, shape)
    if "hadamard" in fmt:
        back = (back.reshape(*shape[:-1], -1, 64) @ walsh(64).T).reshape(shape)
    assert np.all(np.abs(back + rb - x) <= bound)


@pytest.mark.parametrize("bits", [8, 4])
def test_bias_aware_formats_remove_the_outliers_error(bits):
    """With a k_proj bias 500x the projections in two low-frequency channels, the paper's groups
    round the rest of the head away at Q4; debias (alone or with the others) does not."""
    rng = np.random.default_rng(bits)
    cfg, shape = config(2, 64), (1, 1, 128, 2, 64)
    bias = np.zeros((LAYERS, 2, 64))
    bias[:, :, [31, 63]] = 500.0
    x = keys_with_outliers(rng, shape, bias[:1], np.arange(128.0))
    prefix = KVCache.stacked(jnp.asarray(x, jnp.bfloat16), jnp.asarray(x, jnp.bfloat16))
    rms = {}
    for fmt in PREFIX_FORMATS:
        codec = PrefixCodec(bits, fmt, cfg, jnp.asarray(bias, jnp.float32))
        got = np.asarray(unpack_prefix(pack_prefix(prefix, codec)[0], codec, jnp.bfloat16).k)
        rms[fmt] = np.sqrt(np.mean((got - x)[..., [c for c in range(64) if c % 32 != 31]] ** 2))
    assert all(rms[f] < rms[PAPER] / 5 for f in ("debias", "debias+hadamard",
                                                  "debias+per-channel")), rms


@pytest.mark.parametrize("fmt", PREFIX_FORMATS)
@pytest.mark.parametrize("seq", [64, 100])
def test_payload_bytes_and_specs_equal_the_formula(fmt, seq):
    cfg = ModelConfig.preset("tiny")
    params = {"layers": [{"attn": {"k_bias": jnp.ones((2, 64))}}] * cfg.num_layers}
    kv_shape = (3, 2, seq, cfg.num_kv_heads, cfg.head_dim)
    prefix = KVCache.stacked(*(jax.random.normal(jax.random.key(i), kv_shape, jnp.bfloat16)
                               for i in range(2)))
    for bits in (8, 4):
        action = Action(bits, 3, cfg.num_layers, fmt)
        codec = PrefixCodec.of(cfg, params, action)
        sent, _ = pack_prefix(prefix, codec)
        payload = sizes.action_bytes(cfg, action, seq, 2).prefix_payload_bytes
        assert sum(len(np.asarray(b).tobytes()) for b in sent) == payload == sizes.prefix_bytes(
            cfg, seq, 3, bits, 2, fmt)
        assert [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in sent] == prefix_specs(
            cfg, codec, 2, seq, 3, jnp.bfloat16)
    key_tokens = -(-seq // 64) * 64 if "per-channel" in fmt else seq
    elements = 2 * 3 * cfg.num_kv_heads * cfg.head_dim  # per token: B * c * K * H
    assert sizes.prefix_bytes(cfg, seq, 3, 4, 2, fmt) == (
        elements * key_tokens * (4 / 8 + 2 / 64) + elements * seq * (4 / 8 + 2 / 64))


def test_formats_in_actions_and_their_text():
    assert str(Action.parse("q4:r=2/debias+hadamard", 6)) == "q4:r=2/debias+hadamard"
    assert str(Action.parse("q8:full/paper", 6)) == "q8:full"  # the default is never written
    assert Action.parse("q4:3/per-channel", 6) == Action(4, 3, 6, "per-channel")
    assert [str(a) for a in parse_actions("bf16:r=2,q4:full", 6, ["paper", "debias"])] == [
        "bf16:r=2", "q4:full", "q4:full/debias"]
    assert len(list(action_space(2, (16, 8, 4), PREFIX_FORMATS))) == 2 + 2 * 2 * 6 + 1
    for bad, match in [("bf16:r=2/debias", "applies to a Q8/Q4 prefix"),
                       ("q4:r=2/hadamard+per-channel", "unknown prefix format"),
                       ("q4:r=2/Debias", "unknown prefix format")]:
        with pytest.raises(ValueError, match=match):
            Action.parse(bad, 6)
    qwen3 = ModelConfig.preset("tiny-qwen3")
    with pytest.raises(ValueError, match="has no k_proj bias"):
        PrefixCodec.of(qwen3, {}, Action(4, 3, 6, "debias"))
