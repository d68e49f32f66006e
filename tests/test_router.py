"""The router's bookkeeping (pure Python, workers faked): pages counted before each Admit, first
come first served (prefilled ahead of its pages up to `PREFILL_AHEAD`), every request ends
served, faults stay with their requests, aborts and deadlines end one request wherever it is."""

import dataclasses

import pytest
from test_queueing import _tiny7b_profile
from test_serving_policy import COSTS

from rekv_jax.launch.child import member_name, parse_member
from rekv_jax.phases import Phases
from rekv_jax.serving.ledger import Ledger, Setting, Timed
from rekv_jax.serving.lifecycle import Status
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.policy import Context, make_policies
from rekv_jax.serving.requests import (
    Abort,
    Admit,
    Finished,
    Load,
    Prefill,
    PrefillDone,
    Prefilled,
    Ready,
    ServeRequest,
    Token,
)
from rekv_jax.serving.router import PREFILL_AHEAD, Router, Scheduled
from rekv_jax.serving.sampling import Sampling, Stops

POOL = PoolConfig(num_pages=1 + 2 * 18)  # two requests of 256 + 32 tokens (18 pages each)


class Workers:
    """What the router sent, per worker."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    def send(self, name, message):
        self.sent.append((name, message))
        return True

    def to(self, name, kind):
        return [m for n, m in self.sent if n == name and isinstance(m, kind)]


def router(policy="q8:full", prefill=1, decode=1, timeout=10.0, on_assigned=None, pool=POOL):
    ctx = Context("tiny-7b", 28, (_tiny7b_profile(),), COSTS)
    (p,) = make_policies([policy], ctx)
    workers = Workers()
    r = Router(p, Ledger.idle(prefill, decode, 0.01), pool, COSTS, workers.send, 1.0, timeout,
               on_assigned=on_assigned)
    return r, workers


def request(i, n=256, new=32, at=0.0):
    return ServeRequest(i, (1,) * n, new, at)


def finish(r, i, decode=0, n=32, now=1.0, reported=True, prefill=0):
    """Request i's prefill worker reports its handoff sent (unless `reported`), then its decode
    worker its n tokens and its end."""
    if reported:
        r.on_item(f"prefill-{prefill}", PrefillDone(i, prefill, 1.0, 1.0, 1000), now)
    for k in range(n):
        r.on_item(member_name("decode", decode), Token(i, k, 7, now), now)
    r.on_item(member_name("decode", decode), Finished(i, (7,) * n, 0.1, 0.01, 50.0, None,
                                                      "bitwise", False), now)


def test_a_requests_sampling_and_stops_reach_its_workers():
    """The prefill worker draws a transfer-only first token with the request's sampling; the
    decode worker draws the rest and decides its ends: each gets what the request says."""
    r, w = router()
    sampling, stops = Sampling(0.7, 0.9, 40, seed=2**62, logprobs=2), Stops(("\n",), (5,))
    r.arrive(dataclasses.replace(request(0), sampling=sampling, stops=stops), 0.0)
    (prefill,), (admit,) = w.to("prefill-0", Prefill), w.to("decode-0", Admit)
    assert prefill.sampling == admit.sampling == sampling and admit.stops == stops


def test_admits_what_the_pages_hold_and_the_rest_waits_in_order():
    r, w = router()
    for i in range(4):
        r.arrive(request(i, at=0.1 * i), 0.1 * i)
    r.arrive(request(4, at=0.4), 0.4)
    admitted = [m.request_id for m in w.to("decode-0", Admit)]
    assert admitted == [0, 1]  # 2 x 18 pages fill the pool
    assert PREFILL_AHEAD == 2  # the next two are prefilled ahead of their pages
    assert [m.request_id for m in w.to("prefill-0", Prefill)] == [0, 1, 2, 3]
    assert w.to("prefill-0", Prefill)[0].tokens == request(0).tokens
    # a `Prefill` says whether its `Admit` went with it (its streamed prefill computes at once)
    assert [m.admitted for m in w.to("prefill-0", Prefill)] == [True, True, False, False]
    finish(r, 1)
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 1, 2]
    assert [m.request_id for m in w.to("prefill-0", Prefill)] == [0, 1, 2, 3, 4]
    assert not w.to("prefill-0", Prefill)[4].admitted  # 3 is ahead of it
    for i in (0, 2, 3, 4):
        finish(r, i)
    assert r.done and sorted(s.request.id for s in r.served) == [0, 1, 2, 3, 4]
    assert all(s.completed and s.ttft_ms is not None for s in r.served)
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 1, 2, 3, 4]


def test_a_request_ends_once_both_sides_reported_or_its_prefill_worker_ended():
    """A decode worker may finish a request before its prefill worker's report reaches the
    router (that worker is busy computing the next prompt): the request ends at the report, and
    its record holds the prefill side's times; a prefill worker that ends instead ends it at
    once, as its decode worker reported it."""
    r, _ = router()
    r.arrive(request(0), 0.0)
    r.arrive(request(1), 0.0)
    finish(r, 0, reported=False)
    assert not r.served and r.free_pages == (18,)  # its pages are back; request 1 holds 18
    r.on_item("prefill-0", PrefillDone(0, 0, 20.0, 100.0, 1_000_000), 1.5)
    (done,) = r.served
    assert done.completed and done.prefill_done.link_ms == 100.0
    assert done.lifecycle[-1].t_s == 1.5
    finish(r, 1, reported=False)
    r.on_ended("prefill-0", "killed by SIGKILL", 2.0)
    assert r.done and r.served[-1].completed and r.served[-1].prefill_done is None


def test_a_request_larger_than_a_pool_fails_alone_at_once():
    r, w = router()
    r.arrive(request(0, n=600), 0.0)
    r.arrive(request(1), 0.0)
    (big,) = [s for s in r.served if s.request.id == 0]
    assert "pages" in big.error and not w.to("decode-0", Admit)[1:]
    assert [m.request_id for m in w.to("decode-0", Admit)] == [1]


def test_a_dead_decode_worker_fails_its_requests_and_the_other_takes_the_rest():
    r, w = router(decode=2)
    for i in range(3):
        r.arrive(request(i), 0.0)
    on = {m.request_id: d for d in (0, 1) for m in w.to(f"decode-{d}", Admit)}
    assert len(on) == 3
    dead = on[0]
    r.on_ended(member_name("decode", dead), "killed by SIGKILL", 0.5)
    failed = {s.request.id for s in r.served if s.error and "killed" in s.error}
    assert failed == {i for i, d in on.items() if d == dead}
    r.arrive(request(3), 0.6)
    assert w.to(f"decode-{1 - dead}", Admit)[-1].request_id == 3
    for i, d in on.items():
        if d != dead:
            finish(r, i, decode=d)
    finish(r, 3, decode=1 - dead)
    assert r.done and len(r.served) == 4


def test_with_no_prefill_worker_left_its_unsent_requests_fail_once_dropped():
    """Prefill-0 ends: request 0 (its handoff sent) ends as its decode worker reports; request 1
    (admitted, not sent) goes again once its decode worker dropped it, and finds no prefill
    worker; request 2 (prefilled ahead of its pages) goes again at once, and fails too."""
    r, w = router()
    for i in range(3):
        r.arrive(request(i), 0.0)
    r.on_item("prefill-0", PrefillDone(0, 0, 1.0, 1.0, 1000), 0.1)
    r.on_ended("prefill-0", "exit 1: boom", 0.2)
    assert [s.request.id for s in r.served] == [2]
    assert "no prefill worker" in r.served[0].error
    assert [m.request_id for m in w.to("decode-0", Abort)] == [1]
    r.on_item("decode-0", Token(1, 0, 7, 0.25), 0.25)  # of the dropped attempt: not counted
    r.on_item("decode-0", Finished(1, (7,), 0.0, 0.0, 0.0, None, "", False, None, "abort"), 0.3)
    assert [s.request.id for s in r.served] == [2, 1] and "no prefill" in r.served[1].error
    finish(r, 0, now=0.4)
    assert r.done and [s.completed for s in r.served] == [False, False, True]
    assert r.free_pages == (POOL.usable_pages,)


def test_a_dead_prefill_workers_request_goes_again_on_the_other_once_dropped():
    assigned = []
    r, w = router(prefill=2, on_assigned=assigned.append)
    r.arrive(request(0), 0.0)
    (p,) = [k for k in (0, 1) if w.to(f"prefill-{k}", Prefill)]
    r.on_ended(f"prefill-{p}", "killed by SIGKILL", 0.1)
    assert w.to("decode-0", Abort) == [Abort(0, "its prefill worker ended")]
    assert not w.to(f"prefill-{1 - p}", Prefill)  # not before its decode worker dropped it
    r.on_item("decode-0", Finished(0, (), 0.0, 0.0, 0.0, None, "", False, None, "abort"), 0.2)
    assert [m.request_id for m in w.to(f"prefill-{1 - p}", Prefill)] == [0]
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 0]
    assert [a.prefill_worker for a in assigned] == [p, 1 - p]  # told of each assignment
    finish(r, 0, now=0.5, prefill=1 - p)
    (s,) = r.served
    assert s.completed and s.assignment.prefill_worker == 1 - p
    assert [t.status for t in s.lifecycle] == [
        Status.WAITING, Status.PREFILLING, Status.REQUEUING, Status.WAITING, Status.PREFILLING,
        Status.SENT, Status.DECODING, Status.LENGTH]
    assert [t.t_s for t in s.lifecycle] == [0.0, 0.0, 0.1, 0.2, 0.2, 0.5, 0.5, 0.5]


def test_a_request_past_its_deadline_fails_and_its_late_finish_frees_its_pages():
    r, w = router(timeout=1.0)
    r.arrive(request(0), 0.0)
    r.arrive(request(1), 0.5)
    r.arrive(request(2), 0.5)  # prefilled ahead of its pages
    r.on_item("decode-0", Token(0, 0, 7, 0.9), 0.9)
    r.expire(1.2)
    assert [s.request.id for s in r.served] == [0]  # heard of lately, yet past its deadline
    (late,) = r.served
    assert "deadline" in late.error and late.failure == late.error
    assert w.to("decode-0", Abort) == w.to("prefill-0", Abort) == [Abort(0, late.error)]
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 1]  # 0's pages: the worker's
    r.on_item("decode-0", Finished(0, (7,), 0.1, 0.1, 1.0, None, "", False, None, "abort"), 1.3)
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 1, 2]
    with pytest.raises(ValueError, match="not open"):
        r.on_item("decode-0", Token(9, 0, 7, 1.4), 1.4)


def test_an_abort_ends_one_request_wherever_it_is_and_a_queued_one_is_never_prefilled():
    r, w = router()
    for i in range(5):  # 0, 1 admitted; 2, 3 prefilled ahead of their pages; 4 queued
        r.arrive(request(i), 0.0)
    r.abort([4], "client disconnected", 0.1)
    r.abort([2], "client disconnected", 0.1)
    r.on_item("decode-0", Token(0, 0, 7, 0.2), 0.2)
    r.abort([0], "client disconnected", 0.3)
    assert [s.request.id for s in r.served] == [4, 2, 0]
    for s in r.served:
        assert s.status == Status.ABORTED and s.aborted == "client disconnected"
        assert s.failure is None and s.finish_reason == "abort" and not s.completed
        assert s.to_json()["finish_reason"] == "abort"
    assert [m.request_id for m in w.to("prefill-0", Prefill)] == [0, 1, 2, 3]
    assert [m.request_id for m in w.to("prefill-0", Abort)] == [2, 0]
    assert [m.request_id for m in w.to("decode-0", Abort)] == [0]  # 2's never had its Admit
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 1]  # 0's pages: not back yet
    r.on_item("decode-0", Finished(0, (7,), 0.1, 0.0, 1.0, None, "", False, None, "abort"), 0.4)
    assert [m.request_id for m in w.to("decode-0", Admit)] == [0, 1, 3]
    r.abort([0], "again", 0.5)  # it ended: nothing more is sent
    assert len(w.sent) == 10
    finish(r, 1)
    finish(r, 3)
    assert r.done and len(r.served) == 5 and r.free_pages == (POOL.usable_pages,)


def test_reports_move_the_ledger():
    r, w = router()
    r.arrive(request(0), 0.0)
    before = r.ledger
    r.on_item("prefill-0", Prefilled(0, 0, 20.0), 0.1)  # the prefill device is free again
    done, (queued,) = r.ledger.prefill[0], before.prefill[0].queued
    assert (done.queued, done.started_s) == ((), 0.1) and queued.tokens == 256
    priced = queued.priced_ms  # against its price, in its setting and octave:
    assert done.estimate.samples == (Timed(Setting.ALONE, 8, priced, 20.0),)
    assert done.estimate.stretch(Setting.ALONE) == pytest.approx(20.0 / priced)
    assert r.ledger.decode[0].held_pages == POOL.pages_for(256 + 32)  # it decodes there soon:
    assert r.ledger.queues(0, 0, 0.1, 256).prefill_stretch == 1  # a prompt now computes beside it
    assert r.ledger.link(0, 0) == before.link(0, 0)
    r.on_item("prefill-0", PrefillDone(0, 0, 20.0, 100.0, 1_000_000), 0.2)
    assert r.ledger.link(0, 0).estimate.gbps == pytest.approx(0.01)  # the link is timed
    assert r.ledger.prefill[0] == done
    r.on_item("decode-0", Load(0, 1, 40.0, 5), 0.3)
    assert r.ledger.queues(0, 0, 0.3, 256).running == 1
    with pytest.raises(ValueError, match="not a worker"):
        r.on_item("router", Load(0, 1, 40.0, 5), 0.3)
    with pytest.raises(ValueError, match="does not take"):
        r.on_item("decode-0", "hello", 0.3)
    with pytest.raises(ValueError, match="does not take"):  # a worker's own records only
        r.on_item("decode-0", Ready("decode-0"), 0.3)


def test_a_finished_suffix_times_its_decode_worker_beside_or_alone():
    """A suffix's measured time over its price goes into its decode worker's estimate, kept
    apart by whether a prompt was computing when its own was done; a later choice uses it."""
    r, _ = router("q8:balanced")
    for i in range(2):
        r.arrive(request(i), 0.0)
    first, second = (r._open[i].assignment.why.predicted for i in range(2))
    r.on_item("prefill-0", Prefilled(0, 0, 20.0), 0.1)  # request 1's prompt starts: beside
    r.on_item("prefill-0", Prefilled(1, 0, 20.0), 0.2)  # nothing follows it: alone
    for i, (p, factor) in enumerate(((first, 2.0), (second, 0.5))):
        price = p.decode_busy_ms * p.stretch
        assert price > 0 and p.decode_stretch == 1
        r.on_item("prefill-0", PrefillDone(i, 0, 20.0, 100.0, 1_000_000), 0.3)
        r.on_item("decode-0", Token(i, 0, 7, 0.4), 0.4)
        r.on_item("decode-0", Finished(i, (7,), 0.1, 0.01, 50.0, Phases(
            0.0, 1.0, 1.0, factor * price, 0.0, 20.0), "", False), 0.5)
    estimate = r.ledger.decode[0].estimate
    assert estimate.stretch(Setting.BESIDE) == pytest.approx(2.0)
    assert estimate.stretch(Setting.ALONE) == pytest.approx(0.5)
    assert r.ledger.queues(0, 0, 0.5, 256).decode_stretch == pytest.approx(0.5)  # no prompt now
    r.arrive(request(2), 0.6)  # its prompt computes now: the next suffix runs beside it
    assert r.ledger.queues(0, 0, 0.6, 256).decode_stretch == pytest.approx(2.0)
    # a suffix queued behind another's: its phase holds the wait, which the backlog counts
    p = r._open[2].assignment.why.predicted
    r.on_item("prefill-0", Prefilled(2, 0, 20.0), 0.7)
    r.on_item("prefill-0", PrefillDone(2, 0, 20.0, 100.0, 1_000_000), 0.8)
    r.on_item("decode-0", Token(2, 0, 7, 0.9), 0.9)
    r.on_item("decode-0", Finished(2, (7,), 0.1, 0.01, 50.0, Phases(
        0.0, 1.0, 1.0, 9.0 * p.decode_busy_ms * p.stretch, 0.0, 20.0), "", False,
        suffix_queued=True), 1.0)
    assert r.ledger.decode[0].estimate == estimate


def test_member_names_round_trip():
    assert parse_member(member_name("prefill", 3)) == ("prefill", 3)


class SimulatedWorkers:
    """Workers on a simulated clock: each request's prefill ends `prefill_s` after its Prefill
    came, its tokens follow every `token_s` from then or its Admit, whichever is later; `poll`
    moves the clock to the next event (or by its timeout). `dead` ends a worker at a time."""

    def __init__(self, prefill_s=0.2, token_s=0.01, dead=None):
        self.now, self.prefill_s, self.token_s = 0.0, prefill_s, token_s
        self.due: list[tuple[float, int, object]] = []  # (time, order, event)
        self.dead = dict(dead or {})
        self.sent: list[tuple[str, object]] = []
        self.told: set[str] = set()  # the workers whose end is among the events
        self.prefilled: dict[int, float] = {}  # when each request's prefill ends

    def clock(self):
        return self.now

    def _at(self, t, event):
        self.due.append((t, len(self.due), event))

    def send(self, name, message):
        from rekv_jax.launch.group import Emitted

        if name in self.dead and self.dead[name] <= self.now:
            return False
        self.sent.append((name, message))
        if isinstance(message, Prefill):
            self.prefilled[message.request_id] = self.now + self.prefill_s
            self._at(self.now + self.prefill_s,
                     Emitted(name, PrefillDone(message.request_id, 0, 1.0, 1.0, 1000)))
        elif isinstance(message, Admit):
            done = max(self.now, self.prefilled[message.request_id])
            for k in range(32):
                self._at(done + k * self.token_s,
                         Emitted("decode-0", Token(message.request_id, k, 7, 0.0)))
            self._at(done + 32 * self.token_s, Emitted("decode-0", Finished(
                message.request_id, (7,) * 32, 0.1, 0.01, 50.0, None, "bitwise", False)))
        return True

    def poll(self, timeout=0.0):
        from rekv_jax.launch.group import MemberEnded

        for name, t in self.dead.items():
            if name not in self.told:
                self.told.add(name)
                self._at(t, MemberEnded(name, None, f"{name} exited with status 1"))
        nxt = min((t for t, _, _ in self.due), default=self.now + timeout)
        self.now = max(self.now, min(nxt, self.now + timeout))
        ready = sorted(e for e in self.due if e[0] <= self.now)
        self.due = [e for e in self.due if e[0] > self.now]
        return [event for _, _, event in ready]


def test_drive_serves_every_request_on_time_and_ends_when_all_ended():
    from rekv_jax.serving.router import drive

    w = SimulatedWorkers()
    r, _ = router()
    r._send = w.send
    requests = [request(i, at=0.5 * i) for i in range(5)]
    served = drive(w, r, Scheduled(requests), clock=w.clock)
    assert sorted(s.request.id for s in served) == list(range(5))
    assert all(s.completed for s in served)
    # nothing queues at these rates: the first token comes prefill_s after arrival
    assert [round(s.ttft_ms) for s in sorted(served, key=lambda s: s.request.id)] == [200] * 5
    with pytest.raises(ValueError, match="arrival order"):
        drive(w, r, Scheduled(requests[::-1]), clock=w.clock)


def test_drive_with_its_only_prefill_worker_dead_fails_the_rest_at_once():
    from rekv_jax.serving.router import drive

    w = SimulatedWorkers()
    w.dead = {"prefill-0": 0.0}
    r, _ = router()
    r._send = w.send
    served = drive(w, r, Scheduled([request(i, at=100.0 * i) for i in range(3)]),
                   clock=w.clock)
    assert len(served) == 3 and all("no prefill worker" in s.error for s in served)
    assert w.now < 1.0  # it did not wait for the later arrivals


def test_drive_aborts_every_open_request_once_told_and_late_finishes_free_their_pages():
    from rekv_jax.serving.router import drive

    w = SimulatedWorkers(token_s=1.0)  # a request's 32 tokens take 32 s
    r, _ = router()
    r._send = w.send
    served = drive(w, r, Scheduled([request(i) for i in range(3)]), clock=w.clock,
                   abort=lambda: "stopped" if w.now >= 2.0 else None)
    assert 2.0 <= w.now < 3.0  # it ended at the first turn told to
    assert sorted(s.request.id for s in served) == [0, 1, 2]  # two decoding, one waiting
    assert all(not s.completed and s.error == "stopped" for s in served)
    assert [m.request_id for n, m in w.sent if isinstance(m, Admit)] == [0, 1]
    for i in (0, 1):  # the decode worker reports them later: their pages come back
        r.on_item("decode-0", Finished(i, (7,) * 32, 0.1, 0.01, 50.0, None, "", False), w.now)
    r.arrive(request(3), w.now)
    r.arrive(request(4), w.now)
    assert [m.request_id for n, m in w.sent if isinstance(m, Admit)] == [0, 1, 3, 4]


class Leaving(Scheduled):
    """A generated stream whose request `gone`'s client leaves once `clock()` passes `at_s`."""

    def __init__(self, requests, gone, at_s, clock):
        super().__init__(requests)
        self.gone, self.at_s, self.clock, self.told = gone, at_s, clock, False

    def cancelled(self):
        if self.told or self.clock() < self.at_s:
            return []
        self.told = True
        return [self.gone]


def test_drive_aborts_a_request_whose_client_left_and_serves_the_rest():
    from rekv_jax.serving.router import drive

    w = SimulatedWorkers(token_s=0.1)  # a request's 32 tokens take 3.2 s
    r, _ = router()
    r._send = w.send
    served = drive(w, r, Leaving([request(i) for i in range(3)], 1, 1.0, w.clock),
                   clock=w.clock)
    by_id = {s.request.id: s for s in served}
    assert sorted(by_id) == [0, 1, 2] and by_id[0].completed and by_id[2].completed
    gone = by_id[1]
    assert gone.aborted == "client disconnected" and gone.failure is None
    assert 1.0 <= gone.lifecycle[-1].t_s < 1.0 + 0.1 * 2  # at the loop's first turn after
    assert [m.request_id for n, m in w.sent if isinstance(m, Abort)] == [1]  # to decode-0
    assert Scheduled([]).cancelled() == []
