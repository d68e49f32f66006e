"""How faithfully a CPU pair emulates the decode device: one joint action's suffix phase in a
handoff beside the same layers run alone, in the decode process, on the same core, at once after
each rep (`Summary.fidelity`), under the overlapped schedule and the chunked one at each N.
Prints one JSON object.

Each side is pinned to its own core (its device); the link is paced to the paper's ratio,
calibrated on the decode side's core. Per run: the handoff's median, the suffix phase and the
same layers alone (`run_suffix(chunks=N)`), their ratio (target: at most 1.05), what the decode
device's threads waited for their core, and what the process's other threads ran. Between the
chunked runs, what N = 8 costs beyond N = 2 past their own compute: the chunks' messages.

    python scripts/bench_fidelity.py --model tiny-7b --seq-len 256 --action q8:r=12 --chunks 2,8
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from rekv_jax.action import Action
from rekv_jax.model.loader import load_config
from rekv_jax.study.calibrate import LinkCalibration, calibrate_link_in_child
from rekv_jax.study.experiment import Experiment, open_session, side_environments
from rekv_jax.study.records import Summary

TARGET = 1.05  # the suffix phase over the same layers alone
TIMEOUT_S = 3600.0  # per run


def experiments(args: argparse.Namespace) -> tuple[list[Experiment], LinkCalibration]:
    """The overlapped run, then a chunked run per N, on one calibrated link."""
    cfg = load_config(args.model)
    action = Action.parse(args.action, cfg.num_layers)
    base = Experiment(model=args.model, seq_len=args.seq_len, actions=(action,),
                      schedules=("overlapped",), warmup=args.warmup, reps=args.reps)
    link = calibrate_link_in_child(args.model, args.seq_len, side_environments(base)["decode"])
    base = dataclasses.replace(base, link_gbps=link.link_gbps)
    chunked = [dataclasses.replace(base, schedules=("chunked",), chunks=int(n))
               for n in args.chunks.split(",")]
    return [base, *chunked], link


def row(s: Summary) -> dict:
    f = s.fidelity
    return {"schedule": s.schedule, "chunks": s.chunks, "median_ms": round(s.median_ms, 2),
            "suffix_ms": round(s.phases_ms.suffix, 2),
            "suffix_alone_ms": round(f.suffix_alone_ms, 2), "ratio": round(f.ratio, 4),
            "device_wait_ms": f.device_wait_ms, "host_ms": f.host_ms,
            "within_target": f.ratio <= TARGET}


def chunk_cost(rows: list[dict]) -> dict | None:
    """What the chunked run with most chunks costs beyond the one with fewest, past the extra
    compute of its smaller chunks (their standalone times): the cost of its extra messages."""
    chunked = sorted((r for r in rows if r["chunks"] > 1), key=lambda r: r["chunks"])
    if len(chunked) < 2:
        return None
    few, many = chunked[0], chunked[-1]
    extra = (many["median_ms"] - few["median_ms"]) - (
        many["suffix_alone_ms"] - few["suffix_alone_ms"])
    return {"from": few["chunks"], "to": many["chunks"], "extra_ms": round(extra, 2),
            "per_extra_message_ms": round(extra / (many["chunks"] - few["chunks"]), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-7b")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--action", default="q8:r=12")
    p.add_argument("--chunks", default="2,8", help="the chunked runs' N, a comma list")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    (first, *more), link = experiments(args)
    with open_session(first, side_environments(first)) as pair:  # one pair for every run
        items = pair.wait_ready(TIMEOUT_S)
        for exp in more:
            items += pair.ask(exp, TIMEOUT_S)
        pair.close(TIMEOUT_S)
    summaries = [r for r in items if isinstance(r, Summary)]
    rows = [row(s) for s in summaries]
    print(json.dumps({"model": args.model, "seq_len": args.seq_len, "action": args.action,
                      "pinning": summaries[0].pinning, "suffix_layer_ms": link.suffix_layer_ms,
                      "link_gbps": link.link_gbps, "target_ratio": TARGET, "runs": rows,
                      "chunk_cost": chunk_cost(rows)}))


if __name__ == "__main__":
    main()
