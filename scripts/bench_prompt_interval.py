"""Prompt-to-first-token time of full vs split (streamed) prefill, both schedules, a few cuts.

Usage: `python scripts/bench_prompt_interval.py [--reps 20]`. Runs `rekv handoff --interval
prompt` twice per model (`--prefill full`, then `split`) back to back over the transfer-server
transport, the link paced as the CPU sweep's (one BF16 KV layer = 1.15 x a suffix layer), and
prints every summary as JSON plus a markdown table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from rekv_jax.action import parse_actions
from rekv_jax.mode import Interval, PrefillMode
from rekv_jax.model.loader import SHIPPED_MODEL, load_config
from rekv_jax.study.calibrate import calibrate_link
from rekv_jax.study.experiment import Experiment
from rekv_jax.study.sweep import run_experiment

CASES = {"tiny": "q8:r=2,q8:r=4,bf16:r=2", f"hf:{SHIPPED_MODEL}": "q8:r=1,q8:r=2,bf16:r=2"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for model, actions in CASES.items():
        cfg = load_config(model)
        link = calibrate_link(model, args.seq_len).link_gbps
        for mode in (PrefillMode.FULL, PrefillMode.SPLIT):
            exp = Experiment(model=model, seq_len=args.seq_len,
                             actions=tuple(parse_actions(actions, cfg.num_layers)),
                             link_gbps=link, warmup=3, reps=args.reps, interval=Interval.PROMPT,
                             prefill=mode)
            for s in run_experiment(exp):
                print(json.dumps(s.to_json()), flush=True)
                rows.append((cfg.name, link, s))
    print("| model | link GB/s | action | schedule | full ms | split ms | full/split |",
          file=sys.stderr)
    print("| --- | ---: | --- | --- | ---: | ---: | ---: |", file=sys.stderr)
    full = {(m, s.action, s.schedule): s for m, _, s in rows if not s.mode.streams}
    for m, link, s in rows:
        if s.mode.streams_layers:
            f = full[(m, s.action, s.schedule)]
            print(f"| {m} | {link:.4f} | {s.action} | {s.schedule} | {f.median_ms:.2f} | "
                  f"{s.median_ms:.2f} | {f.median_ms / s.median_ms:.2f}x |", file=sys.stderr)


if __name__ == "__main__":
    main()
