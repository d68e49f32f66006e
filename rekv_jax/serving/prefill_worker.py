"""The prefill worker of a serving system: prompts computed first come, first served, while the
handoffs of those before them are on the link (the prefill device and the link work at once).

Each `Prefill` is computed as its mode asks (a full prefill; a split or pipelined one stops at
the cut) and its handoff's messages are handed to the link to its decode worker under the
request's tag, without the benchmark's `go` rendezvous; the first token it sends is drawn with
the request's `Sampling` (`sampling.first_draw`). One loop on one thread (`serve`), every wait
bounded; each turn it
  1. takes what the router sent: a `Prefill` joins the queue; an `Abort` ends its request
     wherever it is here (queued: never computed; held: dropped; on the link: its verdicts no
     longer awaited, its buffers let go) and is answered with `PrefillDone(error=why)`; one for
     a request this worker does not hold is ignored;
  2. reports each handoff on the link whose verdicts all came (`PrefillDone`, its `link_ms` from
     its first message handed to the link to its last verdict, of which `queued_ms` it waited
     for the last verdict of the handoff before it on that link), its buffers let go;
  3. sends each held prompt whose decode side admitted it (`TAG/admitted`, polled without
     waiting), while the bytes on the link are under `IN_FLIGHT_BYTES` (back-pressure: past
     it, nothing more is sent until the oldest handoffs' verdicts come);
  4. computes the next queued prompt. A full prefill is computed at once, before its decode
     side has pages for it, and held until it is admitted (at most `HELD` prompts at once). A
     split or pipelined prefill sends as it computes, once the link has room: one whose `Admit`
     went with it (`Prefill.admitted`) computes at once, its messages held until its admission
     (which comes within a decode iteration); another waits at the head of the queue for it.
Every request taken is told to the router twice: `Prefilled` once this device is done with its
prompt (computed, or dropped before it was), then `PrefillDone` once its handoff's verdicts came
(or it failed); the router's ledger starts the next prompt on this device at the first.
The link to each decode worker stays one FIFO: a handoff is handed to it only after every
handoff before it on that link. A decode side that refuses a request (it could never fit) says
so in `TAG/admitted`. A request that fails (not admitted within the timeout, a send or a verdict
that fails) is reported with its error and the queue goes on: every request taken is reported
exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax.numpy as jnp

from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError, TransportTimeout, first_line, one_line
from rekv_jax.handoff.sender import Prepared, prepare_prompt, start_prompt
from rekv_jax.handoff.sending import Sending, SendReport
from rekv_jax.launch.child import Member
from rekv_jax.model.transformer import Params
from rekv_jax.serving.compile_clock import compiled_ms
from rekv_jax.serving.inbox import LocalInbox, MemberInbox, Requests
from rekv_jax.serving.requests import Abort, Prefill, PrefillDone, Prefilled, tag
from rekv_jax.serving.sampling import first_draw
from rekv_jax.transport import Transport

IN_FLIGHT_BYTES = 1 << 30  # bytes on the links at once before sends wait (plus one handoff)
HELD = 4  # prompts computed and waiting for their admission at once
POLL_S = 0.005  # the longest the loop sleeps while only verdicts or admissions are awaited

T = TypeVar("T")


class _Refused(Exception):
    """A streamed job's admission was refused or failed while it computed (reported)."""


@dataclasses.dataclass
class _Job:
    """One request this worker holds, from its `Prefill` to its `PrefillDone`."""

    request: Prefill
    since_s: float  # time.monotonic(): when it began to wait for its admission (or was taken)
    prepared: Prepared | None = None  # computed, held until admitted (full prefills)
    admitted_at: float | None = None  # time.perf_counter() when its admission was seen
    sending: Sending | None = None  # on the link
    prefilled: bool = False  # its `Prefilled` was emitted
    compile_ms: float = 0.0  # XLA compiles while this worker computed or sent it

    @property
    def name(self) -> str:
        return tag(self.request.request_id)

    def timed(self, call: Callable[[], T]) -> T:
        """`call()`, the XLA compiles it caused added to the job's."""
        before = compiled_ms()
        try:
            return call()
        finally:
            self.compile_ms += compiled_ms() - before


class PrefillWorker:
    """The prefill side of a serving worker: `links[d]` reaches decode worker d. `in_flight_bytes`
    and `held` bound what it keeps on the prefill device (`IN_FLIGHT_BYTES`, `HELD`)."""

    def __init__(self, cfg: ModelConfig, params: Params, links: Sequence[Transport],
                 worker: int = 0, timeout: float = 60.0, in_flight_bytes: int = IN_FLIGHT_BYTES,
                 held: int = HELD) -> None:
        self._cfg, self._params, self._links = cfg, params, list(links)
        self.worker, self._timeout = worker, timeout
        self._max_bytes, self._max_held = in_flight_bytes, held
        self._queue: list[_Job] = []  # taken, not computed (first come, first served)
        self._held: list[_Job] = []  # computed, not yet admitted
        self._flying: list[_Job] = []  # on the link, in the order they were sent
        self._acked_s = [0.0] * len(self._links)  # each link's latest verdict (time.monotonic)

    @property
    def idle(self) -> bool:
        """No request is held here."""
        return not (self._queue or self._held or self._flying)

    @property
    def in_flight_bytes(self) -> int:
        """The bytes of the handoffs on the links, not yet acknowledged."""
        return sum(j.sending.nbytes for j in self._flying)

    def prefill(self, request: Prefill) -> PrefillDone:
        """One request alone, from its `Prefill` to its `PrefillDone` (`serve` of it; its
        `Prefilled` is not returned)."""
        if not self.idle:
            raise RuntimeError("prefill() serves one request on an idle worker")
        inbox, out = LocalInbox(), []
        inbox.put(request)
        inbox.close()
        self.serve(inbox, out.append)
        return out[-1]

    def serve(self, requests: Requests, emit: Callable[[object], None]) -> None:
        """Serve what comes from `requests` until they end and every request is reported; it
        waits for requests only while it holds none, else at most `POLL_S` between turns."""
        moved = False
        while not (requests.ended and self.idle):
            wait = None if self.idle else (0.0 if moved else POLL_S)
            if requests.ended:
                time.sleep(wait)
                items = []
            else:
                items = requests.take(wait)
            for item in items:
                self._take(item, emit)
            moved = self._turn(emit) or bool(items)

    def run(self, member: Member) -> None:
        """Serve the `Prefill`s the router hands this group member."""
        self.serve(MemberInbox(member), member.emit)

    # -- a turn -------------------------------------------------------------------------------

    def _take(self, item: object, emit: Callable[[object], None]) -> None:
        if isinstance(item, Abort):
            return self._abort(item, emit)
        if not isinstance(item, Prefill):
            raise ValueError(f"a prefill worker takes Prefill and Abort requests, got "
                             f"{type(item).__name__}")
        job = _Job(item, time.monotonic())
        if not 0 <= item.decode_worker < len(self._links):
            return self._fail(job, f"no decode worker {item.decode_worker}", emit)
        self._queue.append(job)

    def _abort(self, abort: Abort, emit: Callable[[object], None]) -> None:
        """End the request wherever it is here; a request not held here is ignored."""
        for jobs in (self._queue, self._held, self._flying):
            for job in jobs:
                if job.request.request_id == abort.request_id:
                    jobs.remove(job)
                    if job.sending is not None:
                        job.sending.abandon()
                    return self._fail(job, abort.why, emit)

    def _turn(self, emit: Callable[[object], None]) -> bool:
        """Steps 2-4 of the module's docstring; whether anything moved."""
        moved = self._collect(emit)
        moved = self._send_admitted(emit) or moved
        return self._compute_next(emit) or moved

    def _collect(self, emit: Callable[[object], None]) -> bool:
        """Report every handoff whose verdicts all came (or that failed)."""
        moved = False
        for job in list(self._flying):
            try:
                report = job.sending.poll()
            except (TransportError, ValueError) as e:
                report = e
            if report is None:
                continue
            self._flying.remove(job)
            moved = True
            if isinstance(report, Exception):
                self._fail(job, one_line(report), emit)
            else:
                self._done(job, report, emit)
        return moved

    def _done(self, job: _Job, report: SendReport, emit: Callable[[object], None]) -> None:
        """Report a handoff whose verdicts all came (polled in the order they were sent, so the
        one before it on its link was reported first)."""
        d, t = job.request.decode_worker, report.times
        queued_s = max(0.0, self._acked_s[d] - report.sent_s)
        self._acked_s[d] = max(self._acked_s[d], report.acked_s)
        emit(PrefillDone(job.request.request_id, self.worker, t.prefill_ms + t.quantize_ms,
                         report.link_ms, t.sent_bytes, queued_ms=1e3 * queued_s,
                         compile_ms=job.compile_ms))

    def _send_admitted(self, emit: Callable[[object], None]) -> bool:
        """Hand each held prompt whose decode side admitted it to its link, in order per link,
        while the link has room."""
        moved, blocked = False, set()  # links with an earlier handoff not yet sent
        for job in list(self._held):
            d = job.request.decode_worker
            if d in blocked or not self._has_room():
                blocked.add(d)
                continue
            admitted = self._admission(job, emit)
            if admitted is None:
                blocked.add(d)
                continue
            self._held.remove(job)
            moved = True
            if admitted:
                self._start(job, emit, functools.partial(
                    job.prepared.send, self._links[d], job.name, self._timeout, job.admitted_at))
        return moved

    def _compute_next(self, emit: Callable[[object], None]) -> bool:
        """Compute the head of the queue: a full prefill into the held prompts (while there is
        room); a streamed one once it is admitted and its link has room and no held prompt."""
        if not self._queue:
            return False
        job = self._queue[0]
        request = job.request
        tokens = jnp.asarray([request.tokens], jnp.int32)
        first = first_draw(request.sampling)
        if not request.mode.streams:
            if len(self._held) >= self._max_held:
                return False
            self._queue.pop(0)
            try:
                job.prepared = job.timed(functools.partial(
                    prepare_prompt, self._cfg, self._params, tokens, request.mode, first=first))
            except ValueError as e:
                self._fail(job, one_line(e), emit)
                return True
            job.since_s = time.monotonic()
            self._prefilled(job, job.prepared.compute_ms, emit)
            self._held.append(job)
            return True
        if (any(h.request.decode_worker == request.decode_worker for h in self._held)
                or not self._has_room()):
            return False
        admitted = True if request.admitted else self._admission(job, emit)
        if admitted is None:
            return False
        self._queue.pop(0)
        if admitted:
            link = self._links[request.decode_worker]
            self._start(job, emit, functools.partial(
                start_prompt, link, self._cfg, self._params, tokens, request.mode, job.name,
                timeout=self._timeout, go=False, first=first,
                gate=functools.partial(self._admitted_at, job, emit)))
        return True

    # -- helpers ------------------------------------------------------------------------------

    def _has_room(self) -> bool:
        return self.in_flight_bytes < self._max_bytes

    def _admission(self, job: _Job, emit: Callable[[object], None]) -> bool | None:
        """Whether its decode side admitted it (True), refused it or failed to answer within
        the timeout (False: reported here), or has not answered yet (None)."""
        link = self._links[job.request.decode_worker]
        try:
            admitted: dict[str, Any] = link.recv_meta(f"{job.name}/admitted", 0.0)
        except TransportTimeout:
            if time.monotonic() - job.since_s < self._timeout:
                return None
            self._fail(job, f"TransportTimeout: {job.name} was not admitted within "
                            f"{self._timeout:g}s", emit)
            return False
        except TransportError as e:
            self._fail(job, one_line(e), emit)
            return False
        if "refused" in admitted:
            self._fail(job, admitted["refused"], emit)
            return False
        job.admitted_at = job.admitted_at or time.perf_counter()
        return True

    def _admitted_at(self, job: _Job, emit: Callable[[object], None]) -> float | None:
        """A streamed job's gate: when its admission was seen (time.perf_counter), None while
        it has not come, `_Refused` once it never will (reported)."""
        admitted = self._admission(job, emit)
        if admitted is False:
            raise _Refused(job.name)
        return job.admitted_at if admitted else None

    def _start(self, job: _Job, emit: Callable[[object], None],
               send: Callable[[], Sending]) -> None:
        """Put the job's handoff on its link (`send`), or report why it could not be."""
        try:
            job.sending = job.timed(send)
        except _Refused:
            return  # reported where it was refused
        except (TransportError, ValueError) as e:
            return self._fail(job, one_line(e), emit)
        t = job.sending.times
        self._prefilled(job, t.prefill_ms + t.quantize_ms, emit)
        self._flying.append(job)

    def _prefilled(self, job: _Job, compute_ms: float | None, emit: Callable[[object], None]
                   ) -> None:
        """Tell the router this device is done with the job's prompt (once per job)."""
        if not job.prefilled:
            job.prefilled = True
            emit(Prefilled(job.request.request_id, self.worker, compute_ms, job.compile_ms))

    def _fail(self, job: _Job, error: str, emit: Callable[[object], None]) -> None:
        """Report the job failed (`Prefilled` first if its prompt was never computed)."""
        self._prefilled(job, None, emit)
        emit(PrefillDone(job.request.request_id, self.worker, 0.0, 0.0, 0, first_line(error)))
