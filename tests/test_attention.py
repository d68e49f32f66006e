"""Attention backends: how `auto` resolves, how `cudnn` refuses, the cuDNN path lowered for CUDA.

Lowering the cuDNN path needs no GPU except for one probe: before lowering, JAX asks the
installed CUDA plugin for the cuDNN version (`check_cudnn_version` of JAX's private fused
attention module, `jax_private.cudnn_attention`), and a CPU-only install has no plugin ("cuDNN
is not detected"). The lowering test stubs that single probe with a cuDNN 9.8 answer; everything
else (shape, dtype, mask and head-dim checks, the choice of cuDNN mask type) is JAX's own code.
Whether the cuDNN kernel then runs, and runs bitwise exact, is checked on a GPU by
tests/test_model.py (which adds the cudnn backend there) and by `rekv doctor`.
"""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import pytest

from rekv_jax import KVCache, ModelConfig
from rekv_jax.action import Action
from rekv_jax.errors import RuntimeMismatch
from rekv_jax.jax_private import cudnn_attention
from rekv_jax.model.transformer import (
    _cache_layer,
    _prompt_layer,
    attention_backend,
    attention_width,
    choose_attention,
    init_params,
    prefill,
)
from rekv_jax.study import experiment


@pytest.mark.parametrize("platform, dtype, want", [
    ("gpu", jnp.bfloat16, "cudnn"), ("gpu", jnp.float16, "cudnn"), ("gpu", jnp.float32, "xla"),
    ("cpu", jnp.bfloat16, "xla"), ("cpu", jnp.float32, "xla"), ("tpu", jnp.bfloat16, "xla"),
])
def test_auto_resolves_by_platform_and_dtype(platform, dtype, want):
    assert choose_attention("auto", platform, dtype) == want
    assert choose_attention("xla", platform, dtype) == "xla"


@pytest.mark.parametrize("platform, dtype", [("cpu", jnp.bfloat16), ("gpu", jnp.float32)])
def test_cudnn_where_it_cannot_run_is_one_clear_error(platform, dtype):
    with pytest.raises(ValueError, match="'cudnn' needs a CUDA GPU and bfloat16/float16"):
        choose_attention("cudnn", platform, dtype)


def test_config_field_then_env_then_auto(monkeypatch):
    cfg = ModelConfig.preset("tiny")
    monkeypatch.delenv("REKV_ATTENTION", raising=False)
    assert attention_backend(cfg, jnp.bfloat16) == "xla"  # auto on CPU
    monkeypatch.setenv("REKV_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="'cudnn' needs"):
        attention_backend(cfg, jnp.bfloat16)
    assert attention_backend(dataclasses.replace(cfg, attention="xla"), jnp.bfloat16) == "xla"
    params = init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="'cudnn' needs"):  # before any JAX traceback
        prefill(cfg, params, jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="unknown attention backend"):
        ModelConfig(**{**cfg.to_dict(), "rope_scaling": None, "attention": "flash"})


def test_attention_is_not_written_to_hf_config():
    cfg = dataclasses.replace(ModelConfig.preset("qwen2.5-7b"), attention="xla")
    assert "attention" not in cfg.to_hf()
    assert ModelConfig.from_hf(cfg.to_hf(), name=cfg.name).attention == "auto"
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def _lowered(cfg: ModelConfig, weights: dict, cache: KVCache | None) -> str:
    """A layer's program lowered for CUDA: the prompt program (every prefill, prefix and suffix
    runs it), or with a cache the decode step's program at its last position."""
    cuda = ("cuda",)
    if cache is None:
        x = jax.ShapeDtypeStruct((1, 256, cfg.hidden_size), jnp.bfloat16)
        positions = jax.ShapeDtypeStruct((1, 256), jnp.int32)
        return _prompt_layer.trace(cfg, weights, x, positions).lower(
            lowering_platforms=cuda).as_text()
    x = jax.ShapeDtypeStruct((1, 1, cfg.hidden_size), jnp.bfloat16)
    start = jax.ShapeDtypeStruct((), jnp.int32)
    width = attention_width(cache.seq_len, cache.seq_len)
    return _cache_layer.trace(cfg, weights, x, cache.keys[0], cache.values[0], start,
                              width=width).lower(lowering_platforms=cuda).as_text()


def test_cudnn_path_lowers_for_cuda(monkeypatch):
    """Qwen3-8B-shaped heads (n_h 32, n_kv 8, H 128): the causal prompt path becomes cuDNN's
    fused causal softmax, the cache path its fused bias softmax (the mask)."""
    monkeypatch.setattr(cudnn_attention(), "check_cudnn_version", lambda: 90800)
    base = dataclasses.replace(ModelConfig.preset("qwen3-8b"), num_layers=2, hidden_size=512,
                               intermediate_size=256, vocab_size=256)
    params = jax.eval_shape(lambda: init_params(base, jax.random.key(0), repeat_layers=True))
    cache = jax.eval_shape(lambda: prefill(base, params, jnp.zeros((1, 300), jnp.int32))[0])
    for attention in ("cudnn", "xla"):
        cfg = dataclasses.replace(base, attention=attention)
        prompt = _lowered(cfg, params["layers"][0], None)
        step = _lowered(cfg, params["layers"][0], cache)
        assert ("__cudnn$fmhaSoftmax" in prompt) == (attention == "cudnn")
        assert ("__cudnn$fmhaScaleBiasSoftmax" in step) == (attention == "cudnn")
        assert "__cudnn$fmhaSoftmax" not in step  # the cache path never uses the causal type


def test_handoff_sides_must_agree_on_the_attention_backend(monkeypatch):
    """Different backends give different bits: a handoff between them fails on the agreement."""
    monkeypatch.setattr(experiment, "attention_backend", lambda cfg, dtype: (
        "cudnn" if threading.current_thread().name == "rekv-prefill" else "xla"))
    exp = experiment.Experiment(seq_len=16, actions=(Action.parse("bf16:full", 6),),
                             transport="local", warmup=0, reps=1, timeout=30.0)
    # a failed run (exit 1), not bad input: the sides' runtime agreement
    with pytest.raises(RuntimeMismatch, match="disagree on attention .decode 'xla', prefill "
                                              "'cudnn'"):
        experiment.run_local(exp, lambda record: None)
