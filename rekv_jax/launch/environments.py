"""What each side of a pair (`pair_environments`), or each member of a group
(`group_environments`), gets on one machine, set before JAX starts in its process: its own GPU(s)
or a fair share of the visible ones, or on CPU its own cores; and what a side started by a
scheduler adds on a GPU (`scheduled_environment`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from rekv_jax.launch.child import member_names
from rekv_jax.transport.base import ROLES, Role
from rekv_jax.transport.cores import cpu_environments, split_cpus

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count="

# Added to XLA_FLAGS of both sides on a GPU (a flag the user already sets keeps the user's value).
# The decode side's recomputed suffix must be bitwise the prefill side's, so both processes must
# compile the same kernels. By default XLA:GPU autotunes: it times candidate GEMM/fusion configs
# and cuBLAS algorithms in each process and keeps the fastest, so two processes (on one busy GPU,
# or on two hosts) can choose differently. In XLA's autotuner (xla/service/gpu/autotuning/
# autotuner_pass.cc, openxla/xla) `xla_gpu_autotune_level=0` sets `select_first_config`, turns
# cuBLAS/cuDNN autotuning off and disables the fusion autotuner: every choice is a fixed rule of
# (HLO, device, library versions), which the sides agree on (`agree_runtime`), and nothing is
# timed. `xla_gpu_enable_triton_gemm=false`: at level 0 the Triton GEMM emitter takes its first
# tile config untimed, far slower than cuBLAS's choice; with it off, GEMMs go to cuBLAS, whose
# algorithm at level 0 is its own heuristic's (again a fixed rule).
# `xla_gpu_shard_autotuning=false`: with jax.distributed up, XLA would otherwise split
# autotuning across the processes and join the results through the coordinator, which assumes
# that every process compiles the same module (ours compile different programs). Not chosen:
# a shared `xla_gpu_per_fusion_autotune_cache_dir` (the two sides compile concurrently, so both
# may time and write the same entry), `xla_gpu_deterministic_ops` (run-to-run determinism within a
# process, e.g. no atomics). All three flags exist in the XLA of jaxlib 0.10.2 (their help
# strings are in libjax_common.so).
GPU_XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false",
                 "--xla_gpu_shard_autotuning=false")
# Device memory that the processes sharing one GPU take in all, split evenly: each reserves its
# own share as it starts, so none takes JAX's default 75% before the others start; 10% stays free
# for their CUDA contexts and cuDNN/cuBLAS workspaces outside JAX's pool.
SHARED_MEMORY = 0.9
PAIR_SHARE = SHARED_MEMORY / 2  # each side of a pair on one GPU


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


def group_environments(gpus: Sequence[str], env: Mapping[str, str], prefill: int, decode: int,
                       cpus: Sequence[int] | None) -> dict[str, dict[str, str]]:
    """The environment of each member of a group of `prefill` + `decode` processes on one
    machine, by name in process-id order (`child.member_names`), from the `gpus` visible there
    and the parent's environment `env`. No GPU: each its own run of `cpus` where there is a core
    each (`cores.split_cpus`, the prefill members' first), else all share them (`cpus` None:
    unpinned; there is no default, as a group left unpinned on CPUs computes each member on
    every core, not as the GPUs it emulates). A GPU each:
    each its own, whole, in process-id order (decode-0 the first). Fewer: all see every GPU and
    take SHARED_MEMORY / (prefill + decode) of their memory each. On a GPU all get
    GPU_XLA_FLAGS."""
    names = member_names(prefill, decode)
    if not prefill or not decode:
        raise ValueError(f"a group needs a prefill and a decode member, got {prefill} + {decode}")
    if not gpus:
        pinned = split_cpus(env, (*names[decode:], *names[:decode]), cpus)  # prefill first
        return {name: pinned[name] for name in names}
    base = {**env, "XLA_FLAGS": with_gpu_flags(env.get("XLA_FLAGS", ""))}
    if len(names) <= len(gpus):
        return {name: {**base, "CUDA_VISIBLE_DEVICES": gpu}
                for name, gpu in zip(names, gpus, strict=False)}
    shared = {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus),
              "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{SHARED_MEMORY / len(names):.3g}"}
    return {name: dict(shared) for name in names}


def scheduled_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a side a scheduler started (`--role`): `env`, with GPU_XLA_FLAGS on a
    GPU (the two sides, each started alike, then compile alike)."""
    if not visible_gpus(env):
        return dict(env)
    return {**env, "XLA_FLAGS": with_gpu_flags(env.get("XLA_FLAGS", ""))}


def with_host_devices(env: Mapping[str, str], n: int) -> dict[str, str]:
    """`env` asking XLA for `n` CPU devices (a sharded side on CPU; on a GPU the flag only
    affects the unused CPU platform). n <= 1: `env` as it is."""
    if n <= 1:
        return dict(env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICES_FLAG)]
    return {**env, "XLA_FLAGS": " ".join([*flags, f"{HOST_DEVICES_FLAG}{n}"])}
