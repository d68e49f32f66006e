"""The handoff's link, shared by every transport: buffers with their checksums one way, the
decode side's verdicts (acks) and metadata both ways.

A message (a tag: the boundary, the prefix, a chunk of either) moves as a few device buffers
from the prefill side to the decode side, with their checksums as one more buffer, computed on
the sender's device and ended by a word of the buffers' specs (`checksums.spec_word`). The
sender posts the specs as a header too; a subclass says how the buffers move and when the
header is read (`_send`, `_receive`).

  prefill                                        decode
  send(tag, buffers): hand them to the link      recv(tag, specs) -> Arrival (a future), at once
  ... its other messages ...                     the transport receives, checksums and compares
  wait_ack(tag): the decode side's verdict       on its own threads; the verdict is posted back
  (or forget(tag): no longer wanted)             ("ok", "mismatch: ...", "error: ...")

`recv` never blocks its caller: it starts the receive and returns an `Arrival`, which completes
with the verified buffers, or fails with ValueError (the sender's buffers are not the specs) or
TransportError (corrupted, lost, the peer gone, the time up). A caller receives the messages of
a handoff in the order they were sent, so a transport (and a paced link, `paced.Paced`) may
handle them first in, first out. Every wait is bounded and checks every `LIVENESS_S` that the
peer is alive; the threads a transport waits on are made with it (`Worker`), never per message.
Control messages (headers, verdicts, metadata) go through a `Channel`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.transport.checksums import (
    checksums_buffer,
    checksums_spec,
    spec_word,
    verdict_collect,
    verdict_dispatch,
)
from rekv_jax.transport.workers import LIVENESS_S, Watchdog, Worker

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


class Channel(Protocol):
    """Control plane between the two processes: small string values under write-once keys."""

    def put(self, key: str, value: str) -> None: ...

    def post(self, key: str, value: str) -> None:
        """`put` without waiting for it to land (in order with the other posts). A post that
        fails is dropped: the peer's wait for it then times out or finds this side gone."""
        ...

    def get(self, key: str, timeout: float) -> str:
        """The value under `key`; TransportTimeout after `timeout` s, TransportError if the peer is
        known to be gone."""
        ...

    def came_at(self, key: str) -> float:
        """When the value under `key` reached this side (time.monotonic), once `get` gave it."""
        ...

    def peer_alive(self) -> bool: ...


def peer_of(role: Role) -> Role:
    """The other side's role (ValueError for an unknown role)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return "decode" if role == "prefill" else "prefill"


def mismatch_text(tag: str, sent: list, expected: list) -> str:
    """The error both sides raise when the sender's buffer specs are not the receiver's."""
    return f"{tag}: prefill sent buffers {sent}, decode expects {expected}"


def spec_of(x: jax.Array | jax.ShapeDtypeStruct) -> list:
    """JSON form of a buffer's shape and dtype, e.g. `[[2, 4, 8], "bfloat16"]`."""
    return _spec(x.shape, x.dtype)


def _spec(shape: tuple[int, ...], dtype: jnp.dtype) -> list:
    return [list(shape), jnp.dtype(dtype).name]


@functools.lru_cache(maxsize=256)
def _header(specs: tuple[tuple[tuple[int, ...], jnp.dtype], ...]) -> tuple[str, int]:
    """The header of buffers of these (shape, dtype)s (their `spec_of`s as JSON) and its
    `spec_word`: made once per list of buffer shapes, not per message."""
    text = json.dumps([_spec(shape, dtype) for shape, dtype in specs])
    return text, spec_word(text)


def _header_of(buffers: Sequence[jax.Array | jax.ShapeDtypeStruct]) -> tuple[str, int]:
    """(the header, its spec word) of buffers or specs (`_header`)."""
    return _header(tuple((tuple(b.shape), b.dtype) for b in buffers))


def link_bytes(specs: Sequence[jax.ShapeDtypeStruct]) -> int:
    """The bytes of a message on its busiest link: the largest per receiving device (a sharded
    side receives on one link per device), without the checksums."""
    per_device: dict[object, int] = {}
    for s in specs:
        sharding = getattr(s, "sharding", None)  # a host (numpy) buffer has none
        key = None if sharding is None else frozenset(sharding.device_set)
        per_device[key] = per_device.get(key, 0) + s.size * jnp.dtype(s.dtype).itemsize
    return max(per_device.values(), default=0)


class Arrival(concurrent.futures.Future):
    """The future of one message's verified buffers (decode side). `landed` is when its bytes
    reached this side (time.monotonic; None until known), which a paced link times from;
    `nbytes` what they weigh on the busiest link (`link_bytes`). `abandon()` tells the
    transport nobody waits for it any more (a failed handoff's other messages), so that a receive
    whose bytes never come holds up no later one."""

    def __init__(self, tag: str, nbytes: int, deadline: float) -> None:
        super().__init__()
        self.tag, self.nbytes, self.deadline = tag, nbytes, deadline
        self.landed: float | None = None
        self.settled_at: float | None = None  # when it completed (time.perf_counter)
        self.abandoned = threading.Event()
        self.add_done_callback(_note_settled)

    def abandon(self) -> None:
        self.abandoned.set()


class Transport(Protocol):
    """One end of a prefill -> decode link (see the module docstring): what the handoff uses.
    `Endpoint` implements it over a channel; `paced.Paced` and `mesh.MeshTransport` wrap one."""

    role: Role
    peer: Role
    kind: str
    sent_bytes: int

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None: ...

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0
             ) -> Arrival: ...

    def wait_ack(self, tag: str, timeout: float = 60.0) -> float:
        """Prefill side: wait for the decode side's verdict on `tag`; when it reached this side
        (time.monotonic). Raises the verdict's error (ValueError, TransportError)."""
        ...

    def forget(self, tag: str) -> None: ...

    def send_meta(self, tag: str, meta: dict[str, Any]) -> None: ...

    def recv_meta(self, tag: str, timeout: float = 60.0) -> dict[str, Any]: ...

    def agree(self, tag: str, meta: dict[str, Any], timeout: float = 60.0) -> None: ...

    def peer_alive(self) -> bool: ...

    def close(self, timeout: float = 10.0) -> None: ...


class Wrapper:
    """A `Transport` over another (`paced.Paced`, `mesh.MeshTransport`): everything is the
    wrapped transport's unless a subclass says otherwise."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.role, self.peer, self.kind = transport.role, transport.peer, transport.kind

    @property
    def sent_bytes(self) -> int:
        return self._transport.sent_bytes

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        self._transport.send(tag, arrays, timeout)

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0
             ) -> Arrival:
        return self._transport.recv(tag, specs, timeout)

    def wait_ack(self, tag: str, timeout: float = 60.0) -> float:
        return self._transport.wait_ack(tag, timeout)

    def forget(self, tag: str) -> None:
        self._transport.forget(tag)

    def send_meta(self, tag: str, meta: dict[str, Any]) -> None:
        self._transport.send_meta(tag, meta)

    def recv_meta(self, tag: str, timeout: float = 60.0) -> dict[str, Any]:
        return self._transport.recv_meta(tag, timeout)

    def agree(self, tag: str, meta: dict[str, Any], timeout: float = 60.0) -> None:
        self._transport.agree(tag, meta, timeout)

    def peer_alive(self) -> bool:
        return self._transport.peer_alive()

    def close(self, timeout: float = 10.0) -> None:
        self._transport.close(timeout)

    def __enter__(self) -> Wrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Endpoint:
    """A `Transport` over a control `Channel`: the protocol every transport shares (headers,
    checksums, verdicts, metadata); a subclass moves the buffers (`_send`, `_receive`). Tags
    are unique per message; the decode side receives a handoff's messages in the order they
    were sent."""

    kind: str = ""  # its name in TRANSPORTS and on the command line

    def __init__(self, role: Role, channel: Channel) -> None:
        self.role = role
        self.peer = peer_of(role)
        self._channel = channel
        self._closed = False
        self.sent_bytes = 0  # prefill side: bytes of every buffer handed to the link so far

    # -- buffers -------------------------------------------------------------------------------

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        """Prefill side: hand `arrays` to the link as message `tag`, with their checksums
        (computed on their device meanwhile) and a header of their specs. Returns once the
        transport holds them; adds their bytes to `sent_bytes`. The decode side's verdict comes
        back through `wait_ack`."""
        self._require("prefill", "send")
        arrays = list(arrays)
        if not arrays:
            raise ValueError(f"{tag}: nothing to send")
        for i, a in enumerate(arrays):
            if a.ndim < 1:
                raise ValueError(f"{tag}: buffer {i} must have at least one dimension")
        header, word = _header_of(arrays)
        sums = checksums_buffer(arrays, word)
        self._send(tag, [*arrays, sums], header, time.monotonic() + timeout)
        self.sent_bytes += sum(a.nbytes for a in arrays)

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0
             ) -> Arrival:
        """Decode side: start receiving message `tag`, expected as `specs`; its `Arrival`."""
        self._require("decode", "recv")
        specs = list(specs)
        arrival = Arrival(tag, link_bytes(specs), time.monotonic() + timeout)
        self._receive(arrival, specs, [*specs, checksums_spec(specs)])
        return arrival

    def wait_ack(self, tag: str, timeout: float = 60.0) -> float:
        """Prefill side: block until the decode side confirms `tag` arrived intact, and return
        when its verdict came (time.monotonic); raise its error otherwise (ValueError for
        mismatched buffers, TransportError for a failed transfer)."""
        self._require("prefill", "wait_ack")
        ack = self._channel.get(f"{tag}/ack", timeout)
        self._acked(tag)
        if ack.startswith("mismatch: "):
            raise ValueError(ack.removeprefix("mismatch: "))
        if ack != "ok":
            raise TransportError(f"decode side failed to receive {tag}: {ack}")
        return self._channel.came_at(f"{tag}/ack")

    def forget(self, tag: str) -> None:
        """Prefill side: nobody waits for `tag`'s verdict any more (its handoff was aborted):
        the transport lets go of its buffers now; a verdict that comes later is never read."""
        self._require("prefill", "forget")
        self._acked(tag)

    # -- for the subclasses: the decode side's verdict ----------------------------------------

    def _verify(self, arrival: Arrival, arrays: list[jax.Array], sums: jax.Array,
                expected: list[jax.ShapeDtypeStruct]) -> bool:
        """Checksum landed buffers and compare with the sender's (and the spec word with the
        expected specs'); post the verdict and settle `arrival`. False if the spec word
        differs (other buffers than expected, of the same bytes: the caller reads the header,
        then calls `_settle`)."""
        got, want = verdict_collect(verdict_dispatch(arrays, sums))
        return self._judge(arrival, arrays, got, want, expected)

    def _judge(self, arrival: Arrival, arrays: list[jax.Array], got: list[int],
               want: list[int], expected: list[jax.ShapeDtypeStruct]) -> bool:
        """`_verify` from the checksums of the landed buffers (`got`) and the sender's with its
        spec word (`want`): a transport whose own program computed `got` calls this."""
        got = [*got, _header_of(expected)[1]]
        if got[-1] != want[-1]:
            return False
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        if bad:
            self._settle(arrival, error=TransportError(
                f"{arrival.tag}: checksum mismatch in buffer(s) {bad}: corrupted payload"))
        else:
            self._settle(arrival, arrays)
        return True

    def _get(self, arrival: Arrival, key: str) -> Any:
        """The channel's value under `key` for `arrival`'s receive: by its deadline, in slices
        that stop once it is abandoned (TransportError)."""
        while True:
            try:
                return self._channel.get(key, min(LIVENESS_S, _left(arrival.deadline)))
            except TransportTimeout:
                if arrival.abandoned.is_set():
                    raise TransportError(f"{arrival.tag}: abandoned (its handoff failed)") from None
                if not _left(arrival.deadline):
                    raise

    def _bound(self, arrival: Arrival, worker: Worker, watchdog: Watchdog,
               stuck: Callable[[], None] | None = None) -> None:
        """Have `watchdog` settle `arrival` with the error of its deadline, of its peer gone or
        of its abandonment, should one come before `worker` (receiving it) settles it; that
        worker is then left to its stuck job (later receives get a fresh thread) and `stuck`
        is called."""

        def expire(error: TransportError) -> None:
            if arrival.done():  # the worker settled it meanwhile
                return
            worker.abandon()
            self._settle(arrival, error=error)
            if stuck is not None:
                stuck()

        watchdog.add(arrival, arrival.deadline, arrival.tag, arrival.abandoned, expire)

    def _check_header(self, arrival: Arrival, expected: list) -> bool:
        """Read the header of `arrival`'s message; settle it with a ValueError (and tell the
        sender) if its specs are not `expected`. Whether they match."""
        sent = json.loads(self._get(arrival, f"{arrival.tag}/header"))
        if sent == expected:
            return True
        msg = mismatch_text(arrival.tag, sent, expected)
        self._verdict(arrival.tag, "mismatch: " + msg, lambda: _fail(arrival, ValueError(msg)))
        return False

    def _settle(self, arrival: Arrival, arrays: list[jax.Array] | None = None,
                error: BaseException | None = None) -> None:
        """Post the verdict of `arrival`'s message and complete it."""
        if error is None:
            self._verdict(arrival.tag, "ok", lambda: _complete(arrival, arrays))
        else:
            self._verdict(arrival.tag, f"error: {error}", lambda: _fail(arrival, error))

    # -- metadata ------------------------------------------------------------------------------

    def send_meta(self, tag: str, meta: dict[str, Any]) -> None:
        """Post a JSON-able dict for the peer (either direction); does not wait."""
        self._channel.put(f"{tag}/meta/{self.role}", json.dumps(meta))

    def recv_meta(self, tag: str, timeout: float = 60.0) -> dict[str, Any]:
        """The dict the peer posted under `tag`."""
        return json.loads(self._channel.get(f"{tag}/meta/{self.peer}", timeout))

    def agree(self, tag: str, meta: dict[str, Any], timeout: float = 60.0) -> None:
        """Both sides call this with what they believe (config hash, cut, bits, seq_len, ...);
        both raise ValueError naming every field on which they disagree."""
        self.send_meta(tag, meta)
        theirs = self.recv_meta(tag, timeout)
        mine = json.loads(json.dumps(meta))  # compare in JSON form (tuples -> lists)
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k} ({self.role} {mine.get(k)!r}, {self.peer} {theirs.get(k)!r})"
                               for k in diff)
            raise ValueError(f"{tag}: prefill and decode disagree on {detail}")

    def peer_alive(self) -> bool:
        return self._channel.peer_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Release the link and stop this end's threads (idempotent, bounded by `timeout`)."""
        if not self._closed:
            self._closed = True
            self._close(timeout)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per transport -------------------------------------------------------------------------

    def _send(self, tag: str, buffers: list[jax.Array], header: str, deadline: float) -> None:
        """Prefill side: move `buffers` (the checksums last) and post `header` (the specs)."""
        raise NotImplementedError

    def _receive(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
                 wire: list[jax.ShapeDtypeStruct]) -> None:
        """Decode side: start receiving `wire` (`specs`, then the checksums) for `arrival`, and
        settle it on the transport's own threads (`_verify`, `_check_header`, `_settle`), by
        its deadline."""
        raise NotImplementedError

    def _verdict(self, tag: str, verdict: str, settle: Callable[[], None]) -> None:
        """Hook: post the decode side's verdict on `tag` ("ok", "mismatch: ...", "error: ..."),
        then `settle` its receive (posted first: the sender may free its buffers)."""
        self._post_verdict(tag, verdict)
        settle()

    def _post_verdict(self, tag: str, verdict: str) -> None:
        """Put a verdict where `wait_ack` reads it."""
        self._channel.post(f"{tag}/ack", verdict)

    def _acked(self, tag: str) -> None:
        """Hook: the decode side is done with `tag` (the sender may drop its buffers)."""

    def _close(self, timeout: float) -> None:
        """Hook: release transport resources."""

    def _require(self, role: Role, op: str) -> None:
        if self._closed:
            raise TransportError(f"{op} on a closed transport")
        if self.role != role:
            raise ValueError(f"{op} is a {role}-side operation; this end is the {self.role} side")


def _note_settled(arrival: Arrival) -> None:
    arrival.settled_at = time.perf_counter()  # on the thread that completed it, at once


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _complete(arrival: Arrival, arrays: list[jax.Array] | None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # failed meanwhile
        arrival.set_result(arrays)


def _fail(arrival: Arrival, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # settled meanwhile
        arrival.set_exception(error)
