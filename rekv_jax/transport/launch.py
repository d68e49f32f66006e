"""Start the two processes of a loopback handoff on one machine, bounded in time, no strays,
each with its own GPU or a fair share of one (`pair_environments`); `supervise` one side, so
that even a native abort ends in one line its user reads; and check that the two sides run the
same software on the same kind of device (`agree_runtime`)."""

from __future__ import annotations

import ctypes
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rekv_jax.errors import RuntimeMismatch, TransportError
from rekv_jax.transport.base import ROLES, Role, Transport
from rekv_jax.transport.cores import children_on, cpu_environments, pin_process

T = TypeVar("T")
SUPERVISED = "REKV_SUPERVISED"  # set in the environment of a supervised worker
# What JAX's client writes before it aborts its process because the coordination service (hosted
# by the decode side) went away; see distributed.py.
_SERVICE_GONE = ("Polled an error from coordination service", "detected fatal errors",
                 "Socket closed", "std::bad_cast")

# Added to XLA_FLAGS of both sides on a GPU (a flag the user already sets keeps the user's value).
# The decode side's recomputed suffix must be bitwise the prefill side's, so both processes must
# compile the same kernels. By default XLA:GPU autotunes: it times candidate GEMM/fusion configs
# and cuBLAS algorithms in each process and keeps the fastest, so two processes (on one busy GPU,
# or on two hosts) can choose differently. In XLA's autotuner (xla/service/gpu/autotuning/
# autotuner_pass.cc, openxla/xla) `xla_gpu_autotune_level=0` sets `select_first_config`, turns
# cuBLAS/cuDNN autotuning off and disables the fusion autotuner: every choice is a fixed rule of
# (HLO, device, library versions), which the sides agree on (`agree_runtime`), and nothing is
# timed. `xla_gpu_shard_autotuning=false`: with jax.distributed up, XLA would otherwise split
# autotuning across the processes and join the results through the coordinator, which assumes
# that every process compiles the same module (ours compile different programs). Not chosen:
# a shared `xla_gpu_per_fusion_autotune_cache_dir` (the two sides compile concurrently, so both
# may time and write the same entry), `xla_gpu_deterministic_ops` (run-to-run determinism within a
# process, e.g. no atomics; it also disables the Triton GEMM backend). Both flags exist in the
# XLA of jaxlib 0.10.2 (their help strings are in libjax_common.so). Their cost in speed on a GPU
# is not measured here.
GPU_XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_shard_autotuning=false")
# Device-memory fraction of each side when both share one GPU: each reserves its own share as it
# starts, so neither takes JAX's default 75% before the other starts; 10% stays free for the two
# CUDA contexts and cuDNN/cuBLAS workspaces outside JAX's pool.
PAIR_SHARE = 0.45
# XLA_FLAGS entries that legitimately differ between the sides (host-device counts of sharded
# CPU sides, `sharding.force_host_devices`)
_PER_SIDE_FLAGS = ("--xla_force_host_platform_device_count=",)


def visible_gpus(env: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs a JAX process started with `env` would see, as CUDA_VISIBLE_DEVICES entries,
    found without starting JAX (whose GPU backend would reserve their memory):
    $CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`, else /proc/driver/nvidia/gpus. None when
    $JAX_PLATFORMS leaves CUDA out."""
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
        return []
    if "CUDA_VISIBLE_DEVICES" in env:
        listed = []
        for entry in (e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",")):
            if not entry or entry.startswith("-"):  # CUDA ignores an invalid entry and the rest
                break
            listed.append(entry)
        return listed
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return [str(i) for i, _ in enumerate(
                line for line in out.stdout.splitlines() if line.startswith("GPU "))]
    except (OSError, subprocess.TimeoutExpired):
        pass
    proc = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(proc.iterdir())))] if proc.is_dir() else []


def with_gpu_flags(xla_flags: str) -> str:
    """`xla_flags` (an XLA_FLAGS value) with each of GPU_XLA_FLAGS it does not set appended."""
    given = {f.split("=", 1)[0] for f in xla_flags.split()}
    return " ".join([*xla_flags.split(),
                     *(f for f in GPU_XLA_FLAGS if f.split("=", 1)[0] not in given)])


def pair_environments(gpus: Sequence[str], env: Mapping[str, str],
                      devices: Mapping[Role, int] | None = None,
                      transport: str = "transfer-server", share: float = PAIR_SHARE,
                      cpus: Sequence[int] | None = None) -> dict[Role, dict[str, str]]:
    """The environment of each side of a pair that one command starts on one machine, from the
    `gpus` visible there (`visible_gpus`) and the parent's environment `env`.

    `devices`: the devices each side computes on (default 1 each; a decode side that checks
    against sharded sides needs max(N, M)). No GPU: both get `env`, each with its own half of
    `cpus` (`cores.cpu_environments`; None: they share the cores). Enough GPUs for
    both: each side its own, whole (CUDA_VISIBLE_DEVICES: the decode side the first ones, the
    prefill side the next). Fewer: both see the same GPUs and take `share` of their memory each
    (XLA_PYTHON_CLIENT_MEM_FRACTION, replacing any given: two processes taking one larger
    fraction is the race this prevents); the collective transport is refused there (ValueError),
    as NCCL cannot run both ranks on one device. On a GPU both get GPU_XLA_FLAGS."""
    need = {"decode": 1, "prefill": 1, **(devices or {})}
    if not gpus:
        return cpu_environments(env, cpus)
    base = {**env, "XLA_FLAGS": with_gpu_flags(env.get("XLA_FLAGS", ""))}
    if need["decode"] + need["prefill"] <= len(gpus):
        first = list(gpus[:need["decode"]])
        mine = {"decode": first, "prefill": list(gpus[len(first):len(first) + need["prefill"]])}
        return {role: {**base, "CUDA_VISIBLE_DEVICES": ",".join(mine[role])} for role in ROLES}
    if transport == "collective":
        raise ValueError(
            f"--transport collective needs a GPU per side (NCCL cannot put both ranks on one "
            f"device): {len(gpus)} visible, the sides need {need['decode']} + "
            f"{need['prefill']}; use --transport transfer-server, or more GPUs")
    shared = {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus),
              "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{share:g}"}
    return {role: dict(shared) for role in ROLES}


def become(env: Mapping[str, str]) -> None:
    """Give this process the environment `env` (its side's, from `pair_environments`) and, on
    CPU, its cores before JAX starts its backends, which read the GPUs, the memory share,
    XLA_FLAGS and the cores once. A RuntimeError (a bug in the caller) if they already started
    and `env` changes anything."""
    changed = {k for k in env.keys() | os.environ.keys() if env.get(k) != os.environ.get(k)}
    if changed:
        from rekv_jax.transport.distributed import backends_started

        if backends_started():
            raise RuntimeError(f"JAX started before this side's environment was set: "
                               f"{sorted(changed)}")
    for key in changed:
        if key in env:
            os.environ[key] = env[key]
        else:
            del os.environ[key]
    pin_process(env)


def start_side() -> None:
    """Called by each side's process, whoever started it (our launcher, or a scheduler with
    `--role`), before JAX starts: on a GPU, GPU_XLA_FLAGS join XLA_FLAGS."""
    if visible_gpus():
        become({**os.environ, "XLA_FLAGS": with_gpu_flags(os.environ.get("XLA_FLAGS", ""))})


def runtime(attention: str) -> dict[str, Any]:
    """What decides the bits of this process's programs, beyond the experiment itself."""
    import jax
    import jaxlib

    device = jax.local_devices()[0]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith(_PER_SIDE_FLAGS)]
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": f"{device.platform} {device.client.platform_version}",
            "device_kind": device.device_kind, "xla_flags": " ".join(flags),
            "attention": attention}


def agree_runtime(transport: Transport, attention: str, timeout: float, tag: str = "runtime"
                  ) -> None:
    """Both sides compare `runtime(attention)` under `tag` before any handoff; RuntimeMismatch on
    both, one line naming what differs."""
    try:
        transport.agree(tag, runtime(attention), timeout)
    except ValueError as e:
        raise RuntimeMismatch(f"{e} (the decode side's recomputed suffix would not be bitwise "
                              "the prefill side's)") from None


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
    from rekv_jax.errors import exit_text

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
    cmd = [sys.executable, "-m", "rekv_jax.cli", *argv]
    try:
        with children_on(env or {}):  # on a side's cores, where `env` names them
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what}: still running after {timeout:g} s (killed)") from None
    if out.returncode == 0:
        return out.stdout
    raise _cli_failure(what, out.returncode, out.stderr)


def _cli_failure(what: str, code: int, stderr: str) -> Exception:
    """The one-line error of a command of ours that exited with `code`: ValueError for bad
    input (exit 2), else TransportError; its own error line, else how it ended."""
    from rekv_jax.errors import exit_text

    last = (stderr.strip().splitlines() or ["no output"])[-1]
    why = _error_line(stderr) or f"{exit_text(code)} ({last})"
    return (ValueError if code == 2 else TransportError)(f"{what}: {why}")


class CliSession:
    """`python -m rekv_jax.cli *argv` kept running to serve requests: `ask` writes one line to
    its stdin and returns the lines it prints until the line `end`; `close` ends its stdin and
    waits for it. Failures are one line naming `what`, as `run_cli`'s (it is killed first
    where it still runs)."""

    def __init__(self, argv: list[str], what: str, env: Mapping[str, str] | None = None) -> None:
        self._what = what
        self._error: Exception | None = None
        self._log = tempfile.TemporaryFile("w+")  # its stderr: native logs can be long
        self._proc = subprocess.Popen([sys.executable, "-m", "rekv_jax.cli", *argv],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="rekv-session", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # it closed its stdout: it ended

    def ask(self, line: str, end: str, timeout: float) -> list[str]:
        """Send `line`; the lines it answers before `end`, within `timeout` s. Once it failed,
        every call raises that failure."""
        if self._error is not None:
            raise self._error
        deadline = time.monotonic() + timeout
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._failure() from None
        out = []
        while True:
            try:
                got = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._kill()
                self._error = TimeoutError(f"{self._what}: no answer after {timeout:g} s "
                                           "(killed)")
                raise self._error from None
            if got is None:
                raise self._failure()
            if got == end:
                return out
            out.append(got)

    def close(self, timeout: float = 60.0) -> None:
        """End its input and wait for it; the error of a failed exit not yet raised by `ask`."""
        if self._error is not None:
            return
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            raise TimeoutError(f"{self._what}: still running {timeout:g} s after its input "
                               "ended (killed)") from None
        except BrokenPipeError:
            pass
        if self._proc.wait():
            raise self._failure()
        self._log.close()

    def _failure(self) -> Exception:
        """Its error, once it ended (each later call: the same error)."""
        if self._error is None:
            code = self._proc.wait()
            self._log.seek(0)
            self._error = _cli_failure(self._what, code, self._log.read())
        return self._error

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def __enter__(self) -> CliSession:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        if kind is None:
            self.close()
        else:  # the caller's error wins: no one is left to ask it anything
            self._kill()


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_prefill_child(argv: list[str], decode: Callable[[str], T], timeout: float,
                       envs: Mapping[Role, Mapping[str, str]]) -> T:
    """Run `decode(coordinator)` here while a child process runs `argv + ["--coordinator",
    coordinator]` (the prefill side) over loopback; return what `decode` returns.

    Each side runs in its environment of `envs` (`pair_environments`: its GPUs or share, or
    its cores); this process takes its own before JAX starts, so call this before any JAX
    computation. The child is killed if it outlives the decode side by more than `timeout`.
    Its stderr is ours: its one error line reaches our user even if this process dies first.
    If it dies first, our error names how (exit status or signal)."""
    from rekv_jax.errors import exit_text

    become(envs["decode"])
    coordinator = f"127.0.0.1:{free_port()}"
    with children_on(envs["prefill"]):
        child = subprocess.Popen([*argv, "--coordinator", coordinator],
                                 stdout=subprocess.DEVNULL, text=True, env=envs["prefill"])
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


def pair_record(argv: Callable[[Role, str], list[str]], what: str, timeout: float = 600.0) -> str:
    """Run both sides of a benchmark script (`run_pair`) and return the first JSON line the
    decode side printed; a side that failed is a TransportError naming it, with its stderr."""
    done = run_pair(argv, timeout)
    for role, proc in done.items():
        if proc.returncode:
            raise TransportError(f"{what} {role} failed:\n{proc.stderr[-3000:]}")
    return next(line for line in done["decode"].stdout.splitlines() if line.startswith("{"))
