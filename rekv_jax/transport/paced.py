"""A paced link: any transport's receives, delivered no sooner than a FIFO link of a given
bandwidth would deliver them. It emulates the paper's link on a machine whose real one (loopback,
or a fast interconnect) is far faster than the regime being studied."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax

from rekv_jax.transport.base import Arrival, Transport, Wrapper
from rekv_jax.transport.workers import Worker


class Paced(Wrapper):
    """`transport` whose receives complete as over a FIFO link of `gbps` GB/s: message i, whose
    bytes landed at t_i, completes at d_i = max(t_i, d_{i-1}) + n_i / gbps (and never before the
    transport verified it). Messages are paced in the order they are received (`recv`), which is
    the order they were sent. Everything but `recv` is the transport's own."""

    def __init__(self, transport: Transport, gbps: float) -> None:
        if not gbps > 0:
            raise ValueError(f"link bandwidth must be positive GB/s, got {gbps}")
        super().__init__(transport)
        self.gbps = gbps
        self._free_at = 0.0  # when the link delivered its last message (time.monotonic)
        self._pacer = Worker(f"rekv-{transport.role}-pacer")

    def recv(self, tag: str, specs: Sequence[jax.ShapeDtypeStruct], timeout: float = 60.0
             ) -> Arrival:
        inner = self._transport.recv(tag, specs, timeout)
        arrival = Arrival(tag, inner.nbytes, inner.deadline)
        self._pacer.submit(self._deliver, inner, arrival)
        return arrival

    def _deliver(self, inner: Arrival, arrival: Arrival) -> None:
        """On the pacer's thread, in receive order: wait for the transport's verdict, then for
        the link."""
        while not inner.done():  # the transport settles it by its deadline
            if arrival.abandoned.is_set():
                inner.abandon()
            try:
                inner.exception(timeout=0.5)
            except TimeoutError:
                pass
        error = inner.exception()
        if error is not None:
            arrival.set_exception(error)
            return
        start = inner.landed or time.monotonic()
        self._free_at = max(start, self._free_at) + inner.nbytes / (self.gbps * 1e9)
        time.sleep(max(0.0, self._free_at - time.monotonic()))
        arrival.landed = inner.landed
        arrival.set_result(inner.result())

    def stop(self) -> None:
        """Stop pacing (its thread ends once the messages it holds are delivered); the transport
        stays open, for another link over it."""
        self._pacer.close()

    def close(self, timeout: float = 10.0) -> None:
        self.stop()
        self._transport.close(timeout)


def paced(transport: Transport, gbps: float | None) -> Transport:
    """`transport` paced to `gbps` GB/s; itself where `gbps` is None (unpaced)."""
    return transport if gbps is None else Paced(transport, gbps)
