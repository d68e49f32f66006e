"""The threads a transport waits on, and its bounded waits: a persistent `Worker` per owner (no
thread is started inside a timed interval); `wait_for`, which blocks in slices of `LIVENESS_S`
and checks between them that the peer is alive; and a `Watchdog`, which bounds many pending
receives from one thread that wakes every `LIVENESS_S`, not once per message."""

from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from rekv_jax.errors import TransportError, TransportTimeout

T = TypeVar("T")
LIVENESS_S = 0.5  # how often a blocked wait checks that the peer is alive


class Worker:
    """One persistent daemon thread that runs submitted jobs in order.

    Made with its owner (a transport, a channel), so no thread is started inside a timed interval;
    a daemon, so a job stuck on a dead peer never holds up the process's exit. `abandon()` leaves
    a stuck job to its thread, which ends after it, and gives later jobs a fresh thread: at most
    one thread per worker serves new jobs."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._start()
        _workers.add(self)

    def _start(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self._name,
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            _run(*job)
            del job  # an idle thread holds nothing of its last job (its buffers, its arrays)

    def on_thread(self) -> bool:
        """Whether the calling thread is this worker's."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        if self._jobs is None:
            raise TransportError(f"{self._name}: worker is closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def abandon(self) -> None:
        """Leave the current thread to the jobs it holds; later jobs run on a new thread."""
        self.close()
        self._start()

    def close(self, wait_s: float = 0.0) -> None:
        """The thread ends once its queued jobs are done; it is waited for up to `wait_s`."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
            if wait_s > 0 and not self.on_thread():
                self._thread.join(wait_s)


def _run(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)


class Watchdog:
    """One persistent daemon thread that bounds many pending futures without waking for each:
    every `LIVENESS_S` (or at a nearer deadline) it hands each one not yet done whose deadline
    passed, whose peer is gone or that was abandoned to its `expire` callback, with the error
    (`expired`). A future is forgotten the moment it completes (what it holds is not kept)."""

    def __init__(self, name: str, peer_alive: Callable[[], bool]) -> None:
        self._peer_alive = peer_alive
        self._pending: dict[int, tuple[concurrent.futures.Future, float, str,
                                       threading.Event | None,
                                       Callable[[TransportError], None]]] = {}
        self._added = 0
        self._cond = threading.Condition()
        self._wake_at = float("inf")
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        _workers.add(self)

    def add(self, future: concurrent.futures.Future, deadline: float, what: str,
            abandoned: threading.Event | None, expire: Callable[[TransportError], None]) -> None:
        """Bound `future` by `deadline` (time.monotonic), the peer's liveness and `abandoned`."""
        with self._cond:
            key, self._added = self._added, self._added + 1
            self._pending[key] = (future, deadline, what, abandoned, expire)
            if deadline < self._wake_at:  # sooner than the thread will look: wake it
                self._cond.notify()
        future.add_done_callback(lambda _: self._forget(key))

    def _forget(self, key: int) -> None:
        with self._cond:
            self._pending.pop(key, None)

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._wake_at = min([time.monotonic() + LIVENESS_S,
                                     *(item[1] for item in self._pending.values())])
                self._cond.wait(max(0.0, self._wake_at - time.monotonic()))
                if self._closed:
                    return
                pending = list(self._pending.values())
            for future, deadline, what, abandoned, expire in pending:  # outside the lock: an
                if future.done():  # expiry settles a receive
                    continue
                error = expired(deadline, self._peer_alive, what, abandoned)
                if error is not None:
                    expire(error)

    def close(self) -> None:
        """The thread ends at once; what it bounded is no longer bounded."""
        with self._cond:
            self._closed = True
            self._cond.notify()


def expired(deadline: float, peer_alive: Callable[[], bool], what: str,
            abandoned: threading.Event | None = None) -> TransportError | None:
    """The error of a wait for `what` that must end now: TransportTimeout past `deadline`
    (time.monotonic), TransportError once the peer is gone or nobody waits (`abandoned`)."""
    if time.monotonic() >= deadline:
        return TransportTimeout(f"{what}: payload did not arrive before the timeout")
    if not peer_alive():
        return TransportError(f"{what}: the peer process is gone (mid-transfer)")
    if abandoned is not None and abandoned.is_set():
        return TransportError(f"{what}: abandoned (its handoff failed)")
    return None


_workers: weakref.WeakSet[Worker | Watchdog] = weakref.WeakSet()


@atexit.register
def _end_workers(timeout: float = 1.0) -> None:
    """At exit, end the workers' threads before the interpreter finalizes: a daemon thread that
    wakes during finalization is killed inside whatever call it returns from, and a C++ frame
    there turns that into an abort. Threads still busy (stuck on a dead peer) get `timeout` s in
    all."""
    deadline = time.monotonic() + timeout
    for worker in list(_workers):
        worker.close()
        if worker._thread is not None:
            worker._thread.join(max(0.0, deadline - time.monotonic()))


def wait_for(future: concurrent.futures.Future[T], deadline: float,
             peer_alive: Callable[[], bool], what: str,
             abandoned: threading.Event | None = None) -> T:
    """The future's result (or its exception, raised), blocking until it is done; TransportTimeout
    after `deadline` (time.monotonic), TransportError once the peer is known to be gone (checked
    every `LIVENESS_S`: a blocking wait inside the runtime would not return if the peer died) or
    once nobody waits for it (`abandoned`)."""
    while True:
        remaining = deadline - time.monotonic()
        try:  # waits on the future's own condition: no waiter object per call
            return future.result(timeout=max(0.0, min(LIVENESS_S, remaining)))
        except concurrent.futures.TimeoutError:
            pass
        error = expired(deadline, peer_alive, what, abandoned)
        if error is not None:
            raise error
