"""How long each serving policy takes to choose a request's mode and workers: router time that
every request waits before its `Prefill` is sent (JSON: a row per policy and prompt length).

Each choice is made on a ledger whose link estimate has just changed, as in a served stream
(a transfer is timed between requests), so no choice reuses the plans played for the one
before it under the same bandwidth.

    python scripts/bench_policy_choice.py --profile results/serve/2026-12-04e/profiles.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rekv_jax.config import ModelConfig
from rekv_jax.planning.profile import load_profiles
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.policy import Context, Policy, check_policy_names, make_policies
from rekv_jax.serving.requests import ServeRequest

# a decode worker's iteration costs (ms): they set the stretch k, not how long a choice takes
COSTS = DecodeCosts(step_fixed_ms=6.0, step_per_request_ms=4.0, suffix_budget_ms=20.0)


def choice_ms(policy: Policy, ledger: Ledger, prompt_len: int, reps: int) -> list[float]:
    """`reps` timed choices for a prompt of `prompt_len` tokens (after one untimed: the
    policy's modes for the length are built once)."""
    request = ServeRequest(0, (1,) * prompt_len, 32)
    policy.choose(request, ledger, 0.0)
    out = []
    for i in range(reps):
        ledger = ledger.link_timed(0, 0, 1_000_000 + i, 250.0)  # a new bandwidth estimate
        start = time.perf_counter()
        policy.choose(request, ledger, 0.0)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a `rekv profile --json` file")
    ap.add_argument("--model", default="tiny-7b")
    ap.add_argument("--policy", default="bf16:full,q8:full,q8:balanced,adaptive")
    ap.add_argument("--prompt-lens", default="256,512")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    try:
        cfg = ModelConfig.preset(args.model)
        profiles = tuple(load_profiles(args.profile))
        context = Context(cfg.name, cfg.num_layers, profiles, COSTS)
        policies = make_policies(check_policy_names(args.policy, cfg.num_layers), context)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    ledger, rows = Ledger.idle(1, 1, profiles[0].link_gbps), []
    for policy in policies:
        for n in (int(x) for x in args.prompt_lens.split(",")):
            ms = sorted(choice_ms(policy, ledger, n, args.reps))
            rows.append({"policy": policy.name, "prompt_len": n, "modes": len(policy.modes(n)),
                         "choice_ms_p50": statistics.median(ms), "choice_ms_max": ms[-1]})
    print(json.dumps({"model": cfg.name, "profile": args.profile, "reps": args.reps,
                      "choices": rows}, indent=1))


if __name__ == "__main__":
    main()
