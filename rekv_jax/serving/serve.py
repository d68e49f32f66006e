"""One serving run as `rekv serve` asks for it (`ServeConfig`, checked whole at construction), and
`serve`, which runs it on the workers.

A run either drives generated request streams (one per arrival rate, each served under every
policy, on one set of workers) or answers clients over HTTP (one policy), never both.
"""

from __future__ import annotations

import dataclasses

from rekv_jax.gate_result import GateResult
from rekv_jax.planning.costmodel import Profile
from rekv_jax.serving.http import check_bind
from rekv_jax.serving.metrics import Slo
from rekv_jax.serving.requests import ServeRequest


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


def serve(config: ServeConfig) -> None:
    """Run `config` on its workers: the router, the prefill and decode workers, the policy."""
    raise NotImplementedError("the serving engine is not merged yet: `rekv serve` checked its "
                              "flags, but the decode engine and the router that run them are "
                              "still to come")
