"""What a policy's suffix compute costs the requests decoding beside it, from a `rekv serve
--json` run's records (JSON, one object per rate).

For each rate, over the policy's completed requests of two or more tokens: each request's TPOT
against `beside_ms`, the priced suffix compute of the other requests that ran while it decoded,
per later token. A request's suffix of R priced ms (`decode_busy_ms`) runs in the `k R` ms
(`stretch`) before its first token; the share of that span inside another request's decode
(its first to its last token) counts, as that much of R. A least-squares line through (beside,
TPOT) gives `slope`, the TPOT's ms per priced ms of suffix beside it per token (1: each priced
ms delays the decodes beside it by a ms), and `intercept`, the TPOT with none beside; `alone`
gives the TPOT of the requests with less than `ALONE_MS` beside them.

    python scripts/serve_tpot_cost.py results/serve/2026-12-05b/tiny-7b-1p1d.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

ALONE_MS = 1.0  # per token: a request with less suffix beside it decoded about alone


def beside_ms(records: list[dict]) -> list[float]:
    """Each record's priced suffix compute of the others that ran during its decode, per later
    token (ms)."""
    spans = []  # (start, end, R): when each suffix ran, its priced compute
    for r in records:
        p = r["assignment"]["why"]["predicted"]
        end = r["token_times_s"][0]
        if p["decode_busy_ms"] > 0:
            spans.append((end - p["decode_busy_ms"] * p["stretch"] / 1e3, end,
                          p["decode_busy_ms"], r["id"]))
    out = []
    for r in records:
        first, last = r["token_times_s"][0], r["token_times_s"][-1]
        total = sum(ms * max(0.0, min(last, b) - max(first, a)) / (b - a)
                    for a, b, ms, rid in spans if rid != r["id"] and b > a)
        out.append(total / (len(r["token_times_s"]) - 1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records")
    p.add_argument("--policy", default="adaptive")
    args = p.parse_args()
    by_rate = collections.defaultdict(list)
    with open(args.records) as f:
        for line in f:
            r = json.loads(line)
            if (r.get("kind") == "served_request" and r["policy"] == args.policy
                    and r["completed"] and len(r["token_times_s"]) > 1):
                by_rate[r["rate"]].append(r)
    if not by_rate:
        p.error(f"{args.records} holds no completed request of {args.policy!r}")
    for rate, records in sorted(by_rate.items()):
        x, y = np.array(beside_ms(records)), np.array([r["tpot_ms"] for r in records])
        slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (None, y.mean())
        print(json.dumps({
            "rate": rate, "policy": args.policy, "requests": len(records),
            "beside_ms": {"p50": round(float(np.median(x)), 2),
                          "p90": round(float(np.percentile(x, 90)), 2)},
            "tpot_ms": {"p50": round(float(np.median(y)), 1),
                        "p90": round(float(np.percentile(y, 90)), 1)},
            "slope": None if slope is None else round(float(slope), 2),  # None: none beside
            "intercept_ms": round(float(intercept), 1), "alone": _quantiles(y[x < ALONE_MS])}))


def _quantiles(tpot_ms: np.ndarray) -> dict:
    if not len(tpot_ms):
        return {"requests": 0}
    return {"requests": len(tpot_ms), "tpot_p50_ms": round(float(np.median(tpot_ms)), 1),
            "tpot_p90_ms": round(float(np.percentile(tpot_ms, 90)), 1)}


if __name__ == "__main__":
    main()
