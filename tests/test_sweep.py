"""The measured sweep end to end on a miniature preset (its start profile is `rekv profile`)."""

import csv
import dataclasses
import json

import numpy as np
import pytest

from rekv_jax import Action, ModelConfig, sizes
from rekv_jax.mode import Mode
from rekv_jax.planning import costmodel as cm
from rekv_jax.planning.costmodel import Profile
from rekv_jax.planning.profile_fit import Measurement, fit_profile
from rekv_jax.study import calibrate as calibrate_module
from rekv_jax.study import sweep as sweep_module
from rekv_jax.study import tables
from rekv_jax.study.calibrate import calibrate_link
from rekv_jax.study.records import Summary
from rekv_jax.study.sweep import sweep
from rekv_jax.study.sweep_plan import (
    PAPER_LINK_TO_SUFFIX,
    QUICK_PRESETS,
    SWEEP_PRESETS,
    SweepPreset,
    action_grid,
    balanced_grid,
    best_cut,
    chunked_cut,
)

TINY = ModelConfig.preset("tiny")


def test_action_grid_covers_every_mechanism():
    cfg = ModelConfig.preset("tiny")
    grid = [str(a) for a in action_grid(cfg, (1, 2, 9), (8, 4))]
    assert grid == ["bf16:full", "q8:full", "q4:full", "bf16:r=1", "bf16:r=2", "q8:r=1",
                    "q8:r=2", "q4:r=1", "q4:r=2", "bf16:recompute"]  # r=9 > L is dropped
    assert all(isinstance(a, Action) for a in action_grid(
        ModelConfig.preset("qwen2.5-7b"), (13, 21), (8, 4)))


def _synthetic_profile(link_gbps: float = 1.0) -> Profile:
    """28 layers; per layer: BF16 16 MB (16 ms at 1 GB/s), Q8 8.5 MB + 0.5 ms restore, Q4
    4.5 MB + 0.5 ms; suffix 4 ms; no fixed costs. So c* = 28 * 4 / (beta + 4) = 5.6 (BF16),
    112 / 13 = 8.62 (Q8), 112 / 9 = 12.44 (Q4)."""
    return Profile(model="m", num_layers=28, seq_len=8192, batch=1, hardware="h", link="l",
                   link_gbps=link_gbps, source="analytic",
                   kv_layer_bytes={16: 16_000_000, 8: 8_500_000, 4: 4_500_000},
                   boundary_bytes=1_000_000, token_bytes=32_768,
                   quantize_ms={16: 0.0, 8: 0.1, 4: 0.1}, restore_ms={16: 0.0, 8: 0.5, 4: 0.5},
                   suffix_layer_ms=4.0, join_ms=0.1)


def test_balanced_grid_is_the_balanced_cut_and_its_neighbours():
    grid = [str(a) for a in balanced_grid(_synthetic_profile(), (8, 4), spread=1)]
    # BF16 cuts 4..7 (5, 6 around 5.6), Q8 7..10 (8, 9 around 8.62), Q4 11..14 (12, 13)
    assert grid == (["bf16:full", "q8:full", "q4:full"]
                    + [f"bf16:r={28 - c}" for c in (4, 5, 6, 7)]
                    + [f"q8:r={28 - c}" for c in (7, 8, 9, 10)]
                    + [f"q4:r={28 - c}" for c in (11, 12, 13, 14)] + ["bf16:recompute"])
    # a faster link moves every balanced cut towards the prefix side (more layers transferred)
    fast = balanced_grid(_synthetic_profile(link_gbps=4.0), (8,), spread=0)
    assert [a.cut for a in fast if a.kind == "joint"] == [14, 16, 17]  # 112/8, 112/6.625
    assert best_cut(_synthetic_profile(), 16) in (5, 6)


def test_chunked_grid_adds_the_cut_the_chunked_schedule_prefers():
    """A token-chunked boundary starts the suffix after 1/N of h_c, so with a boundary worth
    several layers the chunked schedule is fastest at a longer suffix than the overlapped one:
    the grid runs that cut too, and only when the sweep chunks."""
    prof = dataclasses.replace(_synthetic_profile(), boundary_bytes=60_000_000)  # 60 ms of h_c
    L, plain = prof.num_layers, balanced_grid(prof, (8,), spread=0)
    cut = chunked_cut(prof, 8, 4)
    chunked = lambda c: cm.predicted_ms(prof, Mode.of(Action(8, c, L), "chunked", chunks=4))  # noqa: E731
    assert chunked(cut) == min(chunked(c) for c in range(1, L))
    assert cut < best_cut(prof, 8)  # more suffix layers fit behind the earlier start
    assert chunked(cut) < chunked(best_cut(prof, 8))
    grid = balanced_grid(prof, (8,), spread=0, chunks=4)
    assert set(grid) - set(plain) == {Action(8, cut, L)}
    assert balanced_grid(prof, (8,), spread=0, chunks=1) == plain


def test_balanced_grid_stays_interior():
    prof = dataclasses.replace(_synthetic_profile(), suffix_layer_ms=0.01)  # c* clips to 1
    cuts = [a.cut for a in balanced_grid(prof, (8,), spread=2) if a.kind == "joint"]
    assert cuts and min(cuts) >= 1 and max(cuts) < 28


def _tiny_profile(seq_len: int = 32, batch: int = 1, link_gbps: float = 0.002,
                  suffix_layer_ms: float = 0.4, cfg: ModelConfig = TINY) -> Profile:
    """A tiny-model profile with every fixed cost nonzero, to generate records from."""
    return Profile.for_config(
        cfg, seq_len, batch, hardware="test", link="test link", link_gbps=link_gbps,
        source="analytic", quantize_ms={16: 0.0, 8: 0.02, 4: 0.03},
        restore_ms={16: 0.0, 8: 0.05, 4: 0.07}, suffix_layer_ms=suffix_layer_ms, embed_ms=0.05,
        join_ms={"transfer": 0.01, "recompute": 0.3, "joint": 0.6}, quantize_fixed_ms=0.1,
        boundary_fixed_ms=0.25, message_ms=0.2, suffix_fixed_ms=0.15,
        restore_fixed_ms={8: 0.4, 4: 0.5})


def _records(prof: Profile, actions: list[Action]) -> list[Measurement]:
    return [Measurement(prof.model, prof.seq_len, prof.batch, a, cm.phase_ms(prof, a))
            for a in actions]


@pytest.mark.parametrize("suffix_layer_ms, cut, near", [(0.001, 1, 2), (1e4, 5, 4)])
def test_balanced_grid_of_one_cut_still_fits(suffix_layer_ms, cut, near):
    """When every precision's balanced cut is the same one (c* clipped to 1 or L - 1, spread 0),
    the grid adds BF16 at its interior neighbour, so the sweep's fit of its records is well
    posed."""
    truth = _tiny_profile(suffix_layer_ms=suffix_layer_ms)
    assert {c for b in (16, 8, 4) for c in truth.balanced_cut(b)[1]} == {cut}  # collapsed
    grid = balanced_grid(truth, (8, 4), spread=0)
    assert len({a.cut for a in grid if a.kind == "joint"}) >= 2
    assert sorted(a.cut for a in grid if a.bits == 16) == sorted([0, cut, near, 6])
    fit = fit_profile(TINY, _records(truth, grid), "test", "test link")
    assert fit.suffix_layer_ms == pytest.approx(suffix_layer_ms, rel=1e-6)
    assert fit.link_gbps == pytest.approx(truth.link_gbps, rel=1e-6)
    assert fit.restore_ms == pytest.approx(truth.restore_ms, rel=1e-6)
    # without the neighbour, the suffix's fixed and per-layer costs cannot be told apart
    lone = [a for a in grid if a.bits != 16 or a.cut in (0, cut, 6)]
    with pytest.raises(ValueError, match="suffix times"):
        fit_profile(TINY, _records(truth, lone), "test", "test link")


def test_gpu_preset_is_the_papers_study():
    gpu, quick = SWEEP_PRESETS["gpu"], QUICK_PRESETS["gpu"]
    assert gpu.models == ("qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b")
    assert gpu.lengths == (512, 2048, 8192) and gpu.transport == "transfer-server"
    assert gpu.cut_spread and gpu.unpaced_block  # each side's GPU or share: tests/test_launch.py
    assert set(quick.models) < set(gpu.models) and set(quick.lengths) <= set(gpu.lengths)


def test_a_sweep_needs_two_suffix_lengths():
    with pytest.raises(ValueError, match="two suffix lengths"):
        SweepPreset(models=("tiny",), lengths=(32,), suffix_lens=(2,), transport="local",
                    link_gbps=None, crossover_factors=(1.0,))


def test_mini_sweep_writes_every_output(monkeypatch, tmp_path):
    """The gpu preset's plumbing on tiny shapes, in one run of one process pair: a start
    profile, the balanced grid, a crossover link, paired Fig. 3 and batch 2, and every output
    file; and the fitted cost model against the paced transfers it measured."""
    preset = SweepPreset(models=("tiny",), lengths=(32,), suffix_lens=(), transport="local",
                         link_gbps=0.001, crossover_factors=(1.0, 4.0),
                         cut_spread=0, prompt_length=32, batch_model="tiny", batches=(2,))
    sessions = []
    opened = sweep_module.open_session

    def counted(*args):
        sessions.append(args)
        return opened(*args)

    monkeypatch.setattr(sweep_module, "open_session", counted)
    records, profiles = sweep(preset, tmp_path, reps=3, warmup=1)
    assert len(sessions) == 1  # one pair ran all five experiments
    names = {p.name for p in tmp_path.iterdir()}
    assert {"sweep.jsonl", "sweep.csv", "table1.md", "table3.md", "predictions.md",
            "crossover.md", "fig3.md", "batch.md", "start_profiles.jsonl", "fig2.png",
            "figures.md"} <= names
    lines = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert sum(line["kind"] == "summary" for line in lines) == len(records)
    assert all(r.first_token_match for r in records)

    # the start profile (`rekv profile`'s measurement) has every cost; the grid is its balanced
    # cuts; the grid run is fitted too (its predictions are checked below)
    (start,) = [json.loads(line) for line in
                (tmp_path / "start_profiles.jsonl").read_text().splitlines()]
    prof = Profile.from_json(start)
    assert prof.source == "fitted" and prof.suffix_layer_ms > 0 and {8, 4} <= set(prof.quantize_ms)
    assert prof.at_link(1.0).link_gbps == 1.0
    assert [(p.model, p.seq_len, p.source) for p in profiles] == [("tiny", 32, "fitted")]
    ready = [r for r in records if r.interval == "ready" and r.batch == 1]
    grid = {str(a) for a in balanced_grid(prof, (8, 4), 0)}
    assert {str(r.action) for r in ready if r.link_gbps == 0.001} == grid
    # crossover: four actions again at 4x the link
    assert {r.link_gbps for r in ready} == {0.001, 0.004}
    prompt = [r for r in records if r.interval == "prompt"]
    assert [(str(r.action), r.schedule, r.paired) for r in prompt] == [
        (f"bf16:r={6 - best_cut(prof, 16)}", s, True) for s in ("sequential", "overlapped")]
    batch = [r for r in records if r.batch == 2]
    assert {str(r.action) for r in batch} == {f"q8:r={6 - best_cut(prof, 8)}", "q8:full"}

    # each record's prediction is its own setup's: the prompt interval adds the prefill compute
    # to the ready one; no profile was fitted at batch 2, so the batch records predict nothing
    ready_pred = {(str(r.action), r.schedule): r.predicted_ms for r in ready
                  if r.link_gbps == 0.001}
    assert all(r.predicted_ms is not None for r in ready)
    assert all(r.predicted_ms > ready_pred[str(r.action), r.schedule] for r in prompt)
    assert all(r.predicted_ms is None for r in batch)
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert len(rows) == len(records)  # the prompt interval's prefill compute is a column
    assert all(float(r["prefill_ms"]) > 0 for r in rows if r["interval"] == "prompt")
    assert "tiny" in (tmp_path / "table1.md").read_text()
    assert "paired bootstrap" in (tmp_path / "fig3.md").read_text()
    assert "Batch 2" in (tmp_path / "batch.md").read_text()

    # The cost model against measurement: a paced transfer-only handoff is the pacing sleep
    # (BF16 98 ms at 1 MB/s) plus a few ms, so the grid run's fit (bandwidth, per-message costs)
    # must predict it at the grid's link and, re-targeted, at 4x it. A bandwidth fitted 2x off
    # errs 40-100% on each; a good fit errs a few % (worst row under 20%) even on busy cores.
    # At a 2 MB/s link a few ms of per-message overhead, fitted into a shorter sleep, weigh
    # 8-20%, hence the slower link. Bound: 20%.
    paced = [r for r in tables.prediction_rows(records) if r.batch == 1 and r.action
             in ("bf16:full", "q8:full", "q4:full") and r.link_gbps is not None]
    assert sorted((r.action, r.link_gbps) for r in paced) == [
        ("bf16:full", 0.001), ("bf16:full", 0.004), ("q4:full", 0.001), ("q8:full", 0.001),
        ("q8:full", 0.004)]
    assert np.median([abs(r.error_pct) for r in paced]) < 20, paced


def _fake_run(exp, cache_dir=None, timeout=None) -> list[Summary]:
    """Summaries of `exp` as `_tiny_profile` predicts them, in place of a measured handoff; some
    start profiles (one interior cut) and grid runs (no joint action) lack what their fits need."""
    prof = _tiny_profile(exp.seq_len, exp.batch, exp.link_gbps or 1.0,
                         cfg=ModelConfig.preset(exp.model))
    actions, key = exp.actions, (exp.model, exp.seq_len)
    if exp.schedules == ("sequential",) and key in (("tiny", 64), ("tiny-qwen3", 32)):
        actions = [a for a in actions if a.cut in (0, 2, 6)]
    elif (exp.seq_len, exp.interval, exp.batch, len(exp.schedules)) == (32, "ready", 1, 2):
        actions = [a for a in actions if a.kind != "joint"]
    done = dict.fromkeys(m for a in actions for m in exp.modes(a))
    out = []
    for mode in done:
        a, s = mode.action, mode.schedule_text
        t = cm.predicted_ms(prof, mode)
        phases = dataclasses.replace(cm.phase_ms(prof, a),
                                     prefill=1.0 if exp.interval == "prompt" else 0.0)
        out.append(Summary(model=exp.model, seq_len=exp.seq_len, batch=exp.batch, action=a,
                           transport=exp.transport, schedule=s, link_gbps=exp.link_gbps,
                           hardware="test", reps_ms=(0.99 * t, t, 1.01 * t), phases_ms=phases,
                           payload_bytes=1000, interval=exp.interval, prefill=exp.prefill,
                           paired=exp.paired))
    return out


class _FakePair:
    """A `sweep.Pair` whose handoffs are `_fake_run`'s."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, exp) -> list[Summary]:
        return _fake_run(exp)


def test_sweep_without_a_fit_still_reports(monkeypatch, capsys, tmp_path):
    """An ill-posed fit (a start profile, a grid run) costs only its predictions: the sweep runs
    a fallback grid, writes every output and names each failure with its reason on stderr."""
    monkeypatch.setattr(sweep_module, "Pair", _FakePair)
    preset = SweepPreset(models=("tiny", "tiny-qwen3"), lengths=(32, 64), suffix_lens=(),
                         transport="local", link_gbps=0.002, crossover_factors=(1.0,),
                         cut_spread=0, prompt_length=32, batch_model="tiny", batches=(2,))
    records, profiles = sweep(preset, tmp_path, reps=3, warmup=1)
    err = [line.split("\r")[-1] for line in capsys.readouterr().err.splitlines()]
    lines = [line for line in err if line.startswith("sweep: no ")]  # not the progress bars
    link, why = "over the paced 0.002 GB/s link", "not enough distinct cuts/precisions in the " \
        "records to fit"
    assert lines == [
        "sweep: no start profile, so cuts L/3 and 2L/3 in place of the balanced ones, for "
        f"tiny at 64 tokens {link} ({why} suffix times); tiny-qwen3 at 32 tokens {link} ({why} "
        "suffix times)",
        f"sweep: no cost-model fit, so no predictions, for tiny at 32 tokens {link} ({why} "
        f"boundary and prefix times); tiny-qwen3 at 32 tokens {link} ({why} boundary and prefix "
        "times); not run for want of a fitted cut: Fig. 3 of tiny-qwen3 at 32"]
    names = {p.name for p in tmp_path.iterdir()}
    assert {"sweep.jsonl", "sweep.csv", "table1.md", "table3.md", "predictions.md",
            "crossover.md", "fig3.md", "batch.md", "start_profiles.jsonl"} <= names
    # the ready, prompt and batch 2 setups
    assert {n for n in names if n.startswith("fig2")} == {"fig2.png", "fig2-2.png", "fig2-3.png"}
    starts = [json.loads(line) for line in
              (tmp_path / "start_profiles.jsonl").read_text().splitlines()]
    assert [(p["model"], p["seq_len"]) for p in starts] == [("tiny", 32), ("tiny-qwen3", 64)]
    # tiny at 64: the fixed grid of cuts L/3 and 2L/3, fitted; its profile picks the batch cut
    assert [(p.model, p.seq_len, p.source) for p in profiles] == [
        ("tiny", 64, "fitted"), ("tiny-qwen3", 64, "fitted")]
    assert {r.action for r in records if (r.model, r.seq_len, r.interval, r.batch)
            == ("tiny", 64, "ready", 1)} == set(action_grid(TINY, (2, 4), (8, 4)))
    assert {r.action for r in records if r.batch == 2} == {
        Action(8, best_cut(profiles[0], 8), 6), Action(8, 6, 6)}
    assert {r.model for r in records if r.interval == "prompt"} == {"tiny"}
    # predictions exactly where a profile was fitted: 64 tokens, batch 1
    for r in records:
        assert (r.predicted_ms is not None) == ((r.seq_len, r.batch) == (64, 1)), r
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert len(rows) == len(records)
    predictions = (tmp_path / "predictions.md").read_text()
    assert "| tiny | 64 |" in predictions and "| tiny | 32 |" not in predictions


def test_one_pair_runs_a_sequence_of_experiments(monkeypatch):
    """`run_session`: one pair runs experiments of other lengths, links, actions and batches one
    after another over one transport, building the model once; each is checked like one run
    alone, and its pacing is its own."""
    from rekv_jax.study import experiment

    loads = []
    real = experiment.load_model
    monkeypatch.setattr(experiment, "load_model",
                        lambda *a, **k: loads.append(a) or real(*a, **k))
    bf16, q8 = Action.parse("bf16:full", 6), Action.parse("q8:r=2", 6)
    first = experiment.Experiment(seq_len=32, actions=(bf16,), transport="local", warmup=0,
                                  reps=2, link_gbps=0.0005)
    then = [dataclasses.replace(first, seq_len=16, actions=(q8,), link_gbps=None, warmup=1),
            dataclasses.replace(first, batch=2, reps=1)]
    records = []
    experiment.run_local(first, records.append, more=iter(then))
    assert loads == [("tiny", 0)] * 2  # once per side (both run in this process), not per run
    got = [(r.seq_len, r.batch, str(r.action), r.link_gbps, len(r.reps_ms)) for r in records
           if isinstance(r, Summary)]
    assert got == [(32, 1, "bf16:full", 0.0005, 2), (16, 1, "q8:r=2", None, 2),
                   (16, 1, "q8:r=2", None, 2), (32, 2, "bf16:full", 0.0005, 1)]
    assert all(r.first_token_match and "MISMATCH" not in r.cache_check for r in records
               if isinstance(r, Summary))
    # each experiment's own link: BF16 at 32 tokens takes its bytes over the paced link
    summaries = [r for r in records if isinstance(r, Summary)]
    paced, unpaced = summaries[0], summaries[1]
    # (0.5 MB/s: ~200 ms); the unpaced one is not paced to it (~50 ms for its bytes)
    ms_at_link = 1e3 / 0.5e6  # per byte at 0.5 MB/s
    assert min(paced.reps_ms) > sizes.action_bytes(TINY, bf16, 32).total_bytes * ms_at_link
    assert min(unpaced.reps_ms) < unpaced.sent_bytes * ms_at_link


def test_a_pair_keeps_its_transport_and_devices():
    from rekv_jax.study.experiment import Experiment, run_local

    first = Experiment(seq_len=16, actions=(Action.parse("bf16:full", 6),), transport="local",
                       warmup=0, reps=1, timeout=5.0)  # the prefill side's wait for the next
    with pytest.raises(ValueError, match="transport 'transfer-server'"):
        run_local(first, lambda r: None,
                  more=[dataclasses.replace(first, transport="transfer-server")])


def test_a_pair_of_processes_runs_experiments_in_turn(tmp_path):
    """`sweep.Pair` over the transfer-server transport (two processes, jax.distributed): a
    second experiment, on another link, and a third, of another model, run in the same pair
    (as a sweep runs its models); a failed one is one line."""
    from rekv_jax.study.experiment import Experiment
    from rekv_jax.study.sweep import Pair

    bf16, q8 = Action.parse("bf16:full", 6), Action.parse("q8:r=2", 6)
    first = Experiment(seq_len=16, actions=(bf16,), transport="transfer-server", warmup=0,
                       reps=1, link_gbps=0.0005)
    with Pair(tmp_path) as pair:
        paced = pair.run(first)
        unpaced = pair.run(dataclasses.replace(first, actions=(q8,), link_gbps=None))
        other = pair.run(dataclasses.replace(first, model="tiny-qwen3", actions=(q8,)))
        # both sides refuse it; the first to end is told, named unless it is the decode side
        with pytest.raises(ValueError, match=r"^(prefill-0: )?actions .*not for tiny"):
            pair.run(dataclasses.replace(first, actions=(Action(16, 8, 8),)))
    assert [(r.model, str(r.action), r.link_gbps) for r in paced + unpaced + other] == [
        ("tiny", "bf16:full", 0.0005), ("tiny", "q8:r=2", None), ("tiny", "q8:r=2", None),
        ("tiny-qwen3", "q8:r=2", 0.0005), ("tiny-qwen3", "q8:r=2", 0.0005)]
    assert all(r.first_token_match for r in paced + unpaced + other)
    assert all(r.cache_check.startswith("suffix bitwise") for r in unpaced + other)
    ms_at_link = 1e3 / 0.5e6  # per byte at 0.5 MB/s
    assert paced[0].median_ms > paced[0].sent_bytes * ms_at_link


def test_calibrate_link_paces_a_kv_layer_to_the_papers_ratio(monkeypatch):
    """`rekv handoff --link-gbps paper`: one BF16 KV layer takes PAPER_LINK_TO_SUFFIX x the
    measured suffix layer on the calibrated link, and `describe` states those numbers."""
    monkeypatch.setattr(calibrate_module, "suffix_layer_ms", lambda model, seq_len: 2.0)
    cal = calibrate_link("tiny", 128)
    kv = sizes.kv_layer_bytes(TINY, 128)  # BF16, batch 1
    assert (cal.model, cal.seq_len, cal.suffix_layer_ms, cal.kv_layer_bytes) == (
        "tiny", 128, 2.0, kv)
    layer_ms = kv / (cal.link_gbps * 1e9) * 1e3  # bytes over bytes/s, in ms
    assert layer_ms == pytest.approx(PAPER_LINK_TO_SUFFIX * 2.0, rel=1e-12)
    assert PAPER_LINK_TO_SUFFIX > 1  # the link is the slower side, as on the paper's H100 path
    text = cal.describe()
    assert f"paced {cal.link_gbps:.4g} GB/s" in text
    assert f"({kv / 2**20:.3g} MiB) takes {PAPER_LINK_TO_SUFFIX}x the 2.00 ms" in text


def test_fig3_and_batch_need_a_start_profile():
    with pytest.raises(ValueError, match="start profile"):
        SweepPreset(models=("tiny",), lengths=(32,), suffix_lens=(1, 2), transport="local",
                    link_gbps=None, crossover_factors=(1.0,), prompt_length=32)


@pytest.mark.parametrize("argv, preset, reps", [
    ([], SWEEP_PRESETS["gpu"], (30, 3)),
    (["--quick"], QUICK_PRESETS["gpu"], (10, 2)),
    (["--quick", "--reps", "5"], QUICK_PRESETS["gpu"], (5, 3)),
])
def test_sweep_cli_quick(monkeypatch, tmp_path, argv, preset, reps):
    from rekv_jax.cli import main as cli
    from rekv_jax.study import sweep as sweep_module

    seen = []

    class Stop(Exception):  # stops before the report: only the arguments matter here
        pass

    def fake_sweep(p, out, n, warmup, pin):
        seen.append((p, n, warmup, pin))
        raise Stop

    monkeypatch.setattr(sweep_module, "sweep", fake_sweep)
    with pytest.raises(Stop):
        cli.main(["sweep", "--preset", "gpu", "--out", str(tmp_path), *argv])
    assert seen == [(preset, *reps, True)]  # pinned unless --no-pin
