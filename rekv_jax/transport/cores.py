"""Each side of a CPU pair on one machine on its own cores, so that both compute at once, as two
GPUs do (otherwise the prefill process, the decode side's suffix and its receive thread all share
every core). `launch.pair_environments` splits the cores; two environment variables carry the
split; the launcher pins its own process and starts each child on its side's cores (Linux CPU
affinity, which a child inherits). Where affinity cannot be set, or there is one core, the sides
share the cores and say so."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from rekv_jax.transport.base import ROLES, Role

CPUS_ENV = "REKV_CPUS"  # the CPU ids this side runs on, a comma list
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
    base = {k: v for k, v in env.items() if k != CPUS_ENV}
    if cpus is None or len(cpus) < 2:
        why = " (one core: nothing to pin)" if cpus is not None and len(cpus) == 1 else ""
        return {role: {**base, PINNING_ENV: SHARED + why} for role in ROLES}
    half = len(cpus) // 2
    mine = {"prefill": list(cpus[:half]), "decode": list(cpus[half:])}
    split = f"pinned: prefill {cpu_text(mine['prefill'])}, decode {cpu_text(mine['decode'])}"
    return {role: {**base, CPUS_ENV: ",".join(map(str, mine[role])), PINNING_ENV: split}
            for role in ROLES}


def _cpus(env: Mapping[str, str]) -> set[int] | None:
    return {int(c) for c in env[CPUS_ENV].split(",")} if env.get(CPUS_ENV) else None


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
