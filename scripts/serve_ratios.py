"""A `rekv serve --json` run's policy against a baseline at each rate, with bootstrap 95% CIs
(JSON, one object per rate): TTFT at p50/p90/p99 as baseline over policy (higher: the policy is
faster), TPOT p90 as policy over baseline (higher: the policy's decoding is slower), goodput as
policy over baseline.

    python scripts/serve_ratios.py results/serve/tiny-7b-1p1d.jsonl --policy adaptive \\
        --baseline bf16:full
"""

from __future__ import annotations

import argparse
import json

import numpy as np

RESAMPLES = 2000


def column(records: list[dict], policy: str, rate: float, key: str) -> np.ndarray:
    return np.array([r[key] for r in records if r["policy"] == policy and r["rate"] == rate
                     and r[key] is not None], float)


def ratio(num: np.ndarray, den: np.ndarray, q: float, rng: np.random.Generator) -> dict:
    """quantile(num, q) / quantile(den, q) and its bootstrap 95% CI (both resampled)."""
    boot = [np.quantile(rng.choice(num, num.size), q) / np.quantile(rng.choice(den, den.size), q)
            for _ in range(RESAMPLES)]
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return {"value": float(np.quantile(num, q) / np.quantile(den, q)), "ci": [lo, hi]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records")
    p.add_argument("--policy", default="adaptive")
    p.add_argument("--baseline", default="bf16:full")
    args = p.parse_args()
    lines = [json.loads(line) for line in open(args.records)]
    served = [r for r in lines if r.get("kind") == "served_request" and r["completed"]]
    goodput = {(s["policy"], s["rate"]): s["goodput_rps"] for s in lines
               if s.get("kind") == "serve_summary"}
    rng = np.random.default_rng(0)
    for rate in sorted({r["rate"] for r in served}):
        mine, base = (column(served, name, rate, "ttft_ms") for name in (args.policy,
                                                                          args.baseline))
        tpot = [column(served, name, rate, "tpot_ms") for name in (args.policy, args.baseline)]
        print(json.dumps({
            "rate": rate, "policy": args.policy, "baseline": args.baseline,
            **{f"ttft_p{round(100 * q)}": ratio(base, mine, q, rng) for q in (0.5, 0.9, 0.99)},
            "tpot_p90": ratio(*tpot, 0.9, rng),
            "goodput": goodput[(args.policy, rate)] / goodput[(args.baseline, rate)]
            if goodput[(args.baseline, rate)] else None}))


if __name__ == "__main__":
    main()
