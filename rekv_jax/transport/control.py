"""The control channel's messages (headers, go-aheads, acks, metadata): write-once keys on a
`Board`, which one process shares between its two ends (`LocalTransport`) and two processes fill
over one direct TCP connection (`PeerSocket`), set up through the coordinator's key-value store.

A message is one frame on that connection (tens of microseconds on loopback), where a put or get
on the coordinator's store is a gRPC round trip (0.3-0.5 ms measured here) through the process
that hosts it. The connection is authenticated by a per-run secret that the listening side
(process 0) posts in the store next to its address: a process that reaches the port but not the
coordinator cannot send a message (see the threat model in docs/reliability.md)."""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.transport.workers import LIVENESS_S

SECRET_BYTES = 16
_HELLO_S = 5.0  # how long a connection that opened may take to present the secret


class Board:
    """Write-once keys with a condition variable; values may be any object (in one process).
    `close(reason)` fails every wait for a key that has not come (whoever fills it is gone)."""

    def __init__(self) -> None:
        self._values: dict[str, object] = {}
        self._cond = threading.Condition()
        self.closed: str | None = None

    def put(self, key: str, value: object) -> None:
        with self._cond:
            if key in self._values:
                raise ValueError(f"{key!r} was already posted (tags must be unique)")
            self._values[key] = value
            self._cond.notify_all()

    post = put  # in-process, a put does not wait for anything

    def get(self, key: str, timeout: float) -> object:
        """The value under `key`; TransportTimeout after `timeout` s, TransportError once closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values or self.closed, timeout):
                raise TransportTimeout(f"nothing under {key!r} within {timeout:g}s")
            if key not in self._values:
                raise TransportError(f"{self.closed} (waiting for {key!r})")
            return self._values[key]

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


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def listen(host: str) -> tuple[socket.socket, str]:
    """A listening socket on an ephemeral port of `host`, and its "host:port" address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    return listener, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def accept(listener: socket.socket, secret: bytes, timeout: float,
           peer_alive: Callable[[], bool] = lambda: True) -> socket.socket:
    """The first connection to `listener` that presents `secret` (others are closed);
    TransportTimeout after `timeout` s, TransportError once `peer_alive()` says the peer is gone
    (asked every `LIVENESS_S`)."""
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
            if hmac.compare_digest(_read_frame(sock), secret):
                return sock
        except (OSError, EOFError):
            pass
        sock.close()
    raise TransportTimeout(f"the peer did not open the control connection within {timeout:g}s")


def connect(address: str, secret: bytes, timeout: float) -> socket.socket:
    """Open the control connection to `address` ("host:port") and present `secret`."""
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        sock.sendall(len(secret).to_bytes(4, "big") + secret)
    except OSError as e:
        raise TransportError(f"could not open the control connection to {address}: {e}") from e
    return sock
