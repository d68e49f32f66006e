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
    "decode_step": "model", "extend": "model", "forward": "model", "greedy_decode": "model",
    "init_params": "model", "prefill": "model", "run_layers": "model", "run_prefix": "model",
    "run_suffix": "model",
    "load_hf": "params", "restore_params": "params", "save_hf": "params", "save_params": "params",
    "LoadedModel": "loader", "load_config": "loader", "load_model": "loader",
    "Summary": "summary",
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
