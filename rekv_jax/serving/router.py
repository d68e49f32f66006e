"""The router of a serving run: it owns the requests from arrival to their last token, asks its
policy how to hand each off, and tells the workers (the launching process; no JAX work here).

A request that arrives waits in one first-come-first-served queue until a decode worker has the
pages it will ever need (its prompt plus its new tokens, `PoolConfig.pages_for`); the router
counts each decode worker's free pages itself (taken at assignment, given back when the worker
reports the request `Finished`, after the worker has freed them), so it never sends an `Admit`
the worker cannot take and nothing waits on a round trip. The policy then chooses the mode and
the worker pair among the live pairs whose decode worker has the pages, and the router sends the
prefill worker its `Prefill` and the decode worker its `Admit` at once.

Faults stay with their requests: a decode worker that ends fails the requests it held, one line
each; a prefill worker that ends takes no new requests (the decode worker reports the ones it
was handing off, which fail or fall back to recomputation); a request that hears nothing for
`timeout` s fails (no run waits forever). Nothing is dropped: every request ends `Served`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from rekv_jax.launch.child import DECODE, PREFILL, member_name, parse_member
from rekv_jax.launch.group import Emitted, Event, MemberEnded
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.policy import Policy
from rekv_jax.serving.requests import (
    Admit,
    Assignment,
    Finished,
    Held,
    Load,
    Prefill,
    PrefillDone,
    ServeRequest,
    Token,
)

POLL_S = 0.5  # the longest the loop waits for a worker before it looks at the clock again


@dataclasses.dataclass
class _Open:
    """A request the router holds: arrived, perhaps assigned, not yet ended."""

    request: ServeRequest
    pages: int
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    assignment: Assignment | None = None  # once chosen
    heard_s: float = 0.0  # when the router last heard of it (run clock)
    prefill_done: PrefillDone | None = None  # its prefill worker's report, once it came


class Router:
    """One stream of requests under one policy, on the workers `send` reaches (`member_name`s).

    The caller feeds it arrivals (`arrive`), what workers emit (`on_item`) and workers' ends
    (`on_ended`), each with the run clock's `now_s`, and calls `expire` now and then; `done`
    once every arrived request ended, each in `served` (in the order they ended) and handed to
    `on_served` as it ends; each `Assignment` is handed to `on_assigned` once its `Prefill` is
    sent (again if its decode worker holds it and it is assigned anew)."""

    def __init__(self, policy: Policy, ledger: Ledger, pool: PoolConfig, costs: DecodeCosts,
                 send: Callable[[str, object], bool], rate: float, timeout: float,
                 on_served: Callable[[Served], None] | None = None,
                 on_assigned: Callable[[Assignment], None] | None = None) -> None:
        self._policy, self._ledger, self._pool, self._costs = policy, ledger, pool, costs
        self._on_served, self._on_assigned = on_served, on_assigned
        self._send, self._rate, self._timeout = send, rate, timeout
        self._free = [pool.usable_pages] * len(ledger.decode)  # per decode worker
        self._live = {PREFILL: set(range(len(ledger.prefill))),
                      DECODE: set(range(len(ledger.decode)))}
        self._waiting: collections.deque[_Open] = collections.deque()  # FCFS, unassigned
        self._open: dict[int, _Open] = {}  # every request held, by id
        # requests the router ended before their worker did: (decode worker, pages) by id
        self._ended: dict[int, tuple[int, int]] = {}
        self.served: list[Served] = []

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

    def arrive(self, request: ServeRequest, now_s: float) -> None:
        """A request arrived: queue it, then assign what the workers can take."""
        if request.id in self._open:
            raise ValueError(f"request {request.id} arrived twice")
        held = _Open(request, self._pool.pages_for(request.prompt_len + request.max_new_tokens),
                     heard_s=now_s)
        self._open[request.id] = held
        self._ledger = self._ledger.arrived(now_s)
        if held.pages > self._pool.usable_pages:
            return self._end(held, f"needs {held.pages} pages of {self._pool.page_size} "
                                   f"positions; a decode worker has {self._pool.usable_pages}")
        self._waiting.append(held)
        self._assign(now_s)

    def _assign(self, now_s: float) -> None:
        """Assign queued requests, first come first served, while a live pair has the pages."""
        while self._waiting:
            if not self._live[PREFILL] or not self._live[DECODE]:
                side = PREFILL if not self._live[PREFILL] else DECODE
                return self._end(self._waiting.popleft(), f"no {side} worker is left")
            held = self._waiting[0]
            pairs = [(p, d) for p, d in self._ledger.pairs() if p in self._live[PREFILL]
                     and d in self._live[DECODE] and self._free[d] >= held.pages]
            if not pairs:
                return  # it waits for pages (a `Finished` calls again)
            self._waiting.popleft()
            self._start(held, pairs, now_s)

    def _start(self, held: _Open, pairs: list[tuple[int, int]], now_s: float) -> None:
        """Choose the request's mode and pair, take its pages and send its `Prefill`, then its
        `Admit`. A worker that has ended (its send fails) is no longer chosen: the request is
        queued again first, or fails if its decode worker was the one."""
        r = held.request
        a = self._policy.choose(r, self._ledger, now_s, pairs)
        p, d = a.prefill_worker, a.decode_worker
        if not self._send(member_name(PREFILL, p), Prefill(r.id, r.tokens, a.mode, d,
                                                           r.sampling)):
            self._live[PREFILL].discard(p)
            return self._waiting.appendleft(held)
        held.assignment, held.heard_s = a, now_s
        if self._on_assigned is not None:
            self._on_assigned(a)
        self._ledger = self._ledger.assigned(a, now_s)
        self._free[d] -= held.pages
        if not self._send(member_name(DECODE, d), Admit(r.id, r.prompt_len, r.max_new_tokens,
                                                       a.mode, p, a.why.predicted.decode_busy_ms,
                                                       r.sampling, r.stops)):
            self._live[DECODE].discard(d)
            self._end(held, f"decode worker {d} has ended")

    def on_item(self, name: str, item: object, now_s: float) -> None:
        """What worker `name` emitted, as it reached the router at `now_s`."""
        _, index = parse_member(name)
        if isinstance(item, Token | Finished | Held) and item.request_id not in self._open:
            return self._late(name, item, now_s)
        if isinstance(item, Token):
            held = self._open[item.request_id]
            if item.index != len(held.token_times_s):
                raise ValueError(f"{name}: token {item.index} of request {item.request_id} "
                                 f"came after {len(held.token_times_s)}")
            held.token_times_s.append(now_s)
            held.heard_s = now_s
        elif isinstance(item, Finished):
            self._finished(index, item, now_s)
        elif isinstance(item, PrefillDone):
            self._prefill_done(item, now_s)
        elif isinstance(item, Load):
            self._ledger = self._ledger.loaded(item, now_s, self._costs)
        elif isinstance(item, Held):  # the worker has fewer pages than counted: wait for them
            held = self._open[item.request_id]
            self._free[index] = min(self._free[index] + held.pages, item.free_pages)
            self._waiting.appendleft(held)
        else:
            raise ValueError(f"{name} emitted {type(item).__name__}, which a router does not "
                             "take")

    def _late(self, name: str, item: Token | Finished | Held, now_s: float) -> None:
        """A report of a request the router already ended: a `Finished` gives its pages back;
        one of a request it never held is an error."""
        if item.request_id not in self._ended:
            raise ValueError(f"{name} reported request {item.request_id}, which is not open")
        if isinstance(item, Finished | Held):
            decode, pages = self._ended.pop(item.request_id)
            self._free[decode] += pages
            self._assign(now_s)

    def _finished(self, decode: int, item: Finished, now_s: float) -> None:
        held = self._open[item.request_id]
        self._free[decode] += held.pages
        self._end(held, None, item)
        self._assign(now_s)

    def _prefill_done(self, item: PrefillDone, now_s: float) -> None:
        self._ledger = self._ledger.prefill_done(item, now_s)
        held = self._open.get(item.request_id)
        if held is None:
            return  # the decode worker reports the request's end either way
        if item.error is not None:
            held.prefill_done = item
            return
        held.heard_s, held.prefill_done = now_s, item
        d = held.assignment.decode_worker
        self._ledger = self._ledger.link_timed(item.worker, d, item.sent_bytes, item.link_ms)

    def on_ended(self, name: str, how: str, now_s: float) -> None:
        """Worker `name` ended (`how`: one line): a decode worker's requests fail; a prefill
        worker takes no more (its requests end as their decode worker reports)."""
        role, index = parse_member(name)
        self._live[role].discard(index)
        if role == DECODE:
            for held in [h for h in self._open.values() if h.assignment is not None
                         and h.assignment.decode_worker == index]:
                self._end(held, f"decode worker {index} ended: {how}")
        self._assign(now_s)

    def expire(self, now_s: float) -> None:
        """Fail the assigned requests nothing was heard of for `timeout` s."""
        for held in [h for h in self._open.values() if h.assignment is not None
                     and now_s - h.heard_s > self._timeout]:
            self._end(held, f"nothing heard of it for {self._timeout:g} s")

    def abort(self, why: str) -> None:
        """End every open request now, failed with `why` (the server stops); a worker's later
        report of one gives its pages back."""
        self._waiting.clear()
        for held in list(self._open.values()):
            self._end(held, why)

    def _end(self, held: _Open, error: str | None, finished: Finished | None = None) -> None:
        del self._open[held.request.id]
        if held.assignment is not None and finished is None:  # its worker may still report it
            self._ended[held.request.id] = (held.assignment.decode_worker, held.pages)
        self.served.append(Served(held.request, self._policy.name, self._rate,
                                  tuple(held.token_times_s), held.assignment, finished, error,
                                  held.prefill_done))
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
        ...

    def take(self, now_s: float, all_now: bool) -> list[ServeRequest]:
        """The requests arrived by `now_s` on the run clock (`all_now`: every one still to
        come, now: no pair is left to serve them)."""
        ...

    def wait_s(self, now_s: float) -> float:
        """How long the loop may wait for workers before the next arrival is due."""
        ...


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


def drive(workers: Workers, router: Router, arrivals: Arrivals,
          on_item: Callable[[Event], None] | None = None,
          clock: Callable[[], float] = time.monotonic,
          abort: Callable[[], str | None] | None = None) -> list[Served]:
    """Serve what `arrivals` brings through `router` to its end: each request arrives at the
    router when it is due on `clock` (time since the start), the workers' events reach the
    router as they come (each first shown to `on_item`: progress, records), silent requests
    expire, and, once `abort()` gives a reason at a turn, every open request fails with it.
    Every request ends `Served`, in the order they ended."""
    start = clock()
    while not (arrivals.ended and router.done):
        now = clock() - start
        for request in arrivals.take(now, not router.serving):
            router.arrive(request, now)
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
            router.abort(why)
    return router.served
