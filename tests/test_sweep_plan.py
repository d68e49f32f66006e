"""The sweep's plan and the dry run's wall-time estimate (no handoff runs here)."""

import pytest

from rekv_jax import Action, ModelConfig
from rekv_jax.mode import Mode
from rekv_jax.planning import costmodel as cm
from rekv_jax.planning.planner import PAPER_LINK_GBPS
from rekv_jax.study.experiment import Experiment
from rekv_jax.study.sweep_plan import (
    COSTS,
    MODEL_PROGRAMS,
    QUICK_PRESETS,
    SMALL_PROGRAMS_PER_ACTION,
    SWEEP_PRESETS,
    ModelPlan,
    PairCosts,
    analytic_profile_of,
    estimate,
    plan_models,
    programs,
)

TINY = ModelConfig.preset("tiny")


def test_estimate_is_the_sum_of_its_parts():
    """One pair's start-up and each later model's weights, compiles x programs, and (warmup +
    reps) x (predicted median + overhead) per action and schedule."""
    bf16, q8 = Action.parse("bf16:full", 6), Action.parse("q8:r=2", 6)
    exps = (Experiment(seq_len=32, actions=(bf16, q8), warmup=1, reps=4),  # q8: both schedules
            Experiment(seq_len=32, actions=(q8,), schedules=("overlapped",), warmup=0, reps=2,
                       link_gbps=0.5))
    pair = ModelPlan("tiny", exps)
    # the model core's programs of one shape, (32, 1); the small ones of two distinct actions
    model, small = programs(list(exps))
    assert model == {(32, 1, p) for p in MODEL_PROGRAMS}
    assert len(small) == 2 * SMALL_PROGRAMS_PER_ACTION
    assert (pair.programs, pair.handoffs) == ((3, 2 * SMALL_PROGRAMS_PER_ACTION), 5 * 3 + 2)
    costs = PairCosts(startup_s=7.0, compile_s=2.0, small_compile_s=0.5,
                      handoff_overhead_ms=1.0, weights_s=3.0, source="test")
    links = []

    def profile_of(m, s, b, lk):
        links.append(lk)
        return cm.Profile.for_config(
            TINY, s, b, hardware="h", link="l", link_gbps=lk, source="analytic",
            quantize_ms={16: 0.0, 8: 0.1}, restore_ms={16: 0.0, 8: 0.2}, suffix_layer_ms=0.3,
            join_ms=0.05, message_ms=0.5)

    est = estimate([pair, pair], costs, 0.25, profile_of)  # two models on the sweep's one pair
    assert links == [0.25, 0.5] * 2  # an unpaced experiment is priced at the sweep's link
    p1, p2 = profile_of("tiny", 32, 1, 0.25), profile_of("tiny", 32, 1, 0.5)
    first = 5 * (cm.predicted_ms(p1, Mode.of(bf16, "sequential"))
                 + cm.predicted_ms(p1, Mode.of(q8, "sequential"))
                 + cm.predicted_ms(p1, Mode.of(q8, "overlapped")) + 3)
    second = 2 * (cm.predicted_ms(p2, Mode.of(q8, "overlapped")) + 1)
    n_small = 2 * 2 * SMALL_PROGRAMS_PER_ACTION
    assert (est.pairs, est.experiments, est.handoffs, est.programs) == (1, 4, 34, (6, n_small))
    assert est.startup_s == 7.0 + 3.0  # the pair, then the second model's weights
    assert est.compile_s == pytest.approx(6 * 2.0 + n_small * 0.5)
    assert est.handoff_s == pytest.approx(2 * (first + second) / 1e3)
    assert est.total_s == pytest.approx(10.0 + est.compile_s + est.handoff_s)


def test_quick_gpu_sweep_fits_eight_minutes_of_one_gpu():
    """The quick GPU preset, at `--quick`'s 10 reps and 2 warmups, is estimated (assumed GPU
    costs, analytic medians on the paper's link) within 480 s; the full one is not."""
    quick, full, link = QUICK_PRESETS["gpu"], SWEEP_PRESETS["gpu"], PAPER_LINK_GBPS
    plans = plan_models(quick, link, 10, 2, analytic_profile_of())
    est = estimate(plans, COSTS["gpu"], link, analytic_profile_of())
    assert est.pairs == 1 and est.total_s <= 480, est
    full_plans = plan_models(full, link, 30, 3, analytic_profile_of())
    assert [p.model for p in full_plans] == list(full.models)  # model after model
    # per model: a start profile and a grid per length and link block, and its tail
    assert sum(len(p.experiments) for p in full_plans) == 45
    assert estimate(full_plans, COSTS["gpu"], link, analytic_profile_of()).total_s > 480


def test_sweep_dry_run_prints_the_plan(capsys):
    from rekv_jax.cli import main as cli

    cli.main(["sweep", "--preset", "gpu", "--quick", "--dry-run"])
    out = capsys.readouterr().out
    assert out.startswith("rekv sweep --preset gpu --quick: plan (10 reps, 2 warmup)")
    assert "\n  qwen2.5-7b: " in out and "total: 1 pair, " in out
    assert "ASSUMED, never measured on a GPU" in out
    assert "estimate: " in out and "analytic_profile" in out


def test_cpu_paper_preset_plans_the_papers_study_on_tiny_7b():
    """tiny-7b alone: a start profile and a balanced grid per length (256, 512) with
    BF16/Q8/Q4 transfer, BF16 recompute and joint Q8 cuts, and full recomputation; its grid's
    schedules are the preset's field (the chunked schedule joins there)."""
    import dataclasses

    preset = SWEEP_PRESETS["cpu-paper"]
    link = 0.002
    profile_of = analytic_profile_of(tflops=0.03, hbm_gbps=10.0)
    (pair,) = plan_models(preset, link, 30, 3, profile_of)
    assert pair.model == "tiny-7b" and [e.seq_len for e in pair.experiments] == [256, 512] * 2
    L = ModelConfig.preset("tiny-7b").num_layers
    for grid in pair.experiments[2:]:
        families = {(a.bits, a.kind) for a in grid.actions}
        assert families == {(16, "transfer"), (8, "transfer"), (4, "transfer"), (16, "joint"),
                            (8, "joint"), (16, "recompute")}
        assert {a.cut for a in grid.actions if a.kind == "joint"} <= set(range(1, L))
        assert grid.schedules == preset.schedules == ("overlapped", "sequential", "chunked")
        assert grid.chunks == preset.chunks == 2
    assert COSTS[preset.machine] is COSTS["cpu"] and QUICK_PRESETS["cpu-paper"].lengths == (256,)
    only = dataclasses.replace(preset, schedules=("overlapped",))
    (pair,) = plan_models(only, link, 30, 3, profile_of)
    assert all(e.schedules == ("overlapped",) for e in pair.experiments[2:])
