"""HF parity (the levanter pattern): tiny random HF model -> save_pretrained -> load_hf -> compare
last-position logits and every layer's K/V in float32 -> round trip through save_hf / orbax."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rekv_jax.model.params import load_hf, restore_params, save_hf, save_params
from rekv_jax.model.transformer import prefill

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
CASES = {
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**COMMON, rope_theta=1e6)),
    # head_dim 32 != hidden 64 / 4 heads, as in Qwen3-0.6B
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**COMMON, head_dim=32)),
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
}


def hf_model(family: str) -> torch.nn.Module:
    """A random HF model whose biases and norm scales are non-trivial too."""
    cls, config = CASES[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def hf_outputs(model, tokens: np.ndarray):
    """(last logits [B, V], K [L, B, S, K, H], V [L, B, S, K, H]) from transformers."""
    with torch.no_grad():
        out = model(torch.tensor(tokens), use_cache=True)
    cache = out.past_key_values
    k = np.stack([layer.keys.numpy() for layer in cache.layers]).transpose(0, 1, 3, 2, 4)
    v = np.stack([layer.values.numpy() for layer in cache.layers]).transpose(0, 1, 3, 2, 4)
    return out.logits[:, -1].numpy(), k, v


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", list(CASES))
def test_parity_with_transformers(family, sharded, tmp_path):
    model = hf_model(family)
    # positions up to 300 cross the llama3 scaling's low/high-frequency wavelengths
    tokens = np.random.default_rng(0).integers(0, 128, (2, 300))
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    cfg, params = load_hf(tmp_path, dtype=jnp.float32)
    assert cfg.model_type == family and cfg.num_layers == 3
    want_logits, want_k, want_v = hf_outputs(model, tokens)
    with jax.default_matmul_precision("float32"):
        kv, logits = prefill(cfg, params, jnp.asarray(tokens, jnp.int32))
    assert np.abs(np.asarray(logits) - want_logits).max() <= 1e-4
    assert np.abs(np.asarray(kv.k) - want_k).max() <= 1e-4
    assert np.abs(np.asarray(kv.v) - want_v).max() <= 1e-4


@pytest.mark.parametrize("family", list(CASES))
def test_round_trip(family, tmp_path):
    model = hf_model(family)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf", dtype=jnp.float32)

    save_hf(tmp_path / "exported", cfg, params)  # ours -> HF: transformers reads it back
    reloaded = type(model).from_pretrained(tmp_path / "exported").eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert dataclasses.replace(load_hf(tmp_path / "exported")[0], name=cfg.name) == cfg

    save_params(tmp_path / "orbax", cfg, params)  # orbax: bitwise the same params and config
    cfg2, params2 = restore_params(tmp_path / "orbax")
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, params2)


def test_unknown_tensor_is_rejected(tmp_path):
    model = hf_model("qwen2")
    state = {**model.state_dict(), "model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    model.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(ValueError, match="extra"):
        load_hf(tmp_path)


def test_a_layer_past_the_config_is_rejected(tmp_path):
    model = hf_model("qwen2")
    extra = model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    state = {**model.state_dict(), "model.layers.99.mlp.up_proj.weight": extra.clone()}
    model.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(ValueError, match="layers.99.* past the"):
        load_hf(tmp_path)
