"""`rekv` command line: one subcommand per stage of the pipeline.

Every subcommand prints a table or a few lines for a person; with `--json` it prints one JSON
object per record, one per line, and nothing else on stdout. Flags shared by several subcommands
are defined once, in `FLAGS`; each subcommand lists the flag groups it takes in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

# absl/glog lines of the XLA runtime and of jax.distributed's coordination service are for
# debugging, not for a person's terminal: keep only errors unless the caller asked otherwise.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GLOG_minloglevel", "2")

PAPER_LINK = "paper"  # --link-gbps: pace to the paper's link/suffix ratio, calibrated here
UNPACED = "unpaced"  # --link-gbps: no pacing (loopback runs as fast as it can)


def _schedules(text: str) -> str:
    """`--schedule` value: `both` or a comma list of handoff.SCHEDULES."""
    from rekv_jax.handoff import SCHEDULES

    bad = [s for s in text.split(",") if s not in SCHEDULES]
    if bad and text != "both":
        raise argparse.ArgumentTypeError(f"unknown schedules {bad}; expected a comma list of "
                                         f"{', '.join(SCHEDULES)}, or both")
    return text


def _link(text: str) -> float | str | None:
    """`--link-gbps` value: a bandwidth in GB/s, `paper` or `unpaced`."""
    if text in (PAPER_LINK, UNPACED):
        return None if text == UNPACED else text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GB/s, {PAPER_LINK!r} or {UNPACED!r}, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--link-gbps must be positive, got {text}")
    return value


def _flags() -> dict[str, Callable[[argparse.ArgumentParser], None]]:
    """Flag groups shared across subcommands; `choices` come from the modules' own constants
    (each group imports its module only when a subcommand uses the group)."""

    def json_(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true",
                       help="one JSON object per record (default: readable tables)")

    def model(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="tiny",
                       help="preset name, hf:PATH, or a trained-model folder (holding orbax/)")

    def seq_len(p: argparse.ArgumentParser) -> None:
        p.add_argument("--seq-len", type=int, default=8192, help="prompt length S")

    def batch(p: argparse.ArgumentParser) -> None:
        p.add_argument("--batch", type=int, default=1, help="prompts per handoff B")

    def actions(p: argparse.ArgumentParser) -> None:
        p.add_argument("--actions", default=None,
                       help="comma list of PREC:CUT (bf16|q8|q4 : c|full|recompute|r=N), or all")

    def link(p: argparse.ArgumentParser) -> None:
        p.add_argument("--link-gbps", type=_link, default=None, metavar="GBPS|paper|unpaced",
                       help="link bandwidth in GB/s; `paper`: the paper's link/suffix ratio, "
                            "calibrated on this machine; `unpaced`: no pacing")

    def transport(p: argparse.ArgumentParser) -> None:
        from rekv_jax.transport import TRANSPORTS

        p.add_argument("--transport", choices=TRANSPORTS, default=TRANSPORTS[0])

    def reps(p: argparse.ArgumentParser) -> None:
        p.add_argument("--warmup", type=int, default=3, help="untimed handoffs per action")
        p.add_argument("--reps", type=int, default=30, help="timed handoffs per action")

    def schedule(p: argparse.ArgumentParser) -> None:
        from rekv_jax.handoff import SCHEDULES

        p.add_argument("--schedule", type=_schedules, default="both",
                       help=f"comma list of {', '.join(SCHEDULES)}; both: overlapped,sequential "
                            "(with --prefill pipelined: chunked)")
        p.add_argument("--chunks", type=int, default=None,
                       help="token chunks N of the chunked schedule and the pipelined prefill "
                            "(default 4)")

    def failure(p: argparse.ArgumentParser) -> None:
        from rekv_jax.handoff import FALLBACKS

        p.add_argument("--fallback", choices=FALLBACKS, default=FALLBACKS[0],
                       help="a failed prefix transfer: fail, or rebuild the cache from tokens")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")

    def handoff(p: argparse.ArgumentParser) -> None:
        from rekv_jax.quantize import BACKENDS

        p.add_argument("--quant-backend", choices=BACKENDS, default=None,
                       help="default: Pallas on GPU, XLA elsewhere")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--role", choices=("prefill", "decode"), default=None,
                       help="run one side only (multi-host); default: start both here")
        p.add_argument("--coordinator", default=None,
                       help="host:port of the decode process (default: detected, e.g. SLURM)")
        p.add_argument("--experiment", default=None, help=argparse.SUPPRESS)  # from launch_pair
        # a sweep's pair (sweep.Pair): experiments as JSON lines on stdin, each answered by its
        # records and experiment.SESSION_DONE
        p.add_argument("--session", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("--prefill-devices", type=int, default=1,
                       help="tensor-parallel devices of the prefill side (CPU: host devices)")
        p.add_argument("--decode-devices", type=int, default=1,
                       help="tensor-parallel devices of the decode side")

    def attention(p: argparse.ArgumentParser) -> None:
        from rekv_jax.config import ATTENTION_BACKENDS

        p.add_argument("--attention", choices=ATTENTION_BACKENDS, default=None,
                       help="attention backend, the same as $REKV_ATTENTION, which a child "
                            "process inherits (default: auto: cuDNN flash attention on a GPU "
                            "for bf16, XLA otherwise)")

    def modes(p: argparse.ArgumentParser) -> None:
        from rekv_jax.costmodel import INTERVALS, PREFILL_MODES

        p.add_argument("--interval", choices=INTERVALS, default=INTERVALS[0],
                       help="time from the prefill state being ready (paper Table 1) or from the "
                            "prompt's arrival at the prefill worker")
        p.add_argument("--prefill", choices=PREFILL_MODES, default=PREFILL_MODES[0],
                       help="the prefill worker runs all L layers, or only 0..c-1 streaming each "
                            "layer (split) or token chunk (pipelined) as computed (both need "
                            "--interval prompt)")

    def pin(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-pin", action="store_true",
                       help="CPU sides on one machine share its cores (default: each side "
                            "runs on its own half of them, as two GPUs compute at once)")

    def bits(p: argparse.ArgumentParser) -> None:
        from rekv_jax.action import BITS

        p.add_argument("--bits", type=int, choices=BITS, default=16, help="prefix precision")

    return {"json": json_, "model": model, "seq_len": seq_len, "batch": batch,
            "actions": actions, "link": link, "transport": transport, "reps": reps,
            "schedule": schedule, "failure": failure, "handoff": handoff, "attention": attention,
            "modes": modes, "bits": bits, "pin": pin}


# ---------------------------------------------------------------------------------- output


def _emit_json(records: Iterable[dict[str, Any]]) -> None:
    for r in records:
        print(json.dumps(r), flush=True)


def _mib(n: float) -> str:
    from rekv_jax.sizes import MIB

    return f"{n / MIB:.2f} MiB"


# ---------------------------------------------------------------------------------- commands


def cmd_info(args: argparse.Namespace) -> None:
    from rekv_jax import sizes
    from rekv_jax.loader import load_config

    cfg = load_config(args.model)
    s = sizes.model_sizes(cfg, args.seq_len, args.batch)
    if args.json:
        return _emit_json([{"config": cfg.to_dict(), "sizes": s}])
    print(f"{cfg.name}: {cfg.model_type}, L {cfg.num_layers}, D {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, "
          f"F {cfg.intermediate_size}, V {cfg.vocab_size}")
    print(f"at S {args.seq_len}, B {args.batch}: boundary h_c {_mib(s['boundary_bytes'])}, one KV "
          f"layer {_mib(s['kv_layer_bytes_bf16'])} BF16 / {_mib(s['kv_layer_bytes_q8'])} Q8 / "
          f"{_mib(s['kv_layer_bytes_q4'])} Q4, full BF16 KV {_mib(s['full_kv_bytes_bf16'])}")
    print(f"B_H / B_KV = {s['boundary_to_kv_layer']:.2f}: a BF16 split saves bytes from a suffix "
          f"of {s['min_saving_suffix_bf16']} layers (Eq. 6)")


def cmd_bytes(args: argparse.Namespace) -> None:
    from rekv_jax import sizes
    from rekv_jax.loader import load_config

    cfg = load_config(args.model)
    cut = cfg.num_layers if args.cut is None else args.cut
    b = sizes.handoff_bytes(cfg, args.seq_len, args.bits, cut, args.batch)
    if args.json:
        return _emit_json([b])
    print(f"{cfg.name}, S {args.seq_len}, B {args.batch}, {args.bits}-bit prefix, cut {cut} "
          f"({b['kind']}, suffix of {b['suffix_len']} layers):")
    print(f"  boundary h_c {_mib(b['boundary_bytes'])} + prefix {_mib(b['prefix_payload_bytes'])}"
          f" + token ids {_mib(b['token_bytes'])} = {_mib(b['total_bytes'])}"
          f" (one BF16 KV layer: {_mib(b['kv_layer_bytes_bf16'])})")


def cmd_plan(args: argparse.Namespace) -> None:
    from rekv_jax import plan_cli
    from rekv_jax.planner import PAPER_LINK_GBPS

    if args.link_gbps == PAPER_LINK:
        args.link_gbps = PAPER_LINK_GBPS  # the paper's H100 path
    plan_cli.cmd_plan(args)


def _handoff_experiment(args: argparse.Namespace):
    """The experiment of `rekv handoff` and a line saying which link it runs on."""
    from rekv_jax.action import parse_actions
    from rekv_jax.chunked import DEFAULT_CHUNKS
    from rekv_jax.experiment import (
        DEFAULT_ACTIONS,
        Experiment,
        calibrate_link_in_child,
        side_environments,
    )
    from rekv_jax.handoff import PAPER_SCHEDULES
    from rekv_jax.loader import load_config

    if args.experiment:  # the prefill child of launch_pair: everything already decided
        return Experiment.from_json(args.experiment), ""
    if args.session:  # a sweep's pair: its first experiment decides the processes
        line = sys.stdin.readline()
        if not line.strip():
            raise ValueError("--session: no experiment on stdin")
        return Experiment.from_json(line), ""
    cfg = load_config(args.model)
    cfg.check_seq_len(args.seq_len)
    schedules = (tuple(args.schedule.split(",")) if args.schedule != "both"
                 else ("chunked",) if args.prefill == "pipelined" else PAPER_SCHEDULES)
    link = args.link_gbps
    if link == PAPER_LINK and args.role is not None:
        link = None  # one side of a multi-host pair: the link is real, not emulated
    exp = Experiment(  # checks every field before any process starts
        model=args.model, seq_len=args.seq_len, batch=args.batch,
        actions=tuple(parse_actions(args.actions or DEFAULT_ACTIONS, cfg.num_layers)),
        schedules=schedules, chunks=args.chunks or (DEFAULT_CHUNKS if "chunked" in schedules
                                                    else 1),
        transport=args.transport, link_gbps=None if link == PAPER_LINK else link,
        warmup=args.warmup, reps=args.reps, fallback=args.fallback, backend=args.quant_backend,
        seed=args.seed, timeout=args.timeout, interval=args.interval, prefill=args.prefill,
        prefill_devices=args.prefill_devices, decode_devices=args.decode_devices)
    if link == PAPER_LINK:  # a layer timed on the decode side's cores
        env = (None if exp.transport == "local"
               else side_environments(exp, not args.no_pin)["decode"])
        calibration = calibrate_link_in_child(args.model, args.seq_len, env)
        exp = dataclasses.replace(exp, link_gbps=calibration.link_gbps)
        note = calibration.describe()
    elif link is None:
        note = ("unpaced loopback: the prefix moves in a few ms, far less than the suffix it "
                "would overlap, so quantizing or recomputing has little link time to save "
                "(the paper's regime: --link-gbps paper, the default)")
    else:
        note = f"paced {link:g} GB/s"
    return exp, note


def cmd_handoff(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from rekv_jax import experiment, report
    from rekv_jax.summary import Summary

    exp, note = _handoff_experiment(args)
    from rekv_jax.sharding import force_host_devices  # before JAX starts (CPU host devices)

    # the decode side also builds the prefill mesh, for its reference (experiment.summarize)
    force_host_devices(exp.prefill_devices if args.role == "prefill"
                       else max(exp.prefill_devices, exp.decode_devices))
    summaries = []
    # stdout carries our records and tables only: native libraries (gloo) print to fd 1
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def emit(record) -> None:
        if args.json:
            print(json.dumps(record.to_json()), file=out, flush=True)
        if isinstance(record, Summary):
            if not args.json:  # each row as it completes: a later failure loses none
                print(report.handoff_table([record], header=not summaries), file=out, flush=True)
            summaries.append(record)

    if args.role is not None:  # one process of a pair started by a scheduler (or by us)
        experiment.run_process(args.role, exp, args.coordinator, emit)
        return
    rest = experiment.session_experiments(sys.stdin, out) if args.session else ()
    pinning = "one process"
    if exp.transport != "local":  # a refused set-up (collective on one GPU) before any output
        from rekv_jax.transport.cores import PINNING_ENV

        pinning = experiment.side_environments(exp, not args.no_pin)["decode"].get(PINNING_ENV)
    if not args.json:
        print(f"{exp.model}, {exp.seq_len} tokens, batch {exp.batch}, {exp.transport}"
              + f"; {pinning}" * bool(pinning) + f"; link: {note}", file=out, flush=True)
    bar = tqdm(total=experiment.total_handoffs(exp), desc="handoffs", unit="", file=sys.stderr,
               disable=args.json)
    if exp.transport == "local":
        experiment.run_local(exp, emit, bar.update, rest)
    else:  # both processes on this machine: we are the decode side, a child is the prefill side
        experiment.launch_pair(exp, emit, bar.update, rest, not args.no_pin)
    bar.close()
    if not args.json:
        print("\n".join(report.conclusion(summaries)), file=out, flush=True)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from rekv_jax.sweep import calibrate_link

    c = calibrate_link(args.model, args.seq_len)
    if args.json:
        return _emit_json([{"kind": "link_calibration", **dataclasses.asdict(c)}])
    print(f"{c.model}, {c.seq_len} tokens: {c.describe()}")


def cmd_quality(args: argparse.Namespace) -> None:
    from rekv_jax import data, quality
    from rekv_jax.action import parse_actions
    from rekv_jax.loader import SHIPPED_MODEL, load_model

    model = load_model(args.model or str(SHIPPED_MODEL))
    if model.tokenizer is None:
        raise ValueError(f"--model {args.model}: quality needs a model with a tokenizer.json")
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    test_ids = data.encode(tok, data.read_split("test", args.wikitext))
    evals = quality.eval_set(tok, test_ids, args.seq_len, args.cont_len, args.windows)
    if not args.json:  # a markdown table
        print("| model | S | action | top-1 agree (flips) | KL(BF16‖a) | PPL BF16 | PPL | "
              "PPL change | NIAH | eligible |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    actions = parse_actions(args.actions, cfg.num_layers)
    for r in quality.evaluate(cfg, params, evals, actions, args.chunks, args.pipelined):
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"| {r['model']} | {r['seq_len']} | {r['action']} | {r['top1_agree']:.4f} "
                  f"({r['top1_flips']}) | {r['kl']:.2e} | {r['ppl_bf16']:.3f} | {r['ppl']:.3f} | "
                  f"{r['ppl_rel_change']:+.3%} | {r['niah_pass']}/{r['niah_total']} | "
                  f"{'yes' if r['eligible'] else 'no'} |", flush=True)


def cmd_select(args: argparse.Namespace) -> None:
    from rekv_jax import report
    from rekv_jax.quality import select
    from rekv_jax.summary import read_jsonl, read_summaries

    timings = read_summaries(args.timings) if args.timings else []
    timings = [t for t in timings if t.batch == args.batch]
    choices = select(read_jsonl(args.quality), timings)
    if args.json:
        return _emit_json({**c, "setup": c["setup"] and dataclasses.asdict(c["setup"])}
                          for c in choices)
    for c in choices:
        chosen = (f"{c['chosen']} ({c['median_ms']:.2f} ms)" if c["chosen"]
                  else "none timed")
        untimed = (f"; eligible but untimed: {', '.join(c['untimed_eligible'])}"
                   if c["untimed_eligible"] else "")
        setup = f" ({report.setup_label(c['setup'])})" if c["setup"] else ""
        print(f"{c['model']}, {c['seq_len']} tokens{setup}: {chosen}; eligible: "
              f"{', '.join(c['eligible']) or 'none'}{untimed}")


def cmd_profile(args: argparse.Namespace) -> None:
    from rekv_jax import sweep

    if args.link_gbps == PAPER_LINK:
        args.link_gbps = sweep.calibrate_pair_link(args.model, args.seq_len,
                                                   args.transport).link_gbps
    prof = sweep.profile(args.model, args.seq_len, args.transport, args.link_gbps, args.reps)
    if args.json:
        return _emit_json([prof.to_json()])
    print(f"{prof.model}, {prof.seq_len} tokens, {prof.hardware}, {prof.link} "
          f"(fitted W {prof.link_gbps:.4g} GB/s), per layer in ms:")
    print(f"  suffix γ {prof.suffix_layer_ms:.3f}; "
          + "; ".join(f"{b}-bit: quantize α {prof.quantize_ms[b]:.3f}, β {prof.beta(b):.3f}"
                      for b in sorted(prof.quantize_ms, reverse=True)))
    print("  `--json` for the whole profile (the input of `rekv plan --profile`)")


def cmd_sweep(args: argparse.Namespace) -> None:
    from pathlib import Path

    from rekv_jax import report, sweep
    from rekv_jax.sweep_plan import QUICK_PRESETS, SWEEP_PRESETS

    preset = (QUICK_PRESETS if args.quick else SWEEP_PRESETS)[args.preset]
    if args.quick and args.reps == 30:  # the default: fewer reps for a short lease
        args.reps, args.warmup = 10, 2
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
    errors = report.error_summary(report.prediction_rows(records, profiles))
    if args.json:
        return _emit_json([{"kind": "prediction_error_pct", **errors}])
    print(f"wrote {len(records)} summaries, tables and figures to {args.out}")
    print("cost model median |error| %: " + ", ".join(f"{a} {e:.1f}" for a, e in errors.items()))


def cmd_generate(args: argparse.Namespace) -> None:
    from rekv_jax import generate
    from rekv_jax.chunked import DEFAULT_CHUNKS
    from rekv_jax.experiment import calibrate_link_in_child

    if args.request:  # the prefill process started by generate.generate
        generate.run_process(args.role, generate.Request(**json.loads(args.request)),
                             args.coordinator)
        return
    args.model = args.model or str(generate.SHIPPED_MODEL)
    tok = generate.tokenizer_of(args.model)
    if args.token_ids is not None:
        text = args.token_ids
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        ids = [int(t) for t in text.replace(",", " ").split()]
    elif args.prompt is not None and tok is not None:
        ids = tok.encode(args.prompt).ids
    else:
        raise ValueError("give --prompt TEXT (a model with a tokenizer) or --token-ids 1,2,3|@file")
    link = args.link_gbps
    if link == PAPER_LINK:
        link = calibrate_link_in_child(args.model, len(ids)).link_gbps
    schedule = "chunked" if args.prefill == "pipelined" else args.schedule
    req = generate.Request(
        token_ids=ids, model=args.model, action=args.action, max_new_tokens=args.max_new_tokens,
        dtype=args.dtype, prefill=args.prefill, schedule=schedule, transport=args.transport,
        chunks=args.chunks or (DEFAULT_CHUNKS if schedule == "chunked" else 1),
        link_gbps=link, fallback=args.fallback, compare=args.compare, timeout=args.timeout)
    shown: list[int] = []

    def stream(token: int) -> None:  # print the text as it grows
        if args.json or tok is None:
            return
        before = tok.decode(shown)
        shown.append(token)
        print(tok.decode(shown)[len(before):], end="", flush=True)

    out = generate.generate(req, stream)
    if args.json:
        return _emit_json([out.to_json(args.compare)])
    print(f"\n[{out.action}, {out.prefill} prefill: ttft {out.ttft_ms:.1f} ms, tpot "
          f"{out.tpot_ms:.1f} ms, {out.tokens_per_s:.1f} tokens/s, {out.payload_bytes} B]"
          + (f" first divergence: {out.first_divergence}" if args.compare else ""),
          file=sys.stderr)


def cmd_doctor(args: argparse.Namespace) -> None:
    from rekv_jax import doctor

    checks = doctor.run_checks()
    result = doctor.report(checks)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        _emit_json([result])
    else:
        doctor.print_table(checks)
    if not result["passed"]:
        raise SystemExit(1)


# ---------------------------------------------------------------------------------- parser

# name -> (handler, help, shared flag groups, a function adding the command's own flags)
COMMANDS: dict[str, tuple[Callable, str, tuple[str, ...], Callable]] = {}


def command(name: str, handler: Callable, help: str, groups: tuple[str, ...]) -> Callable:
    """Register a subcommand; the decorated function adds its own flags and defaults."""
    def register(own: Callable[[argparse.ArgumentParser], None]) -> Callable:
        COMMANDS[name] = (handler, help, groups, own)
        return own
    return register


@command("info", cmd_info, "a config and its per-layer sizes",
         ("model", "seq_len", "batch", "json"))
def _info_flags(p: argparse.ArgumentParser) -> None:
    pass


@command("bytes", cmd_bytes, "bytes sent by a handoff action (paper Eqs. 5, 7)",
         ("model", "seq_len", "batch", "bits", "json"))
def _bytes_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cut", type=int, default=None,
                   help="first recomputed layer c: L = transfer-only (default), 0 = recompute")


@command("plan", cmd_plan, "predicted latency of every action and schedule, and the best",
         ("model", "seq_len", "batch", "actions", "link", "json"))
def _plan_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.plan_cli import add_flags

    add_flags(p)


@command("handoff", cmd_handoff, "timed handoffs between a prefill and a decode process",
         ("model", "seq_len", "batch", "actions", "link", "transport", "reps", "schedule",
          "failure", "handoff", "modes", "attention", "pin", "json"))
def _handoff_flags(p: argparse.ArgumentParser) -> None:
    p.set_defaults(seq_len=256, link_gbps=PAPER_LINK)


@command("calibrate", cmd_calibrate, "the paced link of the paper's regime on this machine",
         ("model", "seq_len", "json"))
def _calibrate_flags(p: argparse.ArgumentParser) -> None:
    p.set_defaults(seq_len=256)


@command("profile", cmd_profile, "measure per-layer alpha, beta, gamma, H, J",
         ("model", "seq_len", "link", "transport", "attention", "json"))
def _profile_flags(p: argparse.ArgumentParser) -> None:
    p.set_defaults(seq_len=256)
    p.add_argument("--reps", type=int, default=5)


@command("sweep", cmd_sweep, "measured sweep -> JSONL, CSV, tables and figures",
         ("link", "reps", "attention", "pin", "json"))
def _sweep_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.sweep_plan import SWEEP_PRESETS

    p.set_defaults(link_gbps=PAPER_LINK)  # the preset's: 2.32 GB/s (gpu), calibrated (cpu)
    p.add_argument("--preset", choices=tuple(SWEEP_PRESETS), default="cpu")
    p.add_argument("--out", default=None, help="output folder (required unless --dry-run)")
    p.add_argument("--quick", action="store_true",
                   help="fewer models, lengths, cuts and reps (10, unless --reps is given)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (pairs, experiments, handoffs, programs) and an "
                        "estimate of its wall time, built from its parts; run nothing")


@command("quality", cmd_quality, "output-quality gate of handoff actions (paper §2.4)",
         ("model", "seq_len", "actions", "attention", "json"))
def _quality_flags(p: argparse.ArgumentParser) -> None:
    p.set_defaults(model=None, seq_len=512, actions="q8:full,q8:r=2,q4:full,q4:r=2")
    p.add_argument("--cont-len", type=int, default=64, help="continuation tokens T scored")
    p.add_argument("--chunks", type=int, default=1,
                   help="score the chunked schedule's cache: the suffix in N token chunks")
    p.add_argument("--pipelined", action="store_true",
                   help="with --chunks: the pipelined prefill's cache (every layer chunked)")
    p.add_argument("--windows", type=int, default=8, help="WikiText-2 test windows")
    p.add_argument("--wikitext", default=None,
                   help="WikiText-2 folder (default: $REKV_WIKITEXT, else the shipped copy)")


@command("select", cmd_select, "Eq. 13: fastest eligible action per (model, length)", ("json",))
def _select_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quality", required=True, help="JSONL from `rekv quality --json`")
    p.add_argument("--timings", default=None, help="JSONL of handoff or sweep summaries")
    p.add_argument("--batch", type=int, default=1, help="use timings measured at this batch")


@command("generate", cmd_generate, "generate text on a handed-off ReKV cache (two workers)",
         ("transport", "link", "failure", "attention", "json"))
def _generate_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.costmodel import PREFILL_MODES
    from rekv_jax.generate import DTYPES
    from rekv_jax.handoff import SCHEDULES

    p.add_argument("--model", default=None,
                   help="trained-model folder (default: the shipped wt2-tiny) or hf:PATH")
    p.add_argument("--action", default="q8:r=2",
                   help="PREC:CUT (bf16|q8|q4 : c|full|recompute|r=N)")
    p.add_argument("--prompt", default=None, help="prompt text (the model's tokenizer)")
    p.add_argument("--token-ids", default=None, help="prompt ids: 1,2,3 or @FILE")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=DTYPES, default=DTYPES[0])
    p.add_argument("--prefill", choices=PREFILL_MODES, default="split",
                   help="the prefill worker runs all L layers, or only 0..c-1, streamed by "
                        "layer (split) or by token chunk (pipelined)")
    p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0],
                   help="with --prefill pipelined: chunked")
    p.add_argument("--chunks", type=int, default=None,
                   help="token chunks of the chunked schedule / pipelined prefill (default 4)")
    p.add_argument("--compare", action="store_true",
                   help="also decode on a single-process cache; report first_divergence")
    p.add_argument("--role", choices=("prefill", "decode"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--request", default=None, help=argparse.SUPPRESS)  # JSON, from generate()


@command("doctor", cmd_doctor, "self-check of this machine: kernels, exactness, speed, a handoff",
         ("attention", "json"))
def _doctor_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="also write the JSON report to this file")


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (the convention of every `rekv` error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `rekv` parser. With `only`, the other subcommands get no flags: their flag groups
    import the modules whose constants they offer, which a light command need not load."""
    flags = _flags()
    parents: dict[str, argparse.ArgumentParser] = {}

    def parent(group: str) -> argparse.ArgumentParser:
        if group not in parents:
            parents[group] = argparse.ArgumentParser(add_help=False)
            flags[group](parents[group])
        return parents[group]

    parser = OneLineParser(prog="rekv", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (handler, help, groups, own) in COMMANDS.items():
        full = only is None or name == only
        p = sub.add_parser(name, help=help, parents=[parent(g) for g in groups] if full else [])
        if full:
            own(p)
        p.set_defaults(func=handler)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(next((a for a in argv if a in COMMANDS), None)).parse_args(argv)
    if getattr(args, "attention", None):
        from rekv_jax.config import ATTENTION_ENV

        os.environ[ATTENTION_ENV] = args.attention
    try:
        args.func(args)
    except Exception as e:  # bad input (exit 2) or a failed run (exit 1): one line, no traceback
        from rekv_jax.failures import describe

        told = describe(e)
        if told is None or args.debug:
            raise
        print(f"rekv {args.command}: error: {told.line}", file=sys.stderr, flush=True)
        raise SystemExit(told.status) from None


if __name__ == "__main__":
    main()
