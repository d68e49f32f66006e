"""The router of a serving run: it owns the requests from arrival to their last token, asks its
policy how to hand each off, and tells the workers (the launching process; no JAX work here).

Each request's status (`lifecycle.Status`) lives here and changes only through
`lifecycle.move`. A request that arrives waits in one first-come-first-served queue until a
live pair can take it. The router is the one owner of every decode worker's pages: it counts
each worker's free pages (taken when it sends the request's `Admit`, given back when the worker
reports the request `Finished`, after the worker freed them), so every `Admit` it sends fits.
The policy chooses the mode and the pair among the live pairs whose decode worker has the pages
(the router sends the `Prefill`, marked admitted, then the `Admit`); when none has them, among
those whose decode worker has fewer than `PREFILL_AHEAD` requests prefilled ahead of their pages
(the `Prefill` only; `Admit`s follow in order as pages return).

`abort` ends one request wherever it is (a queued one is never prefilled) and `abort_all` every
one: each worker holding it is sent an `Abort`, and its pages come back with its decode worker's
`Finished`. With a `timeout`, a request past it since its arrival fails (clients' have none).
A decode worker that ends fails the requests assigned to it; a prefill worker that ends puts
its requests whose handoff it had not completed back in the queue (after their decode worker's
`Finished` for them, once it was sent an `Abort`). Every request ends once, `Served`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from rekv_jax.launch.child import DECODE, PREFILL, member_name, parse_member
from rekv_jax.launch.group import Emitted, Event, MemberEnded
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.lifecycle import HANDING_OFF, OpenRequest, Status, Transition, ending
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.policy import Policy
from rekv_jax.serving.requests import (
    Abort,
    Admit,
    Assignment,
    Finished,
    Load,
    Prefill,
    PrefillDone,
    Prefilled,
    ServeRequest,
    Token,
)

POLL_S = 0.5  # the longest the loop waits for a worker before it looks at the clock again
PREFILL_AHEAD = 2  # requests per decode worker that may be prefilled before their pages are free


class Router:
    """One stream of requests under one policy, on the workers `send` reaches (`member_name`s).

    The caller feeds it arrivals (`arrive`), what workers emit (`on_item`), workers' ends
    (`on_ended`) and aborts (`abort`, `abort_all`), each at its `now_s`, and calls `expire` now and
    then; `done` once every arrival ended, each in `served` (in order) and handed to `on_served`;
    each `Assignment` goes to `on_assigned` once its `Prefill` is sent (again if reassigned)."""

    def __init__(self, policy: Policy, ledger: Ledger, pool: PoolConfig, costs: DecodeCosts,
                 send: Callable[[str, object], bool], rate: float, timeout: float | None,
                 on_served: Callable[[Served], None] | None = None,
                 on_assigned: Callable[[Assignment], None] | None = None) -> None:
        self._policy, self._ledger, self._pool, self._costs = policy, ledger, pool, costs
        self._on_served, self._on_assigned = on_served, on_assigned
        self._send, self._rate, self._timeout = send, rate, timeout
        self._free = [pool.usable_pages] * len(ledger.decode)  # per decode worker
        self._live = {PREFILL: set(range(len(ledger.prefill))),
                      DECODE: set(range(len(ledger.decode)))}
        self._waiting: list[OpenRequest] = []  # unassigned, in arrival order
        # per decode worker: its requests prefilled ahead of their pages, first come first
        self._ahead = [collections.deque[OpenRequest]() for _ in ledger.decode]
        self._open: dict[int, OpenRequest] = {}  # every request held, by id
        # requests the router ended before their decode worker did: (decode worker, pages)
        self._ended: dict[int, tuple[int, int]] = {}
        self._arrived, self.served = 0, list[Served]()

    @property
    def done(self) -> bool:
        return not self._open

    @property
    def serving(self) -> bool:
        """Whether a prefill and a decode worker are left (else every request fails at once)."""
        return bool(self._live[PREFILL] and self._live[DECODE])

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def free_pages(self) -> tuple[int, ...]:
        """Each decode worker's pages that no request holds, as the router counts them."""
        return tuple(self._free)

    def arrive(self, request: ServeRequest, now_s: float) -> None:
        """A request arrived: queue it, then assign what the workers can take."""
        if request.id in self._open:
            raise ValueError(f"request {request.id} arrived twice")
        pages = self._pool.pages_for(request.prompt_len + request.max_new_tokens)
        held = OpenRequest(request, pages, self._arrived, [Transition(Status.WAITING, now_s)])
        self._arrived += 1
        self._open[request.id] = held
        self._ledger = self._ledger.arrived(now_s)
        if held.pages > self._pool.usable_pages:
            return self._end(held, Status.ERROR, now_s, f"needs {held.pages} pages of "
                             f"{self._pool.page_size} positions; a decode worker has "
                             f"{self._pool.usable_pages}")
        self._waiting.append(held)
        self._assign(now_s)

    def _assign(self, now_s: float) -> None:
        """Assign queued requests, first come first served, while a live pair can take them."""
        while self._waiting:
            if not self.serving:
                side = PREFILL if not self._live[PREFILL] else DECODE
                self._end(self._waiting.pop(0), Status.ERROR, now_s, f"no {side} worker is left")
                continue
            pairs = self._pairs(self._waiting[0])
            if not pairs:
                return  # it waits for pages (a `Finished` calls again)
            self._start(self._waiting.pop(0), pairs, now_s)

    def _pairs(self, held: OpenRequest) -> list[tuple[int, int]]:
        """The live pairs that can take the request: those whose decode worker has its pages
        (and no request prefilled ahead of them), else those with room ahead of their pages."""
        live = [(p, d) for p, d in self._ledger.pairs()
                if p in self._live[PREFILL] and d in self._live[DECODE]]
        fit = [(p, d) for p, d in live if not self._ahead[d] and self._free[d] >= held.pages]
        return fit or [(p, d) for p, d in live if len(self._ahead[d]) < PREFILL_AHEAD]

    def _start(self, held: OpenRequest, pairs: list[tuple[int, int]], now_s: float) -> None:
        """Choose the request's mode and pair and send its `Prefill`, then its `Admit` if its
        decode worker has the pages (else it waits ahead of them). A prefill worker that has
        ended (its send fails) is no longer chosen: the request is queued again first."""
        r = held.request
        a = self._policy.choose(r, self._ledger, now_s, pairs)
        p, d = a.prefill_worker, a.decode_worker
        fits = not self._ahead[d] and self._free[d] >= held.pages
        if not self._send(member_name(PREFILL, p), Prefill(r.id, r.tokens, a.mode, d,
                                                           r.sampling, fits)):
            self._live[PREFILL].discard(p)
            return self._waiting.insert(0, held)
        held.assignment = a
        held.move(Status.PREFILLING, now_s)
        if self._on_assigned is not None:
            self._on_assigned(a)
        self._ledger = self._ledger.assigned(a, now_s, r.prompt_len)
        if fits:
            self._admit(held, now_s)
        else:
            self._ahead[d].append(held)

    def _admit(self, held: OpenRequest, now_s: float) -> None:
        """Take the request's pages on its decode worker and send its `Admit` (it fits: the
        router counts the pages); a decode worker that has ended fails it."""
        r, a = held.request, held.assignment
        d = a.decode_worker
        self._take_pages(d, held.pages)
        held.admitted = True
        if not self._send(member_name(DECODE, d), Admit(r.id, r.prompt_len, r.max_new_tokens,
                                                       a.mode, a.prefill_worker,
                                                       a.why.predicted.decode_busy_ms,
                                                       r.sampling, r.stops)):
            self._live[DECODE].discard(d)
            held.admitted = False
            self._stop(held, now_s, error=f"decode worker {d} has ended")

    def _pages_back(self, decode: int, pages: int, now_s: float) -> None:
        """Pages of a decode worker came back: admit its requests prefilled ahead of them, first
        come first served, then assign queued ones."""
        self._take_pages(decode, -pages)
        ahead = self._ahead[decode]
        while ahead and self._free[decode] >= ahead[0].pages:
            self._admit(ahead.popleft(), now_s)
        self._assign(now_s)

    def _take_pages(self, decode: int, pages: int) -> None:
        """Its requests take `pages` more of a decode worker's pool (fewer: they give back)."""
        self._free[decode] -= pages
        self._ledger = self._ledger.holding(decode, self._pool.usable_pages - self._free[decode])

    def on_item(self, name: str, item: object, now_s: float) -> None:
        """What worker `name` emitted, as it reached the router at `now_s`."""
        _, index = parse_member(name)
        if isinstance(item, Token | Finished) and item.request_id not in self._open:
            return self._late(name, item, now_s)
        if isinstance(item, Token):
            self._token(name, item, now_s)
        elif isinstance(item, Finished):
            self._finished(index, item, now_s)
        elif isinstance(item, Prefilled):
            self._prefilled(item, now_s)
        elif isinstance(item, PrefillDone):
            self._prefill_done(item, now_s)
        elif isinstance(item, Load):
            self._ledger = self._ledger.loaded(item, now_s, self._costs)
        else:
            raise ValueError(f"{name} emitted {type(item).__name__}, which a router does not "
                             "take")

    def _token(self, name: str, item: Token, now_s: float) -> None:
        held = self._open[item.request_id]
        if held.status == Status.REQUEUING:
            return  # of the attempt its decode worker was told to drop
        if item.index != len(held.token_times_s):
            raise ValueError(f"{name}: token {item.index} of request {item.request_id} "
                             f"came after {len(held.token_times_s)}")
        held.token_times_s.append(now_s)
        if item.index > 0 and held.assignment:
            self._ledger = self._ledger.decodes_until(held.assignment, held.token_times_s,
                                                      held.request.max_new_tokens)
        if item.index == 0:
            held.move(Status.DECODING, now_s)
            if (sent_s := held.entered_s(Status.SENT)) is not None and held.assignment:
                self._ledger = self._ledger.first_token(held.assignment, held.request.prompt_len,
                                                        (now_s - sent_s) * 1e3)

    def _late(self, name: str, item: Token | Finished, now_s: float) -> None:
        """A report of a request the router already ended: a `Finished` gives its pages back;
        one of a request it never held is an error."""
        if item.request_id not in self._ended:
            raise ValueError(f"{name} reported request {item.request_id}, which is not open")
        if isinstance(item, Finished):
            self._pages_back(*self._ended.pop(item.request_id), now_s)

    def _finished(self, decode: int, item: Finished, now_s: float) -> None:
        """Its decode worker ended it, its pages freed: it goes again (`requeuing`), or ends as
        reported once its prefill worker reported (its record holds those times) or ended."""
        held = self._open[item.request_id]
        held.admitted, held.finished = False, item
        if held.assignment and item.phases and not (item.error or item.fell_back
                                                    or item.compile_ms):
            self._ledger = self._ledger.suffix_done(decode, held.assignment,
                                                    held.request.prompt_len, item.phases.suffix,
                                                    held.suffix_beside, item.suffix_queued)
        if held.status == Status.REQUEUING:
            self._requeue(held, now_s)
        elif held.prefill_done or held.assignment.prefill_worker not in self._live[PREFILL]:
            self._end(held, ending(item), now_s)
        self._pages_back(decode, held.pages, now_s)

    def _prefilled(self, item: Prefilled, now_s: float) -> None:
        """Its prefill worker's device is done with its prompt: the next one starts there."""
        # a compute that compiled times the compiler, not the device: it re-estimates nothing
        self._ledger = self._ledger.prefilled(item.worker, now_s,
                                              None if item.compile_ms else item.compute_ms)
        held = self._open.get(item.request_id)
        if held is not None and held.status == Status.PREFILLING:
            held.move(Status.PREFILLED, now_s)
            held.suffix_beside = self._ledger.prefilling()

    def _prefill_done(self, item: PrefillDone, now_s: float) -> None:
        """Its prefill worker's report: its handoff was sent (`sent`), or it failed there."""
        if (held := self._open.get(item.request_id)) is None:
            return  # it ended (its decode worker gives its pages back)
        held.prefill_done, a = item, held.assignment
        if held.finished is not None:  # its decode worker ended it first
            return self._end(held, ending(held.finished), now_s)
        if item.error is not None:
            if not held.admitted:  # ahead of its pages: its decode worker never heard of it
                self._ahead[a.decode_worker].remove(held)
                self._end(held, Status.ERROR, now_s, item.error)
                self._assign(now_s)
            return  # else its decode worker reports how it ends
        if held.status in HANDING_OFF:
            held.move(Status.SENT, now_s)
        self._ledger = self._ledger.link_timed(item.worker, a.decode_worker, item.sent_bytes,
                                               item.link_ms - item.queued_ms, a.mode.streams)

    def on_ended(self, name: str, how: str, now_s: float) -> None:
        """Worker `name` ended (`how`: one line): a decode worker's requests fail; a prefill
        worker's requests whose handoff it had not completed go again."""
        role, index = parse_member(name)
        self._live[role].discard(index)
        at = "decode_worker" if role == DECODE else "prefill_worker"
        for held in [h for h in self._open.values()
                     if h.assignment is not None and getattr(h.assignment, at) == index]:
            if role == DECODE:
                held.admitted = False  # its pages ended with it
                self._stop(held, now_s, error=f"decode worker {index} ended: {how}")
            elif held.status in HANDING_OFF:
                self._retry(held, now_s)
            elif held.finished is not None:  # it waited for this worker's report
                self._end(held, ending(held.finished), now_s)
        if role == DECODE:
            self._ended = {i: e for i, e in self._ended.items() if e[0] != index}
        self._assign(now_s)

    def _retry(self, held: OpenRequest, now_s: float) -> None:
        """Its prefill worker ended before its handoff completed: queue it again, at once if its
        decode worker holds nothing of it, else once that worker's `Finished` for it came back
        after an `Abort` (a worker takes its messages in order: the `Abort` before any later
        `Admit` of it)."""
        d = held.assignment.decode_worker
        if held.admitted:
            held.move(Status.REQUEUING, now_s)
            self._send(member_name(DECODE, d), Abort(held.request.id, "its prefill worker ended"))
            return
        if held in self._ahead[d]:
            self._ahead[d].remove(held)
        self._requeue(held, now_s)

    def _requeue(self, held: OpenRequest, now_s: float) -> None:
        """Back in the queue in its arrival order, as it arrived (its pages free)."""
        self._ledger = self._ledger.released(held.assignment)
        held.assignment = held.prefill_done = held.finished = None
        held.move(Status.WAITING, now_s)
        at = next((i for i, h in enumerate(self._waiting) if h.order > held.order),
                  len(self._waiting))
        self._waiting.insert(at, held)

    def expire(self, now_s: float) -> None:
        """Fail the requests past their deadline: `timeout` s since their arrival (None: none)."""
        for held in [h for h in self._open.values() if self._timeout is not None
                     and now_s - h.lifecycle[0].t_s > self._timeout]:
            self._stop(held, now_s, error=f"past its deadline, {self._timeout:g} s after its "
                                          "arrival")
        self._assign(now_s)

    def abort(self, request_ids: Iterable[int], why: str, now_s: float) -> None:
        """End these requests now, wherever each is, as aborted (`why`: one line, e.g. their
        clients left; not a failure); one that ended, or never arrived, is left as it is. All
        end before any queued request takes what they free, so a queued one among them is
        never prefilled."""
        for request_id in request_ids:
            if (held := self._open.get(request_id)) is not None:
                self._stop(held, now_s, aborted=why)
        self._assign(now_s)

    def abort_all(self, why: str, now_s: float) -> None:
        """End every open request now, failed with `why` (the server stops)."""
        for held in list(self._open.values()):
            self._stop(held, now_s, error=why)

    def _stop(self, held: OpenRequest, now_s: float, error: str | None = None,
              aborted: str | None = None) -> None:
        """End the request now, failed (`error`) or aborted: it leaves every queue, and each
        worker that holds it is sent an `Abort` (its pages come back with its `Finished`)."""
        if held in self._waiting:
            self._waiting.remove(held)
        if (a := held.assignment) is not None:
            if held in self._ahead[a.decode_worker]:
                self._ahead[a.decode_worker].remove(held)
            if held.prefill_done is None:
                self._send(member_name(PREFILL, a.prefill_worker), Abort(held.request.id,
                                                                         error or aborted))
            if held.admitted:
                self._send(member_name(DECODE, a.decode_worker), Abort(held.request.id,
                                                                       error or aborted))
        self._end(held, Status.ABORTED if error is None else Status.ERROR, now_s, error,
                  aborted)

    def _end(self, held: OpenRequest, status: Status, now_s: float, error: str | None = None,
             aborted: str | None = None) -> None:
        """Its record ends in `status` (its decode worker may still report it: `_late`)."""
        held.move(status, now_s)
        del self._open[held.request.id]
        self._ledger = self._ledger.released(held.assignment)
        if held.admitted:
            self._ended[held.request.id] = (held.assignment.decode_worker, held.pages)
        self.served.append(Served(held.request, self._policy.name, self._rate,
                                  tuple(held.token_times_s), held.assignment, held.finished,
                                  error, held.prefill_done, tuple(held.lifecycle), aborted))
        if self._on_served is not None:
            self._on_served(self.served[-1])


class Workers(Protocol):
    """What the loop drives: a `launch.group.Group` (or its stand-in in a test)."""

    def send(self, name: str, message: object) -> bool: ...

    def poll(self, timeout: float | None = 0.0) -> list[Event]: ...


class Arrivals(Protocol):
    """Where the loop's requests come from: a generated stream (`Scheduled`) or clients."""

    @property
    def ended(self) -> bool:
        """No request will arrive after those taken."""

    def take(self, now_s: float, all_now: bool) -> list[ServeRequest]:
        """The requests arrived by `now_s` on the run clock (`all_now`: every one still to
        come, now: no pair is left to serve them)."""

    def wait_s(self, now_s: float) -> float:
        """How long the loop may wait for workers before the next arrival is due."""

    def cancelled(self) -> list[int]:
        """The ids of the requests taken whose clients left since the last call."""


class Scheduled:
    """A generated stream: each request arrives `arrival_s` after the loop's start."""

    def __init__(self, requests: Sequence[ServeRequest]) -> None:
        if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:], strict=False)):
            raise ValueError("requests must come in arrival order")
        self._requests, self._next = list(requests), 0

    @property
    def ended(self) -> bool:
        return self._next == len(self._requests)

    def take(self, now_s: float, all_now: bool) -> list[ServeRequest]:
        start = self._next
        while not self.ended and (all_now or self._requests[self._next].arrival_s <= now_s):
            self._next += 1
        return self._requests[start:self._next]

    def wait_s(self, now_s: float) -> float:
        return POLL_S if self.ended else self._requests[self._next].arrival_s - now_s

    def cancelled(self) -> list[int]:
        return []  # a generated stream's clients never leave


def drive(workers: Workers, router: Router, arrivals: Arrivals,
          on_item: Callable[[Event], None] | None = None,
          clock: Callable[[], float] = time.monotonic,
          abort: Callable[[], str | None] | None = None) -> list[Served]:
    """Serve what `arrivals` brings through `router` to its end: each request arrives at the
    router when it is due on `clock` (time since the start), the workers' events reach the
    router as they come (each first shown to `on_item`: progress, records), a request whose
    client left is aborted, requests past their deadline fail, and, once `abort()` gives a
    reason at a turn, every open request fails with it.
    Every request ends `Served`, in the order they ended."""
    start = clock()
    while not (arrivals.ended and router.done):
        now = clock() - start
        for request in arrivals.take(now, not router.serving):
            router.arrive(request, now)
        router.abort(arrivals.cancelled(), "client disconnected", now)
        wait = min(max(0.0, arrivals.wait_s(now)), POLL_S)
        for event in workers.poll(wait):
            if on_item is not None:
                on_item(event)
            now = clock() - start
            if isinstance(event, MemberEnded):
                router.on_ended(event.name, event.failure or f"{event.name} ended", now)
            elif isinstance(event, Emitted):
                router.on_item(event.name, event.item, now)
        router.expire(clock() - start)
        if abort is not None and (why := abort()) is not None:
            router.abort_all(why, clock() - start)
    return router.served
