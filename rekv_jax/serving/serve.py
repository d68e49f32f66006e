"""`serve`: one serving run as `rekv serve` asks for it (`serve_config.ServeConfig`), on its
workers.

A run either drives generated request streams (one per arrival rate, each served under every
policy, on one set of workers) or answers clients over HTTP (one policy), never both.

A generated load: `serve` starts the group (`Workers.start`: a `launch.group.Group` spawned here,
or a `launch.nodes.NodeGroup` joined from the workers' own nodes; decode members first, each
running `member.serving_member`) and waits until every member is `Ready`; the decode members'
timed steps give the router its `DecodeCosts` (`server.ready`). Before each policy serves its
first stream, a warm-up (`WARMUP` requests at once of each prompt length, then one of each
alone, then one alone of each mode it may choose that runs programs the others did not, on
every worker; not recorded) compiles its programs and the batched steps it will run, so the
timed stream compiles nothing (each record's `compile_ms` says so); then the router
(`router.Router`, one per stream and policy, over a fresh ledger) drives the stream. The group
is closed whatever happens, and a decode member that ends holding pages fails the run.

HTTP: a `server.Server` with the OpenAI API in front of its clients, serving until SIGINT,
SIGTERM or its caller's `stop`, then ending as `shutdown` says.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Callable, Iterator, Sequence

from rekv_jax.launch.group import Event
from rekv_jax.mode import Mode
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.metrics import Capacity, Served, ServeSummary, capacities, summarize
from rekv_jax.serving.policy import Asked, Policy
from rekv_jax.serving.requests import ServeRequest
from rekv_jax.serving.router import Router, Scheduled, drive
from rekv_jax.serving.serve_config import Members, ServeConfig, Stream, member_setup
from rekv_jax.serving.server import (
    Server,
    close_group,
    make_policies_for,
    make_router,
    ready,
)
from rekv_jax.serving.shutdown import DRAIN_S, GRACE_S, Grace, stopped_by_signals

WARMUP = 8  # requests of each prompt length in a policy's warm-up burst


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
    if config.http is not None:
        return _serve_http(config, stop or threading.Event())
    if not config.streams:
        raise ValueError("serve() runs a generated load or --http; Python callers use Server")
    setup = member_setup(config, link)
    with config.workers.start(serving_member, (setup,)) as group:
        costs = ready(group, setup, config.profiles)
        policies = make_policies_for(config, config.profiles, costs)
        try:
            return _serve_streams(group, config, setup, policies, costs, on_event)
        finally:
            close_group(group, config.workers.timeout)


def _router(group: Members, config: ServeConfig, setup: MemberSetup, policy: Policy,
            costs: DecodeCosts, rate: float) -> Router:
    return make_router(group, config, setup, policy, costs, rate, config.profiles[0].link_gbps,
                       deadline_s=config.workers.timeout)


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
    """`WARMUP` requests of each prompt length of `stream` at once, under `policy`, then one of
    each alone (an idle system's choice, a streamed prefill's programs, may differ from a
    loaded one's), then, alone on each of a set of pairs that holds every worker, one of each
    mode the policy may choose whose programs (`_programs`) that pair has not run: a program
    compiled inside the timed stream would add its compile to a request's TTFT and to its
    device's measured speed. Unrecorded; a warm-up that fails fails the run (a worker that
    cannot serve would fail every request)."""
    lengths = sorted({len(r.tokens) for r in stream.requests})
    first = {n: next(r for r in stream.requests if len(r.tokens) == n) for n in lengths}

    def ask(n: int) -> ServeRequest:
        return ServeRequest(next(ids), first[n].tokens, first[n].max_new_tokens)
    bursts = [[ask(n) for n in lengths for _ in range(WARMUP)], *([ask(n)] for n in lengths)]
    ran = [s for burst in bursts for s in drive(
        group, _router(group, config, setup, policy, costs, 0.0), Scheduled(burst))]
    w = config.workers
    pairs = [(i % w.prefill, i % w.decode) for i in range(max(w.prefill, w.decode))]
    warm = {(s.request.prompt_len, _programs(s.assignment.mode), s.assignment.prefill_worker,
             s.assignment.decode_worker) for s in ran if s.assignment}
    for n in lengths:
        for mode in policy.modes(n):
            for pair in pairs:
                if (n, _programs(mode), *pair) in warm:
                    continue
                warm.add((n, _programs(mode), *pair))
                request = ask(n)
                asked = Asked(policy.context, {request.id: mode}, {request.id: pair})
                ran += drive(group, _router(group, config, setup, asked, costs, 0.0),
                             Scheduled([request]))
    failed = [s for s in ran if not s.completed]
    if failed:
        s = failed[0]
        raise RuntimeError(f"{policy.name}'s warm-up failed: "
                           f"{s.error or (s.finished and s.finished.error)}")


def _programs(mode: Mode) -> tuple[object, ...]:
    """What the programs a handoff runs depend on besides its prompt's length: all but a joint
    action's cut (every program runs one layer, so every joint cut runs the same ones)."""
    a = mode.action
    return (a.bits, a.kind, a.format, mode.schedule, mode.prefill, mode.chunks)


# -------------------------------------------------------------------------------- --http


def _serve_http(config: ServeConfig, stop: threading.Event) -> None:
    """Answer the OpenAI API at `config.http` until SIGINT or SIGTERM or `stop`, then stop as
    `shutdown` says: new requests refused (503) while those in flight are given `GRACE_S`, the
    rest aborted, then the HTTP server stopped and the group closed within `CLOSE_S` (killed
    after an abort: its decode members would run the aborted requests to their ends). With
    `config.json`, stdout holds a record of the server, then each request's record as it ends
    (before its client hears of the end)."""
    # the HTTP layer (FastAPI, pydantic, uvicorn) loads only here: a generated load, the Python
    # API and the doctor run on a machine that holds the compute stack alone
    from rekv_jax.serving.http import Closing, build_app, http_model, running

    def served(s: Served) -> None:
        if config.json:
            _emit(s.to_json(config.slo))

    with Server(config, stop, Grace(stop, GRACE_S), on_served=served) as server:
        model, clients = http_model(config.model), server.clients
        app = build_app(Closing(clients, stop), model, config.http.api_key, clients.metrics,
                        server.ids, config.http.max_body_bytes)
        with running(app, config.http.host, config.http.port) as url, stopped_by_signals(stop):
            _announce(url, model.id, config.policies[0], config.json)
            server.wait()
            # the front end answers until the requests in flight ended, refusing new ones
            server.drain(GRACE_S + DRAIN_S)


def _announce(url: str, model: str, policy: str, as_json: bool) -> None:
    """Where the server listens, on stdout: a line for a person, or a JSON record."""
    if as_json:
        return _emit({"kind": "http_server", "url": f"{url}/v1", "model": model,
                      "policy": policy})
    print(f"rekv serve: the OpenAI API at {url}/v1, model {model!r} ({policy}); "
          "Ctrl-C or SIGTERM stops it", flush=True)


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
