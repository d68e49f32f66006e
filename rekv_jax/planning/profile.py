"""A `Profile`: the per-layer handoff costs of one model, prompt length and batch on one machine
and link, which every formula of `planning.costmodel` reads; the two formulas it needs itself,
a transfer's time, a token chunk's share of a layer and Proposition 2's balanced cut
(Eq. 11); and reading profiles from files.
`costmodel` names all of these too."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

from rekv_jax import sizes
from rekv_jax.action import ACTION_KINDS, PAPER
from rekv_jax.config import ModelConfig

_BITS_FIELDS = ("kv_layer_bytes", "quantize_ms", "restore_ms")  # dicts keyed by bits


def transfer_ms(nbytes: float, link_gbps: float) -> float:
    """Time to move `nbytes` over a `link_gbps` GB/s link."""
    if not link_gbps > 0:
        raise ValueError(f"link bandwidth must be positive GB/s, got {link_gbps!r}")
    return nbytes / (link_gbps * 10**6)  # an int factor keeps exact Fractions exact


def balanced_cut(num_layers: int, alpha: float, beta: float, gamma: float,
                 offset: float = 0) -> tuple[float, tuple[int, ...]]:
    """Proposition 2: `c* = (L γ + offset) / (β + γ)` clipped to [1, L-1], and the interior cuts
    that can minimize `T_ov` (the integers adjacent to `c*`; only `1` when `γ <= α`).

    `offset = r0 - m` is the suffix's fixed cost minus the prefix message's (0 in Eq. 11).
    """
    if num_layers < 2:
        raise ValueError(f"an interior cut needs at least 2 layers, got {num_layers}")
    if not beta > 0 or alpha < 0 or gamma < 0:
        raise ValueError(f"need beta > 0, alpha >= 0, gamma >= 0; got {alpha}, {beta}, {gamma}")
    c_star = min(max((num_layers * gamma + offset) / (beta + gamma), 1), num_layers - 1)
    if gamma <= alpha:  # T_ov is nondecreasing in c: the smallest interior cut is a minimizer
        return c_star, (1,)
    return c_star, tuple(sorted({math.floor(c_star), math.ceil(c_star)}))


# pure, and called per chunk of every mode a policy weighs; typed, so that a Fraction share is
# never answered with a float one that compares equal
@functools.lru_cache(maxsize=4096, typed=True)
def chunk_share(seq_len: int, chunk: int, chunks: int, attention_share: float) -> float:
    """Chunk `chunk`'s share of a prompt layer's γ: its T_i of S tokens, and its attention over
    the w_i cache positions of its bucket (`sizes.attention_width`) where the prompt program's
    covers all S (masked): (1 - s) T_i / S + s T_i w_i / S²."""
    start, stop = sizes.token_chunks(seq_len, chunks)[chunk]
    tokens, width, s = stop - start, sizes.attention_width(stop, seq_len), attention_share
    return Fraction(tokens, seq_len**2) * (seq_len * (1 - s) + s * width)  # exact for rational s


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer handoff costs (ms) of one model, length and batch on one machine and link."""

    model: str
    num_layers: int  # L
    seq_len: int  # S
    batch: int  # B
    hardware: str  # where the compute terms were measured, e.g. "H200", "cpu 2 cores"
    link: str  # what the link is, e.g. "loopback tcp paced", "analytic"
    link_gbps: float  # W: bandwidth the transfer terms use (GB/s)
    source: str  # "measured", "fitted" or "analytic"
    kv_layer_bytes: dict[int, int]  # bits -> one layer's KV payload (per link, see for_config)
    boundary_bytes: int  # B_H (sizes.boundary_bytes; per link)
    token_bytes: int  # int32 token IDs (sizes.token_bytes)
    quantize_ms: dict[int, float]  # bits -> α_b, per layer (0 for 16)
    restore_ms: dict[int, float]  # bits -> per-layer restore after receive (0 for 16)
    suffix_layer_ms: float  # γ
    join_ms: dict[str, float]  # Action.kind -> J (a number: the same for every kind)
    embed_ms: float = 0.0  # full recomputation: embedding of the token IDs
    quantize_fixed_ms: float = 0.0  # q0: per quantize call (bits < 16)
    boundary_fixed_ms: float = 0.0  # h0: start of the handoff and the token-ID message
    message_ms: float = 0.0  # m: the prefix message's fixed cost
    suffix_fixed_ms: float = 0.0  # r0: per suffix call
    # bits -> x0_b: per restore call (dequantize dispatch); missing bits are 0
    restore_fixed_ms: dict[int, float] = dataclasses.field(default_factory=dict)
    chunk_layer_ms: float = 0.0  # κ: per layer of each token chunk after the first
    attention_share: float = 0.0  # s: causal attention's share of γ (0: linear in tokens)

    def __post_init__(self) -> None:
        if not self.link_gbps > 0:
            raise ValueError(f"profile link_gbps must be positive, got {self.link_gbps!r}")
        for name in _BITS_FIELDS:
            d = {int(k): v for k, v in getattr(self, name).items()}
            object.__setattr__(self, name, d)
        if isinstance(self.join_ms, int | float):
            object.__setattr__(self, "join_ms", dict.fromkeys(ACTION_KINDS, float(self.join_ms)))
        if set(self.join_ms) != set(ACTION_KINDS):
            raise ValueError(f"join_ms needs exactly the kinds {ACTION_KINDS}, "
                             f"got {sorted(self.join_ms)}")
        given = {int(k): v for k, v in self.restore_fixed_ms.items()}
        fixed = {b: given.get(b, 0.0) for b in self.quantize_ms}
        object.__setattr__(self, "restore_fixed_ms", fixed)
        missing = set(self.quantize_ms) ^ set(self.restore_ms)
        if missing or not set(self.quantize_ms) <= set(self.kv_layer_bytes):
            raise ValueError("quantize_ms, restore_ms and kv_layer_bytes must cover the same bits")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            values = v.values() if isinstance(v, dict) else [v]
            if f.name.endswith("_ms") and any(x < 0 for x in values):
                raise ValueError(f"profile {f.name} must be >= 0, got {v}")
        if not 0 <= self.attention_share <= 1:
            raise ValueError(f"profile attention_share must be in [0, 1], got "
                             f"{self.attention_share}")

    @classmethod
    def for_config(cls, cfg: ModelConfig, seq_len: int, batch: int = 1, prefill_devices: int = 1,
                   decode_devices: int = 1, **costs: Any) -> Profile:
        """A profile of `cfg` whose byte counts come from `sizes` (the costs are keyword args).

        Between sharded sides the byte counts are those of the busiest of the parallel links
        (`sizes.parallel_links`), so every transfer term is per link; the compute terms are the
        per-device times measured on the sides' meshes."""
        links = sizes.parallel_links(cfg, prefill_devices, decode_devices)
        return cls(model=cfg.name, num_layers=cfg.num_layers, seq_len=seq_len, batch=batch,
                   kv_layer_bytes={b: sizes.link_bytes(sizes.kv_layer_bytes(cfg, seq_len, batch, b),
                                                       links.prefix)
                                   for b in costs["quantize_ms"]},
                   boundary_bytes=sizes.link_bytes(sizes.boundary_bytes(cfg, seq_len, batch),
                                                   links.boundary),
                   token_bytes=sizes.token_bytes(seq_len, batch), **costs)

    def at_link(self, link_gbps: float, link: str | None = None) -> Profile:
        """The same profile on a link of `link_gbps` GB/s (transfer terms rescaled)."""
        return dataclasses.replace(self, link_gbps=link_gbps,
                                   link=link or f"{self.link}, retargeted to {link_gbps:g} GB/s")

    def at_length(self, seq_len: int) -> Profile:
        """An estimate of the same model and machine at prompt length `seq_len`: bytes, the
        embedding and the per-layer quantize and restore costs scale with the tokens, a layer's
        γ as `(1 - s) f + s f²` with `f = seq_len / S` (its attention share s grows with the
        length), and per-call, per-message, per-chunk and join costs stay. A profile measured at
        the length is better; this one fills the lengths between."""
        if seq_len == self.seq_len:
            return self
        if seq_len < 1:
            raise ValueError(f"a prompt length must be positive, got {seq_len}")
        f, s = seq_len / self.seq_len, self.attention_share
        grow = (1 - s) + s * f  # γ(S') / (γ(S) f)

        def scaled(nbytes: int) -> int:  # every byte count is a whole number per token
            return nbytes // self.seq_len * seq_len

        return dataclasses.replace(
            self, seq_len=seq_len, kv_layer_bytes={b: scaled(n) for b, n in
                                                   self.kv_layer_bytes.items()},
            boundary_bytes=scaled(self.boundary_bytes), token_bytes=scaled(self.token_bytes),
            quantize_ms={b: v * f for b, v in self.quantize_ms.items()},
            restore_ms={b: v * f for b, v in self.restore_ms.items()},
            suffix_layer_ms=self.suffix_layer_ms * f * grow, embed_ms=self.embed_ms * f,
            attention_share=s * f / grow, source=f"{self.source}, scaled from {self.seq_len}")

    def beta(self, bits: int, fmt: str = PAPER) -> float:
        """β_b: per-layer prefix transfer (in prefix format `fmt`) plus restore."""
        return (transfer_ms(self.prefix_layer_bytes(bits, fmt), self.link_gbps)
                + self.restore_ms[bits])

    def prefix_layer_bytes(self, bits: int, fmt: str = PAPER) -> int:
        """B_KV,b: one prefix layer's bytes on the wire in prefix format `fmt`."""
        self._check_bits(bits)
        if bits == 16:
            return self.kv_layer_bytes[bits]
        return sizes.format_layer_bytes(self.kv_layer_bytes[bits], self.seq_len, fmt)

    def prefix_ms(self, bits: int, cut: int, fmt: str = PAPER) -> float:
        """X_b(c): the prefix message, its restore call, and `c` layers at β_b."""
        return self.message_ms + self.restore_fixed_ms[bits] + cut * self.beta(bits, fmt)

    def balanced_cut(self, bits: int) -> tuple[float, tuple[int, ...]]:
        """Proposition 2 for precision `bits` under this profile."""
        offset = self.suffix_fixed_ms - self.prefix_ms(bits, 0)  # r0 - X_b(0)
        return balanced_cut(self.num_layers, self.quantize_ms[bits], self.beta(bits),
                            self.suffix_layer_ms, offset)

    def chunk_layer(self, chunk: int, chunks: int) -> float:
        """γ_i: one layer's compute of token chunk `chunk` of `chunks` (module docstring)."""
        return (self.suffix_layer_ms * chunk_share(self.seq_len, chunk, chunks,
                                                   self.attention_share)
                + (chunk > 0) * self.chunk_layer_ms)

    def _check_bits(self, bits: int) -> None:
        if bits not in self.quantize_ms:
            raise ValueError(f"profile has no costs for {bits}-bit prefixes "
                             f"(has {sorted(self.quantize_ms)})")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`kind: "profile"`, bit keys as strings); inverse of `from_json`."""
        d = dataclasses.asdict(self)
        for name in _BITS_FIELDS + ("restore_fixed_ms",):
            d[name] = {str(k): v for k, v in d[name].items()}
        return {"kind": "profile", **d}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"kind"}
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d
                   and f.default is f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"profile lacks the fields {missing}")
        return cls(**{k: v for k, v in d.items() if k in names})


def load_profiles(path: str | Path) -> list[Profile]:
    """Profiles in a file: one JSON object, a JSON list, or JSONL (lines without
    `kind: "profile"` are skipped, so a handoff's output stream can be read directly)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"profile {path}: cannot read it ({e.strerror})") from None
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path}: not JSON or JSONL ({e.msg}, line {e.lineno})"
                             ) from None
    try:
        profiles = [Profile.from_json(d) for d in items
                    if isinstance(d, dict) and d.get("kind", "profile") == "profile"]
    except (ValueError, TypeError) as e:  # TypeError: a field of the wrong type
        raise ValueError(f"profile {path}: {e}") from None
    if not profiles:
        raise ValueError(f"{path}: no profile found")
    return profiles
