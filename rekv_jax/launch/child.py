"""What runs inside a spawned process: its entry (`enter`) and the `Side` a pair's job is handed.

Only the standard library is imported here at module level: a spawned process loads this module
to find its entry, and nothing may start JAX (or read its settings) before `enter` has set the
process up; the job and its arguments are unpickled after that."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rekv_jax.transport import Transport
    from rekv_jax.transport.secret import JobKey

T = TypeVar("T")
# What a child sends its parent: (kind, object)
ITEM = "item"  # an object the job emitted (`Side.emit`)
NEXT = "next"  # the job asks for its next request (`Side.requests`)
VALUE = "value"  # the job returned this
RAISED = "raised"  # the job raised this: (exception, traceback text)


@dataclasses.dataclass(frozen=True)
class Side:
    """What a pair's job is handed in its process: which side it is, where the coordinator is,
    the job's key (None: `--insecure`), and its line to the parent."""

    role: str  # "prefill" | "decode"
    coordinator: str | None  # host:port of process 0; None: JAX detects the cluster
    key: JobKey | None
    _parent: Connection = dataclasses.field(repr=False)

    def emit(self, item: object) -> None:
        """Hand `item` to the parent now (a record, a token, progress)."""
        self._parent.send((ITEM, item))

    def requests(self) -> Iterator[Any]:
        """The requests the parent hands this side (`Pair.ask`), one at a time: asking for the
        next tells the parent that the last one is done. Ends when the parent closes."""
        while True:
            self._parent.send((NEXT, None))
            request = self._parent.recv()
            if request is None:
                return
            yield request

    def inbox(self) -> Inbox:
        """The parent's requests for a job that must not block on them (a serving loop): the
        same asking protocol as `requests`, polled."""
        return Inbox(self._parent)

    def connect(self, kind: str, *, link_gbps: float | None = None, timeout: float = 60.0,
                heartbeat_s: int = 10) -> Transport:
        """This side's end of the pair's link of `kind` (`transport.connect`, with the key)."""
        from rekv_jax.transport import connect

        return connect(kind, self.role, self.coordinator, key=self.key, link_gbps=link_gbps,
                       timeout=timeout, heartbeat_s=heartbeat_s)

    def on_link(self, kind: str, link_gbps: float | None, timeout: float,
                body: Callable[[str, Transport], T]) -> T:
        """`body(role, transport)` over the pair's link of `kind`, closed after: this side's
        end (`connect`), or, for the `local` transport, both ends in this one process (the
        prefill side's on a thread); the decode side's result either way."""
        if kind == "local":
            from rekv_jax.transport import LocalTransport

            return LocalTransport.run_pair(lambda t: body("prefill", t),
                                           lambda t: body("decode", t), link_gbps, timeout)
        with self.connect(kind, link_gbps=link_gbps, timeout=timeout) as transport:
            return body(self.role, transport)


class Inbox:
    """The requests the parent hands a side (`Pair.ask`), taken without blocking: `take`
    returns those that came within its timeout, asking for each next one at once (the parent
    then knows the last was taken); `ended` once the parent said there are no more."""

    def __init__(self, parent: Connection) -> None:
        self._parent, self._asked, self.ended = parent, False, False

    def take(self, timeout: float | None = 0.0) -> list[Any]:
        """The requests handed within `timeout` s (None: until one comes or they end), then
        those already there."""
        out: list[Any] = []
        while not self.ended:
            if not self._asked:
                self._parent.send((NEXT, None))
                self._asked = True
            if not self._parent.poll(0 if out else timeout):
                break
            request, self._asked = self._parent.recv(), False
            if request is None:
                self.ended = True
            else:
                out.append(request)
        return out


def enter(parent: Connection, log: str, payload: bytes, side: tuple | None) -> None:
    """A spawned process's entry: its output goes to `log`; it dies with its parent; it runs
    the job of `payload` (pickled `(function, args)`), handed a `Side(*side, parent)` first
    unless `side` is None, and sends the parent what it returned or raised."""
    _output_to(log)
    die_with_parent()
    try:
        job, args = pickle.loads(payload)
        value = job(*args) if side is None else job(Side(*side, parent), *args)
    except BaseException as e:  # reported to the parent, which decides what its user reads
        _report(parent, e)
        raise SystemExit(1) from None
    parent.send((VALUE, value))


def _report(parent: Connection, e: BaseException) -> None:
    """Send `e` (or, if it does not survive pickling, a RuntimeError naming it) with its
    traceback."""
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        e = RuntimeError(f"{type(e).__name__}: {e}")
    with contextlib.suppress(OSError):  # the parent is gone: nobody to tell
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
