"""The control channel's messages (headers, go-aheads, acks, metadata): write-once keys on a
`Board`, which one process shares between its two ends (`LocalTransport`) and two processes fill
over one direct TCP connection (`PeerSocket`), set up through the coordinator's key-value store.

A message is one frame on that connection (tens of microseconds on loopback), where a put or get
on the coordinator's store is a gRPC round trip through the process that hosts it. The listening
side (process 0) posts only its address in the store. The connection opens with a mutual
challenge-response over the job's key (`secret`): the connector sends a fresh nonce; the
listener answers with its own and its proof over both; the connector checks it and sends its
proof; the listener checks that. Each side proves it holds the key, no key bytes cross, and a
proof is good for that connection only; then the connection carries frames. A connection that
fails the exchange is closed and the listener waits for the next (see the threat model in
docs/reliability.md). Without a key (`--insecure`) the first connection is taken."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.transport import secret
from rekv_jax.transport.workers import LIVENESS_S

_HELLO_S = 5.0  # how long a connection that opened may take to prove it holds the key
PURPOSE = "control connection"  # the derived key the exchange uses (`JobKey.derive`)
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # hosts a one-machine run binds (loopback only)


class WrongKey(TransportError):
    """The other end of a control connection does not hold the job's key."""


class Board:
    """Write-once keys with a condition variable; values may be any object (in one process).
    `close(reason)` fails every wait for a key that has not come (whoever fills it is gone)."""

    def __init__(self) -> None:
        self._values: dict[str, object] = {}
        self._came: dict[str, float] = {}  # when each key was posted (time.monotonic)
        self._cond = threading.Condition()
        self.closed: str | None = None

    def put(self, key: str, value: object) -> None:
        """Post `value` under `key`; TransportError once closed (nothing lands on a dead link)."""
        with self._cond:
            if self.closed:
                raise TransportError(f"{self.closed} (posting {key!r})")
            if key in self._values:
                raise ValueError(f"{key!r} was already posted (tags must be unique)")
            self._values[key] = value
            self._came[key] = time.monotonic()
            self._cond.notify_all()

    def post(self, key: str, value: object) -> None:
        """`put`, dropped once closed (`base.Channel.post`); in-process it waits for nothing."""
        with contextlib.suppress(TransportError):
            self.put(key, value)

    def release(self, key: str) -> None:
        """Let go of the value under `key` (its key stays posted: write-once still holds)."""
        with self._cond:
            if key in self._values:
                self._values[key] = None

    def get(self, key: str, timeout: float) -> object:
        """The value under `key`; TransportTimeout after `timeout` s, TransportError once closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values or self.closed, timeout):
                raise TransportTimeout(f"nothing under {key!r} within {timeout:g}s")
            if key not in self._values:
                raise TransportError(f"{self.closed} (waiting for {key!r})")
            return self._values[key]

    def came_at(self, key: str) -> float:
        """When the value under `key` was posted here (time.monotonic; KeyError before)."""
        with self._cond:
            return self._came[key]

    def close(self, reason: str) -> None:
        with self._cond:
            self.closed = self.closed or reason
            self._cond.notify_all()

    def peer_alive(self) -> bool:
        return self.closed is None


class PeerSocket:
    """One TCP connection to the peer process: `send` writes a (key, value) frame; a reader thread
    puts each frame it receives on `board` and closes the board when the connection ends."""

    def __init__(self, sock: socket.socket, board: Board, gone: str) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._board = board
        self._gone = gone  # the board's closing reason when the connection ends
        self._lock = threading.Lock()  # one frame at a time (posts come from several threads)
        self._reader = threading.Thread(target=self._read, name="rekv-control", daemon=True)
        self._reader.start()

    def send(self, key: str, value: str) -> None:
        frame = json.dumps([key, value]).encode()
        try:
            with self._lock:
                self._sock.sendall(len(frame).to_bytes(4, "big") + frame)
        except OSError as e:
            raise TransportError(f"control connection failed sending {key!r}: {e}") from e

    def _read(self) -> None:
        try:
            while True:
                key, value = json.loads(_read_frame(self._sock))
                try:
                    self._board.put(key, value)
                except ValueError:  # both sides wrote one key: the first stays
                    pass
        except (OSError, EOFError, ValueError):
            self._board.close(self._gone)

    def close(self) -> None:
        """End the connection (the peer's reader sees it end; ours then stops)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer ended it first
        self._sock.close()


def _read_frame(sock: socket.socket) -> bytes:
    return _read_exactly(sock, int.from_bytes(_read_exactly(sock, 4), "big"))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return bytes(data)


def listen(host: str, port: int = 0) -> tuple[socket.socket, str]:
    """A listening socket on `port` of `host` (0: an ephemeral one), and its "host:port"
    address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    if port:  # a fixed port, bound again by the next run at once (not held in TIME_WAIT)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(4)
    port = listener.getsockname()[1]
    return listener, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def accept(listener: socket.socket, key: secret.JobKey | None, timeout: float,
           peer_alive: Callable[[], bool] = lambda: True, purpose: str = PURPOSE
           ) -> socket.socket:
    """The first connection to `listener` that proves it holds `key` (others are closed; None:
    the first connection); TransportTimeout after `timeout` s, TransportError once
    `peer_alive()` says the peer is gone (asked every `LIVENESS_S`). The proofs are keyed by
    `key.derive(purpose)`: a connection of another purpose (another pair of a group) fails."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(min(left, LIVENESS_S))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            if not peer_alive():
                raise TransportError("the peer is gone (before it opened the control "
                                     "connection)") from None
            continue
        try:
            sock.settimeout(min(_HELLO_S, max(0.1, deadline - time.monotonic())))
            if key is None or _listener_exchange(sock, key.derive(purpose)):
                return sock
        except (OSError, EOFError):
            pass
        sock.close()
    raise TransportTimeout(f"the peer did not open the control connection within {timeout:g}s")


def _listener_exchange(sock: socket.socket, key: bytes) -> bool:
    """The listening side's half of the challenge-response: whether the connector proved it
    holds `key` (having been shown that this side does)."""
    theirs = _read_exactly(sock, secret.NONCE_BYTES)
    nonces = theirs + secret.new_nonce()
    sock.sendall(nonces[secret.NONCE_BYTES:] + secret.prove(key, "listener", nonces))
    return secret.check(key, "connector", nonces, _read_exactly(sock, secret.PROOF_BYTES))


def connect(address: str, key: secret.JobKey | None, timeout: float, purpose: str = PURPOSE
            ) -> socket.socket:
    """Open the control connection to `address` ("host:port") and prove this side holds `key`
    once the listener proved it does (None: no exchange), both proofs keyed by
    `key.derive(purpose)`. TransportError if it cannot; WrongKey if the listener does not hold
    the key (or listens for another purpose)."""
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        if key is not None and not _connector_exchange(sock, key.derive(purpose)):
            sock.close()
            raise WrongKey(f"the control listener at {address} does not hold the job's key "
                           "(another job's, or not the peer)")
    except (OSError, EOFError) as e:
        raise TransportError(f"could not open the control connection to {address}: {e}") from e
    return sock


def _connector_exchange(sock: socket.socket, key: bytes) -> bool:
    """The connecting side's half: whether the listener proved it holds `key` (this side's
    proof is sent only then)."""
    mine = secret.new_nonce()
    sock.sendall(mine)
    nonces = mine + _read_exactly(sock, secret.NONCE_BYTES)
    if not secret.check(key, "listener", nonces, _read_exactly(sock, secret.PROOF_BYTES)):
        return False
    sock.sendall(secret.prove(key, "connector", nonces))
    return True
