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
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.model import Params, prefill, run_prefix, run_suffix
from rekv_jax.quantize import QuantizedTensor, dequantize, quantize, quantize_unchecked
from rekv_jax.sizes import GROUP_SIZE
from rekv_jax.transport import Transport, TransportError

SCHEDULES = ("overlapped", "sequential")
FALLBACKS = ("error", "recompute")


@dataclasses.dataclass(frozen=True)
class PrefillState:
    """What the prefill worker holds when its prefill is done (before the timed interval)."""

    tokens: jax.Array  # [B, S] int32
    h_c: jax.Array | None  # [B, S, D] boundary (joint actions)
    prefix: KVCache | None  # [c, B, S, K, H] (joint and transfer-only)
    first_token: jax.Array  # [B] from the prefill's own logits (sent with transfer-only)


@dataclasses.dataclass(frozen=True)
class Handoff:
    """The decode side's outcome: the complete cache, the first token, and the phase times."""

    kv: KVCache  # [L, B, S, K, H]
    first_token: jax.Array  # [B]
    total_ms: float
    phases_ms: dict[str, float]
    fallback: bool = False  # True if the prefix transfer failed and the cache was recomputed


def prepare(cfg: ModelConfig, params: Params, tokens: jax.Array, action: Action) -> PrefillState:
    """Run the prefill worker's prompt processing for `action` (untimed, as in the paper)."""
    if action.kind == "recompute":
        _, logits = prefill(cfg, params, tokens)
        return PrefillState(tokens, None, None, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    h_c, prefix = run_prefix(cfg, params, tokens, action.cut)
    _, logits = run_suffix(cfg, params, h_c, action.cut)  # the rest of the prompt's layers
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return PrefillState(tokens, h_c if action.kind == "joint" else None, prefix, first)


# ---------------------------------------------------------------------------- prefix payload


def encode_prefix(prefix: KVCache, bits: int, backend: str | None = None) -> list[jax.Array]:
    """The prefix as a few contiguous buffers: [K, V] in BF16, or [K codes, K scales, V codes,
    V scales] for Q8/Q4 (codes [c, B, S, K, H*b/8], scales [c, B, S, K, H/64] float16)."""
    if bits == 16:
        return [prefix.k, prefix.v]
    qk, qv = quantize(prefix.k, bits, backend=backend), quantize(prefix.v, bits, backend=backend)
    return [qk.values, qk.scales, qv.values, qv.scales]


def decode_prefix(buffers: list[jax.Array], bits: int, dtype: jnp.dtype,
                  backend: str | None = None) -> KVCache:
    """Inverse of `encode_prefix`: the restored prefix KV [c, B, S, K, H] in `dtype`."""
    if bits == 16:
        return KVCache(*buffers)
    kc, ks, vc, vs = buffers
    return KVCache(dequantize(QuantizedTensor(kc, ks, bits, GROUP_SIZE, dtype), backend=backend),
                   dequantize(QuantizedTensor(vc, vs, bits, GROUP_SIZE, dtype), backend=backend))


def prefix_specs(cfg: ModelConfig, action: Action, batch: int, seq_len: int, dtype: jnp.dtype
                 ) -> list[jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the prefix buffers the decode side must receive."""
    kv = jax.ShapeDtypeStruct(
        (action.cut, batch, seq_len, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(dtype))
    if action.bits == 16:
        return [kv, kv]
    q = jax.eval_shape(lambda x: quantize_unchecked(x, action.bits, backend="xla"), kv)
    return [q.values, q.scales] * 2


# ---------------------------------------------------------------------------- the two sides


def _ms(start: float, stop: float) -> float:
    return 1e3 * (stop - start)


def send_handoff(transport: Transport, state: PrefillState, action: Action, tag: str,
                 backend: str | None = None, timeout: float = 60.0) -> None:
    """Prefill side of one handoff; posts its quantization time to the decode side."""
    transport.agree(f"{tag}/go", {}, timeout)  # both sides start their clocks here
    t0 = time.perf_counter()
    payload = []
    if state.prefix is not None:
        payload = jax.block_until_ready(encode_prefix(state.prefix, action.bits, backend))
    quantize_ms = _ms(t0, time.perf_counter()) if action.bits != 16 else 0.0
    boundary = [state.tokens, state.first_token] + ([state.h_c] if state.h_c is not None else [])
    transport.send(f"{tag}/boundary", boundary, timeout)  # one message: ids (+ h_c) first
    if payload:
        transport.send(f"{tag}/prefix", payload, timeout)
    transport.send_meta(f"{tag}/prefill", {"quantize_ms": quantize_ms})
    for phase in ["boundary"] + ["prefix"] * bool(payload):  # the decode side's errors surface here
        transport.wait_ack(f"{tag}/{phase}", timeout)


def receive_handoff(transport: Transport, cfg: ModelConfig, params: Params, action: Action,
                    batch: int, seq_len: int, tag: str, schedule: str = "overlapped",
                    fallback: str = "error", backend: str | None = None,
                    timeout: float = 60.0) -> Handoff:
    """Decode side of one handoff: receive, recompute, restore, join; time every phase."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    dtype = params["embed"].dtype
    specs = [jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),  # token ids
             jax.ShapeDtypeStruct((batch,), jnp.int32)]  # the prefill side's first token
    if action.kind == "joint":
        specs.append(jax.ShapeDtypeStruct((batch, seq_len, cfg.hidden_size), dtype))  # h_c
    transport.agree(f"{tag}/go", {}, timeout)
    t0 = time.perf_counter()
    tokens, sent_first, *h_c = transport.recv(f"{tag}/boundary", specs, timeout)
    h_c = h_c[0] if h_c else None
    t_boundary = time.perf_counter()

    def restore_prefix() -> tuple[KVCache, float]:
        specs = prefix_specs(cfg, action, batch, seq_len, dtype)
        buffers = transport.recv(f"{tag}/prefix", specs, timeout)
        prefix = jax.block_until_ready(decode_prefix(buffers, action.bits, dtype, backend))
        return prefix, time.perf_counter()

    def run_suffix_now(kind: str) -> tuple[KVCache, jax.Array, float, float]:
        start = time.perf_counter()
        if kind == "recompute":
            kv, logits = prefill(cfg, params, tokens)
        else:
            kv, logits = run_suffix(cfg, params, h_c, action.cut)
        return *jax.block_until_ready((kv, logits)), start, time.perf_counter()

    prefix = suffix = logits = None
    t_prefix = t_boundary
    fell_back = False
    try:
        if action.kind == "recompute":
            suffix, logits, t_start, t_suffix = run_suffix_now("recompute")
        elif action.kind == "transfer":
            prefix, t_prefix = restore_prefix()
            t_start = t_suffix = t_prefix
        elif schedule == "sequential":
            prefix, t_prefix = restore_prefix()
            suffix, logits, t_start, t_suffix = run_suffix_now("suffix")
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="rekv-prefix") as pool:
                pending = pool.submit(restore_prefix)  # transfer + dequantize ...
                suffix, logits, t_start, t_suffix = run_suffix_now("suffix")  # ... meanwhile
                prefix, t_prefix = pending.result()
    except TransportError:
        if fallback != "recompute" or action.kind == "recompute":
            raise
        fell_back, prefix, t_prefix = True, None, t_boundary
        suffix, logits, t_start, t_suffix = run_suffix_now("recompute")

    kv = suffix if prefix is None else prefix if suffix is None else KVCache.concat(prefix, suffix)
    first = sent_first if logits is None else jnp.argmax(logits, axis=-1).astype(jnp.int32)
    kv, first = jax.block_until_ready((kv, first))
    t_end = time.perf_counter()

    quantize_ms = transport.recv_meta(f"{tag}/prefill", timeout)["quantize_ms"]
    phases = {
        "quantize": quantize_ms,
        # the prefill side quantized before sending h_c, so that wait is not link time
        "boundary": max(_ms(t0, t_boundary) - quantize_ms, 0.0),
        "prefix": _ms(t_boundary, t_prefix),
        "suffix": _ms(t_start, t_suffix),
        "join": _ms(max(t_prefix, t_suffix), t_end),
    }
    return Handoff(kv, first, _ms(t0, t_end), phases, fell_back)


def check_cache(reference: KVCache, action: Action, result: Handoff,
                backend: str | None = None) -> str:
    """What held of the handoff's cache against a single-process `prefill` cache.

    BF16 prefixes and every recomputed suffix must be bitwise equal to the prefill's; a Q8/Q4
    prefix must equal the prefill's prefix after one quantize/dequantize round trip, bitwise.
    """
    c, L = (0 if result.fallback else action.cut), reference.num_layers
    want_prefix = reference.layers(0, c)
    if c and action.bits != 16:
        want_prefix = decode_prefix(encode_prefix(want_prefix, action.bits, backend),
                                    action.bits, reference.k.dtype, backend)
    parts = [("prefix", result.kv.layers(0, c), want_prefix),
             ("suffix", result.kv.layers(c, L), reference.layers(c, L))]
    failed = [name for name, got, want in parts
              if not (np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v))]
    if failed:
        return f"MISMATCH in {' and '.join(failed)}"
    if c == 0 or action.bits == 16:
        return "bitwise"
    return f"suffix bitwise, prefix = {action.precision} round trip"
