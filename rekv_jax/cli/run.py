"""`rekv handoff`, `rekv calibrate`, `rekv generate`: the commands that run a handoff pair or time
this machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rekv_jax.cli.flags import PAPER_LINK
from rekv_jax.cli.render import emit_json


def _handoff_experiment(args: argparse.Namespace):
    """The experiment of `rekv handoff` and a line saying which link it runs on."""
    from rekv_jax.action import parse_actions, parse_formats
    from rekv_jax.handoff.chunked import DEFAULT_CHUNKS
    from rekv_jax.model.loader import load_config
    from rekv_jax.phases import PAPER_SCHEDULES, PrefillMode, Schedule
    from rekv_jax.study.calibrate import calibrate_link_in_child
    from rekv_jax.study.experiment import DEFAULT_ACTIONS, Experiment, side_environments

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
                 else (Schedule.CHUNKED,) if args.prefill == PrefillMode.PIPELINED
                 else PAPER_SCHEDULES)
    link = args.link_gbps
    if link == PAPER_LINK and args.role is not None:
        link = None  # one side of a multi-host pair: the link is real, not emulated
    exp = Experiment(  # checks every field before any process starts
        model=args.model, seq_len=args.seq_len, batch=args.batch,
        actions=tuple(parse_actions(args.actions or DEFAULT_ACTIONS, cfg.num_layers,
                                    parse_formats(args.prefix_format) if args.prefix_format
                                    else None)),
        schedules=schedules,
        chunks=args.chunks or (DEFAULT_CHUNKS if Schedule.CHUNKED in schedules else 1),
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

    from rekv_jax.study import experiment, report
    from rekv_jax.study.records import Summary

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
    from rekv_jax.study.calibrate import calibrate_link

    c = calibrate_link(args.model, args.seq_len)
    if args.json:
        return emit_json([{"kind": "link_calibration", **dataclasses.asdict(c)}])
    print(f"{c.model}, {c.seq_len} tokens: {c.describe()}")


def cmd_generate(args: argparse.Namespace) -> None:
    from rekv_jax.handoff import generate
    from rekv_jax.handoff.chunked import DEFAULT_CHUNKS
    from rekv_jax.model.loader import tokenizer_of
    from rekv_jax.phases import PrefillMode, Schedule
    from rekv_jax.study.calibrate import calibrate_link_in_child

    if args.request:  # the prefill process started by generate.generate
        generate.job(generate.Request(**json.loads(args.request))).side(args.role,
                                                                       args.coordinator)
        return
    args.model = args.model or str(generate.SHIPPED_MODEL)
    tok = tokenizer_of(args.model)
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
    schedule = Schedule.CHUNKED if args.prefill == PrefillMode.PIPELINED else args.schedule
    req = generate.Request(
        token_ids=ids, model=args.model, action=args.action, max_new_tokens=args.max_new_tokens,
        dtype=args.dtype, prefill=args.prefill, schedule=schedule, transport=args.transport,
        chunks=args.chunks or (DEFAULT_CHUNKS if schedule == Schedule.CHUNKED else 1),
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
        return emit_json([out.to_json(args.compare)])
    print(f"\n[{out.action}, {out.prefill} prefill: ttft {out.ttft_ms:.1f} ms, tpot "
          f"{out.tpot_ms:.1f} ms, {out.tokens_per_s:.1f} tokens/s, {out.payload_bytes} B]"
          + (f" first divergence: {out.first_divergence}" if args.compare else ""),
          file=sys.stderr)
