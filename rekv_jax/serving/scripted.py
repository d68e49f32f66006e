"""A scripted stream: requests that each name the action they are handed off with (`Ask`),
served through the router's loop (`router.drive`) under the `Asked` policy, as every serving
frontend serves its requests: on workers that are threads of this process over in-process links
(`serve_local`, `in_process.InProcess`) or the two member processes of a group (`serve_pair`);
a `Pair` of them serves such streams in turn. Tests, the engine soak, the doctor and `rekv
generate` choose each request's mode this way.

The router's predictions of a scripted stream come from the model's roofline profile; its
choices do not depend on them (each request runs as it asked).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

from rekv_jax.action import Action
from rekv_jax.launch.environments import group_environments, visible_gpus
from rekv_jax.launch.group import Emitted, Event, Group, failure_line
from rekv_jax.mode import Mode
from rekv_jax.model.loader import LoadedModel, load_config
from rekv_jax.planning.planner import analytic_profile
from rekv_jax.serving.engine import CHUNK_TOKENS, serving_mode
from rekv_jax.serving.in_process import InProcess
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.policy import Asked, Context
from rekv_jax.serving.requests import Admit, Finished, Prefill, ServeRequest
from rekv_jax.serving.router import Router, Scheduled, drive
from rekv_jax.serving.server import ESTIMATED_LENGTH, decode_costs, ready
from rekv_jax.transport import JobKey
from rekv_jax.transport.cores import usable_cpus

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
                Prefill(r.id, r.tokens, mode, 0, r.sampling, admitted=True))


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


class Pair:
    """One prefill worker and one decode engine that serve scripted streams in turn (`serve`):
    threads of this process over the in-process link (`model` given: already loaded), or two
    member processes of a group (`serving_member`, on this machine, under a key made for them).
    `close` ends them: the pages the engine's requests still hold (RuntimeError naming each
    worker that failed); leaving the `with` block without it kills them."""

    def __init__(self, setup: MemberSetup, model: LoadedModel | None = None) -> None:
        self.setup = setup
        self.cfg = model.cfg if model is not None else load_config(setup.model)
        profiles = (analytic_profile(self.cfg, ESTIMATED_LENGTH),)
        if model is not None:
            self._workers: InProcess | Group = InProcess(setup, model)
            self._costs = decode_costs([{1: 0.0}], profiles, setup.suffix_budget)
        else:
            member = dataclasses.replace(setup, cost_position=0)  # its timed steps: short rows
            envs = group_environments(visible_gpus(), os.environ, 1, 1, usable_cpus())
            self._workers = Group(serving_member, (member,), envs, key=JobKey.new())
            try:
                self._costs = ready(self._workers, setup, profiles)
            except BaseException:
                self._workers.kill()
                raise
        self._profiles, self._closed = profiles, False

    def serve(self, requests: Sequence[ServeRequest], modes: Mapping[int, Mode],
              on_item: OnItem | None = None) -> tuple[list[Served], list[object]]:
        """Every request, arriving at its `arrival_s`, through a router of the `Asked` policy
        (`modes`: each one's), to its end: the records in the order given, and everything the
        workers emitted meanwhile (each also handed to `on_item` as it came)."""
        if len({r.id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique")
        cfg, setup = self.cfg, self.setup
        context = Context(cfg.name, cfg.num_layers, self._profiles, self._costs,
                          adaptive_bits=(16,))  # `Asked` weighs no precision of its own
        policy = Asked(context, modes)
        gbps = setup.link_gbps or self._profiles[0].link_gbps
        router = Router(policy, Ledger.idle(1, 1, gbps), setup.pool, self._costs,
                        self._workers.send, 0.0, setup.timeout)
        items: list[object] = []

        def heard(event: Event) -> None:
            if isinstance(event, Emitted):
                items.append(event.item)
                if on_item is not None:
                    on_item(event.item)

        stream = Scheduled(sorted(requests, key=lambda r: r.arrival_s))
        by_id = {s.request.id: s for s in drive(self._workers, router, stream, heard)}
        return [by_id[r.id] for r in requests], items

    def close(self) -> int:
        self._closed = True
        ends = self._workers.close(self.setup.timeout)
        failed = [failure_line(e) for e in ends.values() if not e.ok]
        if failed:
            raise RuntimeError("; ".join(failed))
        return ends["decode-0"].value

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._closed:
            return
        if isinstance(self._workers, Group):
            self._workers.kill()
        else:
            self._workers.close(0.0)


def serve_local(setup: MemberSetup, asks: Sequence[Ask], on_item: OnItem | None = None,
                model: LoadedModel | None = None) -> Driven:
    """Serve `asks` on a prefill worker and a decode engine on threads of this process;
    `model`: already loaded (else `setup.load()`)."""
    with Pair(setup, model or setup.load()) as pair:
        return _driven(pair, asks, on_item)


def serve_pair(setup: MemberSetup, asks: Sequence[Ask], on_item: OnItem | None = None) -> Driven:
    """Serve `asks` on a prefill worker and a decode engine, each a member process of a group."""
    with Pair(setup) as pair:
        return _driven(pair, asks, on_item)


def _driven(pair: Pair, asks: Sequence[Ask], on_item: OnItem | None) -> Driven:
    modes = {a.request.id: a.mode(pair.cfg.num_layers) for a in asks}
    served, items = pair.serve([a.request for a in asks], modes, on_item)
    return Driven(served, items, pair.close())
