"""What one handoff produces and how both sides close it: the `Handoff` record and its
timeline, the prefill side's closing message and the decode side's join (`outcome`)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from rekv_jax.kv import KVCache
from rekv_jax.transport import Transport, checksums

# events of a handoff's timeline: the boundary arrived, the prefix arrived and was restored, the
# suffix started and ended, the cache and first token were ready
TIMELINE = ("boundary", "prefix", "suffix_start", "suffix_end", "end")


@dataclasses.dataclass(frozen=True)
class Handoff:
    """The decode side's outcome: the complete cache, the first token, and the phase times."""

    kv: KVCache  # [L, B, S, K, H]
    first_token: jax.Array  # [B]
    total_ms: float
    phases_ms: dict[str, float]  # keyed by costmodel.PROMPT_PHASES
    # when each event happened, ms after the interval's start (TIMELINE): shows whether the
    # suffix ran while the prefix was still in flight
    timeline_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    sent_bytes: int = 0  # what the prefill side's transport put on the wire for this handoff
    fallback: bool = False  # True if the prefix transfer failed and the cache was recomputed
    # whether the recomputed suffix KV's checksums equal those of the prefill process's own
    # suffix (PrefillState.suffix_sums); None: not compared (nothing sent, or a fallback)
    suffix_match: bool | None = None


def elapsed_ms(start: float, stop: float) -> float:
    return 1e3 * (stop - start)


def finish_send(transport: Transport, tag: str, phases: list[str], timeout: float,
                 **sent: float | list[int]) -> None:
    """Post the prefill side's times and bytes sent, then wait for every phase's ack (the decode
    side's errors surface here)."""
    transport.send_meta(f"{tag}/prefill", sent)
    for phase in phases:
        transport.wait_ack(f"{tag}/{phase}", timeout)


def outcome(transport: Transport, tag: str, timeout: float, t0: float, prefix: KVCache | None,
            suffix: KVCache | None, logits: jax.Array | None, sent_first: jax.Array | None,
            times: tuple[float, float, float, float], fell_back: bool) -> Handoff:
    """Join the prefix and the suffix, pick the first token, collect the prefill side's times
    and turn the decode side's (the boundary and the prefix arrived, the suffix started and
    ended: perf_counter) into the Handoff."""
    t_boundary, t_prefix, t_start, t_suffix = times
    kv = suffix if prefix is None else prefix if suffix is None else KVCache.concat(prefix, suffix)
    first = sent_first if logits is None else jnp.argmax(logits, axis=-1).astype(jnp.int32)
    kv, first = jax.block_until_ready((kv, first))
    t_end = time.perf_counter()

    sent = transport.recv_meta(f"{tag}/prefill", timeout)
    suffix_match = None  # compared after the interval: a device-to-host sync
    if "suffix_sums" in sent and suffix is not None and not fell_back:
        suffix_match = checksums([suffix.k, suffix.v]) == sent["suffix_sums"]
    phases = {
        "prefill": sent["prefill_ms"],
        "quantize": sent["quantize_ms"],
        # the link time of the boundary: from when the prefill side sent it to its arrival
        "boundary": max(elapsed_ms(t0, t_boundary) - sent["boundary_at_ms"], 0.0),
        # what the prefix adds after the boundary (a streamed prefix is mostly there before)
        "prefix": max(elapsed_ms(t_boundary, t_prefix), 0.0),
        "suffix": elapsed_ms(t_start, t_suffix),
        "join": elapsed_ms(max(t_prefix, t_suffix), t_end),
    }
    events = (t_boundary, t_prefix, t_start, t_suffix, t_end)
    timeline = dict(zip(TIMELINE, (elapsed_ms(t0, t) for t in events), strict=True))
    return Handoff(kv, first, elapsed_ms(t0, t_end), phases, timeline, sent["sent_bytes"],
                   fell_back, suffix_match)
