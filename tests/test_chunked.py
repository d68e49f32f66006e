"""Token-chunked handoffs: the chunked schedule's suffix is `run_suffix(chunks=N)` bitwise, the
pipelined prefill's cache is `prefill(chunks=N)` bitwise (prefix after its quantization round
trip), every family, through the local link, the runner and `rekv generate`."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf import hf_model
from test_model import FAMILIES, random_params, small_config, tokens_for

from rekv_jax import Action, ModelConfig, init_params, parse_actions
from rekv_jax.handoff.check import check_cache
from rekv_jax.handoff.check import reference as mode_reference
from rekv_jax.handoff.payload import round_trip
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.handoff.receiver import receive_handoff
from rekv_jax.handoff.sender import prepare, send_handoff, send_prompt
from rekv_jax.mode import Mode, Reference
from rekv_jax.model import new_cache, prefill, run_chunk, run_prefix, run_suffix, token_chunks
from rekv_jax.quality.gate import reconstruct_cache
from rekv_jax.serving.generate import Request, generate
from rekv_jax.study.experiment import Experiment, run_local
from rekv_jax.study.records import Rep, Summary
from rekv_jax.transport import LocalTransport


@given(seq=st.integers(1, 300), chunks=st.integers(1, 40))
def test_token_chunks_cover_the_prompt_in_order(seq, chunks):
    if chunks > seq:
        with pytest.raises(ValueError, match="chunks must be in"):
            token_chunks(seq, chunks)
        return
    ranges = token_chunks(seq, chunks)
    assert len(ranges) == chunks and ranges[0][0] == 0 and ranges[-1][1] == seq
    assert all(a < b for a, b in ranges)
    assert all(b == a2 for (_, b), (a2, _) in zip(ranges, ranges[1:], strict=False))
    sizes = [b - a for a, b in ranges]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and np.array_equal(g, w)


@settings(max_examples=5, deadline=None)
@given(family=st.sampled_from(list(FAMILIES)), seq=st.integers(2, 16), chunks=st.integers(2, 5),
       cut=st.integers(0, 3), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_chunk_steps_are_the_chunked_prefill(family, seq, chunks, cut, dtype):
    """Chunk i through layers 0..c-1 then c..L-1 (the pipelined pair's two sides) is
    `prefill(chunks=N)`; from the unchunked `h_c` it is `run_suffix(chunks=N)`."""
    chunks = min(chunks, seq)
    cfg = small_config(family, layers=3)
    params = random_params(cfg, dtype)
    tokens = tokens_for(cfg, 2, seq)
    kv, logits = prefill(cfg, params, tokens, chunks)
    prefix, suffix = new_cache(cfg, cut, 2, seq, dtype), new_cache(cfg, 3 - cut, 2, seq, dtype)
    for a, b in token_chunks(seq, chunks):
        x, prefix = run_chunk(cfg, params, tokens[:, a:b], prefix, 0, a) if cut else (
            tokens[:, a:b], prefix)
        x, suffix = run_chunk(cfg, params, x, suffix, cut, a)
    _, last = run_suffix(cfg, params, x, 3)
    assert_same([prefix.k, prefix.v, suffix.k, suffix.v, last],
                [kv.k[:cut], kv.v[:cut], kv.k[cut:], kv.v[cut:], logits])
    h_c, _ = run_prefix(cfg, params, tokens, cut)
    want, want_logits = run_suffix(cfg, params, h_c, cut, chunks=chunks)
    suffix = new_cache(cfg, 3 - cut, 2, seq, dtype)
    for a, b in token_chunks(seq, chunks):
        x, suffix = run_chunk(cfg, params, h_c[:, a:b], suffix, cut, a)
    assert_same([suffix.k, suffix.v, run_suffix(cfg, params, x, 3)[1]],
                [want.k, want.v, want_logits])


def test_one_chunk_is_the_unchunked_prefill_and_chunks_differ_little():
    cfg = small_config("qwen2")
    params = random_params(cfg, jnp.float32)
    tokens = tokens_for(cfg, 1, 20)
    kv, logits = prefill(cfg, params, tokens)
    one, one_logits = prefill(cfg, params, tokens, chunks=1)
    assert_same([one.k, one.v, one_logits], [kv.k, kv.v, logits])
    four, four_logits = prefill(cfg, params, tokens, chunks=4)
    assert np.abs(np.asarray(four.k) - np.asarray(kv.k)).max() < 1e-4
    assert np.abs(np.asarray(four_logits) - np.asarray(logits)).max() < 1e-4
    with pytest.raises(ValueError, match="positions"):
        run_suffix(cfg, params, run_prefix(cfg, params, tokens, 2)[0], 2, tokens * 0, chunks=2)


def reference(cfg, params, tokens, cut, chunks, pipelined):
    """The chunked handoff's reference cache, logits and name."""
    ref = Reference(chunks, split_at_cut=not pipelined)
    return (*mode_reference(cfg, params, tokens, ref, cut), ref.name)


def handoff(cfg, params, tokens, action, chunks, pipelined):
    """One chunked (ready) or pipelined (prompt) handoff over a local link paced to 1 MB/s, so
    the prefix (tens of KB) is still in flight when the first chunk's suffix starts."""
    sender, receiver = LocalTransport.pair(link_gbps=1e-3)
    mode = Mode.of(action, "chunked", "pipelined" if pipelined else "full", chunks)
    errors = []

    def send():
        try:
            if pipelined:
                send_prompt(sender, cfg, params, tokens, mode, "t", timeout=120)
            else:
                state = prepare(cfg, params, tokens, mode, check_suffix=True)
                send_handoff(sender, state, mode, "t", timeout=120)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        result = receive_handoff(receiver, cfg, params, mode, *tokens.shape, "t", timeout=120)
    finally:
        thread.join(120)
    assert not errors and not thread.is_alive()
    return result


@settings(max_examples=5, deadline=None)
@given(family=st.sampled_from(list(FAMILIES)), seq=st.sampled_from([6, 13]),
       chunks=st.integers(2, 4), action=st.sampled_from(["q8:r=1", "bf16:r=2", "q4:r=3"]),
       pipelined=st.booleans())
def test_handoff_is_its_chunked_reference_bitwise(family, seq, chunks, action, pipelined):
    cfg = dataclasses.replace(small_config(family, layers=4), head_dim=64)  # quantizer groups
    params = random_params(cfg, jnp.bfloat16)
    tokens = tokens_for(cfg, 1, seq)
    action = Action.parse(action, cfg.num_layers)
    result = handoff(cfg, params, tokens, action, chunks, pipelined)
    kv, logits, name = reference(cfg, params, tokens, action.cut, chunks, pipelined)
    c = action.cut
    restored = round_trip(kv.layers(0, c), PrefixCodec(action.bits))
    assert_same([result.kv.k[:c], result.kv.v[:c], result.kv.k[c:], result.kv.v[c:]],
                [restored.k, restored.v, kv.k[c:], kv.v[c:]])
    assert np.array_equal(result.first_token, jnp.argmax(logits, axis=-1))
    want = "bitwise" if action.bits == 16 else "suffix bitwise"
    assert check_cache(kv, action, result, name).startswith(f"{want} vs {name}")
    assert result.suffix_match is (None if pipelined else True)
    assert result.timeline_ms.suffix_start < result.timeline_ms.prefix


@pytest.mark.parametrize("action", ["q8:full", "bf16:recompute"])
def test_pipelined_transfer_and_recompute(action):
    cfg = dataclasses.replace(small_config("llama", layers=3), head_dim=64)
    params = random_params(cfg, jnp.bfloat16)
    tokens = tokens_for(cfg, 1, 12)
    action = Action.parse(action, cfg.num_layers)
    result = handoff(cfg, params, tokens, action, 3, True)
    kv, logits, name = reference(cfg, params, tokens, action.cut, 3, True)
    assert name == "prefill(chunks=3)"
    assert np.array_equal(result.first_token, jnp.argmax(logits, axis=-1))
    assert not check_cache(kv, action, result, name).startswith("MISMATCH")


@pytest.mark.parametrize("action", ["q8:r=1", "bf16:r=2", "q8:full"])
def test_pipelined_sender_computes_the_next_chunk_while_it_sends(action, monkeypatch):
    """Chunk k+1 is dispatched before chunk k's messages are handed to the link (the device
    computes while the host sends), and the intervals it times are the prefill side's times."""
    import rekv_jax.handoff.sender as sender_module

    cfg = dataclasses.replace(small_config("llama", layers=3), head_dim=64)
    params = random_params(cfg, jnp.bfloat16)
    tokens = tokens_for(cfg, 1, 12)
    events = []
    run = sender_module.run_chunk

    def logged_run(cfg, params, x, kv, first, start):
        events.append(("compute", start))
        return run(cfg, params, x, kv, first, start)

    monkeypatch.setattr(sender_module, "run_chunk", logged_run)
    sender, receiver = LocalTransport.pair()
    send = sender.send
    monkeypatch.setattr(sender, "send", lambda tag, *a: (events.append(("send", tag)),
                                                         send(tag, *a))[1])
    mode = Mode.of(Action.parse(action, cfg.num_layers), "chunked", "pipelined", 3)
    sending = sender_module.start_prompt(sender, cfg, params, tokens, mode, "t", go=False)
    starts = [a for a, _ in token_chunks(12, 3)]
    assert [e for e in events if e[0] == "compute"] == [("compute", a) for a in starts]
    for k, a in enumerate(starts[1:]):
        sent_k = [i for i, e in enumerate(events) if e[0] == "send" and e[1] in
                  (f"t/prefix{k}" if k else "t/prefix", f"t/boundary{k}" if k else "t/boundary")]
        assert sent_k and events.index(("compute", a)) < min(sent_k)
    times = sending.times
    assert times.prefill_ms > 0 and (times.quantize_ms > 0) == (mode.action.bits < 16)
    sending.abandon()


def test_schedules_and_prefills_that_do_not_go_together():
    joint = Action(8, 4, 6)
    Mode.of(joint, "chunked", "full", 4)
    Mode.of(joint, "chunked", "pipelined", 2)
    assert Mode.of(joint, "overlapped", "full", 4).chunks == 1  # chunks only where they apply
    for args in [("chunked", "full", 1), ("chunked", "split", 4), ("overlapped", "pipelined", 4),
                 ("chunked", "pipelined", 1), ("fastest", "full", 1), ("chunked", "full", 0)]:
        with pytest.raises(ValueError):
            Mode.of(joint, *args)
    with pytest.raises(ValueError):
        Mode(joint, "chunked", "full", 1)  # the constructor takes only a normal form
    with pytest.raises(ValueError, match="chunks"):
        Experiment(actions=(joint,), schedules=("chunked",), chunks=1)
    with pytest.raises(ValueError, match="at least as many tokens"):
        Experiment(actions=(joint,), schedules=("chunked",), chunks=9, seq_len=8)


def test_runner_records_name_the_chunked_reference():
    """`rekv handoff`'s runner: overlapped and chunked side by side (ready), then pipelined
    (prompt); every rep checked against its own reference. On a paced link, whose receives
    queue in the order sent: a receive that waits for one that never comes would time out."""
    actions = tuple(parse_actions("q8:r=2,bf16:full,bf16:recompute", 6))
    paced = {"link_gbps": 1.0, "timeout": 15.0}
    runs = [Experiment(seq_len=32, actions=actions, schedules=("overlapped", "chunked"),
                       chunks=4, warmup=1, reps=2, **paced),
            Experiment(seq_len=32, actions=actions, schedules=("chunked",), chunks=3, warmup=1,
                       reps=2, interval="prompt", prefill="pipelined", **paced)]
    for exp in runs:
        out = []
        run_local(exp, out.append)
        summaries = [r for r in out if isinstance(r, Summary)]
        assert all(isinstance(r, Summary | Rep) for r in out)
        assert all(r.first_token_match for r in out), out
        got = {(str(s.action), s.schedule): (s.chunks, s.cache_check) for s in summaries}
        if exp.prefill == "full":
            assert got[("q8:r=2", "chunked")] == (4, (
                "suffix bitwise vs run_suffix(chunks=4), prefix within the q8 error bound, "
                "suffix checksum = the prefill process's"))
            assert got[("q8:r=2", "overlapped")][0] == 1
            assert got[("bf16:recompute", "n/a")] == (1, "bitwise")
        else:
            assert got == {
                ("q8:r=2", "chunked"): (3, "suffix bitwise vs prefill(chunks=3), prefix within "
                                           "the q8 error bound"),
                ("bf16:full", "n/a"): (3, "bitwise vs prefill(chunks=3)"),
                ("bf16:recompute", "n/a"): (3, "bitwise vs prefill(chunks=3)")}


def test_quality_scores_the_chunked_caches():
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size, jnp.int32)
    action = Action.parse("q8:r=2", cfg.num_layers)
    for pipelined in (False, True):
        kv, logits = reconstruct_cache(cfg, params, tokens, action, 4, pipelined)
        want, want_logits, name = reference(cfg, params, tokens, action.cut, 4, pipelined)
        assert np.array_equal(logits, want_logits) and np.array_equal(kv.k[4:], want.k[4:])
        restored = round_trip(want.layers(0, 4), PrefixCodec(8))
        assert np.array_equal(kv.k[:4], restored.k) and np.array_equal(kv.v[:4], restored.v)


def test_generate_pipelined_yields_transformers_greedy_tokens(tmp_path):
    model = hf_model("qwen2")
    model.save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, 40).tolist()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    out = generate(Request(token_ids=ids, model=f"hf:{tmp_path}", action="bf16:r=1",
                           max_new_tokens=6, dtype="float32", prefill="pipelined",
                           schedule="chunked", chunks=4, transport="local"))
    assert out.tokens == want[0, len(ids):].tolist() and out.chunks == 4 and not out.fallback
