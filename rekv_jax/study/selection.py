"""Eq. 13: the eligible action with the smallest measured median per model, length and timing
setup."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from rekv_jax.gate_result import GateResult
from rekv_jax.study.records import Setup, Summary


@dataclasses.dataclass(frozen=True)
class Selection:
    """Eq. 13's choice for one model, length and timing setup (a line of `rekv select --json`)."""

    model: str
    seq_len: int
    setup: Setup | None  # None: no timing of this model and length
    chosen: str | None  # the fastest timed eligible action; None: none was timed
    median_ms: float | None  # its median
    eligible: tuple[str, ...]  # every action the gate passed
    untimed_eligible: tuple[str, ...]  # ... of which this setup has no timing

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "seq_len": self.seq_len,
                "setup": self.setup and dataclasses.asdict(self.setup), "chosen": self.chosen,
                "median_ms": self.median_ms, "eligible": list(self.eligible),
                "untimed_eligible": list(self.untimed_eligible)}


def select(quality: Iterable[GateResult], timings: Iterable[Summary]) -> list[Selection]:
    """Eq. 13 per (model, seq_len) and timing setup: the eligible action with the smallest median.

    `timings` are measured summaries (an action timed under several schedules counts with its
    fastest). Actions are compared only within one setup (`Summary.setup`: link, batch,
    interval...), since a sweep's file holds several. Without a timing for any eligible action,
    `chosen` is None.
    """
    median: dict[tuple, dict[str, float]] = {}  # (model, seq_len, setup) -> action -> ms
    for t in timings:
        times = median.setdefault((t.model, t.seq_len, t.setup), {})
        times[str(t.action)] = min(times.get(str(t.action), float("inf")), t.median_ms)
    groups: dict[tuple[str, int], list[GateResult]] = {}
    for q in quality:
        groups.setdefault((q.model, q.seq_len), []).append(q)
    out = []
    for (model, seq_len), results in groups.items():
        ok = tuple(r.action for r in results if r.eligible)
        setups = [s for m, n, s in median if (m, n) == (model, seq_len)] or [None]
        for setup in setups:
            times = median.get((model, seq_len, setup), {})
            best = min(((times[a], a) for a in ok if a in times), default=(None, None))
            out.append(Selection(model, seq_len, setup, best[1], best[0], ok,
                                 tuple(a for a in ok if a not in times)))
    return out
