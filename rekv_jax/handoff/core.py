"""One ReKV handoff: the prefill side's sends and the decode side's two schedules (paper §2.2-2.3).

Prefill side (`send_handoff`), timed from when its prefill state is ready:
  quantize the prefix (Q) -> send the token ids with `h_c` first -> send the prefix payload.
Decode side (`receive_handoff`), timed from the same start:
  sequential:  receive `h_c` (H), receive + dequantize the prefix (X), run the suffix (R), join (J)
  overlapped:  receive `h_c`, then the suffix runs on this thread while a background thread
               receives and dequantizes the prefix; join when both are done.
So `T_seq = Q + H + X + R + J` and `T_ov = Q + H + max(X, R) + J` (Eqs. 8-9). Transfer-only
(`c = L`) has no boundary and no suffix: the prefill side's first token travels with the token
ids. Full recomputation (`c = 0`) sends token ids only and runs the whole prompt.

Token ids always cross the link (they are tiny): the decode side needs them to check its cache
and, under `fallback="recompute"`, to rebuild the cache if the prefix transfer fails.

Timed from the prompt's arrival instead (`send_prompt`), the prefill side computes inside the
interval. `full`: it runs all L layers, then hands off as above (the paper's Fig. 3). `split`: it
runs layers 0..c-1 only, one step per layer (`model.run_layers`, the same per-layer program as
`prefill`), and streams: the token ids at once, each layer's quantized KV as its own message
(`TAG/layerN`) while the next layer computes, and `h_c` the moment layer c-1 is computed. The
decode side's receive worker restores each layer as it arrives. Either way a `prefill` phase
(the prefill side's own compute) joins `Q, H, X, R, J`.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp

from rekv_jax.action import Action, ActionKind
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.outcome import Handoff, PrefillTimes, elapsed_ms, finish_send, outcome
from rekv_jax.handoff.payload import pack_prefix, prefix_specs, recv_prefix, send_prefix
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.kv import KVCache
from rekv_jax.model.transformer import (
    Params,
    prefill,
    run_layers,
    run_prefix,
    run_suffix,
    token_chunks,
)
from rekv_jax.phases import (
    FALLBACKS,
    Fallback,
    Interval,
    PrefillMode,
    Schedule,
    check_chunks,
    check_modes,
)
from rekv_jax.transport import Transport, TransportError, checksums


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillState:
    """What the prefill worker holds when its prefill is done (before the timed interval)."""

    tokens: jax.Array  # [B, S] int32
    h_c: jax.Array | None  # [B, S, D] boundary (joint actions)
    prefix: KVCache | None  # [c, B, S, K, H] (joint and transfer-only)
    first_token: jax.Array  # [B] from the prefill's own logits (sent with transfer-only)
    # `checksums` of this process's suffix KV [K, V] (joint actions, when asked for): the decode
    # side compares its recomputed suffix with it (sent with the prefill side's times)
    suffix_sums: tuple[int, ...] = dataclasses.field(default=(), metadata={"static": True})
    codec: PrefixCodec | None = None  # how the prefix is encoded (None: no prefix)


def check_schedule(schedule: str, prefill_mode: str, chunks: int, seq_len: int) -> None:
    """ValueError unless the schedule, prefill mode and token chunks go together
    (`costmodel.check_chunks`) as a handoff runs them: chunked with N >= 2 chunks, and a
    pipelined prefill under it only."""
    check_chunks(schedule, prefill_mode, chunks, seq_len)
    pipelined = prefill_mode == PrefillMode.PIPELINED
    if (schedule == Schedule.CHUNKED) != (chunks > 1) or pipelined > (chunks > 1):
        raise ValueError(f"a handoff runs {chunks} chunks under schedule '{schedule}' with a "
                         f"{prefill_mode} prefill: the chunked schedule needs N >= 2, a "
                         "pipelined prefill the chunked schedule")


def prepare(cfg: ModelConfig, params: Params, tokens: jax.Array, action: Action,
            check_suffix: bool = False, chunks: int = 1) -> PrefillState:
    """Run the prefill worker's prompt processing for `action` (untimed, as in the paper).

    `check_suffix`: also take the checksums of the suffix KV it computes anyway (joint actions;
    a device-to-host sync, so only where this runs outside the timed interval), in `chunks`."""
    if action.kind == ActionKind.RECOMPUTE:
        _, logits = prefill(cfg, params, tokens)
        return PrefillState(tokens, None, None, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    h_c, prefix = run_prefix(cfg, params, tokens, action.cut)
    suffix, logits = run_suffix(cfg, params, h_c, action.cut, chunks=chunks)  # layers c..L-1
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    joint = action.kind == ActionKind.JOINT
    sums = tuple(checksums([suffix.k, suffix.v])) if joint and check_suffix else ()
    return PrefillState(tokens, h_c if joint else None, prefix, first, sums,
                        PrefixCodec.of(cfg, params, action))


# ---------------------------------------------------------------------------- prefix payload


# ---------------------------------------------------------------------------- the two sides


def send_handoff(transport: Transport, state: PrefillState, action: Action, tag: str,
                 backend: str | None = None, timeout: float = 60.0, chunks: int = 1) -> None:
    """Prefill side of one handoff from a ready prefill state (the paper's interval)."""
    transport.agree(f"{tag}/go", {}, timeout)  # both sides start their clocks here
    _send_state(transport, state, action, tag, backend, timeout, time.perf_counter(), 0.0,
                chunks)


def send_prompt(transport: Transport, cfg: ModelConfig, params: Params, tokens: jax.Array,
                action: Action, tag: str, prefill_mode: str = PrefillMode.FULL,
                backend: str | None = None, timeout: float = 60.0, chunks: int = 1) -> None:
    """Prefill side of one handoff timed from the prompt's arrival: `full` runs all L layers
    (`prepare`), then hands off as `send_handoff`; `split` streams layers 0..c-1 as computed;
    `pipelined` streams token chunks of layers 0..c-1 as computed (`chunked.send_pipelined`)."""
    check_modes(Interval.PROMPT, prefill_mode)
    transport.agree(f"{tag}/go", {}, timeout)
    t0 = time.perf_counter()
    if prefill_mode == PrefillMode.SPLIT:
        _send_streamed(transport, cfg, params, tokens, action, tag, backend, timeout, t0)
        return
    if prefill_mode == PrefillMode.PIPELINED:
        from rekv_jax.handoff.chunked import send_pipelined  # it builds on this module

        send_pipelined(transport, cfg, params, tokens, action, tag, backend, timeout, chunks)
        return
    state = jax.block_until_ready(prepare(cfg, params, tokens, action, chunks=chunks))
    _send_state(transport, state, action, tag, backend, timeout, t0,
                elapsed_ms(t0, time.perf_counter()), chunks)


def _send_state(transport: Transport, state: PrefillState, action: Action, tag: str,
                backend: str | None, timeout: float, t0: float, prefill_ms: float,
                chunks: int = 1) -> None:
    """Quantize the prefix (Q), send the token ids with `h_c` first (chunks > 1: its first token
    chunk; chunk i > 0 as `TAG/boundaryI`), then the prefix payload."""
    sent_before = transport.sent_bytes
    start = time.perf_counter()
    payload = []
    if state.prefix is not None:
        payload = jax.block_until_ready(pack_prefix(state.prefix, state.codec, backend))
    quantize_ms = elapsed_ms(start, time.perf_counter()) if action.bits != 16 else 0.0
    pieces = [] if state.h_c is None else [state.h_c] if chunks == 1 else [
        state.h_c[:, a:b] for a, b in token_chunks(state.h_c.shape[1], chunks)]  # [B, T, D]
    boundary = [state.tokens, state.first_token] + pieces[:1]
    boundary_at_ms = elapsed_ms(t0, time.perf_counter())
    transport.send(f"{tag}/boundary", boundary, timeout)  # one message: ids (+ h_c) first
    phases = ["boundary"]
    for i, piece in enumerate(pieces[1:], 1):
        transport.send(f"{tag}/boundary{i}", [piece], timeout)
        phases.append(f"boundary{i}")
    if payload:
        transport.send(f"{tag}/prefix", payload, timeout)
    finish_send(transport, tag, phases + ["prefix"] * bool(payload), timeout, PrefillTimes(
        prefill_ms, quantize_ms, boundary_at_ms, transport.sent_bytes - sent_before,
        state.suffix_sums))


def _send_streamed(transport: Transport, cfg: ModelConfig, params: Params, tokens: jax.Array,
                   action: Action, tag: str, backend: str | None, timeout: float, t0: float
                   ) -> None:
    """Split prefill: the token ids at once, then per layer 0..c-1: compute it, quantize it and
    hand it to the link, which moves it while the next layer computes. `h_c` (or, transfer-only,
    the first token) leaves as soon as layer c-1 is computed, before that layer's payload."""
    c, L = action.cut, cfg.num_layers
    codec = PrefixCodec.of(cfg, params, action)
    sent_before = transport.sent_bytes
    transport.send(f"{tag}/tokens", [tokens], timeout)
    phases, prefill_ms, quantize_ms, boundary_at_ms = ["tokens"], 0.0, 0.0, 0.0
    x = tokens
    for layer in range(c):
        start = time.perf_counter()
        x, kv = jax.block_until_ready(  # x: the residual entering layer + 1 [B, S, D]
            run_prefix(cfg, params, tokens, 1) if layer == 0
            else run_layers(cfg, params, x, layer, layer + 1))
        if layer == c - 1:
            boundary = [x]
            if c == L:  # transfer-only: the prefill side picks the first token
                _, logits = run_suffix(cfg, params, x, L)
                boundary = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
            boundary = jax.block_until_ready(boundary)
            prefill_ms += elapsed_ms(start, time.perf_counter())
            boundary_at_ms = elapsed_ms(t0, time.perf_counter())
            transport.send(f"{tag}/boundary", boundary, timeout)
            phases.append("boundary")
        else:
            prefill_ms += elapsed_ms(start, time.perf_counter())
        quantize_ms += send_prefix(transport, f"{tag}/layer{layer}", kv, codec, backend,
                                   timeout, layer)
        phases.append(f"layer{layer}")
    finish_send(transport, tag, phases, timeout, PrefillTimes(
        prefill_ms, quantize_ms, boundary_at_ms, transport.sent_bytes - sent_before))


def receive_handoff(transport: Transport, cfg: ModelConfig, params: Params, action: Action,
                    batch: int, seq_len: int, tag: str, schedule: str = Schedule.OVERLAPPED,
                    fallback: str = Fallback.ERROR, backend: str | None = None,
                    timeout: float = 60.0, prefill_mode: str = PrefillMode.FULL, chunks: int = 1
                    ) -> Handoff:
    """Decode side of one handoff: receive, recompute, restore, join; time every phase.

    `prefill_mode="split"` receives the streamed form (`_send_streamed`): the token ids first,
    then a receive worker restores each prefix layer as it arrives while this thread waits for
    `h_c` and runs the suffix (overlapped) or first waits for the whole prefix (sequential).
    A joint action's `chunked` schedule and a `pipelined` prefill run `chunked.receive_chunked`.
    """
    check_schedule(schedule, prefill_mode, chunks, seq_len)
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    check_modes(Interval.READY if prefill_mode == PrefillMode.FULL else Interval.PROMPT,
                prefill_mode)
    pipelined = prefill_mode == PrefillMode.PIPELINED
    if pipelined or (schedule == Schedule.CHUNKED and action.kind == ActionKind.JOINT):
        from rekv_jax.handoff.chunked import receive_chunked  # it builds on this module

        return receive_chunked(transport, cfg, params, action, batch, seq_len, tag, chunks,
                               pipelined, fallback, backend, timeout)
    split, c = prefill_mode == PrefillMode.SPLIT, action.cut
    dtype = params["embed"].dtype
    codec = PrefixCodec.of(cfg, params, action)
    token_spec = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    first_spec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    h_c_spec = jax.ShapeDtypeStruct((batch, seq_len, cfg.hidden_size), dtype)
    if split:  # the ids came alone; the boundary is h_c, or the first token (transfer-only)
        specs = {ActionKind.JOINT: [h_c_spec], ActionKind.TRANSFER: [first_spec],
                 ActionKind.RECOMPUTE: []}[action.kind]
    else:
        specs = [token_spec, first_spec] + [h_c_spec] * (action.kind == ActionKind.JOINT)
    transport.hold_acks()  # posted once the first token is out (`outcome`)
    transport.agree(f"{tag}/go", {}, timeout)
    t0 = time.perf_counter()
    boundary_in = threading.Event()  # the boundary's receive ended (its bytes are paced first)

    def restore_prefix() -> tuple[KVCache, float]:
        if not split:
            prefix = recv_prefix(transport, cfg, codec, (batch, seq_len, c), dtype,
                                 f"{tag}/prefix", backend, timeout, boundary_in)
        else:  # restore each layer as it arrives (all pulled at once: see Transport.prefetch)
            transport.prefetch([f"{tag}/layer{layer}" for layer in range(c)],
                               [prefix_specs(cfg, action, batch, seq_len, dtype, 1)] * c, timeout)
            layers = []
            for layer in range(c):
                try:
                    layers.append(recv_prefix(transport, cfg, codec, (batch, seq_len, 1), dtype,
                                              f"{tag}/layer{layer}", backend, timeout,
                                              layer=layer))
                except TransportError as e:
                    raise TransportError(f"prefix layer {layer} lost after {layer} of {c} "
                                         f"arrived: {e}") from e
            prefix = KVCache.concat(*layers)
        return jax.block_until_ready(prefix), time.perf_counter()

    def run_suffix_now(kind: ActionKind) -> tuple[KVCache, jax.Array, float, float]:
        start = time.perf_counter()
        if kind == ActionKind.RECOMPUTE:
            kv, logits = prefill(cfg, params, tokens)
        else:
            kv, logits = run_suffix(cfg, params, h_c, c)
        return *jax.block_until_ready((kv, logits)), start, time.perf_counter()

    tokens = transport.recv(f"{tag}/tokens", [token_spec], timeout)[0] if split else None
    prefix = suffix = logits = sent_first = h_c = None
    t_boundary = t_prefix = time.perf_counter()
    fell_back = False
    # the prefix is received beside this thread (on the transport's persistent background
    # thread) where something runs meanwhile: from the start for the split stream, and for
    # transfer-only over a transport that pulls without waiting for a message (both phases in
    # flight at once; a paced link still delivers the boundary first), else beside the
    # overlapped suffix
    early = c > 0 and (split or action.kind == ActionKind.TRANSFER and transport.pull_first)
    pending = transport.background.submit(restore_prefix) if early else None
    try:
        if specs:
            try:
                boundary = transport.recv(f"{tag}/boundary", specs, timeout)
            finally:
                boundary_in.set()
            if not split:
                tokens, sent_first, *boundary = boundary
            h_c = boundary[0] if action.kind == ActionKind.JOINT else None
            sent_first = boundary[0] if split and action.kind == ActionKind.TRANSFER else sent_first
        t_boundary = t_prefix = time.perf_counter()
        if action.kind == ActionKind.RECOMPUTE:
            suffix, logits, t_start, t_suffix = run_suffix_now(ActionKind.RECOMPUTE)
        else:
            overlapped = action.kind == ActionKind.JOINT and schedule == Schedule.OVERLAPPED
            if overlapped and pending is None:  # transfer + restore ...
                pending = transport.background.submit(restore_prefix)
            if overlapped:
                suffix, logits, t_start, t_suffix = run_suffix_now("suffix")  # ... meanwhile
            prefix, t_prefix = pending.result() if pending is not None else restore_prefix()
            if action.kind == ActionKind.JOINT and schedule == Schedule.SEQUENTIAL:
                suffix, logits, t_start, t_suffix = run_suffix_now("suffix")
            elif action.kind == ActionKind.TRANSFER:
                t_start = t_suffix = t_prefix
    except TransportError:
        if (fallback != Fallback.RECOMPUTE or action.kind == ActionKind.RECOMPUTE
                or tokens is None):
            raise
        fell_back, prefix, t_prefix = True, None, t_boundary
        suffix, logits, t_start, t_suffix = run_suffix_now(ActionKind.RECOMPUTE)
    finally:
        if pending is not None and not pending.done():  # left running (a failure here): its
            transport.background.abandon()  # recv ends by its timeout; later handoffs don't wait
        transport.discard(f"{tag}/")

    return outcome(transport, tag, timeout, t0, prefix, suffix, logits, sent_first,
                   (t_boundary, t_prefix, t_start, t_suffix), fell_back)


