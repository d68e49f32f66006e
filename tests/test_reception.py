"""The decode side as a serving loop drives it: handoffs at any cut compile nothing once one cut
of each kind is warm, and one thread can advance several receptions of different modes at once,
each ending with the cache its mode's reference has."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import jax
import numpy as np
import pytest
from test_messages import transfer_server_pair

from rekv_jax import Action, ModelConfig, init_params
from rekv_jax.handoff.check import reference
from rekv_jax.handoff.payload import round_trip
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.handoff.receiver import TRANSITIONS, Reception, State, receive_handoff
from rekv_jax.handoff.sender import prepare, send_handoff
from rekv_jax.mode import Mode
from rekv_jax.transport import LocalTransport
from rekv_jax.transport.control import Board
from rekv_jax.transport.workers import LIVENESS_S

CFG = ModelConfig.preset("tiny")
SEQ = 32


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, SEQ), 0, CFG.vocab_size)
    return params, tokens


def local_pair(board: Board, monkeypatch=None) -> tuple[LocalTransport, LocalTransport]:
    return LocalTransport("prefill", board), LocalTransport("decode", board)


def handoff(links, params, tokens, mode: Mode, tag: str):
    """One handoff at `mode`, the prefill side (with its suffix checksums) on a thread."""
    send, recv = links
    state = prepare(CFG, params, tokens, mode, check_suffix=mode.joint)
    sender = threading.Thread(target=send_handoff, args=(send, state, mode, tag))
    sender.start()
    result = receive_handoff(recv, CFG, params, mode, 1, SEQ, tag)
    sender.join()
    return result


class CompileLog(logging.Handler):
    """The names of the programs XLA compiles while installed (jax_log_compiles' records)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.compiled: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.compiled.append(message.split(" ")[1])


def test_every_cut_reuses_the_programs_of_one_warm_cut(model):
    """After one handoff of each kind (a Q8 and a BF16 joint cut, a transfer, a recomputation),
    the handoffs at every other cut, both sides, the suffix checksums included, compile no new
    program: the prefix moves as per-layer buffers and the model runs one program per layer
    shape, so a planner or a serving loop may pick any cut per request."""
    params, tokens = model
    links = local_pair(Board())
    warm = ["q8:r=2", "bf16:r=2", "q8:full", "bf16:full", "bf16:recompute"]
    for i, text in enumerate(warm):
        handoff(links, params, tokens, Mode.of(Action.parse(text, CFG.num_layers)), f"w{i}")
    log, logger = CompileLog(), logging.getLogger("jax")
    logger.addHandler(log)
    try:
        with jax.log_compiles(True):
            for bits in (8, 16):
                for cut in range(1, CFG.num_layers):
                    mode = Mode.of(Action(bits, cut, CFG.num_layers))
                    result = handoff(links, params, tokens, mode, f"c{bits}-{cut}")
                    assert result.suffix_match is True, mode.label
    finally:
        logger.removeHandler(log)
    assert log.compiled == []


def _expected(params, tokens, mode: Mode):
    """The cache `[L, B, S, K, H]` a handoff of `mode` must hold: its reference, the prefix as
    the decode side restores it (bitwise the quantize round trip for Q8)."""
    kv, _ = reference(CFG, params, tokens, mode.reference, mode.action.cut)
    c = mode.action.cut
    prefix = round_trip(kv.layers(0, c), PrefixCodec.of(CFG, params, mode.action))
    return [np.asarray(x) for x in (*prefix.keys, *kv.keys[c:], *prefix.values, *kv.values[c:])]


@pytest.mark.parametrize("make", [local_pair, transfer_server_pair])
def test_one_thread_advances_three_receptions_of_different_modes(model, make, monkeypatch):
    """A Q8 overlapped handoff, a BF16 chunked one and a Q8 sequential one, started together and
    advanced in turn by this thread only (it blocks on nothing but their waitables): all three
    end with their reference's cache bitwise and their first token, over the in-process link and
    a real transfer server; each ends done, its watcher's threads joined as it finished."""
    params, tokens = model
    send, recv = make(Board(), monkeypatch)
    modes = [Mode.of(Action.parse("q8:r=3", CFG.num_layers)),
             Mode.of(Action.parse("bf16:r=2", CFG.num_layers), "chunked", chunks=4),
             Mode.of(Action.parse("q8:r=2", CFG.num_layers), "sequential")]
    states = [prepare(CFG, params, tokens, m) for m in modes]
    senders = [threading.Thread(target=send_handoff, args=(send, s, m, f"h{i}"))
               for i, (s, m) in enumerate(zip(states, modes, strict=True))]
    for t in senders:
        t.start()
    receptions = [Reception(recv, CFG, params, m, 1, SEQ, f"h{i}") for i, m in enumerate(modes)]
    for r in receptions:
        recv.agree(f"{r.tag}/go", {}, 60.0)
        r.start()
    done = [False] * len(receptions)
    while not all(done):
        done = [d or r.advance() for d, r in zip(done, receptions, strict=True)]
        pending = [f for d, r in zip(done, receptions, strict=True) if not d
                   for f in r.waitables()]
        concurrent.futures.wait(pending, LIVENESS_S, concurrent.futures.FIRST_COMPLETED)
    outcomes = [r.outcome() for r in receptions]
    for t in senders:
        t.join()
    assert [r.state for r in receptions] == [State.DONE] * len(receptions)
    assert not _watching(receptions)  # joined as each finished: none left behind
    for mode, state, out in zip(modes, states, outcomes, strict=True):
        got = [np.asarray(x) for x in (*out.kv.keys, *out.kv.values)]
        want = _expected(params, tokens, mode)
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), mode.label
        assert np.array_equal(np.asarray(out.first_token), np.asarray(state.first_token))


def _watching(receptions: list[Reception]) -> list[str]:
    """The live threads that watch the device work of `receptions`."""
    names = tuple(f"rekv-{r.tag}-watch-" for r in receptions)
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


def test_a_reception_moves_only_along_its_transitions(model):
    """New, receiving, joining, done; abandoned from anywhere not ended; nothing after an end. An
    abandoned reception's watcher threads end, and it is never advanced again."""
    params, _ = model
    send, recv = local_pair(Board())
    mode = Mode.of(Action.parse("q8:r=3", CFG.num_layers))
    reception = Reception(recv, CFG, params, mode, 1, SEQ, "moves")
    assert reception.state == State.NEW
    for state, allowed in TRANSITIONS.items():
        assert allowed <= set(State) and state not in allowed
    with pytest.raises(RuntimeError, match="cannot go from new to joining"):
        reception._move(State.JOINING)
    reception.start()
    assert reception.state == State.RECEIVING and not reception.advance()
    reception.abandon()
    assert reception.state == State.ABANDONED
    reception.abandon()  # an ended reception stays as it ended
    with pytest.raises(RuntimeError, match="cannot go from abandoned"):
        reception.start()
    deadline = time.monotonic() + 10
    while _watching([reception]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _watching([reception])
