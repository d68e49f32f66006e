"""Dead or unreachable peers end in one line within the timeout; finished summaries are kept.

Real processes over loopback only (127.0.0.1), kept short: one or two tiny actions, one rep."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rekv_jax.errors import describe, exit_text
from rekv_jax.launch.environments import pair_environments
from rekv_jax.launch.group import free_port
from rekv_jax.transport.cores import CPUS_ENV, usable_cpus

HANDOFF = [sys.executable, "-m", "rekv_jax.cli", "handoff", "--seq-len", "16", "--warmup", "0",
           "--reps", "1"]
NATIVE_CRASH = ("Traceback", "Check failure", "terminate called", "Aborted")


def error_lines(stderr: str) -> list[str]:
    return [line.split("rekv handoff: error: ", 1)[1] for line in stderr.splitlines()
            if "rekv handoff: error: " in line]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_unreachable_coordinator_is_one_line_within_the_timeout(role):
    # nobody listens on this loopback port: the decode side hosts it and no prefill side comes;
    # a prefill side finds nobody there
    timeout = 4
    start = time.monotonic()
    out = subprocess.run(HANDOFF + ["--actions", "bf16:full", "--role", role, "--coordinator",
                                    f"127.0.0.1:{free_port()}", "--timeout", str(timeout),
                                    "--insecure"],
                         capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stderr[-3000:]
    assert not any(s in out.stderr for s in NATIVE_CRASH), out.stderr[-3000:]
    (line,) = error_lines(out.stderr)
    assert ("did not join" if role == "decode" else "did not answer within 4s") in line, line
    # JAX's own registration wait overshoots its timeout by ~5 s; process start-up under load
    # (2 shared cores) takes the rest of the margin
    assert elapsed < timeout + 60


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _sides(pid: int) -> dict[str, int]:
    """The launched sides among `pid`'s children, by role (told apart by their cores)."""
    cpus = pair_environments([], {}, cpus=usable_cpus())
    mine = {env[CPUS_ENV]: role for role, env in cpus.items()}
    sides = {}
    for child in _children(pid):
        with open(f"/proc/{child}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        if CPUS_ENV.encode() in env:
            sides[mine[env[CPUS_ENV.encode()].decode()]] = child
    return sides


def _start_pair_and_kill(victim: str) -> tuple[subprocess.Popen, str, str, list[int]]:
    """Run a two-action handoff, kill `victim` (the prefill or decode side, or the launching
    process) once the first summary is out; return the launching process, its whole stdout and
    stderr, and the sides' pids."""
    # 50 reps: the second action is still running when the kill lands (its programs compile
    # before the first rep, so one rep of it can finish before the first summary is read)
    cmd = HANDOFF + ["--actions", "bf16:full,bf16:recompute", "--timeout", "30", "--reps", "50"]
    proc = subprocess.Popen(cmd + ["--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    while not any('"summary"' in line for line in lines):
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=60)[1][-3000:]
        lines.append(line)
    sides = _sides(proc.pid)
    assert set(sides) == {"prefill", "decode"}, sides
    os.kill(sides.get(victim, proc.pid), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    return proc, "".join(lines) + out, err, list(sides.values())


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="the sides are told apart by their cores")
@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_killed_side_is_named_and_finished_summaries_are_kept(victim):
    proc, out, err, sides = _start_pair_and_kill(victim)
    assert proc.returncode == 1, err[-3000:]
    assert not any(s in err for s in NATIVE_CRASH), err[-3000:]
    assert error_lines(err) == [f"{victim}-0 was killed by SIGKILL"], err[-3000:]
    summaries = [json.loads(line) for line in out.splitlines() if '"summary"' in line]
    assert [s["action"] for s in summaries] == ["bf16:full"]
    assert summaries[0]["cache_check"] == "bitwise"
    assert not any(_running(pid) for pid in sides)  # nothing stays behind


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="the sides are told apart by their cores")
def test_sides_do_not_outlive_their_launcher():
    proc, _, err, sides = _start_pair_and_kill("launcher")
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in sides) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_running(pid) for pid in sides)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is only a record
    except OSError:
        return False


def test_out_of_memory_is_named_with_its_size():
    told = describe(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                 "153600000000 bytes.\nmore detail"))
    assert told.status == 1
    assert told.line.startswith("out of memory (143.1 GiB requested; RESOURCE_EXHAUSTED")
    assert "\n" not in told.line


def test_exit_text_names_the_signal():
    assert exit_text(-9) == "was killed by SIGKILL" and exit_text(3) == "exited with status 3"
