"""Do a `rekv serve --json` run's BF16 requests decode what a single process decodes? Prints JSON.

The run's records name prompts by length and arrival; the streams are deterministic, so the same
`rekv serve` load flags rebuild every prompt. Each completed request whose action is BF16
(lossless) is matched to its prompt by rate and arrival time, and its tokens are compared with
greedy decoding of that prompt in this process (`model.transformer.greedy_decode` after a plain
prefill); `--most N` checks every k-th such request, N in all.

    python scripts/check_served_tokens.py results/serve/tiny-7b-1p1d.jsonl --most 40 -- \\
        --model tiny-7b --rates 0.6,1.2,1.8,2.3 --requests 100 --prompt-lens 256,512 \\
        --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys


def bf16_records(path: str) -> list[dict]:
    """The completed BF16-action requests of a run's records, in file order."""
    out = []
    for line in open(path):
        r = json.loads(line)
        if (r.get("kind") == "served_request" and r["completed"]
                and r["assignment"]["action"].startswith("bf16:")):
            out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                usage="%(prog)s RECORDS [--most N] -- REKV_SERVE_FLAGS...")
    p.add_argument("records")
    p.add_argument("--most", type=int, default=40)
    argv = sys.argv[1:]
    if "--" not in argv:
        p.error("give the run's rekv serve load flags after --")
    cut = argv.index("--")
    args, flags = p.parse_args(argv[:cut]), argv[cut + 1:]
    import jax.numpy as jnp
    import numpy as np

    from rekv_jax.cli import main as cli
    from rekv_jax.cli.serve import serve_config
    from rekv_jax.model.loader import load_model
    from rekv_jax.model.transformer import greedy_decode, prefill

    config = serve_config(cli.build_parser("serve").parse_args(["serve", *flags]))
    prompts = {(s.rate, round(r.arrival_s, 9)): r.tokens for s in config.streams
               for r in s.requests}
    records = bf16_records(args.records)
    step = max(1, len(records) // max(args.most, 1))
    model = load_model(config.model, dtype=jnp.bfloat16, orbax=False)
    checked, wrong = 0, []
    for r in records[::step][:args.most]:
        tokens = prompts[(r["rate"], round(r["arrival_s"], 9))]
        ids = jnp.asarray([tokens], jnp.int32)
        kv, logits = prefill(model.cfg, model.params, ids)
        want = np.asarray(greedy_decode(model.cfg, model.params, kv, logits,
                                        r["max_new_tokens"]))[0].tolist()
        checked += 1
        if r["tokens"] != want:
            wrong.append({"policy": r["policy"], "rate": r["rate"], "id": r["id"],
                          "action": r["assignment"]["action"]})
    json.dump({"records": args.records, "bf16_requests": len(records), "checked": checked,
               "equal": checked - len(wrong), "wrong": wrong}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
