"""The one door to JAX's private modules (`jax._src`): nothing else in the project imports them.

What passes through it, and why no public API serves:
- the distributed runtime's client and service (`jax._src.distributed.global_state`): the
  coordinator's key-value store, which the control connection is set up through, and an
  ordered shutdown after a failed connect;
- the client's error callback: JAX builds its client with a callback that aborts the process on
  any error it detects (a coordinator that never answers, or one that went away); while
  `initialize` runs, `client_errors_recorded` has the client built with ours instead, which
  records the error, so that connecting fails with an exception and a lost peer is reported like
  any other;
- whether the backends started (`jax._src.xla_bridge.backends_are_initialized`), which fixes the
  GPUs, memory share, XLA_FLAGS and threads a process computes with;
- the cuDNN version probe of JAX's fused attention, which the attention tests stub on CPU;
- the cluster detection of `jax.distributed.initialize` (`jax._src.clusters`: SLURM, Open MPI,
  ...), whose coordinator address and process id a run across nodes starts from (`cluster`).

Each is used as JAX 0.10-0.11 lays them out (`SUPPORTED`). Outside that range the error
callback and the backends check fall back to public behaviour (JAX's own aborting callback; the
backends counted as not started, which holds in a process the launcher spawned), and
`moved()` names what a supported JAX lacks (a test fails loudly on it)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import jax

SUPPORTED = ((0, 10), (0, 11))  # (major, minor) of the JAX versions laid out as used here
# module -> the attributes of it used here
USED = {"jax._src.distributed": ("_jax", "global_state"),
        "jax._src.xla_bridge": ("backends_are_initialized",),
        "jax._src.cudnn.fused_attention_stablehlo": ("check_cudnn_version",),
        "jax._src.clusters": ("ClusterEnv",)}
_CLIENT_FACTORY = "get_distributed_runtime_client"  # on `jax._src.distributed._jax`


def supported(version: str = jax.__version__) -> bool:
    """Whether `version` ("0.10.2") is in the range whose private layout is used here."""
    return tuple(int(p) for p in version.split(".")[:2]) in SUPPORTED


def moved() -> list[str]:
    """Every private name used here that this JAX lacks, as `module.attribute`."""
    missing = []
    for name, attributes in USED.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            missing.append(name)
            continue
        missing += [f"{name}.{a}" for a in attributes if not hasattr(module, a)]
    distributed = importlib.import_module("jax._src.distributed")
    if not hasattr(getattr(distributed, "_jax", None), _CLIENT_FACTORY):
        missing.append(f"jax._src.distributed._jax.{_CLIENT_FACTORY}")
    return missing


def _distributed() -> ModuleType:
    return importlib.import_module("jax._src.distributed")


def distributed_state() -> Any:
    """JAX's distributed runtime state: `.client`, `.service`, `.coordinator_address`."""
    return _distributed().global_state


@contextlib.contextmanager
def client_errors_recorded(record: Callable[[object], None]) -> Iterator[None]:
    """While JAX builds its distributed client, give it `record` as its error callback (in
    place of its default one, which aborts the process). Outside `SUPPORTED`, or where the
    layout moved, JAX keeps its own."""
    module = _distributed()
    lib = getattr(module, "_jax", None)
    make_client = getattr(lib, _CLIENT_FACTORY, None)
    if not supported() or make_client is None:
        yield
        return

    class _WithCallback:
        def __getattr__(self, name: str) -> object:
            return getattr(lib, name)

        @staticmethod
        def get_distributed_runtime_client(*args: object, **kwargs: object) -> object:
            return make_client(*args, missed_heartbeat_callback=record, **kwargs)

    module._jax = _WithCallback()
    try:
        yield
    finally:
        module._jax = lib


def backends_started() -> bool:
    """Whether JAX has started its backends in this process (after which CUDA_VISIBLE_DEVICES,
    the memory share and XLA_FLAGS are read and fixed). Outside `SUPPORTED`: False."""
    if not supported():
        return False
    return importlib.import_module("jax._src.xla_bridge").backends_are_initialized()


def cudnn_attention() -> ModuleType:
    """JAX's fused-attention module, whose `check_cudnn_version` asks the CUDA plugin."""
    return importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")


def cluster() -> tuple[str, int, int] | None:
    """(the coordinator's host:port, the process count, this process's id) as
    `jax.distributed.initialize` would detect them (SLURM, Open MPI, ...; `$JAX_COORDINATOR_PORT`
    overrides the port); None outside any cluster it knows."""
    envs = importlib.import_module("jax._src.clusters").ClusterEnv
    address, count, process_id, _ = envs.auto_detect_unset_distributed_params(
        None, None, None, None, None, None)
    return None if address is None else (address, count, process_id)
