"""Device work a reception dispatches, seen from the host: when it completes (`Watcher`, whose
threads one reception owns and ends) and how much of it may be dispatched at once
(`WorkBudget`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import time

import jax

from rekv_jax.transport.workers import Worker

JOIN_S = 1.0  # bounds the join of a finished reception's idle threads, which end at once


class Lane(enum.StrEnum):
    """A kind of device work: its completions come in dispatch order, so one thread watches it."""

    PREFIX = "prefix"  # the prefix's restores
    SUFFIX = "suffix"  # the suffix (or the recomputation) and its head
    JOIN = "join"  # the complete cache and the first token


class Watcher:
    """Notes the moment dispatched device work completes, on one host thread per lane. Made
    before a handoff's interval starts (no thread starts inside it); `close` ends the threads
    once what they watch has completed."""

    def __init__(self, name: str) -> None:
        self._lanes = {lane: Worker(f"{name}-watch-{lane}") for lane in Lane}

    def watch(self, lane: Lane, arrays: object) -> concurrent.futures.Future[float]:
        """A future of when `arrays` were computed (time.perf_counter): at once if they are
        already (no hop to another thread), else taken on `lane`'s thread the moment they are;
        a failed computation's error is the future's."""
        if all(x.is_ready() for x in jax.tree.leaves(arrays)):
            out: concurrent.futures.Future[float] = concurrent.futures.Future()
            try:
                jax.block_until_ready(arrays)  # raises the error of a failed computation
                out.set_result(time.perf_counter())
            except Exception as e:  # handed to whoever waits on the future
                out.set_exception(e)
            return out
        return self._lanes[lane].submit(_completed, arrays)

    def close(self, finished: bool = False) -> None:
        """End the threads. `finished`: everything watched has completed, so they end at once and
        are joined (a finished reception leaves no thread behind); else each ends after what it
        watches."""
        for worker in self._lanes.values():
            worker.close(wait_s=JOIN_S if finished else 0.0)


def _completed(arrays: object) -> float:
    jax.block_until_ready(arrays)
    return time.perf_counter()


def last_of(futures: list[concurrent.futures.Future[float]]) -> concurrent.futures.Future[float]:
    """A future of the latest time `futures` (of `Watcher.watch`) give, once they all completed
    (the first error, if one failed)."""
    out: concurrent.futures.Future[float] = concurrent.futures.Future()

    def done(_: concurrent.futures.Future) -> None:
        if not all(f.done() for f in futures):
            return
        errors = [f.exception() for f in futures if f.exception() is not None]
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # the last two raced
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(max(f.result() for f in futures))

    for f in futures:
        f.add_done_callback(done)
    return out


class WorkBudget:
    """How much suffix compute receptions may dispatch now, in token-layers (one layer program
    over T tokens costs T); None: no limit. The first unit taken always goes, so a unit larger
    than the budget still runs, one per budget."""

    def __init__(self, token_layers: int | None = None) -> None:
        self.left, self.spent = token_layers, 0

    def take(self, cost: int) -> bool:
        """Whether a unit of `cost` may be dispatched now (then it is spent)."""
        if self.left is not None and self.spent and cost > self.left:
            return False
        self.spent += cost
        if self.left is not None:
            self.left -= cost
        return True
