"""The measured sweep end to end on a miniature preset, and `rekv profile`."""

import json

import pytest

from rekv_jax import Action, ModelConfig
from rekv_jax.sweep import SWEEP_PRESETS, SweepPreset, action_grid, profile, sweep


def test_action_grid_covers_every_mechanism():
    cfg = ModelConfig.preset("tiny")
    grid = [str(a) for a in action_grid(cfg, (1, 2, 9), (8, 4))]
    assert grid == ["bf16:full", "q8:full", "q4:full", "bf16:r=1", "bf16:r=2", "q8:r=1",
                    "q8:r=2", "q4:r=1", "q4:r=2", "bf16:recompute"]  # r=9 > L is dropped
    gpu = SWEEP_PRESETS["gpu"]
    assert all(isinstance(a, Action) for a in action_grid(
        ModelConfig.preset("qwen2.5-7b"), gpu.suffix_lens, gpu.joint_bits))


def test_a_sweep_needs_two_suffix_lengths():
    with pytest.raises(ValueError, match="two suffix lengths"):
        SweepPreset(models=("tiny",), lengths=(32,), suffix_lens=(2,), transport="local",
                    link_gbps=None, crossover_factors=(1.0,))


def test_mini_sweep_writes_every_output(tmp_path):
    preset = SweepPreset(models=("tiny",), lengths=(32,), suffix_lens=(1, 2), transport="local",
                         link_gbps=None, crossover_factors=(1.0, 4.0))
    records, profiles = sweep(preset, tmp_path, reps=2, warmup=1)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"sweep.jsonl", "sweep.csv", "table1.md", "table3.md", "predictions.md",
            "crossover.md"} <= names
    assert any(n.startswith("fig2_") and n.endswith(".png") for n in names)
    # one profile fitted from the grid run (2 noisy reps: its values are not asserted here;
    # fitting itself is tested on synthetic records in test_costmodel.py)
    assert [(p.model, p.seq_len, p.source) for p in profiles] == [("tiny", 32, "fitted")]
    links = {r.link_gbps for r in records}
    assert len(links) == 2  # the calibrated link and 4x it (crossover)
    assert all(r.first_token_match and r.predicted_ms is not None for r in records)
    lines = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert sum(line["kind"] == "summary" for line in lines) == len(records)
    assert "tiny" in (tmp_path / "table1.md").read_text()


def test_profile_measures_every_cost():
    # a slow link, so that transfer time dominates the noise of these few reps
    prof = profile("tiny", 32, "local", link_gbps=0.002, reps=2, warmup=1)
    assert prof.source == "fitted" and prof.suffix_layer_ms > 0
    assert set(prof.quantize_ms) >= {8, 4}
    assert prof.at_link(1.0).link_gbps == 1.0
