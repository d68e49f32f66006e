"""A minimal driver of one prefill worker and one decode engine: requests with the action each is
handed off with arrive at their times; the driver hands the decode side its `Admit` and the
prefill side its `Prefill` at once, hands a `Held` request's `Admit` again once another request
finished, and collects what the workers emit until every request finished. `serve_pair` runs the
two workers as the launcher's pair of spawned processes (the parent does no JAX work);
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

import jax.numpy as jnp

from rekv_jax.action import Action
from rekv_jax.launch.child import Side
from rekv_jax.launch.environments import pair_environments, visible_gpus
from rekv_jax.launch.pair import Pair, loopback
from rekv_jax.launch.runtime import agree_runtime
from rekv_jax.mode import Fallback
from rekv_jax.model.loader import LoadedModel, load_config, load_model
from rekv_jax.model.transformer import attention_backend
from rekv_jax.serving.engine import (
    CHUNK_TOKENS,
    SUFFIX_BUDGET,
    DecodeEngine,
    EngineConfig,
    serving_mode,
)
from rekv_jax.serving.inbox import LocalInbox
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.prefill_worker import PrefillWorker
from rekv_jax.serving.requests import Admit, Finished, Held, Prefill, ServeRequest
from rekv_jax.transport import JobKey, LocalTransport, Transport

OnItem = Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class ServeSetup:
    """What both workers of a driven pair run with."""

    model: str = "tiny"  # a preset, a trained-model folder or hf:PATH (`load_model`)
    dtype: str = "bfloat16"
    pool: PoolConfig = PoolConfig(257)
    suffix_budget: int | None = SUFFIX_BUDGET  # token-layers of suffix compute per iteration
    transport: str = "transfer-server"
    link_gbps: float | None = None  # None: unpaced
    fallback: str = Fallback.ERROR
    check: bool = False  # check every request's paged cache (`EngineConfig.check`)
    timeout: float = 120.0  # seconds any wait may take

    def engine(self) -> EngineConfig:
        return EngineConfig(self.pool, self.suffix_budget, self.fallback, self.timeout,
                            check=self.check)

    def load(self) -> LoadedModel:
        return load_model(self.model, dtype=jnp.dtype(self.dtype), orbax=False)


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
        return (Admit(r.id, r.prompt_len, r.max_new_tokens, mode, 0, 0.0),
                Prefill(r.id, r.tokens, mode, 0))


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


def serve_local(setup: ServeSetup, asks: Sequence[Ask], on_item: OnItem | None = None,
                model: LoadedModel | None = None) -> Driven:
    """Drive `asks` through a decode engine (this thread) and a prefill worker (a thread of
    this process) over the in-process link; `model`: already loaded (else `setup.load()`)."""
    model = model or setup.load()
    cfg, params = model.cfg, model.params
    prefill_end, decode_end = LocalTransport.pair(setup.link_gbps)
    engine = DecodeEngine(cfg, params, decode_end, setup.engine())
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


def serving_side(side: Side, setup: ServeSetup) -> int | None:
    """One launched worker of a driven pair: the decode side runs the engine (returning the
    pages its requests still hold at its end), the prefill side the prefill worker."""
    transport: Transport = side.connect(setup.transport, link_gbps=setup.link_gbps,
                                        timeout=setup.timeout)  # before any other JAX work
    try:
        model = setup.load()
        cfg, params = model.cfg, model.params
        agree_runtime(transport, attention_backend(cfg, params["embed"].dtype), setup.timeout)
        if side.role == "prefill":
            PrefillWorker(cfg, params, [transport], timeout=setup.timeout).run(side)
            return None
        engine = DecodeEngine(cfg, params, transport, setup.engine())
        engine.run(side)
        return engine.used_pages
    finally:
        transport.close()


def serve_pair(setup: ServeSetup, asks: Sequence[Ask], on_item: OnItem | None = None) -> Driven:
    """Drive `asks` through a prefill worker and a decode engine, each a spawned process (on
    this machine, under a key made for them). TimeoutError when nothing was emitted for
    `setup.timeout` s while requests were running."""
    stream = _Stream(asks, load_config(setup.model).num_layers, on_item)
    again: list[Admit] = []
    envs = pair_environments(visible_gpus(), os.environ, None, setup.transport)
    with Pair(serving_side, (setup,), envs, key=JobKey.new(), coordinator=loopback(),
              grace=setup.timeout, on_item=lambda item: again.extend(stream.take(item))) as pair:
        start = time.monotonic()
        for ask in _in_order(asks):
            _pump(pair, stream, again, start + ask.request.arrival_s, setup.timeout)
            admit, prefill = stream.records[ask.request.id]
            pair.post(admit, "decode")
            pair.post(prefill, "prefill")
        _pump(pair, stream, again, None, setup.timeout)
        used = pair.close(setup.timeout)
    return stream.result(asks, used)


def _pump(pair: Pair, stream: _Stream, again: list[Admit], until: float | None,
          timeout: float) -> None:
    """Pass on what the workers emit, handing `Held` requests' `Admit`s again, until the time
    `until` (time.monotonic), or with None until every request finished."""
    heard, count = time.monotonic(), len(stream.items)
    while (time.monotonic() < until) if until is not None else not stream.done:
        pair.pump(min(0.05, until - time.monotonic()) if until is not None else 0.05)
        while again:
            pair.post(again.pop(0), "decode")
        if len(stream.items) != count:
            heard, count = time.monotonic(), len(stream.items)
        elif until is None and time.monotonic() - heard > timeout:
            raise TimeoutError(f"{len(stream.records) - len(stream.finished)} requests still "
                               f"running, nothing heard for {timeout:g} s")
