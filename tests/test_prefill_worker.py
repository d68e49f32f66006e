"""The serving prefill worker's pipeline, in one process over a paced in-process link: a full
prefill is computed before its decode side admits it and held until then; prompts are computed
while earlier handoffs are on the link; the bytes in flight are bounded (back-pressure); each
handoff's reported send time is at least its bytes over the paced bandwidth; an `Abort` ends a
request wherever it is (a queued one is never computed), answered exactly once."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import numpy as np

from rekv_jax.action import Action
from rekv_jax.handoff import sender
from rekv_jax.handoff.sender import Prepared
from rekv_jax.mode import Mode
from rekv_jax.serving import prefill_worker
from rekv_jax.serving.engine import DecodeEngine, EngineConfig
from rekv_jax.serving.inbox import LocalInbox
from rekv_jax.serving.member import MemberSetup
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import Abort, Finished, PrefillDone, Prefilled, ServeRequest
from rekv_jax.serving.scripted import Ask
from rekv_jax.sizes import action_bytes
from rekv_jax.transport import LocalTransport

MODEL = "tiny"
PROMPT = 40  # tokens: one chunk, a full prefill
LINK_S = 0.3  # what one request's handoff takes on the paced link


@functools.cache
def model():
    return MemberSetup(MODEL, PoolConfig(64, 16)).load()


def records(i: int):
    """(Admit, Prefill) of request i: a bf16:full handoff of its own random prompt."""
    vocab, L = model().cfg.vocab_size, model().cfg.num_layers
    tokens = np.random.default_rng(i).integers(0, vocab, PROMPT).tolist()
    return Ask(ServeRequest(i, tokens, 3), "bf16:full").records(L)


def paced_gbps() -> float:
    """The bandwidth at which one request's handoff takes `LINK_S`."""
    cfg = model().cfg
    nbytes = action_bytes(cfg, Action.parse("bf16:full", cfg.num_layers), PROMPT).total_bytes
    return nbytes / LINK_S / 1e9


class Serving:
    """A prefill worker serving on a thread over a paced in-process link to a decode engine
    (admitted here, never stepped: the link's own threads deliver and acknowledge), with when
    each prompt was computed and handed to the link, and what the worker emitted."""

    def __init__(self, monkeypatch, gbps: float | None, **bounds: int) -> None:
        cfg, params = model().cfg, model().params
        self.prefill_end, self.decode_end = LocalTransport.pair(gbps)
        self.engine = DecodeEngine(cfg, params, [self.decode_end],
                                   EngineConfig(PoolConfig(64, 16), None))
        self.worker = PrefillWorker(cfg, params, [self.prefill_end], timeout=30, **bounds)
        self.computed: dict[tuple, float] = {}  # prompt -> when its compute ended
        self.sent: dict[str, float] = {}  # tag -> when its first message was handed over
        self.done: dict[int, list[tuple[float, PrefillDone]]] = {}
        self.prefilled: dict[int, Prefilled] = {}  # id -> its Prefilled
        self._spy(monkeypatch)
        self.inbox = LocalInbox()
        self.thread = threading.Thread(target=self.worker.serve, args=(self.inbox, self._emit),
                                       daemon=True)
        self.thread.start()

    def _spy(self, monkeypatch) -> None:
        prepare, send = prefill_worker.prepare_prompt, Prepared.send

        def preparing(cfg, params, tokens, *args, **kwargs):
            out = prepare(cfg, params, tokens, *args, **kwargs)
            self.computed[tuple(np.asarray(tokens)[0].tolist())] = time.monotonic()
            return out

        def sending(prepared, link, tag, *args):
            self.sent[tag] = time.monotonic()
            return send(prepared, link, tag, *args)

        monkeypatch.setattr(prefill_worker, "prepare_prompt", preparing)
        monkeypatch.setattr(Prepared, "send", sending)

    def _emit(self, item: object) -> None:
        if isinstance(item, Prefilled):  # once per request, before its PrefillDone
            assert item.request_id not in self.prefilled and item.request_id not in self.done
            self.prefilled[item.request_id] = item
            return
        assert isinstance(item, PrefillDone) and item.request_id in self.prefilled
        self.done.setdefault(item.request_id, []).append((time.monotonic(), item))

    def wait(self, what, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    def close(self) -> None:
        self.inbox.close()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.prefill_end.close(), self.decode_end.close()


def warm(monkeypatch) -> None:
    """Compile the prefill and the handoff's programs outside the timed tests."""
    run = Serving(monkeypatch, None)
    admit, prefill = records(100)
    run.engine.admit(admit)
    run.inbox.put(prefill)
    run.wait(lambda: 100 in run.done)
    run.close()


def test_a_full_prefill_is_computed_before_its_admission_and_held_until_it(monkeypatch):
    """The prompt is computed at once; nothing is sent until the decode side admits it; then
    its handoff completes and the engine decodes it."""
    warm(monkeypatch)
    run = Serving(monkeypatch, None)
    admit, prefill = records(0)
    run.inbox.put(prefill)
    run.wait(lambda: tuple(prefill.tokens) in run.computed)
    time.sleep(0.3)
    assert not run.sent and not run.done  # held
    run.engine.admit(admit)
    run.wait(lambda: 0 in run.done)
    (_, done), = run.done[0]
    assert done.error is None and done.sent_bytes > 0 and done.compute_ms > 0
    finished = []
    while not run.engine.idle:
        finished += [i for i in run.engine.step() if isinstance(i, Finished)]
    assert finished[0].error is None and len(finished[0].tokens) == 3
    run.close()


def streamed(i: int, admitted: bool):
    """(Admit, Prefill) of request i as a pipelined q8:r=2 prefill in 3 chunks; the `Prefill`
    says whether its `Admit` went with it."""
    admit, prefill = records(i)
    mode = Mode.of(Action.parse("q8:r=2", model().cfg.num_layers), "chunked", "pipelined", 3)
    return (dataclasses.replace(admit, mode=mode),
            dataclasses.replace(prefill, mode=mode, admitted=admitted))


def spy_streamed(monkeypatch, run: Serving) -> tuple[list[int], list[str]]:
    """The chunks the worker computed (their first positions) and the tags it handed over."""
    chunks, tags = [], []
    run_chunk, send = sender.run_chunk, run.prefill_end.send

    def computing(cfg, params, x, kv, first, start):
        chunks.append(start)
        return run_chunk(cfg, params, x, kv, first, start)

    monkeypatch.setattr(sender, "run_chunk", computing)
    monkeypatch.setattr(run.prefill_end, "send", lambda tag, *a: (tags.append(tag),
                                                                  send(tag, *a))[1])
    return chunks, tags


def test_a_streamed_prefill_whose_admit_went_with_it_computes_before_its_admission(monkeypatch):
    """Marked admitted, every chunk of the prompt is computed at once and nothing is handed to
    the link until the decode side admits it; unmarked, nothing is computed until then. Both
    then complete; a refusal that comes while it computes is its one report."""
    warm(monkeypatch)
    run = Serving(monkeypatch, None)
    chunks, tags = spy_streamed(monkeypatch, run)
    admit, prefill = streamed(0, admitted=True)
    run.inbox.put(prefill)
    run.wait(lambda: len(chunks) == 3)
    time.sleep(0.3)
    assert not tags and not run.done  # computed, held
    run.engine.admit(admit)
    run.wait(lambda: 0 in run.done)
    assert run.done[0][0][1].error is None and tags[0] == "req/0/tokens"

    admit, prefill = streamed(1, admitted=False)
    run.inbox.put(prefill)
    time.sleep(0.3)
    assert len(chunks) == 3  # not computed before its admission
    run.engine.admit(admit)
    run.wait(lambda: 1 in run.done)
    assert run.done[1][0][1].error is None and len(chunks) == 6

    _, prefill = streamed(2, admitted=True)
    run.inbox.put(prefill)
    run.wait(lambda: len(chunks) == 9)
    run.decode_end.send_meta("req/2/admitted", {"refused": "it could never fit"})
    run.wait(lambda: 2 in run.done)
    time.sleep(0.1)
    (_, done), = run.done[2]
    assert done.error == "it could never fit" and not any(t.startswith("req/2/") for t in tags)
    run.close()


def test_prompts_are_computed_while_earlier_handoffs_are_on_the_paced_link(monkeypatch):
    """Three admitted requests on a link that takes `LINK_S` each: every prompt is computed
    before the first handoff's verdicts come; the handoffs leave the link one after another
    (FIFO), each reported no sooner than its bytes cross at the paced bandwidth."""
    warm(monkeypatch)
    gbps = paced_gbps()
    run = Serving(monkeypatch, gbps)
    for i in range(3):
        admit, prefill = records(i)
        run.engine.admit(admit)
        run.inbox.put(prefill)
    run.wait(lambda: len(run.done) == 3)
    ends = [run.done[i][0][0] for i in range(3)]
    assert max(run.computed.values()) < ends[0]  # computed while the first was on the link
    first_sent = min(run.sent.values())
    for k, (end, done) in enumerate(run.done[i][0] for i in range(3)):
        assert done.error is None
        assert done.link_ms >= 1e3 * done.sent_bytes / (gbps * 1e9)
        assert end - first_sent >= (k + 1) * 1e-9 * done.sent_bytes / gbps  # behind the others
        assert 0 <= done.queued_ms <= done.link_ms
    assert run.done[0][0][1].queued_ms == 0.0  # nothing before it on the link
    # each crossing starts once the one before it is acknowledged: they do not overlap
    crossings = [d.link_ms - d.queued_ms for _, d in (run.done[i][0] for i in range(3))]
    assert sum(crossings) <= 1e3 * (ends[-1] - first_sent)
    run.close()


def test_the_bytes_in_flight_are_bounded(monkeypatch):
    """With room for one handoff on the link and one held prompt, each handoff is handed over
    only once the one before it was acknowledged, and a prompt is computed only once the one
    held before it was sent."""
    warm(monkeypatch)
    run = Serving(monkeypatch, paced_gbps(), in_flight_bytes=1, held=1)
    prompts = []
    for i in range(3):
        admit, prefill = records(i)
        run.engine.admit(admit)
        run.inbox.put(prefill)
        prompts.append(tuple(prefill.tokens))
    run.wait(lambda: len(run.done) == 3)
    sent = [run.sent[f"req/{i}"] for i in range(3)]
    for i in (1, 2):
        assert sent[i] >= run.done[i - 1][0][0]  # back-pressure: after the verdicts before
        assert run.computed[prompts[i]] >= sent[i - 1]  # the held slot was freed first
    assert run.worker.in_flight_bytes == 0
    run.close()


def test_an_abort_ends_a_request_wherever_it_is_and_is_answered_once(monkeypatch):
    """Request 0 on the link, 1 computed and held, 2 queued behind it: each aborted is
    answered once with the abort's reason; 2 is never computed; an abort of a request the
    worker does not hold is ignored; request 3 is then served."""
    warm(monkeypatch)
    run = Serving(monkeypatch, paced_gbps() / 4, held=1)  # request 0 holds the link 4 LINK_S
    admits, prefills = zip(*(records(i) for i in range(4)), strict=True)
    run.engine.admit(admits[0])
    for p in prefills[:3]:
        run.inbox.put(p)
    run.wait(lambda: "req/0" in run.sent and tuple(prefills[1].tokens) in run.computed)
    for i in (2, 1, 0, 99):
        run.inbox.put(Abort(i, f"client {i} left"))
    run.engine.admit(admits[3])
    run.inbox.put(prefills[3])
    run.wait(lambda: len(run.done) == 4)
    time.sleep(4 * LINK_S)  # request 0's verdicts came meanwhile: never reported again
    assert sorted(run.done) == [0, 1, 2, 3]
    for i in range(3):
        (_, done), = run.done[i]
        assert done.error == f"client {i} left"
    (_, done), = run.done[3]
    assert done.error is None
    assert tuple(prefills[2].tokens) not in run.computed
    assert run.prefilled[2].compute_ms is None  # dropped before it was computed
    assert run.prefilled[1].compute_ms > 0 and run.prefilled[3].compute_ms > 0
    assert "req/1" not in run.sent
    run.close()


def test_a_request_for_no_decode_worker_fails_alone(monkeypatch):
    """A `Prefill` naming a decode worker it has no link to is answered with its error."""
    run = Serving(monkeypatch, None)
    _, prefill = records(0)
    run.inbox.put(dataclasses.replace(prefill, decode_worker=5))
    run.wait(lambda: 0 in run.done)
    assert run.done[0][0][1].error == "no decode worker 5"
    run.close()
