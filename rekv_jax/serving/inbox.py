"""Where a serving worker takes its requests from without blocking: a group member's inbox
(`MemberInbox`: a spawned worker, from the router) or a `LocalInbox` (one process: a driver
thread hands the requests)."""

from __future__ import annotations

import queue
from typing import Protocol

from rekv_jax.launch.child import CLOSED, Member


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


class MemberInbox:
    """`Requests` a group's router hands this member (`Member.receive`), until the group closes."""

    def __init__(self, member: Member) -> None:
        self._member = member
        self.ended = False

    def take(self, timeout: float | None = 0.0) -> list[object]:
        if self.ended:
            return []
        out = self._member.receive(timeout)
        if out and out[-1] is CLOSED:
            self.ended, out = True, out[:-1]
        return out
