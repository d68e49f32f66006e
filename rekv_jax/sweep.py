"""`rekv profile` and `rekv sweep`: measured handoffs over models x lengths x actions (paper §4).

Every measurement is one `rekv handoff` run (two processes over the chosen transport) in a
subprocess, so each gets fresh `jax.distributed` state and this process stays free to time the
suffix for link calibration. Profiles are fitted from the sequential schedule (phases measured
without contention) and predict every measured action; `rekv_jax.report` turns the records into
Table 1 / Fig. 2 / Table 3 / crossover outputs.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from rekv_jax import costmodel, report, sizes
from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.experiment import Experiment
from rekv_jax.loader import load_config, load_model
from rekv_jax.model import run_suffix
from rekv_jax.planner import PAPER_LINK_GBPS
from rekv_jax.summary import Summary

# The paper's H100 path (§4, Table 3; Qwen2.5-7B, 8K): one BF16 KV layer (16 MiB) takes 7.23 ms
# on the 2.32 GB/s link, and one suffix layer about 6.3 ms (216.31 ms sequential = 25.3 ms
# boundary + 15 x 7.23 ms prefix + 13 suffix layers + join). Link time per BF16 layer over suffix
# time per layer is therefore ~1.15; the CPU preset paces its link to the same ratio.
PAPER_LINK_TO_SUFFIX = 1.15


@dataclasses.dataclass(frozen=True)
class SweepPreset:
    """Where a sweep runs: its models, prompt lengths, cut grid, transport and link."""

    models: tuple[str, ...]
    lengths: tuple[int, ...]
    suffix_lens: tuple[int, ...]  # r grid of recompute-only and joint actions
    transport: str
    link_gbps: float | None  # None: calibrate to PAPER_LINK_TO_SUFFIX on this machine
    crossover_factors: tuple[float, ...]  # crossover links, as multiples of the sweep's link
    joint_bits: tuple[int, ...] = (8, 4)

    def __post_init__(self) -> None:
        if len(set(self.suffix_lens)) < 2:
            raise ValueError("a sweep needs at least two suffix lengths to fit its cost model")


SWEEP_PRESETS = {
    # Scaled: 6-layer models at 128-512 tokens; runs in minutes on 2 CPU cores.
    "cpu": SweepPreset(models=("tiny", "tiny-qwen3"), lengths=(128, 256, 512),
                       suffix_lens=(1, 2, 4), transport="transfer-server", link_gbps=None,
                       crossover_factors=(0.25, 1.0, 4.0, 16.0)),
    # The paper's shapes (synthetic weights, one layer's weights repeated) on one GPU: both
    # sides share the device in one process, the link paced to the paper's measured 2.32 GB/s.
    "gpu": SweepPreset(models=("qwen2.5-3b", "qwen2.5-7b", "qwen3-8b"), lengths=(512, 2048, 8192),
                       suffix_lens=(13, 21), transport="local",
                       link_gbps=PAPER_LINK_GBPS,
                       crossover_factors=(0.5, 1.0, 4.0, 16.0)),
}


def action_grid(cfg: ModelConfig, suffix_lens: tuple[int, ...], joint_bits: tuple[int, ...]
                ) -> list[Action]:
    """BF16 / Q8 / Q4 transfer-only, BF16 recompute-only and joint actions over the r grid, and
    full recomputation."""
    L = cfg.num_layers
    rs = [r for r in suffix_lens if 0 < r < L]
    actions = [Action(b, L, L) for b in (16, 8, 4)]
    actions += [Action(b, L - r, L) for b in (16, *joint_bits) for r in rs]
    return actions + [Action(16, 0, L)]


def run_experiment(exp: Experiment, cache_dir: Path | None = None, timeout: float = 1800.0
                   ) -> list[Summary]:
    """One `rekv handoff --json` run (both processes); its summary records.

    With `cache_dir`, compiled programs persist there, so the two sides and later runs of the
    same shapes compile each program once (compilation is not part of any timed interval)."""
    cmd = [sys.executable, "-m", "rekv_jax.cli", "handoff", "--json", "--experiment",
           exp.to_json()]
    env = None if cache_dir is None else {
        **os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode:
        raise RuntimeError(f"handoff run failed ({exp.model}, {exp.seq_len}):\n"
                           f"{out.stderr[-3000:]}")
    records = [json.loads(line) for line in out.stdout.splitlines()]
    return [Summary.from_json(r) for r in records if r["kind"] == "summary"]


def suffix_layer_ms(model: str, seq_len: int, reps: int = 20) -> float:
    """Time of one suffix layer (`run_suffix` over all layers / L) on this machine: the fastest
    of `reps`, i.e. the uncontended cost, so other load on the machine does not slow the link."""
    loaded = load_model(model)
    cfg, params = loaded.cfg, loaded.params
    h = jnp.zeros((1, seq_len, cfg.hidden_size), params["embed"].dtype)
    jax.block_until_ready(run_suffix(cfg, params, h, 0))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run_suffix(cfg, params, h, 0))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times) / cfg.num_layers


@dataclasses.dataclass(frozen=True)
class LinkCalibration:
    """The paced link of the paper's regime for one model and length on this machine."""

    model: str
    seq_len: int
    suffix_layer_ms: float  # measured here
    kv_layer_bytes: int  # one BF16 KV layer
    link_gbps: float  # kv_layer_bytes takes PAPER_LINK_TO_SUFFIX x suffix_layer_ms on it

    def describe(self) -> str:
        return (f"paced {self.link_gbps:.4g} GB/s, the paper's regime: one BF16 KV layer "
                f"({self.kv_layer_bytes / sizes.MIB:.3g} MiB) takes {PAPER_LINK_TO_SUFFIX}x the "
                f"{self.suffix_layer_ms:.2f} ms of one suffix layer measured here (the paper's "
                f"H100 path: 16 MiB at {PAPER_LINK_GBPS:.2f} GB/s = 7.23 ms vs ~6.3 ms per "
                "Qwen2.5-7B layer at 8K)")


def calibrate_link(model: str, seq_len: int) -> LinkCalibration:
    """The link speed whose BF16-layer time is PAPER_LINK_TO_SUFFIX x a suffix layer here.

    Runs JAX in this process: call it before, or away from, `jax.distributed` initialization."""
    cfg = load_config(model)
    layer_ms = suffix_layer_ms(model, seq_len)
    kv = sizes.kv_layer_bytes(cfg, seq_len)
    return LinkCalibration(cfg.name, seq_len, layer_ms, kv,
                           kv / (PAPER_LINK_TO_SUFFIX * layer_ms * 1e6))


def fit(cfg: ModelConfig, records: list[Summary]) -> costmodel.Profile:
    """A profile from the uncontended (sequential / single-mechanism) summaries of one setup."""
    uncontended = [r for r in records if r.schedule != "overlapped"]
    first = uncontended[0]
    link = f"{first.transport} {report.link_label(first.link_gbps)}"
    return costmodel.fit_profile(cfg, [r.to_json() for r in uncontended], first.hardware, link)


def profile(model: str, seq_len: int, transport: str, link_gbps: float | None,
            reps: int = 5, warmup: int = 2) -> costmodel.Profile:
    """`rekv profile`: short sequential handoffs at two cuts per precision, then a fit."""
    cfg = load_config(model)
    L = cfg.num_layers
    cuts = sorted({max(1, L // 3), max(1, 2 * L // 3)} - {L})
    actions = [Action(b, L, L) for b in (16, 8, 4)] + [
        Action(b, c, L) for b in (16, 8, 4) for c in cuts] + [Action(16, 0, L)]
    exp = Experiment(model=model, seq_len=seq_len, actions=tuple(actions),
                     schedules=("sequential",), transport=transport, link_gbps=link_gbps,
                     warmup=warmup, reps=reps)
    return fit(cfg, run_experiment(exp))


def sweep(preset: SweepPreset, out: Path, reps: int = 30, warmup: int = 3
          ) -> tuple[list[Summary], list[costmodel.Profile]]:
    """Run the whole sweep, write DIR/sweep.jsonl, DIR/sweep.csv and the report files."""
    out.mkdir(parents=True, exist_ok=True)
    mid = preset.lengths[len(preset.lengths) // 2]
    link = preset.link_gbps or calibrate_link(preset.models[0], mid).link_gbps
    grid = [Experiment(model=m, seq_len=s, actions=tuple(action_grid(
                load_config(m), preset.suffix_lens, preset.joint_bits)),
                       transport=preset.transport, link_gbps=link, warmup=warmup, reps=reps)
            for m in preset.models for s in preset.lengths]
    # crossover: the first model at the middle length, over paced links
    base_cfg = load_config(preset.models[0])
    r_mid = preset.suffix_lens[len(preset.suffix_lens) // 2]
    crossover_actions = [Action(16, base_cfg.num_layers, base_cfg.num_layers),
                         Action(8, base_cfg.num_layers, base_cfg.num_layers),
                         Action(8, base_cfg.num_layers - r_mid, base_cfg.num_layers),
                         Action(16, 0, base_cfg.num_layers)]
    crossover = [Experiment(model=preset.models[0], seq_len=mid,
                        actions=tuple(crossover_actions), schedules=("overlapped",),
                        transport=preset.transport, link_gbps=round(link * f, 6),
                        warmup=warmup, reps=reps)
             for f in preset.crossover_factors if f != 1.0]
    records, profiles = [], []
    with open(out / "sweep.jsonl", "w") as log, tempfile.TemporaryDirectory() as cache:
        for exp in tqdm(grid + crossover, desc="sweep", unit="run", file=sys.stderr):
            got = run_experiment(exp, Path(cache))
            if exp in grid:  # every action at both schedules: fit its profile
                profiles.append(fit(load_config(exp.model), got))
                log.write(json.dumps(profiles[-1].to_json()) + "\n")
            for r in got:
                log.write(json.dumps(r.to_json()) + "\n")
            log.flush()
            records += got
    rows = report.prediction_rows(records, profiles)
    predicted = {_key(row): row["predicted_ms"] for row in rows}
    records = [dataclasses.replace(r, predicted_ms=predicted.get(_key(r))) for r in records]
    write_csv(records, out / "sweep.csv")
    report.write_report(records, out, profiles)
    return records, profiles


def _key(r: Summary | dict) -> tuple:
    """Identifies a summary among a sweep's records (a prediction row carries the same keys)."""
    if isinstance(r, Summary):
        r = r.to_json()
    return tuple(r[k] for k in ("model", "seq_len", "action", "schedule", "link_gbps"))


def write_csv(records: list[Summary], path: Path) -> None:
    """One row per summary: setup, action, median, CI and phase medians."""
    fields = ["model", "seq_len", "batch", "hardware", "transport", "link_gbps", "action",
              "bits", "cut", "schedule", "median_ms", "ci95_lo", "ci95_hi", "predicted_ms",
              *(f"{p}_ms" for p in costmodel.PHASES), "payload_bytes", "first_token_match",
              "cache_check"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({**r.to_json(), "ci95_lo": r.ci95_ms[0], "ci95_hi": r.ci95_ms[1],
                        **{f"{p}_ms": v for p, v in r.phases_ms.items()}})
