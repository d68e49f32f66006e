"""Model speed against this device's own peaks (JSON, one line per model and length).

Per preset and length: `prefill`, `run_prefix(L - r)`, `run_suffix(r)` (ms, ms per layer,
TFLOP/s and its fraction of a BF16 matmul timed in the same run) and one `decode_step` at a cache
of `--capacity` positions against (weight + KV bytes) / copy bandwidth measured in the same run.
FLOPs and bytes come from `rekv_jax.sizes`; synthetic BF16 weights, one layer shared by all
layers when the full stack would exceed 2 GiB. See `rekv_jax.study.bench.bench_model`.

    python scripts/bench_model.py --model tiny --seq-len 256
    python scripts/bench_model.py --model qwen2.5-7b,qwen3-8b --seq-len 2048,8192 --suffix 13
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from rekv_jax.config import ATTENTION_BACKENDS, ModelConfig
from rekv_jax.study.bench import bench_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset name(s), comma list")
    p.add_argument("--seq-len", default="256", help="prompt length(s), comma list")
    p.add_argument("--suffix", type=int, default=None,
                   help="recomputed layers r (run_prefix runs the other L - r; default L // 2)")
    p.add_argument("--capacity", type=int, default=None,
                   help="decode-step cache capacity (default seq-len + 1)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto")
    args = p.parse_args()
    for name in args.model.split(","):
        cfg = dataclasses.replace(ModelConfig.preset(name), attention=args.attention)
        for seq_len in args.seq_len.split(","):
            print(json.dumps(bench_model(cfg, int(seq_len), args.suffix, args.capacity,
                                         args.batch, args.reps).to_json()), flush=True)


if __name__ == "__main__":
    main()
