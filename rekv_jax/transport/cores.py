"""Each side of a CPU pair (each process of a group) on one machine on its own cores, so that
all compute at once, as GPUs do. `launch.environments` splits the cores (`split_cpus`);
environment variables carry the split; the launcher starts each side's process on its side's
cores (`children_on`: Linux CPU affinity, which a child inherits). Where affinity cannot be set,
or there is less than a core each, the processes share the cores and say so.

A side's cores are its *device*: only the threads of JAX's CPU backend, which run its programs,
stay on them (`start_device`). Every other thread (Python's, the transport's, the coordination
client's) is a *host* thread and may run on any of the pair's cores, as a GPU node's host threads
run on its CPUs and never on the GPU's SMs: a receive, a checksum or a dispatch then takes an
idle core (the other side's, between its programs) instead of the core a suffix computes on.
`CoreUse` measures what a device's threads lost to others over an interval."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence

from rekv_jax.transport.base import ROLES, Role

CPUS_ENV = "REKV_CPUS"  # the CPU ids this side computes on (its device), a comma list
# XLA:CPU sizes its client's pools by this (else by the cores it may use). With a thread per
# core, a transfer server's copy of a buffer waits behind the program the device runs (a pinned
# prefill side would hold a handoff's bytes until its next prompt is computed); one thread more
# than the side's cores lets a copy run beside a program, as a GPU's copy engines run beside
# its SMs. A value the user sets is kept.
THREADS_ENV = "PJRT_NPROC"
HOST_CPUS_ENV = "REKV_HOST_CPUS"  # the CPU ids its host threads may use: every process's
PINNING_ENV = "REKV_PINNING"  # the pair's split in words, for the header and the records
SHARED = "cores shared"


def usable_cpus() -> list[int]:
    """The CPUs this process may run on; none where affinity cannot be set (not Linux)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []


def cpu_text(cpus: Sequence[int]) -> str:
    """`cpu 3`, `cpus 0-3`, `cpus 0,2`."""
    ids = sorted(cpus)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"cpus {ids[0]}-{ids[-1]}"
    return f"cpu{'s' * (len(ids) > 1)} {','.join(map(str, ids))}"


def cpu_environments(env: Mapping[str, str], cpus: Sequence[int] | None
                     ) -> dict[Role, dict[str, str]]:
    """Each CPU side's environment: `env` with its own half of `cpus` (the prefill side the
    first half, the decode side the rest, which runs the receive thread too) in CPUS_ENV, and
    the split in PINNING_ENV. `cpus` None (`--no-pin`) or fewer than two: both share the cores."""
    return split_cpus(env, ROLES, cpus)


def split_cpus(env: Mapping[str, str], names: Sequence[str], cpus: Sequence[int] | None
               ) -> dict[str, dict[str, str]]:
    """Each process's environment, by name: `env` with its own run of `cpus` in CPUS_ENV, runs
    in the order of `names` (q = len(cpus) // n cores each, the last len(cpus) % n processes
    one more: a decode process, named last, runs the receive thread too), every core in
    HOST_CPUS_ENV, XLA's threads in THREADS_ENV (one more than its cores, unless `env` sets
    it), the split in words in PINNING_ENV. `cpus` None (`--no-pin`) or fewer than
    one core each: all share the cores."""
    base = {k: v for k, v in env.items() if k not in (CPUS_ENV, HOST_CPUS_ENV)}
    n = len(names)
    if cpus is None or len(cpus) < max(n, 2):
        why = (" (one core: nothing to pin)" if cpus is not None and len(cpus) == 1 else
               f" ({len(cpus)} cores for {n} processes)" if cpus else "")
        return {name: {**base, PINNING_ENV: SHARED + why} for name in names}
    q, extra = divmod(len(cpus), n)
    mine, start = {}, 0
    for i, name in enumerate(names):
        stop = start + q + (i >= n - extra)
        mine[name], start = list(cpus[start:stop]), stop
    split = "pinned: " + ", ".join(f"{name} {cpu_text(mine[name])}" for name in names)
    own = bool({THREADS_ENV, "NPROC"} & base.keys())  # the user's (XLA reads NPROC after it)
    return {name: {**({} if own else {THREADS_ENV: str(len(mine[name]) + 1)}), **base,
                   CPUS_ENV: ",".join(map(str, mine[name])),
                   HOST_CPUS_ENV: ",".join(map(str, cpus)), PINNING_ENV: split}
            for name in names}


def _cpus(env: Mapping[str, str], name: str = CPUS_ENV) -> set[int] | None:
    return {int(c) for c in env[name].split(",")} if env.get(name) else None


def pin_process(env: Mapping[str, str]) -> None:
    """Run every thread of this process, and so every thread and child it starts later, on the
    cores of `env` (CPUS_ENV; none given: no change). Call it before JAX starts its thread pool,
    which is sized by the cores it may use."""
    cpus = _cpus(env)
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def children_on(env: Mapping[str, str]) -> Iterator[None]:
    """Inside, a child this thread starts runs on the cores of `env` (it inherits the calling
    thread's affinity); the thread's own cores come back after."""
    cpus = _cpus(env)
    if cpus is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


# ---------------------------------------------------------------------------- device and host


_device_cpus: frozenset[int] | None = None  # this side's device cores, once `start_device` split


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def start_device(env: Mapping[str, str]) -> None:
    """Start JAX's backend in this process and, on a pinned CPU side (`env` names its host cores,
    HOST_CPUS_ENV), free every thread but the backend's to run on the host cores. Call it once
    the process is pinned (`pin_process`) and before the backend starts: the threads it starts,
    and the threads they start, are this side's device. Elsewhere (GPUs, unpinned, already
    started) it only starts the backend."""
    global _device_cpus
    import jax

    from rekv_jax.jax_private import backends_started

    device, host = _cpus(env), _cpus(env, HOST_CPUS_ENV)
    if device is None or host is None or backends_started() or not usable_cpus():
        jax.devices()
        return
    keep_freed_memory()
    before = _thread_ids()
    jax.devices()  # the backend's threads run every program of this process: the device
    for tid in before:  # a thread they start later inherits the host cores
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, host)
    _device_cpus = frozenset(device)


def keep_freed_memory() -> None:
    """Have this process's allocator keep what a program frees for the next one, as a GPU's
    caching allocator does, instead of handing it back to the kernel and faulting it in again
    (glibc: no mmap'd chunks, no trimming). A CPU device's buffers are malloc'd: without this, a
    program's CPU time varies from run to run with the pages it faults in, which depends on the
    allocator's history, not on the program. A no-op where malloc is not glibc's."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@dataclasses.dataclass(frozen=True)
class CoreUse:
    """CPU time of this process's threads over an interval, ms (Linux per-thread schedstat)."""

    device_ms: float  # the device's threads (those on the device cores only) ran
    device_wait_ms: float  # they were ready to run but waited for their core
    host_ms: float  # every other thread of this process ran (on any core it may use)

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in dataclasses.asdict(self).items()}


ThreadTimes = dict[int, tuple[int, int, bool]]  # thread id -> (ns run, ns waited, on the device)


def thread_times() -> ThreadTimes | None:
    """Each thread's CPU time so far and whether it is the device's; None where the device is not
    known (no `start_device` split in this process)."""
    if _device_cpus is None:
        return None
    times = {}
    for tid in _thread_ids():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
            times[tid] = int(run), int(wait), os.sched_getaffinity(tid) <= _device_cpus
    return times


def core_use(before: ThreadTimes | None, after: ThreadTimes | None) -> CoreUse | None:
    """What the threads used between two `thread_times` (None if either is)."""
    if before is None or after is None:
        return None
    ms = {True: [0.0, 0.0], False: [0.0, 0.0]}  # on the device: [run, wait]
    for tid, (run, wait, on_device) in after.items():
        run0, wait0, _ = before.get(tid, (0, 0, on_device))
        ms[on_device][0] += (run - run0) / 1e6
        ms[on_device][1] += (wait - wait0) / 1e6
    return CoreUse(ms[True][0], ms[True][1], ms[False][0])
