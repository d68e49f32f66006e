"""`rekv profile`, `rekv sweep`, `rekv doctor`: the study's commands."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rekv_jax.cli.flags import PAPER_LINK
from rekv_jax.cli.render import emit_json


def cmd_profile(args: argparse.Namespace) -> None:
    from rekv_jax.study import sweep

    if args.link_gbps == PAPER_LINK:
        args.link_gbps = sweep.calibrate_pair_link(args.model, args.seq_len,
                                                   args.transport).link_gbps
    prof = sweep.profile(args.model, args.seq_len, args.transport, args.link_gbps, args.reps)
    if args.json:
        return emit_json([prof.to_json()])
    print(f"{prof.model}, {prof.seq_len} tokens, {prof.hardware}, {prof.link} "
          f"(fitted W {prof.link_gbps:.4g} GB/s), per layer in ms:")
    print(f"  suffix γ {prof.suffix_layer_ms:.3f}; "
          + "; ".join(f"{b}-bit: quantize α {prof.quantize_ms[b]:.3f}, β {prof.beta(b):.3f}"
                      for b in sorted(prof.quantize_ms, reverse=True)))
    print("  `--json` for the whole profile (the input of `rekv plan --profile`)")


def cmd_sweep(args: argparse.Namespace) -> None:
    from pathlib import Path

    from rekv_jax.study import sweep
    from rekv_jax.study import tables as study_tables
    from rekv_jax.study.sweep_plan import QUICK_PRESETS, SWEEP_PRESETS

    preset = (QUICK_PRESETS if args.quick else SWEEP_PRESETS)[args.preset]
    if args.reps is None:  # the preset's; with --quick, fewer for a short lease
        args.reps, args.warmup = (10, 2) if args.quick else (preset.reps, args.warmup)
    if args.link_gbps is None:
        raise ValueError("a sweep runs paced links (the crossover runs are multiples of its "
                         "link); the gpu preset adds an unpaced block of its own")
    if args.link_gbps != PAPER_LINK:
        preset = dataclasses.replace(preset, link_gbps=args.link_gbps)
    if args.dry_run:
        return print(sweep.dry_run(args.preset, preset, args.reps, args.warmup, args.quick,
                                   not args.no_pin))
    if args.out is None:
        raise ValueError("rekv sweep needs --out (or --dry-run)")
    records, profiles = sweep.sweep(preset, Path(args.out), args.reps, args.warmup,
                                    not args.no_pin)
    errors = study_tables.error_summary(study_tables.prediction_rows(records, profiles))
    if args.json:
        return emit_json([{"kind": "prediction_error_pct", **errors}])
    print(f"wrote {len(records)} summaries, tables and figures to {args.out}")
    print("cost model median |error| %: " + ", ".join(f"{a} {e:.1f}" for a, e in errors.items()))


def cmd_doctor(args: argparse.Namespace) -> None:
    from rekv_jax.study import doctor

    checks = doctor.run_checks()
    result = doctor.report(checks)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    if args.json:
        emit_json([result.to_json()])
    else:
        doctor.print_table(checks)
    if not result.passed:
        raise SystemExit(1)
