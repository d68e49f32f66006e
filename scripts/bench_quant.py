"""Quantize/dequantize throughput of the prefix KV beside this machine's copy bandwidth (JSON).

Shape: the model's KV of `--layers` layers at `--seq-len` tokens, `[c, B, S, K, H]` bf16 for both
K and V (Qwen2.5-7B at 8192 tokens by default: 16 MiB per layer). `*_frac_of_copy` is the share
of the copy bandwidth measured in the same run (targets: 0.5 on CPU with the XLA reference, 0.8
on a GPU with the Pallas kernels). On a GPU, `--block-elements` and `--num-warps` take comma
lists and every combination is timed, so the kernels' launch parameters can be chosen by
measurement. See `rekv_jax.study.bench.bench_quant`.
"""

from __future__ import annotations

import argparse
import itertools
import json

from pallas_kernels import quant as kernels
from rekv_jax.config import ModelConfig
from rekv_jax.study.bench import Tuning, bench_quant


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="prefix layers (default: all)")
    p.add_argument("--backend", default=None, help="xla | pallas | pallas-interpret")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--reps", type=int, default=None, help="passes per trial (1 CPU, 20 GPU)")
    p.add_argument("--block-elements", type=ints, default=[kernels.BLOCK_ELEMENTS],
                   help="Pallas elements per program, comma list (powers of two)")
    p.add_argument("--num-warps", type=ints, default=[kernels.NUM_WARPS],
                   help="Pallas warps per program, comma list")
    args = p.parse_args()
    tunings = [Tuning(b, w) for b, w in itertools.product(args.block_elements, args.num_warps)]
    print(json.dumps(bench_quant(ModelConfig.preset(args.model), args.seq_len, args.batch,
                                 args.layers, args.backend, args.trials, args.reps,
                                 tunings).to_json()))


if __name__ == "__main__":
    main()
