"""What one handoff produces and how both sides close it: the `Handoff` record and its
timeline, the prefill side's closing message and the decode side's join (`outcome`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from rekv_jax.kv import KVCache
from rekv_jax.phases import TIMELINE, Phases, Timeline
from rekv_jax.transport import Transport, checksums

__all__ = ["TIMELINE", "Handoff", "PrefillTimes", "elapsed_ms", "finish_send", "outcome"]


@dataclasses.dataclass(frozen=True)
class Handoff:
    """The decode side's outcome: the complete cache, the first token, and the phase times."""

    kv: KVCache  # [L, B, S, K, H]
    first_token: jax.Array  # [B]
    total_ms: float
    phases_ms: Phases
    timeline_ms: Timeline | None = None  # None: not timed (a reference cache)
    sent_bytes: int = 0  # what the prefill side's transport put on the wire for this handoff
    fallback: bool = False  # True if the prefix transfer failed and the cache was recomputed
    # whether the recomputed suffix KV's checksums equal those of the prefill process's own
    # suffix (PrefillState.suffix_sums); None: not compared (nothing sent, or a fallback)
    suffix_match: bool | None = None


def elapsed_ms(start: float, stop: float) -> float:
    return 1e3 * (stop - start)


@dataclasses.dataclass(frozen=True)
class PrefillTimes:
    """What the prefill side tells the decode side after sending (its `TAG/prefill` message)."""

    prefill_ms: float  # its own compute of the prompt (0: timed from the ready state)
    quantize_ms: float  # Q
    boundary_at_ms: float  # when it sent the boundary, ms after the interval's start
    sent_bytes: int  # what its transport put on the wire for this handoff
    # checksums of its own suffix KV (PrefillState.suffix_sums); empty: not computed
    suffix_sums: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        sums = d.pop("suffix_sums")
        return d | ({"suffix_sums": list(sums)} if sums else {})

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrefillTimes:
        return cls(d["prefill_ms"], d["quantize_ms"], d["boundary_at_ms"], d["sent_bytes"],
                   tuple(d.get("suffix_sums", ())))


def finish_send(transport: Transport, tag: str, phases: list[str], timeout: float,
                sent: PrefillTimes) -> None:
    """Post the prefill side's times and bytes sent, then wait for every phase's ack (the decode
    side's errors surface here)."""
    transport.send_meta(f"{tag}/prefill", sent.to_json())
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
    transport.release_acks()  # held since the handoff began (`Transport.hold_acks`)

    sent = PrefillTimes.from_json(transport.recv_meta(f"{tag}/prefill", timeout))
    suffix_match = None  # compared after the interval: a device-to-host sync
    if sent.suffix_sums and suffix is not None and not fell_back:
        suffix_match = tuple(checksums([suffix.k, suffix.v])) == sent.suffix_sums
    phases = Phases(
        prefill=sent.prefill_ms,
        quantize=sent.quantize_ms,
        # the link time of the boundary: from when the prefill side sent it to its arrival
        boundary=max(elapsed_ms(t0, t_boundary) - sent.boundary_at_ms, 0.0),
        # what the prefix adds after the boundary (a streamed prefix is mostly there before)
        prefix=max(elapsed_ms(t_boundary, t_prefix), 0.0),
        suffix=elapsed_ms(t_start, t_suffix),
        join=elapsed_ms(max(t_prefix, t_suffix), t_end),
    )
    timeline = Timeline(*(elapsed_ms(t0, t) for t in (t_boundary, t_prefix, t_start, t_suffix,
                                                      t_end)))
    return Handoff(kv, first, elapsed_ms(t0, t_end), phases, timeline, sent.sent_bytes,
                   fell_back, suffix_match)
