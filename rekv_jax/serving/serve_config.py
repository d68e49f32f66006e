"""What a serving run is, checked whole at construction (`ServeConfig`): the model, its policies
and SLO, its workers (`Workers`: how many, how joined, over what link) and what it serves: a
generated load (`Stream`s), the OpenAI API (`HttpBind`), or, with neither, the Python callers of
`server.Server`. `member_setup` is the one record every worker process is built from.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import os
from collections.abc import Callable

from rekv_jax.gate_result import GateResult
from rekv_jax.launch.child import member_names
from rekv_jax.launch.environments import group_environments, visible_gpus
from rekv_jax.launch.group import Group
from rekv_jax.launch.nodes import NodeGroup, Rendezvous
from rekv_jax.model.loader import load_config
from rekv_jax.planning.costmodel import Profile
from rekv_jax.planning.queueing import TPOT_STRETCH
from rekv_jax.serving.member import TIMEOUT_S, MemberSetup
from rekv_jax.serving.metrics import Slo
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.requests import ServeRequest
from rekv_jax.transport import JobKey
from rekv_jax.transport.cores import PINNING_ENV, usable_cpus

Members = Group | NodeGroup  # a run's workers, as the router's loop drives them
POOL_REQUESTS = 16  # a decode worker's pool holds this many of the run's longest requests
HTTP_CONTEXT = 2048  # the most positions (prompt and tokens) a client's request may take
MAX_BODY_BYTES = 4 * 2**20  # a request body's default limit: far beyond any prompt of a context


@dataclasses.dataclass(frozen=True)
class Stream:
    """The requests of one arrival rate (`load_gen.generate`)."""

    rate: float  # requests per second
    requests: tuple[ServeRequest, ...]


def http_context(model: str) -> int:
    """The positions a client's request may take: the model's, at most `HTTP_CONTEXT`."""
    return min(load_config(model).max_position_embeddings, HTTP_CONTEXT)


HTTP_STACK = ("fastapi", "pydantic", "uvicorn")  # what the OpenAI front end (`http`) runs on


def check_http_stack() -> None:
    """ValueError naming what the OpenAI front end needs and this Python lacks (a compute image
    may hold JAX alone), before any worker starts."""
    missing = [m for m in HTTP_STACK if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--http needs {', '.join(missing)}, not installed here (they come "
                         "with rekv-jax's dependencies: pip install -e .)")


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError unless `host` is loopback or an API key guards the server."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        loopback = False
    if not loopback and not api_key:
        raise ValueError(f"--http {host}: serving beyond loopback needs --api-key-file PATH "
                         "(or $REKV_API_KEY, or --api-key; clients then send Authorization: "
                         "Bearer KEY)")


@dataclasses.dataclass(frozen=True)
class HttpBind:
    """Where the OpenAI API listens, the key clients must send (None: none), and the largest
    request body it takes (larger: a 413)."""

    host: str
    port: int
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--http {self.host}:{self.port}: a port is 0..65535")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        check_bind(self.host, self.api_key)
        check_http_stack()


@dataclasses.dataclass(frozen=True)
class Workers:
    """The processes of a run and how they are joined (the flags `rekv handoff` shares)."""

    prefill: int = 1  # prefill worker processes
    decode: int = 1  # decode worker processes
    transport: str = "transfer-server"
    link_gbps: float | str | None = "paper"  # GB/s, "paper" (calibrated) or None (unpaced)
    fallback: str = "error"
    timeout: float = TIMEOUT_S  # seconds any wait may take
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
        """Each member's environment (`group_environments`): on CPUs, each member its own
        cores where `pin` and there is a core each, as each has its own GPU; else all share
        them."""
        cpus = usable_cpus() if self.pin else None
        return group_environments(visible_gpus(), os.environ, self.prefill, self.decode, cpus)

    def pinning(self) -> str | None:
        """How the members started here share this machine's cores, in words (None on GPUs
        and for members joined from their own nodes)."""
        if self.rendezvous is not None:
            return None
        return next(iter(self.environments().values())).get(PINNING_ENV)

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
    slo: Slo = Slo(1000.0, 100.0)
    workers: Workers = Workers()
    streams: tuple[Stream, ...] = ()  # the generated load (empty: serve clients)
    http: HttpBind | None = None
    profiles: tuple[Profile, ...] = ()  # the cost model's (empty: measured or estimated)
    gate: tuple[GateResult, ...] | None = None  # the quality gate's results (None: no gate)
    adaptive_bits: tuple[int, ...] = (16, 8)
    tpot_stretch: float | None = TPOT_STRETCH  # `policy.Context.tpot_stretch` (None: unbounded)
    json: bool = False  # one JSON record per request and summary on stdout
    plot_dir: str | None = None  # the PNGs' folder
    pool_requests: int = POOL_REQUESTS  # a decode worker's pool holds this many longest requests

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("a run needs a policy")
        if self.http is not None and self.streams:
            raise ValueError("a run serves HTTP clients (--http) or a generated load (--rate), "
                             "one of the two")
        if not self.streams and len(self.policies) > 1:
            raise ValueError(f"clients are served under one policy, got {list(self.policies)}")
        if not self.streams and self.plot_dir is not None:
            raise ValueError("--plot draws a generated load's sweep; --http has none")
        if self.pool_requests < 1:
            raise ValueError(f"a pool holds at least one request, got {self.pool_requests}")
        rates = [s.rate for s in self.streams]
        if len(set(rates)) < len(rates):
            raise ValueError(f"rates {rates} name one twice")


def member_setup(config: ServeConfig, link_gbps: float | None) -> MemberSetup:
    """What the members run with: a pool of `config.pool_requests` of the run's longest
    requests (clients': of the model's context, `http_context`)."""
    if config.streams:
        longest = max(len(r.tokens) + r.max_new_tokens for s in config.streams
                      for r in s.requests)
        position = max(len(r.tokens) for s in config.streams for r in s.requests) - 1
    else:
        longest = http_context(config.model)
        position = longest - 1
    pool = PoolConfig(config.pool_requests * PoolConfig(2).pages_for(longest) + 1)
    w = config.workers
    return MemberSetup(config.model, pool, transport=w.transport, link_gbps=link_gbps,
                       fallback=w.fallback, timeout=w.timeout, cost_position=position)
