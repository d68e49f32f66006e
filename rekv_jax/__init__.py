"""rekv-jax: ReKV prefill->decode handoff (quantized prefix KV + recomputed suffix) in JAX."""

from rekv_jax.action import Action, action_space, parse_actions
from rekv_jax.config import PRESETS, Llama3RopeScaling, ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.model import (
    decode_step,
    extend,
    forward,
    greedy_decode,
    init_params,
    prefill,
    run_layers,
    run_prefix,
    run_suffix,
)
from rekv_jax.params import load_hf, restore_params, save_hf, save_params

__all__ = [
    "PRESETS", "Action", "KVCache", "Llama3RopeScaling", "ModelConfig", "action_space",
    "decode_step", "extend", "forward", "greedy_decode", "init_params", "load_hf", "parse_actions",
    "prefill", "restore_params", "run_layers", "run_prefix", "run_suffix", "save_hf", "save_params",
]
