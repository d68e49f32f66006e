"""Eq. 13: the eligible action with the smallest measured median per model, length and timing
setup."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rekv_jax.study.records import Summary


def select(quality: Iterable[dict[str, Any]], timings: Iterable[Summary]
           ) -> list[dict[str, Any]]:
    """Eq. 13 per (model, seq_len) and timing setup: the eligible action with the smallest median.

    `quality` rows are `evaluate` results (actions in their text form); `timings` are measured
    summaries (an action timed under several schedules counts with its fastest). Actions are
    compared only within one setup (`Summary.setup`: link, batch, interval...), since a sweep's
    file holds several. Without a timing for any eligible action, `chosen` is None.
    """
    median: dict[tuple, dict[str, float]] = {}  # (model, seq_len, setup) -> action -> ms
    for t in timings:
        times = median.setdefault((t.model, t.seq_len, t.setup), {})
        times[str(t.action)] = min(times.get(str(t.action), float("inf")), t.median_ms)
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for q in quality:
        groups.setdefault((q["model"], q["seq_len"]), []).append(q)
    out = []
    for (model, seq_len), rows in groups.items():
        ok = [r["action"] for r in rows if r["eligible"]]
        setups = [s for m, n, s in median if (m, n) == (model, seq_len)] or [None]
        for setup in setups:
            times = median.get((model, seq_len, setup), {})
            best = min(((times[a], a) for a in ok if a in times), default=(None, None))
            out.append({"model": model, "seq_len": seq_len, "setup": setup, "chosen": best[1],
                        "median_ms": best[0], "eligible": ok,
                        "untimed_eligible": [a for a in ok if a not in times]})
    return out
