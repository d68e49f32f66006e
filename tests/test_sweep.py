"""The measured sweep end to end on a miniature preset (its start profile is `rekv profile`)."""

import csv
import dataclasses
import json

import pytest

from rekv_jax import Action, ModelConfig
from rekv_jax.costmodel import Profile
from rekv_jax.sweep import (
    QUICK_PRESETS,
    SWEEP_PRESETS,
    SweepPreset,
    action_grid,
    balanced_grid,
    best_cut,
    sweep,
)


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


def test_balanced_grid_stays_interior():
    prof = dataclasses.replace(_synthetic_profile(), suffix_layer_ms=0.01)  # c* clips to 1
    cuts = [a.cut for a in balanced_grid(prof, (8,), spread=2) if a.kind == "joint"]
    assert cuts and min(cuts) >= 1 and max(cuts) < 28


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


def test_mini_sweep_writes_every_output(tmp_path):
    """The gpu preset's plumbing on tiny shapes, in one run: a start profile, the balanced grid,
    a crossover link, paired Fig. 3 and batch 2, and every output file."""
    preset = SweepPreset(models=("tiny",), lengths=(32,), suffix_lens=(), transport="local",
                         link_gbps=0.002, crossover_factors=(1.0, 4.0),
                         cut_spread=0, prompt_length=32, batch_model="tiny", batches=(2,))
    records, profiles = sweep(preset, tmp_path, reps=2, warmup=1)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"sweep.jsonl", "sweep.csv", "table1.md", "table3.md", "predictions.md",
            "crossover.md", "fig3.md", "batch.md", "start_profiles.jsonl"} <= names
    assert any(n.startswith("fig2_") and n.endswith(".png") for n in names)
    lines = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert sum(line["kind"] == "summary" for line in lines) == len(records)
    assert all(r.first_token_match for r in records)

    # the start profile (`rekv profile`'s measurement) has every cost; the grid is its balanced
    # cuts; the grid run is fitted too (2 noisy reps: values are not asserted; fitting itself
    # is tested on synthetic records in test_costmodel.py)
    (start,) = [json.loads(line) for line in
                (tmp_path / "start_profiles.jsonl").read_text().splitlines()]
    prof = Profile.from_json(start)
    assert prof.source == "fitted" and prof.suffix_layer_ms > 0 and {8, 4} <= set(prof.quantize_ms)
    assert prof.at_link(1.0).link_gbps == 1.0
    assert [(p.model, p.seq_len, p.source) for p in profiles] == [("tiny", 32, "fitted")]
    ready = [r for r in records if r.interval == "ready" and r.batch == 1]
    grid = {str(a) for a in balanced_grid(prof, (8, 4), 0)}
    assert {str(r.action) for r in ready if r.link_gbps == 0.002} == grid
    # crossover: four actions again at 4x the link
    assert {r.link_gbps for r in ready} == {0.002, 0.008}
    prompt = [r for r in records if r.interval == "prompt"]
    assert [(str(r.action), r.schedule, r.paired) for r in prompt] == [
        (f"bf16:r={6 - best_cut(prof, 16)}", s, True) for s in ("sequential", "overlapped")]
    batch = [r for r in records if r.batch == 2]
    assert {str(r.action) for r in batch} == {f"q8:r={6 - best_cut(prof, 8)}", "q8:full"}

    # each record's prediction is its own setup's: the prompt interval adds the prefill compute
    # to the ready one; no profile was fitted at batch 2, so the batch records predict nothing
    ready_pred = {(str(r.action), r.schedule): r.predicted_ms for r in ready
                  if r.link_gbps == 0.002}
    assert all(r.predicted_ms is not None for r in ready)
    assert all(r.predicted_ms > ready_pred[str(r.action), r.schedule] for r in prompt)
    assert all(r.predicted_ms is None for r in batch)
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert len(rows) == len(records)  # the prompt interval's prefill compute is a column
    assert all(float(r["prefill_ms"]) > 0 for r in rows if r["interval"] == "prompt")
    assert "tiny" in (tmp_path / "table1.md").read_text()
    assert "paired bootstrap" in (tmp_path / "fig3.md").read_text()
    assert "Batch 2" in (tmp_path / "batch.md").read_text()


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
    from rekv_jax import cli
    from rekv_jax import sweep as sweep_module

    seen = []

    def fake_sweep(p, out, n, warmup):
        seen.append((p, n, warmup))
        raise KeyboardInterrupt  # stop before the report: only the arguments matter here

    monkeypatch.setattr(sweep_module, "sweep", fake_sweep)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["sweep", "--preset", "gpu", "--out", str(tmp_path), *argv])
    assert seen == [(preset, *reps)]
