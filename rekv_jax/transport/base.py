"""The handoff protocol shared by every transport: headers, checksums, acks, pacing, timeouts.

A transport moves one *phase* (a tag: the boundary, the prefix payload, ...) as a few device buffers
from the prefill side to the decode side. Small JSON control messages (headers, acks, metadata) go
through a `Channel`; each transport subclass only says how the buffers themselves move
(`_push` on the prefill side, `_pull` on the decode side).

Messages of one phase (each control message is a frame on the direct connection between the two
processes, `control.PeerSocket`, 0.05 ms on this CPU host; the protocol keeps them few and off the
critical path all the same):

  prefill                                          decode
  push buffers + checksums (the link holds them)
  post TAG/header (buffer specs)  --------------->  get  TAG/header  (compare specs)
                                                    pull buffers + checksums, checksum the
                                                    buffers on device, compare
  get  TAG/ack (at the end)  <--------------------  post TAG/ack     ("ok", "mismatch: ...",
                                                                    "error: ...")

The sender does not wait for its header to land (a `go_ahead` transport's, below, is put). The
checksums buffer ends with a word of the header itself (`spec_word`), so a `pull_first` transport
(the transfer server, whose pull waits for the sender's buffers) pulls at once and reads the
header only if that pull failed or the word differs (other buffers than expected were sent): no
message is on its critical path.

A `go_ahead` transport (the collective: both sides must enter its program, and mismatched specs
must never reach it) pushes after the header instead, once the decode side's `put TAG/ready`
has come: the specs it expects, put before it reads the header. Each side compares the header
with them and enters the program only if they match, so the go-ahead costs no second round trip;
it is the only message the sender waits for mid-phase.

The checksums are computed on the sender's device and travel as one more buffer beside the ones
they check, so the sender never waits for them and no message carries them. Neither `put` nor
`post` waits for the peer; a failed `post` is dropped (the peer's wait then finds this side
gone). Every wait blocks (no sleep-polling) in slices of `LIVENESS_S`, checking between slices
that the peer is alive, so a dead peer is reported at once when its connection closed (its
process ended), else within about a heartbeat, and no wait outlives its timeout. The threads a
transport waits on are created with it (`Worker`), never per message.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp

from rekv_jax.errors import TransportError
from rekv_jax.transport.checksums import (
    checksums_buffer,
    checksums_spec,
    spec_word,
    verdict_collect,
    verdict_dispatch,
)
from rekv_jax.transport.workers import Worker

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
    return [list(x.shape), jnp.dtype(x.dtype).name]


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


class Transport:
    """One end of a prefill -> decode link. Buffers flow prefill -> decode; metadata both ways.

    Prefill side: `send(tag, arrays)`, then `wait_ack(tag)` to learn whether it arrived intact.
    Decode side: `recv(tag, specs, timeout)`, which blocks its thread only (a caller that computes
    meanwhile runs it on `background`, as the overlapped schedule does). Tags are unique
    strings per phase (e.g. "rep3/boundary"); the collective transport needs them received in the
    order they were sent.
    """

    kind: str = ""  # its name in TRANSPORTS and on the command line
    # whether the sender waits for the decode side's go-ahead (`TAG/ready`) before it pushes: a
    # transport whose buffers move only when both sides act together (the collective) must not
    # start a program the decode side would not join
    go_ahead: bool = False
    # whether the decode side pulls without waiting for the header (a pull that waits for the
    # sender's buffers and fails cleanly on other shapes): the checksums' `spec_word` stands in
    # for the header, which is read only when the pull failed or the word differs
    pull_first: bool = False

    def __init__(self, role: Role, channel: Channel, link_gbps: float | None = None) -> None:
        self.role = role
        self.peer = peer_of(role)
        self._channel = channel
        self.set_link(link_gbps)
        self._closed = False
        self.sent_bytes = 0  # prefill side: bytes of every buffer handed to the link so far
        self._outgoing: dict[str, jax.Array] = {}  # tag -> checksums of the buffers being pushed
        # decode side: tag -> (wire specs, pulled buffers or the pull's error, when they landed:
        # `_watch`'s future), see `prefetch`
        self._prefetched: dict[str, tuple[list, list[jax.Array] | TransportError,
                                          concurrent.futures.Future[float] | None]] = {}
        # work beside the caller's own thread (the decode side's background receive); one
        # persistent thread per end, stopped by `close`
        self.background = Worker(f"rekv-{role}-background")
        self._held_acks: list[str] | None = None  # decode side: ok-acks held (`hold_acks`)

    def set_link(self, link_gbps: float | None) -> None:
        """Pace later receives to a link of `link_gbps` GB/s (None: unpaced): each experiment of
        a pair runs on its own link over the same transport."""
        self._pacer = LinkPacer(link_gbps) if link_gbps is not None else None

    # -- buffers -------------------------------------------------------------------------------

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        """Prefill side: post the header (buffer specs; not waited for) and hand the buffers to
        the link with their checksums (computed on device meanwhile, sent as one more buffer):
        the buffers first where the link holds them until the decode side pulls; the header
        first, put, for a `go_ahead` transport. A header whose post fails (a reused tag, a lost
        coordinator) surfaces as the decode side's timeout, then `wait_ack`'s.

        Returns once the transport holds the buffers (transfer-server: registered for pull; the
        collective returns when the exchange is done), and adds their bytes to `sent_bytes`
        (the checksums and the JSON control messages are not counted). Errors of the decode side
        surface here (collective) or in `wait_ack`."""
        self._require("prefill", "send")
        arrays = list(arrays)
        if not arrays:
            raise ValueError(f"{tag}: nothing to send")
        for i, a in enumerate(arrays):
            if a.ndim < 1:
                raise ValueError(f"{tag}: buffer {i} must have at least one dimension")
        deadline = time.monotonic() + timeout
        header = json.dumps([spec_of(a) for a in arrays])
        self._outgoing[tag] = checksums_buffer(arrays, spec_word(header))  # on device meanwhile
        if self.go_ahead:  # the push waits for the go-ahead, which the header brings about
            self._channel.put(f"{tag}/header", header)
            self._push(tag, arrays, deadline)
        else:  # the buffers wait at the link for the pull (which may come before the header)
            self._push(tag, arrays, deadline)
            self._channel.post(f"{tag}/header", header)
        self.sent_bytes += sum(a.nbytes for a in arrays)

    def prefetch(self, tags: Sequence[str], specs: Sequence[Sequence[jax.ShapeDtypeStruct]],
                 timeout: float = 60.0) -> None:
        """Decode side: start pulling the buffers of `tags` now, for `recv` to complete later
        (a `pull_first` transport; a no-op for the others). A link then moves a queue of
        messages back to back while this thread computes between their receives, instead of
        idling until each receive asks for the next (the chunked schedules)."""
        self._require("decode", "prefetch")
        if not self.pull_first:
            return
        deadline = time.monotonic() + timeout
        for tag, tag_specs in zip(tags, specs, strict=True):
            wire = [*tag_specs, checksums_spec(tag_specs)]
            try:
                pulled = self._pull(tag, wire, deadline)
                self._prefetched[tag] = wire, pulled, self._watch(pulled)
            except TransportError as e:  # raised by the receive that asks for it
                self._prefetched[tag] = wire, e, None

    def discard(self, prefix: str) -> None:
        """Decode side: forget the prefetched pulls of tags under `prefix` that no receive took
        (a handoff that failed or fell back)."""
        for tag in [t for t in self._prefetched if t.startswith(prefix)]:
            landing = self._prefetched.pop(tag)[2]
            if landing is not None and not landing.done():
                self._unwatch()

    def _take_pull(self, tag: str, wire: list, deadline: float
                   ) -> tuple[list[jax.Array], concurrent.futures.Future[float] | None]:
        """The prefetched pull of `tag` (see `prefetch`) and its landing, else a new pull."""
        if tag not in self._prefetched:
            return self._pull(tag, wire, deadline), None
        fetched, got, landing = self._prefetched.pop(tag)
        if [spec_of(s) for s in fetched] != [spec_of(s) for s in wire]:
            raise ValueError(f"{tag}: prefetched as {fetched}, received as {wire}")
        if isinstance(got, TransportError):
            raise got
        return got, landing

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0,
             paced_after: threading.Event | None = None) -> list[jax.Array]:
        """Decode side: block until the buffers of `tag` are on the local device and verified.

        Raises ValueError if the sender's buffers do not match `specs` (the sender raises too),
        TransportError if the payload is corrupted or the peer died, TransportTimeout. The ack
        is posted, not waited for: the sender collects it at the end (`wait_ack`).
        `paced_after`: on a paced link, these bytes queue behind those of a receive running
        beside this one (the sender sent those first), which sets the event once it ended."""
        self._require("decode", "recv")
        deadline = time.monotonic() + timeout
        expected = [spec_of(s) for s in specs]
        wire = [*specs, checksums_spec(specs)]  # what crosses: the buffers, then checksums
        if self.go_ahead:  # put, not post: the sender is waiting for it; put before the header
            # is read, since the sender compares the specs too (one round trip, not two)
            self._channel.put(f"{tag}/ready", self._ready(wire, expected))
        if not self.pull_first:
            self._check_header(tag, expected, timeout)
        start = time.monotonic()  # when the header came (`pull_first`: when the bytes did)
        try:
            try:
                (*arrays, sums), landing = self._take_pull(tag, wire, deadline)
                got, want, landed = self._landed_verdict(tag, arrays, sums, deadline, landing)
            except TransportError:
                if self.pull_first:  # a pull of other buffers than were sent fails: say so
                    self._recheck_header(tag, expected, deadline)
                raise
            got.append(spec_word(json.dumps(expected)))
            if self.pull_first:  # the link's clock starts when the bytes landed, not when the
                start = landed or time.monotonic()  # checksums (queued behind compute) came
                if got[-1] != want[-1]:  # other buffers than expected (same bytes, or fewer)
                    self._recheck_header(tag, expected, deadline)
            bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            if bad:
                raise TransportError(f"{tag}: checksum mismatch in buffer(s) {bad}: "
                                     "corrupted payload")
        except TransportError as e:
            self.release_acks()
            self._channel.post(f"{tag}/ack", f"error: {e}")
            raise
        if self._held_acks is None:
            self._channel.post(f"{tag}/ack", "ok")
        else:
            self._held_acks.append(tag)
        if self._pacer is not None:  # one link per receiving device (sharded sides)
            if paced_after is not None:
                paced_after.wait(max(0.0, deadline - time.monotonic()))
            per_device: Counter[frozenset] = Counter()
            for a in arrays:
                per_device[frozenset(a.devices())] += a.nbytes
            self._pacer.wait(max(per_device.values()), start)
        return arrays

    def hold_acks(self) -> None:
        """Decode side: hold the "ok" acks of later receives until `release_acks` (a failed
        receive's ack, and every held one before it, go at once). The sender waits for acks only
        at its end, and each is a control-channel message whose cost would fall inside a timed
        handoff, on the decode side's cores."""
        self.release_acks()
        self._held_acks = []

    def release_acks(self) -> None:
        """Post the held acks, in order, and stop holding (a no-op when none are held)."""
        held, self._held_acks = self._held_acks, None
        for tag in held or ():
            self._channel.post(f"{tag}/ack", "ok")

    def _recheck_header(self, tag: str, expected: list, deadline: float) -> None:
        """`_check_header` after a failed pull (`pull_first`): a header that cannot be read
        (the peer died, the time is up) leaves the pull's own error to stand."""
        with contextlib.suppress(TransportError):
            self._check_header(tag, expected, max(0.0, deadline - time.monotonic()))

    def _check_header(self, tag: str, expected: list, timeout: float) -> None:
        """Decode side: raise ValueError (and tell the sender) if the header's buffer specs are
        not `expected`. A header that does not come is a TransportError (a timeout)."""
        sent = json.loads(self._channel.get(f"{tag}/header", timeout))
        if sent != expected:
            msg = mismatch_text(tag, sent, expected)
            self.release_acks()
            self._channel.post(f"{tag}/ack", "mismatch: " + msg)
            raise ValueError(msg)

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
        """Release the link and stop this end's threads (idempotent, bounded by `timeout`)."""
        if not self._closed:
            self.release_acks()
            self._closed = True
            self.background.close()
            self._close(timeout)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per transport -------------------------------------------------------------------------

    def _push(self, tag: str, arrays: list[jax.Array], deadline: float) -> None:
        """Prefill side: move the buffers (header already posted) and, after them, their
        checksums (`_with_checksums`)."""
        raise NotImplementedError

    def _with_checksums(self, tag: str, arrays: list[jax.Array]) -> list[jax.Array]:
        """`arrays` and then the checksums `send` computed for `tag`: from the buffers it was
        given, so that whatever happens to them after (on the wire) is caught."""
        return [*arrays, self._outgoing.pop(tag)]

    def _pull(self, tag: str, specs: list[jax.ShapeDtypeStruct], deadline: float
              ) -> list[jax.Array]:
        """Decode side: the buffers of `tag` on the local device, the checksums buffer last (they
        may still be landing if the transport's `_landed_verdict` waits for them)."""
        raise NotImplementedError

    def _landed_verdict(self, tag: str, arrays: list[jax.Array], sums: jax.Array,
                        deadline: float, landing: concurrent.futures.Future[float] | None
                        ) -> tuple[list[int], list[int], float | None]:
        """Decode side: (computed, sent) checksums of pulled buffers once they landed, and when
        they landed (time.monotonic; None: not known apart from now; `landing`: `_watch`'s).
        Here: on this thread, for transports whose `_pull` returns materialized buffers."""
        return *verdict_collect(verdict_dispatch(arrays, sums)), None

    def _watch(self, pulled: list[jax.Array]) -> concurrent.futures.Future[float] | None:
        """Hook: note when a prefetched pull lands, apart from the receive that takes it (which
        may come after the device computed a while); None: not known."""
        return None

    def _unwatch(self) -> None:
        """Hook: a `_watch` that may never end (its pull was discarded) is left to its thread."""

    def _ready(self, specs: Sequence[jax.ShapeDtypeStruct], expected: list) -> str:
        """Decode side (`go_ahead` transports): the go-ahead, JSON of the buffer specs it
        expects (`expect`), which the sender compares with its own before it pushes."""
        return json.dumps({"expect": expected})

    def _acked(self, tag: str) -> None:
        """Hook: the decode side is done with `tag` (the sender may drop its buffers)."""

    def _close(self, timeout: float) -> None:
        """Hook: release transport resources."""

    def _require(self, role: Role, op: str) -> None:
        if self._closed:
            raise TransportError(f"{op} on a closed transport")
        if self.role != role:
            raise ValueError(f"{op} is a {role}-side operation; this end is the {self.role} side")
