"""The flag groups several `rekv` subcommands share, each defined once (a group imports the module
whose choices it offers only when a subcommand uses it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

PAPER_LINK = "paper"  # --link-gbps: pace to the paper's link/suffix ratio, calibrated here
UNPACED = "unpaced"  # --link-gbps: no pacing (loopback runs as fast as it can)


def _schedules(text: str) -> str:
    """`--schedule` value: `both` or a comma list of handoff.SCHEDULES."""
    from rekv_jax.mode import SCHEDULES

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



def _json_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="one JSON object per record (default: readable tables)")

def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="preset name, hf:PATH, or a trained-model folder (holding orbax/)")

def _seq_len_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=8192, help="prompt length S")

def _batch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=1, help="prompts per handoff B")

def _actions_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.action import PREFIX_FORMATS

    p.add_argument("--actions", default=None,
                   help="comma list of PREC:CUT[/FORMAT] (bf16|q8|q4 : c|full|recompute|r=N "
                        f"/ {'|'.join(PREFIX_FORMATS)}), or all")
    p.add_argument("--prefix-format", default=None, metavar="FORMATS",
                   help="run each Q8/Q4 action in each of these prefix formats: a comma list "
                        f"of {', '.join(PREFIX_FORMATS)}, or all (default: the action's own; "
                        "paper, the paper's groups of 64 along head_dim, unless written)")

def _link_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-gbps", type=_link, default=None, metavar="GBPS|paper|unpaced",
                   help="link bandwidth in GB/s; `paper`: the paper's link/suffix ratio, "
                        "calibrated on this machine; `unpaced`: no pacing")

def _transport_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.transport import TRANSPORTS

    p.add_argument("--transport", choices=TRANSPORTS, default=TRANSPORTS[0])

def _reps_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, default=3, help="untimed handoffs per action")
    p.add_argument("--reps", type=int, default=30, help="timed handoffs per action")

def _schedule_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.mode import SCHEDULES

    p.add_argument("--schedule", type=_schedules, default="both",
                   help=f"comma list of {', '.join(SCHEDULES)}; both: overlapped,sequential "
                        "(with --prefill pipelined: chunked)")
    p.add_argument("--chunks", type=int, default=None,
                   help="token chunks N of the chunked schedule and the pipelined prefill "
                        "(default 4)")

def _failure_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.mode import FALLBACKS

    p.add_argument("--fallback", choices=FALLBACKS, default=FALLBACKS[0],
                   help="a failed prefix transfer: fail, or rebuild the cache from tokens")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")

def _handoff_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.quantize import BACKENDS

    p.add_argument("--quant-backend", choices=BACKENDS, default=None,
                   help="default: Pallas on GPU, XLA elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--role", choices=("prefill", "decode"), default=None,
                   help="run one side only (multi-host); default: start both here")
    p.add_argument("--coordinator", default=None,
                   help="host:port of the decode process (default: detected, e.g. SLURM)")
    p.add_argument("--insecure", action="store_true",
                   help="with --role and no key: run without one (anyone may join)")
    p.add_argument("--prefill-devices", type=int, default=1,
                   help="tensor-parallel devices of the prefill side (CPU: host devices)")
    p.add_argument("--decode-devices", type=int, default=1,
                   help="tensor-parallel devices of the decode side")

def _secret_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="with --role: the job's key, one file every node reads, readable by "
                        "its owner only (default: $REKV_SECRET_FILE)")

def _attention_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.config import ATTENTION_BACKENDS

    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default=None,
                   help="attention backend, the same as $REKV_ATTENTION, which a child "
                        "process inherits (default: auto: cuDNN flash attention on a GPU "
                        "for bf16, XLA otherwise)")

def _modes_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.mode import INTERVALS, PREFILL_MODES

    p.add_argument("--interval", choices=INTERVALS, default=INTERVALS[0],
                   help="time from the prefill state being ready (paper Table 1) or from the "
                        "prompt's arrival at the prefill worker")
    p.add_argument("--prefill", choices=PREFILL_MODES, default=PREFILL_MODES[0],
                   help="the prefill worker runs all L layers, or only 0..c-1 streaming each "
                        "layer (split) or token chunk (pipelined) as computed (both need "
                        "--interval prompt)")

def _pin_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-pin", action="store_true",
                   help="CPU sides on one machine share its cores (default: each side "
                        "runs on its own half of them, as two GPUs compute at once)")

def _bits_flags(p: argparse.ArgumentParser) -> None:
    from rekv_jax.action import BITS

    p.add_argument("--bits", type=int, choices=BITS, default=16, help="prefix precision")


# Flag groups shared across subcommands; `choices` come from the modules' own constants (each
# group imports its module only when a subcommand uses the group)
FLAG_GROUPS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "json": _json_flags,
    "model": _model_flags,
    "seq_len": _seq_len_flags,
    "batch": _batch_flags,
    "actions": _actions_flags,
    "link": _link_flags,
    "transport": _transport_flags,
    "reps": _reps_flags,
    "schedule": _schedule_flags,
    "failure": _failure_flags,
    "handoff": _handoff_flags,
    "secret": _secret_flags,
    "attention": _attention_flags,
    "modes": _modes_flags,
    "bits": _bits_flags,
    "pin": _pin_flags,
}
