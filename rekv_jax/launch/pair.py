"""The launcher: a job function run by both sides of a pair (`Pair`, `run_pair`) or by one fresh
process (`run_child`), each side spawned in its own environment, its arguments and results
Python objects.

A pair's job is called in each side's process as `job(side, *args)` (`child.Side`: its role,
the coordinator, the job's key, `emit` and `requests`). What the sides emit reaches the parent as
it comes (`on_item`); the parent hands a side further requests while it runs (`Pair.ask`, the
answering side, i.e. the decode side or the only one, unless a role is named: a sweep decides
its next experiment from the last one's records; a serving run hands each side its requests and
`pump`s their tokens meanwhile). The parent does no JAX work: every side computes in a process
of its own.

Supervision: a side that dies natively (a signal, JAX aborting it once its coordinator went
away) ends the pair with one line naming the side and how it ended; once one side has ended the
other gets `grace` seconds, then is killed; every wait is bounded and no process outlives the
launcher (each dies with its parent, and is killed on the way out)."""

from __future__ import annotations

import collections
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Generic, TypeVar

from rekv_jax.launch import child
from rekv_jax.launch.processes import Child, Ended
from rekv_jax.transport.base import Role
from rekv_jax.transport.secret import JobKey

T = TypeVar("T")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback() -> str:
    """A coordinator address for a pair on this machine (loopback only)."""
    return f"127.0.0.1:{free_port()}"


class Pair(Generic[T]):
    """The sides of `job` named in `envs` (both on one machine; this process's side on a
    multi-host allocation), each spawned in its environment and running `job(side, *args)`.

    `key` reaches each side as a spawn argument (never the environment, the command line or a
    file). `coordinator`: process 0's host:port (None: JAX detects the cluster)."""

    def __init__(self, job: Callable[..., T], args: tuple, envs: Mapping[Role, Mapping[str, str]],
                 *, key: JobKey | None, coordinator: str | None = None, grace: float = 60.0,
                 on_item: Callable[[Any], None] | None = None) -> None:
        self._logs = tempfile.TemporaryDirectory(prefix="rekv-pair-")
        self._grace = grace
        self._items: list[Any] = []
        self._on_item = on_item or self._items.append
        self._answering: Role = "decode" if "decode" in envs else next(iter(envs))
        self._waiting: set[Role] = set()  # the sides that asked for their next request
        # requests `post`ed to each side, handed one per ask
        self._posted: dict[Role, collections.deque[object]] = {r: collections.deque()
                                                               for r in envs}
        self._ended: list[Role] = []  # in the order they ended
        self._first_end: float | None = None
        self._late: TimeoutError | None = None  # told when sides were killed past the grace
        self._outlived: set[Role] = set()  # those sides (their end is not their failure)
        self._children: dict[Role, Child] = {}
        try:
            for role, env in envs.items():
                self._children[role] = Child(
                    f"the {role} side", job, args, env, Path(self._logs.name),
                    (role, coordinator, key), own_words=role == self._answering)
        except BaseException:
            self.kill()
            raise

    def wait_ready(self, timeout: float | None, role: Role | None = None) -> list[Any]:
        """Serve the sides until side `role` (default: the answering side) asks for its next
        request; what was emitted meanwhile (unless `on_item` took it). Raises the first
        failure, or TimeoutError past `timeout` s (every side killed)."""
        role = role or self._answering
        self._serve(timeout, closing=False, until=role)
        self._raise_failure()
        if role not in self._waiting:
            raise RuntimeError(f"the {role} side ended without asking for a request")
        items, self._items[:] = list(self._items), []
        return items

    def ask(self, request: object, timeout: float | None, role: Role | None = None
            ) -> list[Any]:
        """Hand `request` to side `role` (default: the answering side) once it asks for one;
        what was emitted until it asks for the next (and before, if it had not asked yet)."""
        role = role or self._answering
        before = [] if role in self._waiting else self.wait_ready(timeout, role)
        self._waiting.discard(role)
        self._children[role].conn.send(request)
        return before + self.wait_ready(timeout, role)

    def post(self, request: object, role: Role | None = None) -> None:
        """Hand `request` to side `role` (default: the answering side) as soon as it asks for
        one, without waiting for that: requests posted to a side reach it in order, one per
        ask, while the parent `pump`s (a side that takes them without blocking,
        `child.Inbox`, asks again at once)."""
        role = role or self._answering
        self._posted[role].append(request)
        self._hand(role)

    def _hand(self, role: Role) -> None:
        if role in self._waiting and self._posted[role]:
            self._waiting.discard(role)
            self._children[role].conn.send(self._posted[role].popleft())

    def pump(self, seconds: float) -> list[Any]:
        """Pass on what the sides emit for `seconds` s (less once every side ended), handing
        none a request; what was emitted (unless `on_item` took it). Raises the first failure
        of a side that ended."""
        self._serve(None, closing=False, until=None, stop=time.monotonic() + seconds)
        self._raise_failure()
        items, self._items[:] = list(self._items), []
        return items

    def wait(self, timeout: float | None = None) -> dict[Role, Ended]:
        """Every side's end, whatever it was (a request asked for meanwhile is answered with
        none: the end of requests); TimeoutError past `timeout` s (every side killed)."""
        self._serve(timeout, closing=True)
        return {role: c.ended for role, c in self._children.items()}

    def close(self, timeout: float | None = None) -> T:
        """`wait`, then what the answering side returned; the first failure, in one line, if a
        side failed."""
        ended = self.wait(timeout)
        self._raise_failure()
        return ended[self._answering].value

    def kill(self) -> None:
        """End every side now and reap it."""
        for c in self._children.values():
            c.kill()
        for role, c in self._children.items():
            if c.ended is None:
                self._take(role, c.messages())
                c.reap()
                self._ended.append(role)
        self._logs.cleanup()

    def __enter__(self) -> Pair[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _serve(self, timeout: float | None, closing: bool, until: Role | None = None,
               stop: float | None = None) -> None:
        """Pass on what the sides send until side `until` asks for a request (when `closing`,
        each side that asks is told there are none), every side ended, or the time is `stop`
        (time.monotonic). A side that outlives the first end by `grace` s is killed; past
        `timeout` s all are (TimeoutError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while live := [c for c in self._children.values() if c.ended is None]:
            if until in self._waiting and not closing:
                return
            for role in list(self._waiting) if closing else ():
                if not self._posted[role]:  # what was posted goes first
                    self._children[role].conn.send(None)
                    self._waiting.discard(role)
            limits = [t for t in (deadline, self._first_end and self._first_end + self._grace)
                      if t is not None]
            left = min(limits) - time.monotonic() if limits else None
            if left is not None and left <= 0:
                return self._stop_late(live, deadline, timeout)
            if stop is not None and (left is None or stop - time.monotonic() < left):
                if (left := stop - time.monotonic()) <= 0:
                    return
            ready = wait([w for c in live for w in c.waitables()], left)
            for role, c in self._children.items():
                if c in live and (c.conn in ready or c.sentinel in ready):
                    self._take(role, c.messages())
                if c in live and c.sentinel in ready:
                    c.reap()
                    self._ended.append(role)
                    self._first_end = self._first_end or time.monotonic()

    def _take(self, role: Role, messages: list[tuple[str, object]]) -> None:
        for kind, obj in messages:
            if kind == child.ITEM:
                self._on_item(obj)
            elif kind == child.NEXT:
                self._waiting.add(role)
                self._hand(role)

    def _stop_late(self, live: list[Child], deadline: float | None, timeout: float | None
                   ) -> None:
        """Kill the sides still running: past the overall deadline (TimeoutError), or past the
        grace after another side ended (told after that side's failure, if it had one)."""
        names = " and ".join(c.name for c in live)
        self._outlived = {role for role, c in self._children.items() if c in live}
        self.kill()
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{names} still running after {timeout:g} s (killed)")
        self._late = TimeoutError(f"{names} still running {self._grace:g} s after the other "
                                  "side ended (killed)")

    def _raise_failure(self) -> None:
        """The failure of the first side that failed, in the order they ended (else a side
        killed past the grace; else nothing)."""
        for role in self._ended:
            ended = self._children[role].ended
            if ended is not None and not ended.ok and role not in self._outlived:
                raise ended.failure()
        if self._late is not None:
            raise self._late


def run_pair(job: Callable[..., T], *args: Any, envs: Mapping[Role, Mapping[str, str]],
             key: JobKey | None, coordinator: str | None = None, grace: float = 60.0,
             on_item: Callable[[Any], None] | None = None, timeout: float | None = None) -> T:
    """Run `job(side, *args)` on the sides of `envs` to their end (`Pair`); what the answering
    side returned, or its (or the first failed side's) error in one line."""
    with Pair(job, args, envs, key=key, coordinator=coordinator, grace=grace,
              on_item=on_item) as pair:
        return pair.close(timeout)


def run_child(job: Callable[..., T], *args: Any, env: Mapping[str, str], what: str,
              timeout: float) -> T:
    """`job(*args)` in a fresh process of its own, in the environment `env`: JAX work that must
    not happen in this process (one that will later initialize jax.distributed, or that only
    launches). Its value; its error in one line naming `what`; TimeoutError past `timeout` s
    (killed)."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="rekv-child-") as logs:
        one = Child(what, job, args, env, Path(logs))
        try:
            while (left := deadline - time.monotonic()) > 0:
                if one.sentinel in wait(one.waitables(), left):
                    break
                one.messages()
            else:
                raise TimeoutError(f"{what}: still running after {timeout:g} s (killed)")
            one.messages()
        finally:
            one.kill()
            ended = one.reap()
    if not ended.ok:
        raise ended.failure()
    return ended.value
