"""Presets equal published HF configs; from_hf reads real files and rejects what we do not run."""

import json

import pytest

from rekv_jax import ModelConfig
from rekv_jax.cli.main import main

# The published config.json of Qwen2.5-7B-Instruct, verbatim (harmless keys included).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize("preset,hf", [("qwen2.5-7b", QWEN25_7B), ("llama-3.1-8b", LLAMA31_8B),
                                       ("qwen3-8b", QWEN3_8B)])
def test_presets_equal_published_configs(preset, hf, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    parsed = ModelConfig.from_hf(tmp_path, name=preset)
    assert parsed == ModelConfig.preset(preset)
    assert ModelConfig.from_hf(parsed.to_hf(), name=preset) == parsed
    assert ModelConfig.from_dict(parsed.to_dict()) == parsed


def test_preset_details():
    q05, q3b = ModelConfig.preset("qwen2.5-0.5b"), ModelConfig.preset("qwen2.5-3b")
    assert (q05.num_layers, q05.hidden_size, q05.num_kv_heads, q05.head_dim) == (24, 896, 2, 64)
    assert q05.tie_embeddings and q05.qkv_bias and q3b.tie_embeddings
    assert (q3b.num_layers, q3b.hidden_size, q3b.num_heads, q3b.intermediate_size) == (
        36, 2048, 16, 11008)
    tiny = ModelConfig.preset("tiny")
    assert tiny.num_layers >= 4 and tiny.model_type == "qwen2"


def test_tiny_7b_has_qwen2_5_7b_proportions():
    """The stand-in keeps what the handoff's ratios depend on: 28 layers, the architecture, and
    B_H / B_KV = 3.5 (boundary over one BF16 KV layer) at every length."""
    from rekv_jax import sizes

    tiny, big = ModelConfig.preset("tiny-7b"), ModelConfig.preset("qwen2.5-7b")
    assert (tiny.num_layers, tiny.model_type, tiny.qkv_bias) == (big.num_layers, "qwen2", True)
    assert (tiny.num_heads, tiny.num_kv_heads, tiny.head_dim, tiny.hidden_size) == (7, 1, 64, 448)
    for s in (256, 512):
        ratio = sizes.boundary_bytes(tiny, s) / sizes.kv_layer_bytes(tiny, s)
        assert ratio == sizes.boundary_bytes(big, s) / sizes.kv_layer_bytes(big, s) == 3.5


def test_qwen3_head_dim_is_not_hidden_over_heads():
    cfg = ModelConfig.from_hf({**QWEN3_8B, "hidden_size": 1024, "num_attention_heads": 16,
                               "num_key_value_heads": 8, "num_hidden_layers": 28})
    assert cfg.head_dim == 128 != cfg.hidden_size // cfg.num_heads
    assert cfg.qk_norm and not cfg.qkv_bias


@pytest.mark.parametrize("change,message", [
    ({"use_sliding_window": True}, "sliding"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"model_type": "mistral"}, "mistral"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_from_hf_rejects_what_is_not_implemented(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**QWEN25_7B, **change})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("gpt-5")


def test_cli_info(capsys):
    main(["info", "--model", "qwen2.5-7b", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["num_layers"] == 28
    # the sizes, from the published config at the CLI's default S = 8192, B = 1
    hf, S = QWEN25_7B, 8192
    D, K = hf["hidden_size"], hf["num_key_value_heads"]
    H = D // hf["num_attention_heads"]
    kv16 = 2 * S * K * H * 2  # K and V, bf16
    scales = 2 * S * K * (H // 64) * 2  # one float16 scale per group of 64
    assert out["sizes"] == {
        "seq_len": S, "batch": 1, "boundary_bytes": S * D * 2, "kv_layer_bytes_bf16": kv16,
        "kv_layer_bytes_q8": kv16 // 2 + scales, "kv_layer_bytes_q4": kv16 // 4 + scales,
        "full_kv_bytes_bf16": hf["num_hidden_layers"] * kv16, "token_bytes": S * 4,
        "boundary_to_kv_layer": 3.5,  # n_h / (2 n_kv), the paper's Eq. 3 ratio for this model
        "min_saving_suffix_bf16": 4}  # smallest r with r * 16 MiB > 56 MiB (Eq. 6)
    with pytest.raises(SystemExit):
        main(["info", "--model", "nope"])
