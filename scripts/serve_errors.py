"""Where a `rekv serve --json` run's cost model errs: per policy and prompt length, the median
signed error of each predicted stage ((predicted - measured) / measured: prefill, link,
first token) and the median prompt compute, predicted and measured, apart for the requests
that met an idle system (no predicted wait, no running decodes) and those that queued (JSON, one
object per group).

    python scripts/serve_errors.py results/serve/2026-12-03/tiny-7b-1p1d.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

STAGES = ("prefill", "link", "first_token")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _met(record: dict) -> str:
    """'idle' when the cost model saw no queue and no running decodes ahead of the request."""
    p = record["assignment"]["why"]["predicted"]
    waits = p["prefill_wait_ms"] or p["link_wait_ms"] or p["decode_wait_ms"]
    return "queued" if waits or p["after"]["running"] else "idle"


def group(records: list[dict]) -> dict:
    """One group's medians: requests, each stage's signed error, and the prompt compute."""
    errors = {name: [] for name in STAGES}
    compute = {"predicted": [], "measured": []}
    for r in records:
        for s in r["stages"]:
            if s["name"] in errors and s["predicted_ms"] is not None and s["measured_ms"]:
                errors[s["name"]].append((s["predicted_ms"] - s["measured_ms"]) / s["measured_ms"])
        if r["assignment"]["prefill"] == "full":
            compute["predicted"].append(r["assignment"]["why"]["predicted"]["prefill_busy_ms"])
            compute["measured"].append(r["phases_ms"]["prefill"])
    return {"requests": len(records),
            "signed_error": {name: _median(v) for name, v in errors.items()},
            "prompt_compute_ms": {k: _median(v) for k, v in compute.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records")
    args = p.parse_args()
    groups = collections.defaultdict(list)
    with open(args.records) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "served_request" and r["completed"]:
                groups[(r["policy"], r["prompt_len"], _met(r))].append(r)
    for (policy, prompt_len, met), records in sorted(groups.items()):
        print(json.dumps({"policy": policy, "prompt_len": prompt_len, "met": met,
                          **group(records)}))


if __name__ == "__main__":
    main()
