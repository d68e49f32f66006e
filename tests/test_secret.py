"""The job's key against a stranger: a third process that reads every key of the coordinator's
store cannot join the control connection or pull a buffer, and the run goes on unharmed; the
store holds no secret. And a peer that dies before it opens the control connection is reported
by the listening side's liveness check within a heartbeat, not at the timeout."""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from store_reader import read_dir

from rekv_jax.launch.group import Job, loopback, run_child, run_pair
from rekv_jax.transport import ROLES, JobKey, TransportError, control, distributed, secret
from rekv_jax.transport.transfer_server import _uuid, pull_key

PAYLOAD = np.arange(4096, dtype=np.float32).reshape(64, 64)
TAG = "secret"
WAIT_S = 120.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.05)


def attacked_side(side, folder: str) -> bool | None:
    """One side of a run with a stranger about: the prefill side joins the coordinator, then
    lets the stranger try to join the control connection first (`joined`); it sends one buffer
    and tells where its transfer server is; the decode side receives it once the stranger tried
    to pull it (`pulled`) and says whether it arrived intact."""
    import jax

    if side.role == "prefill":  # the backends start together: theirs exchange topologies
        distributed.initialize(side.coordinator, 1, init_timeout_s=int(WAIT_S))
        jax.devices()
        _wait_for(Path(folder, "joined"))
    t = side.link("transfer-server", timeout=WAIT_S)
    if side.role == "prefill":
        t.send(TAG, [jax.device_put(PAYLOAD)], timeout=WAIT_S)
        side.emit(t._server.address())  # where a stranger who scanned the ports would pull
        t.wait_ack(TAG, timeout=WAIT_S)
        t.close()
        return None
    _wait_for(Path(folder, "pulled"))
    (got,) = t.recv(TAG, [jax.ShapeDtypeStruct(PAYLOAD.shape, PAYLOAD.dtype)],
                    timeout=WAIT_S).result(WAIT_S)
    intact = bool(np.array_equal(np.asarray(got), PAYLOAD))
    t.close()
    return intact


def stranger_joins(coordinator: str) -> tuple[dict[str, bytes], list[str]]:
    """The store as a stranger reads it once the decode side listens, and how each attempt to
    join the control connection ended: with a key made of each value it read, and by hand."""
    distributed.wait_for_port(coordinator, WAIT_S)  # the coordinator may not be up yet
    deadline = time.monotonic() + WAIT_S
    while "rekv/control" not in (store := read_dir(coordinator, "rekv")):
        if time.monotonic() > deadline:
            raise TimeoutError("the decode side never posted its control address")
        time.sleep(0.1)
    address = store["rekv/control"].decode()
    outcomes = []
    for value in store.values():
        try:
            control.connect(address, JobKey(value), 5).close()
            outcomes.append("joined")
        except TransportError:
            outcomes.append("refused")
    with socket.create_connection(address.rsplit(":", 1), timeout=5) as raw:
        raw.sendall(os.urandom(secret.NONCE_BYTES))
        raw.recv(secret.NONCE_BYTES + secret.PROOF_BYTES)
        raw.sendall(store["rekv/control"][:secret.PROOF_BYTES].ljust(secret.PROOF_BYTES, b"0"))
        outcomes.append("joined" if raw.recv(1) else "refused")
    return store, outcomes


def stranger_pulls(server: str, keys: list[bytes]) -> list[bool]:
    """Whether a pull of the buffer, its id keyed by each of `keys`, brought anything within a
    few seconds (the stranger knows the buffer's tag and shape)."""
    import jax
    from jax.experimental import transfer
    from jax.sharding import SingleDeviceSharding

    device = jax.devices()[0]
    own = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
    link = own.connect(server)
    spec = jax.ShapeDtypeStruct(PAYLOAD.shape, PAYLOAD.dtype, sharding=SingleDeviceSharding(device))
    pulls = [link.pull(_uuid(TAG, key), [spec])[0] for key in keys]
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not any(p.is_ready() for p in pulls):
        time.sleep(0.1)
    return [p.is_ready() for p in pulls]


def test_a_stranger_who_reads_the_store_cannot_join_or_pull_and_the_run_goes_on(tmp_path):
    key, coordinator, servers = JobKey.new(), loopback(), queue.Queue()
    found: dict[str, object] = {}

    def stranger() -> None:  # beside the run, in processes of its own
        try:
            found["store"], found["joins"] = run_child(
                stranger_joins, coordinator, env=os.environ, what="the stranger", timeout=WAIT_S)
            (tmp_path / "joined").touch()
            candidates = [pull_key(None), pull_key(JobKey.new()),
                          *(pull_key(JobKey(v)) for v in found["store"].values())]
            found["pulls"] = run_child(stranger_pulls, servers.get(timeout=WAIT_S), candidates,
                                       env=os.environ, what="the stranger", timeout=WAIT_S)
        finally:
            (tmp_path / "joined").touch()
            (tmp_path / "pulled").touch()

    thread = threading.Thread(target=stranger)
    thread.start()
    intact = run_pair(attacked_side, str(tmp_path), envs={r: dict(os.environ) for r in ROLES},
                      key=key, coordinator=coordinator, on_item=servers.put, grace=WAIT_S)
    thread.join(WAIT_S)
    assert intact is True  # the run is unharmed: its buffer arrived bit for bit
    store = found["store"]
    assert set(store) == {"rekv/control"} | {k for k in store if k.startswith("rekv/beat/")}
    for value in store.values():  # public data only: an address and heartbeat counts
        for secret_bytes in (key.secret, key.derive(control.PURPOSE), pull_key(key)):
            assert secret_bytes not in value and secret_bytes.hex().encode() not in value
    assert found["joins"] == ["refused"] * len(found["joins"])
    assert found["pulls"] == [False] * len(found["pulls"])


def dies_before_control(side) -> tuple[str, float] | None:
    """The prefill side joins the coordinator and dies before it opens the control connection;
    the decode side, listening for it, says when it found out, and how."""
    if side.role == "prefill":  # joined, its backend started (the decode side's waits for it)
        distributed.initialize(side.coordinator, 1, init_timeout_s=int(WAIT_S))
        import jax

        jax.devices()
        os.kill(os.getpid(), 9)
    start = time.monotonic()
    with pytest.raises(TransportError) as gone:
        side.link("transfer-server", timeout=WAIT_S, heartbeat_s=2)
    return str(gone.value), time.monotonic() - start


def test_a_peer_that_dies_before_the_control_connection_is_seen_within_a_heartbeat():
    with Job.pair(dies_before_control, (), {r: dict(os.environ) for r in ROLES},
                  key=JobKey.new(), coordinator=loopback(), grace=WAIT_S) as pair:
        ended = pair.wait(timeout=2 * WAIT_S)
    assert ended["prefill-0"].exitcode == -9
    said, seconds = ended["decode-0"].value
    assert "gone (before it opened the control connection)" in said, said
    assert seconds < 2 + 10 < WAIT_S  # its heartbeat's staleness (2 s) plus start-up, not 120 s


STALL_S = 12.0  # past the beat's staleness (2 s) and past a 10 s service heartbeat


def stalled_side(side, folder: str) -> bool | None:
    """Both sides link, then wait on nothing of the other's while the test stops the decode side
    (process 0, which hosts the coordination service) for `STALL_S`; then one buffer crosses,
    and the decode side says whether it arrived intact."""
    import jax

    link = side.link("transfer-server", timeout=WAIT_S, heartbeat_s=2)
    Path(folder, f"{side.role}.pid").write_text(str(os.getpid()))
    _wait_for(Path(folder, "resumed"))
    if side.role == "prefill":
        link.send(TAG, [jax.device_put(PAYLOAD)], timeout=WAIT_S)
        link.wait_ack(TAG, timeout=WAIT_S)
        link.close(WAIT_S)
        return None
    (got,) = link.recv(TAG, [jax.ShapeDtypeStruct(PAYLOAD.shape, PAYLOAD.dtype)],
                       timeout=WAIT_S).result(WAIT_S)
    link.close(WAIT_S)
    return bool(np.array_equal(np.asarray(got), PAYLOAD))


def test_a_side_stalled_past_a_heartbeat_is_not_taken_for_dead(tmp_path):
    """A paused VM or a starved core stalls a live process: once it resumes, neither side takes
    the other for dead, no JAX client aborts its process, and the run completes intact."""
    with Job.pair(stalled_side, (str(tmp_path),), {r: dict(os.environ) for r in ROLES},
                  key=JobKey.new(), coordinator=loopback(), grace=WAIT_S) as pair:
        for role in ROLES:
            _wait_for(tmp_path / f"{role}.pid")
        decode = int((tmp_path / "decode.pid").read_text())
        os.kill(decode, signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
        finally:
            os.kill(decode, signal.SIGCONT)
        (tmp_path / "resumed").touch()
        assert pair.close(timeout=2 * WAIT_S) is True
