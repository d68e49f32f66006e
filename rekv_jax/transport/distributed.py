"""jax.distributed for the handoff's processes: bounded-failure setup, the control channel between
two processes (`PeerChannel`), and an ordered shutdown. JAX's private modules are reached
through `rekv_jax.jax_private` only. A pair is two processes; a group (`launch.group`) is N, where
each (prefill, decode) pair of processes has a channel of its own.

What JAX does when a peer dies (jax 0.10): the coordination service lives in process 0.
If process 0 dies, the JAX client in process 1 aborts its process at once ("Terminating process
because the JAX distributed service detected fatal errors"), whatever we do. If process 1 dies,
process 0 is aborted too after the heartbeat timeout, unless `jax_enable_recoverability` is on;
with it on, process 0 lives on and shuts down at once. Process 0 leaving first, even normally,
aborts process 1. Hence the decode side (whose result matters, and which may fall back to
recomputation) is process 0 by default, recoverability is on, and a leaving process 0 waits for
process 1 to disconnect first. `get_live_nodes` is a barrier (it returns once every live task has
called it), so it serves that wait but not as a liveness probe: the channel keeps its own beat.
With N processes (jax 0.10.2, recoverability on): a process other than 0 that dies
or leaves disturbs nobody else, and no leave waits for the others (there is no shutdown
barrier); so any process may leave once its own channels are closed, and process 0 leaves last,
after waiting (bounded) until every other one disconnected.

JAX's client aborts its process (a C++ fatal error and stack) on any error it detects: a
coordinator that never answers, or one that went away. `initialize` hands the client an error
callback instead (`jax_private.client_errors_recorded`), which records the error, so that
connecting fails with a TransportError. Once connected, an error still aborts (see
`SERVICE_HEARTBEAT_S`), so the service is never asked to judge liveness: a peer lost later is
reported by `PeerChannel` like any other dead peer. A prefill side first waits (bounded) for
the coordinator's port to open, so an unreachable coordinator is a one-line error. What the
coordinator's store holds is public: each control connection's address and each process's
heartbeat; the job's key never enters it (`control`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import jax

from rekv_jax import jax_private
from rekv_jax.errors import TransportError, TransportTimeout, first_line
from rekv_jax.transport import control
from rekv_jax.transport.base import Role
from rekv_jax.transport.secret import JobKey
from rekv_jax.transport.workers import LIVENESS_S

# The decode side hosts the coordination service so that it survives the prefill side's death.
DEFAULT_PROCESS_ID: dict[Role, int] = {"decode": 0, "prefill": 1}
_PREFIX = "rekv/"


# How long JAX's coordination service waits for a process's heartbeat before it declares the
# process dead, and the time a leaving client waits for the service. Once connected, a JAX client
# aborts its process on any error the service reports (jaxlib 0.10 cannot hand the error to the
# Python callback: the call throws std::bad_cast), and a process the service declared dead gets
# one: a live process stalled that long (a paused VM, a starved core) would be killed, and with
# process 0 both would. So the service's timeout is JAX's own default, far above any stall;
# whether a peer is alive is this module's to judge (`PeerChannel`: its beat, its connection).
SERVICE_HEARTBEAT_S = 100
SERVICE_SHUTDOWN_S = 10

_client_error: list[str] = []  # what JAX's client reported (set from its own threads)


def _record_client_error(status: object) -> None:
    """JAX client error callback, in place of its default one that aborts the process. (jaxlib
    0.10 cannot pass the status to Python: the call then fails inside `connect`, which raises.)"""
    _client_error.append(first_line(str(status)))


def wait_for_port(address: str, timeout: float) -> None:
    """Return once `host:port` accepts TCP connections; TransportTimeout after `timeout` s."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"the coordinator {address} did not answer within "
                                       f"{timeout:g}s (is the decode side running?)") from None
            time.sleep(0.2)


def initialize(coordinator: str | None, process_id: int | None, *, init_timeout_s: int = 60,
               num_processes: int = 2) -> None:
    """`jax.distributed.initialize` for `num_processes` processes (a pair: two), with gloo CPU
    collectives and recoverability on. `coordinator=None` lets JAX detect the cluster (SLURM,
    Open MPI, ...). TransportError (not an abort) if a peer or the coordinator is not there in
    time. The service's heartbeat timeout is `SERVICE_HEARTBEAT_S`."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    start = time.monotonic()
    if coordinator is not None and process_id != 0:
        wait_for_port(coordinator, init_timeout_s)
    init_timeout_s = max(1, round(init_timeout_s - (time.monotonic() - start)))
    # JAX's coordination service binds every interface by default; a loopback coordinator (one
    # machine, `launch.group.loopback`) keeps it to loopback
    host = coordinator.rsplit(":", 1)[0].strip("[]") if coordinator else None
    bind = coordinator if host in control.LOOPBACK else None
    try:
        with jax_private.client_errors_recorded(_record_client_error):
            jax.distributed.initialize(
                coordinator, num_processes if coordinator else None, process_id,
                initialization_timeout=init_timeout_s,
                heartbeat_timeout_seconds=SERVICE_HEARTBEAT_S,
                shutdown_timeout_seconds=SERVICE_SHUTDOWN_S, coordinator_bind_address=bind,
            )
    except RuntimeError as e:  # JaxRuntimeError, or the callback's own error while connecting
        if not isinstance(e, jax.errors.JaxRuntimeError) and "bad_cast" not in str(e):
            raise  # misuse (e.g. JAX already started), not a missing peer
        state = jax_private.distributed_state()
        with contextlib.suppress(RuntimeError):
            if state.service is not None:
                state.service.shutdown()
        state.client = state.service = None  # nothing left for JAX's exit hook to shut down
        if num_processes == 2:
            who = f"the {'prefill' if process_id == 0 else 'decode'} side"
        else:
            who = f"not all {num_processes} processes of the group"
        raise TransportError(f"{who} did not join {coordinator or 'the cluster'} "
                             f"within {init_timeout_s}s") from e


def check_processes(n: int = 2) -> None:
    """ValueError unless the cluster is the `n` processes of a handoff (a pair: 2) or of a
    group (this starts JAX's backend: `cores.start_device` first)."""
    if jax.process_count() != n:
        what = "a handoff" if n == 2 else "this group"
        raise ValueError(f"{what} needs exactly {n} processes, JAX reports {jax.process_count()}")


def local_ip() -> str:
    """This host's address on the route to the coordinator (no packet is sent)."""
    host = jax_private.distributed_state().coordinator_address.rsplit(":", 1)[0].strip("[]")
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


class _Beat:
    """This process's heartbeat (`rekv/beat/<process id>` in the store), bumped every
    `interval` s from one daemon thread while any channel of this process is open: the first
    channel starts it, the last one to stop stops it. Each peer reads it (`PeerChannel.peer_alive`),
    so a process beats once whatever its number of channels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0  # the channels of this process that have not stopped
        self._stop = threading.Event()

    def join(self, client: object, process_id: int, interval: float) -> None:
        with self._lock:
            self._open += 1
            if self._open == 1:
                self._stop = threading.Event()
                threading.Thread(target=_beat, args=(client, process_id, interval, self._stop),
                                 name="rekv-beat", daemon=True).start()

    def leave(self) -> bool:
        """One channel stopped; whether it was this process's last (the beat then stops)."""
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._stop.set()
            return self._open == 0


def _beat(client: object, process_id: int, interval: float, stop: threading.Event) -> None:
    n = 0
    while True:
        n += 1
        try:
            client.key_value_set(f"{_PREFIX}beat/{process_id}", str(n), allow_overwrite=True)
        except jax.errors.JaxRuntimeError:
            return  # the service is gone (JAX ends this process) or shutting down
        if stop.wait(interval):
            return


_beat_of_process = _Beat()
_gone: set[int] = set()  # the processes a channel of this process found gone


class PeerChannel:
    """The control channel between this process and `peer_id` (None: the other of exactly two):
    messages over one direct connection (`control.PeerSocket`), which the coordinator's
    key-value store only helps set up; liveness and the ordered leave (`shutdown`) through the
    store.

    Of a pair, the lower process id listens and posts its address; the connector reads it and
    connects; both prove they hold the job's key. The two-process link uses the store key
    `rekv/control` and the proofs' purpose `control.PURPOSE`; a pair of a group
    (`peer_id` given) uses its own, `rekv/control/<low>-<high>` and that purpose with the pair
    appended, so a connection proves it is of that pair.

    Liveness: this process beats (`_Beat`); the peer counts as gone once its beat has not
    changed for `stale_s`, or at once when its end of the connection closed (a process that
    died). A dead peer is this channel's only: other channels of the process keep working.
    (`get_live_nodes` cannot serve: it is a barrier that returns only once every live task has
    called it.) Waits are sliced so that a dead peer is reported instead of waited out."""

    def __init__(self, key: JobKey | None, stale_s: float = 10.0, timeout: float = 60.0,
                 peer_id: int | None = None) -> None:
        self._client = jax_private.distributed_state().client
        if self._client is None:
            raise ValueError("jax.distributed is not initialized")
        self.process_id = jax.process_index()
        self.peer_id = 1 - self.process_id if peer_id is None else peer_id
        low, high = sorted((self.process_id, self.peer_id))
        pair = "" if peer_id is None else f"{low}-{high}"
        self._store_key = f"{_PREFIX}control" + (pair and f"/{pair}")
        self._purpose = control.PURPOSE + (pair and f" {pair}")
        self._stale_s = stale_s
        self._peer_beat: str | None = None
        self._peer_beat_at = self._looked_at = time.monotonic()
        _beat_of_process.join(self._client, self.process_id, stale_s / 5)
        self._board = control.Board()
        try:
            sock = self._open(key, timeout)
        except BaseException:
            _beat_of_process.leave()
            raise
        self._socket = control.PeerSocket(sock, self._board, f"the peer process {self.peer_id} "
                                          "is gone (its control connection closed)")

    def _open(self, key: JobKey | None, timeout: float) -> socket.socket:
        """The listener (the lower process id) listens where the coordinator routes (loopback
        on one machine) and posts its address, and nothing else, in the store; the connector
        reads it and connects. Both prove they hold `key` (`control`)."""
        if self.process_id < self.peer_id:
            listener, address = control.listen(local_ip())
            with listener:
                self._client.key_value_set(self._store_key, address)
                return control.accept(listener, key, timeout, self.peer_alive, self._purpose)
        deadline = time.monotonic() + timeout
        while True:  # the store's own wait, in slices that check the peer's beat
            try:
                address = self._client.blocking_key_value_get(
                    self._store_key,
                    max(1, int(1000 * min(LIVENESS_S, deadline - time.monotonic()))))
                return control.connect(address, key, timeout, self._purpose)
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e) or time.monotonic() >= deadline:
                    raise TransportError(f"the peer process {self.peer_id} did not open the "
                                         f"control channel within {timeout:g}s: {e}") from e
            if not self.peer_alive():
                raise TransportError(f"the peer process {self.peer_id} is gone (before the "
                                     "control channel opened)")

    def put(self, key: str, value: str) -> None:
        """Send `key` to the peer (write-once; it does not wait for the peer to read it)."""
        self._board.put(key, value)
        self._socket.send(key, value)

    def post(self, key: str, value: str) -> None:
        """`put`, where a failed send is dropped (the peer's wait then finds this side gone)."""
        with contextlib.suppress(TransportError):
            self.put(key, value)

    def came_at(self, key: str) -> float:
        return self._board.came_at(key)

    def get(self, key: str, timeout: float) -> str:
        """The value the peer sent under `key` (or this side did)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._board.get(key, min(LIVENESS_S, max(0.0, deadline - time.monotonic())))
            except TransportTimeout:
                pass
            if not self.peer_alive():
                raise TransportError(f"the peer process {self.peer_id} is gone "
                                     f"(no heartbeat for {self._stale_s:g}s; waiting for {key!r})")
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"nothing under {key!r} within {timeout:g}s")

    def peer_alive(self) -> bool:
        """Whether the peer lives; one found gone is recorded (`wait_others_left` does not wait
        for it)."""
        alive = self._peer_alive()
        if not alive:
            _gone.add(self.peer_id)
        return alive

    def _peer_alive(self) -> bool:
        if _client_error or not self._board.peer_alive():  # the service or the connection
            return False  # told us the peer is gone
        try:
            beat = self._client.key_value_try_get(f"{_PREFIX}beat/{self.peer_id}")
        except jax.errors.JaxRuntimeError:  # not beating yet, or the service is gone
            beat = None
        now = time.monotonic()
        # a beat unchanged since this process last looked `stale_s` or more ago says nothing of
        # the peer: this process was not looking (idle, or itself stalled: a paused VM pauses
        # both); the peer's silence is timed from this look
        if beat != self._peer_beat or now - self._looked_at >= self._stale_s:
            self._peer_beat, self._peer_beat_at = beat, now
        self._looked_at = now
        return now - self._peer_beat_at < self._stale_s

    def stop(self) -> bool:
        """End the connection (after the ordered leave's messages); whether this was the
        process's last open channel (its beat then stops)."""
        self._socket.close()
        return _beat_of_process.leave()


def wait_others_left(timeout: float) -> None:
    """Process 0: return once every other process not known to be gone has shut its JAX client
    down, or after `timeout`. `get_live_nodes` blocks until then; a daemon thread keeps the wait
    bounded. A process found gone (`PeerChannel.peer_alive`) is not waited for: the service
    would count it live until its heartbeat timeout (`SERVICE_HEARTBEAT_S`)."""
    client = jax_private.distributed_state().client
    everyone = [p for p in range(jax.process_count()) if p not in _gone]

    def wait() -> None:
        with contextlib.suppress(jax.errors.JaxRuntimeError):
            client.get_live_nodes(everyone)

    waiter = threading.Thread(target=wait, name="rekv-leave", daemon=True)
    waiter.start()
    waiter.join(timeout)


def shutdown(channel: PeerChannel, timeout: float) -> None:
    """Leave in order: both ends send 'close' and wait (bounded) for the other's, then end the
    connection. The last channel of a process then leaves jax.distributed: process 0 after
    waiting (bounded) until every other process has, since a JAX client whose coordinator
    vanishes aborts its process."""
    deadline = time.monotonic() + timeout
    try:
        channel.put(f"close/{channel.process_id}", "1")
        channel.get(f"close/{channel.peer_id}", max(0.0, deadline - time.monotonic()))
    except TransportError:  # the peer is gone or stuck: leave anyway
        channel.peer_alive()  # (a gone one is not waited for: `wait_others_left`)
    if not channel.stop():
        return
    if channel.process_id == 0:
        wait_others_left(max(0.0, deadline - time.monotonic()))
    jax.distributed.shutdown()
