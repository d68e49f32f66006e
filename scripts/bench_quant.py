"""Quantize/dequantize throughput of the prefix KV beside this machine's copy bandwidth (JSON).

Shape: the model's KV of `--layers` layers at `--seq-len` tokens, `[c, B, S, K, H]` bf16 for both
K and V (Qwen2.5-7B at 8192 tokens by default: 16 MiB per layer). Bandwidth counts bytes read plus
bytes written; the copy is a jitted `jnp.copy` of the same tensors, timed the same way, so
`*_frac_of_copy` is the share of the machine's copy bandwidth each kernel reaches. Targets: 0.5
on CPU (XLA reference), 0.8 on a GPU (Pallas kernels). The backend follows
`rekv_jax.quantize.resolve_backend` (Pallas on GPU, XLA on CPU; `--backend` overrides).

On CPU each call handles one layer and is waited for, so the allocator reuses its buffers (fresh
multi-MiB buffers cost page faults that would dominate both sides); on a GPU a call handles all
layers and a trial waits once, so launch overhead does not dominate. Best of `--trials`.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax import quantize as Q
from rekv_jax.config import ModelConfig


def best_seconds(ops: dict, trials: int, reps: int, wait_each: bool) -> dict[str, float]:
    """Best over `trials` of the mean time of one pass of each `fn` over its inputs; the ops take
    turns within a trial, so load from other processes hits them alike."""
    for fn, inputs in ops.values():
        jax.block_until_ready([fn(x) for x in inputs])  # compile and warm up
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(trials):
        for name, (fn, inputs) in ops.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                for x in inputs:
                    out = fn(x)
                    if wait_each:
                        jax.block_until_ready(out)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    return best


def rms_rel_err(xs: list, qs: list) -> float:
    """sqrt(sum (x - deq)^2 / sum x^2) over all tensors, in float64."""
    num = den = 0.0
    for x, q in zip(xs, qs, strict=True):
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        d64 = np.asarray(Q.dequantize(q, jnp.float32), np.float64)
        num += float(np.sum((x64 - d64) ** 2))
        den += float(np.sum(x64**2))
    return (num / den) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="prefix layers (default: all)")
    p.add_argument("--backend", default=None, help="xla | pallas | pallas-interpret")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--reps", type=int, default=None, help="passes per trial (1 CPU, 20 GPU)")
    args = p.parse_args()

    cfg = ModelConfig.preset(args.model)
    layers = args.layers or cfg.num_layers
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    reps = args.reps or (1 if on_cpu else 20)
    per_call = 1 if on_cpu else layers
    shape = (per_call, args.batch, args.seq_len, cfg.num_kv_heads, cfg.head_dim)
    keys = jax.random.split(jax.random.key(0), 2 * layers // per_call)
    xs = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]  # K and V chunks
    in_bytes = sum(x.nbytes for x in xs)

    qs = {b: [Q.quantize(x, b, backend=args.backend) for x in xs] for b in (8, 4)}
    ops = {"copy": (jax.jit(jnp.copy), xs)}  # an XLA copy of the same bytes
    for b in (8, 4):
        ops[f"q{b}/quantize"] = (functools.partial(Q.quantize_unchecked, bits=b,
                                                   backend=args.backend), xs)
        ops[f"q{b}/dequantize"] = (functools.partial(Q.dequantize, backend=args.backend), qs[b])
    seconds = best_seconds(ops, args.trials, reps, on_cpu)

    copy_gbps = 2 * in_bytes / seconds["copy"] / 1e9
    target = 0.5 if on_cpu else 0.8
    result = {
        "bench": "quant", "platform": platform, "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__, "backend": Q.resolve_backend(args.backend), "model": cfg.name,
        "kv_shape": [layers, *shape[1:]], "dtype": "bfloat16", "layers_per_call": per_call,
        "input_mib": in_bytes / 2**20, "copy_gbps": copy_gbps, "target_frac_of_copy": target,
    }
    for b in (8, 4):
        moved = in_bytes + sum(q.nbytes for q in qs[b])  # bf16 in, codes + scales out (or back)
        r = result[f"q{b}"] = {}
        for op in ("quantize", "dequantize"):
            gbps = moved / seconds[f"q{b}/{op}"] / 1e9
            r[f"{op}_gbps"] = gbps
            r[f"{op}_frac_of_copy"] = gbps / copy_gbps
            r[f"{op}_ms_per_layer"] = seconds[f"q{b}/{op}"] * 1e3 / layers  # K and V of a layer
        r["rms_rel_err_gaussian"] = rms_rel_err(xs, qs[b])
    result["meets_target"] = all(result[f"q{b}"][f"{op}_frac_of_copy"] >= target
                                 for b in (8, 4) for op in ("quantize", "dequantize"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
