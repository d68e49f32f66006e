"""A paced link: any transport, its messages delivered no sooner than a FIFO link of a given
bandwidth would deliver them, on both sides: the decode side's receives complete, and the prefill
side's verdicts come, after the paced delivery. It emulates the paper's link on a machine whose
real one (loopback, or a fast interconnect) is far faster than the regime being studied."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax

from rekv_jax.errors import TransportTimeout
from rekv_jax.transport.base import Arrival, Transport, Wrapper, link_bytes
from rekv_jax.transport.workers import Worker


class Paced(Wrapper):
    """`transport` as a FIFO link of `gbps` GB/s, seen the same from both ends; n_i is message
    i's `link_bytes` (what the decode side's `Arrival.nbytes` counts: no checksums).

    Decode side: message i, whose bytes landed at t_i, completes at
    d_i = max(t_i, d_{i-1}) + n_i / gbps (and never before the transport verified it), paced in
    the order it is received (`recv`), which is the order it was sent.
    Prefill side: message i, sent (`send`) at s_i, is delivered at
    e_i = max(s_i, e_{i-1}) + n_i / gbps, and `wait_ack` reports its "ok" verdict no sooner
    than e_i (nor before the transport's verdict came); a failed message's error is raised as
    it comes. Since s_i <= t_i, e_i <= d_i: the sender never hears of a message before the
    paced link could have delivered it, and never much after the receiver had it.
    Everything else is the transport's own."""

    def __init__(self, transport: Transport, gbps: float) -> None:
        if not gbps > 0:
            raise ValueError(f"link bandwidth must be positive GB/s, got {gbps}")
        super().__init__(transport)
        self.gbps = gbps
        # when the link delivers its last message (time.monotonic): d_i on the decode side,
        # e_i on the prefill side
        self._free_at = 0.0
        self._pacer = Worker(f"rekv-{transport.role}-pacer")
        self._due: dict[str, float] = {}  # prefill side: e_i of each message not yet acked
        # prefill side: acked by the transport (when), not yet due
        self._verified: dict[str, float] = {}

    def send(self, tag: str, arrays: Sequence[jax.Array], timeout: float = 60.0) -> None:
        arrays = list(arrays)
        self._transport.send(tag, arrays, timeout)
        start = max(time.monotonic(), self._free_at)
        self._free_at = start + link_bytes(arrays) / (self.gbps * 1e9)
        self._due[tag] = self._free_at

    def wait_ack(self, tag: str, timeout: float = 60.0) -> float:
        """The transport's verdict on `tag` (`Transport.wait_ack`), an "ok" no sooner than the
        paced link delivers the message (and that is when it came); TransportTimeout if that is
        not within `timeout`."""
        deadline = time.monotonic() + timeout
        if tag not in self._verified:
            try:
                came = self._transport.wait_ack(tag, timeout)
            except BaseException as e:
                if not isinstance(e, TransportTimeout):  # failed: nothing of it is paced now
                    self._due.pop(tag, None)
                raise
            self._verified[tag] = came
        due = self._due.get(tag, 0.0)
        if due > deadline:
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise TransportTimeout(f"{tag}: the paced link delivers it {due - deadline:.3f}s "
                                   f"after the {timeout:g}s wait")
        time.sleep(max(0.0, due - time.monotonic()))
        self._due.pop(tag, None)
        return max(due, self._verified.pop(tag))

    def forget(self, tag: str) -> None:
        self._due.pop(tag, None)
        self._verified.pop(tag, None)
        self._transport.forget(tag)

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
