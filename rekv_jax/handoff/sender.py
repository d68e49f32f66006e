"""The prefill side of a handoff (paper §2.2): compute what each message needs, then send it, in
the order its `Mode` gives (`Mode.messages`).

From a ready prefill state (the paper's interval, `send_handoff`): quantize the prefix (Q), send
the token ids with `h_c` first (H), then the prefix payload. Timed from the prompt's arrival
(`send_prompt`), the prefill side computes inside the interval: a full prefill runs all L layers
and then hands off as above; a split one runs layers 0..c-1 one program per layer and sends each
layer's payload as it is computed, `h_c` the moment layer c-1 is; a pipelined one runs each token
chunk through layers 0..c-1 (a chunked prefill with its own prefix cache) and sends the chunk's
`h_c`, then its prefix. Either way the link moves a message while the next one computes.

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
from rekv_jax.kv import KVCache
from rekv_jax.mode import Message, Mode, Part
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
from rekv_jax.sizes import token_chunks
from rekv_jax.transport import Transport, checksums

T = TypeVar("T")
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


@dataclasses.dataclass(frozen=True)
class SendReport:
    """What the prefill side did for one handoff: the times it told the decode side, and how
    long its messages held the link (from the first handed to it to the last acknowledged)."""

    times: PrefillTimes
    link_ms: float


class _Sent:
    """The prefill side's running account of one handoff: its compute and quantize times, when
    the boundary left, the messages sent and the bytes they carried."""

    def __init__(self, link: Transport, t0: float, codec: PrefixCodec) -> None:
        self.link, self.t0, self.codec, self.bytes_before = link, t0, codec, link.sent_bytes
        self.prefill_ms = self.quantize_ms = self.boundary_at_ms = 0.0
        self.first_sent: float | None = None
        self.tags: list[str] = []
        self.nonfinite: list[jax.Array] = []

    def timed(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, awaited, with its time added to `what` (prefill_ms or quantize_ms)."""
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        setattr(self, what, getattr(self, what) + elapsed_ms(start, time.perf_counter()))
        return out

    def pack(self, prefix: KVCache, backend: str | None, message: Message) -> list[jax.Array]:
        """The payload of `message`'s prefix (Q: quantize, timed; BF16 buffers as they are)."""
        args = (prefix, self.codec, backend, message.layers[0], message.tokens[0])
        payload, nonfinite = (self.timed("quantize_ms", pack_prefix, *args)
                              if self.codec.bits != 16 else pack_prefix(*args))
        self.nonfinite += nonfinite
        return payload

    def send(self, tag: str, message: Message, buffers: list[jax.Array], timeout: float) -> None:
        if {Part.BOUNDARY, Part.FIRST} & set(message.parts) and not self.boundary_at_ms:
            self.boundary_at_ms = elapsed_ms(self.t0, time.perf_counter())
        self.first_sent = self.first_sent or time.perf_counter()
        self.link.send(f"{tag}/{message.name}", buffers, timeout)
        self.tags.append(message.name)

    def finish(self, tag: str, timeout: float, suffix_sums: tuple[int, ...] = ()
               ) -> SendReport:
        """Post the prefill side's times and bytes, then wait for every message's verdict (the
        decode side's errors surface here); a non-finite scale is an error too."""
        check_finite(self.nonfinite, self.codec.bits)
        times = PrefillTimes(self.prefill_ms, self.quantize_ms, self.boundary_at_ms,
                             self.link.sent_bytes - self.bytes_before, suffix_sums)
        self.link.send_meta(f"{tag}/prefill", times.to_json())
        for name in self.tags:
            self.link.wait_ack(f"{tag}/{name}", timeout)
        return SendReport(times, elapsed_ms(self.first_sent or time.perf_counter(),
                                            time.perf_counter()))


def send_handoff(link: Transport, state: PrefillState, mode: Mode, tag: str,
                 backend: str | None = None, timeout: float = 60.0) -> SendReport:
    """Prefill side of one handoff from a ready prefill state (the paper's interval)."""
    link.agree(f"{tag}/go", {}, timeout)  # both sides start their clocks here
    sent = _Sent(link, time.perf_counter(), state.codec)
    return _send_state(state, mode, tag, backend, timeout, sent)


def send_prompt(link: Transport, cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode,
                tag: str, backend: str | None = None, timeout: float = 60.0, go: bool = True,
                first: FirstDraw = argmax_first) -> SendReport:
    """Prefill side of one handoff timed from the prompt's arrival (`mode.from_prompt`). `go`:
    start both sides' clocks together first (`TAG/go`, agreed with `receive_handoff`); a
    serving prefill worker sends at once instead (the decode side's clock starts at its
    admission). `first`: how it draws the first token it sends."""
    if go:
        link.agree(f"{tag}/go", {}, timeout)
    sent = _Sent(link, time.perf_counter(), PrefixCodec.of(cfg, params, mode.action))
    if not mode.streams:
        state = sent.timed("prefill_ms", prepare, cfg, params, tokens, mode, False, first)
        return _send_state(state, mode, tag, backend, timeout, sent)
    send = _send_layers if mode.streams_layers else _send_chunks
    return send(cfg, params, tokens, mode, tag, backend, timeout, sent, first)


def _send_state(state: PrefillState, mode: Mode, tag: str, backend: str | None, timeout: float,
                sent: _Sent) -> SendReport:
    """Quantize the prefix (Q), then send each message: the ids with the first token and h_c's
    first chunk, h_c's other chunks, the prefix."""
    messages = mode.messages(state.tokens.shape[1], mode.action.num_layers)
    payload = [] if state.prefix is None else sent.pack(state.prefix, backend, messages[-1])
    for message in messages:
        buffers = []
        for part in message.parts:
            buffers += {Part.TOKENS: lambda: [state.tokens],
                        Part.FIRST: lambda: list(state.first),
                        Part.BOUNDARY: lambda m=message: [_tokens_of(state.h_c, *m.tokens)],
                        Part.PREFIX: lambda: payload}[part]()
        sent.send(tag, message, buffers, timeout)
    return sent.finish(tag, timeout, state.suffix_sums)


def _send_layers(cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode, tag: str,
                 backend: str | None, timeout: float, sent: _Sent, first: FirstDraw
                 ) -> SendReport:
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
        sent.send(tag, message, _streamed(message, tokens, x, layer_kv, cfg, params, sent,
                                          backend, first), timeout)
    return sent.finish(tag, timeout)


def _send_chunks(cfg: ModelConfig, params: Params, tokens: jax.Array, mode: Mode, tag: str,
                 backend: str | None, timeout: float, sent: _Sent, first: FirstDraw
                 ) -> SendReport:
    """A pipelined prefill: compute the token chunks each message needs through layers 0..c-1
    (a chunked prefill with its own prefix cache), then send it (a chunk's h_c, then its
    prefix; transfer-only, the first token before the last chunk's prefix)."""
    B, S = tokens.shape
    kv = new_cache(cfg, mode.action.cut, B, S, params["embed"].dtype)  # [B, S, K, H] per layer
    ranges = token_chunks(S, mode.chunks)
    x, done = tokens, 0  # the residual of the last computed chunk; chunks computed
    for message in mode.messages(S, cfg.num_layers):
        while message.parts != (Part.TOKENS,) and done <= message.chunk:
            a, b = ranges[done]
            x, kv = sent.timed("prefill_ms", run_chunk, cfg, params, tokens[:, a:b], kv, 0, a)
            done += 1
        prefix = kv.span(*message.tokens) if message.parts == (Part.PREFIX,) else None
        sent.send(tag, message, _streamed(message, tokens, x, prefix, cfg, params, sent,
                                          backend, first), timeout)
    return sent.finish(tag, timeout)


def _streamed(message: Message, tokens: jax.Array, x: jax.Array, prefix: KVCache | None,
              cfg: ModelConfig, params: Params, sent: _Sent, backend: str | None,
              first: FirstDraw) -> list[jax.Array]:
    """The buffers of one message of a streamed prefill: the ids, h_c (`x`), the first token
    drawn from `x` after the last layer, or the payload of `prefix`."""
    part, = message.parts
    if part == Part.TOKENS:
        return [tokens]
    if part == Part.BOUNDARY:
        return [x]
    if part == Part.FIRST:
        return list(sent.timed("prefill_ms", _first_token, cfg, params, x, first))
    return sent.pack(prefix, backend, message)


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
