"""In-process transport: both ends in one process, for unit tests and `--transport local`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from rekv_jax.errors import TransportError
from rekv_jax.transport.base import Arrival, Endpoint, Role, Transport, spec_of
from rekv_jax.transport.control import Board
from rekv_jax.transport.paced import paced
from rekv_jax.transport.workers import Worker

T = TypeVar("T")


class LocalTransport(Endpoint):
    """Buffers are handed over by reference; the protocol (headers, checksums, acks) is the same
    as for the two-process transports."""

    kind = "local"

    def __init__(self, role: Role, board: Board) -> None:
        super().__init__(role, board)
        self._worker = Worker(f"rekv-{role}-receive") if role == "decode" else None

    @classmethod
    def pair(cls, link_gbps: float | None = None) -> tuple[Transport, Transport]:
        """The (prefill, decode) ends of one in-process link, both paced to `link_gbps` (None:
        unpaced; `paced.Paced`)."""
        board = Board()
        return paced(cls("prefill", board), link_gbps), paced(cls("decode", board), link_gbps)

    @classmethod
    def run_pair(cls, prefill: Callable[[Transport], Any], decode: Callable[[Transport], T],
                 link_gbps: float | None, timeout: float) -> T:
        """`prefill(end)` on a thread and `decode(end)` here, over one in-process link; returns
        what `decode` returns. The decode side's error wins; the prefill side's is raised after
        the decode side stops (the thread is given `timeout` s to end)."""
        prefill_end, decode_end = cls.pair(link_gbps)
        errors: list[BaseException] = []

        def prefill_side() -> None:
            try:
                prefill(prefill_end)
            except BaseException as e:  # surfaced below, after the decode side stops
                errors.append(e)

        thread = threading.Thread(target=prefill_side, name="rekv-prefill", daemon=True)
        thread.start()
        try:
            out = decode(decode_end)
        finally:
            thread.join(timeout)
            prefill_end.close(), decode_end.close()
        if errors:
            raise errors[0]
        return out

    def _send(self, tag: str, buffers: list[jax.Array], header: str, deadline: float) -> None:
        self._channel.put(f"{tag}/payload", buffers)
        self._channel.post(f"{tag}/header", header)

    def _receive(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct],
                 wire: list[jax.ShapeDtypeStruct]) -> None:
        self._worker.submit(self._take, arrival, specs)

    def _take(self, arrival: Arrival, specs: list[jax.ShapeDtypeStruct]) -> None:
        try:
            if not self._check_header(arrival, [spec_of(s) for s in specs]):
                return
            *arrays, sums = self._get(arrival, f"{arrival.tag}/payload")
            arrival.landed = time.monotonic()
            if not self._verify(arrival, arrays, sums, specs):  # the header matched
                self._settle(arrival, error=TransportError(
                    f"{arrival.tag}: the checksums' spec word is corrupted"))
        except TransportError as e:
            self._settle(arrival, error=e)

    def _acked(self, tag: str) -> None:
        self._channel.release(f"{tag}/payload")  # taken and verified: the board lets go of it

    def _close(self, timeout: float) -> None:
        if self._worker is not None:
            self._worker.close()
