"""rekv-jax: ReKV prefill->decode handoff (quantized prefix KV + recomputed suffix) in JAX.

The public names below load on first use, so `import rekv_jax` (and the `rekv` command, which
imports only the submodules a subcommand needs) does not pay for JAX, Flax or orbax up front.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "Action": "action", "action_space": "action", "parse_actions": "action",
    "MODEL_PRESETS": "config", "Llama3RopeScaling": "config", "ModelConfig": "config",
    "KVCache": "kv",
    "decode_step": "model.transformer", "extend": "model.transformer",
    "forward": "model.transformer", "greedy_decode": "model.transformer",
    "init_params": "model.transformer", "prefill": "model.transformer",
    "run_layers": "model.transformer", "run_prefix": "model.transformer",
    "run_suffix": "model.transformer",
    "load_hf": "model.params", "restore_params": "model.params", "save_hf": "model.params",
    "save_params": "model.params",
    "LoadedModel": "model.loader", "load_config": "model.loader", "load_model": "model.loader",
    "Summary": "study.records",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'rekv_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rekv_jax.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
