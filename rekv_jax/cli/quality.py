"""`rekv quality`, `rekv select`: the quality gate and Eq. 13's selection."""

from __future__ import annotations

import argparse
import json

from rekv_jax.cli.render import emit_json


def cmd_quality(args: argparse.Namespace) -> None:
    from rekv_jax.action import parse_actions, parse_formats
    from rekv_jax.model.loader import SHIPPED_MODEL, load_model
    from rekv_jax.quality import data
    from rekv_jax.quality import gate as quality

    model = load_model(args.model or str(SHIPPED_MODEL))
    if model.tokenizer is None:
        raise ValueError(f"--model {args.model}: quality needs a model with a tokenizer.json")
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    test_ids = data.encode(tok, data.read_split("test", args.wikitext))
    evals = quality.eval_set(tok, test_ids, args.seq_len, args.cont_len, args.windows)
    if not args.json:  # a markdown table
        print("| model | S | action | top-1 agree (flips) | KL(BF16‖a) | PPL BF16 | PPL | "
              "PPL change | NIAH | eligible |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    formats = parse_formats(args.prefix_format) if args.prefix_format else None
    actions = parse_actions(args.actions, cfg.num_layers, formats)
    for r in quality.evaluate(cfg, params, evals, actions, args.chunks, args.pipelined):
        if args.json:
            print(json.dumps(r.to_json()), flush=True)
        else:
            m = r.metrics
            print(f"| {r.model} | {r.seq_len} | {r.action} | {m.top1_agree:.4f} "
                  f"({m.top1_flips}) | {m.kl:.2e} | {m.ppl_bf16:.3f} | {m.ppl:.3f} | "
                  f"{m.ppl_rel_change:+.3%} | {m.niah_pass}/{m.niah_total} | "
                  f"{'yes' if r.eligible else 'no'} |", flush=True)


def cmd_select(args: argparse.Namespace) -> None:
    from rekv_jax.gate_result import load_gate
    from rekv_jax.study import tables
    from rekv_jax.study.records import read_summaries
    from rekv_jax.study.selection import select

    timings = read_summaries(args.timings) if args.timings else []
    timings = [t for t in timings if t.batch == args.batch]
    choices = select(load_gate(args.quality), timings)
    if args.json:
        return emit_json(c.to_json() for c in choices)
    for c in choices:
        chosen = f"{c.chosen} ({c.median_ms:.2f} ms)" if c.chosen else "none timed"
        untimed = (f"; eligible but untimed: {', '.join(c.untimed_eligible)}"
                   if c.untimed_eligible else "")
        setup = f" ({tables.setup_label(c.setup)})" if c.setup else ""
        print(f"{c.model}, {c.seq_len} tokens{setup}: {chosen}; eligible: "
              f"{', '.join(c.eligible) or 'none'}{untimed}")
