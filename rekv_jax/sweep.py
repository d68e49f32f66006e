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
from rekv_jax.transport.launch import run_cli

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
    suffix_lens: tuple[int, ...]  # fixed r grid of recompute-only and joint actions
    transport: str
    link_gbps: float | None  # None: calibrate to PAPER_LINK_TO_SUFFIX on this machine
    crossover_factors: tuple[float, ...]  # crossover links, as multiples of the sweep's link
    joint_bits: tuple[int, ...] = (8, 4)
    # None: the fixed `suffix_lens` grid; k: per precision, the balanced cut (Prop. 2) of a
    # profile measured at the start of the run, and k cuts either side (replaces suffix_lens)
    cut_spread: int | None = None
    unpaced_block: bool = False  # also run the grid over the unpaced link, as its own block
    prompt_length: int | None = None  # Fig. 3: prompt to first token at this length, per model
    batch_model: str | None = None  # batch 2 and 4 at the longest length: joint vs Q8 transfer
    batches: tuple[int, ...] = (2, 4)

    def __post_init__(self) -> None:
        if self.cut_spread is None and len(set(self.suffix_lens)) < 2:
            raise ValueError("a sweep needs at least two suffix lengths to fit its cost model")
        if (self.prompt_length is not None or self.batch_model is not None) and (
                self.cut_spread is None or self.prompt_length not in (None, *self.lengths)
                or self.batch_model not in (None, *self.models)):
            raise ValueError("Fig. 3 and batch runs take their cut from a start profile: they "
                             "need cut_spread, a prompt length among the lengths and a batch "
                             "model among the models")


_GPU = SweepPreset(
    models=("qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b"), lengths=(512, 2048, 8192),
    suffix_lens=(), transport="transfer-server", link_gbps=PAPER_LINK_GBPS,
    crossover_factors=(0.5, 1.0, 4.0, 16.0), cut_spread=1, unpaced_block=True,
    prompt_length=8192, batch_model="qwen2.5-7b")

SWEEP_PRESETS = {
    # Scaled: 6-layer models at 128-512 tokens; under 10 minutes on 2 CPU cores (r = 1, 2, 4
    # and four crossover links took 11 min 20 s). Two suffix lengths far apart keep the fit
    # well posed: refitting a full run's records, r = {1, 4} erred 7.0% (median over actions),
    # {1, 2, 4} 7.6%, and {1, 2} 20.5% (cuts 4 and 5 barely separate per-layer from fixed costs).
    "cpu": SweepPreset(models=("tiny", "tiny-qwen3"), lengths=(128, 256, 512),
                       suffix_lens=(1, 4), transport="transfer-server", link_gbps=None,
                       crossover_factors=(0.25, 1.0, 4.0)),
    # The paper's shapes (synthetic weights, one layer's weights repeated) on a GPU per side, or
    # one GPU shared with a memory share each (`transport.launch.pair_environments`), over the
    # transfer-server transport, paced to the paper's 2.32 GB/s, then unpaced; Fig. 3 at 8K per
    # model, batch 2 and 4 at 8K for Qwen2.5-7B. An estimate, not a measurement: ~8 minutes on
    # one H200 with the shared compile cache (30 reps of a 7B handoff at 8K take ~10 s; the
    # compiles dominate), `--quick` ~4.
    "gpu": _GPU,
}

# `--quick`: the same study on fewer models and lengths (use with fewer reps), for short leases
QUICK_PRESETS = {
    "cpu": dataclasses.replace(SWEEP_PRESETS["cpu"], models=("tiny",), lengths=(128,),
                               crossover_factors=(1.0, 4.0)),
    "gpu": dataclasses.replace(_GPU, models=("qwen2.5-3b", "qwen2.5-7b"), lengths=(8192,),
                               crossover_factors=(1.0, 4.0), batches=(4,)),
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


def balanced_grid(prof: costmodel.Profile, joint_bits: tuple[int, ...], spread: int = 1
                  ) -> list[Action]:
    """BF16 / Q8 / Q4 transfer-only; per precision (BF16: recompute-only) the profile's balanced
    cuts (Prop. 2) and `spread` interior cuts either side; and full recomputation.

    The fit of its records needs two distinct interior cuts (the suffix's fixed and per-layer
    costs) and, per precision, one besides `c = L` (the prefix's): when every balanced cut is
    the same one, BF16 also runs at its nearest interior neighbour (with L = 2 there is none)."""
    L = prof.num_layers
    actions = [Action(b, L, L) for b in (16, 8, 4)]
    for bits in (16, *joint_bits):
        cuts = prof.balanced_cut(bits)[1]
        actions += [Action(bits, c, L) for c in range(min(cuts) - spread, max(cuts) + spread + 1)
                    if 0 < c < L]
    interior = {a.cut for a in actions if 0 < a.cut < L}
    if len(interior) == 1 and L > 2:
        (c,) = interior
        near = c + 1 if c + 1 < L else c - 1
        actions.insert(3 + (near > c), Action(16, near, L))  # BF16's cuts stay ascending
    return actions + [Action(16, 0, L)]


def best_cut(prof: costmodel.Profile, bits: int) -> int:
    """The interior cut of `bits` the profile predicts fastest overlapped (Prop. 2's candidates)."""
    L = prof.num_layers
    return min(prof.balanced_cut(bits)[1],
               key=lambda c: costmodel.predicted_ms(prof, Action(bits, c, L)))


def run_experiment(exp: Experiment, cache_dir: Path | None = None, timeout: float = 1800.0
                   ) -> list[Summary]:
    """One `rekv handoff --json` run (both processes); its summary records.

    With `cache_dir`, compiled programs persist there, so the two sides and later runs of the
    same shapes compile each program once (compilation is not part of any timed interval).
    The run's own launcher gives each side a GPU or a memory share of one
    (`transport.launch.pair_environments`)."""
    env = dict(os.environ)
    if cache_dir is not None:
        env |= {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    out = run_cli(["handoff", "--json", "--experiment", exp.to_json()],
                  f"handoff run ({exp.model}, {exp.seq_len})", timeout, env)
    records = [json.loads(line) for line in out.splitlines()]
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
            reps: int = 5, warmup: int = 2, cache_dir: Path | None = None) -> costmodel.Profile:
    """`rekv profile`: short sequential handoffs at two cuts per precision, then a fit."""
    cfg = load_config(model)
    L = cfg.num_layers
    actions = [Action(b, L, L) for b in (16, 8, 4)] + [
        Action(b, c, L) for b in (16, 8, 4) for c in _far_cuts(L)] + [Action(16, 0, L)]
    exp = Experiment(model=model, seq_len=seq_len, actions=tuple(actions),
                     schedules=("sequential",), transport=transport, link_gbps=link_gbps,
                     warmup=warmup, reps=reps)
    return fit(cfg, run_experiment(exp, cache_dir))


def _far_cuts(num_layers: int) -> list[int]:
    """Two interior cuts far apart (L/3 and 2L/3): the profile's grid, and the sweep's where a
    start profile could not be fitted."""
    L = num_layers
    return sorted({max(1, L // 3), max(1, 2 * L // 3)} - {L})


def sweep(preset: SweepPreset, out: Path, reps: int = 30, warmup: int = 3
          ) -> tuple[list[Summary], list[costmodel.Profile]]:
    """Run the whole sweep, write DIR/sweep.jsonl, DIR/sweep.csv and the report files.

    With `preset.cut_spread`, each model and length is first profiled (short sequential
    handoffs; DIR/start_profiles.jsonl) and its cut grid is the balanced one (`balanced_grid`).
    A fit that fails (ValueError) costs only its predictions: the sweep goes on, writes every
    output and names what it could not fit, and why, in one line on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    mid = preset.lengths[len(preset.lengths) // 2]
    link = preset.link_gbps or calibrate_link(preset.models[0], mid).link_gbps
    records, profiles, unfitted, skipped = [], [], [], []
    with open(out / "sweep.jsonl", "w") as log, tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)

        def run(exp: Experiment) -> list[Summary]:
            got = run_experiment(exp, cache)
            for r in got:
                log.write(json.dumps(r.to_json()) + "\n")
            log.flush()
            records.extend(got)
            return got

        start = _start_profiles(preset, link, out, cache)
        grid = [Experiment(model=m, seq_len=s, actions=tuple(_actions(preset, m, s, start)),
                           transport=preset.transport, link_gbps=lk, warmup=warmup, reps=reps)
                for lk in (link, None)[:1 + preset.unpaced_block]
                for m in preset.models for s in preset.lengths]
        fits = {}  # (model, length, link) -> the profile of its grid run
        for exp in tqdm(grid, desc="sweep", unit="run", file=sys.stderr):
            got = run(exp)  # every action, both schedules
            try:
                prof = fit(load_config(exp.model), got)
            except ValueError as e:
                unfitted.append(f"{_setup_text(exp.model, exp.seq_len, exp.link_gbps)} ({e})")
                continue
            fits[exp.model, exp.seq_len, exp.link_gbps] = prof
            profiles.append(prof)
            log.write(json.dumps(prof.to_json()) + "\n")
        base = preset.models[0]
        L = load_config(base).num_layers
        lens = _suffix_lens(preset, base)
        q8_cut = (best_cut(start[base, mid], 8) if (base, mid) in start
                  else L - lens[len(lens) // 2])
        crossover = (Action(16, L, L), Action(8, L, L), Action(8, q8_cut, L), Action(16, 0, L))
        for f in preset.crossover_factors:  # the first model at the middle length, paced links
            if f != 1.0:
                run(Experiment(model=base, seq_len=mid, actions=crossover,
                               schedules=("overlapped",), transport=preset.transport,
                               link_gbps=round(link * f, 6), warmup=warmup, reps=reps))
        # Fig. 3 and batch runs take their cut from the start profile, else the grid run's fit
        extra = [(m, preset.prompt_length, None) for m in preset.models
                 if preset.prompt_length is not None]
        extra += [(preset.batch_model, max(preset.lengths), b) for b in preset.batches
                  if preset.batch_model is not None]
        for m, s, b in extra:
            prof = start.get((m, s)) or fits.get((m, s, link))
            if prof is None:
                skipped.append(f"{'Fig. 3' if b is None else f'batch {b}'} of {m} at {s}")
            elif b is None:
                run(prompt_experiment(m, s, prof, preset.transport, link, reps, warmup))
            else:
                run(batch_experiment(m, s, b, prof, preset.transport, link, reps, warmup))
    if unfitted:  # a skipped run's grid fit failed too
        print("sweep: no cost-model fit, so no predictions, for " + "; ".join(unfitted)
              + (f"; not run for want of a fitted cut: {', '.join(skipped)}" if skipped else ""),
              file=sys.stderr)
    records = [dataclasses.replace(r, predicted_ms=report.record_prediction(r, profiles))
               for r in records]
    write_csv(records, out / "sweep.csv")
    report.write_report(records, out, profiles)
    return records, profiles


def _start_profiles(preset: SweepPreset, link: float, out: Path, cache: Path
                    ) -> dict[tuple[str, int], costmodel.Profile]:
    """(model, length) -> its profile measured at the start of the run (none for a fixed grid,
    nor where the fit failed: one line on stderr names those, whose grid is `_far_cuts`); also
    written to DIR/start_profiles.jsonl."""
    if preset.cut_spread is None:
        return {}
    start, unfitted = {}, []
    for m in tqdm(preset.models, desc="profile", unit="model", file=sys.stderr):
        for s in preset.lengths:
            try:
                start[m, s] = profile(m, s, preset.transport, link, cache_dir=cache)
            except ValueError as e:
                unfitted.append(f"{_setup_text(m, s, link)} ({e})")
    if unfitted:
        print("sweep: no start profile, so cuts L/3 and 2L/3 in place of the balanced ones, for "
              + "; ".join(unfitted), file=sys.stderr)
    (out / "start_profiles.jsonl").write_text(
        "".join(json.dumps(p.to_json()) + "\n" for p in start.values()))
    return start


def _setup_text(model: str, seq_len: int, link_gbps: float | None) -> str:
    return f"{model} at {seq_len} tokens over the {report.link_label(link_gbps)} link"


def _suffix_lens(preset: SweepPreset, model: str) -> tuple[int, ...]:
    """The fixed r grid of `model`: the preset's, or, in a sweep of balanced grids whose start
    profile is missing, the suffixes of `_far_cuts` (far apart: the fit stays well posed)."""
    if preset.cut_spread is None:
        return preset.suffix_lens
    L = load_config(model).num_layers
    return tuple(L - c for c in reversed(_far_cuts(L)))


def _actions(preset: SweepPreset, model: str, seq_len: int,
             start: dict[tuple[str, int], costmodel.Profile]) -> list[Action]:
    if (model, seq_len) in start:
        return balanced_grid(start[model, seq_len], preset.joint_bits, preset.cut_spread)
    return action_grid(load_config(model), _suffix_lens(preset, model), preset.joint_bits)


def prompt_experiment(model: str, seq_len: int, prof: costmodel.Profile, transport: str,
                      link_gbps: float | None, reps: int = 30, warmup: int = 3) -> Experiment:
    """Fig. 3: prompt to first token of the BF16 joint action (the profile's best BF16 cut),
    sequential and overlapped as paired reps; the prefill worker runs the full prompt."""
    L = prof.num_layers
    return Experiment(model=model, seq_len=seq_len, actions=(Action(16, best_cut(prof, 16), L),),
                      schedules=("sequential", "overlapped"), transport=transport,
                      link_gbps=link_gbps, warmup=warmup, reps=reps, interval="prompt",
                      prefill="full", paired=True)


def batch_experiment(model: str, seq_len: int, batch: int, prof: costmodel.Profile,
                     transport: str, link_gbps: float | None, reps: int = 30, warmup: int = 3
                     ) -> Experiment:
    """`batch` simultaneously ready requests of equal length: joint Q8 at the profile's best Q8
    cut (overlapped) vs Q8 transfer-only."""
    L = prof.num_layers
    return Experiment(model=model, seq_len=seq_len, batch=batch,
                      actions=(Action(8, best_cut(prof, 8), L), Action(8, L, L)),
                      schedules=("overlapped",), transport=transport, link_gbps=link_gbps,
                      warmup=warmup, reps=reps)


def write_csv(records: list[Summary], path: Path) -> None:
    """One row per summary: setup, action, median, CI and phase medians."""
    fields = ["model", "seq_len", "batch", "hardware", "transport", "link_gbps",
              "prefill_devices", "decode_devices", "action", "bits", "cut", "schedule",
              "interval", "prefill", "paired", "median_ms", "ci95_lo", "ci95_hi",
              "predicted_ms", *(f"{p}_ms" for p in costmodel.PROMPT_PHASES), "payload_bytes",
              "first_token_match", "cache_check"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({**r.to_json(), "ci95_lo": r.ci95_ms[0], "ci95_hi": r.ci95_ms[1],
                        **{f"{p}_ms": v for p, v in r.phases_ms.items()}})
