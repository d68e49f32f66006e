"""The paper's Table 1 headline on one machine: best joint Q8 over BF16 transfer, and over the best
single mechanism, from one `rekv handoff` run (targets 1.9x and 1.05x for `tiny-7b` at 256
tokens, overlapped schedule, paper-paced link, each side on its own cores). Prints one JSON
object: the run's setup, each family's best action and median, the two ratios with bootstrap
95% CIs (`tables.table1_rows`), and whether each target is met.

    python scripts/paper_ratios.py                       # runs the handoff (a few minutes)
    python scripts/paper_ratios.py --no-pin              # both sides share the cores
    python scripts/paper_ratios.py --save run.jsonl      # and keep the run's records
    python scripts/paper_ratios.py --records run.jsonl   # from a `rekv handoff --json` output
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rekv_jax.study import tables
from rekv_jax.study.records import Summary, read_summaries

# Transfer-only, full recomputation, and cuts around the paper's best BF16 recompute (r = 15 of
# 28) and joint Q8 (r ~ 10), which on two CPU cores are best near r = 13-15 and 8-10
ACTIONS = ("bf16:full,q8:full,bf16:recompute,bf16:r=13,bf16:r=15,bf16:r=17,"
           "q8:r=8,q8:r=10,q8:r=12,q8:r=14")
TARGETS = {"joint_vs_bf16": 1.9, "joint_vs_single": 1.05}


def run(args: argparse.Namespace) -> list[Summary]:
    """The summaries of one `rekv handoff --json` run of `args`' setup."""
    argv = ["handoff", "--json", "--model", args.model, "--seq-len", str(args.seq_len),
            "--actions", args.actions, "--schedule", "overlapped", "--link-gbps", args.link,
            "--reps", str(args.reps), "--warmup", str(args.warmup)] + ["--no-pin"] * args.no_pin
    done = subprocess.run([sys.executable, "-m", "rekv_jax.cli", *argv], capture_output=True,
                          text=True, timeout=3600.0)
    if done.returncode:
        raise SystemExit(f"rekv handoff failed: {done.stderr.strip().splitlines()[-1:]}")
    out = done.stdout
    if args.save:
        args.save.write_text(out)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [Summary.from_json(d) for d in lines if d["kind"] == "summary"]


def ratios(records: list[Summary]) -> dict:
    """The Table 1 row of the records' one setup, model and length, as JSON."""
    (row,) = tables.table1_rows(records)
    best = {k: None if r is None else {"action": str(r.action), "median_ms": round(r.median_ms, 2)}
            for k in ("bf16", "q8", "recompute", "joint") for r in [getattr(row, k)]}
    out = {"model": row.model, "seq_len": row.seq_len, "reps": row.reps,
           "pinning": row.setup.pinning, "link_gbps": row.setup.link_gbps,
           "hardware": row.setup.hardware, **best,
           "first_token_match": all(r.first_token_match for r in records)}
    for key, target in TARGETS.items():
        s = getattr(row, key)
        out[key] = None if s is None else {"x": round(s.x, 3), "ci95": [round(c, 3) for c in
                                           s.ci95], "over": s.over, "target": target,
                                           "met": s.x >= target}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-7b")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--actions", default=ACTIONS)
    p.add_argument("--link", default="paper", help="--link-gbps of rekv handoff")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--records", type=Path, default=None,
                   help="read a `rekv handoff --json` output instead of running one")
    p.add_argument("--save", type=Path, default=None, help="write the run's JSON lines here")
    args = p.parse_args()
    records = read_summaries(args.records) if args.records else run(args)
    print(json.dumps(ratios(records)))


if __name__ == "__main__":
    main()
