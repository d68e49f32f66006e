"""`rekv handoff`, `rekv calibrate`, `rekv generate`: the commands that run a handoff pair or time
this machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rekv_jax.cli.flags import PAPER_LINK
from rekv_jax.cli.render import emit_json


def _handoff_experiment(args: argparse.Namespace):
    """The experiment of `rekv handoff` and a line saying which link it runs on."""
    from rekv_jax.action import parse_actions, parse_formats
    from rekv_jax.mode import run_chunks, run_schedules
    from rekv_jax.model.loader import load_config
    from rekv_jax.study.calibrate import calibrate_link_in_child
    from rekv_jax.study.experiment import DEFAULT_ACTIONS, Experiment, side_environments

    cfg = load_config(args.model)
    cfg.check_seq_len(args.seq_len)
    schedules = run_schedules(None if args.schedule == "both" else args.schedule.split(","),
                              args.prefill)
    link = args.link_gbps
    if link == PAPER_LINK and args.role is not None:
        link = None  # one side of a multi-host pair: the link is real, not emulated
    exp = Experiment(  # checks every field before any process starts
        model=args.model, seq_len=args.seq_len, batch=args.batch,
        actions=tuple(parse_actions(args.actions or DEFAULT_ACTIONS, cfg.num_layers,
                                    parse_formats(args.prefix_format) if args.prefix_format
                                    else None)),
        schedules=schedules,
        chunks=run_chunks(schedules, args.prefill, args.chunks),
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
    from rekv_jax.transport.cores import PINNING_ENV
    from rekv_jax.transport.secret import key_of

    exp, note = _handoff_experiment(args)
    summaries: list[Summary] = []
    key = args.role and key_of(args.secret_file, args.insecure, "a multi-host run (--role)")
    # a refused set-up (collective on one GPU) fails here, before any output
    envs = None if args.role else experiment.side_environments(exp, not args.no_pin)
    bar = tqdm(total=experiment.total_handoffs(exp), desc="handoffs", unit="", file=sys.stderr,
               disable=args.json or args.role == "prefill")

    def take(item: object) -> None:  # what the decode side sends, as it comes
        if isinstance(item, experiment.Progress):
            return bar.update(item.handoffs)
        if args.json:
            print(json.dumps(item.to_json()), flush=True)
        if isinstance(item, Summary):
            if not args.json:  # each row as it completes: a later failure loses none
                print(report.handoff_table([item], header=not summaries), flush=True)
            summaries.append(item)

    if envs is None:  # one process of a pair started by a scheduler (multi-host)
        return experiment.run_process(args.role, exp, args.coordinator, key or None, take)
    pinning = "one process" if exp.transport == "local" else envs["decode"].get(PINNING_ENV)
    if not args.json:
        print(f"{exp.model}, {exp.seq_len} tokens, batch {exp.batch}, {exp.transport}"
              + f"; {pinning}" * bool(pinning) + f"; link: {note}", flush=True)
    experiment.launch_pair(exp, take, not args.no_pin)
    bar.close()
    for warning in filter(None, (s.fidelity_warning() for s in summaries)):
        print(warning, file=sys.stderr, flush=True)
    if not args.json:
        print("\n".join(report.conclusion(summaries)), flush=True)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from rekv_jax.study.calibrate import calibrate_link

    c = calibrate_link(args.model, args.seq_len)
    if args.json:
        return emit_json([{"kind": "link_calibration", **dataclasses.asdict(c)}])
    print(f"{c.model}, {c.seq_len} tokens: {c.describe()}")


def cmd_generate(args: argparse.Namespace) -> None:
    from rekv_jax.mode import run_chunks, run_schedules
    from rekv_jax.model.loader import tokenizer_of
    from rekv_jax.serving import generate
    from rekv_jax.study.calibrate import calibrate_link_in_child

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
    schedule, = run_schedules([args.schedule], args.prefill)
    req = generate.Request(
        token_ids=ids, model=args.model, action=args.action, max_new_tokens=args.max_new_tokens,
        dtype=args.dtype, prefill=args.prefill, schedule=schedule, transport=args.transport,
        chunks=run_chunks([schedule], args.prefill, args.chunks),
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
