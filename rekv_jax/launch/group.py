"""The launcher: every multi-process job is a group of named member processes
(`child.member_names`: decode-0 .. decode-(D-1), then prefill-0 .. prefill-(P-1), their process
ids in jax.distributed in that order), those of this machine each spawned here in its
environment and running `job(member, *args)` (`child.Member`); a one-off process is
`run_child`.

`Group` is the mechanism. The parent does no JAX work. At any time it hands a member a message
(`send`) and takes what came (`poll`): items the members emitted (`Emitted`, in order per
member) and members' ends (`MemberEnded`, with a one-line failure if it failed). A member that
dies ends only itself: the parent is told, never raised at, and the others run on (a serving
router). `close` tells every member there is nothing more (its inbox yields `child.CLOSED`),
waits for them (bounded; those still running past its timeout are killed) and returns how each
ended. Every wait is bounded, and no member outlives the launcher (each dies with its parent,
and is killed on the way out).

`Job` runs a group as one job to its end (a pair's: `run_pair`, decode-0 and prefill-0), whose
members end together: a member that fails ends the job in one line naming it, and once one has
ended the others get a grace, then are killed. Its answering member (decode-0 where it runs
here) may take requests while it runs (`Job.ask`, `Member.requests`)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Generic, TypeVar

from rekv_jax.errors import describe, one_line
from rekv_jax.launch import child
from rekv_jax.launch.child import DECODE, PREFILL, member_names, role_of
from rekv_jax.launch.processes import Child, Ended
from rekv_jax.transport.base import Role
from rekv_jax.transport.secret import JobKey

T = TypeVar("T")


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


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback() -> str:
    """A coordinator address for a group on this machine (loopback only)."""
    return f"127.0.0.1:{free_port()}"


def failure_line(ended: Ended) -> str | None:
    """How `ended` failed, in one line naming the member (None: it returned)."""
    if ended.ok:
        return None
    told = describe(ended.failure())
    if told is not None:
        return told.line
    return f"{ended.name} failed: {one_line(ended.error)}"


class Group:
    """The members named in `envs`, each spawned in its environment and running
    `job(member, *args)`: all of `members` (the group's names in process-id order,
    `child.member_names(P, D)` with a decode member at least; None: those of `envs`), or, on a
    multi-host allocation, those run on this machine.

    `key` reaches each member as a spawn argument (never the environment, the command line or a
    file). `coordinator`: decode-0's host:port for jax.distributed (None: a free loopback port
    where every member runs here, else JAX detects the cluster)."""

    def __init__(self, job: Callable[..., Any], args: tuple, envs: Mapping[str, Mapping[str, str]],
                 *, key: JobKey | None, coordinator: str | None = None,
                 members: tuple[str, ...] | None = None) -> None:
        members = tuple(envs) if members is None else members
        counts = [sum(role_of(n) == role for n in members) for role in (PREFILL, DECODE)]
        here = [n for n in members if n in envs]
        if members != member_names(*counts) or not counts[1] or here != list(envs):
            raise ValueError(f"a group's members are named {member_names(1, 1)}..., decode "
                             f"first, at least one decode member; got {tuple(envs)} of {members}")
        self.names = tuple(envs)
        self.coordinator = coordinator or (loopback() if here == list(members) else None)
        self._logs = tempfile.TemporaryDirectory(prefix="rekv-group-")
        self._events: list[Event] = []  # come, not polled yet
        self._children: dict[str, Child] = {}
        try:
            for name in self.names:
                self._children[name] = Child(
                    name, job, args, envs[name], Path(self._logs.name),
                    (child.Member.start, (name, members, self.coordinator, key)))
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

    def end_inboxes(self) -> None:
        """Tell every live member there is nothing more (its inbox yields `child.CLOSED`)."""
        for name in self.live():
            with contextlib.suppress(OSError):  # it died; its sentinel tells
                self._children[name].conn.send((child.CLOSE, None))

    def close(self, timeout: float) -> dict[str, Ended]:
        """Tell every member there is nothing more, wait up to `timeout` s for all to end, kill
        those still running then; how each ended. What came meanwhile stays for `poll`."""
        self.end_inboxes()
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


class Job(Generic[T]):
    """A `Group` run as one job: what its members emit reaches `on_item` as it comes (else it is
    returned by `wait_ready`/`ask`); `close` returns the answering member's value (decode-0's,
    or the one member's run here) or raises the first failure, in one line; the answering
    member's errors stand in its own words. Once one member has ended the others get `grace` s,
    then are killed."""

    def __init__(self, job: Callable[..., T], args: tuple, envs: Mapping[str, Mapping[str, str]],
                 *, key: JobKey | None, coordinator: str | None = None,
                 members: tuple[str, ...] | None = None, grace: float = 60.0,
                 on_item: Callable[[Any], None] | None = None) -> None:
        self.group = Group(job, args, envs, key=key, coordinator=coordinator, members=members)
        self._answering = self.group.names[0]  # decode first
        self._grace = grace
        self._items: list[Any] = []
        self._on_item = on_item or self._items.append
        self._ready = False  # the answering member asked for its next request
        self._ended: dict[str, Ended] = {}  # in the order they ended
        self._first_end: float | None = None
        self._late: TimeoutError | None = None  # told when members were killed past the grace
        self._outlived: set[str] = set()  # those members (their end is not their failure)

    @classmethod
    def pair(cls, job: Callable[..., T], args: tuple, envs: Mapping[Role, Mapping[str, str]],
             **kwargs: Any) -> Job[T]:
        """A pair's job: decode-0 and prefill-0, of which those of the roles in `envs` run here
        (both on one machine; one on a multi-host allocation, or the one process of the `local`
        transport, which runs both ends)."""
        here = {f"{role}-0": envs[role] for role in ("decode", "prefill") if role in envs}
        return cls(job, args, here, members=member_names(1, 1), **kwargs)

    def wait_ready(self, timeout: float | None) -> list[Any]:
        """Serve until the answering member asks for a request (`Member.requests`); what it
        emitted meanwhile (unless `on_item` took it). Raises the first failure, or TimeoutError
        past `timeout` s (every member killed)."""
        self._serve(timeout, until_ready=True)
        self._raise_failure()
        if not self._ready:
            raise RuntimeError(f"{self._answering} ended without asking for a request")
        items, self._items[:] = list(self._items), []
        return items

    def ask(self, request: object, timeout: float | None) -> list[Any]:
        """Hand `request` to the answering member once it asks for one; what it emitted until
        it asks for the next (and before, if it had not asked yet)."""
        before = [] if self._ready else self.wait_ready(timeout)
        self._ready = False
        self.group.send(self._answering, request)
        return before + self.wait_ready(timeout)

    def wait(self, timeout: float | None = None) -> dict[str, Ended]:
        """Every member's end, whatever it was (its inbox closed: no more requests);
        TimeoutError past `timeout` s (every member killed)."""
        self.group.end_inboxes()
        self._serve(timeout, until_ready=False)
        return {name: self._ended[name] for name in self.group.names}

    def close(self, timeout: float | None = None) -> T:
        """`wait`, then what the answering member returned; the first failure, in one line, if
        a member failed."""
        ended = self.wait(timeout)
        self._raise_failure()
        return ended[self._answering].value

    def kill(self) -> None:
        """End every member now and reap it."""
        self.group.kill()
        self._take(self.group.poll())

    def __enter__(self) -> Job[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _serve(self, timeout: float | None, until_ready: bool) -> None:
        """Pass on what the members emit until the answering member asks for a request (if
        `until_ready`) or every member ended. Members that outlive the first end by `grace` s
        are killed; past `timeout` s all are (TimeoutError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while live := self.group.live():
            if until_ready and self._ready:
                return
            limits = [t for t in (deadline, self._first_end and self._first_end + self._grace)
                      if t is not None]
            left = min(limits) - time.monotonic() if limits else None
            if left is not None and left <= 0:
                return self._stop_late(live, deadline, timeout)
            self._take(self.group.poll(left))

    def _take(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, MemberEnded):
                self._ended[event.name] = event.ended
                self._first_end = self._first_end or time.monotonic()
            elif isinstance(event.item, child.Ready):
                self._ready = self._ready or event.name == self._answering
            else:
                self._on_item(event.item)

    def _stop_late(self, live: list[str], deadline: float | None, timeout: float | None
                   ) -> None:
        """Kill the members still running: past the overall deadline (TimeoutError), or past
        the grace after another member ended (told after that one's failure, if it had one)."""
        names = " and ".join(live)
        self._outlived = set(live)
        self.kill()
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{names} still running after {timeout:g} s (killed)")
        self._late = TimeoutError(f"{names} still running {self._grace:g} s after another "
                                  "member ended (killed)")

    def _raise_failure(self) -> None:
        """The failure of the first member that failed, in the order they ended (else members
        killed past the grace; else nothing)."""
        for name, ended in self._ended.items():
            if not ended.ok and name not in self._outlived:
                own = dataclasses.replace(ended, own_words=name == self._answering)
                raise own.failure()
        if self._late is not None:
            raise self._late


def run_pair(job: Callable[..., T], *args: Any, envs: Mapping[Role, Mapping[str, str]],
             key: JobKey | None, coordinator: str | None = None, grace: float = 60.0,
             on_item: Callable[[Any], None] | None = None, timeout: float | None = None) -> T:
    """Run `job(member, *args)` as a pair's job to its end (`Job.pair`); what the answering
    member returned, or its (or the first failed member's) error in one line."""
    with Job.pair(job, args, envs, key=key, coordinator=coordinator, grace=grace,
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
