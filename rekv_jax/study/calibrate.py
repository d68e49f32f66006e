"""The paced link of the paper's regime on this machine: one suffix layer's time here sets the link
speed."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp

from rekv_jax import sizes
from rekv_jax.launch.group import run_child
from rekv_jax.model.loader import load_config, load_model
from rekv_jax.model.transformer import run_suffix
from rekv_jax.planning.planner import PAPER_LINK_GBPS
from rekv_jax.study.sweep_plan import PAPER_LINK_TO_SUFFIX
from rekv_jax.transport.cores import cpu_text, keep_freed_memory, usable_cpus


def suffix_layer_ms(model: str, seq_len: int, reps: int = 20) -> float:
    """Time of one suffix layer (`run_suffix` over all layers / L) on this machine: the median of
    `reps`, the statistic a handoff's phases are reported in, with the allocator a handoff's
    processes run with (`cores.keep_freed_memory`)."""
    keep_freed_memory()
    loaded = load_model(model)
    cfg, params = loaded.cfg, loaded.params
    h = jnp.zeros((1, seq_len, cfg.hidden_size), params["embed"].dtype)
    jax.block_until_ready(run_suffix(cfg, params, h, 0))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run_suffix(cfg, params, h, 0))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) / cfg.num_layers


@dataclasses.dataclass(frozen=True)
class LinkCalibration:
    """The paced link of the paper's regime for one model and length on this machine."""

    model: str
    seq_len: int
    suffix_layer_ms: float  # measured here
    kv_layer_bytes: int  # one BF16 KV layer
    link_gbps: float  # kv_layer_bytes takes PAPER_LINK_TO_SUFFIX x suffix_layer_ms on it
    cpus: str = ""  # the cores the layer was timed on (`cores.cpu_text`)

    def describe(self) -> str:
        where = f" on {self.cpus}" if self.cpus else ""
        return (f"paced {self.link_gbps:.4g} GB/s, the paper's regime: one BF16 KV layer "
                f"({self.kv_layer_bytes / sizes.MIB:.3g} MiB) takes {PAPER_LINK_TO_SUFFIX}x the "
                f"{self.suffix_layer_ms:.2f} ms of one suffix layer measured here{where} (the "
                f"paper's H100 path: 16 MiB at {PAPER_LINK_GBPS:.2f} GB/s = 7.23 ms vs ~6.3 ms "
                "per Qwen2.5-7B layer at 8K)")


def calibrate_link(model: str, seq_len: int) -> LinkCalibration:
    """The link speed whose BF16-layer time is PAPER_LINK_TO_SUFFIX x a suffix layer here.

    Runs JAX in this process: call it before, or away from, `jax.distributed` initialization."""
    cfg = load_config(model)
    layer_ms = suffix_layer_ms(model, seq_len)
    kv = sizes.kv_layer_bytes(cfg, seq_len)
    return LinkCalibration(cfg.name, seq_len, layer_ms, kv,
                           kv / (PAPER_LINK_TO_SUFFIX * layer_ms * 1e6), cpu_text(usable_cpus()))


def calibrate_link_in_child(model: str, seq_len: int, env: dict[str, str] | None = None,
                            timeout: float = 600.0) -> LinkCalibration:
    """`calibrate_link` in a fresh process (`launch.run_child`: a process that runs a real
    transport must initialize jax.distributed before any JAX work, and a launching process does
    none), in `env`: the decode side's (`side_environments`), so it times a layer on that
    side's cores."""
    return run_child(calibrate_link, model, seq_len, env=os.environ if env is None else env,
                     what="link calibration", timeout=timeout)
