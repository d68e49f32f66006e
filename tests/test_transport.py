"""Transports: the protocol in-process (LocalTransport), then both real transports with two OS
processes on loopback, including injected faults (corruption, mismatch, a peer killed mid-transfer).
"""

from __future__ import annotations

import os
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transport_worker import COMPUTE_S, PACED_S, main, sleep_side

from rekv_jax.launch.child import role_of
from rekv_jax.launch.group import Job, loopback, run_child
from rekv_jax.transport import (
    ROLES,
    JobKey,
    LocalTransport,
    Paced,
    TransportError,
    TransportTimeout,
    checksums,
    connect,
    distributed,
)
from rekv_jax.transport.checksums import _checksums_and_word, _host_checksums
from rekv_jax.transport.control import Board
from rekv_jax.transport.workers import LIVENESS_S

REAL_KINDS = ["transfer-server", "collective"]


def prefix_payload(rows: int = 8) -> list[jax.Array]:
    rng = np.random.default_rng(1)
    return [jnp.asarray(rng.standard_normal((2, rows, 16)), jnp.bfloat16),  # h_c [B, S, D]
            jnp.asarray(rng.integers(0, 256, (2, 3, 2, rows, 2, 4)), jnp.uint8),
            jnp.asarray(rng.standard_normal((2, 3, 2, rows, 2)), jnp.float16)]


def specs(arrays: list[jax.Array]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def flip_byte(x: jax.Array, index: int, mask: int) -> jax.Array:
    host = np.array(x)
    host.view(np.uint8).reshape(-1)[index] ^= mask
    return jnp.asarray(host)


# -- checksum --------------------------------------------------------------------------------

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8, jnp.uint8, jnp.int32]
SHAPES = [(3,), (2, 5), (4, 3, 2)]


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16),
       where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_checksum_detects_any_single_byte_change(dtype, shape, seed, where, mask):
    x = jnp.asarray(np.random.default_rng(seed).integers(0, 100, shape), dtype)
    index = int(where * x.nbytes)
    assert checksums([x]) != checksums([flip_byte(x, index, mask)])


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([*DTYPES, jnp.bool_]), shape=st.sampled_from([*SHAPES, (0,), (7,)]),
       seed=st.integers(0, 2**16))
def test_host_checksums_are_the_device_programs_bit_for_bit(dtype, shape, seed):
    """CPU buffers are summed by numpy (no program to compile), accelerator buffers by the jitted
    program: the two give the same words (odd sizes padded alike, bools as bytes)."""
    rng = np.random.default_rng(seed)
    xs = [jnp.asarray(rng.integers(0, 100, shape), dtype),
          jnp.asarray(rng.integers(0, 2**16, (3, 5), dtype=np.uint16).view(jnp.bfloat16))]
    host = _host_checksums(xs)
    assert checksums(xs) == host  # CPU devices here: the host path
    assert np.asarray(_checksums_and_word(xs, 12345)).tolist() == [*host, 12345]


def test_checksum_is_position_weighted_sum_of_words():
    words = np.array([7, 0, 2**32 - 1], np.uint32)
    expected = (7 * 1 + 0 * 3 + (2**32 - 1) * 5) % 2**32
    assert checksums([jnp.asarray(words)]) == [expected]
    assert checksums([jnp.asarray(words[::-1].copy())]) != [expected]  # order matters


# -- protocol, in-process ---------------------------------------------------------------------

def test_local_roundtrip_is_exact_and_acknowledged():
    prefill, decode = LocalTransport.pair()
    sent = prefix_payload()
    arrival = decode.recv("p", specs(sent), timeout=10)  # a future: nothing blocks here
    assert not arrival.done()
    prefill.send("p", sent)
    got = arrival.result(timeout=10)
    for g, s in zip(got, sent, strict=True):
        assert g.dtype == s.dtype and np.array_equal(np.asarray(g), np.asarray(s))
    assert arrival.landed is not None and arrival.settled_at is not None
    prefill.wait_ack("p", timeout=10)
    decode.send_meta("result", {"first_token": 3})
    assert prefill.recv_meta("result", timeout=10) == {"first_token": 3}


def test_receives_settle_in_order_and_a_failed_one_holds_up_no_other():
    """Messages received in the order sent: a mismatched one fails on both sides, the ones
    around it arrive and are acknowledged."""
    prefill, decode = LocalTransport.pair()
    sent = prefix_payload()
    arrivals = [decode.recv("a", specs(sent), timeout=10),
                decode.recv("d", specs(prefix_payload(rows=8)), timeout=10),
                decode.recv("b", specs(sent), timeout=10)]
    prefill.send("a", sent)
    prefill.send("d", prefix_payload(rows=7))
    prefill.send("b", sent)
    assert arrivals[0].result(timeout=10) and arrivals[2].result(timeout=10)
    with pytest.raises(ValueError, match="prefill sent buffers"):
        arrivals[1].result(timeout=10)
    prefill.wait_ack("a", timeout=10)
    prefill.wait_ack("b", timeout=10)
    with pytest.raises(ValueError, match="decode expects"):
        prefill.wait_ack("d", timeout=10)


def test_an_abandoned_receive_ends_before_its_deadline():
    prefill, decode = LocalTransport.pair()
    never = decode.recv("never", specs(prefix_payload()), timeout=60)
    later = decode.recv("later", specs(prefix_payload()), timeout=60)
    prefill.send("later", prefix_payload())
    t0 = time.monotonic()
    never.abandon()
    with pytest.raises(TransportError, match="abandoned"):
        never.result(timeout=10)
    assert later.result(timeout=10) and time.monotonic() - t0 < 5


def test_shape_mismatch_raises_on_both_sides():
    prefill, decode = LocalTransport.pair()
    prefill.send("p", prefix_payload(rows=7))
    with pytest.raises(ValueError, match="prefill sent buffers"):
        decode.recv("p", specs(prefix_payload(rows=8)), timeout=10).result(timeout=10)
    with pytest.raises(ValueError, match="decode expects"):
        prefill.wait_ack("p", timeout=10)


def test_corrupted_payload_raises_on_both_sides():
    prefill, decode = LocalTransport.pair()
    original = prefill._send
    prefill._send = lambda tag, buffers, header, deadline: original(
        tag, [buffers[0], flip_byte(buffers[1], 17, 0x01), *buffers[2:]], header, deadline)
    sent = prefix_payload()
    prefill.send("p", sent)
    with pytest.raises(TransportError, match=r"checksum mismatch in buffer\(s\) \[1\]"):
        decode.recv("p", specs(sent), timeout=10).result(timeout=10)
    with pytest.raises(TransportError, match="checksum mismatch"):
        prefill.wait_ack("p", timeout=10)


def test_agree_names_every_disagreeing_field_on_both_sides():
    prefill, decode = LocalTransport.pair()
    errors = {}

    def side(t, meta):
        try:
            t.agree("run", meta, timeout=10)
        except ValueError as e:
            errors[t.role] = str(e)

    other = threading.Thread(target=side, args=(prefill, {"cut": 2, "bits": 8, "seq_len": 64}))
    other.start()
    side(decode, {"cut": 3, "bits": 4, "seq_len": 64})
    other.join(10)
    assert set(errors) == {"prefill", "decode"}
    for message in errors.values():
        assert "cut" in message and "bits" in message and "seq_len" not in message


def test_waits_time_out():
    prefill, decode = LocalTransport.pair()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        decode.recv("never", specs(prefix_payload()), timeout=0.2).result(timeout=10)
    with pytest.raises(TransportError, match="nothing under 'never/header'"):
        prefill.wait_ack("never", timeout=10)  # the decode side told it why
    with pytest.raises(TransportTimeout):
        prefill.wait_ack("unheard", timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_bad_use_raises_value_error():
    prefill, decode = LocalTransport.pair()
    with pytest.raises(ValueError, match="prefill-side"):
        decode.send("p", prefix_payload())
    with pytest.raises(ValueError, match="decode-side"):
        prefill.recv("p", [], timeout=1)
    with pytest.raises(ValueError, match="at least one dimension"):
        prefill.send("p", [jnp.float32(1.0)])
    with pytest.raises(ValueError, match="unknown transport"):
        connect("carrier-pigeon", "decode", key=None)
    with pytest.raises(ValueError, match="role"):
        connect("collective", "encode", key=None)
    prefill.close()
    with pytest.raises(TransportError, match="closed"):
        prefill.send("q", prefix_payload())


def test_pacing_emulates_a_fifo_link():
    """Two messages on a paced link: each takes n / W after the later of its landing and the
    one before it, so both take 2 n / W from their send, and not much more."""
    gbps, nbytes = 0.01, 2_000_000  # 0.2 s per transfer
    sent = [jnp.zeros((nbytes,), jnp.uint8)]
    warm, cold = LocalTransport.pair()  # checksum outside the timing (host memory: numpy)
    warm.send("p", sent)
    cold.recv("p", specs(sent), timeout=60).result(timeout=60)
    prefill, decode = LocalTransport.pair(link_gbps=gbps)
    assert isinstance(decode, Paced)
    first, second = (decode.recv(t, specs(sent), timeout=10) for t in ("p", "q"))
    t0 = time.monotonic()
    prefill.send("p", sent)
    prefill.send("q", sent)
    first.result(timeout=10)
    assert 0.2 <= time.monotonic() - t0 <= 0.35
    second.result(timeout=10)
    assert 0.4 <= time.monotonic() - t0 <= 0.6  # queued behind the first on the link
    assert prefill.sent_bytes == 2 * nbytes  # what the link carried
    with pytest.raises(ValueError, match="positive"):
        LocalTransport.pair(link_gbps=0)


# -- two real processes on loopback -----------------------------------------------------------

def run_workers(kind: str, scenario: str) -> dict:
    """Both ends of `scenario`; returns {role: (exit code, events or None, output)}."""
    with Job.pair(main, (kind, scenario), {role: dict(os.environ) for role in ROLES},
                  key=JobKey.new(), coordinator=loopback()) as pair:
        ended = pair.wait(timeout=120)
    return {role_of(name): (e.exitcode, e.value, e.log[-3000:] + e.traceback)
            for name, e in ended.items()}


@pytest.mark.parametrize("kind", REAL_KINDS)
def test_two_processes_protocol_and_injected_faults(kind):
    result = run_workers(kind, "protocol")
    for role in ("prefill", "decode"):
        code, events, stderr = result[role]
        assert code == 0, stderr
        assert events["agree"][0] == "ok"
        assert events["disagree"][0] == "ValueError" and "cut" in events["disagree"][1]
        assert events["phase"][0] == "ok"  # received bit-exact (checked by the decode worker)
        assert events["corrupt"][0] == "TransportError"
        assert "checksum mismatch in buffer(s) [1]" in events["corrupt"][1]
        assert events["truncated"][0] == "ValueError" and "[2, 7, 16]" in events["truncated"][1]
        assert events["after"][0] == "ok"  # the link survives the failed phases
        assert events["prefetched"][0] == "ok"
        assert events["close"][0] == "ok"
    seconds = result["decode"][1]["prefetched"][1]
    # the first message, the compute, then the second, which moved during the compute: every
    # message is received from the start
    assert PACED_S + COMPUTE_S <= seconds < 1.5 * PACED_S + COMPUTE_S, seconds
    assert result["prefill"][1]["meta"] == ["ok", {"first_token": 5}]


@pytest.mark.parametrize("kind", REAL_KINDS)
def test_prefill_killed_mid_transfer_gives_decode_a_prompt_error(kind):
    result = run_workers(kind, "kill-prefill")
    assert result["prefill"][0] == -9
    code, events, stderr = result["decode"]
    assert code == 0, stderr
    outcome, message = events["recv"]
    assert outcome == "TransportError", message
    assert float(message.rsplit("[", 1)[1].rstrip("s]")) < 15  # ~ one heartbeat, not the timeout
    assert events["close"][0] == "ok" and events["close"][1] < 15


def test_decode_killed_ends_prefill_without_hanging():
    # The decode side hosts the coordination service: JAX aborts the prefill process once it is
    # gone. The property is that nothing hangs (run_pair would raise TimeoutError).
    result = run_workers("transfer-server", "kill-decode")
    assert result["decode"][0] == -9
    assert result["prefill"][0] != 0


def _children() -> set[int]:
    """This process's child processes (Linux)."""
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(pid) for pid in f.read().split()}


def test_launched_processes_are_killed_past_their_timeout():
    before = _children()
    with pytest.raises(TimeoutError, match=r"^decode-0 and prefill-0 still running after 3 s "
                                          r"\(killed\)$"):
        with Job.pair(sleep_side, (600,), {role: dict(os.environ) for role in ROLES},
                      key=None) as pair:
            pair.wait(timeout=3)
    with pytest.raises(TimeoutError, match=r"^napping: still running after 3 s \(killed\)$"):
        run_child(time.sleep, 600, env=os.environ, what="napping", timeout=3)
    assert _children() <= before  # nothing stays behind


class _Beats:
    """A store whose only key is the peer's beat, as the test sets it."""

    def __init__(self) -> None:
        self.beat = "1"

    def key_value_try_get(self, key: str) -> str:
        return self.beat


def test_a_peer_is_gone_only_after_a_silence_this_process_watched(monkeypatch):
    """A beat unchanged for `stale_s` while this process looks (every `LIVENESS_S`, as its waits
    do) is a gone peer, and recorded; a beat unchanged across a stretch in which this process
    did not look (it was idle, or itself stalled) is timed from the next look."""
    clock = [0.0]
    monkeypatch.setattr(distributed, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(distributed, "_gone", set())
    channel = object.__new__(distributed.PeerChannel)
    channel._board, channel._client, channel._stale_s, channel.peer_id = Board(), _Beats(), 2.0, 7
    channel._peer_beat, channel._peer_beat_at = "1", 0.0  # seen at 0 s, unchanged since
    channel._looked_at = 0.0

    clock[0] = 30.0  # this process did not look for 30 s: the silence is timed from now
    assert channel.peer_alive()
    looks = []
    while channel.peer_alive():
        clock[0] += LIVENESS_S
        looks.append(clock[0])
    assert looks[-1] - 30.0 == pytest.approx(2.0)  # gone after `stale_s` of watched silence
    assert distributed._gone == {7}

    distributed._gone.clear()
    channel._board, channel._client.beat = Board(), "2"
    for _ in range(20):  # a beat that changes between looks: alive however long
        clock[0] += LIVENESS_S
        channel._client.beat = str(int(channel._client.beat) + 1)
        assert channel.peer_alive()
    assert not distributed._gone
