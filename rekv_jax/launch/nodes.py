"""A group across nodes: the router in this process, each member started on a node of its own
(`run_member`), each joined to the router by one connection.

The router listens at the rendezvous address for `timeout` s (`NodeGroup`); each member retries
it for its own `timeout` s, so either may start first. A connection opens with the control
connection's challenge-response over a key derived from the job's key (`control.accept`,
`control.connect`, purpose `PURPOSE`): a process without the key joins nothing, and the router
waits on for the members. Each member then says its name (`Hello`, with a port free on its host,
where decode-0 will host jax.distributed's coordination service). Once every member has, the
router stops listening and answers each with a `Join`: the job and its arguments, the members in
process-id order and decode-0's coordinator address. A member that never comes is named in one
line at the timeout; those that came are told so (`Refused`) and exit.

Each member runs the job in a process of its own, as `Group` spawns one on one machine
(`processes.Child`, handed a `child.Member` whose key is the member's own), and relays: the
router's messages to it, its items to the router, and at its end its `Ended`. To the router a
`NodeGroup` is what a `Group` is (send, poll, close, kill); a member whose connection closes
without its `Ended` (its process or node gone) ends with a line saying so. A member whose
router goes away kills its job and exits; TCP keepalive finds a router whose node vanished."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from rekv_jax.errors import TransportError, TransportTimeout
from rekv_jax.launch import child
from rekv_jax.launch.child import member_names
from rekv_jax.launch.group import Emitted, Event, MemberEnded, failure_line, free_port
from rekv_jax.launch.processes import Child, Ended
from rekv_jax.transport import control
from rekv_jax.transport.secret import JobKey

ROUTER = "router"
PURPOSE = "router connection"  # the derived key a connection to the router proves it holds
# What crosses beside child.MESSAGE and child.CLOSE (router -> member) and child.ITEM (back)
KILL = "kill"  # router -> member: end the job now
ENDED = "ended"  # member -> router: how its job ended (an `Ended`)
HELLO_S = 5.0  # how long an authenticated connection may take to say its name
RETRY_S = 0.2  # how often a member tries a router that does not listen yet
LOG_TAIL = 65536  # the characters of a member's log that reach the router
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}  # a dead peer in ~25 s


def node_names(prefill: int, decode: int) -> tuple[str, ...]:
    """A run's processes in node-rank order: the router, then the members in process-id order
    (`child.member_names`)."""
    return (ROUTER, *member_names(prefill, decode))


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the router listens for its members ("host:port"), and the job's key."""

    address: str
    key: JobKey


@dataclasses.dataclass(frozen=True)
class Hello:
    """A member's first message: its name, and a port free on its host."""

    name: str
    port: int


@dataclasses.dataclass(frozen=True)
class Join:
    """The router's answer once every member came: run `job(member, *args)`."""

    job: Callable[..., Any]
    args: tuple
    members: tuple[str, ...]  # in process-id order
    coordinator: str  # decode-0's host:port for jax.distributed


@dataclasses.dataclass(frozen=True)
class Refused:
    """The router's answer to a member that cannot join, or to every member once one never
    came: why, in one line."""

    why: str


class NodeGroup:
    """The members `names` (`child.member_names`, decode-0 first), each joined from its own node
    within `timeout` s (the module's docstring), running `job(member, *args)`; a
    `TransportTimeout` names those that never came."""

    def __init__(self, job: Callable[..., Any], args: tuple, names: tuple[str, ...],
                 rendezvous: Rendezvous, timeout: float) -> None:
        self.names = names
        self._conns: dict[str, Connection] = {}
        self._ends: dict[str, Ended] = {}
        self._events: list[Event] = []
        try:
            hosts = self._gather(rendezvous, timeout)
        except BaseException as e:  # each member is told why, in the router's words
            self._let_go(Refused(str(e) or "the router stopped before the run started"))
            raise
        host, port = hosts[names[0]]
        coordinator = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        for conn in self._conns.values():
            with contextlib.suppress(OSError):  # it went away: `poll` tells
                conn.send(Join(job, args, names, coordinator))

    def _gather(self, rendezvous: Rendezvous, timeout: float) -> dict[str, tuple[str, int]]:
        """Take members until all came or `timeout` s passed: each one's host and port."""
        host, port = rendezvous.address.rsplit(":", 1)
        host = host.strip("[]")
        listener, _ = control.listen(host if host in control.LOOPBACK else "0.0.0.0", int(port))
        hosts: dict[str, tuple[str, int]] = {}
        deadline = time.monotonic() + timeout
        with listener:
            while len(hosts) < len(self.names) and (left := deadline - time.monotonic()) > 0:
                try:
                    sock = control.accept(listener, rendezvous.key, left, purpose=PURPOSE)
                except TransportTimeout:
                    break
                peer = sock.getpeername()[0]
                conn = _connection(sock)
                hello = _receive(conn, HELLO_S)
                why = self._refusal(hello)
                if why is not None:
                    with contextlib.suppress(OSError):
                        conn.send(Refused(why))
                    conn.close()
                    continue
                self._conns[hello.name] = conn
                hosts[hello.name] = (peer, hello.port)
        missing = [name for name in self.names if name not in hosts]
        if missing:
            line = (f"{', '.join(missing)} did not join the router at {rendezvous.address} "
                    f"within {timeout:g} s")
            raise TransportTimeout(line)
        return hosts

    def _refusal(self, hello: object) -> str | None:
        if not isinstance(hello, Hello):
            return "no name came"
        if hello.name not in self.names:
            return f"{hello.name} is not a member of this run ({', '.join(self.names)})"
        if hello.name in self._conns:
            return f"{hello.name} has joined already"
        return None

    def send(self, name: str, message: object) -> bool:
        """Hand `message` to member `name`; False if it has ended (as `Group.send`)."""
        if name in self._ends:
            return False
        try:
            self._conns[name].send((child.MESSAGE, message))
        except OSError:  # it went away; `poll` tells
            return False
        return True

    def poll(self, timeout: float | None = 0.0) -> list[Event]:
        """The events that came, waiting up to `timeout` s for the first (as `Group.poll`)."""
        if not self._events:
            self._take(timeout)
        events, self._events = self._events, []
        return events

    def live(self) -> list[str]:
        return [name for name in self.names if name not in self._ends]

    def close(self, timeout: float) -> dict[str, Ended]:
        """Tell every member there is nothing more, wait up to `timeout` s for all to end, kill
        those still running then; how each ended (as `Group.close`)."""
        for name in self.live():
            with contextlib.suppress(OSError):
                self._conns[name].send((child.CLOSE, None))
        deadline = time.monotonic() + timeout
        while self.live() and (left := deadline - time.monotonic()) > 0:
            self._take(left)
        self._kill(f"still running {timeout:g} s after the group closed (killed)")
        return dict(self._ends)

    def kill(self) -> None:
        """End every member's job now (its end among the events)."""
        self._kill("killed by the launcher")

    def __enter__(self) -> NodeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _kill(self, why: str) -> None:
        for name in self.live():
            with contextlib.suppress(OSError):
                self._conns[name].send((KILL, None))
            self._end(name, Ended(name, -signal.SIGKILL), f"{name} {why}")

    def _let_go(self, refused: Refused) -> None:
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.send(refused)
            conn.close()

    def _take(self, timeout: float | None) -> None:
        """Take what the live members sent, waiting up to `timeout` s for something."""
        live = {self._conns[name]: name for name in self.live()}
        for conn in wait(list(live), timeout) if live else ():
            name = live[conn]
            try:
                while name not in self._ends and conn.poll():
                    kind, obj = conn.recv()
                    if kind == child.ITEM:
                        self._events.append(Emitted(name, obj))
                    elif kind == ENDED:
                        self._end(name, obj)
            except (EOFError, OSError):
                gone = TransportError("its connection to the router closed before it ended "
                                      "(its process or node went away)")
                self._end(name, Ended(name, 1, error=gone))

    def _end(self, name: str, ended: Ended, why: str | None = None) -> None:
        self._ends[name] = ended
        self._conns[name].close()
        self._events.append(MemberEnded(name, ended, why or failure_line(ended)))


def run_member(name: str, rendezvous: Rendezvous, timeout: float, env: Mapping[str, str]
               ) -> None:
    """Member `name`'s node: join the router at `rendezvous` (retried for `timeout` s), run
    the job it hands in a process of its own in the environment `env`, and relay until the job
    ends (its failure raised, in one line) or the router stops it. TransportError if the router
    refuses it or goes away; WrongKey if the router does not hold this process's key."""
    conn = _connect(rendezvous, timeout)
    with conn:
        conn.send(Hello(name, free_port()))
        join = _receive(conn, timeout)
        if not isinstance(join, Join):
            raise TransportError(f"{name}: " + (
                join.why if isinstance(join, Refused)
                else f"no answer from the router at {rendezvous.address} within {timeout:g} s"))
        with tempfile.TemporaryDirectory(prefix="rekv-node-") as logs:
            one = Child(name, join.job, join.args, env, Path(logs), (child.Member.start, (
                name, join.members, join.coordinator, rendezvous.key)))
            try:
                outcome = _relay(conn, one)
            finally:
                one.kill()
                one.messages()
                ended = one.reap()
        if outcome == KILL:
            return
        if outcome is None:
            with contextlib.suppress(OSError):  # the router is gone: nobody to tell
                conn.send((ENDED, dataclasses.replace(ended, log=ended.log[-LOG_TAIL:])))
            if ended.ok:
                return
            raise ended.failure()
    raise TransportError(f"the router at {rendezvous.address} went away; {name} stopped")


def _relay(conn: Connection, one: Child) -> str | None:
    """Pass the router's messages to `one` and its items back until it ends (None), the router
    says KILL (KILL), or the router's connection closes (ENDED)."""
    while True:
        ready = wait([conn, *one.waitables()])
        if conn in ready:
            try:
                kind, message = conn.recv()
            except (EOFError, OSError):
                return ENDED
            if kind == KILL:
                return KILL
            with contextlib.suppress(OSError):  # it died: its sentinel tells
                one.conn.send((kind, message))
        for kind, item in one.messages():
            if kind == child.ITEM:
                with contextlib.suppress(OSError):  # the router is gone: its recv tells
                    conn.send((child.ITEM, item))
        if one.sentinel in ready:
            return None


def _connect(rendezvous: Rendezvous, timeout: float) -> Connection:
    """An authenticated connection to the router, retried while nothing answers there (the
    router may start later) for up to `timeout` s; WrongKey at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _connection(control.connect(rendezvous.address, rendezvous.key,
                                               max(1.0, deadline - time.monotonic()), PURPOSE))
        except control.WrongKey:
            raise control.WrongKey(f"the router at {rendezvous.address} does not hold this "
                                   "process's key (give every node the same --secret-file)"
                                   ) from None
        except TransportError:
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"no router answered at {rendezvous.address} within "
                                       f"{timeout:g} s (is it running?)") from None
        time.sleep(RETRY_S)


def _connection(sock: socket.socket) -> Connection:
    """`sock` (authenticated) as a connection carrying Python objects, with TCP keepalive."""
    sock.setblocking(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE.items():
        if hasattr(socket, option):  # Linux names them all
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return Connection(sock.detach())


def _receive(conn: Connection, timeout: float) -> object:
    """The next object on `conn` within `timeout` s; None if none came or it closed."""
    try:
        return conn.recv() if conn.poll(timeout) else None
    except (EOFError, OSError):
        return None
