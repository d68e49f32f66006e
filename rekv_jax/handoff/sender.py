"""The prefill side of a handoff (paper §2.2): compute what each message needs, then send it, in
the order its `Mode` gives (`Mode.messages`).

From a ready prefill state (the paper's interval, `send_handoff`): quantize the prefix (Q), send
the token ids with `h_c` first (H), then the prefix payload. Timed from the prompt's arrival
(`send_prompt`), the prefill side computes inside the interval: a full prefill runs all L layers
and then hands off as above; a split one runs layers 0..c-1 one program per layer and sends each
layer's payload as it is computed, `h_c` the moment layer c-1 is; a pipelined one runs each token
chunk through layers 0..c-1 (a chunked prefill with its own prefix cache) and sends the chunk's
`h_c`, then its prefix, the next chunk dispatched before they are sent. Either way the link moves
a message while the next one computes.

Sends complete asynchronously: `start_prompt` (and `Prepared.send`, for a full prefill computed
earlier by `prepare_prompt`) returns once every message is handed to the link, with a `Sending`
that holds the handoff's buffers until the decode side's verdicts and is polled or waited on
for its `SendReport`; `send_prompt` and `send_handoff` wait for it at once.

Token ids always cross the link (they are tiny): the decode side needs them to check its cache
and, under the recompute fallback, to rebuild the cache if the prefix transfer fails.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from rekv_jax.config import ModelConfig
from rekv_jax.handoff.outcome import PrefillTimes, elapsed_ms
from rekv_jax.handoff.payload import check_finite, pack_prefix
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.handoff.sending import Sending, SendReport
from rekv_jax.kv import KVCache
from rekv_jax.mode import Mode
from rekv_jax.model.transformer import (
    Params,
    greedy_token,
    new_cache,
    prefill,
    run_chunk,
    run_layers,
    run_prefix,
    run_suffix,
)
from rekv_jax.plan import Message, Part, Plan
from rekv_jax.sizes import token_chunks
from rekv_jax.transport import Transport, checksums

T = TypeVar("T")
ADMISSION_POLL_S = 0.005  # how often a handoff computed before its admission asks for it
# When the decode side admitted a handoff (time.perf_counter()), None while it has not: a
# `start_prompt` gate (it raises why it never will)
Gate = Callable[[], float | None]
# How the prefill side draws a handoff's first token from its logits [B, V] f32: the buffers its
# first-token part carries, the token [B] int32 first (what else rides with it is the caller's,
# e.g. the serving layer's log probabilities; the decode side expects the same, `Reception`)
FirstDraw = Callable[[jax.Array], tuple[jax.Array, ...]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillState:
    """What the prefill worker holds when its prefill is done (before the paper's interval)."""

    tokens: jax.Array  # [B, S] int32
    h_c: jax.Array | None  # [B, S, D] boundary (joint actions)
    prefix: KVCache | None  # layers 0..c-1 (joint and transfer-only)
    first: tuple[jax.Array, ...]  # its `FirstDraw` of the prefill's own logits (sent with the ids)
    codec: PrefixCodec  # how the prefix travels
    # `checksums` of this process's suffix KV [K, V] (joint actions, when asked for): the decode
    # side compares its recomputed suffix with it (sent with the prefill side's times)
    suffix_sums: tuple[int, ...] = dataclasses.field(default=(), metadata={"static": True})

    @property
    def first_token(self) -> jax.Array:
        """The first token [B]."""
        return self.first[0]


def argmax_first(logits: jax.Array) -> tuple[jax.Array]:
    """The greedy `FirstDraw`: the argmax [B] alone."""
    return (greedy_token(logits),)


def prepare(cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode,
            check_suffix: bool = False, first: FirstDraw = argmax_first) -> PrefillState:
    """The prefill worker's prompt processing for `mode` (untimed, as in the paper): the prefix,
    `h_c` and its own suffix, in the mode's token chunks, and the first token as `first` draws
    it. `check_suffix`: also the checksums of that suffix (joint actions; a device-to-host sync,
    so only outside a timed interval)."""
    action = mode.action
    codec = PrefixCodec.of(cfg, params, action)
    if not action.cut:
        _, logits = prefill(cfg, params, tokens)
        return PrefillState(tokens, None, None, first(logits), codec)
    h_c, prefix = run_prefix(cfg, params, tokens, action.cut)
    suffix, logits = run_suffix(cfg, params, h_c, action.cut, chunks=mode.suffix_chunks)
    sums = tuple(checksums(suffix.buffers)) if mode.joint and check_suffix else ()
    return PrefillState(tokens, h_c if mode.joint else None, prefix, first(logits), codec, sums)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _tokens_of(h: jax.Array, start: int, stop: int) -> jax.Array:
    return h[:, start:stop]  # [B, stop - start, D]


class _Sent:
    """The prefill side's running account of one handoff: its compute and quantize times, then
    (once `start`ed on a link) when the boundary left, the messages sent, their buffers and the
    bytes they carried."""

    def __init__(self, codec: PrefixCodec) -> None:
        self.codec = codec
        self.prefill_ms = self.quantize_ms = self.boundary_at_ms = 0.0
        self.mark = 0.0  # time.perf_counter(): the end of the last interval `awaited` timed
        self.link: Transport | None = None
        self.t0, self.bytes_before = 0.0, 0
        self.gate: Gate | None = None  # the messages wait until it opens (`start`)
        self.held: list[tuple[Message, list[jax.Array]]] = []  # computed, not yet sent
        self.first_sent: float | None = None  # time.monotonic(), as verdicts are timed
        self.tags: list[str] = []
        self.buffers: list[jax.Array] = []
        self.nonfinite: list[jax.Array] = []

    def start(self, link: Transport, t0: float, gate: Gate | None = None) -> None:
        """Send on `link` from now on; `t0` (time.perf_counter) starts the interval. `gate`: the
        messages wait, in order, until it opens, and its time starts the interval instead."""
        self.link, self.t0, self.bytes_before = link, t0, link.sent_bytes
        self.gate = gate

    def timed(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, awaited, with its time added to `what` (prefill_ms or quantize_ms)."""
        self.mark = time.perf_counter()
        return self.awaited(what, fn(*args))

    def awaited(self, what: str, out: T) -> T:
        """`out`, dispatched earlier, awaited, the time since the last `mark` added to `what`
        (awaited in dispatch order, the intervals sum to the device's span)."""
        out = jax.block_until_ready(out)
        now = time.perf_counter()
        setattr(self, what, getattr(self, what) + elapsed_ms(self.mark, now))
        self.mark = now
        return out

    def pack(self, prefix: KVCache, backend: str | None, message: Message) -> list[jax.Array]:
        """The payload of `message`'s prefix (Q: quantize, timed; BF16 buffers as they are)."""
        self.mark = time.perf_counter()
        payload = self.dispatch_pack(prefix, backend, message)
        return payload if self.codec.bits == 16 else self.awaited("quantize_ms", payload)

    def dispatch_pack(self, prefix: KVCache, backend: str | None, message: Message
                      ) -> list[jax.Array]:
        """The payload of `message`'s prefix, dispatched, not awaited (`awaited` times it)."""
        payload, nonfinite = pack_prefix(prefix, self.codec, backend, message.layers[0],
                                         message.tokens[0])
        self.nonfinite += nonfinite
        return payload

    def send(self, tag: str, message: Message, buffers: list[jax.Array], timeout: float) -> None:
        """Hand `message` to the link after those held before it, once the gate is open."""
        self.held.append((message, buffers))
        if not self._opened():
            return
        for message, buffers in self.held:
            if {Part.BOUNDARY, Part.FIRST} & set(message.parts) and not self.boundary_at_ms:
                self.boundary_at_ms = elapsed_ms(self.t0, time.perf_counter())
            self.first_sent = self.first_sent or time.monotonic()
            self.link.send(f"{tag}/{message.name}", buffers, timeout)
            self.tags.append(message.name)
            self.buffers += buffers
        self.held = []

    def _opened(self, poll_s: float | None = None) -> bool:
        """Whether the gate is open (none is); `poll_s`: ask every `poll_s` s until it is."""
        while self.gate is not None:
            if (t0 := self.gate()) is not None:
                self.gate, self.t0 = None, t0
            elif poll_s is None:
                return False
            else:
                time.sleep(poll_s)
        return True

    def handed(self, tag: str, timeout: float, suffix_sums: tuple[int, ...] = ()) -> Sending:
        """Post the prefill side's times and bytes; the handoff, on the link until its verdicts
        (the decode side's errors surface there), once the gate opened and the messages held
        were sent. A non-finite scale is an error at once."""
        if self.held:
            self._opened(ADMISSION_POLL_S)
            self.send(tag, *self.held.pop(), timeout)
        check_finite(self.nonfinite, self.codec.bits)
        times = PrefillTimes(self.prefill_ms, self.quantize_ms, self.boundary_at_ms,
                             self.link.sent_bytes - self.bytes_before, suffix_sums)
        self.link.send_meta(f"{tag}/prefill", times.to_json())
        return Sending(self.link, [f"{tag}/{name}" for name in self.tags], self.buffers, times,
                       self.first_sent or time.monotonic(), timeout)


class Prepared:
    """A full (unstreamed) prefill's handoff, computed and packed on the prefill device, not
    yet sent: what a serving prefill worker holds while its decode side has no pages for it.
    `compute_ms`: its prompt compute and quantize."""

    def __init__(self, state: PrefillState, mode: Mode, payload: list[jax.Array], sent: _Sent,
                 plan: Plan) -> None:
        self.state, self.mode, self._payload, self._sent = state, mode, payload, sent
        self.plan = plan
        self.compute_ms = sent.prefill_ms + sent.quantize_ms

    def send(self, link: Transport, tag: str, timeout: float = 60.0, t0: float | None = None
             ) -> Sending:
        """Hand each message to `link` (the ids with the first token and h_c's first chunk,
        h_c's other chunks, the prefix); `t0` (time.perf_counter; None: now) starts the
        interval its boundary's send time is told from."""
        state, sent = self.state, self._sent
        sent.start(link, time.perf_counter() if t0 is None else t0)
        for message in self.plan.messages:
            buffers = []
            for part in message.parts:
                buffers += {Part.TOKENS: lambda: [state.tokens],
                            Part.FIRST: lambda: list(state.first),
                            Part.BOUNDARY: lambda m=message: [_tokens_of(state.h_c, *m.tokens)],
                            Part.PREFIX: lambda m=message: self._layers(m)}[part]()
            sent.send(tag, message, buffers, timeout)
        return sent.handed(tag, timeout, state.suffix_sums)

    def _layers(self, message: Message) -> list[jax.Array]:
        """A prefix message's buffers: its layers' of the whole prefix's payload (a full
        prefill's prefix crosses in layer ranges over all its tokens)."""
        if message.tokens != (0, self.state.tokens.shape[1]):
            raise ValueError(f"{message.name}: a full prefill sends its prefix over every token")
        per_layer = len(self._payload) // self.mode.action.cut
        return self._payload[message.layers[0] * per_layer:message.layers[1] * per_layer]


def _packed(state: PrefillState, mode: Mode, backend: str | None, sent: _Sent,
            plan: Plan | None = None) -> Prepared:
    """`state` with its prefix quantized (Q, timed into `sent`), ready to send as `plan` (None:
    the mode's)."""
    S, c = state.tokens.shape[1], mode.action.cut
    whole = Message("prefix", (Part.PREFIX,), (0, S), (0, c))
    payload = [] if state.prefix is None else sent.pack(state.prefix, backend, whole)
    return Prepared(state, mode, payload, sent, plan or mode.plan(S, mode.action.num_layers))


def send_handoff(link: Transport, state: PrefillState, mode: Mode, tag: str,
                 backend: str | None = None, timeout: float = 60.0, plan: Plan | None = None
                 ) -> SendReport:
    """Prefill side of one handoff from a ready prefill state (the paper's interval), its
    messages as `plan` has them (None: the mode's)."""
    link.agree(f"{tag}/go", {}, timeout)  # both sides start their clocks here
    t0 = time.perf_counter()
    prepared = _packed(state, mode, backend, _Sent(state.codec), plan)
    return prepared.send(link, tag, timeout, t0).wait(timeout)


def prepare_prompt(cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode,
                   backend: str | None = None, first: FirstDraw = argmax_first) -> Prepared:
    """A full prefill's handoff computed from the prompt (its compute and Q timed), to send
    later (`Prepared.send`); ValueError for a streamed mode, which sends as it computes."""
    if mode.streams:
        raise ValueError(f"{mode.label} streams its prefill: start it with start_prompt")
    sent = _Sent(PrefixCodec.of(cfg, params, mode.action))
    state = sent.timed("prefill_ms", prepare, cfg, params, tokens, mode, False, first)
    return _packed(state, mode, backend, sent)


def send_prompt(link: Transport, cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode,
                tag: str, backend: str | None = None, timeout: float = 60.0, go: bool = True,
                first: FirstDraw = argmax_first) -> SendReport:
    """Prefill side of one handoff timed from the prompt's arrival (`mode.from_prompt`), until
    every verdict came (`start_prompt`, then `Sending.wait`)."""
    return start_prompt(link, cfg, params, tokens, mode, tag, backend, timeout, go,
                        first).wait(timeout)


def start_prompt(link: Transport, cfg: ModelConfig, params: Params, tokens: jax.Array,
                 mode: Mode, tag: str, backend: str | None = None, timeout: float = 60.0,
                 go: bool = True, first: FirstDraw = argmax_first, t0: float | None = None,
                 gate: Gate | None = None) -> Sending:
    """Compute one handoff from the prompt and hand its messages to the link; returns once all
    are handed (the verdicts come through the `Sending`). `go`: start both sides' clocks
    together first (`TAG/go`, agreed with `receive_handoff`); a serving prefill worker sends
    without it (the decode side's clock starts at its admission; `t0`, time.perf_counter,
    when this side saw it; None: now; or a streamed prefill's `gate`, which holds its messages
    until then while it computes). `first`: how it draws the first token it sends."""
    if go:
        link.agree(f"{tag}/go", {}, timeout)
    t0 = time.perf_counter() if t0 is None else t0
    if not mode.streams:
        if gate is not None:
            raise ValueError(f"{mode.label} is sent once computed: it takes no gate")
        return prepare_prompt(cfg, params, tokens, mode, backend, first).send(link, tag,
                                                                               timeout, t0)
    sent = _Sent(PrefixCodec.of(cfg, params, mode.action))
    sent.start(link, t0, gate)
    send = _send_layers if mode.streams_layers else _send_chunks
    return send(cfg, params, tokens, mode, tag, backend, timeout, sent, first)


def _send_layers(cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode, tag: str,
                 backend: str | None, timeout: float, sent: _Sent, first: FirstDraw
                 ) -> Sending:
    """A split prefill: compute the layers each message needs, one program per layer, then send
    it (a layer's payload once that layer is computed; h_c or the first token once layer c-1
    is)."""
    x, done, layer_kv = tokens, 0, None  # the residual entering layer `done`
    for message in mode.messages(tokens.shape[1], cfg.num_layers):
        need = message.layers[1] if message.parts == (Part.PREFIX,) else (
            mode.action.cut if message.parts != (Part.TOKENS,) else 0)
        while done < need:
            x, layer_kv = sent.timed("prefill_ms", _layer_step, cfg, params, tokens, x, done)
            done += 1
        payload = functools.partial(sent.pack, layer_kv, backend, message)
        sent.send(tag, message, _streamed(message, tokens, lambda x=x: x, payload, cfg, params,
                                          sent, first), timeout)
    return sent.handed(tag, timeout)


def _send_chunks(cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode, tag: str,
                 backend: str | None, timeout: float, sent: _Sent, first: FirstDraw
                 ) -> Sending:
    """A pipelined prefill: token chunks through layers 0..c-1 dispatched one ahead (`_Ahead`),
    each message sent once what it carries is computed (a chunk's h_c, then its prefix;
    transfer-only, the first token before the last chunk's prefix)."""
    messages = mode.messages(tokens.shape[1], cfg.num_layers)
    ahead = _Ahead(cfg, params, tokens, mode, sent, backend, messages)
    for message in messages:
        x, payload = (functools.partial(f, message.chunk) for f in (ahead.residual, ahead.prefix))
        sent.send(tag, message, _streamed(message, tokens, x, payload, cfg, params, sent, first),
                  timeout)
    return sent.handed(tag, timeout)


class _Ahead:
    """A pipelined prefill's chunks through layers 0..c-1, chunk k+1 dispatched once chunk k is
    computed and its prefix packed (the cache donated): it computes while chunk k is sent."""

    def __init__(self, cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode,
                 sent: _Sent, backend: str | None, messages: list[Message]) -> None:
        B, S = tokens.shape
        self._run = functools.partial(run_chunk, cfg, params)
        self._tokens, self._sent, self._backend = tokens, sent, backend
        self._ranges = token_chunks(S, mode.chunks)
        self._prefixes = {m.chunk: m for m in messages if m.parts == (Part.PREFIX,)}
        self._kv = new_cache(cfg, mode.action.cut, B, S, params["embed"].dtype)  # [B, S, K, H]
        self._done: list[tuple[jax.Array, list[jax.Array]]] = []  # per chunk: h_c, payload
        self._next: jax.Array | None = None  # the residual of the chunk in flight
        sent.mark = time.perf_counter()
        self._dispatch(0)

    def _dispatch(self, k: int) -> None:
        if self._prefixes:  # else no layer runs here (a recomputation sends only the ids)
            a, b = self._ranges[k]
            self._next, self._kv = self._run(self._tokens[:, a:b], self._kv, 0, a)

    def residual(self, k: int) -> jax.Array:
        """Chunk k's residual after layer c-1 [B, T, D], awaited (then its prefix dispatched)."""
        while len(self._done) <= k:
            i = len(self._done)
            x = self._sent.awaited("prefill_ms", self._next)
            message = self._prefixes[i]
            payload = self._sent.dispatch_pack(self._kv.span(*message.tokens), self._backend,
                                               message)
            if i + 1 < len(self._ranges):
                self._dispatch(i + 1)
            self._done.append((x, payload))
        return self._done[k][0]

    def prefix(self, k: int) -> list[jax.Array]:
        """Chunk k's prefix payload, awaited (a Q8/Q4 one timed as its quantize)."""
        self.residual(k)
        what = "prefill_ms" if self._sent.codec.bits == 16 else "quantize_ms"
        return self._sent.awaited(what, self._done[k][1])


def _streamed(message: Message, tokens: jax.Array, x: Callable[[], jax.Array],
              payload: Callable[[], list[jax.Array]], cfg: ModelConfig, params: Params,
              sent: _Sent, first: FirstDraw) -> list[jax.Array]:
    """The buffers of one message of a streamed prefill: the ids, h_c (`x()`), the first token
    drawn from `x()` after the last layer, or the prefix's `payload()`."""
    part, = message.parts
    if part == Part.TOKENS:
        return [tokens]
    if part == Part.BOUNDARY:
        return [x()]
    if part == Part.FIRST:
        return list(sent.timed("prefill_ms", _first_token, cfg, params, x(), first))
    return payload()


def _layer_step(cfg: ModelConfig, params: Params, tokens: jax.Array, x: jax.Array, layer: int
                ) -> tuple[jax.Array, KVCache]:
    """Layer `layer` of a split prefill (the same per-layer program as `prefill`)."""
    if layer == 0:
        return run_prefix(cfg, params, tokens, 1)
    return run_layers(cfg, params, x, layer, layer + 1)


def _first_token(cfg: ModelConfig, params: Params, x: jax.Array, first: FirstDraw
                 ) -> tuple[jax.Array, ...]:
    """The first token drawn from the residual after the last layer (transfer-only)."""
    return first(run_suffix(cfg, params, x, cfg.num_layers)[1])
