"""The shared vocabulary of a handoff's timing: phase names, the modes that decide what is timed
and how the decode side runs (`StrEnum`s: each member equals its string, so JSON and the CLI see
plain strings), and the `Phases` and `Timeline` records of one handoff."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

PHASES = ("quantize", "boundary", "prefix", "suffix", "join")
PROMPT_PHASES = ("prefill", *PHASES)  # a measured handoff also reports the prefill's own compute


class Interval(enum.StrEnum):
    """What a handoff's time counts from."""

    READY = "ready"  # the prefill state being ready
    PROMPT = "prompt"  # the prompt's arrival at the prefill worker


class PrefillMode(enum.StrEnum):
    """How the prefill side computes and sends."""

    FULL = "full"  # all L layers, then the handoff
    SPLIT = "split"  # only 0..c-1, each layer streamed as computed
    PIPELINED = "pipelined"  # token chunks through 0..c-1, each streamed as computed


class Schedule(enum.StrEnum):
    """How the decode side runs the suffix against the prefix's arrival (Eqs. 8-9)."""

    OVERLAPPED = "overlapped"  # the suffix while the prefix is in flight
    SEQUENTIAL = "sequential"  # the suffix after the prefix has arrived
    CHUNKED = "chunked"  # the boundary in token chunks, each run through c..L-1 as it arrives


class Fallback(enum.StrEnum):
    """What the decode side does when the prefix transfer fails."""

    ERROR = "error"  # raise
    RECOMPUTE = "recompute"  # rebuild the cache from the token ids


# the values, as plain strings (argparse choices, error messages)
INTERVALS = tuple(m.value for m in Interval)
PREFILL_MODES = tuple(m.value for m in PrefillMode)
SCHEDULES = tuple(m.value for m in Schedule)  # what the model predicts (handoff runs them)
PAPER_SCHEDULES = SCHEDULES[:2]  # overlapped, sequential (Eqs. 8-9)
FALLBACKS = tuple(m.value for m in Fallback)


def check_modes(interval: str, prefill_mode: str) -> None:
    """ValueError unless (interval, prefill mode) is a valid pair (split, pipelined need the
    prompt)."""
    if interval not in INTERVALS or prefill_mode not in PREFILL_MODES:
        raise ValueError(f"interval must be one of {INTERVALS} and prefill one of "
                         f"{PREFILL_MODES}, got {interval!r}, {prefill_mode!r}")
    if prefill_mode != PrefillMode.FULL and interval != Interval.PROMPT:
        raise ValueError(f"a {prefill_mode} prefill streams while it computes, so its interval "
                         "starts at the prompt: use interval 'prompt'")


def check_chunks(schedule: str, prefill_mode: str, chunks: int, seq_len: int) -> None:
    """ValueError unless `chunks` suits the schedule: N > 1 only for the chunked schedule or a
    pipelined prefill (not with a split one), and at most one chunk per token."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= seq_len:
        raise ValueError(f"chunks must be an integer in 1..{seq_len} (the tokens), got {chunks!r}")
    if schedule == Schedule.CHUNKED and prefill_mode == PrefillMode.SPLIT:
        raise ValueError("a split prefill streams per layer; chunk the boundary with a full "
                         "prefill, or use prefill 'pipelined'")
    if chunks > 1 and schedule != Schedule.CHUNKED and prefill_mode != PrefillMode.PIPELINED:
        raise ValueError(f"{chunks} chunks need schedule 'chunked' or prefill 'pipelined'")



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
