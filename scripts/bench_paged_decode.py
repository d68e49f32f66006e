"""The paged decode step's cost on one CPU core (JSON): batching, and a step beside a suffix chunk.

On `--model` (default `tiny-7b`, synthetic BF16 weights), pinned to `--core` before JAX starts:
  * the paged step (`rekv_jax.model.paged.decode_step`) at batch 1 and `--batch` (8), width
    `--width` (512), requests at positions spread over the width's upper half (each attends
    over the same 512-position bucket); the ratio batch/1 against its target (2.5x);
  * what the step's blocks of ROW_BLOCK rows cost a request alone: the batch-1 step against the
    same program traced with one row per dot (`layers.ROW_BLOCK` set to 1 while it compiles:
    the matrix-vector dots a lone request would run, not batch-invariant);
  * the contiguous `transformer.decode_step` at batch 1 and `--batch`, all at one position, on
    a cache held as bits, and at batch 1 with one row per dot (its programs traced so and
    swapped in for each call): what the row blocks cost the single-process decode;
  * a step dispatched right after a `run_chunk` of `--chunk-tokens` over the last
    `--suffix-layers` layers (a handoff's suffix chunk on its own cache), both awaited, against
    the step alone plus the chunk alone (target: within 10% of their sum).
Each figure is the median of `--reps` timed runs after a warm-up; `load_average` is the
machine's 1-minute load when the run starts and ends (other work on a shared machine moves the
figures).

    python scripts/bench_paged_decode.py
    python scripts/bench_paged_decode.py --batch 4 --width 256 --core 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

BATCH_TARGET = 2.5  # the batch-8 step costs at most this many batch-1 steps
OVERLAP_TARGET = 1.10  # a step beside a chunk costs at most this times step + chunk


def median_ms(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time of each `run()` to completion (it returns what to wait for), after one
    warm-up each; the runs take turns in every rep, so the machine's other work weighs on all
    of them alike."""
    import jax

    for run in runs.values():
        jax.block_until_ready(run())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


class PagedSteps:
    """A pool holding `batch` requests at positions spread over the width's upper half."""

    def __init__(self, cfg, params, batch: int, width: int, page_size: int):
        import jax.numpy as jnp
        import numpy as np

        from rekv_jax.model import paged
        from rekv_jax.serving.pages import PageAllocator, PoolConfig, StepRow, step_inputs

        config = PoolConfig(batch * -(-width // page_size) + 1, page_size)
        alloc = PageAllocator(config)
        positions = np.linspace(width // 2, width - 1, batch).astype(int)
        rows = [StepRow(1, int(p), alloc.admit(width)) for p in positions]
        self.inputs = step_inputs(rows, page_size)
        self.cfg, self.weights = cfg, paged.stack_weights(cfg, params)
        self.pool = paged.new_pool(cfg, config.num_pages, page_size, jnp.bfloat16)

    def step(self):
        from rekv_jax.model import paged

        i = self.inputs
        logits, self.pool = paged.decode_step(self.cfg, self.weights, self.pool, i.tokens,
                                              i.positions, i.tables, i.width)
        return logits

    def one_row_step(self) -> Callable[[], object]:
        """The same step compiled with one row per dot (its own program, traced while
        `layers.ROW_BLOCK` is 1), warmed up."""
        import jax

        from rekv_jax.model import layers, paged

        program = jax.jit(paged._step.__wrapped__, static_argnames=("cfg", "width", "attention"),
                          donate_argnames="pool")

        def step():
            i = self.inputs
            logits, self.pool = program(self.cfg, self.weights, self.pool, i.tokens, i.positions,
                                        i.tables, width=i.width, attention="xla")
            return logits

        rows, layers.ROW_BLOCK = layers.ROW_BLOCK, 1
        try:
            jax.block_until_ready(step())
        finally:
            layers.ROW_BLOCK = rows
        return step


def contiguous_step(cfg, params, batch: int, width: int, rows: int | None = None
                    ) -> Callable[[], object]:
    """`transformer.decode_step` of `batch` rows at position width - 1 of a width cache.
    `rows`: with programs compiled for that many rows per dot (swapped in for each call)."""
    import jax
    import jax.numpy as jnp

    from rekv_jax.model import decode_step, layers, new_cache, transformer

    programs = (transformer._step_layer, transformer._step_head)
    if rows is not None:
        programs = (jax.jit(programs[0].__wrapped__, static_argnames=("cfg", "width"),
                            donate_argnames=("k", "v")),
                    jax.jit(programs[1].__wrapped__, static_argnames="cfg"))
    state = {"kv": new_cache(cfg, cfg.num_layers, batch, width, jnp.bfloat16).held_as_bits()}
    token = jnp.ones((batch,), jnp.int32)

    def step():
        default = transformer._step_layer, transformer._step_head
        transformer._step_layer, transformer._step_head = programs
        try:
            logits, state["kv"] = decode_step(cfg, params, state["kv"], token, width - 1)
        finally:
            transformer._step_layer, transformer._step_head = default
        return logits

    if rows is not None:  # compile with that many rows per dot
        layers.ROW_BLOCK, rows = rows, layers.ROW_BLOCK
        try:
            jax.block_until_ready(step())
        finally:
            layers.ROW_BLOCK = rows
    return step


def chunk_runner(cfg, params, tokens: int, layers: int) -> Callable[[], object]:
    """A fresh `run_chunk` of `tokens` residual rows over the last `layers` layers, on a cache
    of twice the chunk at offset `tokens` (a second chunk of a handoff's suffix)."""
    import jax
    import jax.numpy as jnp

    from rekv_jax.model import new_cache, run_chunk

    first = cfg.num_layers - layers
    x = jax.random.normal(jax.random.key(0), (1, tokens, cfg.hidden_size), jnp.bfloat16)

    def start():
        kv = new_cache(cfg, layers, 1, 2 * tokens, jnp.bfloat16)
        return lambda: run_chunk(cfg, params, x, kv, first, tokens)

    return start


def overlap(steps: PagedSteps, chunk: Callable, reps: int) -> dict:
    """The step alone, the chunk alone, and a step dispatched right after the chunk."""
    def together():
        out = chunk()()  # dispatched, not awaited
        return out, steps.step()

    ms = median_ms({"chunk": lambda: chunk()(), "step": steps.step, "both": together}, reps)
    alone = ms["step"] + ms["chunk"]
    return {"chunk_ms": ms["chunk"], "step_ms": ms["step"], "step_during_chunk_ms": ms["both"],
            "ratio_to_step_plus_chunk": ms["both"] / alone, "target": OVERLAP_TARGET,
            "met": ms["both"] <= OVERLAP_TARGET * alone}


def run(args: argparse.Namespace) -> dict:
    import jax

    from rekv_jax.model.layers import ROW_BLOCK
    from rekv_jax.model.loader import load_model

    load = os.getloadavg()[0]
    model = load_model(args.model)
    cfg, params = model.cfg, model.params
    sizes = (1, args.batch)
    alone = PagedSteps(cfg, params, 1, args.width, args.page_size)
    runs = {b: PagedSteps(cfg, params, b, args.width, args.page_size).step for b in sizes}
    paged_ms = median_ms({**runs, "1 row per dot": alone.one_row_step()}, args.reps)
    one_row = paged_ms.pop("1 row per dot")
    contiguous_ms = median_ms({**{b: contiguous_step(cfg, params, b, args.width) for b in sizes},
                               "1 row per dot": contiguous_step(cfg, params, 1, args.width, 1)},
                              args.reps)
    contiguous_one_row = contiguous_ms.pop("1 row per dot")
    batched = PagedSteps(cfg, params, args.batch, args.width, args.page_size)
    chunk = chunk_runner(cfg, params, args.chunk_tokens, args.suffix_layers)
    ratio = paged_ms[args.batch] / paged_ms[1]
    beside = overlap(batched, chunk, args.reps)
    return {
        "model": args.model, "weights": model.weights, "core": args.core, "load_average": load,
        "load_average_end": os.getloadavg()[0], "jax": jax.__version__,
        "device": str(jax.devices()[0]), "reps": args.reps,
        "width": args.width, "page_size": args.page_size, "batch": args.batch,
        "paged_step_ms": paged_ms, "batch_over_1": ratio, "batch_target": BATCH_TARGET,
        "batch_target_met": ratio <= BATCH_TARGET,
        "row_block": ROW_BLOCK, "batch_1_one_row_per_dot_ms": one_row,
        "batch_1_cost_of_row_blocks": paged_ms[1] / one_row,
        "contiguous_step_ms": contiguous_ms,
        "contiguous_batch_1_one_row_per_dot_ms": contiguous_one_row,
        "contiguous_batch_1_cost_of_row_blocks": contiguous_ms[1] / contiguous_one_row,
        "contiguous_batch_over_1": contiguous_ms[args.batch] / contiguous_ms[1],
        "chunk": {"tokens": args.chunk_tokens, "layers": args.suffix_layers, **beside},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-7b")
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)),
                   help="the one CPU core to run on (default: the last this process may use)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=512, help="the step's attention width")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--suffix-layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    os.sched_setaffinity(0, {args.core})  # before JAX starts its threads
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
