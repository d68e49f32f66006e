"""The fixed cost per message stays down: the control messages of one phase are counted, waits
do not sleep-poll, and no thread is started per handoff. (How fast that is, is measured by
scripts/bench_messages.py, not asserted here.)"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
import weakref
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax import init_params
from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.receiver import Reception, receive_handoff
from rekv_jax.handoff.sender import prepare, send_handoff
from rekv_jax.mode import Mode
from rekv_jax.transport import (
    JobKey,
    LocalTransport,
    TransportError,
    TransportTimeout,
    distributed,
)
from rekv_jax.transport.control import Board
from rekv_jax.transport.transfer_server import TransferServerTransport
from rekv_jax.transport.verdicts import Verdicts
from rekv_jax.transport.workers import LIVENESS_S, Watchdog, Worker, wait_for

# one phase, both sides: the header posted by the prefill side, then the ack posted by the decode
# side and collected at the end; no go-ahead, no separate checksums (they travel with the
# buffers). The transfer server reads the header only when its pull brought other buffers.
ONE_PHASE = {"post header": 1, "get header": 1, "post ack": 1, "get ack": 1}
PULL_FIRST = {"post header": 1, "post ack": 1, "get ack": 1}


class CountingBoard(Board):
    """A Board that counts each operation on a phase's control keys by (operation, last part)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def _count(self, op: str, key: str) -> None:
        if key.startswith("p/") and not key.endswith("/payload"):  # payload: LocalTransport's data
            self.counts[f"{op} {key.rsplit('/', 1)[1]}"] += 1

    def put(self, key, value):
        self._count("put", key)
        super().put(key, value)

    def post(self, key, value):
        self._count("post", key)
        super().put(key, value)

    def get(self, key, timeout):
        self._count("get", key)
        return super().get(key, timeout)


def payload(rows: int = 8) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((2, rows, 16)), jnp.bfloat16),
            jnp.asarray(rng.integers(0, 256, (3, rows, 4)), jnp.uint8)]


def specs(arrays):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def local_pair(board: Board) -> tuple[LocalTransport, LocalTransport]:
    return LocalTransport("prefill", board), LocalTransport("decode", board)


def transfer_server_pair(board: Board, monkeypatch) -> tuple[TransferServerTransport, ...]:
    """Both ends of a real transfer server in this process, with a Board as their channel."""
    monkeypatch.setattr(distributed, "local_ip", lambda: "127.0.0.1")
    key = JobKey.new()
    prefill = TransferServerTransport("prefill", board, key)
    return prefill, TransferServerTransport("decode", board, key)


def no_sleeping(*_):
    raise AssertionError("a transport wait slept (sleep-polling is back)")


@pytest.mark.parametrize("make", [local_pair, transfer_server_pair])
def test_a_phase_is_one_header_and_one_posted_ack_and_no_wait_sleeps(make, monkeypatch):
    board = CountingBoard()
    prefill, decode = make(board, monkeypatch) if make is transfer_server_pair else make(board)
    sent = payload()
    monkeypatch.setattr(time, "sleep", no_sleeping)
    prefill.send("p", sent)
    got = decode.recv("p", specs(sent), timeout=30).result(timeout=30)
    prefill.wait_ack("p", timeout=30)
    for g, s in zip(got, sent, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(s))
    pulls_first = isinstance(decode, TransferServerTransport)
    assert board.counts == (PULL_FIRST if pulls_first else ONE_PHASE)


@pytest.mark.parametrize("make", [local_pair, transfer_server_pair])
def test_failed_phases_cost_no_extra_message(make, monkeypatch):
    board = CountingBoard()
    prefill, decode = make(board, monkeypatch) if make is transfer_server_pair else make(board)
    reshaped = [payload()[0].reshape(2, 16, 8), payload()[1]]  # the same bytes, other specs
    for tag, sent in (("p", payload(rows=7)), ("p/1", reshaped)):  # mismatched specs
        board.counts.clear()
        prefill.send(tag, sent)
        with pytest.raises(ValueError, match="decode expects"):
            decode.recv(tag, specs(payload()), timeout=30).result(timeout=30)
        with pytest.raises(ValueError, match="decode expects"):
            prefill.wait_ack(tag, timeout=30)
        assert board.counts == ONE_PHASE

    board.counts.clear()
    original = prefill._send

    def corrupt(tag, buffers, header, deadline):
        host = np.array(buffers[1])
        host.reshape(-1)[3] ^= 1
        original(tag, [buffers[0], jnp.asarray(host), *buffers[2:]], header, deadline)

    prefill._send = corrupt
    prefill.send("p/2", payload())
    with pytest.raises(TransportError, match=r"checksum mismatch in buffer\(s\) \[1\]"):
        decode.recv("p/2", specs(payload()), timeout=30).result(timeout=30)
    with pytest.raises(TransportError, match="checksum mismatch"):
        prefill.wait_ack("p/2", timeout=30)
    pulls_first = isinstance(decode, TransferServerTransport)
    assert board.counts == (PULL_FIRST if pulls_first else ONE_PHASE)


def test_no_thread_is_started_inside_a_handoff(monkeypatch):
    """The threads a handoff waits on are made before its interval starts: the transport's
    receive worker once, a reception's watchers of its device work when it is made; the
    reception's end ends its watchers, and `close` ends the transport's worker."""
    cfg = ModelConfig.preset("tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size, jnp.int32)
    mode = Mode.of(Action.parse("bf16:r=2", cfg.num_layers))  # the prefix beside the suffix
    prefill, decode = LocalTransport.pair()
    state = prepare(cfg, params, tokens, mode)
    reps = 4
    sender = threading.Thread(target=lambda: [
        send_handoff(prefill, state, mode, f"h{i}", timeout=60) for i in range(reps)])
    sender.start()
    receive_handoff(decode, cfg, params, mode, 1, 16, "h0", timeout=60)  # warm

    def no_new_threads(self):
        raise AssertionError(f"thread {self.name} started inside a handoff")

    for i in range(1, reps):
        reception = Reception(decode, cfg, params, mode, 1, 16, f"h{i}", timeout=60)
        decode.agree(f"h{i}/go", {}, 60)
        monkeypatch.setattr(threading.Thread, "start", no_new_threads)
        reception.start()
        while not reception.advance():
            concurrent.futures.wait(reception.waitables(), LIVENESS_S,
                                    concurrent.futures.FIRST_COMPLETED)
        reception.outcome()
        monkeypatch.undo()
    sender.join(60)
    deadline = time.monotonic() + 10
    while any(t.name.startswith("rekv-h") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a done reception's watcher threads still run"
        time.sleep(0.01)
    worker = decode._worker._thread
    assert worker.is_alive()
    decode.close()
    worker.join(10)
    assert not worker.is_alive()


def test_a_stuck_job_is_abandoned_and_later_jobs_still_run():
    worker = Worker("test")
    release = threading.Event()
    stuck = worker.submit(release.wait)
    with pytest.raises(TransportTimeout):
        wait_for(stuck, time.monotonic() + 0.2, lambda: True, "stuck")
    with pytest.raises(TransportError, match="peer process is gone"):
        wait_for(stuck, time.monotonic() + 30, lambda: False, "stuck")
    worker.abandon()
    assert wait_for(worker.submit(lambda: 7), time.monotonic() + 30, lambda: True, "next") == 7
    release.set()
    assert stuck.result(timeout=10) is True
    worker.close()
    with pytest.raises(TransportError, match="closed"):
        worker.submit(lambda: None)


def test_a_handoffs_verdicts_are_held_until_its_last_message_and_failures_are_not():
    posted = []
    verdicts = Verdicts(lambda tag, verdict: posted.append((tag, verdict)))

    def give(tag, verdict):  # its receive is settled before any verdict crosses
        verdicts.give(tag, verdict, lambda: posted.append((tag, "settled")))

    for tag in ("h/a", "h/b", "h/c", "g/a"):
        verdicts.expect(tag)
    give("h/a", "ok")
    give("g/a", "ok")  # another handoff's: its last
    assert posted == [("h/a", "settled"), ("g/a", "settled"), ("g/a", "ok")]
    give("h/b", "error: lost")  # a failure crosses at once
    assert posted[-2:] == [("h/b", "settled"), ("h/b", "error: lost")]
    give("h/c", "ok")  # the handoff's last: its held "ok"s follow
    assert posted[-3:] == [("h/c", "settled"), ("h/a", "ok"), ("h/c", "ok")]
    verdicts.expect("k/a")
    verdicts.expect("k/b")
    give("k/a", "ok")
    verdicts.flush()  # closing: nothing is kept back
    assert posted[-1] == ("k/a", "ok")


def test_the_transfer_servers_verdicts_cross_once_the_handoff_is_received(monkeypatch):
    """Two messages of one handoff: the first's "ok" is not on the channel while the second is
    being received; both are once it has been, and the sender's waits end."""
    board = CountingBoard()
    prefill, decode = transfer_server_pair(board, monkeypatch)
    first, second = payload(), payload(rows=4)
    arrivals = [decode.recv("p/a", specs(first), timeout=30),
                decode.recv("p/b", specs(second), timeout=30)]
    prefill.send("p/a", first)
    arrivals[0].result(timeout=30)
    assert board.counts["post ack"] == 0
    prefill.send("p/b", second)
    arrivals[1].result(timeout=30)
    prefill.wait_ack("p/a", timeout=30)
    prefill.wait_ack("p/b", timeout=30)
    assert board.counts["post ack"] == 2


def test_the_watchdog_forgets_a_receive_once_it_completes():
    """What a completed receive holds (its buffers) is not kept until the watchdog next looks."""

    class Buffers:
        pass

    watchdog = Watchdog("test-watchdog", lambda: True)
    future = concurrent.futures.Future()
    expired = []
    watchdog.add(future, time.monotonic() + 60, "x", None, expired.append)
    held = Buffers()
    alive = weakref.ref(held)
    future.set_result(held)
    del held, future
    gc.collect()
    assert alive() is None and expired == []
    watchdog.close()


def test_the_watchdog_expires_a_receive_past_its_deadline():
    watchdog = Watchdog("test-watchdog", lambda: True)
    future, expired = concurrent.futures.Future(), []
    start = time.monotonic()
    watchdog.add(future, start + 0.2, "x", None, expired.append)
    while not expired and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert isinstance(expired[0], TransportTimeout)
    assert time.monotonic() - start < 2  # at its deadline, not a liveness slice later
    watchdog.close()
