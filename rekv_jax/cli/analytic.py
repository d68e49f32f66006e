"""`rekv info`, `rekv bytes`, `rekv plan`: the commands that only compute (no model runs)."""

from __future__ import annotations

import argparse

from rekv_jax.action import PAPER
from rekv_jax.cli.flags import PAPER_LINK
from rekv_jax.cli.render import emit_json, mib


def cmd_info(args: argparse.Namespace) -> None:
    from rekv_jax import sizes
    from rekv_jax.model.loader import load_config

    cfg = load_config(args.model)
    s = sizes.model_sizes(cfg, args.seq_len, args.batch)
    if args.json:
        return emit_json([{"config": cfg.to_dict(), "sizes": s.to_json()}])
    print(f"{cfg.name}: {cfg.model_type}, L {cfg.num_layers}, D {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, "
          f"F {cfg.intermediate_size}, V {cfg.vocab_size}")
    print(f"at S {args.seq_len}, B {args.batch}: boundary h_c {mib(s.boundary_bytes)}, one KV "
          f"layer {mib(s.kv_layer_bytes_bf16)} BF16 / {mib(s.kv_layer_bytes_q8)} Q8 / "
          f"{mib(s.kv_layer_bytes_q4)} Q4, full BF16 KV {mib(s.full_kv_bytes_bf16)}")
    print(f"B_H / B_KV = {s.boundary_to_kv_layer:.2f}: a BF16 split saves bytes from a suffix "
          f"of {s.min_saving_suffix_bf16} layers (Eq. 6)")


def cmd_bytes(args: argparse.Namespace) -> None:
    from rekv_jax import sizes
    from rekv_jax.model.loader import load_config

    cfg = load_config(args.model)
    cut = cfg.num_layers if args.cut is None else args.cut
    fmt = args.prefix_format
    b = sizes.handoff_bytes(cfg, args.seq_len, args.bits, cut, args.batch, fmt)
    if args.json:
        return emit_json([b.to_json()])
    named = f" {fmt}" if fmt != PAPER else ""
    print(f"{cfg.name}, S {args.seq_len}, B {args.batch}, {args.bits}-bit{named} prefix, cut {cut} "
          f"({b.kind}, suffix of {b.suffix_len} layers):")
    print(f"  boundary h_c {mib(b.boundary_bytes)} + prefix {mib(b.prefix_payload_bytes)}"
          f" + token ids {mib(b.token_bytes)} = {mib(b.total_bytes)}"
          f" (one BF16 KV layer: {mib(b.kv_layer_bytes_bf16)})")
    tokens = sizes.key_tokens(args.seq_len, fmt)
    if tokens != args.seq_len:
        print(f"  keys grouped per channel along tokens: {args.seq_len} tokens padded to "
              f"{tokens} (whole groups of {sizes.GROUP_SIZE})")


def cmd_plan(args: argparse.Namespace) -> None:
    from rekv_jax.cli import plan as plan_cli
    from rekv_jax.planning.planner import PAPER_LINK_GBPS

    if args.link_gbps == PAPER_LINK:
        args.link_gbps = PAPER_LINK_GBPS  # the paper's H100 path
    plan_cli.cmd_plan(args)
