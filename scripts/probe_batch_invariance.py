"""Which of a decode step's operations give a row the same bits whatever shares its batch, on
this JAX backend (JSON, one line per probe).

  * `dot`: each weight shape of `--model` ([D, N*H], [D, K*H], [N*H, D], [D, F], [F, D], the
    head [D, V]) times `x [M, D]` in float32 (what XLA computes a BF16 dot in): the row counts
    M at which row 0 differs from M = 1, whether a row moved to another slot of 8 or 16 rows
    keeps its bits, and at M = ROW_BLOCK (the decode step's rows per dot) whether a row keeps
    its bits in every slot beside `--trials` draws of other rows;
  * `attention`: `xla_attention` of one token at position p over its power-of-two bucket and
    over twice it (the extra positions masked): how many of `--trials` outputs differ;
  * `decode`: whole decode steps of 8 requests against the same requests alone, for the
    contiguous `transformer.decode_step` (rows batched, all at one position) and the paged
    `paged.decode_step`: how many rows' logits differ.

    python scripts/probe_batch_invariance.py
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax import KVCache, ModelConfig
from rekv_jax.model import decode_step, init_params, paged
from rekv_jax.model.layers import ROW_BLOCK, causal_mask, xla_attention
from rekv_jax.serving.pages import PageAllocator, PoolConfig, StepRow, step_inputs

ROWS = (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 32, 64)


def block_invariant(matmul, w: jax.Array, x0: jax.Array, rng: np.random.Generator,
                    trials: int) -> bool:
    """Whether row x0 [D] gets the same bits in every slot of ROW_BLOCK rows, the other rows
    drawn afresh each time."""
    want = None
    for t in range(trials):
        x = rng.standard_normal((ROW_BLOCK, x0.shape[0])) * rng.choice([1e-3, 1, 1e3])
        slot = t % ROW_BLOCK
        got = np.asarray(matmul(jnp.asarray(x, jnp.float32).at[slot].set(x0), w))[slot]
        want = got if want is None else want
        if not np.array_equal(got, want):
            return False
    return True


def probe_dots(cfg: ModelConfig, rng: np.random.Generator, trials: int) -> list[dict]:
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    matmul = jax.jit(lambda x, w: x @ w)
    out = []
    for name, shape in (("q", (D, N * H)), ("k/v", (D, K * H)), ("o", (N * H, D)),
                        ("gate/up", (D, F)), ("down", (F, D)), ("head", (D, cfg.vocab_size))):
        w = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)
        x = jnp.asarray(rng.standard_normal((max(ROWS), shape[0])), jnp.float32)
        alone = np.asarray(matmul(x[:1], w))[0]
        differ = [m for m in ROWS if not np.array_equal(np.asarray(matmul(x[:m], w))[0], alone)]
        slots = {}
        for m in (8, 16):  # row 0 moved to slot m - 3 of m rows
            moved = np.asarray(matmul(x[:m].at[m - 3].set(x[0]), w))
            slots[m] = bool(np.array_equal(moved[m - 3], moved[0]))
        out.append({"probe": "dot", "weight": name, "shape": shape, "rows_that_differ": differ,
                    "slot_invariant_at_rows": slots, "row_block": ROW_BLOCK,
                    "invariant_at_row_block": block_invariant(matmul, w, x[0], rng, trials),
                    "trials": trials})
    return out


def probe_attention(cfg: ModelConfig, rng: np.random.Generator, trials: int) -> dict:
    attend = jax.jit(xla_attention)
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    differ = 0
    for _ in range(trials):
        p = int(rng.integers(256, 512))
        q = jnp.asarray(rng.standard_normal((1, 1, N, H)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((1, 1024, K, H)), jnp.bfloat16) for _ in "kv")
        a, b = (np.asarray(attend(q, k[:, :w], v[:, :w], causal_mask(p, 1, w))).view(np.uint16)
                for w in (512, 1024))
        differ += not np.array_equal(a, b)
    return {"probe": "attention", "widths": [512, 1024], "trials": trials, "differ": differ}


def probe_decode(cfg: ModelConfig, rng: np.random.Generator, batch: int = 8) -> dict:
    params = init_params(cfg, jax.random.key(0))
    prompt, width = 200, 256  # every request at position 200 of a 256-position cache
    values = rng.standard_normal((batch, width, cfg.num_kv_heads, cfg.head_dim))
    values[:, prompt:] = 0
    layers = [jnp.asarray(values, jnp.bfloat16)] * cfg.num_layers  # one cache for every layer
    tokens = rng.integers(cfg.vocab_size, size=batch).astype(np.int32)

    def cache(rows: list[int], stop: int) -> KVCache:
        return KVCache(*(tuple(c[np.array(rows), :stop] for c in layers) for _ in "kv"))

    def contiguous(rows: list[int]) -> np.ndarray:
        return np.asarray(decode_step(cfg, params, cache(rows, width), tokens[rows], prompt)[0])

    weights, config = paged.stack_weights(cfg, params), PoolConfig(batch * 16 + 1, 16)
    alloc = PageAllocator(config)
    tables = [alloc.admit(width) for _ in range(batch)]

    def paged_step(rows: list[int]) -> np.ndarray:
        pool = paged.new_pool(cfg, config.num_pages, 16, jnp.bfloat16)
        for i in rows:
            pool = paged.write_cache(pool, cache([i], prompt), 0, tables[i].rows(0, prompt))
        got = step_inputs([StepRow(int(tokens[i]), prompt, tables[i]) for i in rows], 16)
        return np.asarray(paged.decode_step(cfg, weights, pool, got.tokens, got.positions,
                                            got.tables, got.width)[0])

    everyone = list(range(batch))
    alone = {name: [run([i])[0] for i in everyone] for name, run in
             (("contiguous", contiguous), ("paged", paged_step))}
    together = {"contiguous": contiguous(everyone), "paged": paged_step(everyone)}
    return {"probe": "decode", "batch": batch, "position": prompt, **{
        f"{name}_rows_that_differ": sum(not np.array_equal(together[name][i], alone[name][i])
                                        for i in everyone) for name in together},
        "paged_alone_equals_contiguous_alone": all(
            np.array_equal(a, b) for a, b in zip(alone["paged"], alone["contiguous"],
                                                  strict=True))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-7b")
    p.add_argument("--trials", type=int, default=200)
    args = p.parse_args()
    cfg = ModelConfig.preset(args.model)
    rng = np.random.default_rng(0)
    for record in [*probe_dots(cfg, rng, args.trials // 4), probe_attention(cfg, rng, args.trials),
                   probe_decode(cfg, rng)]:
        print(json.dumps({"backend": jax.default_backend(), "jax": jax.__version__,
                          "model": args.model, **record}), flush=True)


if __name__ == "__main__":
    main()
