"""Byte accounting: the paper's published payloads (§2.2, Table 3) and Eqs. 3, 5, 6, 7."""

import json

import pytest

from rekv_jax import sizes
from rekv_jax.action import Action, action_space
from rekv_jax.cli.main import main
from rekv_jax.config import MODEL_PRESETS, ModelConfig

MIB = 2**20
QWEN7B = ModelConfig.preset("qwen2.5-7b")


def test_paper_payloads_qwen25_7b_8k():
    assert sizes.boundary_bytes(QWEN7B, 8192) == 56 * MIB
    assert sizes.kv_layer_bytes(QWEN7B, 8192) == 16 * MIB
    assert sizes.kv_layer_bytes(QWEN7B, 8192, bits=8) == 8.25 * MIB
    assert sizes.handoff_bytes(QWEN7B, 8192, 16, 28).total_mib == 448.00
    assert sizes.handoff_bytes(QWEN7B, 8192, 8, 28).total_mib == 231.00
    joint = sizes.handoff_bytes(QWEN7B, 8192, 8, 15)
    assert joint.total_mib == 179.75
    assert joint.boundary_bytes == 56 * MIB and joint.prefix_payload_bytes == 15 * 8.25 * MIB


@pytest.mark.parametrize("name, ratio", [("qwen2.5-7b", 3.5), ("llama-3.1-8b", 2.0)])
def test_boundary_to_kv_ratio(name, ratio):
    cfg = ModelConfig.preset(name)
    assert sizes.boundary_bytes(cfg, 8192) / sizes.kv_layer_bytes(cfg, 8192) == ratio
    assert ratio == cfg.num_heads / (2 * cfg.num_kv_heads)  # Eq. 3


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_bf16_cut_saves_bytes_iff_eq6(name):
    cfg = ModelConfig.preset(name)
    L = cfg.num_layers
    full = sizes.handoff_bytes(cfg, 1024, 16, L).total_bytes
    assert cfg.hidden_size == cfg.num_heads * cfg.head_dim  # Eq. 3 premise
    threshold = cfg.num_heads / (2 * cfg.num_kv_heads)
    for r in range(1, L):
        saves = sizes.handoff_bytes(cfg, 1024, 16, L - r).total_bytes < full
        assert saves == (r > threshold), (name, r)
    assert sizes.model_sizes(cfg, 1024).min_saving_suffix_bf16 == int(threshold) + 1


def test_qwen25_7b_needs_four_suffix_layers():
    assert sizes.model_sizes(QWEN7B, 8192).min_saving_suffix_bf16 == 4


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_eq5_eq7_interior_cut(bits, batch):
    cfg = ModelConfig.preset("qwen3-8b")
    S, c = 512, 11
    E = 2 * batch * S * cfg.num_kv_heads * cfg.head_dim
    b_kv = E * 2 if bits == 16 else E * bits // 8 + E // 64 * 2
    got = sizes.handoff_bytes(cfg, S, bits, c, batch)
    assert got.total_bytes == c * b_kv + batch * S * cfg.hidden_size * 2
    assert got.kind == "joint" and got.suffix_len == cfg.num_layers - c


def test_endpoints_transfer_and_recompute():
    cfg = ModelConfig.preset("tiny")
    transfer = sizes.handoff_bytes(cfg, 256, 4, cfg.num_layers, batch=2)
    assert transfer.boundary_bytes == 0 and transfer.token_bytes == 0
    assert transfer.total_bytes == cfg.num_layers * sizes.kv_layer_bytes(cfg, 256, 2, 4)
    recompute = sizes.handoff_bytes(cfg, 256, 16, 0, batch=2)
    assert recompute.total_bytes == recompute.token_bytes == 2 * 256 * 4
    assert recompute.prefix_payload_bytes == recompute.boundary_bytes == 0


def test_action_bytes_matches_handoff_bytes():
    cfg = ModelConfig.preset("tiny")
    for a in action_space(cfg.num_layers):
        assert sizes.action_bytes(cfg, a, 100) == sizes.handoff_bytes(cfg, 100, a.bits, a.cut)
    with pytest.raises(ValueError, match="layers"):
        sizes.action_bytes(cfg, Action(8, 3, cfg.num_layers + 1), 100)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0, bits=8, cut=3), "seq_len"),
    (dict(seq_len=8, bits=6, cut=3), "bits"),
    (dict(seq_len=8, bits=8, cut=7), "cut"),
    (dict(seq_len=8, bits=8, cut=3, batch=0), "batch"),
])
def test_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sizes.handoff_bytes(ModelConfig.preset("tiny"), **kwargs)


def test_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="group size"):
        sizes.quantized_bytes(96 * 10, 96, 8)


def test_cli_bytes_prints_one_json_line(capsys):
    main(["bytes", "--model", "qwen2.5-7b", "--seq-len", "8192", "--bits", "8", "--cut", "15",
          "--json"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out == sizes.handoff_bytes(QWEN7B, 8192, 8, 15).to_json()
    assert out["total_mib"] == 179.75
    main(["bytes", "--model", "qwen2.5-7b", "--seq-len", "8192", "--bits", "8", "--cut", "15"])
    assert "= 179.75 MiB" in capsys.readouterr().out  # the readable form says the same


def test_cli_bytes_bad_cut_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bytes", "--model", "qwen2.5-7b", "--cut", "29"])
    assert e.value.code == 2
    assert "cut must be" in capsys.readouterr().err


def test_cli_info_reports_sizes(capsys):
    main(["info", "--model", "qwen2.5-7b", "--seq-len", "8192", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["sizes"] == sizes.model_sizes(QWEN7B, 8192).to_json()
    assert out["sizes"]["boundary_to_kv_layer"] == 3.5


def test_layer_weights_match_qwen25_7b_non_embedding_count():
    # Qwen2.5 report: 6.53B non-embedding parameters (biases and norms are the small rest).
    cfg = ModelConfig.preset("qwen2.5-7b")
    assert 28 * sizes.layer_weight_count(cfg) == pytest.approx(6.53e9, rel=0.005)


@pytest.mark.parametrize("prompt, more", [(8192, 1), (512, 512), (1, 7)])
def test_layer_flops_of_a_prompt_then_more_tokens_add_up(prompt, more):
    """A cache extended by `more` tokens costs what the longer prompt costs, weights and keys."""
    cfg = ModelConfig.preset("qwen3-8b")
    split = sizes.layer_flops(cfg, prompt, 2) + sizes.layer_flops(cfg, more, 2, past=prompt)
    assert split == sizes.layer_flops(cfg, prompt + more, 2)
    assert sizes.head_flops(cfg, 3, 2) == 2 * 2 * 3 * cfg.hidden_size * cfg.vocab_size


@pytest.mark.parametrize("seq, padded", [(8192, 8192), (100, 128), (1, 64), (64, 64)])
def test_per_channel_keys_count_whole_token_groups(seq, padded):
    """Keys grouped per channel along tokens: one FP16 scale per 64 tokens of a channel, the same
    scales per element as the paper's; a last partial group is padded to 64 tokens. Every other
    format sends the paper's bytes."""
    cfg = ModelConfig.preset("qwen3-8b")
    per_token = 3 * cfg.num_kv_heads * cfg.head_dim  # batch 3
    for bits in (8, 4):
        want = (per_token * padded + per_token * seq) * (bits / 8 + 2 / 64)
        assert sizes.kv_layer_bytes(cfg, seq, 3, bits, "per-channel") == want
        assert sizes.kv_layer_bytes(cfg, seq, 3, bits, "debias+per-channel") == want
        paper = sizes.kv_layer_bytes(cfg, seq, 3, bits)
        for fmt in ("debias", "hadamard", "debias+hadamard"):
            assert sizes.kv_layer_bytes(cfg, seq, 3, bits, fmt) == paper
        assert sizes.format_layer_bytes(paper, seq, "per-channel") == want
    with pytest.raises(ValueError, match="Q8/Q4"):
        sizes.kv_layer_bytes(cfg, seq, 1, 16, "per-channel")


def test_cli_bytes_of_a_prefix_format(capsys):
    args = ["bytes", "--model", "qwen2.5-7b", "--seq-len", "8100", "--bits", "4", "--cut", "15"]
    main([*args, "--prefix-format", "per-channel", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out == sizes.handoff_bytes(QWEN7B, 8100, 4, 15, 1, "per-channel").to_json()
    assert out["format"] == "per-channel" and out["prefix_payload_bytes"] > (
        sizes.handoff_bytes(QWEN7B, 8100, 4, 15).prefix_payload_bytes)
    main([*args, "--prefix-format", "per-channel"])
    text = capsys.readouterr().out
    assert "4-bit per-channel prefix" in text and "8100 tokens padded to 8128" in text
    main([*args, "--json"])
    assert "format" not in json.loads(capsys.readouterr().out)  # the paper's: as before
