"""Token-chunked handoffs: the decode side runs the suffix on each token chunk as it arrives.

Causal attention lets token chunk i of layers c..L-1 run once chunks 0..i of `h_c` are there, so
the decode side need not wait for the whole boundary (issue 20).

Ready interval, `chunked` schedule: the prefill side sends `h_c` as N token-chunk messages (the
first with the token ids, `handoff._send_state`), then the prefix payload. The decode side
dispatches layers c..L-1 on chunk i (`model.run_chunk`: a chunked prefill of the suffix with its
own cache) the moment it arrives, without waiting for the device, while the transport's
background worker receives and restores the prefix. The suffix equals
`run_suffix(chunks=N)` bitwise.

Prompt interval, `pipelined` prefill: the prefill side runs each token chunk through layers
0..c-1 (a chunked prefill with its own prefix cache) and sends the chunk's `h_c` the moment it is
computed, then that chunk's quantized prefix KV (`TAG/prefixI`). The decode side runs each chunk's
suffix as it arrives while the background worker restores the prefix chunks, so the two sides
form a two-stage pipeline over the prompt. The cache equals `prefill(chunks=N)` bitwise, the
prefix after its quantization round trip.

Messages: chunk 0 of `h_c` is `TAG/boundary`, chunk i > 0 `TAG/boundaryI`. A pipelined
transfer-only action sends its first token as `TAG/boundary` after the last chunk; a pipelined
full recomputation sends the token ids only.
"""

from __future__ import annotations

import itertools
import threading
import time

import jax
import jax.numpy as jnp

from rekv_jax.action import Action, ActionKind
from rekv_jax.config import ModelConfig
from rekv_jax.handoff.outcome import Handoff, PrefillTimes, elapsed_ms, finish_send, outcome
from rekv_jax.handoff.payload import prefix_specs, recv_prefix, send_prefix
from rekv_jax.handoff.prefix_format import PrefixCodec
from rekv_jax.kv import KVCache
from rekv_jax.model.transformer import (
    Params,
    new_cache,
    prefill,
    run_chunk,
    run_prefix,
    run_suffix,
    token_chunks,
)
from rekv_jax.phases import Fallback
from rekv_jax.transport import Transport, TransportError

DEFAULT_CHUNKS = 4  # token chunks when none are asked for (the planner may choose better)


def boundary_tag(tag: str, chunk: int) -> str:
    """The message of `h_c`'s token chunk `chunk`."""
    return f"{tag}/boundary" + (str(chunk) if chunk else "")


def reference(cfg: ModelConfig, params: Params, tokens: jax.Array, cut: int, chunks: int,
              pipelined: bool) -> tuple[KVCache, jax.Array, str]:
    """The single-process cache [L, B, S, K, H] and last logits [B, V] a chunked handoff equals
    (bitwise; a Q8/Q4 prefix within its error bound), and the reference's name."""
    if pipelined:
        kv, logits = prefill(cfg, params, tokens, chunks)
        return kv, logits, f"prefill(chunks={chunks})"
    h_c, prefix = run_prefix(cfg, params, tokens, cut)
    suffix, logits = run_suffix(cfg, params, h_c, cut, chunks=chunks)
    return KVCache.concat(prefix, suffix), logits, f"run_suffix(chunks={chunks})"


def send_pipelined(transport: Transport, cfg: ModelConfig, params: Params, tokens: jax.Array,
                   action: Action, tag: str, backend: str | None, timeout: float, chunks: int
                   ) -> None:
    """Prefill side of a pipelined prefill: the token ids at once, then per token chunk: run it
    through layers 0..c-1, send its `h_c`, quantize and send its prefix KV."""
    c, L = action.cut, cfg.num_layers
    B, S = tokens.shape
    codec = PrefixCodec.of(cfg, params, action)
    t0, sent_before = time.perf_counter(), transport.sent_bytes
    transport.send(f"{tag}/tokens", [tokens], timeout)
    phases, prefill_ms, quantize_ms, boundary_at_ms = ["tokens"], 0.0, 0.0, 0.0
    kv = new_cache(cfg, c, B, S, params["embed"].dtype)  # [c, B, S, K, H]
    ranges = token_chunks(S, chunks) if c else []  # full recomputation: the ids are all
    for i, (a, b) in enumerate(ranges):
        start = time.perf_counter()
        x, kv = run_chunk(cfg, params, tokens[:, a:b], kv, 0, a)  # x [B, T, D] enters layer c
        out = [x] if action.kind == ActionKind.JOINT else []
        if action.kind == ActionKind.TRANSFER and i == len(ranges) - 1:  # the first token, last
            _, logits = run_suffix(cfg, params, x, L)
            out = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
        out = jax.block_until_ready(out)
        prefill_ms += elapsed_ms(start, time.perf_counter())
        if out:
            name = boundary_tag(tag, i if action.kind == ActionKind.JOINT else 0)
            boundary_at_ms = boundary_at_ms or elapsed_ms(t0, time.perf_counter())
            transport.send(name, out, timeout)
            phases.append(name.removeprefix(f"{tag}/"))
        quantize_ms += send_prefix(transport, f"{tag}/prefix{i}", kv.span(a, b), codec,
                                   backend, timeout, start=a)
        phases.append(f"prefix{i}")
    finish_send(transport, tag, phases, timeout, PrefillTimes(
        prefill_ms, quantize_ms, boundary_at_ms, transport.sent_bytes - sent_before))


def receive_chunked(transport: Transport, cfg: ModelConfig, params: Params, action: Action,
                    batch: int, seq_len: int, tag: str, chunks: int, pipelined: bool,
                    fallback: str, backend: str | None, timeout: float) -> Handoff:
    """Decode side of a chunked schedule (ready interval) or a pipelined prefill: layers c..L-1
    on each token chunk as it arrives; the prefix restored meanwhile on the background worker."""
    c, L, D = action.cut, cfg.num_layers, cfg.hidden_size
    dtype = params["embed"].dtype
    codec = PrefixCodec.of(cfg, params, action)
    ranges = token_chunks(seq_len, chunks)
    token_spec = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    first_spec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    h_specs = [[jax.ShapeDtypeStruct((batch, b - a, D), dtype)] for a, b in ranges]
    if not pipelined:  # chunk 0 travels with the ids
        h_specs[0] = [token_spec, first_spec, *h_specs[0]]
    prefix_tags = [f"{tag}/prefix{i}" for i in range(len(ranges))] if pipelined else [
        f"{tag}/prefix"]
    prefix_shapes = [(batch, b - a, c) for a, b in ranges] if pipelined else [(batch, seq_len, c)]
    transport.hold_acks()  # posted once the first token is out (`outcome`)
    transport.agree(f"{tag}/go", {}, timeout)
    t0 = time.perf_counter()
    # every message is pulled from the start, in the order sent, so the link moves them back to
    # back while the suffix computes between their receives (which then verify and pace)
    joint = action.kind == ActionKind.JOINT
    boundary = [(boundary_tag(tag, i), s) for i, s in enumerate(h_specs)] * joint
    prefix_msgs = [(name, prefix_specs(cfg, action, B, T, dtype, layers))
                   for name, (B, T, layers) in zip(prefix_tags, prefix_shapes, strict=True)]
    prefix_msgs *= c > 0
    if pipelined:  # h_c chunk i, then its prefix
        order = [m for pair in itertools.zip_longest(boundary, prefix_msgs) for m in pair if m]
    else:
        order = boundary + prefix_msgs
    transport.prefetch([name for name, _ in order], [specs for _, specs in order], timeout)
    # a paced link delivers in the order sent: every h_c chunk, then the prefix; pipelined,
    # h_c chunk i, prefix chunk i, h_c chunk i+1, ... (each receive waits for the one before)
    boundary_in = [threading.Event() for _ in ranges]
    prefix_in = [threading.Event() for _ in ranges]
    if action.kind != ActionKind.JOINT:  # no h_c chunks: nothing to queue behind
        for event in boundary_in:
            event.set()

    def restore_prefix() -> tuple[KVCache, float]:
        try:
            spans = []  # pipelined: chunk by chunk, as computed
            for i, (name, shape) in enumerate(zip(prefix_tags, prefix_shapes, strict=True)):
                spans.append(recv_prefix(transport, cfg, codec, shape, dtype, name, backend,
                                         timeout, boundary_in[i if pipelined else -1],
                                         start=ranges[i][0] if pipelined else 0))
                prefix_in[i].set()
            prefix = KVCache.join_spans(*spans) if pipelined else spans[0]
        finally:  # a failed receive holds up no other
            for event in prefix_in:
                event.set()
        return jax.block_until_ready(prefix), time.perf_counter()

    tokens = transport.recv(f"{tag}/tokens", [token_spec], timeout)[0] if pipelined else None
    prefix = suffix = logits = sent_first = None
    t_boundary = t_prefix = t_start = t_suffix = time.perf_counter()
    fell_back = False
    pending = transport.background.submit(restore_prefix) if c > 0 else None
    try:
        if action.kind == ActionKind.RECOMPUTE:  # pipelined only: the whole prompt, chunked
            t_boundary = t_start = time.perf_counter()
            suffix, logits = jax.block_until_ready(prefill(cfg, params, tokens, chunks))
            t_suffix = time.perf_counter()
        elif action.kind == ActionKind.TRANSFER:  # pipelined only
            sent_first = transport.recv(f"{tag}/boundary", [first_spec], timeout)[0]
            t_boundary = t_start = t_suffix = time.perf_counter()
        else:
            suffix = new_cache(cfg, L - c, batch, seq_len, dtype)  # [L-c, B, S, K, H]
            for i, (a, _) in enumerate(ranges):
                got = transport.recv(boundary_tag(tag, i), h_specs[i], timeout,
                                     prefix_in[i - 1] if pipelined and i > 0 else None)
                if i == 0 and not pipelined:
                    tokens, sent_first, h = got
                else:
                    h = got[0]
                boundary_in[i].set()
                if i == 0:
                    t_boundary = t_start = time.perf_counter()
                x, suffix = run_chunk(cfg, params, h, suffix, c, a)  # dispatched, not awaited
            _, logits = run_suffix(cfg, params, x, L)  # the head on the last position
            suffix, logits = jax.block_until_ready((suffix, logits))
            t_suffix = time.perf_counter()
        prefix, t_prefix = pending.result() if pending is not None else (None, t_boundary)
    except TransportError:
        if (fallback != Fallback.RECOMPUTE or action.kind == ActionKind.RECOMPUTE
                or tokens is None):
            raise
        fell_back, prefix, t_prefix = True, None, t_boundary
        t_start = time.perf_counter()
        suffix, logits = jax.block_until_ready(prefill(cfg, params, tokens))
        t_suffix = time.perf_counter()
    finally:
        for event in boundary_in:
            event.set()
        if pending is not None and not pending.done():  # see handoff.receive_handoff
            transport.background.abandon()
        transport.discard(f"{tag}/")
    return outcome(transport, tag, timeout, t0, prefix, suffix, logits, sent_first,
                   (t_boundary, t_prefix, t_start, t_suffix), fell_back)
