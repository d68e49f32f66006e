"""A scripted stream: requests that each name the action they are handed off with (`Ask`),
served through the router's loop (`router.drive`) under the `Asked` policy, as every serving
frontend serves its requests: on workers that are threads of this process over in-process links
(`serve_local`, `in_process.InProcess`) or the two member processes of a group (`serve_pair`).
Tests, the engine soak and the doctor choose each request's action this way.

The router's predictions of a scripted stream come from the model's roofline profile; its
choices do not depend on them (each request runs as it asked).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.launch.environments import group_environments, visible_gpus
from rekv_jax.launch.group import Emitted, Event, Group
from rekv_jax.launch.processes import Ended
from rekv_jax.mode import Mode
from rekv_jax.model.loader import LoadedModel, load_config
from rekv_jax.planning.planner import analytic_profile
from rekv_jax.planning.queueing import DecodeCosts
from rekv_jax.serving.engine import CHUNK_TOKENS, serving_mode
from rekv_jax.serving.in_process import InProcess
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.policy import Asked, Context
from rekv_jax.serving.requests import Admit, Finished, Prefill, ServeRequest
from rekv_jax.serving.router import Router, Scheduled, Workers, drive
from rekv_jax.serving.server import ESTIMATED_LENGTH, decode_costs, ready
from rekv_jax.transport import JobKey

OnItem = Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of a scripted stream, and the action it is handed off with."""

    request: ServeRequest
    action: str
    chunk_tokens: int = CHUNK_TOKENS  # its suffix's token chunks (`serving_mode`)

    def mode(self, num_layers: int) -> Mode:
        """How it is handed off (`serving_mode`)."""
        action = Action.parse(self.action, num_layers)
        return serving_mode(action, self.request.prompt_len, self.chunk_tokens)

    def records(self, num_layers: int) -> tuple[Admit, Prefill]:
        """What its decode side and its prefill side are handed, on workers 0 and 0."""
        r, mode = self.request, self.mode(num_layers)
        return (Admit(r.id, r.prompt_len, r.max_new_tokens, mode, 0, 0.0, r.sampling, r.stops),
                Prefill(r.id, r.tokens, mode, 0, r.sampling))


@dataclasses.dataclass(frozen=True)
class Driven:
    """What a scripted stream produced."""

    served: list[Served]  # one per request, in the order asked
    items: list[object]  # everything the workers emitted, in the order it came
    used_pages: int  # pages the decode engine's requests still held at its end

    @property
    def finished(self) -> list[Finished | None]:
        """Each request's decode-side report (None: it ended before its decode worker had it)."""
        return [s.finished for s in self.served]


def serve_local(setup: MemberSetup, asks: Sequence[Ask], on_item: OnItem | None = None,
                model: LoadedModel | None = None) -> Driven:
    """Serve `asks` on a prefill worker and a decode engine on threads of this process;
    `model`: already loaded (else `setup.load()`)."""
    model = model or setup.load()
    workers = InProcess(setup, model)
    costs = decode_costs([{1: 0.0}], _profiles(model.cfg), setup.suffix_budget)
    try:
        served, items = _drive(workers, setup, model.cfg, costs, asks, on_item)
    finally:
        ends = workers.close(setup.timeout)
    return _driven(asks, served, items, ends)


def serve_pair(setup: MemberSetup, asks: Sequence[Ask], on_item: OnItem | None = None) -> Driven:
    """Serve `asks` on a prefill worker and a decode engine, each a member process of a group
    (`serving_member`, on this machine, under a key made for them)."""
    cfg = load_config(setup.model)
    member = dataclasses.replace(setup, cost_position=0)  # its timed steps: short rows
    envs = group_environments(visible_gpus(), os.environ, 1, 1)
    with Group(serving_member, (member,), envs, key=JobKey.new()) as group:
        costs = ready(group, setup, _profiles(cfg))
        served, items = _drive(group, setup, cfg, costs, asks, on_item)
        ends = group.close(setup.timeout)
    return _driven(asks, served, items, ends)


def _profiles(cfg: ModelConfig) -> tuple:
    return (analytic_profile(cfg, ESTIMATED_LENGTH),)


def _drive(workers: Workers, setup: MemberSetup, cfg: ModelConfig, costs: DecodeCosts,
           asks: Sequence[Ask], on_item: OnItem | None) -> tuple[list[Served], list[object]]:
    """Every ask through a router of the `Asked` policy over one pair of workers."""
    if len({a.request.id for a in asks}) != len(asks):
        raise ValueError("request ids must be unique")
    profiles = _profiles(cfg)
    policy = Asked(Context(cfg.name, cfg.num_layers, profiles, costs),
                   {a.request.id: a.mode(cfg.num_layers) for a in asks})
    router = Router(policy, Ledger.idle(1, 1, setup.link_gbps or profiles[0].link_gbps),
                    setup.pool, costs, workers.send, 0.0, setup.timeout)
    items: list[object] = []

    def heard(event: Event) -> None:
        if isinstance(event, Emitted):
            items.append(event.item)
            if on_item is not None:
                on_item(event.item)

    stream = sorted((a.request for a in asks), key=lambda r: r.arrival_s)
    return drive(workers, router, Scheduled(stream), heard), items


def _driven(asks: Sequence[Ask], served: list[Served], items: list[object],
            ends: dict[str, Ended]) -> Driven:
    """The stream's result; RuntimeError naming each member that failed."""
    failed = [f"{name}: {e.error}" for name, e in ends.items() if not e.ok]
    if failed:
        raise RuntimeError("; ".join(failed))
    by_id = {s.request.id: s for s in served}
    return Driven([by_id[a.request.id] for a in asks], items, ends["decode-0"].value)
