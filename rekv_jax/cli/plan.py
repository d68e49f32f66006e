"""`rekv plan`: its flags and its handler (the planner's CLI, kept out of `rekv_jax.cli`)."""

from __future__ import annotations

import argparse
import json

from rekv_jax.mode import INTERVALS, PREFILL_MODES, SCHEDULES


def _choices(allowed: tuple[str, ...]):
    """argparse type of a comma list of `allowed` names."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(","))
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {allowed}, got {text!r}")
        return names
    return parse


def _counts(text: str) -> tuple[int, ...]:
    """argparse type of a comma list of positive chunk counts."""
    try:
        counts = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected chunk counts like 4 or 2,4,8, got {text!r}"
                                         ) from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"chunk counts must be positive, got {text!r}")
    return counts


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `rekv plan` beyond the shared model, length, batch, actions, link and json."""
    from rekv_jax.planning.planner import CHUNK_CHOICES

    p.add_argument("--profile", default=None,
                   help="profile JSON/JSONL (e.g. from `rekv profile` on a GPU); default: analytic")
    p.add_argument("--bits", dest="plan_bits", default=None,
                   help="precisions to consider, e.g. 16,8 (default all)")
    p.add_argument("--schedule", type=_choices(SCHEDULES), default=SCHEDULES,
                   help=f"schedules to choose from, a comma list of {', '.join(SCHEDULES)} "
                        "(default all)")
    p.add_argument("--interval", choices=INTERVALS, default=INTERVALS[0],
                   help="time from the prefill state being ready (paper Table 1) or from the "
                        "prompt's arrival at the prefill worker")
    p.add_argument("--prefill", type=_choices(PREFILL_MODES), default=None,
                   help=f"prefill modes to choose from, a comma list of {', '.join(PREFILL_MODES)}"
                        " (default: full for --interval ready, all for prompt)")
    p.add_argument("--chunks", type=_counts, default=CHUNK_CHOICES,
                   help="token chunk counts to choose from for the chunked schedules "
                        f"(default {','.join(map(str, CHUNK_CHOICES))})")
    p.add_argument("--quality", default=None,
                   help="gate results (`rekv quality --json` output): choose only eligible "
                        "actions (default: none; every action's quality is unchecked)")


def cmd_plan(args: argparse.Namespace) -> None:
    """Predict every candidate, choose one and print the plan (a table, or one JSON object)."""
    from rekv_jax.action import parse_actions, parse_formats
    from rekv_jax.gate_result import load_gate
    from rekv_jax.model.loader import load_config
    from rekv_jax.planning.costmodel import load_profiles
    from rekv_jax.planning.planner import plan, plan_text, select_profile

    cfg = load_config(args.model)
    profile = None
    if args.profile:
        profile = select_profile(load_profiles(args.profile), cfg, args.seq_len, args.batch)
    formats = parse_formats(args.prefix_format) if args.prefix_format else None
    actions = parse_actions(args.actions, cfg.num_layers, formats) if args.actions else None
    bits = [int(b) for b in args.plan_bits.split(",")] if args.plan_bits else None
    gate = load_gate(args.quality) if args.quality else None
    result = plan(cfg, args.seq_len, profile, args.link_gbps, actions, args.batch, args.schedule,
                  args.interval, args.prefill, args.chunks, gate, args.quality, bits, formats)
    print(json.dumps(result.to_json()) if args.json else plan_text(result), flush=True)
