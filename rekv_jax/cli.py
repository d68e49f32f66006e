"""`rekv` command line: one subcommand per stage of the pipeline, JSON on stdout."""

from __future__ import annotations

import argparse
import json
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
