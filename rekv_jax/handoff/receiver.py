"""The decode side of a handoff, for every mode: one executor, `Reception`, that a loop advances
without blocking (paper §2.3 and its chunked and streamed variants).

A reception receives every message of its `Mode` at once, in the order sent (`Transport.recv`
returns futures), and handles them in that order as they arrive: the token ids and the first
token are kept; an `h_c` (or a token chunk of it) dispatches the suffix on it, or waits for the
prefix (the sequential schedule); a prefix part dispatches its restore. Device work is dispatched
asynchronously and watched from host threads (`watch`), which note the moment it completes on
the reception's `Clock`; the phases and the timeline derive from those events. Once the inputs
are all handled and the suffix and the prefix are done, the join (the complete cache and the
first token) is dispatched, and its end ends the handoff.

`advance()` does what can be done now and says whether the handoff is done; `waitables()` are
the futures whose completion lets it go on, so one thread can advance many receptions (and
decode steps) and sleep until one of them can move. `receive_handoff` is "advance until done".
The suffix (or recomputation) is queued as one unit per layer and token chunk (the same per-layer
programs `run_suffix` and `prefill` run, so the same bits) and dispatched as far as a
`WorkBudget` allows: all at once for a lone handoff, a bounded amount per iteration of a decode
loop that keeps stepping running requests beside it. A `sink` takes the cache's layers as they
complete (a decode worker's pages) instead of the reception joining them into one cache.
A prefix that fails to arrive (corrupted, lost, its peer gone) fails the handoff, or, under the
recompute fallback, makes it rebuild the cache from the token ids.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError
from rekv_jax.handoff.outcome import Clock, Event, Handoff, PrefillTimes, phases_of
from rekv_jax.handoff.payload import prefix_specs, unpack_prefix
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.kv import KVCache
from rekv_jax.mode import Fallback, Mode, check_fallback
from rekv_jax.model.transformer import (
    LayerPrograms,
    Params,
    greedy_token,
    new_cache,
    token_chunks,
)
from rekv_jax.plan import Message, Part
from rekv_jax.transport import Arrival, Transport, checksums
from rekv_jax.transport.workers import LIVENESS_S, Worker

LANES = ("prefix", "suffix", "join")  # the kinds of device work a reception watches
_lanes: dict[str, Worker] = {}  # one watcher thread per lane, for the process


def _start_lanes() -> None:
    """Make the lanes' threads (once per process, before any handoff is timed)."""
    for lane in LANES:
        if lane not in _lanes:
            _lanes[lane] = Worker(f"rekv-watch-{lane}")


def watch(lane: str, arrays: object) -> concurrent.futures.Future[float]:
    """A future of when `arrays` were computed (time.perf_counter): at once if they are already
    (no hop to another thread), else taken on a host thread of `lane` the moment they are (the
    work of one lane completes in dispatch order)."""
    if all(x.is_ready() for x in jax.tree.leaves(arrays)):
        out: concurrent.futures.Future[float] = concurrent.futures.Future()
        try:
            jax.block_until_ready(arrays)  # raises the error of a failed computation
            out.set_result(time.perf_counter())
        except Exception as e:  # handed to whoever waits on the future
            out.set_exception(e)
        return out
    _start_lanes()

    def done() -> float:
        jax.block_until_ready(arrays)
        return time.perf_counter()

    return _lanes[lane].submit(done)


def _last_of(futures: list[concurrent.futures.Future[float]]) -> concurrent.futures.Future[float]:
    """A future of the latest time `futures` (of `watch`) give, once they all completed (the
    first error, if one failed)."""
    out: concurrent.futures.Future[float] = concurrent.futures.Future()

    def done(_: concurrent.futures.Future) -> None:
        if not all(f.done() for f in futures):
            return
        errors = [f.exception() for f in futures if f.exception() is not None]
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # the last two raced
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(max(f.result() for f in futures))

    for f in futures:
        f.add_done_callback(done)
    return out


class WorkBudget:
    """How much suffix compute receptions may dispatch now, in token-layers (one layer program
    over T tokens costs T); None: no limit. The first unit taken always goes, so a unit larger
    than the budget still runs, one per budget."""

    def __init__(self, token_layers: int | None = None) -> None:
        self.left, self.spent = token_layers, 0

    def take(self, cost: int) -> bool:
        """Whether a unit of `cost` may be dispatched now (then it is spent)."""
        if self.left is not None and self.spent and cost > self.left:
            return False
        self.spent += cost
        if self.left is not None:
            self.left -= cost
        return True


# Where a reception puts the cache's layers as they complete: (layers first.. of KV [n, B, T, K,
# H] at token positions start..start+T-1, first, start)
Sink = Callable[[KVCache, int, int], None]


class Reception:
    """The decode side of one handoff of `mode` (`tag`'s messages over `link`): `start`, then
    `advance` until it returns True, then `outcome`. With a `sink`, the cache's layers go there
    as they complete and the outcome holds no cache. `first`: the buffers of the first-token
    part, as the prefill side's `FirstDraw` sends them (None: the token [B] int32 alone)."""

    def __init__(self, link: Transport, cfg: ModelConfig, params: Params, mode: Mode,
                 batch: int, seq_len: int, tag: str, fallback: str = Fallback.ERROR,
                 backend: str | None = None, timeout: float = 60.0, sink: Sink | None = None,
                 first: Sequence[jax.ShapeDtypeStruct] | None = None) -> None:
        self._link, self._cfg, self._params, self.mode = link, cfg, params, mode
        self._batch, self._seq_len, self.tag = batch, seq_len, tag
        self._fallback, self._backend, self._timeout = check_fallback(fallback), backend, timeout
        self._dtype = params["embed"].dtype
        self._first_specs = list(first or [jax.ShapeDtypeStruct((batch,), jnp.int32)])
        self._programs = LayerPrograms.of(cfg, params)  # checked once, not per layer
        _start_lanes()  # not inside the handoff's interval
        self._codec = PrefixCodec.of(cfg, params, mode.action)
        self._messages = mode.messages(seq_len, cfg.num_layers)
        self.clock: Clock | None = None
        self._arrivals: list[Arrival] = []
        self._next = 0  # the next message to handle
        self._tokens = self._sent_first = self._held = None
        self._suffix_kv: KVCache | None = None
        self._suffix_layers: list[KVCache] = []  # an unchunked suffix's, in order
        self._work: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._sink = sink
        self._logits: jax.Array | None = None
        # the prefix parts, in order (with a sink, the futures of their restores)
        self._restored: list[KVCache | concurrent.futures.Future[float]] = []
        self._prefix: KVCache | None = None
        self._watches: dict[str, tuple[concurrent.futures.Future[float], str]] = {}
        self._kv: KVCache | None = None
        self._first_token: jax.Array | None = None
        self.fell_back = False

    # -- the loop's interface ----------------------------------------------------------------

    def start(self) -> None:
        """Start the clock and every message's receive, in the order sent."""
        self.clock = Clock()
        self._arrivals = [self._link.recv(f"{self.tag}/{m.name}", self._specs(m), self._timeout)
                          for m in self._messages]

    def advance(self, budget: WorkBudget | None = None) -> bool:
        """Do what can be done now without blocking, dispatching as much queued suffix work as
        `budget` allows (None: all); whether the handoff is done. Raises its error (ValueError:
        the sides disagree on a message; TransportError: a message failed and no fallback
        recovered it)."""
        self._note_watched()
        if "end" in self._watches:
            return self._done("end")
        try:
            while self._next < len(self._arrivals) and self._arrivals[self._next].done():
                self._take(self._messages[self._next], self._arrivals[self._next].result())
                self._next += 1
        except TransportError as e:
            self._fall_back(self._lost(e))
        except BaseException:
            self.abandon()
            raise
        if self._held is not None and self._done("prefix"):  # the sequential schedule
            self._run_suffix(self._held)
            self._held = None
        budget = budget or WorkBudget()
        while self._work and budget.take(self._work[0][0]):
            self._work.popleft()[1]()
        if self._next == len(self._arrivals) and self._held is None and not self._work and all(
                self._done(name) for name in self._watches):
            self._join()
            self._note_watched()  # the join may be done already (its inputs were)
            return self._done("end")
        return False

    @property
    def pending_work(self) -> int:
        """Token-layers of suffix compute queued and not yet dispatched."""
        return sum(cost for cost, _ in self._work)

    @property
    def first_token(self) -> jax.Array:
        """The first token [B] (once `advance` returned True)."""
        return self._first_token

    @property
    def logits(self) -> jax.Array | None:
        """The last position's logits [B, V] f32 if this side computed them (once done)."""
        return self._logits

    @property
    def sent_first(self) -> tuple[jax.Array, ...] | None:
        """The prefill side's first-token part (its `FirstDraw`'s buffers), once arrived."""
        return self._sent_first

    @property
    def tokens(self) -> jax.Array | None:
        """The prompt's token ids [B, S], once they arrived."""
        return self._tokens

    def _note_watched(self) -> None:
        """Note on the clock when each finished piece of device work finished."""
        for future, event in self._watches.values():
            if future.done():
                self.clock.note(event, future.result())

    def waitables(self) -> list[concurrent.futures.Future]:
        """The futures whose completion lets `advance` go on (none once it is done)."""
        pending = [f for f, _ in self._watches.values() if not f.done()]
        if self._next < len(self._arrivals):
            pending.append(self._arrivals[self._next])
        return pending

    def abandon(self) -> None:
        """Tell the transport nobody waits for this handoff's messages any more."""
        for arrival in self._arrivals[self._next:]:
            arrival.abandon()

    def outcome(self, timeout: float | None = None) -> Handoff:
        """The complete cache, the first token and the phase times (after `advance` returned
        True): waits for the prefill side's times (posted after its last message; `timeout`
        s, default the reception's), compares its suffix checksums."""
        sent = PrefillTimes.from_json(self._link.recv_meta(f"{self.tag}/prefill",
                                                           timeout or self._timeout))
        match = None  # compared after the interval: a device-to-host sync
        if sent.suffix_sums and self._suffix_kv is not None and not self.fell_back:
            match = tuple(checksums(self._suffix_kv.buffers)) == sent.suffix_sums
        phases, timeline, total = phases_of(self.clock, sent)
        return Handoff(self._kv, self._first_token, total, phases, timeline, sent.sent_bytes,
                       self.fell_back, match)

    # -- messages --------------------------------------------------------------------------

    def _specs(self, message: Message) -> list[jax.ShapeDtypeStruct]:
        B, (start, stop) = self._batch, message.tokens
        specs = {Part.TOKENS: [jax.ShapeDtypeStruct((B, self._seq_len), jnp.int32)],
                 Part.FIRST: self._first_specs,
                 Part.BOUNDARY: [jax.ShapeDtypeStruct((B, stop - start, self._cfg.hidden_size),
                                                      self._dtype)]}
        out = []
        for part in message.parts:
            out += specs[part] if part != Part.PREFIX else prefix_specs(
                self._cfg, self._codec, B, stop - start, message.layers[1] - message.layers[0],
                self._dtype)
        return out

    def _take(self, message: Message, buffers: list[jax.Array]) -> None:
        """Handle one arrived message, its parts in order."""
        rest = list(buffers)
        for part in message.parts:
            if part == Part.TOKENS:
                self._tokens = rest.pop(0)
            elif part == Part.FIRST:
                self._sent_first = tuple(rest.pop(0) for _ in self._first_specs)
            elif part == Part.BOUNDARY:
                self._on_boundary(message, rest.pop(0))
            else:
                self._on_prefix(message, rest)
        arrived = self._arrivals[self._next].settled_at
        if {Part.BOUNDARY, Part.FIRST} & set(message.parts):
            self.clock.note(Event.BOUNDARY, arrived)
        if Part.TOKENS in message.parts and not self.mode.action.cut:  # full recomputation
            self.clock.note(Event.BOUNDARY, arrived)
            self._recompute(self.mode.suffix_chunks)

    def _on_boundary(self, message: Message, h: jax.Array) -> None:
        """h_c, or its token chunk `message.chunk`: run the suffix on it now, or (sequential)
        once the prefix is there."""
        if self.mode.suffix_chunks > 1:
            self._run_chunk(message, h)
        elif self.mode.suffix_waits_for_prefix:
            self._held = h
        else:
            self._run_suffix(h)

    def _on_prefix(self, message: Message, buffers: list[jax.Array]) -> None:
        """Restore one prefix part (into the sink, if any); once the last is in, watch the
        whole prefix."""
        part = unpack_prefix(buffers, self._codec, self._dtype, self._backend,
                             message.layers[0], message.tokens[0])
        if self._sink is not None:  # into the sink; kept only until its restore is done
            self._sink(part, message.layers[0], message.tokens[0])
            self._restored.append(watch("prefix", part))
        else:
            self._restored.append(part)
        if len(self._restored) == sum(Part.PREFIX in m.parts for m in self._messages):
            parts, self._restored = self._restored, []
            if self._sink is not None:
                self._watches["prefix"] = _last_of(parts), Event.PREFIX
                return
            spans = len({m.tokens for m in self._messages if Part.PREFIX in m.parts}) > 1
            self._prefix = KVCache.join_spans(*parts) if spans else KVCache.concat(*parts)
            self._watches["prefix"] = watch("prefix", self._prefix), Event.PREFIX

    # -- device work -------------------------------------------------------------------------

    def _run_suffix(self, h_c: jax.Array) -> None:
        self.clock.note(Event.SUFFIX_START)
        self._queue_layers(h_c, self.mode.action.cut, (0, self._seq_len), False, True)

    def _run_chunk(self, message: Message, h: jax.Array) -> None:
        """Queue layers c..L-1 on one token chunk of h_c; after the last chunk, the head on its
        last position."""
        cfg, c = self._cfg, self.mode.action.cut
        if self._suffix_kv is None:
            self.clock.note(Event.SUFFIX_START)
            self._suffix_kv = new_cache(cfg, cfg.num_layers - c, self._batch, self._seq_len,
                                        self._dtype)
        self._queue_layers(h, c, message.tokens, True, message.tokens[1] == self._seq_len)

    def _recompute(self, chunks: int) -> None:
        """Queue every layer from the token ids, in `chunks` token chunks (`prefill(chunks)`)."""
        self.clock.note(Event.SUFFIX_START)
        if chunks > 1:
            self._suffix_kv = new_cache(self._cfg, self._cfg.num_layers, self._batch,
                                        self._seq_len, self._dtype)
        ranges = token_chunks(self._seq_len, chunks)
        for i, (start, stop) in enumerate(ranges):
            ids = self._tokens if chunks == 1 else self._tokens[:, start:stop]
            self._queue_layers(ids, 0, (start, stop), chunks > 1, i == len(ranges) - 1)

    def _queue_layers(self, x: jax.Array, first: int, tokens: tuple[int, int], chunked: bool,
                      last: bool) -> None:
        """Queue layers first..L-1 on x (token ids [B, T] when first is 0, else a residual
        [B, T, D]) at positions tokens[0]..tokens[1]-1, one unit a layer: through the chunked
        suffix cache (`run_chunk`), or as a whole prompt pass (`run_layers`). After the `last`
        chunk, the head and the suffix's end."""
        state = {"x": x, "positions": None}
        for layer in range(first, self._cfg.num_layers):
            unit = functools.partial(self._layer, state, layer, first, tokens[0], chunked)
            self._work.append((tokens[1] - tokens[0], unit))
        if last:
            self._work.append((0, functools.partial(self._end_suffix, state)))

    def _layer(self, state: dict, layer: int, first: int, start: int, chunked: bool) -> None:
        """One queued unit: `layer` on state["x"] (embedded first if token ids), its KV kept:
        the program `run_chunk` (chunked) or `run_suffix` / `prefill` runs for that layer."""
        programs, x = self._programs, state["x"]
        if x.ndim == 2:
            x = programs.embed(x)
        if chunked:
            i, kv = layer - first, self._suffix_kv
            x, one = programs.chunk(x, kv.layers(i, i + 1), layer, start)
            self._suffix_kv = KVCache.concat(kv.layers(0, i), one, kv.layers(i + 1, kv.num_layers))
        else:
            if state["positions"] is None:  # on the device once for the suffix's layers
                state["positions"] = programs.positions(x)
            x, one = programs.prompt(x, layer, state["positions"])
            self._suffix_layers.append(one)
        state["x"] = x

    def _end_suffix(self, state: dict) -> None:
        """The head on the last position; the suffix's layers to the sink; watched."""
        cfg = self._cfg
        self._logits = self._programs.head(state["x"])
        if self._suffix_layers:
            self._suffix_kv = KVCache.concat(*self._suffix_layers)
            self._suffix_layers = []
        suffix = self._suffix_kv
        if self._sink is not None:
            self._sink(suffix, cfg.num_layers - suffix.num_layers, 0)
        self._watches["suffix"] = (watch("suffix", (suffix, self._logits)), Event.SUFFIX_END)

    def _done(self, name: str) -> bool:
        """Whether the device work `name` was dispatched and finished (raising its error)."""
        if name not in self._watches or not self._watches[name][0].done():
            return False
        self._watches[name][0].result()
        return True

    def _lost(self, error: TransportError) -> TransportError:
        """The error of the message that failed, saying how much of the prefix had arrived."""
        parts = [m.name for m in self._messages if Part.PREFIX in m.parts]
        name = self._messages[self._next].name
        if name not in parts:
            return error
        done = parts.index(name)
        return TransportError(f"prefix part {name} lost after {done} of {len(parts)} arrived: "
                              f"{error}")

    def _fall_back(self, error: TransportError) -> None:
        """A message failed: rebuild the cache from the token ids (`Fallback.RECOMPUTE`, once
        they are here), or fail the handoff."""
        self.abandon()
        if self._fallback != Fallback.RECOMPUTE or self._tokens is None or not self.mode.action.cut:
            raise error
        self.fell_back, self._next, self._held = True, len(self._arrivals), None
        self._prefix, self._suffix_kv, self._suffix_layers, self._restored = None, None, [], []
        self._work.clear()
        self._watches.clear()  # what was dispatched still runs; its times are not the cache's
        boundary = self.clock.note(Event.BOUNDARY)
        self.clock.set(Event.PREFIX, boundary)
        self.clock.forget(Event.SUFFIX_START)
        self.clock.forget(Event.SUFFIX_END)
        self._recompute(1)

    def _join(self) -> None:
        """The complete cache and the first token, dispatched and watched."""
        prefix, suffix = self._prefix, self._suffix_kv
        if self._sink is not None:  # the sink holds the cache
            self._kv = self._suffix_kv = None
        else:
            self._kv = suffix if prefix is None else prefix if suffix is None else (
                KVCache.concat(prefix, suffix))
        self._first_token = (self._sent_first[0] if self._logits is None
                             else greedy_token(self._logits))
        self._watches["end"] = watch("join", (self._kv, self._first_token)), Event.END


def receive_handoff(link: Transport, cfg: ModelConfig, params: Params, mode: Mode, batch: int,
                    seq_len: int, tag: str, fallback: str = Fallback.ERROR,
                    backend: str | None = None, timeout: float = 60.0) -> Handoff:
    """The decode side of one handoff, from the clocks' common start (`TAG/go`, agreed with the
    prefill side) to its outcome: a `Reception` advanced until done."""
    reception = Reception(link, cfg, params, mode, batch, seq_len, tag, fallback, backend,
                          timeout)
    link.agree(f"{tag}/go", {}, timeout)
    reception.start()
    while not reception.advance():
        concurrent.futures.wait(reception.waitables(), LIVENESS_S,
                                concurrent.futures.FIRST_COMPLETED)
    return reception.outcome()
