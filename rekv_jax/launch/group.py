"""The launcher of a group: N named member processes on this machine (`child.member_names`:
decode-0 .. decode-(D-1), then prefill-0 .. prefill-(P-1), their process ids in jax.distributed in
that order), each spawned in its environment (`environments.group_environments`) and running
`job(member, *args)` (`child.Member`).

The parent is the router: it does no JAX work. At any time it hands a member a message
(`send`) and takes what came (`poll`): items the members emitted (`Emitted`, in order per
member) and members' ends (`MemberEnded`, with a one-line failure if it failed). A member that
dies ends only itself: the parent is told, never raised at, and the others run on. `close`
tells every member there is nothing more (its inbox yields `child.CLOSED`), waits for them
(bounded; those still running past its timeout are killed) and returns how each ended. Every
wait is bounded, and no member outlives the launcher (each dies with its parent, and is killed
on the way out)."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from rekv_jax.errors import describe, one_line
from rekv_jax.launch import child
from rekv_jax.launch.child import DECODE, PREFILL, member_names, role_of
from rekv_jax.launch.pair import loopback
from rekv_jax.launch.processes import Child, Ended
from rekv_jax.transport.secret import JobKey


@dataclasses.dataclass(frozen=True)
class Emitted:
    """An item member `name` emitted (`Member.emit`)."""

    name: str
    item: Any


@dataclasses.dataclass(frozen=True)
class MemberEnded:
    """Member `name` ended: how (`ended`: its value, exit code, log), and, if it failed, what
    its user reads, in one line (None: its job returned)."""

    name: str
    ended: Ended
    failure: str | None


Event = Emitted | MemberEnded


def failure_line(ended: Ended) -> str | None:
    """How `ended` failed, in one line naming the member (None: it returned)."""
    if ended.ok:
        return None
    told = describe(ended.failure())
    if told is not None:
        return told.line
    return f"{ended.name} failed: {one_line(ended.error)}"


class Group:
    """The members named in `envs` (`environments.group_environments`: exactly
    `child.member_names(P, D)`, in that order), each spawned in its environment and running
    `job(member, *args)`.

    `key` reaches each member as a spawn argument (never the environment, the command line or a
    file). `coordinator`: decode-0's host:port for jax.distributed (None: a free loopback
    port)."""

    def __init__(self, job: Callable[..., Any], args: tuple, envs: Mapping[str, Mapping[str, str]],
                 *, key: JobKey | None, coordinator: str | None = None) -> None:
        names = tuple(envs)
        counts = [sum(role_of(n) == role for n in names) for role in (PREFILL, DECODE)]
        if names != member_names(*counts) or not all(counts):
            raise ValueError(f"a group's members are named {member_names(1, 1)}..., decode "
                             f"first, at least one of each; got {names}")
        self.names = names
        self.coordinator = coordinator or loopback()
        self._logs = tempfile.TemporaryDirectory(prefix="rekv-group-")
        self._events: list[Event] = []  # come, not polled yet
        self._children: dict[str, Child] = {}
        try:
            for name in names:
                self._children[name] = Child(
                    name, job, args, envs[name], Path(self._logs.name),
                    (child.Member.start, (name, names, self.coordinator, key)))
        except BaseException:
            self.kill()
            raise

    def send(self, name: str, message: object) -> bool:
        """Hand `message` to member `name` (its inbox, in order); False if it has ended (its
        `MemberEnded` is or will be among the events), so its caller can fail what it sent."""
        one = self._children[name]
        if one.ended is not None:
            return False
        try:
            one.conn.send((child.MESSAGE, message))
        except OSError:  # it died; its sentinel tells `poll`
            return False
        return True

    def poll(self, timeout: float | None = 0.0) -> list[Event]:
        """The events that came, in order per member, waiting up to `timeout` s (None: until
        one comes) for the first. Empty: none came in time, or every member has ended."""
        if not self._events:
            self._gather(timeout)
        events, self._events = self._events, []
        return events

    def live(self) -> list[str]:
        """The members that have not ended (as far as the events taken so far tell)."""
        return [name for name, one in self._children.items() if one.ended is None]

    def close(self, timeout: float) -> dict[str, Ended]:
        """Tell every member there is nothing more, wait up to `timeout` s for all to end, kill
        those still running then; how each ended. What came meanwhile stays for `poll`."""
        for name in self.live():
            with contextlib.suppress(OSError):  # it died; its sentinel tells
                self._children[name].conn.send((child.CLOSE, None))
        deadline = time.monotonic() + timeout
        while self.live() and (left := deadline - time.monotonic()) > 0:
            self._gather(left)
        self._kill(f"still running {timeout:g} s after the group closed (killed)")
        return {name: one.ended for name, one in self._children.items()}

    def kill_member(self, name: str) -> None:
        """End member `name` now, as a crash would (a worker loss); its end comes among the
        events."""
        self._children[name].kill()

    def kill(self) -> None:
        """End every member now and reap it (its end among the events)."""
        self._kill("killed by the launcher")
        self._logs.cleanup()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _kill(self, why: str) -> None:
        live = self.live()
        for name in live:
            self._children[name].kill()
        for name in live:
            self._take(name, self._children[name])
            ended = self._children[name].reap()
            self._events.append(MemberEnded(name, ended, f"{name} {why}"))

    def _gather(self, timeout: float | None) -> None:
        """Take what the live members sent, waiting up to `timeout` s for something."""
        live = {name: one for name, one in self._children.items() if one.ended is None}
        if not live:
            return
        ready = wait([w for one in live.values() for w in one.waitables()], timeout)
        for name, one in live.items():
            if one.conn in ready or one.sentinel in ready:
                self._take(name, one)
            if one.sentinel in ready:
                ended = one.reap()
                self._events.append(MemberEnded(name, ended, failure_line(ended)))

    def _take(self, name: str, one: Child) -> None:
        self._events += [Emitted(name, item) for kind, item in one.messages()
                         if kind == child.ITEM]
