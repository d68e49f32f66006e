"""Random event sequences through a `Router` on fake workers that keep the workers' side of the
contract (a decode worker holds the pages of each `Admit` until it reports the request
`Finished`, answers an `Abort` of a request it holds with `Finished` "abort"; a prefill worker
reports each `Prefill` it was sent): arrivals, prefills done or failed, tokens, finishes,
aborts, worker losses and the clock. After every event only legal transitions happened, each
live decode worker's pages are conserved and never overcommitted, no request ended twice, and
no request was prefilled or admitted after it ended; once the workers drain, every request
ended exactly once and every page is back."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router import router

from rekv_jax.launch.child import member_name, parse_member
from rekv_jax.serving.lifecycle import ENDS, Status, Transition, move
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.requests import (
    Abort,
    Admit,
    Finished,
    Prefill,
    PrefillDone,
    Prefilled,
    ServeRequest,
    Token,
)

# The moves the lifecycle's docstring describes, stated here apart from `lifecycle.LEGAL` (the
# table `move` enforces), so that neither a looser table nor a router that moves around it
# passes: waiting -> prefilling -> prefilled -> sent -> decoding -> an end; the first token may
# come before either prefill report; a prefill worker's end sends a request back to waiting, at
# once or through requeuing; every status that is not an end can end aborted or in error.
W, P, F, S, D, Q = (Status.WAITING, Status.PREFILLING, Status.PREFILLED, Status.SENT,
                    Status.DECODING, Status.REQUEUING)
DOCUMENTED = frozenset({
    (W, P), (P, F), (P, S), (P, D), (P, Q), (P, W), (F, S), (F, D), (F, Q), (F, W), (S, D),
    (Q, W), (D, Status.LENGTH), (D, Status.STOP),
    *((a, end) for a in (W, P, F, S, D, Q) for end in (Status.ABORTED, Status.ERROR))})
POOL = PoolConfig(num_pages=1 + 20)  # a 256 + 32-token request takes 18 pages, 100 + 8 take 7
SIZES = ((256, 32), (256, 32), (100, 8), (40, 3), (600, 4))  # (prompt, new); 600: never fits
TIMEOUT = 10.0
WORKERS = 2  # of each role
# the events (a method of `World` and its arguments after `pick`), arrivals the commonest
KINDS = (*[("arrive",)] * 4, ("compute",), ("prefill_done",), ("prefill_done", True),
         *[("token",)] * 2, ("token", "stop"), ("token", "error"), ("take_abort",), ("abort",),
         ("lose", "prefill"), ("lose", "decode"), ("tick",))


@dataclasses.dataclass
class Decode:
    """A fake decode worker: what it holds (its pages and tokens so far) and its inbox's
    `Abort`s, taken in order when told."""

    held: dict[int, tuple[Admit, int]] = dataclasses.field(default_factory=dict)  # id: (, n)
    aborts: list[int] = dataclasses.field(default_factory=list)

    def used(self) -> int:
        return sum(POOL.pages_for(a.prompt_len + a.max_new_tokens) for a, _ in self.held.values())


class World:
    """The router and its fake workers, and what the test checks after each event."""

    def __init__(self) -> None:
        self.router, _ = router(prefill=WORKERS, decode=WORKERS, timeout=TIMEOUT,
                                pool=POOL)
        self.router._send = self.send
        self.now, self.arrived = 0.0, 0
        self.dead: set[str] = set()
        self.prefills: list[list[int]] = [[] for _ in range(WORKERS)]  # ids sent, unreported
        self.computed: list[set[int]] = [set() for _ in range(WORKERS)]  # of those: Prefilled
        self.aborted_prefill: set[int] = set()  # ids a prefill worker was told to drop
        self.decodes = [Decode() for _ in range(WORKERS)]
        self.ended: set[int] = set()  # ids whose record ended
        self.prefilled: set[int] = set()  # ids a prefill worker was sent

    def send(self, name: str, message: object) -> bool:
        if name in self.dead:
            return False
        role, index = parse_member(name)
        rid = message.request_id
        assert not (isinstance(message, Prefill | Admit) and rid in self.ended), message
        if isinstance(message, Prefill):
            self.prefills[index].append(rid)
            self.prefilled.add(rid)
        elif isinstance(message, Admit):
            # its inbox is FIFO: an `Abort` of this id sent before is taken first, and finds
            # nothing (a worker holds an id once), so it is ignored
            assert rid not in self.decodes[index].held
            self.decodes[index].aborts = [a for a in self.decodes[index].aborts if a != rid]
            self.decodes[index].held[rid] = (message, 0)
            assert self.decodes[index].used() <= POOL.usable_pages  # every Admit fits
        elif isinstance(message, Abort) and role == "decode":
            self.decodes[index].aborts.append(rid)
        elif isinstance(message, Abort):
            self.aborted_prefill.add(rid)
        return True

    def emit(self, name: str, item: object) -> None:
        self.now += 0.01
        self.router.on_item(name, item, self.now)

    # -- events ------------------------------------------------------------------------------

    def arrive(self, pick: int) -> None:
        n, new = SIZES[pick % len(SIZES)]
        self.now += 0.01
        self.router.arrive(ServeRequest(self.arrived, (1,) * n, new, self.now), self.now)
        self.arrived += 1

    def compute(self, pick: int) -> None:
        """A prefill worker's device is done with its oldest prompt not yet computed."""
        live = [p for p in range(WORKERS) if set(self.prefills[p]) - self.computed[p]
                and f"prefill-{p}" not in self.dead]
        if live:
            p = live[pick % len(live)]
            rid = next(r for r in self.prefills[p] if r not in self.computed[p])
            self.computed[p].add(rid)
            self.emit(member_name("prefill", p), Prefilled(rid, p, 1.0))

    def prefill_done(self, pick: int, fail: bool = False) -> None:
        """A prefill worker reports its oldest request (`Prefilled` first, once per request)."""
        live = [p for p in range(WORKERS) if self.prefills[p] and f"prefill-{p}" not in self.dead]
        if live:
            p = live[pick % len(live)]
            rid = self.prefills[p].pop(0)  # first come first served
            if rid not in self.computed[p]:
                self.emit(member_name("prefill", p), Prefilled(rid, p, 0.0))
            self.computed[p].discard(rid)
            error = "boom" if fail or rid in self.aborted_prefill else None
            self.emit(member_name("prefill", p), PrefillDone(rid, p, 1.0, 1.0, 1000, error))

    def token(self, pick: int, finish: str | None = None) -> None:
        held = [(d, rid) for d, dec in enumerate(self.decodes) if f"decode-{d}" not in self.dead
                for rid in dec.held]
        if not held:
            return
        d, rid = held[pick % len(held)]
        admit, n = self.decodes[d].held[rid]
        if n == admit.max_new_tokens or finish == "error" or (finish == "stop" and n):
            return self.finish(d, rid, finish or "length")
        self.decodes[d].held[rid] = (admit, n + 1)  # a stop comes after a token
        self.emit(member_name("decode", d), Token(rid, n, 7, 0.0))

    def finish(self, d: int, rid: int, how: str) -> None:
        _, n = self.decodes[d].held.pop(rid)
        error = "lost its prefix" if how == "error" else None
        self.emit(member_name("decode", d), Finished(rid, (7,) * n, 0.1, 0.01, 1.0, None, "",
                                                     False, error, "length" if error else how))

    def take_abort(self, pick: int) -> None:
        live = [d for d in range(WORKERS) if self.decodes[d].aborts
                and f"decode-{d}" not in self.dead]
        if live:
            d = live[pick % len(live)]
            rid = self.decodes[d].aborts.pop(0)
            if rid in self.decodes[d].held:  # else it ignores it
                self.finish(d, rid, "abort")

    def abort(self, pick: int) -> None:
        """Abort an open request, or now and then one that ended."""
        ids = sorted(set(range(self.arrived)) - self.ended) if pick % 4 else range(self.arrived)
        if ids:
            self.now += 0.01
            self.router.abort([ids[pick % len(ids)]], "client disconnected", self.now)

    def lose(self, pick: int, role: str) -> None:
        name = member_name(role, pick % WORKERS)
        if pick < 100 and name not in self.dead:  # rarely: a worker ends for good
            self.dead.add(name)
            self.now += 0.01
            self.router.on_ended(name, "killed by SIGKILL", self.now)

    def tick(self, pick: int) -> None:
        self.now += (pick % 16) * TIMEOUT / 14  # now and then past a deadline
        self.router.expire(self.now)

    def step(self, kind: int, pick: int) -> None:
        """Event `kind` (`KINDS`), `pick` choosing what it acts on."""
        getattr(self, KINDS[kind][0])(pick, *KINDS[kind][1:])
        self.check()

    # -- checks ------------------------------------------------------------------------------

    def check(self) -> None:
        ids = [s.request.id for s in self.router.served]
        assert len(ids) == len(set(ids)), "a request ended twice"
        for s in self.router.served[len(self.ended):]:
            statuses = [t.status for t in s.lifecycle]
            assert statuses[0] == Status.WAITING and statuses[-1] in ENDS
            assert set(zip(statuses, statuses[1:], strict=False)) <= DOCUMENTED, statuses
            times = [t.t_s for t in s.lifecycle]
            assert times == sorted(times)
            assert (s.status == Status.ABORTED) == (s.aborted is not None)
            self.ended.add(s.request.id)
        booked = [x.request_id for q in self.router.ledger.decode for x in q.slack]
        assert len(booked) == len(set(booked)) and self.ended.isdisjoint(booked)  # TPOT slack
        for d, dec in enumerate(self.decodes):
            if f"decode-{d}" not in self.dead:  # pages conserved: counted free + held = all
                assert self.router.free_pages[d] + dec.used() == POOL.usable_pages
                assert self.router.ledger.decode[d].held_pages == dec.used()  # as the ledger sees

    def drain(self) -> None:
        """Every live worker does all it was told, until the router is done."""
        for _ in range(50):
            for p in range(WORKERS):
                while self.prefills[p] and f"prefill-{p}" not in self.dead:
                    self.prefill_done(p)
            for d in range(WORKERS):
                while self.decodes[d].aborts and f"decode-{d}" not in self.dead:
                    self.take_abort(d)
                while self.decodes[d].held and f"decode-{d}" not in self.dead:
                    self.token(0)
            self.check()
            if self.router.done:
                return


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(KINDS) - 1), st.integers(0, 1000)), min_size=20,
                max_size=100))
def test_random_event_sequences_keep_every_requests_lifecycle(events):
    world = World()
    for kind, pick in events:
        world.step(kind, pick)
    world.drain()
    assert world.router.done
    assert sorted(s.request.id for s in world.router.served) == list(range(world.arrived))
    assert not any(q.slack for q in world.router.ledger.decode)  # every slack released
    for d in range(WORKERS):
        if f"decode-{d}" not in world.dead:
            assert world.router.free_pages[d] == POOL.usable_pages
    for s in world.router.served:  # one that ended before it was assigned never was prefilled
        if Status.PREFILLING not in [t.status for t in s.lifecycle]:
            assert s.request.id not in world.prefilled and s.assignment is None


@pytest.mark.parametrize("at", list(Status))
def test_a_move_the_lifecycle_does_not_describe_is_refused(at):
    """From each status, `move` takes exactly the documented moves and refuses every other
    one with a ValueError naming both statuses, the lifecycle left as it was."""
    for to in Status:
        lifecycle = [Transition(W, 0.0), Transition(at, 1.0)]
        if (at, to) in DOCUMENTED:
            move(lifecycle, to, 2.0)
            assert lifecycle[-1] == Transition(to, 2.0) and len(lifecycle) == 3
        else:
            with pytest.raises(ValueError, match=f"from {at.value} to {to.value}"):
                move(lifecycle, to, 2.0)
            assert lifecycle == [Transition(W, 0.0), Transition(at, 1.0)]
