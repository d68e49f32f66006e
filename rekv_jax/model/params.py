"""Weights in and out: HF safetensors checkpoints (no torch) and orbax checkpoints.

One small regex table maps HF tensor names to entries of the model's param dict and says how to
reshape them (HF stores `[out, in]` matrices; the model uses `[in, out]` with heads split out).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from safetensors.numpy import save_file

from rekv_jax.config import ModelConfig
from rekv_jax.model.transformer import Params, check_params

# One row per tensor kind: (HF name, param path, variants of {x}, HF -> ours, ours -> HF).
# `{i}` is the layer index (params["layers"] is a list of per-layer dicts).
_Reshape = Callable[[np.ndarray, ModelConfig], np.ndarray]
_SAME: _Reshape = lambda w, c: w  # noqa: E731
_T: _Reshape = lambda w, c: w.T  # noqa: E731
_HF_MAP: list[tuple[str, str, str, _Reshape, _Reshape]] = [
    ("model.embed_tokens.weight", "embed", "", _SAME, _SAME),
    ("model.norm.weight", "final_norm/weight", "", _SAME, _SAME),
    ("lm_head.weight", "lm_head", "", _T, _T),  # [V, D] <-> [D, V]
    ("model.layers.{i}.self_attn.{x}_proj.weight", "layers/{i}/attn/{x}_proj", "q|k|v",
     lambda w, c: w.T.reshape(c.hidden_size, -1, c.head_dim),  # [n*H, D] -> [D, n, H]
     lambda w, c: w.reshape(c.hidden_size, -1).T),
    ("model.layers.{i}.self_attn.{x}_proj.bias", "layers/{i}/attn/{x}_bias", "q|k|v",
     lambda w, c: w.reshape(-1, c.head_dim), lambda w, c: w.reshape(-1)),  # [n*H] <-> [n, H]
    ("model.layers.{i}.self_attn.o_proj.weight", "layers/{i}/attn/o_proj", "",
     lambda w, c: w.T.reshape(-1, c.head_dim, c.hidden_size),  # [D, N*H] -> [N, H, D]
     lambda w, c: w.reshape(-1, c.hidden_size).T),
    ("model.layers.{i}.self_attn.{x}_norm.weight", "layers/{i}/attn/{x}_norm/weight", "q|k",
     _SAME, _SAME),
    ("model.layers.{i}.mlp.{x}_proj.weight", "layers/{i}/mlp/{x}_proj", "gate|up|down", _T, _T),
    ("model.layers.{i}.input_layernorm.weight", "layers/{i}/input_norm/weight", "", _SAME, _SAME),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers/{i}/post_attn_norm/weight", "",
     _SAME, _SAME),
]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # buffers some old checkpoints carry


def _regex(template: str, variants: str) -> re.Pattern:
    """`model.layers.{i}.mlp.{x}_proj.weight` -> a pattern with groups `i` and `x`."""
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)")
    return re.compile(pattern.replace(r"\{x\}", f"(?P<x>{variants})"))


def _match(name: str, column: int) -> tuple[re.Match, tuple] | None:
    """The table row whose column (0: HF name, 1: param path) matches `name`."""
    for row in _HF_MAP:
        m = _regex(row[column], row[2]).fullmatch(name)
        if m:
            return m, row
    return None


def _set(tree: dict, path: str, value) -> None:
    """Set `tree[a][b]... = value` for path "a/b/..."; a digit indexes the list of layers."""
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree[int(p)] if p.isdigit() else tree.setdefault(p, {})
    tree[leaf] = value


def open_hf(path: str | Path) -> tuple[ModelConfig, list[Path]]:
    """An HF checkpoint folder's config and weight files, checked (present, readable) before any
    weight is read; ValueError naming the folder or file otherwise."""
    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{index}: not a readable weight index ({e!r})") from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files")
    unreadable = [f.name for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise ValueError(f"{path}: weight files missing or unreadable: {unreadable}")
    return cfg, files


def load_hf(path: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, Params]:
    """Read an HF checkpoint folder (config.json + safetensors, single or sharded) into params."""
    cfg, files = open_hf(path)
    params: Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:  # memory-mapped
            for name in f.keys():
                if _IGNORED.fullmatch(name) or (cfg.tie_embeddings and name == "lm_head.weight"):
                    continue
                found = _match(name, 0)
                if found is None:
                    raise ValueError(f"{file.name}: tensor {name!r} has no place in {cfg.name}")
                m, (_, target, _, to_ours, _) = found
                if int(m.groupdict().get("i") or 0) >= cfg.num_layers:
                    raise ValueError(f"{file.name}: tensor {name!r} is past the "
                                     f"{cfg.num_layers} layers of config.json")
                target = target.format(**m.groupdict())
                _set(params, target, jnp.asarray(to_ours(f.get_tensor(name), cfg).astype(dtype)))
    check_params(cfg, params)
    return cfg, params


def save_hf(path: str | Path, cfg: ModelConfig, params: Params) -> None:
    """Write params as an HF checkpoint folder (`model.safetensors` + `config.json`)."""
    check_params(cfg, params)
    tensors = {}
    for p, w in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(p, simple=True, separator="/")
        m, (hf_name, *_, to_hf) = _match(key, 1)
        tensors[hf_name.format(**m.groupdict())] = np.ascontiguousarray(to_hf(np.asarray(w), cfg))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))


def save_params(path: str | Path, cfg: ModelConfig, params: Params) -> None:
    """Write an orbax checkpoint of params plus `rekv_config.json` beside it."""
    check_params(cfg, params)
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params)
    (path / "rekv_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))


def restore_params(path: str | Path) -> tuple[ModelConfig, Params]:
    """Read what `save_params` wrote: (config, params)."""
    path = Path(path).absolute()
    cfg = ModelConfig.from_dict(json.loads((path / "rekv_config.json").read_text()))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(path / "params")
    if isinstance(params["layers"], dict):  # the old stacked layout: leaves [L, ...] or [1, ...]
        params["layers"] = unstack_layers(params["layers"], cfg.num_layers)
    check_params(cfg, params)
    return cfg, params


def unstack_layers(stacked: dict, num_layers: int) -> list[dict]:
    """A stacked layer dict (leaves `[L, ...]`, or `[1, ...]` shared by every layer) as the list
    of per-layer dicts params hold; a shared layer becomes one dict at every index."""
    if all(w.shape[0] == 1 for w in jax.tree.leaves(stacked)):
        return [jax.tree.map(lambda w: w[0], stacked)] * num_layers
    return [jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(num_layers)]
