"""The handoff protocol shared by every transport: headers, checksums, acks, pacing, timeouts.

A transport moves one *phase* (a tag: the boundary, the prefix payload, ...) as a few device buffers
from the prefill side to the decode side. Small JSON control messages (headers, acks, metadata) go
through a `Channel`; each transport subclass only says how the buffers themselves move
(`_push` on the prefill side, `_pull` on the decode side).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


class TransportError(RuntimeError):
    """A phase did not arrive intact: the peer died or failed, or the payload was corrupted."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait ran past its timeout."""


class Channel(Protocol):
    """Control plane between the two processes: small string values under write-once keys."""

    def put(self, key: str, value: str) -> None: ...

    def get(self, key: str, timeout: float) -> str:
        """The value under `key`; TransportTimeout after `timeout` s, TransportError if the peer is
        known to be gone."""
        ...

    def peer_alive(self) -> bool: ...


def peer_of(role: Role) -> Role:
    """The other side's role (ValueError for an unknown role)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return "decode" if role == "prefill" else "prefill"


def spec_of(x: jax.Array | jax.ShapeDtypeStruct) -> list:
    """JSON form of a buffer's shape and dtype, e.g. `[[2, 4, 8], "bfloat16"]`."""
    return [list(x.shape), jnp.dtype(x.dtype).name]


def _checksum(x: jax.Array) -> jax.Array:
    """Position-weighted sum of the buffer's 32-bit words, `sum_i w_i * (2i + 1) mod 2**32`.

    The weights are odd, so any change of one byte (or one word) always changes the sum; weights
    differ per position, so reordered words are caught too (barring rare coincidences)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)  # [bytes]
    b = jnp.pad(b, (0, -b.size % 4))
    w = jax.lax.bitcast_convert_type(b.reshape(-1, 4), jnp.uint32)  # [words]
    i = jax.lax.iota(jnp.uint32, w.size)
    return jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)


@jax.jit
def _checksums_device(arrays: list[jax.Array]) -> jax.Array:
    return jnp.stack([_checksum(x) for x in arrays])  # [n] uint32


def _checksums_dispatch(arrays: Sequence[jax.Array]) -> list[tuple[list[int], jax.Array]]:
    """Start one jitted checksum call per device holding some of the buffers (one call when they
    share a device, as on a single-device side): (buffer indices, their checksums)."""
    groups: dict[frozenset, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(frozenset(a.devices()), []).append(i)
    return [(idx, _checksums_device([arrays[i] for i in idx])) for idx in groups.values()]


def _checksums_collect(pending: list[tuple[list[int], jax.Array]]) -> list[int]:
    sums = {i: s for idx, device_sums in pending
            for i, s in zip(idx, np.asarray(device_sums).tolist(), strict=True)}
    return [sums[i] for i in range(len(sums))]


def checksums(arrays: Sequence[jax.Array]) -> list[int]:
    """One uint32 checksum per buffer, computed on the buffers' devices."""
    return _checksums_collect(_checksums_dispatch(list(arrays)))


class LinkPacer:
    """Emulates a FIFO link of `gbps` GB/s: a transfer of n bytes that starts at t completes no
    earlier than max(t, end of the previous transfer) + n / gbps."""

    def __init__(self, gbps: float) -> None:
        if not gbps > 0:
            raise ValueError(f"link bandwidth must be positive GB/s, got {gbps}")
        self.gbps = gbps
        self._free_at = 0.0
        self._lock = threading.Lock()

    def wait(self, nbytes: int, start: float) -> None:
        """Sleep until a transfer of `nbytes` begun at `start` (time.monotonic) is done."""
        with self._lock:
            done = max(start, self._free_at) + nbytes / (self.gbps * 1e9)
            self._free_at = done
        time.sleep(max(0.0, done - time.monotonic()))


def poll_until(done: Callable[[], bool], deadline: float, peer_alive: Callable[[], bool],
               what: str) -> None:
    """Poll `done()` until it holds; TransportTimeout after `deadline` (time.monotonic),
    TransportError once the peer is known to be gone. Polling, unlike a blocking wait inside the
    runtime, stays bounded when the peer vanishes."""
    delay, next_check = 1e-4, time.monotonic() + 0.5
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise TransportTimeout(f"{what}: payload did not arrive before the timeout")
        if now > next_check:
            if not peer_alive():
                raise TransportError(f"{what}: the peer process is gone (mid-transfer)")
            next_check = now + 0.5
        time.sleep(delay)
        delay = min(2 * delay, 2e-3)


class Transport:
    """One end of a prefill -> decode link. Buffers flow prefill -> decode; metadata both ways.

    Prefill side: `send(tag, arrays)`, then `wait_ack(tag)` to learn whether it arrived intact.
    Decode side: `recv(tag, specs, timeout)`, which blocks its thread only (a caller that computes
    meanwhile runs it on a thread of its own, as the overlapped schedule does). Tags are unique
    strings per phase (e.g. "rep3/boundary"); the collective transport needs them received in the
    order they were sent.
    """

    kind: str = ""  # its name in TRANSPORTS and on the command line

    def __init__(self, role: Role, channel: Channel, link_gbps: float | None = None) -> None:
        self.role = role
        self.peer = peer_of(role)
        self._channel = channel
        self.set_link(link_gbps)
        self._closed = False
        self.sent_bytes = 0  # prefill side: bytes of every buffer handed to the link so far

    def set_link(self, link_gbps: float | None) -> None:
        """Pace later receives to a link of `link_gbps` GB/s (None: unpaced): each experiment of
        a pair runs on its own link over the same transport."""
        self._pacer = LinkPacer(link_gbps) if link_gbps is not None else None

    # -- buffers -------------------------------------------------------------------------------

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        """Prefill side: post the header (buffer specs), hand the buffers to the link, then post
        their checksums (computed on device while the link works).

        Returns once the transport holds the buffers (transfer-server: registered for pull; the
        collective returns when the exchange is done), and adds their bytes to `sent_bytes`
        (the JSON control messages are not counted). Errors of the decode side surface here
        (collective) or in `wait_ack`."""
        self._require("prefill", "send")
        arrays = list(arrays)
        if not arrays:
            raise ValueError(f"{tag}: nothing to send")
        for i, a in enumerate(arrays):
            if a.ndim < 1:
                raise ValueError(f"{tag}: buffer {i} must have at least one dimension")
        sums = _checksums_dispatch(arrays)  # dispatched asynchronously
        self._channel.put(f"{tag}/header", json.dumps([spec_of(a) for a in arrays]))
        self._push(tag, arrays, time.monotonic() + timeout)
        self.sent_bytes += sum(a.nbytes for a in arrays)
        self._channel.put(f"{tag}/checksums", json.dumps(_checksums_collect(sums)))

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0
             ) -> list[jax.Array]:
        """Decode side: block until the buffers of `tag` are on the local device and verified.

        Raises ValueError if the sender's buffers do not match `specs` (the sender raises too),
        TransportError if the payload is corrupted or the peer died, TransportTimeout."""
        self._require("decode", "recv")
        deadline = time.monotonic() + timeout
        sent = json.loads(self._channel.get(f"{tag}/header", timeout))
        start = time.monotonic()
        expected = [spec_of(s) for s in specs]
        if sent != expected:
            msg = f"{tag}: prefill sent buffers {sent}, decode expects {expected}"
            self._channel.put(f"{tag}/ready", "mismatch: " + msg)
            self._channel.put(f"{tag}/ack", "mismatch: " + msg)
            raise ValueError(msg)
        self._channel.put(f"{tag}/ready", self._ready(specs))
        try:
            arrays = self._pull(tag, list(specs), deadline)
            got = checksums(arrays)
            want = json.loads(self._channel.get(f"{tag}/checksums",
                                                max(0.0, deadline - time.monotonic())))
            bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            if bad:
                raise TransportError(f"{tag}: checksum mismatch in buffer(s) {bad}: "
                                     "corrupted payload")
        except TransportError as e:
            self._channel.put(f"{tag}/ack", f"error: {e}")
            raise
        self._channel.put(f"{tag}/ack", "ok")
        if self._pacer is not None:  # one link per receiving device (sharded sides)
            per_device: Counter[frozenset] = Counter()
            for a in arrays:
                per_device[frozenset(a.devices())] += a.nbytes
            self._pacer.wait(max(per_device.values()), start)
        return arrays

    def wait_ack(self, tag: str, timeout: float = 60.0) -> None:
        """Prefill side: block until the decode side confirms `tag` arrived intact; raise its error
        otherwise (ValueError for mismatched buffers, TransportError for a failed transfer)."""
        self._require("prefill", "wait_ack")
        ack = self._channel.get(f"{tag}/ack", timeout)
        self._acked(tag)
        if ack.startswith("mismatch: "):
            raise ValueError(ack.removeprefix("mismatch: "))
        if ack != "ok":
            raise TransportError(f"decode side failed to receive {tag}: {ack}")

    # -- metadata --------------------------------------------------------------------------------

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

    def close(self, timeout: float = 10.0) -> None:
        """Release the link (idempotent, bounded by `timeout`)."""
        if not self._closed:
            self._closed = True
            self._close(timeout)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per transport -------------------------------------------------------------------------

    def _push(self, tag: str, arrays: list[jax.Array], deadline: float) -> None:
        """Prefill side: move the buffers (header already posted)."""
        raise NotImplementedError

    def _pull(self, tag: str, specs: list[jax.ShapeDtypeStruct], deadline: float
              ) -> list[jax.Array]:
        """Decode side: the buffers of `tag` on the local device, materialized."""
        raise NotImplementedError

    def _ready(self, specs: Sequence[jax.ShapeDtypeStruct]) -> str:
        """Decode side: the go-ahead for the sender once the header matched."""
        return "ok"

    def _acked(self, tag: str) -> None:
        """Hook: the decode side is done with `tag` (the sender may drop its buffers)."""

    def _close(self, timeout: float) -> None:
        """Hook: release transport resources."""

    def _require(self, role: Role, op: str) -> None:
        if self._closed:
            raise TransportError(f"{op} on a closed transport")
        if self.role != role:
            raise ValueError(f"{op} is a {role}-side operation; this end is the {self.role} side")
