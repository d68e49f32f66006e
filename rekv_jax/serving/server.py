"""A serving run from Python: `Server`, a context manager that starts the workers of a
`ServeConfig` (a group of member processes, `member.serving_member`), runs the router's loop
(`router.drive`) on a thread of its own, and serves what its callers submit, under the config's
one policy:

    with Server(ServeConfig(model, ("bf16:full",), workers=Workers(link_gbps=None))) as server:
        for token in server.submit("Once upon a time", max_new_tokens=16): ...
        outputs = server.generate(["a prompt", "another"], max_new_tokens=16)

`submit` returns a blocking iterator of the request's token ids as the decode worker produces
them; `generate` submits every prompt at once and returns each one's `Output` (its tokens, text
and `Served` record). `rekv serve --http` is the same server with the OpenAI API in front of
`clients` (their async streams). A caller that stops reading a request (closes its iterator, or
an HTTP client that disconnects) aborts it: `Clients.cancelled` hands its id to the router's
loop. Leaving the `with` block stops taking requests, ends those still open (after `grace_s`
given with an `abort`) and closes the workers, every wait bounded.

The pieces every serving run shares are here too: `ready` (the group's `Ready`s and the decode
members' measured `DecodeCosts`), `make_router` and `close_group`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence

from rekv_jax.errors import TransportError
from rekv_jax.launch.child import DECODE, parse_member
from rekv_jax.launch.group import Emitted, Event, MemberEnded, failure_line
from rekv_jax.model.loader import load_config, tokenizer_of
from rekv_jax.planning.costmodel import Profile
from rekv_jax.planning.planner import analytic_profile
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.policy import Context, Policy, make_policies
from rekv_jax.serving.prometheus import ServingMetrics
from rekv_jax.serving.requests import Assignment, Ended, Ready, ServeRequest, Token
from rekv_jax.serving.router import Router, drive
from rekv_jax.serving.sampling import Sampling, Stops
from rekv_jax.serving.serve_config import Members, ServeConfig, member_setup
from rekv_jax.serving.shutdown import CLOSE_S

TAKE_WAIT_S = 0.005  # the longest a client's request waits for the router's loop to take it
CLOSED = "the server closed"  # the error of a request still open when a `Server` closes
ESTIMATED_LENGTH = 512  # prompt length of the roofline profile a run without profiles uses

OnEvent = Callable[[Event], None]
GREEDY, EOS = Sampling(), Stops()  # a request's defaults: greedy, ended by EOS or its length


def ready(group: Members, setup: MemberSetup, profiles: Sequence[Profile]) -> DecodeCosts:
    """Wait until every member is `Ready`; the decode members' iteration costs (the slowest
    member's steps; the suffix budget from the shortest profile's suffix compute)."""
    waiting, steps = set(group.names), []
    deadline_s = setup.timeout * 4  # links, a model load and the steps' compiles
    for event in _events(group, deadline_s, lambda: bool(waiting)):
        if isinstance(event, MemberEnded):
            raise TransportError(event.failure or f"{event.name} ended before it was ready")
        if isinstance(event, Emitted) and isinstance(event.item, Ready):
            waiting.discard(event.name)
            if parse_member(event.name)[0] == DECODE:
                steps.append(dict(event.item.step_ms))
    if waiting:
        raise TimeoutError(f"{sorted(waiting)} not ready within {deadline_s:g} s")
    return decode_costs(steps, profiles, setup.suffix_budget)


def _events(group: Members, timeout_s: float, wanted: Callable[[], bool]) -> Iterator[Event]:
    """The group's events while `wanted()` holds, for at most `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while wanted() and (left := deadline - time.monotonic()) > 0:
        yield from group.poll(min(left, 1.0))


def decode_costs(steps: Sequence[dict[int, float]], profiles: Sequence[Profile],
                 suffix_budget: int | None) -> DecodeCosts:
    """`DecodeCosts` from each decode member's timed steps (batch -> ms; the slowest member's
    at each batch): a line through the smallest and largest batch; the suffix budget's ms from
    the profile's suffix compute per token-layer (no budget: one 512-token layer)."""
    batches = sorted(set.intersection(*(set(s) for s in steps)))
    ms = {b: max(s[b] for s in steps) for b in batches}
    lo, hi = batches[0], batches[-1]
    per = (ms[hi] - ms[lo]) / (hi - lo) if hi > lo else 0.0
    p = min(profiles, key=lambda p: p.seq_len)
    token_layer_ms = p.suffix_layer_ms / p.seq_len
    budget = suffix_budget if suffix_budget is not None else 512
    return DecodeCosts(max(ms[lo] - lo * per, 0.0), max(per, 0.0), budget * token_layer_ms)


def make_policies_for(config: ServeConfig, profiles: Sequence[Profile],
                      costs: DecodeCosts) -> list[Policy]:
    """The config's policies over `profiles` and the measured decode costs."""
    cfg = load_config(config.model)
    context = Context(cfg.name, cfg.num_layers, tuple(profiles), costs, config.gate,
                      config.adaptive_bits, tpot_stretch=config.tpot_stretch)
    return make_policies(config.policies, context)


def make_router(group: Members, config: ServeConfig, setup: MemberSetup, policy: Policy,
                costs: DecodeCosts, rate: float, link_gbps: float,
                on_served: Callable[[Served], None] | None = None,
                on_assigned: Callable[[Assignment], None] | None = None,
                deadline_s: float | None = None) -> Router:
    """A router of one stream (`rate`: its arrival rate, 0 for clients) over the group;
    `link_gbps`: what its ledger assumes of an unpaced link; `deadline_s`: how long after its
    arrival a request fails (None: never; a client's own deadline is the front end's)."""
    w = config.workers
    return Router(policy, Ledger.idle(w.prefill, w.decode, setup.link_gbps or link_gbps),
                  setup.pool, costs, group.send, rate, deadline_s, on_served, on_assigned)


def close_group(group: Members, timeout: float) -> None:
    """Close the group; a decode member that held pages at its end, or failed, fails the run."""
    ends = group.close(timeout)
    bad = [failure_line(e) if not e.ok else f"{name}: {e.value} pages still held"
           for name, e in ends.items()
           if not e.ok or (parse_member(name)[0] == DECODE and e.value)]
    if bad:
        raise TransportError("the serving group ended badly: " + "; ".join(bad))


class Clients:
    """`Arrivals` from callers (HTTP clients or Python) and what hands them their tokens: a
    request is queued by the caller's thread (`submit`, `follow`), taken by the router's loop at
    its next turn, and its tokens, then its `Served` record, reach the caller as the decode
    worker emits them. A caller that stops following a request before its end has its id in
    `cancelled`. `metrics` sees each record on the way (`pages`: each decode worker's)."""

    def __init__(self, closed: threading.Event, pages: int | None = None) -> None:
        # each request with when it was submitted (time.monotonic()), so its arrival is that
        # instant and not the loop's next turn
        self._queue: queue.Queue[tuple[ServeRequest, float]] = queue.Queue()
        self._sinks: dict[int, Callable[[object], None]] = {}  # open requests' callers
        self._cancelled: list[int] = []
        self._lock = threading.Lock()
        self.closed = closed  # set: no more requests are taken
        self.metrics = ServingMetrics(pages)

    @property
    def ended(self) -> bool:
        return self.closed.is_set() and self._queue.empty()

    def take(self, now_s: float, all_now: bool) -> list[ServeRequest]:
        out = []
        while not self._queue.empty():
            request, submitted = self._queue.get()
            waited_s = time.monotonic() - submitted  # in the queue, on the run's clock too
            out.append(dataclasses.replace(request, arrival_s=max(0.0, now_s - waited_s)))
            self.metrics.arrived(out[-1])
        return out

    def wait_s(self, now_s: float) -> float:
        return TAKE_WAIT_S

    def cancelled(self) -> list[int]:
        """The requests whose callers stopped following them since the last call."""
        with self._lock:
            out, self._cancelled = self._cancelled, []
        return out

    async def submit(self, request: ServeRequest) -> AsyncGenerator[Token | Ended, None]:
        """`request`'s tokens, then how it ended (`http.Backend`); closed or cancelled before
        its end (its client disconnected), the request is cancelled."""
        loop, items = asyncio.get_running_loop(), asyncio.Queue()
        self._open(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            while True:
                item = await items.get()
                if isinstance(item, Served):
                    yield _ended(item)
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._leave(request.id)

    def follow(self, request: ServeRequest) -> Iterator[Token | Served]:
        """Queue `request` now; a blocking iterator of its tokens, then its `Served` record.
        Closed before its end, the request is cancelled."""
        items: queue.Queue = queue.Queue()
        self._open(request, items.put)
        return self._followed(request.id, items)

    def _followed(self, request_id: int, items: queue.Queue) -> Iterator[Token | Served]:
        try:
            while True:
                item = items.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Served):
                    return
        finally:
            self._leave(request_id)

    def _open(self, request: ServeRequest, sink: Callable[[object], None]) -> None:
        with self._lock:
            self._sinks[request.id] = sink
        self._queue.put((request, time.monotonic()))

    def _leave(self, request_id: int) -> None:
        with self._lock:
            if self._sinks.pop(request_id, None) is not None:
                self._cancelled.append(request_id)

    def _put(self, request_id: int, item: object, last: bool = False) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None) if last else self._sinks.get(request_id)
        if sink is not None:
            sink(item)

    def fail(self, error: BaseException) -> None:
        """The router's loop failed: every open request's caller gets `error`."""
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink(error)

    def on_event(self, event: Event) -> None:
        """A worker's event: a token goes to its caller."""
        if isinstance(event, Emitted):
            self.metrics.emitted(event.item)
            if isinstance(event.item, Token):
                self._put(event.item.request_id, event.item)

    def on_assigned(self, assignment: Assignment) -> None:
        self.metrics.assigned(assignment)

    def on_served(self, served: Served) -> None:
        """A request ended: its caller gets its record."""
        self.metrics.served(served)
        self._put(served.request.id, served, True)


def _ended(served: Served) -> Ended:
    """How a request ended as its client hears it: as its worker reported, or a RuntimeError
    with the request's one line."""
    if served.failure:
        raise RuntimeError(served.failure)
    return Ended(served.finish_reason, served.finished.stop if served.finished else None)


@dataclasses.dataclass(frozen=True)
class Output:
    """One prompt's generation (`Server.generate`)."""

    tokens: list[int]  # the generated ids
    text: str | None  # their text (None: the model has no tokenizer)
    served: Served  # the router's record of the request


class Server:
    """The context manager of the module docstring, over `config` (no generated load; one
    policy; the link in GB/s or None). `on_event`: each worker event as it comes; `on_served`:
    each record as its request ends; `abort`: the router loop's (`router.drive`) once `stop`
    is set (default: every open request ends at once, `CLOSED`)."""

    def __init__(self, config: ServeConfig, stop: threading.Event | None = None,
                 abort: Callable[[], str | None] | None = None, on_event: OnEvent | None = None,
                 on_served: Callable[[Served], None] | None = None) -> None:
        if config.streams:
            raise ValueError("a Server serves its callers; a generated load runs in serve()")
        if isinstance(config.workers.link_gbps, str):
            raise ValueError(f"a Server takes the link in GB/s or None (unpaced), got "
                             f"{config.workers.link_gbps!r}")
        self.config, self.stop = config, stop or threading.Event()
        self._abort = abort or (lambda: CLOSED if self.stop.is_set() else None)
        self._on_event, self._on_served = on_event, on_served
        self._setup = member_setup(config, config.workers.link_gbps)
        self.ids, self._aborted = itertools.count(), False  # its requests' ids, HTTP's too
        self._error: BaseException | None = None
        self.clients = Clients(self.stop, self._setup.pool.usable_pages)
        self.tokenizer = tokenizer_of(config.model)

    def __enter__(self) -> Server:
        c = self.config
        profiles = c.profiles or (analytic_profile(load_config(c.model), ESTIMATED_LENGTH),)
        self._group = c.workers.start(serving_member, (self._setup,))
        try:
            costs = ready(self._group, self._setup, profiles)
            (policy,) = make_policies_for(c, profiles, costs)
            self.router = make_router(self._group, c, self._setup, policy, costs, 0.0,
                                      profiles[0].link_gbps, self._served,
                                      self.clients.on_assigned)
            self._thread = threading.Thread(target=self._drive, name="rekv-router", daemon=True)
            self._thread.start()
        except BaseException:
            self._group.kill()
            raise
        return self

    def _served(self, served: Served) -> None:
        if self._on_served is not None:
            self._on_served(served)
        self.clients.on_served(served)

    def _drive(self) -> None:
        def on_event(event: Event) -> None:
            if self._on_event is not None:
                self._on_event(event)
            self.clients.on_event(event)

        def abort() -> str | None:
            why = self._abort()
            self._aborted |= why is not None and not self.router.done
            return why

        try:
            drive(self._group, self.router, self.clients, on_event, abort=abort)
        except BaseException as e:  # its callers hear it; the server's close raises it
            self._error = e
            self.clients.fail(e)

    def __exit__(self, *exc: object) -> None:
        """Stop taking requests, end the open ones (`abort`), close the workers (killed if a
        request was aborted: its decode member would run it to its end); bounded."""
        self.stop.set()
        self._thread.join(self.config.workers.timeout)
        if self._thread.is_alive() or self._aborted:
            self._group.kill()
        else:
            close_group(self._group, min(self.config.workers.timeout, CLOSE_S))
        if self._thread.is_alive():
            raise TimeoutError("the router's loop did not end")
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Block until `stop` is set or the router's loop ended."""
        while not self.stop.wait(0.2) and self._thread.is_alive():
            pass

    def drain(self, timeout: float) -> None:
        """Block until the router's loop ended (once `stop` is set: when every open request
        ended, or the `abort` ended them), at most `timeout` s."""
        self._thread.join(timeout)

    def request(self, prompt: str | Sequence[int], max_new_tokens: int = 16,
                sampling: Sampling = GREEDY, stops: Stops = EOS) -> ServeRequest:
        """A request of this server's: `prompt` as text (the model's tokenizer) or token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer: give token ids")
            prompt = self.tokenizer.encode(prompt).ids
        return ServeRequest(next(self.ids), tuple(prompt), max_new_tokens, 0.0, sampling,
                            stops)

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int = 16,
               sampling: Sampling = GREEDY, stops: Stops = EOS) -> Iterator[int]:
        """Queue one request now; its token ids as they come (RuntimeError if it failed).
        Closing the iterator early aborts the request."""
        return _tokens(self.clients.follow(self.request(prompt, max_new_tokens, sampling,
                                                        stops)))

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 16,
                 sampling: Sampling = GREEDY, stops: Stops = EOS) -> list[Output]:
        """Every prompt queued at once; each one's `Output`, in order (RuntimeError naming the
        first that failed)."""
        followed = [self.clients.follow(self.request(p, max_new_tokens, sampling, stops))
                    for p in prompts]
        outputs = []
        for items in followed:
            *_, served = items
            if served.failure:
                raise RuntimeError(f"request {served.request.id}: {served.failure}")
            ids = list(served.finished.tokens)
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
            outputs.append(Output(ids, text, served))
        return outputs


def _tokens(items: Iterator[Token | Served]) -> Iterator[int]:
    with contextlib.closing(items):
        for item in items:
            if isinstance(item, Token):
                yield item.token
            elif item.failure:
                raise RuntimeError(f"request {item.request.id}: {item.failure}")
