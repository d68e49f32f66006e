"""The decode engine: handoffs of every kind admitted into pages between the decode steps of the
requests already running, in one process and across two; every BF16-action request's tokens are
its single-process greedy decode, every request's pages pass its cache check, the pool ends
empty; a request whose prefix is corrupted or whose prefill worker dies fails or recovers alone;
the prefill worker holds its sends until the decode side admits (back-pressure)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax.action import Action
from rekv_jax.handoff.check import reference
from rekv_jax.handoff.receiver import Reception, WorkBudget
from rekv_jax.handoff.sender import send_prompt
from rekv_jax.mode import Interval, PrefillMode, Reference, Schedule
from rekv_jax.model.transformer import greedy_decode
from rekv_jax.serving.engine import DecodeEngine, EngineConfig, serving_mode
from rekv_jax.serving.inbox import LocalInbox
from rekv_jax.serving.member import MemberSetup
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import (
    Abort,
    Finished,
    Load,
    PrefillDone,
    ServeRequest,
    Token,
    tag,
)
from rekv_jax.serving.scripted import Ask, serve_local, serve_pair
from rekv_jax.transport import LocalTransport

MODEL = "tiny"  # 6 layers
NEW = 5  # tokens per request
LONG = 24  # tokens per request where requests must overlap
# every kind of action, two prompt lengths (few programs to compile), staggered arrivals
ACTIONS = (("bf16:full", 40), ("bf16:r=2", 96), ("q8:r=2", 96), ("bf16:recompute", 96),
           ("bf16:r=3", 40), ("q8:full", 40), ("q4:r=4", 96))
CHUNK = 32  # token chunks of a suffix: a 96-token prompt's suffix (or recomputation) in 3


@functools.cache
def model():
    return MemberSetup(MODEL, PoolConfig(40, 16)).load()


def asks(actions=ACTIONS, gap_s: float = 0.15, new: int = NEW) -> list[Ask]:
    rng = np.random.default_rng(0)
    vocab = model().cfg.vocab_size
    return [Ask(ServeRequest(i, rng.integers(0, vocab, n).tolist(), new, arrival_s=gap_s * i),
                action, CHUNK) for i, (action, n) in enumerate(actions)]


@functools.cache
def single_process(ask: Ask, plain: bool = False) -> tuple[int, ...]:
    """Greedy tokens on the single-process reference of the request's mode (`plain`: the plain
    prefill's, a fallback's cache)."""
    cfg, params = model().cfg, model().params
    mode = ask.records(cfg.num_layers)[0].mode
    tokens = jnp.asarray([ask.request.tokens], jnp.int32)
    kv, logits = reference(cfg, params, tokens, Reference() if plain else mode.reference,
                           mode.action.cut)
    steps = ask.request.max_new_tokens
    return tuple(np.asarray(greedy_decode(cfg, params, kv, logits, steps))[0].tolist())


def check_served(asked: list[Ask], finished: list[Finished], skip=(), checked=True) -> None:
    """BF16 actions: the tokens of single-process greedy decoding; Q8/Q4: its first token;
    every cache check passes (a quantized prefix within its bound) when `checked`."""
    L = model().cfg.num_layers
    for ask, f in zip(asked, finished, strict=True):
        if ask.request.id in skip:
            continue
        action = Action.parse(ask.action, L)
        assert f.error is None and len(f.tokens) == ask.request.max_new_tokens, f
        want = single_process(ask, plain=f.fell_back)
        lossless = action.bits == 16 or f.fell_back or action.cut == 0
        assert (f.tokens if lossless else f.tokens[:1]) == (want if lossless else want[:1]), ask
        if checked:
            assert f.checks.startswith("bitwise" if lossless else "suffix bitwise"), f
            assert lossless or "prefix within the" in f.checks


def test_serving_modes_chunk_the_decode_sides_compute():
    L = 6
    modes = {a: serving_mode(Action.parse(a, L), 96, 32) for a in
             ("bf16:r=2", "bf16:recompute", "bf16:full")}
    assert modes["bf16:r=2"].schedule == Schedule.CHUNKED and modes["bf16:r=2"].chunks == 3
    assert modes["bf16:recompute"].prefill == PrefillMode.PIPELINED
    assert modes["bf16:recompute"].reference == Reference(3)  # prefill(chunks=3)
    assert modes["bf16:full"].chunks == 1
    assert all(m.interval == Interval.PROMPT for m in modes.values())
    assert serving_mode(Action.parse("q8:r=2", L), 20, 32).chunks == 1  # one chunk: unchunked


def test_work_budget_spends_and_always_lets_one_unit_through():
    budget = WorkBudget(100)
    assert budget.take(300) and not budget.take(1)  # the first unit goes, even if larger
    budget = WorkBudget(100)
    assert budget.take(60) and budget.take(40) and not budget.take(1)
    assert all(WorkBudget(None).take(10**6) for _ in range(3))


def test_a_reception_dispatches_its_suffix_within_each_budget_as_data():
    """A chunked suffix (96 tokens in 3 chunks through the last 2 layers: 6 units of 32
    token-layers): an advance given a budget of 64 dispatches at most that; the layers come out
    as produced parts, not in the outcome, and are the chunked reference's bit for bit."""
    cfg, params = model().cfg, model().params
    ask = asks((("bf16:r=2", 96),))[0]
    admit, prefill = ask.records(cfg.num_layers)
    tokens = jnp.asarray([prefill.tokens], jnp.int32)
    prefill_end, decode_end = LocalTransport.pair()
    sunk = {}
    reception = Reception(decode_end, cfg, params, admit.mode, 1, 96, "r", keeps_cache=False)
    reception.start()
    sender = threading.Thread(target=send_prompt, args=(prefill_end, cfg, params, tokens,
                                                        admit.mode, "r"), kwargs={"go": False})
    sender.start()
    spent = []
    while True:
        budget = WorkBudget(64)
        done = reception.advance(budget)
        sunk.update({(part.first + i, part.start): (part.kv.keys[i], part.kv.values[i])
                     for part in reception.produced() for i in range(part.kv.num_layers)})
        spent.append(budget.spent)
        if done:
            break
        concurrent.futures.wait(reception.waitables(), 1.0, concurrent.futures.FIRST_COMPLETED)
    sender.join(30)
    assert max(spent) <= 64 and sum(spent) == 6 * 32
    assert reception.outcome().kv is None
    want, _ = reference(cfg, params, tokens, admit.mode.reference, admit.mode.action.cut)
    for layer in range(cfg.num_layers):
        k, v = sunk[layer, 0]
        assert np.array_equal(np.asarray(k), np.asarray(want.keys[layer]))
        assert np.array_equal(np.asarray(v), np.asarray(want.values[layer]))


def test_every_action_in_one_process_with_a_pool_that_makes_requests_wait():
    """Seven requests of every kind arrive while others decode, into a pool that holds two
    or three at once (the router admits the others as pages free up); each one's tokens and
    pages are what the single process gives, and the pool ends empty."""
    asked = asks()
    pool = PoolConfig(18, 16)  # 17 pages; a 96-token request takes 7
    out = serve_local(MemberSetup(MODEL, pool=pool, check=True), asked, model=model())
    check_served(asked, out.finished)
    assert out.used_pages == 0
    for ask in asked:  # tokens in order, the first from the handoff
        mine = [i for i in out.items if isinstance(i, Token) and i.request_id == ask.request.id]
        assert [t.index for t in mine] == list(range(NEW))
    loads = [i for i in out.items if isinstance(i, Load)]
    assert loads and loads[-1].running == 0 and loads[-1].free_pages == pool.usable_pages
    assert min(i.free_pages for i in loads) < pool.pages_for(96 + NEW)  # too full at times
    assert sum(isinstance(i, PrefillDone) and i.error is None for i in out.items) == len(asked)


def test_requests_decoding_across_an_attention_bucket_give_greedy_decodes_tokens():
    """Prompts that end just below a power of two decode past it: each step attends over its
    whole bucket in the pages, as in the single process's greedy decode (whose cache is padded
    to a power of two, not to the prompt plus its tokens)."""
    asked = [dataclasses.replace(a, request=dataclasses.replace(a.request, max_new_tokens=12))
             for a in asks((("bf16:full", 60), ("bf16:r=2", 123), ("bf16:full", 250)))]
    out = serve_local(MemberSetup(MODEL, pool=PoolConfig(40, 16)), asked, model=model())
    check_served(asked, out.finished, checked=False)


def test_requests_admitted_together_share_decode_steps():
    """Four requests admitted at once, their prefill sides done before the engine's first
    iteration (which dispatches all of their suffix work): they join the batch as their
    handoffs complete and then step together, each with its single-process tokens; the pool
    then holds nothing. The first suffix ran first; the later ones queued behind it (their
    phases hold that wait), and `bf16:full`, with no suffix, queued behind nothing."""
    cfg, params = model().cfg, model().params
    asked = asks((("bf16:r=2", 96), ("bf16:full", 40), ("q8:r=2", 96), ("bf16:recompute", 40)))
    prefill_end, decode_end = LocalTransport.pair()
    engine = DecodeEngine(cfg, params, [decode_end], EngineConfig(PoolConfig(40, 16), None))
    worker = PrefillWorker(cfg, params, [prefill_end])
    for ask in asked:
        admit, prefill = ask.records(cfg.num_layers)
        engine.admit(dataclasses.replace(admit, max_new_tokens=LONG))
        assert worker.prefill(prefill).error is None  # sent, acknowledged
    steps, finished = [], []
    while not engine.idle:
        items = engine.step()
        steps.append({i.request_id for i in items if isinstance(i, Token) and i.index})
        finished += [i for i in items if isinstance(i, Finished)]
    assert max(map(len, steps)) == 4  # one batch of all four
    assert sum(len(s) for s in steps) == 4 * (LONG - 1)  # every step of each
    finished.sort(key=lambda f: f.request_id)
    for ask, f in zip(asked, finished, strict=True):
        n = 1 if "q8" in ask.action else NEW  # the reference decodes NEW tokens
        assert len(f.tokens) == LONG and f.tokens[:n] == single_process(ask)[:n]
    assert [f.suffix_queued for f in finished] == [False, False, True, True]
    assert engine.used_pages == 0


def corrupt(tag: str):
    """A `LocalTransport._verify` that flips one bit of message `tag`'s first buffer as it
    lands: its checksum no longer matches (a corrupted payload)."""
    verify = LocalTransport._verify

    def corrupting(self, arrival, arrays, sums, expected):
        if arrival.tag == tag:
            bits = jax.lax.bitcast_convert_type(arrays[0], jnp.dtype(
                f"uint{arrays[0].dtype.itemsize * 8}"))
            flipped = jax.lax.bitcast_convert_type(bits.at[(0,) * bits.ndim].add(1),
                                                   arrays[0].dtype)
            arrays = [flipped, *arrays[1:]]
        return verify(self, arrival, arrays, sums, expected)

    return corrupting


@pytest.mark.parametrize("fallback", ["recompute", "error"])
def test_a_corrupted_prefix_stays_with_its_request(monkeypatch, fallback):
    """Request 2's Q8 prefix is corrupted on the link while three others decode: it recovers
    by recomputation (its tokens then the plain prefill's) or, under `fallback error`, fails
    alone in one line; the others' tokens and caches are untouched."""
    asked = asks((("bf16:r=2", 96), ("bf16:full", 40), ("q8:r=2", 96), ("bf16:r=3", 40)),
                 gap_s=0.3)
    monkeypatch.setattr(LocalTransport, "_verify", corrupt("req/2/prefix"))
    out = serve_local(MemberSetup(MODEL, pool=PoolConfig(40, 16), fallback=fallback,
                                 check=True), asked, model=model())
    bad = out.finished[2]
    if fallback == "recompute":
        assert bad.fell_back and bad.error is None
        check_served(asked, out.finished)
    else:
        assert bad.tokens == () and "corrupted payload" in bad.error
        assert "\n" not in bad.error
        check_served(asked, out.finished, skip={2})
    assert out.used_pages == 0


def test_a_dead_prefill_worker_fails_the_requests_waiting_for_it_and_running_ones_finish(
        monkeypatch):
    """The prefill worker dies once its first two requests are handed off (its end of the link
    closes as it starts the third): the requests still waiting for it fail, one line each;
    those it handed off finish."""
    started = []
    start = PrefillWorker._start

    def dying(self, job, emit, send):
        if len(started) == 2:  # its link goes as a dead process's does: every wait fails
            deadline = time.monotonic() + 20
            while self._flying and time.monotonic() < deadline:  # the two handed off
                self._collect(emit)
            self._links[0]._channel.close("the prefill side is gone")
        started.append(job.request.request_id)
        return start(self, job, emit, send)

    monkeypatch.setattr(PrefillWorker, "_start", dying)
    asked = asks((("bf16:r=2", 96), ("bf16:full", 40), ("q8:r=2", 96), ("bf16:r=3", 40)),
                 gap_s=0.0)
    out = serve_local(MemberSetup(MODEL, pool=PoolConfig(40, 16), timeout=20), asked,
                      model=model())
    check_served(asked[:2], out.finished[:2], checked=False)
    for f in out.finished[2:]:
        assert f.tokens == () and "the prefill side is gone" in f.error and "\n" not in f.error
    assert out.used_pages == 0


def shared_steps(items: list[object]) -> int:
    """The most requests one decode step served (a step's tokens share their time)."""
    steps: dict[float, int] = {}
    for i in items:
        if isinstance(i, Token) and i.index:
            steps[i.t_s] = steps.get(i.t_s, 0) + 1
    return max(steps.values())


def test_two_processes_serve_staggered_requests_of_every_kind():
    """The same kinds of requests through a prefill process and a decode process (the
    launcher's pair, the transfer server between them), each arriving 0.1 s after the last
    while the ones before it decode their 16 tokens."""
    asked = asks(ACTIONS[:6], gap_s=0.1, new=16)
    out = serve_pair(MemberSetup(MODEL, pool=PoolConfig(64, 16), check=True), asked)
    check_served(asked, out.finished)
    assert out.used_pages == 0 and shared_steps(out.items) >= 2
    done = [i for i in out.items if isinstance(i, PrefillDone)]
    assert sorted(d.request_id for d in done) == list(range(len(asked)))
    assert all(d.error is None and d.sent_bytes > 0 for d in done)


def test_a_request_that_can_never_fit_fails_alone():
    """A request needing more pages than a decode worker holds fails at once at the router, in
    one line, and is never prefilled; the other is served."""
    asked = asks((("bf16:full", 40), ("bf16:r=2", 96)))
    asked[1] = dataclasses.replace(asked[1], request=dataclasses.replace(
        asked[1].request, max_new_tokens=400))
    out = serve_local(MemberSetup(MODEL, pool=PoolConfig(12, 16), timeout=60), asked,
                      model=model())
    assert out.served[1].failure == ("needs 31 pages of 16 positions; a decode worker has 11")
    assert out.finished[1] is None
    assert not [i for i in out.items if getattr(i, "request_id", None) == 1]  # never prefilled
    check_served(asked[:1], out.finished[:1], checked=False)
    assert out.used_pages == 0


def test_a_reception_that_can_move_is_advanced_without_a_sleep(monkeypatch):
    """A reception whose awaited work completed between its advance and the engine's wait has
    nothing pending: the engine advances it at once rather than sleeping its idle wait (here
    60 s, so a sleep would show). Every reception is made to report nothing pending."""
    cfg, params = model().cfg, model().params
    (ask,) = asks((("q8:full", 40),))
    prefill_end, decode_end = LocalTransport.pair()
    engine = DecodeEngine(cfg, params, [decode_end],
                          EngineConfig(PoolConfig(40, 16), None, idle_wait_s=60.0))
    admit, prefill = ask.records(cfg.num_layers)
    engine.admit(admit)
    assert PrefillWorker(cfg, params, [prefill_end]).prefill(prefill).error is None
    monkeypatch.setattr(Reception, "waitables", lambda self: [])
    start, finished = time.monotonic(), []
    while not engine.idle and time.monotonic() - start < 30:
        finished += [i for i in engine.step() if isinstance(i, Finished)]
    assert time.monotonic() - start < 30
    assert [f.error for f in finished] == [None] and engine.used_pages == 0


def test_a_handoff_completed_while_the_step_ran_gives_its_first_token_that_iteration(
        monkeypatch):
    """Beside a running request, a handoff whose reception is done by the time the step's tokens
    are collected emits its first token in that iteration, not the next: the engine advances
    the receptions again after the collect. Its reception's first advance is made to report
    not done (as work still in flight would), having waited for everything it dispatched."""
    cfg, params = model().cfg, model().params
    running, late = asks((("bf16:full", 40), ("q8:full", 40)), new=20)
    prefill_end, decode_end = LocalTransport.pair()
    engine = DecodeEngine(cfg, params, [decode_end], EngineConfig(PoolConfig(40, 16), None))
    worker = PrefillWorker(cfg, params, [prefill_end])
    admit, prefill = running.records(cfg.num_layers)
    engine.admit(admit)
    assert worker.prefill(prefill).error is None
    while not any(isinstance(t, Token) and t.index == 1 for t in engine.step()):
        pass  # until request 0 decodes in the batch
    advance, calls = Reception.advance, []

    def first_not_done(self, budget=None):
        done = advance(self, budget)
        if self.tag == tag(late.request.id) and not calls:
            calls.append(done)
            concurrent.futures.wait(self.waitables())
            return False
        return done
    monkeypatch.setattr(Reception, "advance", first_not_done)
    admit, prefill = late.records(cfg.num_layers)
    engine.admit(admit)
    assert worker.prefill(prefill).error is None
    items = engine.step()
    assert calls, "the late reception was advanced"
    assert [(t.request_id, t.index) for t in items if isinstance(t, Token)][-1] == (1, 0)


def test_the_engine_refuses_what_could_never_fit_and_stops_on_what_does_not_fit_now():
    """An `Admit` no pool could hold fails its request in one line and tells its prefill side
    not to send (it does not wait out its timeout); one that does not fit now is the router's
    error (it counts the pages), and the engine says so rather than decide."""
    cfg, params = model().cfg, model().params
    big, small = asks((("bf16:r=2", 96), ("bf16:full", 40)))
    big_admit, big_prefill = big.records(cfg.num_layers)
    big_admit = dataclasses.replace(big_admit, max_new_tokens=400)
    prefill_end, decode_end = LocalTransport.pair()
    engine = DecodeEngine(cfg, params, [decode_end], EngineConfig(PoolConfig(12, 16), None))
    inbox, out = LocalInbox(), []
    inbox.put(big_admit)
    inbox.close()
    engine.serve(inbox, out.append)
    (f,) = [item for item in out if isinstance(item, Finished)]
    assert [item.free_pages for item in out if isinstance(item, Load)] == [11]  # nothing taken
    assert f.error == ("ValueError: a request of 496 positions needs 31 pages; the pool holds "
                       "11 of 16")
    done = PrefillWorker(cfg, params, [prefill_end], timeout=60).prefill(big_prefill)
    assert "needs 31 pages" in done.error and done.sent_bytes == 0
    admit, _ = small.records(cfg.num_layers)
    for i in range(2):  # 40 + 5 positions: 3 pages each; 11 hold three such requests
        engine.admit(dataclasses.replace(admit, request_id=10 + i))
    with pytest.raises(RuntimeError, match="admitted with 5 pages free, too few"):
        engine.admit(dataclasses.replace(admit, request_id=12, max_new_tokens=100))
    assert engine.used_pages == 6
    for i in range(2):
        engine.abort(10 + i)
    assert engine.used_pages == 0


def four_and_one_aborted(abort_at: int | None) -> tuple[dict[int, Finished], list[int]]:
    """Four requests admitted at once and their prefill sides done; with `abort_at`, a fifth
    admitted whose handoff never comes, and it and request 0 (then decoding) aborted after that
    many iterations. Each request's `Finished`, and the pages used after each iteration."""
    cfg, params = model().cfg, model().params
    asked = asks((("bf16:r=2", 96), ("bf16:full", 40), ("q8:r=2", 96), ("bf16:recompute", 40),
                  ("bf16:full", 40)))
    prefill_end, decode_end = LocalTransport.pair()
    engine = DecodeEngine(cfg, params, [decode_end], EngineConfig(PoolConfig(60, 16), None))
    worker = PrefillWorker(cfg, params, [prefill_end])
    for ask in asked[:4] if abort_at is None else asked:
        admit, prefill = ask.records(cfg.num_layers)
        engine.admit(dataclasses.replace(admit, max_new_tokens=LONG))
        if ask.request.id < 4:
            assert worker.prefill(prefill).error is None
    finished, used = {}, []
    while not engine.idle:
        if len(used) == abort_at:
            before = engine.used_pages
            items = engine._take(Abort(0, "client disconnected")) + engine.abort(4)
            assert engine.abort(0) == engine.abort(99) == []  # ids it does not hold
            assert before - engine.used_pages == 8 + 4  # 96 + 24 and 40 + 24 positions
            finished |= {f.request_id: f for f in items}
        finished |= {i.request_id: i for i in engine.step() if isinstance(i, Finished)}
        used.append(engine.used_pages)
    return finished, used


def test_an_abort_frees_a_requests_pages_at_once_and_leaves_the_others_tokens_as_they_were():
    """Request 0 aborted while it decodes and request 4 while its handoff waits: each ends
    "abort" with its tokens so far, its pages free at once; the other three decode exactly as
    in the run without them, and the pool is empty once the last one finished."""
    want, _ = four_and_one_aborted(None)
    got, used = four_and_one_aborted(4)
    assert got[0].finish_reason == "abort" and 0 < len(got[0].tokens) < LONG
    assert got[0].error is None and got[0].tokens == want[0].tokens[:len(got[0].tokens)]
    assert got[4].finish_reason == "abort" and got[4].tokens == ()
    for i in (1, 2, 3):
        assert np.array_equal(got[i].tokens, want[i].tokens) and got[i].error is None
    assert used[-1] == 0
