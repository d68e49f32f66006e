"""`rekv profile` and `rekv sweep`: measured handoffs over models x lengths x actions (paper §4).

A sweep runs one process pair (`Pair`: both sides spawned once, handed one experiment after
another) for all its models, model after model; each model's experiments in order: its
start profiles, then its grid (decided from them), crossover links, Fig. 3 and batch runs
(`sweep_plan`), building each model's weights once per process. The link is calibrated in a
child on the cores of the pair's decode side (`calibrate_pair_link`). Profiles are fitted from the
sequential schedule (phases measured without contention) and predict every measured action;
`rekv_jax.study.report` turns the records into Table 1 / Fig. 2 / Table 3 / crossover outputs.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from rekv_jax import phases, sizes
from rekv_jax.compile_cache import compile_cache_env
from rekv_jax.config import ModelConfig
from rekv_jax.launch.environments import pair_environments, visible_gpus
from rekv_jax.launch.group import Job
from rekv_jax.model.loader import load_config
from rekv_jax.planning import costmodel, profile_fit
from rekv_jax.study import report, tables
from rekv_jax.study.calibrate import LinkCalibration, calibrate_link_in_child
from rekv_jax.study.experiment import Experiment, open_session, side_environments
from rekv_jax.study.records import Summary
from rekv_jax.study.sweep_plan import (
    COSTS,
    CPU_MEMORY_GBPS,
    SweepPreset,
    analytic_profile_of,
    estimate,
    estimate_text,
    grid_experiments,
    plan_models,
    profile_experiment,
    start_experiments,
    tail_experiments,
)
from rekv_jax.transport.cores import usable_cpus


class Pair:
    """One process pair of a sweep, spawned for its first experiment (which decides its
    transport and devices) and handed one experiment after another (`run`), each decided from
    the records of the last; returns each one's summary records.

    With `cache_dir`, compiled programs persist there, so the calibration child and the two
    sides compile a program once where they do not compile it at the same time (compilation is
    not part of any timed interval). Each side gets a GPU or a memory share of one, or on CPU
    its own cores unless not `pin` (`experiment.side_environments`)."""

    def __init__(self, cache_dir: Path | None = None, timeout: float = 1800.0,
                 pin: bool = True) -> None:
        self._cache = compile_cache_env(cache_dir)
        self._timeout = timeout  # per experiment
        self._pin = pin
        self._pair: Job[None] | None = None
        self._failed = False

    def run(self, exp: Experiment) -> list[Summary]:
        """`exp`'s summary records; a failure (in one line) ends the pair."""
        try:
            if self._pair is None:
                envs = {role: env | self._cache
                        for role, env in side_environments(exp, self._pin).items()}
                self._pair = open_session(exp, envs)
                items = self._pair.wait_ready(self._timeout)
            else:
                items = self._pair.ask(exp, self._timeout)
        except BaseException:
            self._failed = True
            raise
        return [r for r in items if isinstance(r, Summary)]

    def close(self) -> None:
        """End its experiments and wait for its processes to exit (a pair that failed was told
        so by `run`: it only ends)."""
        if self._failed and self._pair is not None:
            self._pair.kill()
        elif self._pair is not None:
            try:
                self._pair.close(self._timeout)
            finally:
                self._pair.kill()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        if kind is None:
            self.close()
        elif self._pair is not None:  # the caller's error wins: no one is left to ask
            self._pair.kill()


def run_experiment(exp: Experiment, cache_dir: Path | None = None, timeout: float = 1800.0
                   ) -> list[Summary]:
    """One experiment in a pair of its own; its summary records."""
    with Pair(cache_dir, timeout) as pair:
        return pair.run(exp)


def calibrate_pair_link(model: str, seq_len: int, transport: str, pin: bool = True,
                        cache_dir: Path | None = None) -> LinkCalibration:
    """`calibrate_link` in a child on the cores a pair's decode side gets (`pin`: its own half;
    else all of them); with `cache_dir`, the programs it compiles (the weights' draws, the
    layer) persist there for the pair that follows."""
    env = pair_environments(visible_gpus(), os.environ, transport=transport,
                            cpus=usable_cpus() if pin else None)["decode"]
    return calibrate_link_in_child(model, seq_len, env | compile_cache_env(cache_dir))


def fit(cfg: ModelConfig, records: list[Summary]) -> costmodel.Profile:
    """A profile from the uncontended (sequential / single-mechanism) summaries of one setup."""
    uncontended = [r for r in records if not r.mode.overlapped]
    first = uncontended[0]
    link = f"{first.transport} {tables.link_label(first.link_gbps)}"
    measured = [profile_fit.Measurement(r.model, r.seq_len, r.batch, r.action, r.phases_ms,
                                        r.chunks, r.mode.streams_chunks) for r in uncontended]
    return profile_fit.fit_profile(cfg, measured, first.hardware, link)


def profile(model: str, seq_len: int, transport: str, link_gbps: float | None,
            reps: int = 5, warmup: int = 2, cache_dir: Path | None = None) -> costmodel.Profile:
    """`rekv profile`: short sequential handoffs at two cuts per precision, then a fit."""
    exp = profile_experiment(model, seq_len, transport, link_gbps, reps, warmup)
    return fit(load_config(model), run_experiment(exp, cache_dir))


def sweep(preset: SweepPreset, out: Path, reps: int = 30, warmup: int = 3, pin: bool = True
          ) -> tuple[list[Summary], list[costmodel.Profile]]:
    """Run the whole sweep, write DIR/sweep.jsonl, DIR/sweep.csv and the report files.

    One pair runs every model's experiments, model after model. With `preset.cut_spread`, each
    length is first profiled in that pair (short sequential handoffs; DIR/start_profiles.jsonl),
    and its grid is the balanced one (`balanced_grid`). A fit that fails (ValueError) costs only its
    predictions: the sweep goes on, writes every output and names what it could not fit, and
    why, in one line on stderr. On CPU each side runs on its own cores unless not `pin`."""
    out.mkdir(parents=True, exist_ok=True)
    models = preset.models
    with open(out / "sweep.jsonl", "w") as log_file, tempfile.TemporaryDirectory() as tmp:
        log = _SweepLog(log_file)
        # the link first, uncontended (it times the suffix); then one pair for every model
        link = preset.link_gbps or calibrate_pair_link(
            models[0], preset.mid_length, preset.transport, pin, Path(tmp)).link_gbps
        with Pair(Path(tmp), pin=pin) as pair:
            for model in tqdm(models, desc="sweep", unit="model", file=sys.stderr):
                _sweep_model(pair, preset, model, link, reps, warmup, log)
    if preset.cut_spread is not None:
        (out / "start_profiles.jsonl").write_text(
            "".join(json.dumps(p.to_json()) + "\n" for p in log.starts))
    log.say_what_is_missing()
    records = [dataclasses.replace(r, predicted_ms=tables.record_prediction(r, log.profiles))
               for r in log.records]
    write_csv(records, out / "sweep.csv")
    report.write_report(records, out, log.profiles)
    return records, log.profiles


@dataclasses.dataclass
class _SweepLog:
    """What a sweep has measured and fitted so far, and what it could not (`sweep.jsonl`)."""

    file: TextIO
    records: list[Summary] = dataclasses.field(default_factory=list)
    profiles: list[costmodel.Profile] = dataclasses.field(default_factory=list)
    starts: list[costmodel.Profile] = dataclasses.field(default_factory=list)
    no_start: list[str] = dataclasses.field(default_factory=list)
    unfitted: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)

    def say_what_is_missing(self) -> None:
        """One line on stderr for the start profiles and the fits that could not be made."""
        if self.no_start:
            print("sweep: no start profile, so cuts L/3 and 2L/3 in place of the balanced ones, "
                  "for " + "; ".join(self.no_start), file=sys.stderr)
        if self.unfitted:  # a skipped run's grid fit failed too
            print("sweep: no cost-model fit, so no predictions, for " + "; ".join(self.unfitted)
                  + (f"; not run for want of a fitted cut: {', '.join(self.skipped)}"
                     if self.skipped else ""), file=sys.stderr)


def _sweep_model(pair: Pair, preset: SweepPreset, model: str, link: float, reps: int,
                 warmup: int, log: _SweepLog) -> None:
    """One model's runs in the sweep's pair: its start profiles, its grid (each length's fit),
    then Fig. 3 and batch runs, which take their cut from the start profile, else the grid's
    fit."""
    cfg = load_config(model)
    start = {}  # length -> start profile
    for exp in start_experiments(preset, model, link):
        try:
            start[exp.seq_len] = fit(cfg, pair.run(exp))
        except ValueError as e:
            log.no_start.append(f"{_setup_text(model, exp.seq_len, link)} ({e})")
    if len(start) > 1:  # attention's share of γ over the lengths: what chunks save
        start = dict(zip(start, profile_fit.attention_shares(list(start.values())),
                         strict=True))
    log.starts += start.values()
    fits = _grid(pair, preset, cfg, model, link, start, reps, warmup, log)
    tail, missing = tail_experiments(preset, model, link, start, fits, reps, warmup)
    log.skipped += missing
    for exp in tail:
        _logged(pair.run(exp), log.file, log.records)


def _grid(pair: Pair, preset: SweepPreset, cfg: ModelConfig, model: str, link: float,
          start: dict[int, costmodel.Profile], reps: int, warmup: int, log: _SweepLog
          ) -> dict[int, costmodel.Profile]:
    """`model`'s grid runs, each fitted; the fits of the paced link by length (their attention
    share measured over the lengths)."""
    fits, fitted = {}, []  # length -> the fit of its grid on the paced link; all fits
    for exp in grid_experiments(preset, model, link, start, reps, warmup):
        got = _logged(pair.run(exp), log.file, log.records)  # every action, both schedules
        try:
            fitted.append(fit(cfg, got))
        except ValueError as e:
            log.unfitted.append(f"{_setup_text(model, exp.seq_len, exp.link_gbps)} ({e})")
            continue
        if exp.link_gbps == link:
            fits[exp.seq_len] = fitted[-1]
    if len(fits) > 1:  # attention's share of γ, measured over the lengths
        shares = profile_fit.attention_shares(list(fits.values()))
        measured = dict(zip(map(id, fits.values()), shares, strict=True))
        fitted = [measured.get(id(p), p) for p in fitted]
        fits = {s: measured[id(p)] for s, p in fits.items()}
    for prof in fitted:
        log.profiles.append(prof)
        log.file.write(json.dumps(prof.to_json()) + "\n")
    return fits


def _logged(got: list[Summary], log, records: list[Summary]) -> list[Summary]:
    """`got`, written to the sweep's log and added to its records."""
    for r in got:
        log.write(json.dumps(r.to_json()) + "\n")
    log.flush()
    records.extend(got)
    return got


def _setup_text(model: str, seq_len: int, link_gbps: float | None) -> str:
    return f"{model} at {seq_len} tokens over the {tables.link_label(link_gbps)} link"


def dry_run(name: str, preset: SweepPreset, reps: int, warmup: int, quick: bool = False,
            pin: bool = True) -> str:
    """`rekv sweep --dry-run`: the experiments, handoffs and programs per model of a sweep of
    `preset` (named `name`, `quick` or not: its `COSTS`), and its wall time estimated from those
    parts. A GPU preset's predicted medians are `planner.analytic_profile`'s; a preset
    calibrated here (the CPU one) measures its suffix layer (`calibrate_link`, which the sweep
    runs too) and prices handoffs with a roofline of that measured compute rate."""
    costs = COSTS[preset.machine]
    if preset.link_gbps is not None:
        link, profile_of = preset.link_gbps, analytic_profile_of()
        note = (f"planner.analytic_profile (assumed H100-class rates, not measured) on the "
                f"{link:.3g} GB/s link")
    else:
        cal = calibrate_pair_link(preset.models[0], preset.mid_length, preset.transport,
                              pin)
        tflops = sizes.layer_flops(load_config(cal.model), cal.seq_len) / (
            cal.suffix_layer_ms * 1e9)
        link, profile_of = cal.link_gbps, analytic_profile_of(tflops=tflops,
                                                              hbm_gbps=CPU_MEMORY_GBPS)
        note = (f"a roofline at the compute rate measured here ({cal.suffix_layer_ms:.2f} ms per "
                f"{cal.model} suffix layer at {cal.seq_len} tokens on {cal.cpus}: "
                f"{tflops * 1e3:.3g} "
                f"GFLOP/s) and an assumed {CPU_MEMORY_GBPS:g} GB/s memory, on the calibrated "
                f"{link:.4g} GB/s link")
    plans = plan_models(preset, link, reps, warmup, profile_of)
    est = estimate(plans, costs, link, profile_of)
    title = f"rekv sweep --preset {name}{' --quick' * quick}: plan ({reps} reps, {warmup} warmup)"
    return estimate_text(title,
                         plans, est, costs, note, preset.unpaced_block)


def write_csv(records: list[Summary], path: Path) -> None:
    """One row per summary: setup, action, median, CI and phase medians."""
    fields = ["model", "seq_len", "batch", "hardware", "transport", "link_gbps",
              "prefill_devices", "decode_devices", "action", "bits", "cut", "schedule",
              "interval", "prefill", "paired", "median_ms", "ci95_lo", "ci95_hi",
              "predicted_ms", *(f"{p}_ms" for p in phases.PROMPT_PHASES), "payload_bytes",
              "first_token_match", "cache_check"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({**r.to_json(), "ci95_lo": r.ci95_ms[0], "ci95_hi": r.ci95_ms[1],
                        **{f"{p}_ms": v for p, v in r.phases_ms.to_json().items()}})
