"""How far any policy could beat a baseline's TTFT by sparing the link alone, from a `rekv serve
--json` run's records (JSON, one object per rate).

For each rate, from the baseline's requests (default `bf16:full`, one prefill worker):
- `link_free_ttft_ms`: the TTFT p50 and p90 of a policy whose handoffs cost no link time at all
  but whose prompts are computed where the baseline's were: on the prefill device, in arrival
  order, each taking the compute its prefill side measured (a FIFO queue, Lindley's
  recursion). No policy that keeps the prompt on the prefill device does better;
- `ratio_bound`: the baseline's measured TTFT p50 and p90 over those: the most such a policy's
  TTFT ratio can reach. A target above it needs prompt compute moved to the decode device;
- `utilization`: the rate times the mean service of the prefill device (a prompt's measured
  compute) and of the link (its bytes at the run's pace, `--link-gbps`); and `decode_busy`, the
  share of the run's span the decode device held a running request (the union of those
  intervals): what moving work between them has to fit in.

    python scripts/serve_bounds.py results/serve/2026-12-04c/tiny-7b-1p1d.jsonl \
        --link-gbps 0.00418
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np


def compute_ms(r: dict) -> float:
    """A full prefill's compute (ms): its prefill side's report, else its phases' (the same
    time, carried with the handoff; a record may lack the report where its request ended first,
    which the router no longer lets happen)."""
    side = r.get("prefill_side")
    return side["compute_ms"] if side else r["phases_ms"]["prefill"]


def link_free_ttft_ms(records: list[dict]) -> list[float]:
    """Each request's TTFT (ms), in arrival order, if its prompt were the only thing it waited
    for: the prefill device serves the prompts in arrival order, each for its measured
    compute."""
    free_s, out = 0.0, []
    for r in sorted(records, key=lambda r: r["arrival_s"]):
        start = max(r["arrival_s"], free_s)
        free_s = start + compute_ms(r) / 1e3
        out.append((free_s - r["arrival_s"]) * 1e3)
    return out


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `intervals` (s)."""
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def decode_busy(records: list[dict]) -> float:
    """The share of the run's span (first arrival to last token) in which some request was
    decoding."""
    decoding, first = [], min(r["arrival_s"] for r in records)
    for r in records:
        at = {x["status"]: x["t_s"] for x in r["lifecycle"]}
        if "decoding" in at:
            decoding.append((at["decoding"], max(at.values())))
    return covered(decoding) / (max(b for _, b in decoding) - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records")
    p.add_argument("--baseline", default="bf16:full")
    p.add_argument("--link-gbps", type=float, required=True, help="the run's link pace")
    args = p.parse_args()
    by_rate = collections.defaultdict(list)
    with open(args.records) as f:
        for line in f:
            r = json.loads(line)
            if (r.get("kind") == "served_request" and r["policy"] == args.baseline
                    and r["completed"]):
                by_rate[r["rate"]].append(r)
    if not by_rate:
        p.error(f"{args.records} holds no completed request of {args.baseline!r}")
    if any(r["assignment"]["prefill_worker"] for rs in by_rate.values() for r in rs):
        p.error("the bound replays one prefill device: the run had more than one prefill worker")
    for rate, records in sorted(by_rate.items()):
        measured = [r["ttft_ms"] for r in records]
        bound = link_free_ttft_ms(records)
        q = {"p50": 50, "p90": 90}
        print(json.dumps({
            "rate": rate, "baseline": args.baseline, "requests": len(records),
            "baseline_ttft_ms": {k: round(float(np.percentile(measured, v))) for k, v in q.items()},
            "link_free_ttft_ms": {k: round(float(np.percentile(bound, v))) for k, v in q.items()},
            "ratio_bound": {k: round(float(np.percentile(measured, v) / np.percentile(bound, v)), 2)
                            for k, v in q.items()},
            "utilization": {
                "prefill": round(rate * np.mean([compute_ms(r) / 1e3 for r in records]), 3),
                "link": round(rate * np.mean([r["prefill_side"]["sent_bytes"]
                                              / (args.link_gbps * 1e9) for r in records
                                              if r.get("prefill_side")]), 3)},
            "decode_busy": round(decode_busy(records), 3)}))


if __name__ == "__main__":
    main()
