"""A minimal driver of one prefill worker and one decode engine: requests with the action each is
handed off with arrive at their times; the driver hands the decode side its `Admit` and the
prefill side its `Prefill` at once, hands a `Held` request's `Admit` again once another request
finished, and collects what the workers emit until every request finished. `serve_pair` runs the
two workers as a group of two member processes (the parent does no JAX work);
`serve_local` runs both in this process over the in-process link (the prefill worker on a
thread). The router of a serving run (policies, several workers, the request stream) is built
on the same records.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence

from rekv_jax.action import Action
from rekv_jax.launch.environments import group_environments, visible_gpus
from rekv_jax.launch.group import Group, MemberEnded
from rekv_jax.model.loader import LoadedModel, load_config
from rekv_jax.serving.engine import (
    CHUNK_TOKENS,
    DecodeEngine,
    serving_mode,
)
from rekv_jax.serving.inbox import LocalInbox
from rekv_jax.serving.member import MemberSetup, serving_member
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import Admit, Finished, Held, Prefill, Ready, ServeRequest
from rekv_jax.transport import JobKey, LocalTransport

OnItem = Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of a driven stream, and the action it is handed off with."""

    request: ServeRequest
    action: str
    chunk_tokens: int = CHUNK_TOKENS  # its suffix's token chunks (`serving_mode`)

    def records(self, num_layers: int) -> tuple[Admit, Prefill]:
        """What the decode side and the prefill side are handed for it."""
        r = self.request
        mode = serving_mode(Action.parse(self.action, num_layers), r.prompt_len,
                            self.chunk_tokens)
        return (Admit(r.id, r.prompt_len, r.max_new_tokens, mode, 0, 0.0, r.sampling, r.stops),
                Prefill(r.id, r.tokens, mode, 0, r.sampling))


@dataclasses.dataclass(frozen=True)
class Driven:
    """What a driven stream produced."""

    finished: list[Finished]  # one per request, in the order asked
    items: list[object]  # everything the workers emitted, in the order it came
    used_pages: int  # pages the decode engine's requests still held at its end


class _Stream:
    """The driver's account of a stream: the `Admit`s to hand again, what finished."""

    def __init__(self, asks: Sequence[Ask], num_layers: int, on_item: OnItem | None) -> None:
        self.records = {a.request.id: a.records(num_layers) for a in asks}
        if len(self.records) != len(asks):
            raise ValueError("request ids must be unique")
        self.finished: dict[int, Finished] = {}
        self.ready: list[Ready] = []  # the workers that said they can serve
        self.items: list[object] = []
        self._held: list[Admit] = []
        self._on_item = on_item or (lambda item: None)
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.records)

    def take(self, item: object) -> list[Admit]:
        """Note an emitted item; the `Admit`s to hand again now (after a `Finished`)."""
        with self._lock:
            if isinstance(item, Ready):
                self.ready.append(item)
                return []
            self.items.append(item)
            again: list[Admit] = []
            if isinstance(item, Held):
                self._held.append(self.records[item.request_id][0])
            elif isinstance(item, Finished):
                self.finished[item.request_id] = item
                again, self._held = self._held, []
        self._on_item(item)
        return again

    def result(self, asks: Sequence[Ask], used_pages: int) -> Driven:
        return Driven([self.finished[a.request.id] for a in asks], self.items, used_pages)


def _in_order(asks: Sequence[Ask]) -> list[Ask]:
    return sorted(asks, key=lambda a: a.request.arrival_s)


def serve_local(setup: MemberSetup, asks: Sequence[Ask], on_item: OnItem | None = None,
                model: LoadedModel | None = None) -> Driven:
    """Drive `asks` through a decode engine (this thread) and a prefill worker (a thread of
    this process) over the in-process link; `model`: already loaded (else `setup.load()`)."""
    model = model or setup.load()
    cfg, params = model.cfg, model.params
    prefill_end, decode_end = LocalTransport.pair(setup.link_gbps)
    engine = DecodeEngine(cfg, params, [decode_end], setup.engine_config(), model.eos_ids,
                          model.tokenizer)
    worker = PrefillWorker(cfg, params, [prefill_end], timeout=setup.timeout)
    stream = _Stream(asks, cfg.num_layers, on_item)
    decode_in, prefill_in = LocalInbox(), LocalInbox()

    def emit(item: object) -> None:
        for admit in stream.take(item):
            decode_in.put(admit)
        if stream.done:
            decode_in.close()

    def feed() -> None:
        start = time.monotonic()
        for ask in _in_order(asks):
            time.sleep(max(0.0, start + ask.request.arrival_s - time.monotonic()))
            admit, prefill = stream.records[ask.request.id]
            prefill_in.put(prefill)
            decode_in.put(admit)
        prefill_in.close()

    threads = [threading.Thread(target=feed, name="rekv-feed", daemon=True),
               threading.Thread(target=worker.serve, args=(prefill_in, stream.take),
                                name="rekv-prefill-worker", daemon=True)]
    for t in threads:
        t.start()
    try:
        engine.serve(decode_in, emit)
    finally:
        prefill_in.close()
        for t in threads:
            t.join(setup.timeout)
        prefill_end.close(), decode_end.close()
    return stream.result(asks, engine.used_pages)


def serve_pair(setup: MemberSetup, asks: Sequence[Ask], on_item: OnItem | None = None) -> Driven:
    """Drive `asks` through a prefill worker and a decode engine, each a member process of a
    group (`serving_member`, on this machine, under a key made for them). TimeoutError when
    nothing was emitted for `setup.timeout` s while requests were running."""
    stream = _Stream(asks, load_config(setup.model).num_layers, on_item)
    member = dataclasses.replace(setup, cost_position=0)
    envs = group_environments(visible_gpus(), os.environ, 1, 1)
    with Group(serving_member, (member,), envs, key=JobKey.new()) as group:
        _pump(group, stream, lambda: len(stream.ready) < 2, setup.timeout * 4)
        start = time.monotonic()
        for ask in _in_order(asks):
            due = start + ask.request.arrival_s
            _pump(group, stream, lambda due=due: time.monotonic() < due,
                  max(due - time.monotonic(), 0.0) + setup.timeout)
            admit, prefill = stream.records[ask.request.id]
            group.send("prefill-0", prefill)
            group.send("decode-0", admit)
        _pump(group, stream, lambda: not stream.done, setup.timeout)
        ends = group.close(setup.timeout)
    failed = [f"{name}: {e.error}" for name, e in ends.items() if not e.ok]
    if failed:
        raise RuntimeError("; ".join(failed))
    return stream.result(asks, ends["decode-0"].value)


def _pump(group: Group, stream: _Stream, wanted: Callable[[], bool], timeout: float) -> None:
    """Pass on what the workers emit, sending `Held` requests' `Admit`s again, while `wanted()`
    holds. TimeoutError when nothing came for `timeout` s meanwhile; RuntimeError naming a
    member that ended."""
    heard = time.monotonic()
    while wanted():
        events = group.poll(0.05)
        for event in events:
            if isinstance(event, MemberEnded):
                raise RuntimeError(event.failure or f"{event.name} ended while serving")
            for admit in stream.take(event.item):
                group.send("decode-0", admit)
        if events:
            heard = time.monotonic()
        elif time.monotonic() - heard > timeout:
            raise TimeoutError(f"{len(stream.records) - len(stream.finished)} requests still "
                               f"running, nothing heard for {timeout:g} s")
