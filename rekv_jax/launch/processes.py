"""One spawned process watched from its parent (`Child`), and how it ended (`Ended`), told in
one line: its own error, or, where it died natively (a signal, JAX aborting it once its
coordinator went away), the member and how it ended."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from rekv_jax.errors import TransportError, describe, exit_text
from rekv_jax.launch import child
from rekv_jax.transport.cores import children_on

# What JAX's client writes before it aborts its process because the coordination service (hosted
# by the decode side) went away (see transport/distributed.py)
SERVICE_GONE = ("Polled an error from coordination service", "detected fatal errors",
                "Socket closed", "std::bad_cast")
_SPAWN = multiprocessing.get_context("spawn")
_environ_lock = threading.Lock()  # `os.environ` is swapped while a child starts


@dataclasses.dataclass(frozen=True)
class Ended:
    """How one spawned process ended."""

    name: str  # e.g. "prefill-0", "link calibration"
    exitcode: int  # negative: the signal that ended it
    value: object = None  # what its job returned
    error: BaseException | None = None  # what its job raised
    traceback: str = ""  # of `error`
    log: str = ""  # its output (native libraries' included)
    kept_log: str = ""  # where a copy of `log` outlives the run (a crash's; "" for none)
    own_words: bool = False  # its errors stand as they are (a job's answering member)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None

    def failure(self) -> BaseException:
        """The exception its user is told, in one line (a bug keeps its traceback)."""
        if self.error is None:  # it died without a word: say how, and why where JAX said
            if any(sign in self.log for sign in SERVICE_GONE):
                return TransportError(f"{self.name} stopped: the decode side went away (its "
                                      "coordination service stopped answering)")
            last = last_words(self.log) if crashed(self.exitcode) else ""  # not a kill's
            return TransportError(f"{self.name} {exit_text(self.exitcode)}"
                                  + (f"; its last words: {last}" if last else "")
                                  + (f" (its output: {self.kept_log})" if self.kept_log else ""))
        told = describe(self.error)
        if told is None:
            return RuntimeError(f"{self.name} failed:\n{self.traceback}")
        if self.own_words:
            return self.error
        return (ValueError if told.status == 2 else TransportError)(f"{self.name}: {told.line}")


FAULT_SIGNS = ("fatal", "error", "terminate", "check failed", "what()")
CRASHES = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


def crashed(exitcode: int | None) -> bool:
    """Whether a process that ended with `exitcode` crashed (`CRASHES`), rather than was killed,
    exited or runs on (None)."""
    return exitcode is not None and -exitcode in CRASHES


def last_words(log: str, most: int = 300) -> str:
    """What a crashed process (`CRASHES`) said last of its fault: its output's last two lines
    that name one (`FAULT_SIGNS`: a native library's abort message, faulthandler's heading), else
    its last non-blank line; at most `most` characters."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    faults = [line for line in lines if any(s in line.lower() for s in FAULT_SIGNS)
              and not line.startswith('File "')]  # a stack's frames name files, not faults
    return " / ".join(faults[-2:] or lines[-1:])[:most]


def keep_crash_log(name: str, exitcode: int | None, log: str) -> str:
    """The path of a copy of the output of `name` if a crash (`CRASHES`) ended it, else ""."""
    if not crashed(exitcode) or not log:
        return ""
    fd, path = tempfile.mkstemp(prefix=f"rekv-{name.replace(' ', '-')}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(log)
    return path


class Child:
    """A job in a process of its own, spawned (a fresh interpreter) in the environment `env`:
    its variables from the start, so JAX reads the GPUs, memory share and flags of `env`; on
    CPU its cores (`cores.children_on`). `handed`: (make, fields) of what its job is handed
    first, `make(*fields, connection)` (a group's `child.Member`). Its output goes to a log
    file in `logs`."""

    def __init__(self, name: str, job: Callable, args: tuple, env: Mapping[str, str],
                 logs: Path, handed: tuple[Callable, tuple] | None = None) -> None:
        self.name = name
        self._log = logs / f"{name.replace(' ', '-')}.log"
        self.conn, theirs = _SPAWN.Pipe()
        payload = pickle.dumps((job, args))  # unpickled there once its output is set up
        self._process = _SPAWN.Process(target=child.enter, args=(theirs, str(self._log), payload,
                                                                  handed), name=name, daemon=True)
        with _environment(env), children_on(env):
            self._process.start()
        theirs.close()
        self._said: tuple[str, object] | None = None  # its VALUE or RAISED message
        self._open = True  # its end of the connection is open
        self.ended: Ended | None = None

    @property
    def sentinel(self) -> int:
        return self._process.sentinel

    def waitables(self) -> list:
        """What to wait on for its next message or its end."""
        return [self.conn, self.sentinel] if self._open else [self.sentinel]

    def messages(self) -> list[tuple[str, object]]:
        """The messages it sent that were not read yet, its VALUE or RAISED noted (none once
        its connection closed)."""
        out = []
        try:
            while self._open and self.conn.poll():
                out.append(self.conn.recv())
        except (EOFError, OSError):
            self._open = False
        for kind, obj in out:
            if kind in (child.VALUE, child.RAISED):
                self._said = kind, obj
        return out

    def reap(self) -> Ended:
        """Its `Ended`, once its process exited (its messages already read)."""
        self._process.join()
        kind, said = self._said or (None, None)
        error, text = said if kind == child.RAISED else (None, "")
        log = self._log.read_text(errors="replace") if self._log.exists() else ""
        exitcode = self._process.exitcode
        self.ended = Ended(self.name, exitcode, said if kind == child.VALUE else None, error,
                           text, log, keep_crash_log(self.name, exitcode, log))
        self.conn.close()
        return self.ended

    def kill(self) -> None:
        """End it now (it is reaped by `reap`)."""
        if self._process.is_alive():
            self._process.kill()


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Inside, this process's environment is `env` (a child started now inherits it)."""
    with _environ_lock:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
