"""In-process transport: both ends in one process, for unit tests and `--transport local`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from rekv_jax.transport.base import Transport
from rekv_jax.transport.control import Board

T = TypeVar("T")


class LocalTransport(Transport):
    """Buffers are handed over by reference; the protocol (headers, checksums, acks, pacing) is the
    same as for the two-process transports."""

    kind = "local"

    @classmethod
    def pair(cls, link_gbps: float | None = None) -> tuple[LocalTransport, LocalTransport]:
        """The (prefill, decode) ends of one in-process link."""
        board = Board()
        return cls("prefill", board, link_gbps), cls("decode", board, link_gbps)

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

    def _push(self, tag: str, arrays: list[jax.Array], deadline: float) -> None:
        self._channel.put(f"{tag}/payload", self._with_checksums(tag, arrays))

    def _pull(self, tag: str, specs: list[jax.ShapeDtypeStruct], deadline: float
              ) -> list[jax.Array]:
        return self._channel.get(f"{tag}/payload", max(0.0, deadline - time.monotonic()))
