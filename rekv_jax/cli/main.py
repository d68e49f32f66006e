"""`rekv` command line: one subcommand per stage of the pipeline.

Every subcommand prints a table or a few lines for a person; with `--json` it prints one JSON
object per record, one per line, and nothing else on stdout. Flags shared by several subcommands
are defined once, in `FLAGS`; each subcommand lists the flag groups it takes in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from rekv_jax.cli.analytic import cmd_bytes, cmd_info, cmd_plan
from rekv_jax.cli.flags import FLAG_GROUPS, PAPER_LINK
from rekv_jax.cli.quality import cmd_quality, cmd_select
from rekv_jax.cli.run import cmd_calibrate, cmd_generate, cmd_handoff
from rekv_jax.cli.serve import cmd_serve
from rekv_jax.cli.study import cmd_doctor, cmd_profile, cmd_sweep

# absl/glog lines of the XLA runtime and of jax.distributed's coordination service are for
# debugging, not for a person's terminal: keep only errors unless the caller asked otherwise.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GLOG_minloglevel", "2")


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
    from rekv_jax.action import PAPER, PREFIX_FORMATS

    p.add_argument("--cut", type=int, default=None,
                   help="first recomputed layer c: L = transfer-only (default), 0 = recompute")
    p.add_argument("--prefix-format", choices=PREFIX_FORMATS, default=PAPER,
                   help="format of a Q8/Q4 prefix: paper (Eq. 7: one FP16 scale per 64 "
                        "elements along head_dim); debias, hadamard and debias+hadamard send "
                        "the same bytes (the keys transformed); per-channel and "
                        "debias+per-channel group keys as 64 tokens of one channel per FP16 "
                        "scale, the same scales per element, with the keys' tokens padded to a "
                        "multiple of 64")


@command("plan", cmd_plan, "predicted latency of every action and schedule, and the best",
         ("model", "seq_len", "batch", "actions", "link", "json"))
def _plan_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.cli.plan import add_flags

    add_flags(p)


@command("handoff", cmd_handoff, "timed handoffs between a prefill and a decode process",
         ("model", "seq_len", "batch", "actions", "link", "transport", "reps", "schedule",
          "failure", "handoff", "secret", "modes", "attention", "pin", "json"))
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
    from rekv_jax.study.sweep_plan import SWEEP_PRESETS

    p.set_defaults(link_gbps=PAPER_LINK)  # the preset's: 2.32 GB/s (gpu), calibrated (cpu)
    p.set_defaults(reps=None)  # the preset's (`SweepPreset.reps`)
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
    from rekv_jax.mode import PREFILL_MODES, SCHEDULES, PrefillMode
    from rekv_jax.serving.generate import DTYPES

    p.add_argument("--model", default=None,
                   help="trained-model folder (default: the shipped wt2-tiny) or hf:PATH")
    p.add_argument("--action", default="q8:r=2",
                   help="PREC:CUT (bf16|q8|q4 : c|full|recompute|r=N)")
    p.add_argument("--prompt", default=None, help="prompt text (the model's tokenizer)")
    p.add_argument("--token-ids", default=None, help="prompt ids: 1,2,3 or @FILE")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=DTYPES, default=DTYPES[0])
    p.add_argument("--prefill", choices=PREFILL_MODES, default=PrefillMode.SPLIT,
                   help="the prefill worker runs all L layers, or only 0..c-1, streamed by "
                        "layer (split) or by token chunk (pipelined)")
    p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0],
                   help="with --prefill pipelined: chunked")
    p.add_argument("--chunks", type=int, default=None,
                   help="token chunks of the chunked schedule / pipelined prefill (default 4)")
    p.add_argument("--compare", action="store_true",
                   help="also decode on a single-process cache; report first_divergence")


@command("serve", cmd_serve, "serve a request stream (or OpenAI API clients) under policies",
         ("model", "link", "transport", "failure", "secret", "attention", "pin", "json"))
def _serve_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.cli.serve import add_flags

    p.set_defaults(link_gbps=PAPER_LINK, model=None)  # None: the shipped wt2-tiny
    add_flags(p)


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
    flags = FLAG_GROUPS
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
        from rekv_jax.errors import describe

        told = describe(e)
        if told is None or args.debug:
            raise
        print(f"rekv {args.command}: error: {told.line}", file=sys.stderr, flush=True)
        raise SystemExit(told.status) from None
    except KeyboardInterrupt:  # Ctrl-C: whatever the command started has been ended on the way
        if args.debug:
            raise
        print(f"rekv {args.command}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
