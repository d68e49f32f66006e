"""One serving run as `rekv serve` asks for it (`ServeConfig`, checked whole at construction), and
`serve`, which runs it on the workers.

A run either drives generated request streams (one per arrival rate, each served under every
policy, on one set of workers) or answers clients over HTTP (one policy), never both.

`serve` starts the group (`Workers.start`: a `launch.group.Group` spawned here, or a
`launch.nodes.NodeGroup` joined from the workers' own nodes; decode members first, each running
`member.serving_member`) and waits until every member is `Ready`; the decode members' timed
steps give the router its `DecodeCosts`. Before each policy serves its first stream, a warm-up burst
(`WARMUP` requests at once of each prompt length, not recorded) compiles its programs and the
batched steps it will run; then the router (`router.Router`, one per stream and policy, over a
fresh ledger) drives the stream. An HTTP run serves until SIGINT, SIGTERM or its caller's `stop`,
then ends as `shutdown` says. The group is closed whatever happens (an HTTP run's within
`shutdown.CLOSE_S`), and a decode member that ends holding pages fails the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence

from rekv_jax.errors import TransportError
from rekv_jax.gate_result import GateResult
from rekv_jax.launch.child import member_names
from rekv_jax.launch.environments import group_environments, visible_gpus
from rekv_jax.launch.group import Emitted, Event, Group, MemberEnded, failure_line
from rekv_jax.launch.nodes import NodeGroup, Rendezvous
from rekv_jax.model.loader import load_config
from rekv_jax.planning.costmodel import Profile
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.http import build_app, check_bind, running
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.metrics import (
    Capacity,
    Served,
    ServeSummary,
    Slo,
    capacities,
    summarize,
)
from rekv_jax.serving.openai_answer import Ended
from rekv_jax.serving.openai_request import ModelInfo
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.policy import Context, Policy, make_policies
from rekv_jax.serving.prometheus import ServingMetrics
from rekv_jax.serving.requests import Assignment, Ready, ServeRequest, Token
from rekv_jax.serving.router import DECODE, Router, Scheduled, drive, parse_worker
from rekv_jax.serving.shutdown import (
    ABORTED,
    CLOSE_S,
    GRACE_S,
    Closing,
    Grace,
    stopped_by_signals,
)
from rekv_jax.transport import JobKey

Members = Group | NodeGroup  # a run's workers, as the router's loop drives them
POOL_REQUESTS = 16  # a decode worker's pool holds this many of the run's longest requests
WARMUP = 8  # requests of each prompt length in a policy's warm-up burst
TAKE_WAIT_S = 0.005  # the longest a client's request waits for the router's loop to take it
HTTP_CONTEXT = 2048  # the most positions (prompt and tokens) an HTTP request may take


def http_context(model: str) -> int:
    """The positions an HTTP request may take: the model's, at most `HTTP_CONTEXT`."""
    return min(load_config(model).max_position_embeddings, HTTP_CONTEXT)


def http_model(spec: str) -> ModelInfo:
    """What the OpenAI API serves of model `spec`: its context, tokenizer and chat template."""
    from rekv_jax.model.loader import chat_template_of, tokenizer_of

    return ModelInfo(spec, http_context(spec), tokenizer_of(spec), chat_template_of(spec))


@dataclasses.dataclass(frozen=True)
class Stream:
    """The requests of one arrival rate (`load_gen.generate`)."""

    rate: float  # requests per second
    requests: tuple[ServeRequest, ...]


@dataclasses.dataclass(frozen=True)
class HttpBind:
    """Where the OpenAI API listens, and the key clients must send (None: none)."""

    host: str
    port: int
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--http {self.host}:{self.port}: a port is 0..65535")
        check_bind(self.host, self.api_key)


@dataclasses.dataclass(frozen=True)
class Workers:
    """The processes of a run and how they are joined (the flags `rekv handoff` shares)."""

    prefill: int = 1  # prefill worker processes
    decode: int = 1  # decode worker processes
    transport: str = "transfer-server"
    link_gbps: float | str | None = "paper"  # GB/s, "paper" (calibrated) or None (unpaced)
    fallback: str = "error"
    timeout: float = 120.0  # seconds any wait may take
    pin: bool = True  # each CPU side on its own cores
    rendezvous: Rendezvous | None = None  # across nodes, where the router takes its workers

    def start(self, job: Callable[..., object], args: tuple) -> Members:
        """The workers, each running `job(member, *args)`: spawned here under a fresh key, or
        (with a rendezvous) each joined from a node of its own (`launch.nodes`)."""
        if self.rendezvous is None:
            return Group(job, args, self.environments(), key=JobKey.new())
        return NodeGroup(job, args, member_names(self.prefill, self.decode), self.rendezvous,
                         self.timeout)

    def environments(self) -> dict[str, dict[str, str]]:
        """Each member's environment (`group_environments`; unpinned: all share the cores)."""
        if not self.pin and not visible_gpus():
            names = group_environments([], os.environ, self.prefill, self.decode)
            return {name: dict(os.environ) for name in names}
        return group_environments(visible_gpus(), os.environ, self.prefill, self.decode)

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"a run needs at least one prefill and one decode worker, got "
                             f"{self.prefill} and {self.decode}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout}")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything a serving run needs, checked."""

    model: str  # the --model spec
    policies: tuple[str, ...]  # `policy.check_policy_names`
    slo: Slo
    workers: Workers
    streams: tuple[Stream, ...] = ()  # the generated load (empty: serve HTTP clients)
    http: HttpBind | None = None
    profiles: tuple[Profile, ...] = ()  # the cost model's (empty: measured at the start)
    gate: tuple[GateResult, ...] | None = None  # the quality gate's results (None: no gate)
    adaptive_bits: tuple[int, ...] = (16, 8)
    json: bool = False  # one JSON record per request and summary on stdout
    plot_dir: str | None = None  # the PNGs' folder

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("a run needs a policy")
        if (self.http is None) == (not self.streams):
            raise ValueError("a run serves HTTP clients (--http) or a generated load (--rate), "
                             "one of the two")
        if self.http is not None and len(self.policies) > 1:
            raise ValueError(f"--http serves under one policy, got {list(self.policies)}")
        if self.http is not None and self.plot_dir is not None:
            raise ValueError("--plot draws a generated load's sweep; --http has none")
        rates = [s.rate for s in self.streams]
        if len(set(rates)) < len(rates):
            raise ValueError(f"rates {rates} name one twice")


@dataclasses.dataclass(frozen=True)
class ServeRun:
    """What a generated-load run measured."""

    served: tuple[Served, ...]  # every request, by stream, then policy, in the order they ended
    summaries: tuple[ServeSummary, ...]  # one per stream and policy
    capacities: tuple[Capacity, ...]  # one per policy
    costs: DecodeCosts  # the decode workers' measured iteration costs the policies used


OnEvent = Callable[[Event], None]


def serve(config: ServeConfig, on_event: OnEvent | None = None,
          stop: threading.Event | None = None) -> ServeRun | None:
    """Run `config` on its workers: a generated load's `ServeRun`, or, with `--http`, answer
    clients until SIGINT, SIGTERM or `stop` (None). `on_event`: each worker event as it
    comes (progress)."""
    link = config.workers.link_gbps
    if isinstance(link, str):
        raise ValueError(f"serve() takes the link in GB/s or None (unpaced), got {link!r}: "
                         "the CLI resolves 'paper' from the run's profiles")
    if not config.profiles:
        raise ValueError("serve() needs the cost model's profiles (the CLI measures them)")
    setup = member_setup(config, link)
    with config.workers.start(serving_member, (setup,)) as group:
        costs = _ready(group, config, setup)
        policies = make_policies(config.policies, _context(config, costs))
        if config.http is not None:
            return _serve_http(group, config, setup, policies[0], costs,
                               stop or threading.Event())
        try:
            return _serve_streams(group, config, setup, policies, costs, on_event)
        finally:
            _close(group, config.workers.timeout)


def member_setup(config: ServeConfig, link_gbps: float | None) -> MemberSetup:
    """What the members run with: a pool of `POOL_REQUESTS` of the run's longest requests
    (HTTP: of the model's context)."""
    if config.streams:
        longest = max(len(r.tokens) + r.max_new_tokens for s in config.streams
                      for r in s.requests)
        position = max(len(r.tokens) for s in config.streams for r in s.requests) - 1
    else:
        longest = http_context(config.model)
        position = longest - 1
    pool = PoolConfig(POOL_REQUESTS * PoolConfig(2).pages_for(longest) + 1)
    w = config.workers
    return MemberSetup(config.model, pool, transport=w.transport, link_gbps=link_gbps,
                       fallback=w.fallback, timeout=w.timeout, cost_position=position)


def _ready(group: Members, config: ServeConfig, setup: MemberSetup) -> DecodeCosts:
    """Wait until every member is `Ready`; the decode members' iteration costs (the slowest
    member's steps; the suffix budget from the shortest profile's suffix compute)."""
    waiting, steps = set(group.names), []
    deadline_s = config.workers.timeout * 4  # links, a model load and the steps' compiles
    for event in _events(group, deadline_s, lambda: bool(waiting)):
        if isinstance(event, MemberEnded):
            raise TransportError(event.failure or f"{event.name} ended before it was ready")
        if isinstance(event, Emitted) and isinstance(event.item, Ready):
            waiting.discard(event.name)
            if parse_worker(event.name)[0] == DECODE:
                steps.append(dict(event.item.step_ms))
    if waiting:
        raise TimeoutError(f"{sorted(waiting)} not ready within {deadline_s:g} s")
    return decode_costs(steps, config.profiles, setup.suffix_budget)


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


def _context(config: ServeConfig, costs: DecodeCosts) -> Context:
    cfg = load_config(config.model)
    return Context(cfg.name, cfg.num_layers, config.profiles, costs, config.gate,
                   config.adaptive_bits)


def _router(group: Members, config: ServeConfig, setup: MemberSetup, policy: Policy,
            costs: DecodeCosts, rate: float, on_served=None, on_assigned=None) -> Router:
    w = config.workers
    link = setup.link_gbps or config.profiles[0].link_gbps
    return Router(policy, Ledger.idle(w.prefill, w.decode, link), setup.pool, costs, group.send,
                  rate, w.timeout, on_served, on_assigned)


def _serve_streams(group: Members, config: ServeConfig, setup: MemberSetup,
                   policies: Sequence[Policy], costs: DecodeCosts, on_event: OnEvent | None
                   ) -> ServeRun:
    """Each stream under each policy, after the policy's warm-up burst. A request's id is its
    handoff's tag, unique over the group's life: each run's ids are offset past the last's."""
    served: list[Served] = []
    summaries: list[ServeSummary] = []
    ids = itertools.count()
    for k, stream in enumerate(config.streams):
        for policy in policies:
            if k == 0:  # a policy's programs are the same at every rate
                _warm(group, config, setup, policy, costs, stream, ids)
            router = _router(group, config, setup, policy, costs, stream.rate)
            requests = [dataclasses.replace(r, id=next(ids)) for r in stream.requests]
            run = drive(group, router, Scheduled(requests), on_event)
            served += run
            if any(s.completed for s in run):
                summaries.append(summarize(run, config.slo))
    return ServeRun(tuple(served), tuple(summaries), tuple(capacities(summaries)), costs)


def _warm(group: Members, config: ServeConfig, setup: MemberSetup, policy: Policy,
          costs: DecodeCosts, stream: Stream, ids: Iterator[int]) -> None:
    """`WARMUP` requests of each prompt length of `stream` at once, under `policy`, unrecorded;
    a warm-up that fails fails the run (a worker that cannot serve would fail every request)."""
    lengths = sorted({len(r.tokens) for r in stream.requests})
    first = {n: next(r for r in stream.requests if len(r.tokens) == n) for n in lengths}
    burst = [ServeRequest(next(ids), first[n].tokens, first[n].max_new_tokens)
             for n in lengths for _ in range(WARMUP)]
    router = _router(group, config, setup, policy, costs, 0.0)
    failed = [s for s in drive(group, router, Scheduled(burst)) if not s.completed]
    if failed:
        s = failed[0]
        raise RuntimeError(f"{policy.name}'s warm-up failed: "
                           f"{s.error or (s.finished and s.finished.error)}")


def _close(group: Members, timeout: float) -> None:
    """Close the group; a decode member that held pages at its end, or failed, fails the run."""
    ends = group.close(timeout)
    bad = [failure_line(e) if not e.ok else f"{name}: {e.value} pages still held"
           for name, e in ends.items()
           if not e.ok or (parse_worker(name)[0] == DECODE and e.value)]
    if bad:
        raise TransportError("the serving group ended badly: " + "; ".join(bad))


# -------------------------------------------------------------------------------- --http


class Clients:
    """`Arrivals` from HTTP clients and the `Backend` that hands them their tokens: a client's
    request is queued by the server's thread (`submit`), taken by the router's loop at its
    next turn, and its tokens, then how it ended, reach the client's event loop as the decode
    worker emits them. `metrics` sees each record on the way (`pages`: each decode worker's)."""

    def __init__(self, closed: threading.Event, pages: int | None = None) -> None:
        # each request with when it was submitted (time.monotonic()), so its arrival is that
        # instant and not the loop's next turn
        self._queue: queue.Queue[tuple[ServeRequest, float]] = queue.Queue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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

    async def submit(self, request: ServeRequest) -> AsyncGenerator[Token | Ended, None]:
        items: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request.id] = (asyncio.get_running_loop(), items)
        self._queue.put((request, time.monotonic()))
        while True:
            item = await items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Ended):
                return

    def _put(self, request_id: int, item: object, last: bool = False) -> None:
        with self._lock:
            stream = (self._streams.pop(request_id, None) if last
                      else self._streams.get(request_id))
        if stream is not None:
            loop, items = stream
            loop.call_soon_threadsafe(items.put_nowait, item)

    def on_event(self, event: Event) -> None:
        """A worker's event: a token goes to its client."""
        if isinstance(event, Emitted):
            self.metrics.emitted(event.item)
            if isinstance(event.item, Token):
                self._put(event.item.request_id, event.item)

    def on_assigned(self, assignment: Assignment) -> None:
        self.metrics.assigned(assignment)

    def on_served(self, served: Served) -> None:
        """A request ended: its stream ends as its worker reported, or fails with the
        request's one line."""
        self.metrics.served(served)
        f, failure = served.finished, served.failure
        self._put(served.request.id, RuntimeError(failure) if failure
                  else Ended(f.finish_reason, f.stop), True)


def _serve_http(group: Members, config: ServeConfig, setup: MemberSetup, policy: Policy,
                costs: DecodeCosts, stop: threading.Event) -> None:
    """Answer the OpenAI API at `config.http` until SIGINT or SIGTERM or `stop`, then stop as
    `shutdown` says: no request taken, those in flight given `GRACE_S`, the rest aborted, and
    the group closed within `CLOSE_S` (killed after an abort: its decode members would run the
    aborted requests to their ends). With `config.json`, stdout holds a record of the server,
    then each request's record as it ends (before its client hears of the end)."""
    clients = Clients(stop, setup.pool.usable_pages)

    def served(s: Served) -> None:
        if config.json:
            _emit(s.to_json(config.slo))
        clients.on_served(s)

    router = _router(group, config, setup, policy, costs, 0.0, served, clients.on_assigned)
    model = http_model(config.model)
    app = build_app(Closing(clients, stop), model, config.http.api_key, clients.metrics)
    try:
        with running(app, config.http.host, config.http.port) as url, stopped_by_signals(stop):
            _announce(url, model.id, policy.name, config.json)
            drive(group, router, clients, clients.on_event, abort=Grace(stop, GRACE_S))
    finally:
        if any(s.error == ABORTED for s in router.served):
            group.kill()
        else:
            _close(group, min(config.workers.timeout, CLOSE_S))


def _announce(url: str, model: str, policy: str, as_json: bool) -> None:
    """Where the server listens, on stdout: a line for a person, or a JSON record."""
    if as_json:
        return _emit({"kind": "http_server", "url": f"{url}/v1", "model": model,
                      "policy": policy})
    print(f"rekv serve: the OpenAI API at {url}/v1, model {model!r} ({policy}); "
          "Ctrl-C or SIGTERM stops it", flush=True)


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
