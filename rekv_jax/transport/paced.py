"""A paced link: any transport's receives, delivered no sooner than a FIFO link of a given
bandwidth would deliver them. It emulates the paper's link on a machine whose real one (loopback,
or a fast interconnect) is far faster than the regime being studied."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

from rekv_jax.transport.base import Arrival, Transport
from rekv_jax.transport.workers import Worker


class Paced:
    """`transport` whose receives complete as over a FIFO link of `gbps` GB/s: message i, whose
    bytes landed at t_i, completes at d_i = max(t_i, d_{i-1}) + n_i / gbps (and never before the
    transport verified it). Messages are paced in the order they are received (`recv`), which is
    the order they were sent. Everything but `recv` is the transport's own."""

    def __init__(self, transport: Transport, gbps: float) -> None:
        if not gbps > 0:
            raise ValueError(f"link bandwidth must be positive GB/s, got {gbps}")
        self._transport = transport
        self.gbps = gbps
        self.role, self.peer, self.kind = transport.role, transport.peer, transport.kind
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

    @property
    def sent_bytes(self) -> int:
        return self._transport.sent_bytes

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        self._transport.send(tag, arrays, timeout)

    def wait_ack(self, tag: str, timeout: float = 60.0) -> None:
        self._transport.wait_ack(tag, timeout)

    def send_meta(self, tag: str, meta: dict[str, Any]) -> None:
        self._transport.send_meta(tag, meta)

    def recv_meta(self, tag: str, timeout: float = 60.0) -> dict[str, Any]:
        return self._transport.recv_meta(tag, timeout)

    def agree(self, tag: str, meta: dict[str, Any], timeout: float = 60.0) -> None:
        self._transport.agree(tag, meta, timeout)

    def peer_alive(self) -> bool:
        return self._transport.peer_alive()

    def stop(self) -> None:
        """Stop pacing (its thread ends once the messages it holds are delivered); the transport
        stays open, for another link over it."""
        self._pacer.close()

    def close(self, timeout: float = 10.0) -> None:
        self.stop()
        self._transport.close(timeout)

    def __enter__(self) -> Paced:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def paced(transport: Transport, gbps: float | None) -> Transport:
    """`transport` paced to `gbps` GB/s; itself where `gbps` is None (unpaced)."""
    return transport if gbps is None else Paced(transport, gbps)
