"""Model configuration: one frozen dataclass for the Qwen2 / Qwen3 / Llama decoder family.

`ModelConfig` is hashable, so it can be a static argument of jitted functions. Presets carry the
values of the published HF `config.json` files; `ModelConfig.from_hf` reads such a file and refuses
settings this implementation does not compute (it never silently runs a different model).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

MODEL_TYPES = ("qwen2", "qwen3", "llama")
# How attention is computed: not a property of the weights, but it changes the bits. `auto`
# means cuDNN flash attention on a GPU for bf16/f16, XLA otherwise (`model.attention_backend`).
ATTENTION_BACKENDS = ("auto", "xla", "cudnn")
ATTENTION_ENV = "REKV_ATTENTION"  # overrides `auto` (what `--attention` sets)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE rescaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only GQA transformer (pre-norm, RoPE, SwiGLU)."""

    name: str
    model_type: str  # "qwen2" | "qwen3" | "llama"
    num_layers: int  # L
    hidden_size: int  # D
    num_heads: int  # n_h (query heads)
    num_kv_heads: int  # n_kv (K)
    head_dim: int  # H (not always D / n_h: Qwen3)
    intermediate_size: int  # F
    vocab_size: int  # V
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    tie_embeddings: bool = False  # LM head reuses the embedding matrix
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 32768
    attention: str = "auto"  # one of ATTENTION_BACKENDS; static under jit, never written to HF

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"unknown model_type {self.model_type!r}; expected one of {MODEL_TYPES}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention!r}; expected one of "
                             f"{ATTENTION_BACKENDS}")
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def check_cut(self, cut: int) -> int:
        """Validate a layer cut `c` in `0..L` and return it as an int."""
        if isinstance(cut, bool) or not isinstance(cut, int) or not 0 <= cut <= self.num_layers:
            raise ValueError(f"cut must be an integer in 0..{self.num_layers}, got {cut!r}")
        return cut

    def check_seq_len(self, seq_len: int) -> int:
        """Validate a prompt length `S` in `1..max_position_embeddings` and return it."""
        if not 1 <= seq_len <= self.max_position_embeddings:
            raise ValueError(f"sequence length must be in 1..{self.max_position_embeddings} "
                             f"(the max_position_embeddings of {self.name}), got {seq_len}")
        return seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`."""
        scaling = d.get("rope_scaling")
        return cls(**{**d, "rope_scaling": Llama3RopeScaling(**scaling) if scaling else None})

    def to_hf(self) -> dict[str, Any]:
        """An HF `config.json` dict for this model (inverse of `from_hf`)."""
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "llama": "LlamaForCausalLM"}
        hf = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return hf

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named configuration: published HF models, plus `tiny` for tests and quick runs."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(_PRESETS)}") from None

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any], name: str | None = None
                ) -> ModelConfig:
        """Read an HF `config.json` (a path to it, to its folder, or the parsed dict)."""
        if isinstance(path_or_dict, dict):
            hf = path_or_dict
            name = name or hf.get("_name_or_path") or hf.get("model_type", "hf")
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            elif not path.exists():
                raise ValueError(f"{path}: no such HF checkpoint folder")
            try:
                hf = json.loads(path.read_text())
            except FileNotFoundError:
                raise ValueError(f"{path.parent}: no config.json (not an HF checkpoint folder)"
                                 ) from None
            except OSError as e:
                raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, "
                                 f"column {e.colno})") from None
            if not isinstance(hf, dict):
                raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
            name = name or str(path.parent)
            try:
                return _from_hf_dict(hf, name)
            except KeyError as e:
                raise ValueError(f"{path}: missing field {e.args[0]!r}") from None
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: {e}") from None
        return _from_hf_dict(hf, name)


def _from_hf_dict(hf: dict[str, Any], name: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported HF model_type {model_type!r}; supported: {MODEL_TYPES}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only SiLU (SwiGLU MLP) is implemented")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError("sliding-window attention is enabled in this config; not implemented")
    if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
        raise ValueError(f"attention_bias=True for {model_type} (o_proj bias) is not implemented")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not implemented")

    # transformers >= 5 writes `rope_parameters` (theta + type); older files `rope_theta` +
    # `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    else:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}: only default and llama3")

    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if hf.get("head_dim") is None and hf["hidden_size"] % heads:
        raise ValueError("hidden_size is not divisible by num_attention_heads; give head_dim")
    return ModelConfig(
        name=name,
        model_type=model_type,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    )


def _qwen2(name: str, L: int, D: int, nh: int, nkv: int, F: int, V: int, tie: bool) -> ModelConfig:
    return ModelConfig(name, "qwen2", L, D, nh, nkv, D // nh, F, V, rope_theta=1e6,
                       rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=tie)


_PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        _qwen2("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tie=True),
        _qwen2("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tie=True),
        _qwen2("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, tie=False),
        ModelConfig("qwen3-8b", "qwen3", 36, 4096, 32, 8, 128, 12288, 151936, rope_theta=1e6,
                    rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=40960),
        ModelConfig("llama-3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256,
                    rope_theta=500000.0, rms_norm_eps=1e-5,
                    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192),
                    max_position_embeddings=131072),
        # Qwen2 architecture, small enough that a 256-token prefill takes milliseconds on CPU.
        ModelConfig("tiny", "qwen2", 6, 256, 4, 2, 64, 512, 512, rope_theta=10000.0,
                    rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=4096),
        # Qwen3 architecture with Qwen3-8B's boundary-to-KV-layer ratio n_h / (2 n_kv) = 2.
        ModelConfig("tiny-qwen3", "qwen3", 6, 256, 4, 1, 64, 512, 512, rope_theta=10000.0,
                    rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=4096),
        # Qwen2.5-7B's proportions where the handoff's ratios come from: 28 layers and a
        # boundary-to-KV-layer ratio B_H / B_KV = D / (2 n_kv H) = 448 / 128 = 3.5, with
        # distinct weights per layer (90 MiB in bf16). The link is calibrated to the suffix
        # layer's time (`sweep.calibrate_link`), so the MLP width F only scales every time:
        # F = 2D keeps a 256-token layer a few ms on one CPU core (far above the per-layer
        # program call, so the layer is compute, not dispatch), and `--preset cpu-paper`'s 28
        # layers at 256 and 512 tokens within 12 minutes on 2 cores (Qwen2.5-7B's F = 5.3 D
        # would slow every handoff ~2.3x). Vocabulary 512: the head runs on one position per
        # handoff, so a real vocabulary would only cost weight-building time and memory.
        ModelConfig("tiny-7b", "qwen2", 28, 448, 7, 1, 64, 896, 512, rope_theta=1e6,
                    rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=4096),
    )
}
MODEL_PRESETS: tuple[str, ...] = tuple(_PRESETS)  # names ModelConfig.preset knows

