"""How far a token-chunked prefill lies from the unchunked one: max |Δ| of KV and logits, and
first-token agreement, for the chunked schedule's suffix (`run_suffix(chunks=N)` from the exact
`h_c`) and the pipelined prefill (`prefill(chunks=N)`). Prints one JSON line per chunk count.

    PYTHONPATH=. python scripts/chunked_error.py --model tiny --seq-len 256 --chunks 2,4,8
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.model.loader import load_model
from rekv_jax.model.transformer import prefill, run_prefix, run_suffix


def max_delta(a: jax.Array, b: jax.Array) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a loader spec (preset, hf:PATH, folder)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="random prompts")
    p.add_argument("--chunks", default="2,4,8")
    p.add_argument("--cut", type=int, default=None, help="the chunked schedule's c (default L/2)")
    args = p.parse_args()
    model = load_model(args.model, 0)
    cfg, params = model.cfg, model.params
    cut = cfg.num_layers // 2 if args.cut is None else args.cut
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq_len), 0,
                                cfg.vocab_size, jnp.int32)
    kv, logits = prefill(cfg, params, tokens)
    h_c, _ = run_prefix(cfg, params, tokens, cut)
    first = np.asarray(jnp.argmax(logits, -1))
    for n in (int(c) for c in args.chunks.split(",")):
        suffix, s_logits = run_suffix(cfg, params, h_c, cut, chunks=n)
        full, f_logits = prefill(cfg, params, tokens, chunks=n)
        print(json.dumps({
            "model": cfg.name, "dtype": str(params["embed"].dtype), "seq_len": args.seq_len,
            "batch": args.batch, "chunks": n, "cut": cut,
            "kv_abs_max": max(float(jnp.abs(kv.k).max()), float(jnp.abs(kv.v).max())),
            "chunked_suffix": {
                "kv_max_abs_delta": max(max_delta(suffix.k, kv.k[cut:]),
                                        max_delta(suffix.v, kv.v[cut:])),
                "logits_max_abs_delta": max_delta(s_logits, logits),
                "first_token_agree": float(np.mean(np.asarray(jnp.argmax(s_logits, -1))
                                                   == first))},
            "pipelined_prefill": {
                "kv_max_abs_delta": max(max_delta(full.k, kv.k), max_delta(full.v, kv.v)),
                "logits_max_abs_delta": max_delta(f_logits, logits),
                "first_token_agree": float(np.mean(np.asarray(jnp.argmax(f_logits, -1))
                                                   == first))}}), flush=True)


if __name__ == "__main__":
    main()
