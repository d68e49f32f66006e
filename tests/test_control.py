"""The control channel's direct connection (`transport.control`) and the collective's packed
buffers: frames arrive in order both ways, only the holder of the run's secret gets a connection,
a closed connection fails waits at once, and packing moves every bit."""

from __future__ import annotations

import os
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax.transport import JobKey, TransportError, TransportTimeout, checksums, control, secret
from rekv_jax.transport.collective import _packed, _unpacked


def connected_pair(key: JobKey | None = None) -> tuple[control.Board, control.PeerSocket,
                                                       control.Board, control.PeerSocket]:
    """Both ends of one control connection in this process: (board, socket) per end."""
    key = key or JobKey.new()
    listener, address = control.listen("127.0.0.1")
    with listener:
        opened = []
        opener = threading.Thread(target=lambda: opened.append(control.connect(address, key, 10)))
        opener.start()
        accepted = control.accept(listener, key, 10)
        opener.join(10)
    ends = []
    for sock in (accepted, opened[0]):
        board = control.Board()
        ends += [board, control.PeerSocket(sock, board, "peer gone")]
    return tuple(ends)


def test_frames_arrive_in_order_both_ways():
    board0, end0, board1, end1 = connected_pair()
    keys = [f"k{i}" for i in range(200)]
    for k in keys:
        end1.send(k, k.upper() * 50)  # frames of several hundred bytes back to back
    end0.send("back", "é ✓")  # any text
    assert [board0.get(k, 10) for k in keys] == [k.upper() * 50 for k in keys]
    assert board1.get("back", 10) == "é ✓"
    end0.close(), end1.close()


def test_a_closed_connection_fails_waits_at_once_and_keeps_what_came():
    board0, end0, board1, end1 = connected_pair()
    end1.send("came", "1")
    assert board0.get("came", 10) == "1"
    start = time.monotonic()
    threading.Timer(0.2, end1.close).start()
    with pytest.raises(TransportError, match="peer gone .*'never'"):
        board0.get("never", 30)
    assert time.monotonic() - start < 5  # not the timeout
    assert not board0.peer_alive()
    assert board0.get("came", 0) == "1"
    end0.close()


def test_nothing_lands_on_a_closed_board():
    """An in-process link that is gone takes no more values, as a dead peer's socket does: a
    put fails, a post is dropped, and a wait for either fails."""
    board = control.Board()
    board.put("came", 1)
    board.close("the prefill side is gone")
    with pytest.raises(TransportError, match="the prefill side is gone .*'late'"):
        board.put("late", 2)
    board.post("posted", 3)
    for key in ("late", "posted"):
        with pytest.raises(TransportError, match="the prefill side is gone"):
            board.get(key, 10)
    assert board.get("came", 0) == 1


def test_only_holders_of_the_key_open_a_connection_and_no_key_bytes_cross():
    key = JobKey.new()
    derived = key.derive(control.PURPOSE)
    listener, address = control.listen("127.0.0.1")
    seen: dict[str, object] = {}
    with listener:

        def strangers_then_peer() -> None:
            with pytest.raises(TransportError, match="does not hold the job's key"):
                control.connect(address, JobKey.new(), 10)  # another job's key
            with socket.create_connection(address.rsplit(":", 1)) as raw:  # no key: a guess
                raw.settimeout(5)
                raw.sendall(os.urandom(secret.NONCE_BYTES))
                seen["listener said"] = raw.recv(4096)
                raw.sendall(os.urandom(secret.PROOF_BYTES))
                seen["then"] = raw.recv(1)
            seen["peer"] = control.connect(address, key, 10)

        opener = threading.Thread(target=strangers_then_peer)
        opener.start()
        accepted = control.accept(listener, key, 10)
        opener.join(10)
    said = seen["listener said"]
    assert len(said) == secret.NONCE_BYTES + secret.PROOF_BYTES  # its nonce and its proof
    assert key.secret not in said and derived not in said
    assert seen["then"] == b""  # a wrong proof: closed at once
    seen["peer"].sendall(b"x")
    accepted.settimeout(5)
    assert accepted.recv(1) == b"x"
    for sock in (accepted, seen["peer"]):
        sock.close()


def test_a_listener_without_the_key_gets_no_proof():
    """A connector checks the listener's proof before it sends its own: a listener that does
    not hold the key learns nothing it could replay."""
    listener, address = control.listen("127.0.0.1")
    got = {}

    def fake_listener() -> None:
        sock, _ = listener.accept()
        with sock:
            got["nonce"] = sock.recv(4096)
            sock.sendall(os.urandom(secret.NONCE_BYTES + secret.PROOF_BYTES))
            sock.settimeout(5)
            got["after"] = sock.recv(4096)

    with listener:
        faker = threading.Thread(target=fake_listener)
        faker.start()
        with pytest.raises(TransportError, match="does not hold the job's key"):
            control.connect(address, JobKey.new(), 10)
        faker.join(10)
    assert len(got["nonce"]) == secret.NONCE_BYTES and got["after"] == b""


def test_accept_times_out_when_nobody_connects_and_stops_once_the_peer_is_gone():
    listener, _ = control.listen("127.0.0.1")
    with listener, pytest.raises(TransportTimeout, match="control connection"):
        control.accept(listener, JobKey.new(), 0.3)
    listener, _ = control.listen("127.0.0.1")
    start = time.monotonic()
    with listener, pytest.raises(TransportError, match="gone"):
        control.accept(listener, JobKey.new(), 30, peer_alive=lambda: False)
    assert time.monotonic() - start < 5  # within a liveness slice, not the timeout


def test_packed_buffers_unpack_to_the_same_bits():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, (3, 5), dtype=np.uint16)
    buffers = (jnp.asarray(bits.view(jnp.bfloat16)),  # every bf16 pattern, NaNs included
               jnp.asarray(rng.standard_normal((2, 7)), jnp.float16),
               jnp.asarray(rng.integers(-2**31, 2**31 - 1, (4,)), jnp.int32),
               jnp.asarray(rng.integers(0, 256, (2, 3, 2)), jnp.uint8),
               jnp.asarray(rng.integers(-128, 128, (5,)), jnp.int8),
               jnp.asarray(rng.integers(0, 2**32 - 1, (3,), dtype=np.uint64), jnp.uint32))
    flat = _packed(list(buffers))
    assert flat.dtype == jnp.uint8 and flat.shape == (sum(b.nbytes for b in buffers),)
    like = tuple((b.shape, b.dtype.name) for b in buffers)
    unpacked, sums = _unpacked(flat, like)
    for got, want in zip(unpacked, buffers, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    # the checksums the program computes of all but the last are the host's, bit for bit
    assert np.asarray(sums).tolist() == checksums(list(buffers[:-1]))
