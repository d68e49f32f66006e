"""Do the prefill device and the link work at once? A burst of N `bf16:full` requests, all
arriving at 0, through `rekv serve`'s stack (`serving.serve.serve`: one prefill and one decode
worker process, pinned, the transfer server between them, paced to a link on which one
request's transfer takes about one prefill). (JSON)

With overlapped stages the burst's first tokens all arrive within p + n max(p, l): the first
prefill, then one request per slower stage; serial stages take n (p + l). `p` is the measured
prefill (median `PrefillDone.compute_ms`), `l` a handoff's bytes over the paced bandwidth, `n`
the burst; the target is a span of first tokens (the last one's time after the burst's arrival)
within 15% of the overlapped bound. Each request's prefill-side send time (its first message
handed to the link to its last verdict, `PrefillDone.link_ms`) is reported too: on the faithful
link it is at least `l`.

The link: `--link-gbps`; `--calibrate`: paced so that a handoff takes the median prefill of a
first burst of `CALIBRATION_BURST` requests, measured now on the same stack (as loaded as the
machine is); by default the `rekv profile` record's (`--profile`, at the prompt length: the
calibrated link of `results/serve.md`, on which a handoff takes about one prefill on a quiet
machine). The profile also gives the router's cost model its figures.

    python scripts/bench_stage_overlap.py --profile results/serve/profiles.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

CALIBRATION_BURST = 4  # requests whose median prefill `--calibrate` paces the link to


def run(args: argparse.Namespace) -> dict:
    from rekv_jax.launch.group import Emitted
    from rekv_jax.model.loader import load_config
    from rekv_jax.planning.profile import load_profiles
    from rekv_jax.serving.metrics import Slo
    from rekv_jax.serving.requests import PrefillDone, ServeRequest
    from rekv_jax.serving.serve import serve
    from rekv_jax.serving.serve_config import ServeConfig, Stream, Workers

    cfg = load_config(args.model)
    profiles = tuple(p for p in load_profiles(args.profile)
                     if p.model == cfg.name and p.seq_len == args.prompt)
    if not profiles:
        raise SystemExit(f"{args.profile}: no profile of {cfg.name} at {args.prompt} tokens")
    rng = np.random.default_rng(args.seed)
    burst = tuple(ServeRequest(i, rng.integers(0, cfg.vocab_size, args.prompt).tolist(),
                               args.new_tokens) for i in range(args.requests))

    def burst_of(n: int, gbps: float) -> tuple:
        config = ServeConfig(args.model, ("bf16:full",), Slo(60_000, 60_000),
                             Workers(link_gbps=gbps, timeout=args.timeout),
                             streams=(Stream(0.0, burst[:n]),), profiles=profiles)
        done: list[tuple[float, PrefillDone]] = []

        def on_event(event: object) -> None:
            if isinstance(event, Emitted) and isinstance(event.item, PrefillDone):
                done.append((time.monotonic(), event.item))

        return serve(config, on_event).served, done

    gbps, calibration = args.link_gbps or profiles[0].link_gbps, None
    if args.calibrate:  # one prefill's time, measured here now: the link moves a handoff in it
        _, done = burst_of(CALIBRATION_BURST, gbps)
        p = statistics.median(d.compute_ms for _, d in done if d.error is None)
        nbytes = max(d.sent_bytes for _, d in done)
        gbps, calibration = nbytes / (p * 1e-3) / 1e9, {"p_ms": p, "bytes": nbytes}
    start = time.monotonic()
    served, done = burst_of(args.requests, gbps)
    out = report(args, gbps, served, done, time.monotonic() - start)
    return out | {"calibration": calibration}


def report(args: argparse.Namespace, gbps: float, served, done, wall_s: float) -> dict:
    """The figures of the burst (see the module's docstring)."""
    failed = [s.failure for s in served if not s.completed]
    reports = [d for _, d in done if d.error is None]
    p = statistics.median(d.compute_ms for d in reports)
    nbytes = max(d.sent_bytes for d in reports)
    l_ms = 1e3 * nbytes / (gbps * 1e9)
    n = args.requests
    first = sorted(s.ttft_ms for s in served if s.ttft_ms is not None)
    span = first[-1] if first else float("nan")  # every request arrived at 0
    bound = 1.15 * (p + n * max(p, l_ms))
    times = [t for t, d in done if d.error is None]
    return {"model": args.model, "prompt_tokens": args.prompt, "n": n,
            "new_tokens": args.new_tokens, "link_gbps": gbps,
            "link_from": ("--calibrate" if args.calibrate else "--link-gbps" if args.link_gbps
                          else f"{args.profile} (link_gbps)"),
            "p_ms": p, "prefill_compute_ms": sorted(d.compute_ms for d in reports),
            "bytes": nbytes, "l_ms": l_ms,
            "prefill_link_ms": [d.link_ms for d in sorted(reports, key=lambda d: d.request_id)],
            "link_faithful": all(d.link_ms >= l_ms for d in reports),
            "prefill_done_gaps_ms": [1e3 * (b - a) for a, b in zip(times[:-1], times[1:],
                                                                    strict=True)],
            "first_tokens_ms": first, "span_ms": span, "bound_ms": bound,
            "overlapped_ms": p + n * max(p, l_ms), "serial_ms": n * (p + l_ms),
            "pass": not failed and span <= bound, "failed": failed,
            "wall_s": round(wall_s, 1), "load_average": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-7b")
    p.add_argument("--prompt", type=int, default=256, help="tokens per prompt")
    p.add_argument("--requests", type=int, default=12, help="the burst's size n")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--profile", default="results/serve/profiles.jsonl")
    p.add_argument("--link-gbps", type=float, default=None)
    p.add_argument("--calibrate", action="store_true",
                   help=f"pace the link so a handoff takes the median prefill of a first burst "
                        f"of {CALIBRATION_BURST}, measured now")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
