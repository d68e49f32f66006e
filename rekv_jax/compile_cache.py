"""The on-disk caches that make a second start fast: JAX's persistent compilation cache
(`use_compile_cache`, in every process that compiles: the router and each worker) and the
cached start profile (`profile_path`), both under one user cache folder (`cache_root`).

The folder is `$REKV_CACHE_DIR`, else `$XDG_CACHE_HOME/rekv-jax`, else `~/.cache/rekv-jax`;
`REKV_CACHE_DIR=none` turns both caches off. A program read back from the compilation cache is
the one XLA compiled for the same computation, options, backend and JAX version (JAX's own key),
so caching changes no result, only how long a start takes. A cached profile is keyed on what its
measurement depends on (`profile_key`): the model's files, the machine, this package's source and
the measurement's own parameters, so a change to any of them measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterable
from pathlib import Path

import jax

CACHE_ENV = "REKV_CACHE_DIR"  # the cache folder, or OFF
OFF = "none"
PACKAGE = Path(__file__).resolve().parent


def cache_root(env: dict[str, str] | None = None) -> Path | None:
    """The user cache folder (the module's docstring); None when the caches are off."""
    env = os.environ if env is None else env
    given = env.get(CACHE_ENV)
    if given == OFF:
        return None
    if given:
        return Path(given).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rekv-jax"


def compile_cache_env(folder: Path | None) -> dict[str, str]:
    """The environment that makes a child persist every program it compiles in `folder`,
    whatever its compile time or size (none: no change): JAX reads it when it is imported."""
    if folder is None:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(folder),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def use_compile_cache(root: Path | None = None) -> Path | None:
    """Turn JAX's persistent compilation cache on under `root` (default `cache_root()`) for
    this process and the children it starts after (`compile_cache_env` in its environment);
    the folder used (None: the caches are off). Call it before the process compiles anything:
    JAX opens the cache, or not, at its first compile."""
    root = cache_root() if root is None else root
    if root is None:
        return None
    folder = root / "jax"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.update(compile_cache_env(folder))
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def code_version() -> str:
    """A hash of this package's Python source: any edit to it is a new version."""
    files = sorted(PACKAGE.rglob("*.py"))
    return _digest(p.relative_to(PACKAGE).as_posix().encode() + p.read_bytes() for p in files)


def model_version(spec: str) -> str:
    """A hash of a model: its folder's files (a trained-model folder or `hf:PATH`), else the
    preset's name (a preset's weights follow from its name and seed)."""
    folder = Path(spec.removeprefix("hf:"))
    if not folder.is_dir():
        return _digest([spec.encode()])
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return _digest(p.relative_to(folder).as_posix().encode() + p.read_bytes() for p in files)


def machine() -> dict[str, object]:
    """What a measured cost depends on of this machine: its host, CPU, usable cores and JAX's
    devices."""
    devices = jax.devices()
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "jax": jax.__version__,
            "devices": [f"{d.platform}:{d.device_kind}" for d in devices]}


def profile_key(model: str, measurement: dict[str, object]) -> str:
    """The key of a start profile of `model` measured as `measurement` says, on this machine,
    by this package's code."""
    record = {"model": model_version(model), "machine": machine(), "code": code_version(),
              "measurement": measurement}
    return _digest([json.dumps(record, sort_keys=True).encode()])


def profile_path(root: Path, model: str, measurement: dict[str, object]) -> Path:
    """Where the start profile of `model` measured as `measurement` says is cached."""
    return root / "profiles" / f"{profile_key(model, measurement)}.jsonl"
