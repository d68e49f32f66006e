"""The model's parameters: their pytree (`Params`), checking a pytree against a config, random
initialization, and which attention backend a process runs a config with.

Params are a plain pytree (optax, orbax and tree utilities work directly):
`{"embed": [V, D], "layers": [L pure dicts of one DecoderLayer], "final_norm": {"weight": [D]},
"lm_head": [D, V] (untied only)}`. Shared weights (`init_params(repeat_layers=True)`) put the same
dict, i.e. the same arrays, at every index.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rekv_jax.config import ATTENTION_BACKENDS, ATTENTION_ENV, ModelConfig
from rekv_jax.model.layers import INIT, DecoderLayer

Params = dict  # {"embed", "layers": [L per-layer dicts], "final_norm", "lm_head"?} of arrays


@functools.lru_cache(maxsize=64)
def layer_def(cfg: ModelConfig) -> nnx.GraphDef:
    return nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, nnx.Rngs(0), jnp.float32)))[0]


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
    """{"attn/q_proj": shape, ...} for a nested dict of arrays."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(x.shape) for p, x in leaves}


@functools.lru_cache(maxsize=64)
def _expected_shapes(cfg: ModelConfig) -> tuple[dict, dict]:
    """(shapes outside the layer stack, shapes of one layer's dict)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    outer = {"embed": (V, D), "final_norm/weight": (D,)}
    if not cfg.tie_embeddings:
        outer["lm_head"] = (D, V)
    layer = nnx.eval_shape(lambda: DecoderLayer(cfg, nnx.Rngs(0), jnp.float32))
    return outer, _shapes(nnx.to_pure_dict(nnx.state(layer)))


@functools.lru_cache(maxsize=64)
def _expected_flat(cfg: ModelConfig) -> tuple[jax.tree_util.PyTreeDef, list[tuple[int, ...]]]:
    leaves, treedef = jax.tree.flatten(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    return treedef, [x.shape for x in leaves]


def check_params(cfg: ModelConfig, params: Params) -> None:
    """Raise ValueError unless `params` has exactly the entries and shapes `cfg` implies."""
    leaves, treedef = jax.tree.flatten(params)
    if (treedef, [getattr(x, "shape", None) for x in leaves]) == _expected_flat(cfg):
        return  # the common case, checked fast: every call (each decode step) runs this
    outer, layer = _expected_shapes(cfg)
    try:
        layers = params["layers"]
        got = {"": _shapes({k: v for k, v in params.items() if k != "layers"})}
        if isinstance(layers, list | tuple):
            got.update({f"layers/{i}/": _shapes(w) for i, w in enumerate(layers)})
    except (AttributeError, KeyError, TypeError):
        raise ValueError("params must be a nested dict of arrays whose 'layers' is a list of "
                         "per-layer dicts (see init_params)") from None
    if not isinstance(layers, list | tuple) or len(layers) != cfg.num_layers:
        held = f"{len(layers)} layers" if isinstance(layers, list | tuple) else type(layers)
        raise ValueError(f"the layer stack params['layers'] must be a list of {cfg.num_layers} "
                         f"per-layer dicts for config {cfg.name!r}, got {held}")
    for prefix, have in got.items():
        want = layer if prefix else outer
        if have.keys() != want.keys():
            raise ValueError(f"params do not match config {cfg.name!r}: missing "
                             f"{sorted(prefix + n for n in want.keys() - have.keys())}, "
                             f"unexpected {sorted(prefix + n for n in have.keys() - want.keys())}")
        for name, shape in want.items():
            if have[name] != shape:
                raise ValueError(f"params[{prefix}{name}] has shape {have[name]}, config "
                                 f"{cfg.name!r} needs {shape}")


def check_tokens(cfg: ModelConfig, tokens: jax.Array, values: bool = True) -> None:
    """Raise ValueError unless tokens are int ids [B, S]; with `values`, also that they are in
    0..V-1 when concrete (a host pull: prompts only, never a decode step's token)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers [B, S], got {tokens.dtype}{tokens.shape}")
    if tokens.shape[1] == 0:
        raise ValueError("tokens must hold at least one position")
    if values and not isinstance(tokens, jax.core.Tracer):
        host = np.asarray(tokens)
        if host.min() < 0 or host.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be in 0..{cfg.vocab_size - 1}, got range "
                             f"{host.min()}..{host.max()}")


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16,
                repeat_layers: bool = False) -> Params:
    """Synthetic weights (N(0, 0.02), unit norms); `repeat_layers` shares one layer's weights
    (the same dict at every index of `params["layers"]`: no extra memory).

    Built op by op, not as one jitted program: XLA:CPU compiles a program of every layer's
    random draws far more slowly, in every process, than the few per-shape programs of the
    draws op by op; the weights are bitwise the same."""
    rngs = nnx.Rngs(key)
    D, V = cfg.hidden_size, cfg.vocab_size
    params = {"embed": INIT(rngs.params(), (V, D), dtype),  # [V, D]
              "layers": [nnx.to_pure_dict(nnx.state(DecoderLayer(cfg, rngs, dtype)))
                         for _ in range(1 if repeat_layers else cfg.num_layers)],
              "final_norm": {"weight": jnp.ones((D,), dtype)}}
    if not cfg.tie_embeddings:
        params["lm_head"] = INIT(rngs.params(), (D, V), dtype)  # [D, V]
    if repeat_layers:
        params["layers"] = params["layers"] * cfg.num_layers
    return params


def choose_attention(requested: str, platform: str, dtype: jnp.dtype) -> str:
    """The concrete attention backend (`xla` or `cudnn`) for a request on a platform and dtype.

    `auto`: cuDNN flash attention on a GPU for bf16/f16 (it refuses float32), XLA otherwise.
    `cudnn` where it cannot run is a ValueError with the reason, not a JAX traceback.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; expected one of "
                         f"{ATTENTION_BACKENDS}")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if requested == "auto":
        return "cudnn" if platform == "gpu" and half else "xla"
    if requested == "cudnn" and not (platform == "gpu" and half):
        raise ValueError(f"attention backend 'cudnn' needs a CUDA GPU and bfloat16/float16 "
                         f"weights; here: {platform}, {jnp.dtype(dtype).name} (use xla or auto)")
    return requested


def attention_backend(cfg: ModelConfig, dtype: jnp.dtype) -> str:
    """The backend this process runs `cfg` with: `cfg.attention`, else $REKV_ATTENTION, else
    `auto`, resolved for this process's platform and the weights' dtype."""
    requested = cfg.attention if cfg.attention != "auto" else os.environ.get(ATTENTION_ENV, "auto")
    return choose_attention(requested, jax.default_backend(), dtype)
