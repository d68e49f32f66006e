"""The paged cache: pages hold a contiguous cache bitwise and are written in place; the batched
paged decode step is the contiguous decode bitwise, whatever shares its batch and in whichever
slot; the allocator admits, waits and retires; the Pallas kernel's path lowers for CUDA."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_model import FAMILIES, random_params, small_config, tokens_for

from pallas_kernels import paged as pallas_paged
from rekv_jax import KVCache, ModelConfig
from rekv_jax.model import decode_step, paged, prefill, run_prefix, run_suffix
from rekv_jax.model.layers import ROW_BLOCK, row_blocks
from rekv_jax.model.transformer import init_params
from rekv_jax.serving.pages import (
    NULL_PAGE,
    BlockTable,
    PageAllocator,
    PoolConfig,
    StepRow,
    batch_bucket,
    step_inputs,
    width_bucket,
)

STEPS = 3  # decode steps per request
CAPACITY = 64  # the contiguous caches': a power of two, so it caps no attention bucket


def assert_bitwise(a: jax.Array, b: jax.Array) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


@dataclasses.dataclass
class Request:
    """A prompt cache of random values (any cache is a state decoding must carry on from) and
    its contiguous decode alone: the logits of each step and the tokens fed."""

    prompt: int
    k: list  # L x [1, S, K, H]
    v: list
    first: int  # the first token
    logits: list = dataclasses.field(default_factory=list)  # STEPS x [V] f32
    tokens: list = dataclasses.field(default_factory=list)  # STEPS x int


def random_request(cfg: ModelConfig, dtype, prompt: int, rng: np.random.Generator) -> Request:
    shape = (1, prompt, cfg.num_kv_heads, cfg.head_dim)
    kv = [[jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(cfg.num_layers)]
          for _ in "kv"]
    return Request(prompt, *kv, int(rng.integers(cfg.vocab_size)))


def decode_alone(cfg: ModelConfig, params: dict, r: Request) -> None:
    """The contiguous decode of r alone, on a cache whose capacity cuts no attention bucket."""
    assert r.prompt + STEPS <= CAPACITY
    kv = KVCache(tuple(r.k), tuple(r.v)).pad(CAPACITY)
    token = r.first
    for i in range(STEPS):
        r.tokens.append(token)
        logits, kv = decode_step(cfg, params, kv, jnp.array([token], jnp.int32), r.prompt + i)
        r.logits.append(np.asarray(logits[0]))
        token = int(np.argmax(r.logits[-1]))


def write_prompt(pool: paged.PagePool, r: Request, table: BlockTable) -> paged.PagePool:
    return paged.write_cache(pool, KVCache(tuple(r.k), tuple(r.v)), 0, table.rows(0, r.prompt))


def random_table(rng: np.random.Generator, pool: PoolConfig, tokens: int) -> BlockTable:
    pages = rng.choice(np.arange(1, pool.num_pages), pool.pages_for(tokens), replace=False)
    return BlockTable(tuple(int(p) for p in pages), pool.page_size)


# ---------------------------------------------------------------------------- the pages


def test_pages_hold_a_split_handoffs_cache_bitwise_written_in_place():
    """A BF16 handoff's restored prefix layers (whole) and recomputed suffix layers (in token
    chunks at their offsets) written into a request's scattered pages read back as the
    single-process prefill's cache, bit for bit; the pool is updated in place and another
    request's pages are untouched."""
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = tokens_for(cfg, 1, 45)
    kv, _ = prefill(cfg, params, tokens)
    cut = 4
    h_c, prefix = run_prefix(cfg, params, tokens, cut)
    suffix, _ = run_suffix(cfg, params, h_c, cut)
    config = PoolConfig(num_pages=12, page_size=16)
    mine, other = BlockTable((9, 4, 7), 16), BlockTable((2,), 16)
    rng = np.random.default_rng(0)
    pool = paged.new_pool(cfg, config.num_pages, config.page_size, jnp.bfloat16)
    noise = jnp.asarray(rng.standard_normal((1, 16, cfg.num_kv_heads, cfg.head_dim)), jnp.bfloat16)
    for layer in range(cfg.num_layers):
        pool = paged.write_layer(pool, layer, other.rows(0, 16), noise, -noise)
    pointers = (pool.k.unsafe_buffer_pointer(), pool.v.unsafe_buffer_pointer())
    before = pool
    pool = paged.write_cache(pool, prefix, 0, mine.rows(0, 45))
    assert before.k.is_deleted() and before.v.is_deleted()  # donated
    for start, stop in ((0, 13), (13, 40), (40, 45)):  # the suffix in token chunks
        pool = paged.write_cache(pool, suffix.span(start, stop), cut, mine.rows(start, stop))
    assert (pool.k.unsafe_buffer_pointer(), pool.v.unsafe_buffer_pointer()) == pointers
    for layer in range(cfg.num_layers):
        k, v = paged.read_layer(pool, layer, mine.rows(0, 45))
        assert_bitwise(k, kv.keys[layer])
        assert_bitwise(v, kv.values[layer])
        k, v = paged.read_layer(pool, layer, other.rows(0, 16))
        assert_bitwise(k, noise)
        assert_bitwise(v, -noise)


def test_block_table_rows_and_padding():
    table = BlockTable((5, 2, 9), page_size=4)
    assert table.capacity == 12
    assert table.rows(2, 7).tolist() == [22, 23, 8, 9, 10]
    assert table.padded(5).tolist() == [5, 2, 9, NULL_PAGE, NULL_PAGE]
    assert table.padded(2).tolist() == [5, 2]
    with pytest.raises(ValueError, match="outside"):
        table.rows(10, 13)


# ---------------------------------------------------------------------------- the allocator


@settings(max_examples=30, deadline=None)
@given(num_pages=st.integers(2, 20), page_size=st.integers(1, 8),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 60)), max_size=40))
def test_allocator_admits_waits_retires_and_ends_empty(num_pages, page_size, ops):
    config = PoolConfig(num_pages, page_size)
    alloc = PageAllocator(config)
    live: list[BlockTable] = []
    for admit, n in ops:
        if admit or not live:
            need = config.pages_for(n)
            if need > config.usable_pages:
                with pytest.raises(ValueError, match="could never|needs"):
                    alloc.admit(n)
                continue
            free = alloc.free_pages
            table = alloc.admit(n)
            assert (table is None) == (need > free)  # waits exactly when too few are free
            if table is not None:
                assert len(table.pages) == need and table.capacity >= n
                live.append(table)
        else:
            alloc.retire(live.pop(n % len(live)))
        owned = [p for t in live for p in t.pages]
        assert len(owned) == len(set(owned)) == alloc.used_pages  # no page owned twice
        assert NULL_PAGE not in owned and all(0 < p < num_pages for p in owned)
        assert alloc.used_pages + alloc.free_pages == config.usable_pages
    for table in live:
        alloc.retire(table)
    assert alloc.free_pages == config.usable_pages and alloc.used_pages == 0
    table = alloc.admit(config.usable_pages * page_size)  # the whole pool is free again
    assert sorted(table.pages) == list(range(1, num_pages))


def test_allocator_refuses_foreign_and_twice_retired_tables():
    alloc = PageAllocator(PoolConfig(8, 4))
    table = alloc.admit(9)
    alloc.retire(table)
    with pytest.raises(ValueError, match="not held"):
        alloc.retire(table)
    with pytest.raises(ValueError, match="not held"):
        alloc.retire(BlockTable((3,), 4))
    with pytest.raises(ValueError, match="at least 2 pages"):
        PoolConfig(1)


def test_buckets_and_step_inputs():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 17)] == [8, 8, 8, 8, 8, 8, 16, 24]
    assert [width_bucket([p]) for p in (0, 1, 2, 3, 4, 31, 32)] == [1, 2, 4, 4, 8, 32, 64]
    a, b = BlockTable((3, 4), 4), BlockTable((6,), 4)
    got = step_inputs([None, StepRow(7, 5, a), StepRow(8, 2, b), None], page_size=4)
    assert got.width == 8
    assert got.tokens.tolist() == [0, 7, 8, 0] and got.positions.tolist() == [0, 5, 2, 0]
    assert got.tables.tolist() == [[0, 0], [3, 4], [6, 0], [0, 0]]
    with pytest.raises(ValueError, match="outside"):
        step_inputs([StepRow(1, 8, a)], page_size=4)


# ---------------------------------------------------------------------------- the decode step


@settings(max_examples=5, deadline=None)
@given(family=st.sampled_from(list(FAMILIES)), page_size=st.sampled_from([1, 3, 16]),
       prompt=st.integers(1, 40), seed=st.integers(0, 2**31 - 1), dtype=st.just(jnp.bfloat16))
@example(family="qwen2", page_size=5, prompt=13, seed=1, dtype=jnp.float32)
@example(family="qwen3", page_size=2, prompt=1, seed=2, dtype=jnp.float32)
def test_paged_decode_is_contiguous_decode_bitwise(family, page_size, prompt, seed, dtype):
    """A request on randomly placed pages of a random size decodes bit for bit as on a
    contiguous cache (BF16 in every family; float32 in two, where XLA compiles a layer
    differently once a loop around it is inlined: docs/design.md)."""
    cfg = small_config(family, layers=2)
    params = random_params(cfg, dtype)
    rng = np.random.default_rng(seed)
    r = random_request(cfg, dtype, prompt, rng)
    decode_alone(cfg, params, r)
    config = PoolConfig(num_pages=96, page_size=page_size)
    table = random_table(rng, config, prompt + STEPS)
    weights = paged.stack_weights(cfg, params)
    pool = write_prompt(paged.new_pool(cfg, config.num_pages, page_size, dtype), r, table)
    tables = table.padded(-(-CAPACITY // page_size))[None]
    for i in range(STEPS):
        logits, pool = paged.decode_step(cfg, weights, pool, np.array([r.tokens[i]], np.int32),
                                         np.array([prompt + i], np.int32), tables, CAPACITY)
        assert_bitwise(logits[0], r.logits[i])


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_logits_do_not_depend_on_the_batch(seed):
    """Requests arrive at random steps into random slots of random batch sizes, beside others
    at other positions (so the step's width changes too), on pages other requests used before;
    each request's logits at every step are bitwise those of its contiguous decode alone."""
    cfg = small_config("qwen3", layers=2)
    params = random_params(cfg, jnp.bfloat16)
    rng = np.random.default_rng(seed)
    requests = [random_request(cfg, jnp.bfloat16, int(rng.integers(16, 60)), rng)
                for _ in range(5)]
    for r in requests:
        decode_alone(cfg, params, r)
    arrivals = rng.integers(0, 6, len(requests))
    config = PoolConfig(num_pages=14, page_size=16)  # 13 pages: not all 5 requests at once
    alloc, weights = PageAllocator(config), paged.stack_weights(cfg, params)
    pool = paged.new_pool(cfg, config.num_pages, config.page_size, jnp.bfloat16)
    running: dict[int, tuple[BlockTable, int]] = {}  # request -> (pages, steps done)
    waiting = list(range(len(requests)))
    for t in range(40):
        for i in [i for i in waiting if arrivals[i] <= t]:
            table = alloc.admit(requests[i].prompt + STEPS)
            if table is None:
                continue  # waits for pages
            waiting.remove(i)
            pool = write_prompt(pool, requests[i], table)
            running[i] = (table, 0)
        if not running:
            continue
        bucket = batch_bucket(len(running))  # unpadded, padded, or more blocks than needed
        slots: list = [None] * int(rng.choice([len(running), bucket, 2 * bucket]))
        for i, at in zip(running, rng.permutation(len(slots)), strict=False):
            slots[at] = i
        pool = step_and_check(cfg, weights, pool, requests, running, slots)
        for i in [i for i, (_, done) in running.items() if done == STEPS]:
            alloc.retire(running.pop(i)[0])
    assert not waiting and not running and alloc.used_pages == 0


@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from([(448, 448), (448, 64), (448, 896), (896, 448), (448, 512),
                              (64, 32)]),
       slot=st.integers(0, ROW_BLOCK - 1), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2**31 - 1))
def test_a_rows_dot_at_the_row_block_is_its_own(shape, slot, scale, seed):
    """What the decode step's invariance rests on: at ROW_BLOCK rows a row's product with a
    weight has the same bits in any slot, beside any other rows (of any scale), as in the row
    block of a batch of one (the other rows zero), in BF16 as the model computes it."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
    row = jnp.asarray(rng.standard_normal(shape[0]), jnp.bfloat16)
    others = jnp.asarray(rng.standard_normal((ROW_BLOCK, shape[0])) * scale, jnp.bfloat16)
    dot = jax.jit(lambda x: row_blocks(lambda x: jnp.einsum("rd,df->rf", x, w), x))
    alone = dot(row[None])[0]
    assert_bitwise(dot(others.at[slot].set(row))[slot], alone)
    assert_bitwise(dot(jnp.concatenate([others, others]).at[ROW_BLOCK + slot].set(row))[
        ROW_BLOCK + slot], alone)


def step_and_check(cfg, weights, pool, requests, running, slots):
    rows = [None if i is None else StepRow(requests[i].tokens[running[i][1]],
                                           requests[i].prompt + running[i][1], running[i][0])
            for i in slots]
    inputs = step_inputs(rows, page_size=pool.page_size)
    logits, pool = paged.decode_step(cfg, weights, pool, inputs.tokens, inputs.positions,
                                     inputs.tables, inputs.width)
    for slot, i in enumerate(slots):
        if i is not None:
            table, done = running[i]
            assert_bitwise(logits[slot], requests[i].logits[done])
            running[i] = (table, done + 1)
    return pool


def test_step_is_one_program_in_place_and_compiles_once_per_shape():
    """After a warm step, steps at other positions, tokens, tables and slots compile nothing,
    and update the pool in place."""
    cfg = small_config("llama", layers=3)
    params = random_params(cfg, jnp.bfloat16)
    weights = paged.stack_weights(cfg, params)
    pool = paged.new_pool(cfg, 20, 4, jnp.bfloat16)
    tables = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    _, pool = paged.decode_step(cfg, weights, pool, np.array([1, 2], np.int32),
                                np.array([3, 30], np.int32), tables, width=32)
    pointer = pool.k.unsafe_buffer_pointer()
    compiled = []
    handler = logging.Handler()
    handler.emit = lambda record: compiled.append(record.getMessage())
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles():
            for positions in ([17, 0], [5, 9], [31, 31]):
                before = pool
                _, pool = paged.decode_step(cfg, weights, pool, np.array(positions, np.int32),
                                            np.array(positions, np.int32), tables[::-1], 32)
                assert before.k.is_deleted() and pool.k.unsafe_buffer_pointer() == pointer
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert not [m for m in compiled if m.startswith("Compiling ")], compiled


def test_step_program_does_not_grow_with_the_layers():
    """One loop over the stacked layers: the lowered step of a 2-layer and a 6-layer model hold
    the same operations, so no layer is a call or a copy of its own."""
    def lowered(layers: int) -> str:
        cfg = small_config("qwen2", layers=layers)
        params = jax.eval_shape(lambda: random_params(cfg, jnp.bfloat16))
        weights = jax.eval_shape(lambda p: paged.stack_weights(cfg, p), params)
        pool = jax.eval_shape(lambda: paged.new_pool(cfg, 16, 4, jnp.bfloat16))
        ints = jax.ShapeDtypeStruct((4,), jnp.int32)
        tables = jax.ShapeDtypeStruct((4, 8), jnp.int32)
        return paged._step.trace(cfg, weights, pool, ints, ints, tables, width=32,
                                 attention="xla").lower().as_text()

    two, six = lowered(2), lowered(6)
    for op in ("stablehlo.dot_general", "stablehlo.while", "stablehlo.case", "func.func"):
        assert two.count(op) == six.count(op) > 0, op


def test_bad_step_inputs_raise_value_error():
    cfg = small_config("qwen2", layers=2)
    params = random_params(cfg, jnp.bfloat16)
    weights = paged.stack_weights(cfg, params)
    pool = paged.new_pool(cfg, 8, 4, jnp.bfloat16)
    one, tables = np.array([1], np.int32), np.ones((1, 4), np.int32)
    for width, match in ((12, "power of two"), (32, "within the tables")):
        with pytest.raises(ValueError, match=match):
            paged.decode_step(cfg, weights, pool, one, one, tables, width)
    with pytest.raises(ValueError, match="tables"):
        paged.decode_step(cfg, weights, pool, one, one, tables[0], 16)
    with pytest.raises(ValueError, match="positions"):
        paged.decode_step(cfg, weights, pool, one, one * 16, tables, 16)
    with pytest.raises(ValueError, match="float32"):
        paged.decode_step(cfg, weights, paged.new_pool(cfg, 8, 4, jnp.float32), one, one,
                          tables, 16)
    with pytest.raises(ValueError, match="paged attention"):
        paged.decode_step(cfg, weights, pool, one, one, tables, 16, attention="cudnn")
    x = jnp.zeros((1, 3, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    with pytest.raises(ValueError, match="T rows"):
        paged.write_layer(pool, 0, np.arange(2), x, x)
    with pytest.raises(ValueError, match="next layer"):
        paged.write_layer(pool, 0, np.arange(30, 33), x, x)


# ---------------------------------------------------------------------------- the Pallas kernel


def test_pallas_kernel_interpreted_agrees_with_the_xla_step():
    """The step with JAX's Pallas kernel (interpreted on CPU) computes what the XLA path does,
    within BF16 attention's rounding (the kernel's online softmax has its own bits)."""
    cfg = small_config("qwen2", layers=2)
    params = random_params(cfg, jnp.bfloat16)
    weights = paged.stack_weights(cfg, params)
    rng = np.random.default_rng(0)
    config = PoolConfig(num_pages=12, page_size=8)
    requests = [random_request(cfg, jnp.bfloat16, n, rng) for n in (29, 6)]
    tables = [random_table(rng, config, 32), random_table(rng, config, 8)]
    out = {}
    for attention in ("xla", "pallas-interpret"):
        pool = paged.new_pool(cfg, config.num_pages, config.page_size, jnp.bfloat16)
        for r, table in zip(requests, tables, strict=True):
            pool = write_prompt(pool, r, table)
        inputs = step_inputs([StepRow(r.first, r.prompt, t) for r, t in zip(requests, tables,
                                                                          strict=True)], 8)
        out[attention], _ = paged.decode_step(cfg, weights, pool, inputs.tokens,
                                              inputs.positions, inputs.tables, inputs.width,
                                              attention=attention)
    np.testing.assert_allclose(out["pallas-interpret"], out["xla"], atol=0.02, rtol=0)


def test_pallas_tiling_divides_the_pages():
    for n in (1, 2, 3, 6, 8, 12, 32, 64, 96, 512):
        splits, block = pallas_paged.tiling(n)
        assert n % splits == 0 and (n // splits) % block == 0
        assert splits <= pallas_paged.MAX_SPLITS and block <= pallas_paged.MAX_BLOCK_PAGES


@pytest.mark.parametrize("page_size, width", [(16, 512), (16, 16), (8, 2048)])
def test_pallas_paged_step_lowers_for_cuda(page_size, width):
    """The whole step of `tiny-7b` (batch 8) with the Pallas kernel, lowered for CUDA from
    this CPU: JAX's paged-attention Triton kernel, once in the loop over layers."""
    cfg = ModelConfig.preset("tiny-7b")
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    weights = jax.eval_shape(lambda p: paged.stack_weights(cfg, p), params)
    pool = jax.eval_shape(lambda: paged.new_pool(cfg, 256, page_size, jnp.bfloat16))
    ints = jax.ShapeDtypeStruct((8,), jnp.int32)
    tables = jax.ShapeDtypeStruct((8, width // page_size), jnp.int32)
    text = jax.jit(lambda *a: paged._step(cfg, *a, width=width, attention="pallas")).trace(
        weights, pool, ints, ints, tables).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
    splits, block = pallas_paged.tiling(width // page_size)
    assert f'name = "paged_attention_block_h_16_pages_per_compute_block_{block}"' in text
