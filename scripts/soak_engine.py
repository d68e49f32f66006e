"""Soak the decode engine: N requests through one engine and one prefill worker (both in this
process over the in-process link, `serving.scripted.serve_local`); does its memory stay flat and
does its page pool empty? (JSON)

Requests of mixed actions and prompt lengths (drawn from `--seed`) arrive `--gap-ms` apart, so
several are in flight at once (handed off while others decode) and, with `--pool-pages` small,
some wait for pages. Resident memory is read when the `--warmup`th request finished (every
program compiled by then) and at the end; `rss_growth` is their ratio - 1, to be within
`--max-rss-growth` (2%). The pool must end with every page free, and no request may fail.

    python scripts/soak_engine.py --requests 1000
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

ACTIONS = ("bf16:full", "q8:full", "bf16:r=2", "q8:r=2", "q4:r=3", "bf16:recompute")
PROMPTS = (32, 64, 96)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def run(args: argparse.Namespace) -> dict:
    from rekv_jax.serving.member import MemberSetup
    from rekv_jax.serving.pages import PoolConfig
    from rekv_jax.serving.requests import Finished, ServeRequest
    from rekv_jax.serving.scripted import Ask, serve_local

    setup = MemberSetup(args.model, pool=PoolConfig(args.pool_pages, 16), timeout=120)
    model = setup.load()
    rng = np.random.default_rng(args.seed)
    asks = [Ask(ServeRequest(i, rng.integers(0, model.cfg.vocab_size,
                                             int(rng.choice(PROMPTS))).tolist(),
                             int(rng.integers(2, args.max_new_tokens + 1)),
                             arrival_s=i * args.gap_ms / 1e3), str(rng.choice(ACTIONS)), 32)
            for i in range(args.requests)]
    seen = {"finished": 0, "rss": {}}

    def on_item(item: object) -> None:
        if isinstance(item, Finished):
            seen["finished"] += 1
            if seen["finished"] == args.warmup:
                seen["rss"]["after_warmup"] = rss_kib()

    start = time.monotonic()
    out = serve_local(setup, asks, on_item, model)
    seen["rss"]["end"] = rss_kib()
    failed = [s.failure for s in out.served if s.failure is not None]
    growth = seen["rss"]["end"] / seen["rss"]["after_warmup"] - 1
    return {"model": args.model, "requests": args.requests, "gap_ms": args.gap_ms,
            "pool_pages": args.pool_pages, "wall_s": round(time.monotonic() - start, 1),
            "load_average": os.getloadavg()[0], "rss_kib": seen["rss"], "rss_growth": growth,
            "max_rss_growth": args.max_rss_growth, "failed": len(failed),
            "errors": sorted(set(failed))[:5], "used_pages_at_end": out.used_pages,
            "ok": not failed and out.used_pages == 0 and growth <= args.max_rss_growth}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--gap-ms", type=float, default=15.0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--pool-pages", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=0.02)
    args = p.parse_args()
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
