"""Where a serving worker takes its requests from without blocking: the launcher's
`launch.child.Inbox` (a spawned side, from the parent) or a `LocalInbox` (one process: a driver
thread hands the requests)."""

from __future__ import annotations

import queue
from typing import Protocol


class Requests(Protocol):
    """Requests taken without blocking (`take`), until `ended`."""

    ended: bool

    def take(self, timeout: float | None = 0.0) -> list[object]:
        """The requests that came within `timeout` s (None: until one comes or they end),
        then those already there."""
        ...


class LocalInbox:
    """`Requests` handed by another thread of this process (`put`, then `close`)."""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()
        self.ended = False

    def put(self, request: object) -> None:
        self._queue.put(request)

    def close(self) -> None:
        """No more requests: `ended` once those before are taken."""
        self._queue.put(self._END)

    def take(self, timeout: float | None = 0.0) -> list[object]:
        out: list[object] = []
        while not self.ended:
            try:
                request = self._queue.get(block=not out and timeout != 0, timeout=timeout)
            except queue.Empty:
                break
            if request is self._END:
                self.ended = True
            else:
                out.append(request)
        return out
