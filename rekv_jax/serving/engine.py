"""The decode worker of a serving system: one engine thread that admits ReKV handoffs into a paged
cache between the decode steps of the requests already running (continuous batching).

Each iteration (`DecodeEngine.step`), with every device call dispatched asynchronously:
  1. join: the requests whose cache completed last iteration enter the decode batch;
  2. decode: one batched step of the running requests is dispatched (`paged.decode_step`,
     one program for all layers; its tokens stay on the device);
  3. handoffs: each in-flight `Reception` advances in admission order, together dispatching at
     most `suffix_budget` token-layers of suffix compute (a serving request's suffix runs in
     token chunks, `serving_mode`: Sarathi-style interleaving, so running requests keep
     stepping); a reception's restored and recomputed layers go straight into its pages;
  4. collect: the step's tokens are pulled to the host (the one sync of an iteration: emitting
     them needs it) and emitted; then the receptions advance again, within what is left of the
     budget: the device work dispatched before the step has completed by now, so a handoff it
     completed gives its first token in this iteration rather than the next. A request whose
     handoff completed emits its first token and joins next iteration; a request that ended
     (`ends.Ending`: its EOS, a stop, its `max_new_tokens`) retires (`Finished`) and its pages
     go back.
Every token, the handoff's first included, is drawn by one batched program from its row's logits
(`sampling.draw`, with the request's `Sampling` and the token's index): a request's tokens
depend on its prompt, parameters and seed, never on what shares its steps. A transfer-only
handoff's first token is drawn on the prefill side (which has the logits) by the same program,
and its log probabilities, when asked, cross with it (`sampling.first_specs`).
When nothing runs and no queued suffix work waits, it sleeps on the receptions' `waitables()`
(bounded), never spinning.

A request takes every page it can need at admission (`admit`); its prefill side holds its sends
until the decode side posts `TAG/admitted` on the control connection. The router counts this
worker's pages and sends only `Admit`s that fit: one that does not is the router's error, and
the engine stops on it. An `Abort` ends an admitted request wherever it is (`abort`): its pages
free at once. Faults stay with their
request: a reception's error (a lost or corrupt prefix without the recompute fallback, its
prefill process gone) fails that request alone, in one line.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.errors import TransportError, one_line
from rekv_jax.handoff.check import HostReference, check_cache, reference
from rekv_jax.handoff.prefix_format import KeyBias
from rekv_jax.handoff.receiver import Produced, Reception, WorkBudget
from rekv_jax.kv import KVCache
from rekv_jax.launch.child import Member
from rekv_jax.mode import Fallback, Mode, Reference, check_fallback
from rekv_jax.model import paged
from rekv_jax.model.transformer import Params
from rekv_jax.serving.compile_clock import compiled_ms
from rekv_jax.serving.ends import End, Ending
from rekv_jax.serving.inbox import MemberInbox, Requests
from rekv_jax.serving.pages import (
    BlockTable,
    PageAllocator,
    PoolConfig,
    StepRow,
    batch_bucket,
    step_inputs,
)
from rekv_jax.serving.requests import Abort, Admit, Finished, Load, Token, tag
from rekv_jax.serving.sampling import Drawn, Sampling, draw, first_specs, rows_of
from rekv_jax.transport import Transport

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CHUNK_TOKENS = 64  # a serving request's suffix runs in token chunks of at most this many
SUFFIX_BUDGET = 8 * CHUNK_TOKENS  # token-layers of suffix compute per iteration (8 layers' chunk)
OUTCOME_WAIT_S = 1.0  # the longest a retiring request waits for its prefill side's times


def serving_mode(action: Action, prompt_len: int, chunk_tokens: int = CHUNK_TOKENS) -> Mode:
    """How a serving request of `action` is handed off, timed from the prompt, so that its
    decode-side compute comes in units of at most `chunk_tokens` tokens through one layer
    (`Mode.in_chunks`). Its cache's reference is `Mode.reference` either way."""
    return Mode.in_chunks(action, -(-prompt_len // chunk_tokens))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How a decode engine runs."""

    pool: PoolConfig
    suffix_budget: int | None = SUFFIX_BUDGET  # token-layers per iteration (None: no limit)
    fallback: str = Fallback.ERROR  # what a request whose prefix fails does
    timeout: float = 60.0  # seconds each message of a handoff may take
    # the longest wait before looking for new requests again: a streamed prompt's prefill
    # device waits for its admission, so this bounds how long it may idle
    idle_wait_s: float = 0.005
    # check each request's paged cache against its single-process reference (a prefill per
    # request on this worker: for tests)
    check: bool = False
    attention: str | None = None  # `paged.PAGED_ATTENTIONS`; None: the platform's default
    worker: int = 0  # this decode worker's index

    def __post_init__(self) -> None:
        check_fallback(self.fallback)
        if self.suffix_budget is not None and self.suffix_budget < 1:
            raise ValueError(f"suffix_budget must be >= 1 token-layer, got {self.suffix_budget}")


@dataclasses.dataclass
class _Request:
    """An admitted request: its pages, its handoff, and what it generated so far."""

    admit: Admit
    table: BlockTable
    reception: Reception
    ending: Ending
    admitted_s: float  # time.monotonic()
    compiled_at_ms: float  # this process's XLA compile time at its admission (`compile_clock`)
    tokens: list[int] = dataclasses.field(default_factory=list)
    times_s: list[float] = dataclasses.field(default_factory=list)
    checks: str = ""
    end: End | None = None  # once it ended
    queued: bool = False  # its suffix work waited behind an earlier reception's in a budget

    @property
    def position(self) -> int:
        """The position its last token is decoded at."""
        return self.admit.prompt_len + len(self.tokens) - 1

    @property
    def next_row(self) -> tuple[Sampling, int]:
        """Its row of the next `draw`: its sampling and the index of the token drawn."""
        return self.admit.sampling, len(self.tokens)


def _host(drawn: Drawn, logprobs: bool) -> Drawn:
    """A `Drawn` pulled to the host in one transfer: its tokens, and its log probabilities
    only when `logprobs`."""
    return Drawn(*jax.device_get(drawn.buffers(logprobs)))


class DecodeEngine:
    """The decode side of a serving worker: the paged cache of every admitted request, handed
    off over `links[p]` from prefill worker p (`Admit.prefill_worker`), one thread. `admit`
    requests, call `step` in a loop (or `run` a group member). `eos_ids`: the model's EOS
    tokens; `tokenizer`: its tokenizer (requests with stop strings need one)."""

    def __init__(self, cfg: ModelConfig, params: Params, links: Sequence[Transport],
                 config: EngineConfig, eos_ids: Sequence[int] = (),
                 tokenizer: Tokenizer | None = None) -> None:
        self._cfg, self._params, self._links, self.config = cfg, params, list(links), config
        self._eos_ids, self._tokenizer = tuple(eos_ids), tokenizer
        self._alloc = PageAllocator(config.pool)
        self._weights = paged.stack_weights(cfg, params)
        self._pool = paged.new_pool(cfg, config.pool.num_pages, config.pool.page_size,
                                    params["embed"].dtype)
        self._handoffs: list[_Request] = []  # receptions in flight, in admission order
        self._joining: list[_Request] = []  # cache complete: join the batch next iteration
        self._running: list[_Request] = []  # in the decode batch, in the order they joined
        self._changed = True  # since the last `Load`

    # -- the loop's interface ----------------------------------------------------------------

    def admit(self, request: Admit) -> None:
        """Take the request's pages and start its handoff. ValueError if it could never fit, or
        its stops cannot be honoured; RuntimeError if too few pages are free (its router counts
        them: an `Admit` that does not fit is the router's error)."""
        link = self._link(request)
        ending = Ending(request.stops, request.max_new_tokens, self._eos_ids, self._tokenizer)
        table = self._alloc.admit(request.prompt_len + request.max_new_tokens)
        name = tag(request.request_id)
        if table is None:
            raise RuntimeError(f"{name} was admitted with {self._alloc.free_pages} pages free, "
                               f"too few: the router counts this worker's pages")
        reception = Reception(link, self._cfg, self._params, request.mode, 1,
                              request.prompt_len, name, self.config.fallback,
                              timeout=self.config.timeout, keeps_cache=False,
                              first=first_specs(request.sampling))
        reception.start()
        # its prefill side may send now; if that side is gone, the reception's waits fail with
        # the link and the request ends alone
        with contextlib.suppress(TransportError):
            link.send_meta(f"{name}/admitted", {})
        self._handoffs.append(_Request(request, table, reception, ending, time.monotonic(),
                                       compiled_ms()))
        self._changed = True

    def _link(self, request: Admit) -> Transport:
        """The link to the request's prefill worker; ValueError if there is none."""
        if not 0 <= request.prefill_worker < len(self._links):
            raise ValueError(f"no prefill worker {request.prefill_worker} (this decode worker "
                             f"links to {len(self._links)})")
        return self._links[request.prefill_worker]

    @property
    def idle(self) -> bool:
        """Nothing admitted is left."""
        return not (self._handoffs or self._joining or self._running)

    @property
    def busy(self) -> bool:
        """Work can be dispatched now without waiting for anything."""
        return bool(self._joining or self._running
                    or any(r.reception.pending_work for r in self._handoffs))

    def step(self) -> list[object]:
        """One iteration (the module's docstring); what it emitted: `Token`s, `Finished`s and,
        when something changed, a `Load`. With nothing to dispatch it waits (bounded) for a
        handoff to be able to move."""
        if self._joining:
            self._running += self._joining
            self._joining, self._changed = [], True
        tokens = self._dispatch_step() if self._running else None
        budget, own = WorkBudget(self.config.suffix_budget), {}
        items = self._advance_handoffs(budget, own)
        if tokens is not None:
            items += self._collect(tokens)
            # device work dispatched before the step has completed once its tokens are here: a
            # handoff it completed gives its first token now, not an iteration later (within
            # the same budget)
            items += self._advance_handoffs(budget, own)
        items += self._retire()
        if not self.busy and self._handoffs:
            self._wait()
        return items + self._changes()

    def _changes(self) -> list[Load]:
        """A `Load`, if anything changed since the last one."""
        if not self._changed:
            return []
        self._changed = False
        return [self.load()]

    def _wait(self) -> None:
        """Sleep until a reception can move, at most `idle_wait_s`. A reception with nothing
        pending (its `waitables` empty: what it waited on completed since it last advanced) can
        move now, so then the engine does not sleep at all."""
        pending = [r.reception.waitables() for r in self._handoffs]
        if all(pending):
            concurrent.futures.wait([f for futures in pending for f in futures],
                                    self.config.idle_wait_s, concurrent.futures.FIRST_COMPLETED)

    def load(self) -> Load:
        """Its state: running requests, admitted suffix compute not yet done, free pages."""
        return Load(self.config.worker, len(self._running),
                    sum(r.admit.suffix_ms for r in self._handoffs), self._alloc.free_pages)

    def step_ms(self, batches: Sequence[int], position: int, reps: int = 5
                ) -> tuple[tuple[int, float], ...]:
        """(batch, median ms) of a batched decode step of each size in `batches`, every row at
        `position` and its greedy draw, timed on this engine's pool while nothing is admitted
        (the rows' pages are taken and given back; what the steps wrote there is never read: a
        request attends only to positions it wrote). The first step of each size compiles and
        is not timed."""
        if not self.idle:
            raise RuntimeError("step costs are measured before any request is admitted")
        out = []
        for batch in batches:
            tables = [self._alloc.admit(position + 1) for _ in range(batch)]
            if None in tables:
                raise ValueError(f"a pool of {self.config.pool.num_pages} pages holds fewer "
                                 f"than {batch} rows at position {position}")
            rows = [StepRow(0, position, t) for t in tables]
            slots = rows + [None] * (batch_bucket(batch) - batch)
            inputs = step_inputs(slots, self.config.pool.page_size)
            greedy = rows_of([None] * len(slots))
            times = []
            for _ in range(reps + 1):
                start = time.perf_counter()
                logits, self._pool = paged.decode_step(
                    self._cfg, self._weights, self._pool, inputs.tokens, inputs.positions,
                    inputs.tables, inputs.width, self.config.attention)
                jax.block_until_ready(draw(logits, greedy))
                times.append(1e3 * (time.perf_counter() - start))
            for t in tables:
                self._alloc.retire(t)
            out.append((batch, float(np.median(times[1:]))))
        draw(logits[:1], rows_of([None]))  # compiles the draw of a handoff's first token
        return tuple(out)

    @property
    def free_pages(self) -> int:
        return self._alloc.free_pages

    @property
    def used_pages(self) -> int:
        return self._alloc.used_pages

    def serve(self, requests: Requests, emit: Callable[[object], None]) -> None:
        """Serve the `Admit`s taken from `requests` until there are no more and every admitted
        request ended, emitting what each iteration produced."""
        while not (requests.ended and self.idle):
            for request in requests.take(None if self.idle else 0.0):
                for item in self._take(request):
                    emit(item)
            # an abort that left it idle changed its load too: told before it blocks on `take`
            for item in self.step() if not self.idle else self._changes():
                emit(item)

    def run(self, member: Member) -> None:
        """Serve the `Admit`s the router hands this group member."""
        self.serve(MemberInbox(member), member.emit)

    def abort(self, request_id: int) -> list[Finished]:
        """End an admitted request now, wherever it is (its reception abandoned, or out of the
        batch): its pages free at once; its `Finished` ("abort", its tokens so far). [] for one
        it does not hold (it ended, or was never admitted)."""
        for queue in (self._handoffs, self._joining, self._running):
            for r in queue:
                if r.admit.request_id == request_id:
                    queue.remove(r)
                    return [self._end(r, None, aborted=True)]
        return []

    def _take(self, request: object) -> list[object]:
        """One message from the router: an `Abort` (its `Finished`, if it held the request), or
        an `Admit` ([] once admitted; its failed `Finished` if it could never be)."""
        if isinstance(request, Abort):
            return self.abort(request.request_id)
        if not isinstance(request, Admit):
            raise ValueError(f"a decode engine takes Admit and Abort messages, got "
                             f"{type(request).__name__}")
        try:
            self.admit(request)
            return []
        except ValueError as e:  # it could never fit: its prefill side is told not to send
            if 0 <= request.prefill_worker < len(self._links):
                self._links[request.prefill_worker].send_meta(
                    f"{tag(request.request_id)}/admitted", {"refused": one_line(e)})
            return [Finished(request.request_id, (), 0.0, 0.0, 0.0, None, "", False,
                             one_line(e))]

    # -- an iteration ------------------------------------------------------------------------

    def _write(self, table: BlockTable, part: Produced) -> None:
        """Cache layers a reception produced (KV [n, 1, T, K, H]) into the request's pages at
        their positions (the pool donated: written in place)."""
        rows = table.rows(part.start, part.start + part.kv.seq_len)
        self._pool = paged.write_cache(self._pool, part.kv, part.first, rows)

    def _dispatch_step(self) -> Drawn:
        """One decode step of the running requests, each at its position; their next tokens
        [B] drawn on the device (slots in `_running`'s order, padding after)."""
        pad = [None] * (batch_bucket(len(self._running)) - len(self._running))
        rows: list[StepRow | None] = [StepRow(r.tokens[-1], r.position, r.table)
                                      for r in self._running]
        inputs = step_inputs(rows + pad, self.config.pool.page_size)
        logits, self._pool = paged.decode_step(self._cfg, self._weights, self._pool,
                                               inputs.tokens, inputs.positions, inputs.tables,
                                               inputs.width, self.config.attention)
        return draw(logits, rows_of([r.next_row for r in self._running] + pad))

    def _advance_handoffs(self, budget: WorkBudget, own: dict[int, int]) -> list[object]:
        """Advance every reception within what is left of the iteration's suffix `budget`
        (`own`: what each took of it so far, by request id); a completed one emits its first
        token and joins next iteration; a failed one fails alone."""
        items: list[object] = []
        for r in list(self._handoffs):
            try:
                start, rid = budget.spent, r.admit.request_id
                others = start - own.get(rid, 0)  # what other receptions took of this budget
                done = r.reception.advance(budget)
                own[rid] = own.get(rid, 0) + budget.spent - start
                worked = budget.spent > start or r.reception.pending_work > 0
                r.queued |= others > 0 and worked  # its suffix shared the device's budget
                for part in r.reception.produced():
                    self._write(r.table, part)
                if not done:
                    continue
                self._handoffs.remove(r)
                items.append(self._first_token(r))
            except Exception as e:  # the request's own fault: it fails alone
                self._handoffs.remove(r)
                items.append(self._end(r, one_line(e)))
        return items

    def _first_token(self, r: _Request) -> Token:
        """The handoff's first token: drawn here from its logits, or as the prefill side drew
        it (transfer-only); it joins the batch next iteration."""
        logits = r.reception.logits
        drawn = (draw(logits, rows_of([r.next_row])) if logits is not None
                 else Drawn(*r.reception.sent_first))
        if self.config.check:
            r.checks = self._check(r)
        self._joining.append(r)
        self._changed = True
        return self._token(r, _host(drawn, r.admit.sampling.logprobs is not None), 0,
                           time.monotonic())

    def _collect(self, drawn: Drawn) -> list[Token]:
        """The step's tokens (and log probabilities, if any request asked), pulled to the host
        once, each appended to its request."""
        asked = any(r.admit.sampling.logprobs is not None for r in self._running)
        host, now = _host(drawn, asked), time.monotonic()
        return [self._token(r, host, slot, now) for slot, r in enumerate(self._running)]

    def _token(self, r: _Request, host: Drawn, row: int, now: float) -> Token:
        """Append row `row` of a host `Drawn` to the request, see whether it ended; its Token."""
        r.tokens.append(int(host.token[row]))
        r.times_s.append(now)
        r.end = r.ending.after(r.tokens)
        logprob, top = host.reported(r.admit.sampling, row)
        return Token(r.admit.request_id, len(r.tokens) - 1, r.tokens[-1], now, logprob, top)

    def _retire(self) -> list[Finished]:
        """Retire the requests that ended (those that just joined too): their pages go back."""
        done = [r for r in self._running + self._joining if r.end is not None]
        self._running = [r for r in self._running if r.end is None]
        self._joining = [r for r in self._joining if r.end is None]
        return [self._end(r, None) for r in done]

    def _end(self, r: _Request, error: str | None, aborted: bool = False) -> Finished:
        """Free the request's pages; its record (failed with `error`, or `aborted`: its
        reception abandoned, its tokens so far)."""
        self._alloc.retire(r.table)
        self._changed = True
        compiled = compiled_ms() - r.compiled_at_ms
        if error is not None or aborted:
            r.reception.abandon()
            return Finished(r.admit.request_id, tuple(r.tokens), 0.0, 0.0, 0.0, None, "",
                            r.reception.fell_back, error, "abort" if aborted else "length",
                            compile_ms=compiled)
        gaps = np.diff(r.times_s)
        try:  # the prefill side's times are there unless it failed after its last message
            handoff = r.reception.outcome(OUTCOME_WAIT_S)
        except TransportError as e:
            return Finished(r.admit.request_id, tuple(r.tokens), r.times_s[0] - r.admitted_s,
                            float(gaps.mean()) if gaps.size else 0.0, 0.0, None, r.checks,
                            r.reception.fell_back, one_line(e), compile_ms=compiled)
        return Finished(r.admit.request_id, tuple(r.tokens), r.times_s[0] - r.admitted_s,
                        float(gaps.mean()) if gaps.size else 0.0, handoff.total_ms,
                        handoff.phases_ms, r.checks, handoff.fallback, None, r.end.reason,
                        r.end.stop, r.queued, compiled)

    def _check(self, r: _Request) -> str:
        """What holds of the request's pages against its single-process reference (the plain
        prefill's after a fallback), as `check_cache` says it."""
        cfg, mode, S = self._cfg, r.admit.mode, r.admit.prompt_len
        rows = r.table.rows(0, S)
        layers = [paged.read_layer(self._pool, layer, rows) for layer in range(cfg.num_layers)]
        kv = KVCache(tuple(k for k, _ in layers), tuple(v for _, v in layers))
        handoff = dataclasses.replace(r.reception.outcome(OUTCOME_WAIT_S), kv=kv)
        ref = Reference() if handoff.fallback else mode.reference
        want, _ = reference(cfg, self._params, r.reception.tokens, ref, mode.action.cut)
        return check_cache(HostReference(want, KeyBias.of(cfg, self._params)), mode.action,
                           handoff, ref.name)
