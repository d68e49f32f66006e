"""rekv-jax: ReKV prefill->decode handoff (quantized prefix KV + recomputed suffix) in JAX."""

from rekv_jax.config import PRESETS, Llama3RopeScaling, ModelConfig
from rekv_jax.kv import KVCache

__all__ = ["PRESETS", "KVCache", "Llama3RopeScaling", "ModelConfig"]
