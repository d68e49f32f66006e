"""The shared vocabulary of a handoff's timing: phase names and the `Phases` and `Timeline`
records of one handoff (how a handoff runs is its `mode.Mode`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

PHASES = ("quantize", "boundary", "prefix", "suffix", "join")
PROMPT_PHASES = ("prefill", *PHASES)  # a measured handoff also reports the prefill's own compute


@dataclasses.dataclass(frozen=True)
class Phases:
    """Time of each phase of one handoff, ms (PROMPT_PHASES): measured, a median or predicted.
    A record, not a dict, so a misspelt phase is an AttributeError, not a silent KeyError."""

    quantize: float  # Q: quantize the prefix
    boundary: float  # H: the token ids (and h_c) on the link
    prefix: float  # X: what the prefix adds after the boundary, restore included
    suffix: float  # R: layers c..L-1 (to the first token's logits)
    join: float  # J: assemble the cache and pick the first token
    prefill: float = 0.0  # the prefill's own compute (0: timed from the ready state)

    @property
    def ready(self) -> tuple[float, float, float, float, float]:
        """Q, H, X, R, J: the arguments of Eqs. 8-9 (`costmodel.t_seq`, `t_ov`)."""
        return self.quantize, self.boundary, self.prefix, self.suffix, self.join

    def to_json(self, names: Sequence[str] = PROMPT_PHASES) -> dict[str, float]:
        """`{phase: ms}` in the order of `names` (a record's `phases_ms`)."""
        return {p: getattr(self, p) for p in names}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Phases:
        """Inverse of `to_json`; older lines without `prefill` read as 0 (timed from ready)."""
        missing = sorted(set(PHASES) - set(d))
        if missing:
            raise ValueError(f"phases_ms lacks {missing}")
        return cls(**{p: float(d[p]) for p in PHASES}, prefill=float(d.get("prefill", 0.0)))


# events of a handoff's timeline: the boundary arrived, the prefix arrived and was restored, the
# suffix started and ended, the cache and first token were ready
TIMELINE = ("boundary", "prefix", "suffix_start", "suffix_end", "end")


@dataclasses.dataclass(frozen=True)
class Timeline:
    """When each event of a handoff happened, ms after the interval's start (TIMELINE): shows
    whether the suffix ran while the prefix was still in flight."""

    boundary: float
    prefix: float
    suffix_start: float
    suffix_end: float
    end: float

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Timeline:
        return cls(**{e: float(d[e]) for e in TIMELINE})
