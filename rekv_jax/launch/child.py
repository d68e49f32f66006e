"""What runs inside a spawned process: its entry (`enter`), and what a group's job is handed
first: its `Member` (with its `Inbox` of the group's messages).

Only the standard library is imported here at module level: a spawned process loads this module
to find its entry, and nothing may start JAX (or read its settings) before `enter` has set the
process up; the job and its arguments are unpickled after that."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import faulthandler
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rekv_jax.transport import Transport
    from rekv_jax.transport.secret import JobKey

T = TypeVar("T")
# What a child sends its parent: (kind, object)
ITEM = "item"  # an object the job emitted (`Member.emit`)
VALUE = "value"  # the job returned this
RAISED = "raised"  # the job raised this: (exception, traceback text)
# What a group sends a member: (kind, object)
MESSAGE = "message"  # an object for the member (`Group.send`)
CLOSE = "close"  # nothing more will come (`Group.close`)
PREFILL, DECODE = "prefill", "decode"  # the two roles of a group's members
_sending = threading.Lock()  # one message at a time to the parent (a member emits from threads)


def member_name(role: str, index: int) -> str:
    """The name of a group's member, e.g. `prefill-0`, `decode-1`."""
    return f"{role}-{index}"


def parse_member(name: str) -> tuple[str, int]:
    """(role, index) of a member's name (`member_name`); ValueError if it is none."""
    role, _, index = name.rpartition("-")
    if role not in (PREFILL, DECODE) or not index.isdigit():
        raise ValueError(f"not a worker's name: {name!r}")
    return role, int(index)


def member_names(prefill: int, decode: int) -> tuple[str, ...]:
    """The members of a group of `prefill` + `decode` processes, in process-id order: the
    decode members first (decode-0 is process 0: it hosts the coordinator, and a process 0
    that died would take every other down), then the prefill members."""
    return (*(member_name(DECODE, i) for i in range(decode)),
            *(member_name(PREFILL, i) for i in range(prefill)))


def role_of(name: str) -> str:
    """A member's role (`PREFILL` | `DECODE`), from its name (`member_names`)."""
    return parse_member(name)[0]


@dataclasses.dataclass(frozen=True)
class Closed:
    """The end of a member's inbox: the group has nothing more for it (or went away)."""


CLOSED = Closed()


@dataclasses.dataclass(frozen=True)
class Ready:
    """What a member emits when it asks for its next request (`Member.requests`): the one it
    had is done."""


READY = Ready()


class Inbox:
    """The group's messages to this process that its job has not taken yet, filled by one
    reader thread from the connection to the parent. Invariants: messages are taken in the
    order the parent sent them; `CLOSED` comes after every message and, once come, ends every
    later `receive` too."""

    def __init__(self, parent: Connection) -> None:
        self._cond = threading.Condition()
        self._messages: collections.deque[Any] = collections.deque()
        self._closed = False
        self._waiter: concurrent.futures.Future[None] | None = None  # what `incoming` handed
        threading.Thread(target=self._read, args=(parent,), name="rekv-inbox",
                         daemon=True).start()

    def _read(self, parent: Connection) -> None:
        closed = False
        while not closed:
            try:
                kind, message = parent.recv()
            except (EOFError, OSError):  # the parent is gone: nothing more will come
                kind, message = CLOSE, None
            closed = kind == CLOSE
            with self._cond:
                if closed:
                    self._closed = True
                else:
                    self._messages.append(message)
                self._cond.notify_all()
                waiter, self._waiter = self._waiter, None
            if waiter is not None:
                waiter.set_result(None)

    def receive(self, timeout: float = 0.0) -> list[Any]:
        """Every pending message, waiting up to `timeout` s for the first; `CLOSED` last once the
        group closed. Empty: nothing came in time."""
        with self._cond:
            self._cond.wait_for(lambda: self._messages or self._closed, timeout)
            out = list(self._messages)
            self._messages.clear()
            return [*out, CLOSED] if self._closed else out

    def incoming(self) -> concurrent.futures.Future[None]:
        """A future that completes once a message (or the close) is pending: already done if
        one is. One future serves every caller until it completes (no thread per call)."""
        with self._cond:
            if self._messages or self._closed:
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                return done
            if self._waiter is None:
                self._waiter = concurrent.futures.Future()
            return self._waiter


@dataclasses.dataclass(frozen=True)
class Member:
    """What a group's job is handed in its process: which member it is (`name`, e.g.
    "prefill-1": its `role` and `index`), its `process_id` in jax.distributed (its place in
    `members`, the group's names in process-id order, some perhaps run elsewhere), where the
    coordinator is (decode-0's; None: JAX detects the cluster), the job's key (None:
    `--insecure`), its line to the parent (`emit`), its inbox (`receive`, `incoming`, or as
    `requests`) and its links to the other side (`links`, a pair's `link` or `on_link`)."""

    name: str
    members: tuple[str, ...]
    coordinator: str | None
    key: JobKey | None
    _parent: Connection = dataclasses.field(repr=False)
    _inbox: Inbox = dataclasses.field(repr=False)

    @classmethod
    def start(cls, name: str, members: tuple[str, ...], coordinator: str | None,
              key: JobKey | None, parent: Connection) -> Member:
        """This process's member, its inbox reading from `parent` from now on."""
        return cls(name, members, coordinator, key, parent, Inbox(parent))

    @property
    def role(self) -> str:
        return role_of(self.name)

    @property
    def index(self) -> int:
        return parse_member(self.name)[1]

    @property
    def process_id(self) -> int:
        return self.members.index(self.name)

    @property
    def peers(self) -> dict[str, int]:
        """The members of the other side, name -> process id: those this one links to."""
        return {name: pid for pid, name in enumerate(self.members)
                if role_of(name) != self.role}

    def emit(self, item: object) -> None:
        """Hand `item` to the parent now (from any thread; in order per thread)."""
        with _sending:
            self._parent.send((ITEM, item))

    def receive(self, timeout: float = 0.0) -> list[Any]:
        """The group's pending messages (`Inbox.receive`): `CLOSED` last once it closed."""
        return self._inbox.receive(timeout)

    def incoming(self) -> concurrent.futures.Future[None]:
        """Completes once a message is pending (`Inbox.incoming`), to wait on beside other
        futures (`concurrent.futures.wait`)."""
        return self._inbox.incoming()

    def requests(self) -> Iterator[Any]:
        """The group's messages to this member taken as requests, one at a time: each is asked
        for by emitting `READY` (the one before is done). Ends once the group closed."""
        while True:
            self.emit(READY)
            messages: list[Any] = []
            while not messages:
                messages = self.receive(timeout=60.0)
            for message in messages:
                if isinstance(message, Closed):
                    return
                yield message

    def links(self, kind: str, link_gbps: float | None = None, timeout: float = 60.0,
              heartbeat_s: int = 10) -> dict[str, Transport]:
        """This member's links, one per member of the other side, by name in process-id order
        (`transport.connect_peers`: a group of more than two links by transfer-server only; close
        them in this order). Call it in every member at about the same time, before any other
        JAX work: it joins jax.distributed."""
        from rekv_jax.transport import connect_peers

        return connect_peers(kind, self.role, self.coordinator, self.process_id,
                             len(self.members), self.peers, key=self.key, link_gbps=link_gbps,
                             timeout=timeout, heartbeat_s=heartbeat_s)

    def link(self, kind: str, link_gbps: float | None = None, timeout: float = 60.0,
             heartbeat_s: int = 10) -> Transport:
        """This member's one link, to the other side's only member (a pair: `links`' one)."""
        links = self.links(kind, link_gbps, timeout, heartbeat_s)
        if len(links) != 1:
            raise ValueError(f"{self.name} has {len(links)} peers, not one: use `links`")
        return next(iter(links.values()))

    def on_link(self, kind: str, link_gbps: float | None, timeout: float,
                body: Callable[[str, Transport], T]) -> T:
        """`body(role, transport)` over the pair's link of `kind`, closed after: this member's
        end (`link`), or, for the `local` transport, both ends in this one process (the
        prefill end's on a thread); the decode end's result either way."""
        if kind == "local":
            from rekv_jax.transport import LocalTransport

            return LocalTransport.run_pair(lambda t: body("prefill", t),
                                           lambda t: body("decode", t), link_gbps, timeout)
        with self.link(kind, link_gbps, timeout) as transport:
            return body(self.role, transport)


def enter(parent: Connection, log: str, payload: bytes,
          handed: tuple[Callable[..., Any], tuple] | None) -> None:
    """A spawned process's entry: its output goes to `log`; it dies with its parent; it runs
    the job of `payload` (pickled `(function, args)`), handed `make(*fields, parent)` first
    where `handed` is `(make, fields)` (a `Member`), and sends the parent what it
    returned or raised."""
    _output_to(log)
    faulthandler.enable()  # a fatal signal writes every thread's Python stack into `log`
    die_with_parent()
    try:
        job, args = pickle.loads(payload)
        if handed is None:
            value = job(*args)
        else:
            make, fields = handed
            value = job(make(*fields, parent), *args)
    except BaseException as e:  # reported to the parent, which decides what its user reads
        _report(parent, e)
        _leave(1)
    with _sending:
        parent.send((VALUE, value))
    _leave(0)


def _leave(code: int) -> None:
    """End this process now with `code`, its output flushed, skipping the interpreter's
    finalization: the job is over and the parent has its outcome, while the native runtimes'
    teardown (XLA's GPU client and its threads) can abort the process at exit (std::terminate
    on a thread still joinable), which would turn a finished job into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(parent: Connection, e: BaseException) -> None:
    """Send `e` (or, if it does not survive pickling, a RuntimeError naming it) with its
    traceback."""
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        e = RuntimeError(f"{type(e).__name__}: {e}")
    with contextlib.suppress(OSError), _sending:  # the parent is gone: nobody to tell
        parent.send((RAISED, (e, text)))


def _output_to(log: str) -> None:
    """This process's stdout and stderr, native libraries' included, into `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies (a side never outlives
    its launcher). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
