"""The chunked schedules' speedups from `rekv handoff --json` outputs, as one JSON line.

Ready interval: the best `chunked` joint action over the best `overlapped` joint action (target:
>= 1.08). Prompt interval: the best `pipelined` action over the best `full` and the
best `split` action (>= 1.5, >= 1.3). Each best is the smallest median over the summaries of
one file set and setup (model, prompt length, batch); only checked records count (first
token matched, no cache mismatch). One JSON line per setup.

    PYTHONPATH=. python scripts/chunked_ratios.py ready.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from rekv_jax.jsonl import read_jsonl
from rekv_jax.mode import Formula, Mode
from rekv_jax.study.records import Summary

TARGETS = {"chunked_over_overlapped": 1.08, "pipelined_over_full": 1.5,
           "pipelined_over_split": 1.3}


def best(summaries: list[Summary], which: Callable[[Mode], bool]) -> Summary | None:
    """The fastest checked summary whose mode is `which`."""
    ok = [s for s in summaries if which(s.mode) and s.first_token_match
          and not s.cache_check.startswith("MISMATCH")]
    return min(ok, key=lambda s: s.median_ms, default=None)


def main(paths: list[str]) -> None:
    summaries = [Summary.from_json(r) for p in paths for r in read_jsonl(p)
                 if r.get("kind") == "summary"]
    setups: dict[tuple[str, int, int], list[Summary]] = {}
    for s in summaries:
        setups.setdefault((s.model, s.seq_len, s.batch), []).append(s)
    for (model, seq_len, batch), group in sorted(setups.items()):
        ratios = setup_ratios(group)
        if ratios:
            print(json.dumps({"model": model, "seq_len": seq_len, "batch": batch, **ratios}))


def setup_ratios(summaries: list[Summary]) -> dict[str, dict[str, object]]:
    """The speedups of one setup's summaries, each with its target, best and baseline."""
    pipelined = best(summaries, lambda m: m.streams_chunks)
    pairs = {"chunked_over_overlapped": (
                 best(summaries, lambda m: m.joint and m.formula == Formula.CHUNKED),
                 best(summaries, lambda m: m.joint and m.formula == Formula.OVERLAPPED
                      and not m.from_prompt)),
             "pipelined_over_full": (pipelined, best(summaries, lambda m: m.from_prompt
                                                     and not m.streams)),
             "pipelined_over_split": (pipelined, best(summaries, lambda m: m.streams_layers))}
    out = {}
    for name, (new, old) in pairs.items():
        if new is None or old is None:
            continue
        out[name] = {"ratio": old.median_ms / new.median_ms, "target": TARGETS[name],
                     "best": f"{new.action} {new.schedule} N={new.chunks}: {new.median_ms:.2f} ms",
                     "baseline": f"{old.action} {old.schedule}: {old.median_ms:.2f} ms"}
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
