"""Start the two processes of a loopback handoff on one machine, bounded in time, no strays."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rekv_jax.transport.base import ROLES, Role


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
