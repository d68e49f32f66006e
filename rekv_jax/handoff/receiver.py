"""The decode side of a handoff: one executor, `Reception`, that runs a handoff's plan (its mode's,
`Mode.plan`, or one given) and that a loop advances without blocking (paper §2.3 and its chunked
and streamed variants).

A reception receives every message of its plan at once, in the order sent (`Transport.recv`
returns futures), and handles them in that order as they land: the token ids and the first token
are kept, a piece of h_c or a prefix part waits for the step that takes it. Each decode-side step
starts once what it needs is there: a `Restore` once its message has landed; a `Suffix` once its
message has (its piece of h_c, or the token ids), each restore it waits for has completed, and
the suffix steps before it are queued (the device runs them in dispatch order); the join once all
else has completed. Device work is dispatched asynchronously and watched from the reception's own
host threads (`device_work.Watcher`, ended with it), which note the moment it completes on the
reception's `Clock`; the phases and the timeline derive from those events.

A reception's `State` moves only along `TRANSITIONS`. `advance()` does what can be done now and
says whether the handoff is done; `waitables()` are the futures whose completion lets it go on, so
one thread can advance many receptions (and decode steps) and sleep until one of them can move.
`receive_handoff` is "advance until done". A suffix step is queued as one unit per layer (the
same per-layer programs `run_suffix`, `run_chunk` and `prefill` run, so the same bits) and
dispatched as far as a `WorkBudget` allows: all at once for a lone handoff, a bounded amount per
iteration of a decode loop that steps running requests beside it. A reception that keeps no
cache hands each completed part to its caller as data (`produced`; a decode worker's pages). A
prefix that fails to arrive fails the handoff, or (the recompute fallback) makes it rebuild the
cache from the token ids.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError
from rekv_jax.handoff.device_work import Lane, Watcher, WorkBudget, last_of
from rekv_jax.handoff.outcome import Clock, Event, Handoff, PrefillTimes, phases_of
from rekv_jax.handoff.payload import message_specs, unpack_prefix
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.kv import KVCache
from rekv_jax.mode import Fallback, Mode, check_fallback
from rekv_jax.model.transformer import LayerPrograms, Params, greedy_token, new_cache
from rekv_jax.plan import Part, Plan, Receive, Restore, Suffix, chunks_of
from rekv_jax.transport import Arrival, Transport, checksums
from rekv_jax.transport.workers import LIVENESS_S


class State(enum.StrEnum):
    """Where a reception is."""

    NEW = "new"  # made (its watcher's threads started), nothing received yet
    RECEIVING = "receiving"  # its plan's messages and steps under way
    RECOVERING = "recovering"  # a message failed: the cache rebuilt from the token ids
    JOINING = "joining"  # the join dispatched
    DONE = "done"  # the complete cache (or its parts, produced) and the first token
    ABANDONED = "abandoned"  # ended without them: failed, or given up by its caller


TRANSITIONS = {State.NEW: {State.RECEIVING, State.ABANDONED},
               State.RECEIVING: {State.RECOVERING, State.JOINING, State.ABANDONED},
               State.RECOVERING: {State.JOINING, State.ABANDONED},
               State.JOINING: {State.DONE, State.ABANDONED}, State.DONE: set(),
               State.ABANDONED: set()}  # the moves a reception may make
RECOVERY = -1  # the step key of the recomputation a failed prefix falls back to


@dataclasses.dataclass(frozen=True)
class Produced:
    """Cache layers a reception completed, for a caller that keeps the cache itself: KV
    [n, B, T, K, H] of layers `first`.. at token positions `start`..start+T-1."""

    kv: KVCache
    first: int
    start: int


@dataclasses.dataclass
class _Pass:
    """One suffix step's residual as its layers run: from `source`'s (the suffix step it
    continues) once that one's units are dispatched, else given: token ids [B, T] before a
    recomputation's first layer, h_c [B, T, D] after it; positions made once per pass."""

    x: jax.Array | None
    source: int | None = None
    positions: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class _Unit:
    """Queued device work of suffix step `step`: a `layer`, or (None) the head after its last."""

    step: int
    layer: int | None
    cost: int  # token-layers


class Reception:
    """The decode side of one handoff of `mode` (`tag`'s messages over `link`), running `plan`
    (None: the mode's): `start`, then `advance` until it returns True, then `outcome`. With
    `keeps_cache` False, the cache's parts go to `produced()` as they complete and the outcome
    holds no cache. `first`: the buffers of the first-token part, as the prefill side's
    `FirstDraw` sends them (None: the token [B] int32 alone)."""

    def __init__(self, link: Transport, cfg: ModelConfig, params: Params, mode: Mode,
                 batch: int, seq_len: int, tag: str, fallback: str = Fallback.ERROR,
                 backend: str | None = None, timeout: float = 60.0, keeps_cache: bool = True,
                 first: Sequence[jax.ShapeDtypeStruct] | None = None,
                 plan: Plan | None = None) -> None:
        self._link, self._cfg, self._params, self.mode = link, cfg, params, mode
        self._batch, self._seq_len, self.tag = batch, seq_len, tag
        self._fallback, self._backend, self._timeout = check_fallback(fallback), backend, timeout
        self._dtype, self._keeps = params["embed"].dtype, keeps_cache
        self._first_specs = list(first or [jax.ShapeDtypeStruct((batch,), jnp.int32)])
        self._programs = LayerPrograms.of(cfg, params)  # checked once, not per layer
        self._codec = PrefixCodec.of(cfg, params, mode.action)
        self.plan = plan or mode.plan(seq_len, cfg.num_layers)
        self._steps = dict(enumerate(self.plan.steps))
        self._receives = [i for i, s in self._steps.items() if isinstance(s, Receive)]
        self._order = {step: k for k, step in enumerate(self._receives)}  # a message's place
        self._decode = [i for i, s in self._steps.items() if isinstance(s, Restore | Suffix)]
        self._watcher = Watcher(f"rekv-{tag}")  # its threads start outside the interval
        self.state, self.clock = State.NEW, Clock()
        self._arrivals: list[Arrival] = []
        self._next = 0  # the next message to handle, of `_receives`
        # once arrived: the token ids [B, S], the prefill side's first-token part (its
        # `FirstDraw`'s buffers); once done: the last position's logits [B, V] f32 if this side
        # computed them, the first token [B]
        self.tokens = self.sent_first = self.logits = self.first_token = None
        self._landed: dict[int, list[jax.Array]] = {}  # a message's buffers, until taken
        self._started: set[int] = set()  # decode-side steps restored or queued
        self._restored: dict[int, concurrent.futures.Future[float]] = {}
        self._parts: list[KVCache] = []  # restored prefix parts, in order (kept cache)
        self._passes: dict[int, _Pass] = {}
        self._work: collections.deque[_Unit] = collections.deque()
        self._suffix_kv: KVCache | None = None  # a chunked suffix's cache, or the suffix's
        self._suffix_layers: list[KVCache] = []  # a whole-prompt suffix's, in order
        self._prefix = self._kv = None
        self._produced: list[Produced] = []
        self._watches: dict[str, tuple[concurrent.futures.Future[float], str]] = {}
        self.fell_back = False

    # -- the loop's interface ----------------------------------------------------------------

    def start(self) -> None:
        """Start the clock and every message's receive, in the order sent."""
        self._move(State.RECEIVING)
        self.clock = Clock()
        self._arrivals = [self._link.recv(f"{self.tag}/{m.name}", message_specs(
            self._cfg, self._codec, m, self._batch, self._seq_len, self._dtype,
            self._first_specs), self._timeout) for m in self.plan.messages]

    def advance(self, budget: WorkBudget | None = None) -> bool:
        """Do what can be done now without blocking, dispatching as much queued suffix work as
        `budget` allows (None: all); whether the handoff is done. Raises its error (ValueError:
        the sides disagree on a message; TransportError: a message failed and no fallback
        recovered it)."""
        if self.state not in (State.RECEIVING, State.RECOVERING):
            return self._ended()
        try:
            self._note_watched()
            self._take_landed()
            self._start_ready()
        except TransportError as e:
            self._fall_back(self._lost(e))
        except BaseException:
            self.abandon()
            raise
        budget = budget or WorkBudget()
        while self._work and budget.take(self._work[0].cost):
            self._run(self._work.popleft())
        if self._joinable():
            self._join()
            self._note_watched()  # the join may be done already (its inputs were)
            return self._ended()
        return False

    def produced(self) -> list[Produced]:
        """The cache's parts completed since the last call (a reception that keeps no cache)."""
        out, self._produced = self._produced, []
        return out

    @property
    def pending_work(self) -> int:
        """Token-layers of suffix compute queued and not yet dispatched."""
        return sum(unit.cost for unit in self._work)

    def waitables(self) -> list[concurrent.futures.Future]:
        """The futures whose completion lets `advance` go on (none once it is done)."""
        pending = [f for f, _ in self._watches.values() if not f.done()]
        pending += [f for f in self._restored.values() if not f.done()]
        if self.state == State.RECEIVING and self._next < len(self._arrivals):
            pending.append(self._arrivals[self._next])
        return pending

    def abandon(self) -> None:
        """End the reception where it is (unless done): nobody waits for its messages any
        more, and its watcher's threads end once what they watch has completed."""
        if self.state in (State.DONE, State.ABANDONED):
            return
        for arrival in self._arrivals[self._next:]:
            arrival.abandon()
        self._move(State.ABANDONED)
        self._watcher.close()

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
        return Handoff(self._kv, self.first_token, total, phases, timeline, sent.sent_bytes,
                       self.fell_back, match)

    # -- state -------------------------------------------------------------------------------

    def _move(self, to: State) -> None:
        if to not in TRANSITIONS[self.state]:
            raise RuntimeError(f"{self.tag}: a reception cannot go from {self.state} to {to}")
        self.state = to

    def _note_watched(self) -> None:
        """Note on the clock when each finished piece of device work finished (raising the
        error of one that failed)."""
        for future, event in self._watches.values():
            if future.done():
                self.clock.note(event, future.result())

    def _ended(self) -> bool:
        """Whether the join completed (then the reception is done)."""
        if self.state in (State.NEW, State.ABANDONED):
            raise RuntimeError(f"{self.tag}: a reception that is {self.state} does not advance")
        self._note_watched()
        if self.state == State.JOINING and self._watches["end"][0].done():
            self._move(State.DONE)
            self._watcher.close(finished=True)
        return self.state == State.DONE

    def _joinable(self) -> bool:
        """Every message handled, every step started and its work dispatched and completed."""
        if self.state == State.RECEIVING and (
                self._next < len(self._arrivals)
                or any(i not in self._started for i in self._decode)):
            return False
        return not self._work and all(_completed(f) for f, _ in self._watches.values()) and all(
            _completed(f) for f in self._restored.values())

    # -- messages --------------------------------------------------------------------------

    def _take_landed(self) -> None:
        """Take every message that landed, in the order sent, its parts in order."""
        while (self.state == State.RECEIVING and self._next < len(self._arrivals)
               and self._arrivals[self._next].done()):
            step, arrival = self._receives[self._next], self._arrivals[self._next]
            message, rest = self._steps[step].message, list(arrival.result())
            for part in message.parts:
                if part == Part.TOKENS:
                    self.tokens = rest.pop(0)
                elif part == Part.FIRST:
                    self.sent_first = tuple(rest.pop(0) for _ in self._first_specs)
            self._landed[step] = rest  # h_c's piece, or the prefix part's buffers
            self._next += 1
            if {Part.BOUNDARY, Part.FIRST} & set(message.parts) or (
                    Part.TOKENS in message.parts and not self.mode.action.cut):
                self.clock.note(Event.BOUNDARY, arrival.settled_at)

    # -- steps -------------------------------------------------------------------------------

    def _start_ready(self) -> None:
        """Start, in plan order, each decode-side step whose needs are met."""
        if self.state != State.RECEIVING:
            return
        for i in self._decode:
            step = self._steps[i]
            if i not in self._started and all(self._met(j) for j in step.after):
                self._started.add(i)
                if isinstance(step, Restore):
                    self._restore(i, step)
                else:
                    self._queue(i, step, self._pass_of(step))

    def _met(self, j: int) -> bool:
        """Whether step j is as far as a step after it needs: a message landed, a restore
        completed, a suffix queued (the device runs it first); the prefill side's steps are
        done once the message they make has landed."""
        step = self._steps[j]
        if isinstance(step, Receive):
            return self._order[j] < self._next
        if isinstance(step, Restore):
            return j in self._restored and _completed(self._restored[j])
        return not isinstance(step, Suffix) or j in self._started

    def _restore(self, i: int, step: Restore) -> None:
        """Restore one prefix part (produced, or kept); once the last is in, watch the whole
        prefix."""
        m = step.message
        part = unpack_prefix(self._landed.pop(step.after[0]), self._codec, self._dtype,
                             self._backend, m.layers[0], m.tokens[0])
        self._restored[i] = self._watcher.watch(Lane.PREFIX, part)
        if self._keeps:
            self._parts.append(part)
        else:
            self._produced.append(Produced(part, m.layers[0], m.tokens[0]))
        restores = [s for s in self.plan.steps if isinstance(s, Restore)]
        if len(self._restored) < len(restores):
            return
        if not self._keeps:
            self._watches["prefix"] = last_of(list(self._restored.values())), Event.PREFIX
            return
        spans = len({s.message.tokens for s in restores}) > 1
        parts, self._parts = self._parts, []
        self._prefix = KVCache.join_spans(*parts) if spans else KVCache.concat(*parts)
        self._watches["prefix"] = self._watcher.watch(Lane.PREFIX, self._prefix), Event.PREFIX

    def _pass_of(self, step: Suffix) -> _Pass:
        """What a suffix step runs on: the suffix step it continues (on the same tokens, ending
        where it begins), else the token ids (from layer 0), else its piece of h_c."""
        for j in step.after:
            s = self._steps[j]
            if isinstance(s, Suffix) and s.chunk == step.chunk and s.layers[1] == step.layers[0]:
                return _Pass(None, source=j)
        if step.layers[0] == 0:
            start, stop = step.chunk.tokens
            return _Pass(self.tokens if step.chunk.of == 1 else self.tokens[:, start:stop])
        piece = next(j for j in step.after if isinstance(self._steps[j], Receive))
        return _Pass(self._landed.pop(piece)[0])

    def _queue(self, i: int, step: Suffix, run: _Pass) -> None:
        """Queue a suffix step, one unit a layer (and the head after the suffix's last)."""
        self.clock.note(Event.SUFFIX_START)
        L = self._cfg.num_layers
        if step.chunk.of > 1 and self._suffix_kv is None:  # (a recovery is never chunked)
            self._suffix_kv = new_cache(self._cfg, L - self.plan.action.cut, self._batch,
                                        self._seq_len, self._dtype)
        self._passes[i] = run
        tokens = step.chunk.tokens[1] - step.chunk.tokens[0]
        self._work.extend(_Unit(i, layer, tokens) for layer in range(*step.layers))
        if step.layers[1] == L and step.chunk.last:
            self._work.append(_Unit(i, None, 0))

    def _run(self, unit: _Unit) -> None:
        """Dispatch one unit: its layer on its pass's residual (embedded first if token ids),
        the KV kept: the program `run_chunk` (a chunk of several) or `run_suffix` / `prefill`
        runs for that layer."""
        run, programs = self._passes[unit.step], self._programs
        step = self._recovery() if unit.step == RECOVERY else self._steps[unit.step]
        if run.x is None:
            run.x = self._passes[run.source].x
        if unit.layer is None:
            return self._end_suffix(run)
        x = programs.embed(run.x) if run.x.ndim == 2 else run.x
        if step.chunk.of > 1:
            i, kv = unit.layer - self.plan.action.cut, self._suffix_kv
            x, one = programs.chunk(x, kv.layers(i, i + 1), unit.layer, step.chunk.tokens[0])
            self._suffix_kv = KVCache.concat(kv.layers(0, i), one, kv.layers(i + 1, kv.num_layers))
        else:
            if run.positions is None:  # on the device once per pass
                run.positions = programs.positions(x)
            x, one = programs.prompt(x, unit.layer, run.positions)
            self._suffix_layers.append(one)
        run.x = x
        return None

    def _end_suffix(self, run: _Pass) -> None:
        """The head on the last position; the suffix's layers produced (or kept); watched."""
        self.logits = self._programs.head(run.x)
        if self._suffix_layers:
            self._suffix_kv = KVCache.concat(*self._suffix_layers)
            self._suffix_layers = []
        suffix = self._suffix_kv
        if not self._keeps:
            self._produced.append(Produced(suffix, self._cfg.num_layers - suffix.num_layers, 0))
        self._watches["suffix"] = (self._watcher.watch(Lane.SUFFIX, (suffix, self.logits)),
                                   Event.SUFFIX_END)

    def _recovery(self) -> Suffix:
        """The recomputation a failed prefix falls back to: every layer from the token ids."""
        return Suffix((0, self._cfg.num_layers), chunks_of(self._seq_len, 1)[0])

    def _lost(self, error: TransportError) -> TransportError:
        """The error of the message that failed, saying how much of the prefix had arrived."""
        parts = [m.name for m in self.plan.messages if Part.PREFIX in m.parts]
        name = self._steps[self._receives[self._next]].message.name
        return error if name not in parts else TransportError(
            f"prefix part {name} lost after {parts.index(name)} of {len(parts)} arrived: {error}")

    def _fall_back(self, error: TransportError) -> None:
        """A message failed: rebuild the cache from the token ids (`Fallback.RECOMPUTE`, once
        they are here), or fail the handoff."""
        if self._fallback != Fallback.RECOMPUTE or self.tokens is None or not self.mode.action.cut:
            self.abandon()
            raise error
        for arrival in self._arrivals[self._next:]:
            arrival.abandon()
        self._move(State.RECOVERING)
        self.fell_back = True
        self._prefix, self._suffix_kv, self._suffix_layers, self._parts = None, None, [], []
        self._work.clear()
        self._watches.clear()  # what was dispatched still runs; its times are not the cache's
        self._restored.clear()
        boundary = self.clock.note(Event.BOUNDARY)
        self.clock.set(Event.PREFIX, boundary)
        self.clock.forget(Event.SUFFIX_START)
        self.clock.forget(Event.SUFFIX_END)
        self._queue(RECOVERY, self._recovery(), _Pass(self.tokens))

    def _join(self) -> None:
        """The complete cache and the first token, dispatched and watched."""
        self._move(State.JOINING)
        prefix, suffix = self._prefix, self._suffix_kv
        if not self._keeps:  # the caller holds the cache
            self._kv = self._suffix_kv = None
        else:
            self._kv = suffix if prefix is None else prefix if suffix is None else (
                KVCache.concat(prefix, suffix))
        self.first_token = (self.sent_first[0] if self.logits is None
                             else greedy_token(self.logits))
        self._watches["end"] = (self._watcher.watch(Lane.JOIN, (self._kv, self.first_token)),
                                Event.END)

def _completed(future: concurrent.futures.Future[float]) -> bool:
    """Whether watched device work completed (raising the error of work that failed)."""
    if not future.done():
        return False
    future.result()
    return True


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
