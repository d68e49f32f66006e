"""What one handoff produces: the decode side's `Handoff` record, the prefill side's times on the
wire (`PrefillTimes`), and the `Clock` of named events both are derived from."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax

from rekv_jax.kv import KVCache
from rekv_jax.phases import TIMELINE, Phases, Timeline


def elapsed_ms(start: float, stop: float) -> float:
    return 1e3 * (stop - start)


class Event:
    """The decode side's events of a handoff (`Clock`), in the order they usually happen."""

    BOUNDARY = "boundary"  # the input the decode side computes from arrived (h_c, or the ids)
    SUFFIX_START = "suffix_start"  # the suffix (or the recomputation) was dispatched
    PREFIX = "prefix"  # the whole prefix arrived and was restored
    SUFFIX_END = "suffix_end"  # the suffix's last program finished
    END = "end"  # the complete cache and the first token are ready


class Clock:
    """When each named event of one handoff happened (time.perf_counter), the first time it is
    noted; events are noted from whichever thread sees them."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._at: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, event: str, at: float | None = None) -> float:
        """Note `event` now (or at `at`), unless it was noted before; when it happened."""
        with self._lock:
            return self._at.setdefault(event, time.perf_counter() if at is None else at)

    def set(self, event: str, at: float | None = None) -> float:
        """Note `event` now (or at `at`), over any earlier note (a fallback starts it again)."""
        with self._lock:
            self._at[event] = time.perf_counter() if at is None else at
            return self._at[event]

    def forget(self, event: str) -> None:
        with self._lock:
            self._at.pop(event, None)

    def at(self, event: str) -> float | None:
        return self._at.get(event)


@dataclasses.dataclass(frozen=True)
class PrefillTimes:
    """What the prefill side tells the decode side after sending (its `TAG/prefill` message)."""

    prefill_ms: float  # its own compute of the prompt (0: timed from the ready state)
    quantize_ms: float  # Q
    boundary_at_ms: float  # when it sent the boundary, ms after the interval's start
    sent_bytes: int  # what its transport put on the wire for this handoff
    # checksums of its own suffix KV (sender.PrefillState.suffix_sums); empty: not computed
    suffix_sums: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        sums = d.pop("suffix_sums")
        return d | ({"suffix_sums": list(sums)} if sums else {})

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrefillTimes:
        return cls(d["prefill_ms"], d["quantize_ms"], d["boundary_at_ms"], d["sent_bytes"],
                   tuple(d.get("suffix_sums", ())))


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


def phases_of(clock: Clock, sent: PrefillTimes) -> tuple[Phases, Timeline, float]:
    """The phases, the timeline and the total (ms) of a handoff from its clock's events and the
    prefill side's times: a phase that did not happen lasts 0 (no prefix: it ends with the
    boundary; no suffix: it starts and ends with the prefix)."""
    t0 = clock.start
    boundary = clock.at(Event.BOUNDARY) or t0
    prefix = clock.at(Event.PREFIX) or boundary
    start = clock.at(Event.SUFFIX_START) or prefix
    end = clock.at(Event.END)
    suffix = clock.at(Event.SUFFIX_END) or start
    phases = Phases(
        prefill=sent.prefill_ms,
        quantize=sent.quantize_ms,
        # the link time of the boundary: from when the prefill side sent it to its arrival
        boundary=max(elapsed_ms(t0, boundary) - sent.boundary_at_ms, 0.0),
        # what the prefix adds after the boundary (a streamed prefix is mostly there before)
        prefix=max(elapsed_ms(boundary, prefix), 0.0),
        suffix=elapsed_ms(start, suffix),
        join=elapsed_ms(max(prefix, suffix), end),
    )
    times = dict(zip(TIMELINE, (boundary, prefix, start, suffix, end), strict=True))
    timeline = Timeline(**{e: elapsed_ms(t0, t) for e, t in times.items()})
    return phases, timeline, elapsed_ms(t0, end)
