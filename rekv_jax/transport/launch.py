"""Start the two processes of a loopback handoff on one machine, bounded in time, no strays;
and `supervise` one side, so that even a native abort ends in one line its user reads."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from rekv_jax.transport.base import ROLES, Role, TransportError

T = TypeVar("T")
SUPERVISED = "REKV_SUPERVISED"  # set in the environment of a supervised worker
# What JAX's client writes before it aborts its process because the coordination service (hosted
# by the decode side) went away; see distributed.py.
_SERVICE_GONE = ("Polled an error from coordination service", "detected fatal errors",
                 "Socket closed", "std::bad_cast")


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies (a supervised worker never
    outlives its supervisor). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def supervise(argv: list[str], name: str) -> None:
    """Run `argv` (one side of a handoff, with SUPERVISED set) to its end.

    The worker's stderr, native logs included, goes to a file; its own error line (`rekv ...
    error: ...`) is raised here as a TransportError, as is an abort because its peer went away or
    a signal that killed it, each in one line naming `name`. Returns if the worker succeeded."""
    with tempfile.TemporaryFile("w+") as log:
        worker = subprocess.Popen(argv, stderr=log, text=True, env={**os.environ, SUPERVISED: "1"})
        try:
            code = worker.wait()
        except BaseException:  # interrupted: the worker must not outlive us
            worker.kill()
            worker.wait()
            raise
        if code == 0:
            return
        log.seek(0)
        output = log.read()
    if said := _error_line(output):  # the worker's own line: bad input (2) or a failed run
        raise (ValueError if code == 2 else TransportError)(f"{name}: {said}")
    if any(sign in output for sign in _SERVICE_GONE):
        raise TransportError(f"{name} stopped: the decode side went away (its coordination "
                             "service stopped answering)")
    from rekv_jax.failures import exit_text

    raise TransportError(f"{name} {exit_text(code)}")


def _error_line(stderr: str) -> str | None:
    """The last `rekv ... error: WHY` line a command of ours wrote, as WHY."""
    said = [line.split("error: ", 1)[1] for line in stderr.splitlines()
            if line.startswith("rekv ") and "error: " in line]
    return said[-1] if said else None


def run_cli(argv: list[str], what: str, timeout: float, env: Mapping[str, str] | None = None
            ) -> str:
    """`python -m rekv_jax.cli *argv` in a child process; its stdout.

    A failure is one line naming `what`: ValueError for bad input (exit 2), TransportError for a
    failed run, TimeoutError past `timeout` s (the child is killed)."""
    from rekv_jax.failures import exit_text

    cmd = [sys.executable, "-m", "rekv_jax.cli", *argv]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what}: still running after {timeout:g} s (killed)") from None
    if out.returncode == 0:
        return out.stdout
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    why = _error_line(out.stderr) or f"{exit_text(out.returncode)} ({last})"
    raise (ValueError if out.returncode == 2 else TransportError)(f"{what}: {why}")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_prefill_child(argv: list[str], decode: Callable[[str], T], timeout: float) -> T:
    """Run `decode(coordinator)` here while a child process runs `argv + ["--coordinator",
    coordinator]` (the prefill side) over loopback; return what `decode` returns.

    The child is killed if it outlives the decode side by more than `timeout`. Its stderr is
    ours: its one error line reaches our user even if this process dies first. If it dies
    first, our error names how (exit status or signal)."""
    from rekv_jax.failures import exit_text

    coordinator = f"127.0.0.1:{free_port()}"
    child = subprocess.Popen([*argv, "--coordinator", coordinator], stdout=subprocess.DEVNULL,
                             text=True)
    try:
        out = decode(coordinator)
        child.wait(timeout=timeout)
    except BaseException as e:
        died = child.poll()  # None: still running, so the failure is ours
        if died is None:
            child.kill()
        child.wait()
        if died and isinstance(e, TransportError):  # the peer died: say how
            raise TransportError(f"the prefill process {exit_text(died)}") from e
        raise
    if child.returncode:
        raise TransportError(f"the prefill process {exit_text(child.returncode)}")
    return out


def run_pair(argv: Callable[[Role, str], list[str]], timeout: float,
             env: Mapping[str, str] | None = None) -> dict[Role, subprocess.CompletedProcess[str]]:
    """Run `argv(role, coordinator)` for both roles at once and wait for both.

    Raises TimeoutError (with both outputs) if either is still running after `timeout` s; every
    child is killed and reaped before this returns or raises."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs: dict[Role, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="rekv-pair-") as tmp:
        logs = {role: (Path(tmp) / f"{role}.out", Path(tmp) / f"{role}.err") for role in ROLES}
        try:
            for role in ROLES:
                out, err = logs[role]
                with open(out, "w") as o, open(err, "w") as e:
                    procs[role] = subprocess.Popen(argv(role, coordinator), stdout=o, stderr=e,
                                                   text=True, env=env)
            deadline = time.monotonic() + timeout
            late = []
            for role, p in procs.items():
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    late.append(role)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
        done = {role: subprocess.CompletedProcess(procs[role].args, procs[role].returncode,
                                                  logs[role][0].read_text(),
                                                  logs[role][1].read_text())
                for role in procs}
    if late:
        detail = "\n".join(f"--- {r} stdout:\n{c.stdout}\n--- {r} stderr:\n{c.stderr[-3000:]}"
                           for r, c in done.items())
        raise TimeoutError(f"{late} still running after {timeout:g}s (killed)\n{detail}")
    return done
