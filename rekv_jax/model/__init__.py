"""The model: the transformer (modules, layer program, functional API), its parameters (HF
safetensors, orbax), the one loader, and the decode side's paged cache and batched step
(`paged`)."""

from rekv_jax.model.transformer import (
    KVCache,
    Params,
    decode_step,
    extend,
    forward,
    init_params,
    new_cache,
    prefill,
    run_chunk,
    run_layers,
    run_prefix,
    run_suffix,
    token_chunks,
)

__all__ = ["KVCache", "Params", "decode_step", "extend", "forward", "init_params", "new_cache",
           "prefill", "run_chunk", "run_layers", "run_prefix", "run_suffix", "token_chunks"]
