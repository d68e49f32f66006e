"""Turn a `--model` spec into a config, weights and (when it has one) a tokenizer: the one loader.

A spec is one of
  * a preset name (`tiny`, `qwen2.5-7b`, ...; `MODEL_PRESETS`): synthetic weights from a seed.
    A preset whose weights would exceed `SHARE_LAYERS_ABOVE_BYTES` gets one layer's weights
    shared by all layers (the paper's model-shaped timing benchmark), and says so in `weights`;
  * `hf:PATH`: an HF checkpoint folder (`config.json` + safetensors);
  * the path of a trained-model folder holding `orbax/` (as `scripts/train_tiny.py` writes, e.g.
    the shipped `SHIPPED_MODEL`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer

from rekv_jax.config import MODEL_PRESETS, ModelConfig
from rekv_jax.model.chat_template import ChatTemplate, read_chat_template

if TYPE_CHECKING:
    from rekv_jax.model.transformer import Params

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "wt2-tiny"
SHARE_LAYERS_ABOVE_BYTES = 2 * 2**30  # synthetic weights larger than this share one layer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizer.json` file, or the folder holding one."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def eos_ids(spec: str) -> tuple[int, ...]:
    """The EOS token ids of a trained-model folder or `hf:PATH` checkpoint: `eos_token_id` (an
    id or a list) of its `generation_config.json`, else of its `config.json`; () for a preset
    or a folder that names none (reads files only, like `tokenizer_of`)."""
    if spec in MODEL_PRESETS:
        return ()
    folder = Path(spec.removeprefix("hf:"))
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
        if eos is not None:
            return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


def tokenizer_of(spec: str) -> Tokenizer | None:
    """The tokenizer beside a trained-model folder or `hf:PATH` checkpoint, if it has one
    (reads files only: no JAX call, so it may run before jax.distributed starts)."""
    folder = Path(spec.removeprefix("hf:"))
    return load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None


def chat_template_of(spec: str) -> ChatTemplate | None:
    """The chat template of a trained-model folder or `hf:PATH` checkpoint, if it has one
    (`chat_template.read_chat_template`; reads files only, as `tokenizer_of`)."""
    folder = Path(spec.removeprefix("hf:"))
    return read_chat_template(folder) if folder.is_dir() else None


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: config, params (nested dict of arrays) and where they came from."""

    cfg: ModelConfig
    params: Params  # nested dict of arrays
    weights: str  # e.g. "synthetic (seed 0)", "hf:PATH", "orbax PATH"
    tokenizer: Tokenizer | None = None  # for checkpoints that ship a tokenizer.json
    eos_ids: tuple[int, ...] = ()  # the tokens that end a generation (`eos_ids`)


def _orbax_folder(spec: str) -> Path:
    folder = Path(spec)
    if not (folder / "orbax").is_dir():
        raise ValueError(f"--model {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}), not "
                         "hf:PATH, and not a trained-model folder holding orbax/")
    return folder


def load_config(spec: str) -> ModelConfig:
    """The config of a spec, without loading any weights. Its `name` is the model's one name
    (what profiles, gate results and records call it), however its weights are read: a
    preset's name, an `hf:PATH` checkpoint's PATH, a trained-model folder's own name (its
    `rekv_config.json`, the same for a relative and an absolute path)."""
    if spec.startswith("hf:"):  # checked: config and weight files, none read yet
        from rekv_jax.model.params import open_hf

        return open_hf(spec[3:])[0]
    if spec in MODEL_PRESETS:
        return ModelConfig.preset(spec)
    folder = _orbax_folder(spec)
    return ModelConfig.from_dict(json.loads((folder / "orbax" / "rekv_config.json").read_text()))


def synthetic_weight_bytes(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> int:
    """Bytes of the fully materialized synthetic weights of `cfg` (shapes only, nothing runs)."""
    from rekv_jax.model.transformer import init_params

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def synthetic_model(cfg: ModelConfig, seed: int = 0, dtype: jnp.dtype = jnp.bfloat16
                    ) -> LoadedModel:
    """Synthetic weights of `cfg` from `seed`; one layer's weights shared by all layers when the
    full stack would exceed `SHARE_LAYERS_ABOVE_BYTES` (said in `weights`)."""
    from rekv_jax.model.transformer import init_params

    nbytes = synthetic_weight_bytes(cfg, dtype)
    share = nbytes > SHARE_LAYERS_ABOVE_BYTES
    weights = (f"synthetic (seed {seed}, one layer shared by all {cfg.num_layers}: "
               f"{nbytes / 2**30:.1f} GiB > {SHARE_LAYERS_ABOVE_BYTES / 2**30:g} GiB)"
               if share else f"synthetic (seed {seed})")
    return LoadedModel(cfg, init_params(cfg, jax.random.key(seed), dtype, share), weights)


def load_model(spec: str, seed: int = 0, dtype: jnp.dtype = jnp.bfloat16, orbax: bool = True
               ) -> LoadedModel:
    """Config, weights and tokenizer of a spec (see the module docstring). Not `orbax`: a
    trained-model folder is read from its HF safetensors (an orbax restore would synchronize
    with the peer process of a pair that does not restore too)."""
    from rekv_jax.model.params import load_hf, restore_params

    if spec.startswith("hf:") or not (orbax or spec in MODEL_PRESETS):
        cfg, params = load_hf(Path(spec.removeprefix("hf:")), dtype)
        cfg = dataclasses.replace(cfg, name=load_config(spec).name)  # the spec's one name
        return LoadedModel(cfg, params, f"hf:{spec.removeprefix('hf:')}", tokenizer_of(spec),
                           eos_ids(spec))
    if spec in MODEL_PRESETS:
        return synthetic_model(ModelConfig.preset(spec), seed, dtype)
    folder = _orbax_folder(spec)
    cfg, params = restore_params(folder / "orbax")
    return LoadedModel(cfg, params, f"orbax {folder}", load_tokenizer(folder), eos_ids(spec))
