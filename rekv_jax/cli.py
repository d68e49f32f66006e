"""`rekv` command line: one subcommand per stage of the pipeline, JSON on stdout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rekv_jax.config import ModelConfig


def load_config(spec: str) -> ModelConfig:
    """`--model` value: a preset name, or `hf:PATH` for an HF checkpoint folder."""
    if spec.startswith("hf:"):
        return ModelConfig.from_hf(spec[3:])
    return ModelConfig.preset(spec)


def cmd_info(args: argparse.Namespace) -> None:
    cfg = load_config(args.model)
    from rekv_jax import sizes

    print(json.dumps({"config": cfg.to_dict(), "sizes": sizes.model_sizes(cfg, args.seq_len)}))


def cmd_bytes(args: argparse.Namespace) -> None:
    cfg = load_config(args.model)
    from rekv_jax import sizes

    print(json.dumps(sizes.handoff_bytes(cfg, args.seq_len, args.bits, args.cut, args.batch)))


def cmd_plan(args: argparse.Namespace) -> None:
    cfg = load_config(args.model)
    from rekv_jax.action import action_space, parse_actions
    from rekv_jax.costmodel import load_profiles
    from rekv_jax.planner import plan, select_profile

    profile = None
    if args.profile:
        profile = select_profile(load_profiles(args.profile), cfg, args.seq_len, args.batch)
    if args.actions:
        actions = parse_actions(args.actions, cfg.num_layers)
    else:
        bits = sorted(profile.quantize_ms if profile else (16, 8, 4), reverse=True)
        if args.bits:
            bits = [int(b) for b in args.bits.split(",")]
        actions = list(action_space(cfg.num_layers, bits))
    print(json.dumps(plan(cfg, args.seq_len, profile, args.link_gbps, actions, args.batch,
                          args.schedule)))


def cmd_handoff(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from rekv_jax import handoff

    schedules = handoff.SCHEDULES if args.schedule == "both" else (args.schedule,)
    exp = handoff.Experiment(**json.loads(args.experiment)) if args.experiment else (
        handoff.Experiment(
            model=args.model, seq_len=args.seq_len, batch=args.batch, actions=args.actions,
            schedules=schedules, transport=args.transport, link_gbps=args.link_gbps,
            warmup=args.warmup, reps=args.reps, fallback=args.fallback,
            backend=args.quant_backend, seed=args.seed, timeout=args.timeout,
            prefill_devices=args.prefill_devices, decode_devices=args.decode_devices))
    from rekv_jax.sharding import force_host_devices  # before JAX starts (CPU host devices)

    # the decode side also builds the prefill mesh, for its reference (handoff.summarize)
    force_host_devices(exp.prefill_devices if args.role == "prefill"
                       else max(exp.prefill_devices, exp.decode_devices))
    cfg = load_config(exp.model)
    summaries: list[dict] = []
    records = sys.stdout
    if args.json:  # stdout carries records only: native libraries (gloo) print to fd 1
        records = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def emit(record: dict) -> None:
        if args.json:
            print(json.dumps(record), file=records, flush=True)
        if record["kind"] == "summary":
            summaries.append(record)

    if args.role is not None:  # one process of a pair started by a scheduler (or by us)
        handoff.run_process(args.role, exp, args.coordinator, emit)
        return
    bar = tqdm(total=handoff.total_handoffs(exp, cfg.num_layers), desc="handoffs", unit="",
               file=sys.stderr, disable=args.json)
    if exp.transport == "local":
        handoff.run_local(exp, emit, bar.update)
    else:  # both processes on this machine: we are the decode side, a child is the prefill side
        handoff.launch_pair(exp, emit, bar.update)
    bar.close()
    if not args.json:
        handoff.print_table(summaries)


def cmd_quality(args: argparse.Namespace) -> None:
    from rekv_jax import data, quality
    from rekv_jax.action import parse_actions

    cfg, params, tok = quality.load_model(args.model or str(quality.SHIPPED_MODEL))
    test_ids = data.encode(tok, data.read_split("test", args.wikitext))
    evals = quality.eval_set(tok, test_ids, args.seq_len, args.cont_len, args.windows)
    if not args.json:  # a markdown table
        print("| model | S | action | top-1 agree (flips) | KL(BF16‖a) | PPL BF16 | PPL | "
              "PPL change | NIAH | eligible |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in quality.evaluate(cfg, params, evals, parse_actions(args.actions, cfg.num_layers)):
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"| {r['model']} | {r['seq_len']} | {r['action']} | {r['top1_agree']:.4f} "
                  f"({r['top1_flips']}) | {r['kl']:.2e} | {r['ppl_bf16']:.3f} | {r['ppl']:.3f} | "
                  f"{r['ppl_rel_change']:+.3%} | {r['niah_pass']}/{r['niah_total']} | "
                  f"{'yes' if r['eligible'] else 'no'} |", flush=True)


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return rows


def cmd_select(args: argparse.Namespace) -> None:
    from rekv_jax.quality import select

    timings = _read_jsonl(args.timings) if args.timings else []
    timings = [t for t in timings if t.get("kind", "summary") == "summary"
               and t.get("batch", 1) == args.batch]
    for choice in select(_read_jsonl(args.quality), timings):
        print(json.dumps(choice))


def cmd_profile(args: argparse.Namespace) -> None:
    from rekv_jax import sweep

    prof = sweep.profile(args.model, args.seq_len, args.transport, args.link_gbps, args.reps)
    print(json.dumps(prof.to_json()))


def cmd_sweep(args: argparse.Namespace) -> None:
    from pathlib import Path

    from rekv_jax import report, sweep

    preset = sweep.PRESETS[args.preset]
    if args.link_gbps is not None:
        preset = dataclasses.replace(preset, link_gbps=args.link_gbps)
    records, profiles = sweep.sweep(preset, Path(args.out), args.reps, args.warmup)
    errors = report.error_summary(report.prediction_rows(records, profiles))
    print(json.dumps({"kind": "prediction_error_pct", **errors}))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="print a config and its per-layer sizes as JSON")
    p.add_argument("--model", default="tiny", help="preset name or hf:PATH")
    p.add_argument("--seq-len", type=int, default=8192, help="prompt length for the byte sizes")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bytes", help="bytes sent by a handoff action (paper Eqs. 5, 7) as JSON")
    p.add_argument("--model", default="tiny", help="preset name or hf:PATH")
    p.add_argument("--seq-len", type=int, default=8192, help="prompt length S")
    p.add_argument("--bits", type=int, default=16, help="prefix precision: 16, 8 or 4")
    p.add_argument("--cut", type=int, required=True,
                   help="first recomputed layer c: L = transfer-only, 0 = full recomputation")
    p.add_argument("--batch", type=int, default=1, help="prompts per handoff B")
    p.set_defaults(func=cmd_bytes)

    p = sub.add_parser("plan", help="predicted latency of every action and the best one (JSON)")
    p.add_argument("--model", default="tiny", help="preset name or hf:PATH")
    p.add_argument("--seq-len", type=int, default=8192, help="prompt length S")
    p.add_argument("--batch", type=int, default=1, help="prompts per handoff B")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="link bandwidth in GB/s (re-targets a profile; default: the profile's, "
                        "or the paper's H100 TCP path for the analytic profile)")
    p.add_argument("--profile", default=None,
                   help="profile JSON/JSONL (e.g. from `rekv profile` on a GPU); default: analytic")
    p.add_argument("--actions", default=None, help="comma list of PREC:CUT, or all")
    p.add_argument("--bits", default=None, help="precisions to consider, e.g. 16,8 (default all)")
    p.add_argument("--schedule", default="overlapped", choices=("overlapped", "sequential"))
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("handoff", help="timed handoffs between a prefill and a decode process")
    p.add_argument("--model", default="tiny", help="preset name or hf:PATH")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--actions", default="bf16:full,q8:full,bf16:r=2,q8:r=2,bf16:recompute",
                   help="comma list of PREC:CUT (bf16|q8|q4 : c|full|recompute|r=N), or all")
    p.add_argument("--schedule", choices=["overlapped", "sequential", "both"], default="both")
    p.add_argument("--transport", choices=["transfer-server", "collective", "local"],
                   default="transfer-server")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="pace every receive to emulate a link of this many GB/s")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--fallback", choices=["error", "recompute"], default="error",
                   help="on a failed prefix transfer: fail, or rebuild the cache from token ids")
    p.add_argument("--quant-backend", choices=["xla", "pallas", "pallas-interpret"], default=None,
                   help="default: Pallas on GPU, XLA elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    p.add_argument("--prefill-devices", type=int, default=1,
                   help="tensor-parallel devices of the prefill side (CPU: host devices)")
    p.add_argument("--decode-devices", type=int, default=1,
                   help="tensor-parallel devices of the decode side")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--role", choices=["prefill", "decode"], default=None,
                   help="run one side only (multi-host); default: start both here")
    p.add_argument("--coordinator", default=None,
                   help="host:port of the decode process (default: detected, e.g. SLURM)")
    p.add_argument("--experiment", default=None, help=argparse.SUPPRESS)  # JSON, from launch_pair
    p.set_defaults(func=cmd_handoff)

    p = sub.add_parser("profile", help="measure per-layer alpha, beta, gamma, H, J (JSON)")
    p.add_argument("--model", default="tiny", help="preset name")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--transport", choices=["transfer-server", "collective", "local"],
                   default="transfer-server")
    p.add_argument("--link-gbps", type=float, default=None, help="pace the link (GB/s)")
    p.add_argument("--reps", type=int, default=5)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("sweep", help="measured sweep -> JSONL, CSV, tables and figures")
    p.add_argument("--preset", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="override the preset's link (cpu: calibrated to the paper's ratio)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("quality", help="output-quality gate of handoff actions (paper §2.4)")
    p.add_argument("--model", default=None,
                   help="trained-model folder (default: the shipped wt2-tiny) or hf:PATH")
    p.add_argument("--actions", default="q8:full,q8:r=2,q4:full,q4:r=2",
                   help="comma list of PREC:CUT (bf16|q8|q4 : c|full|recompute|r=N), or all")
    p.add_argument("--seq-len", type=int, default=512, help="context S handed off")
    p.add_argument("--cont-len", type=int, default=64, help="continuation tokens T scored")
    p.add_argument("--windows", type=int, default=8, help="WikiText-2 test windows")
    p.add_argument("--wikitext", default=None,
                   help="WikiText-2 folder (default: $REKV_WIKITEXT or ../shared/data/wikitext-2)")
    p.add_argument("--json", action="store_true", help="one JSON object per action")
    p.set_defaults(func=cmd_quality)

    p = sub.add_parser("select", help="Eq. 13: fastest eligible action per (model, length)")
    p.add_argument("--quality", required=True, help="JSONL from `rekv quality --json`")
    p.add_argument("--timings", default=None,
                   help="JSONL of sweep summaries (model, seq_len, action, median_ms)")
    p.add_argument("--batch", type=int, default=1, help="use timings measured at this batch")
    p.set_defaults(func=cmd_select)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"rekv {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
