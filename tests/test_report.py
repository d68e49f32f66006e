"""Report: tables and figures from synthetic summary records with known winners."""

import dataclasses
import json

import numpy as np
import pytest

from rekv_jax import sizes, stats
from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.mode import Mode
from rekv_jax.phases import Phases
from rekv_jax.planning.costmodel import predicted_ms as mode_predicted_ms
from rekv_jax.planning.costmodel import t_ov
from rekv_jax.planning.planner import analytic_profile
from rekv_jax.study import chunked_table, figures, report
from rekv_jax.study import tables as study_tables
from rekv_jax.study.records import Summary, read_summaries


def predicted_ms(profile, action, schedule="overlapped", interval=None, prefill="full",
                 chunks=1):
    """The cost model's prediction of `action` run as the mode these name."""
    return mode_predicted_ms(profile, Mode.of(action, schedule, prefill, chunks, interval))

TINY = ModelConfig.preset("tiny")  # L = 6
L = TINY.num_layers
# Medians (ms) at 256 tokens: joint q8:r=2 is fastest, bf16:r=3 the best BF16 recompute.
MEDIANS = {"bf16:full": 40.0, "q8:full": 22.0, "q4:full": 30.0, "bf16:r=1": 38.0,
           "bf16:r=3": 25.0, "bf16:recompute": 60.0, "q8:r=1": 20.0, "q8:r=2": 16.0,
           "q8:r=4": 21.0}


def _rec(action: str, median: float, schedule: str = "overlapped", link: float | None = 5.0,
         seq_len: int = 256, **extra) -> Summary:
    a = Action.parse(action, L)
    reps = tuple(median * (1 + 0.002 * np.arange(-14.5, 15)))  # 30 reps around the median
    phases = Phases(0.1, 1.0, 0.6 * median, 0.5 * median, 0.2)
    return Summary(model="tiny", seq_len=seq_len, batch=1, action=a, transport="local",
                   schedule=schedule, link_gbps=link, hardware="test cpu", reps_ms=reps,
                   phases_ms=phases,
                   payload_bytes=sizes.action_bytes(TINY, a, seq_len).total_bytes,
                   cache_check="ok", **extra)


def _sweep(scale: float = 1.0, seq_len: int = 256, link: float | None = 5.0) -> list[Summary]:
    """One run of every action in MEDIANS, as the handoff writes it (schedule n/a unless joint)."""
    return [_rec(a, m * scale, "overlapped" if ":r=" in a else "n/a", seq_len=seq_len, link=link)
            for a, m in MEDIANS.items()]


def test_table1_known_winner_and_speedup_math():
    recs = _sweep() + _sweep(2.0, seq_len=512)
    rows = study_tables.table1_rows(recs)
    assert [(r.model, r.seq_len) for r in rows] == [("tiny", 256), ("tiny", 512)]
    r = rows[0]
    assert str(r.joint.action) == "q8:r=2" and str(r.recompute.action) == "bf16:r=3"
    assert str(r.best.action) == "q8:r=2"
    assert r.bf16.median_ms == stats.median(r.bf16.reps_ms)  # filled from the reps
    bf16, joint = r.bf16.median_ms, r.joint.median_ms
    assert r.joint_vs_bf16.x == pytest.approx(40 / 16) == bf16 / joint
    lo, hi = r.joint_vs_bf16.ci95
    assert lo <= r.joint_vs_bf16.x <= hi


def test_best_single_is_the_faster_of_q8_transfer_and_recompute():
    r = study_tables.table1_rows(_sweep())[0]
    assert r.joint_vs_single.over == "q8:full"
    assert r.joint_vs_single.x == pytest.approx(22.0 / 16.0)
    slow_q8 = [_rec(a, 30.0 if a == "q8:full" else m) for a, m in MEDIANS.items()]
    assert study_tables.table1_rows(slow_q8)[0].joint_vs_single.over == "bf16:r=3"


def test_overlapped_records_win_sequential_only_fills_trivial_schedules():
    recs = [_rec("bf16:full", 40.0, "sequential"), _rec("q8:r=2", 10.0, "sequential"),
            _rec("q8:r=2", 16.0), _rec("bf16:r=3", 5.0, "sequential")]
    r = study_tables.table1_rows(recs)[0]
    assert r.bf16.schedule == "sequential"  # transfer-only: nothing to overlap
    assert r.joint.median_ms == pytest.approx(16.0)  # the overlapped run, not the sequential
    assert r.recompute is None  # a joint cut measured only sequentially is not in the table


def test_table1_markdown_is_labelled():
    md = study_tables.table1_markdown(_sweep())
    assert "hardware: test cpu · transport: local · link: paced 5 GB/s · batch 1" in md
    assert "30 reps" in md and "| tiny | 256 | 40.00 | 22.00 | 25.00 (r=3) | 16.00 (r=2) |" in md
    unpaced = study_tables.table1_markdown(_sweep(link=None))
    assert "link: unpaced" in unpaced


def test_predictions_from_records_and_from_a_profile():
    profile = analytic_profile(TINY, 256, link_gbps=1.0)
    recs = [_rec("q8:r=2", 16.0, predicted_ms=20.0), _rec("bf16:full", 40.0),
            _rec("bf16:r=3", 25.0, "sequential", seq_len=512)]
    no_q4 = dataclasses.replace(profile, quantize_ms={16: 0.0, 8: 0.1},
                                restore_ms={16: 0.0, 8: 0.1})
    rows = study_tables.prediction_rows(recs + [_rec("q4:r=2", 16.0)], [no_q4, profile])
    assert len(rows) == 3 and rows[2].predicted_ms == predicted_ms(
        profile.at_link(5.0), Action(4, L - 2, L))  # the profile that has Q4 costs
    rows = study_tables.prediction_rows(recs, [profile])
    assert len(rows) == 2  # no profile for 512 tokens
    assert rows[0].error_pct == pytest.approx(25.0)
    want = predicted_ms(profile.at_link(5.0), Action(16, L, L))  # re-targeted to the paced link
    assert rows[1].predicted_ms == pytest.approx(want)
    assert rows[1].error_pct == pytest.approx(100 * (want - 40.0) / 40.0)
    summary = study_tables.error_summary(rows)
    assert summary == {"bf16:full": pytest.approx(abs(rows[1].error_pct)), "q8:r=2": 25.0}
    md = study_tables.predictions_markdown(recs, [profile])
    assert "| q8:r=2 | 25.0 |" in md and "over 2 records" in md


def test_unpaced_and_prompt_records_take_their_own_profile_and_interval():
    paced = dataclasses.replace(analytic_profile(TINY, 256, link_gbps=1.0), link="ts paced 1")
    unpaced = dataclasses.replace(paced, link_gbps=40.0, link="ts unpaced")
    recs = [_rec("bf16:full", 40.0, link=None),
            _rec("bf16:r=3", 60.0, "sequential", interval="prompt")]
    rows = study_tables.prediction_rows(recs, [paced, unpaced])
    assert rows[0].predicted_ms == predicted_ms(unpaced, Action(16, L, L))
    assert rows[1].predicted_ms == predicted_ms(paced.at_link(5.0), Action(16, L - 3, L),
                                                   "sequential", "prompt", "full")


def test_chunked_and_pipelined_records_are_predicted_with_their_chunks():
    # a slow link and a slow suffix: the suffix waits for the boundary, which chunks shorten
    profile = dataclasses.replace(analytic_profile(TINY, 256, link_gbps=1.0), suffix_layer_ms=300.0)
    slow = 0.001  # GB/s
    recs = [_rec("q8:r=2", 16.0, "chunked", link=slow, chunks=4),
            _rec("q8:r=2", 30.0, "chunked", link=slow, interval="prompt", prefill="pipelined",
                 chunks=4)]
    rows = study_tables.prediction_rows(recs, [profile])
    at = profile.at_link(slow)
    a = Action(8, L - 2, L)
    assert rows[0].predicted_ms == predicted_ms(at, a, "chunked", chunks=4)
    assert rows[0].predicted_ms != predicted_ms(at, a)  # not the overlapped schedule's
    assert rows[1].predicted_ms == predicted_ms(at, a, "chunked", "prompt", "pipelined", 4)
    assert rows[1].predicted_ms != predicted_ms(at, a, "chunked", "prompt", "pipelined", 2)


def test_chunked_records_stand_beside_table1_not_in_it():
    recs = _sweep() + [_rec("q8:r=2", 12.0, "chunked", chunks=2),
                       _rec("q8:r=1", 14.0, "chunked", chunks=2)]
    (row,) = study_tables.table1_rows(recs)
    assert row.joint.median_ms == pytest.approx(16.0) and row.joint.schedule == "overlapped"
    (ch,) = chunked_table.chunked_rows(recs)
    assert (ch.chunks, str(ch.overlapped.action), str(ch.chunked.action)) == (2, "q8:r=2",
                                                                           "q8:r=2")
    assert ch.speedup.x == pytest.approx(16.0 / 12.0) and ch.speedup.over == "q8:r=2"
    assert "| tiny | 256 | 2 | q8:r=2 (16.00) | q8:r=2 (12.00) | 1.33×" in (
        chunked_table.chunked_markdown(recs))
    assert chunked_table.chunked_markdown(_sweep()) == ""  # no chunked run, no table


def test_table3_payloads_schedule_gain_and_efficiency():
    recs = _sweep() + [_rec("bf16:r=2", 30.0, "sequential"), _rec("bf16:r=2", 20.0)]
    (row,) = study_tables.table3_rows(recs)
    assert row.payload_mib["BF16 transfer"] == sizes.handoff_bytes(TINY, 256, 16, L).total_mib
    assert row.payload_mib["joint Q8 (q8:r=2)"] == sizes.handoff_bytes(
        TINY, 256, 8, L - 2).total_mib
    s = row.schedule
    assert s.action == "bf16:r=2"  # BF16 at the best joint cut, as in the paper
    assert s.gain == pytest.approx(1.5) and s.gain_ci95[0] <= 1.5 <= s.gain_ci95[1]
    ov, seq = recs[-1], recs[-2]
    ideal = t_ov(*seq.phases_ms.ready)  # Eq. 9 from the uncontended phases
    assert s.efficiency_sequential_phases == pytest.approx(ov.median_ms / ideal)
    assert not hasattr(s, "efficiency_own_phases")  # ~1 by construction: not reported
    assert "Schedule gain 1.50×" in study_tables.table3_markdown(recs)
    assert study_tables.table3_rows(_sweep())[0].schedule is None


def test_crossover_measured_and_predicted():
    # Slow link favours the joint action, fast link favours Q8 transfer-only.
    recs = []
    for link, joint, q8 in ((1.0, 16.0, 40.0), (10.0, 12.0, 11.0), (100.0, 11.0, 5.0)):
        recs += [_rec("q8:r=2", joint, link=link), _rec("q8:full", q8, link=link),
                 _rec("bf16:full", 2 * q8, link=link)]
    profile = analytic_profile(TINY, 256)
    rows = study_tables.crossover_rows(recs, [profile])
    assert [r.link_gbps for r in rows] == [1.0, 10.0, 100.0]
    assert [r.measured_best for r in rows] == ["q8:r=2", "q8:full", "q8:full"]
    for r in rows:
        preds = {a: predicted_ms(profile.at_link(r.link_gbps), Action.parse(a, L))
                 for a in ("q8:r=2", "q8:full", "bf16:full")}
        assert r.predicted_best == min(preds, key=preds.get)
    md = study_tables.crossover_markdown(recs, [profile])
    assert "q8:r=2 → q8:full between 1 and 10 GB/s" in md
    assert "Predicted crossovers (analytic profile" in md
    assert study_tables.crossover_rows(_sweep()) == []  # one link: no crossover


def test_write_report_writes_every_file(tmp_path):
    recs = _sweep() + _sweep(2.0, seq_len=512) + [_rec("bf16:r=2", 30.0, "sequential")]
    recs += [_rec("q8:full", 9.0, link=50.0), _rec("q8:r=2", 12.0, link=50.0)]
    jsonl = tmp_path / "sweep.jsonl"
    lines = [{"kind": "rep"}] + [r.to_json() for r in recs]
    jsonl.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    loaded = read_summaries(jsonl)
    assert loaded == recs
    paths = report.write_report(loaded, tmp_path / "out", [analytic_profile(TINY, 256)])
    names = sorted(p.name for p in paths)
    assert names == sorted(["table1.md", "predictions.md", "table3.md", "crossover.md",
                            "fig2.png", "fig2-2.png", "crossover.png", "figures.md"])
    for p in paths:
        data = p.read_bytes()
        assert data and (p.suffix == ".md" or data[:8] == b"\x89PNG\r\n\x1a\n")
    # the figures' short names: what each shows is in figures.md (and in its title)
    figures = (tmp_path / "out" / "figures.md").read_text()
    for name, what in (("fig2.png", "link: paced 5 GB/s"), ("fig2-2.png", "link: paced 50 GB/s"),
                       ("crossover.png", "tiny, 256 tokens, batch 1 · hardware: test cpu")):
        assert f"**{name}**: " in figures and f"![{name}]({name})" in figures
        line = next(t for t in figures.splitlines() if t.startswith(f"**{name}**"))
        assert what in line, line


def _outside(fig) -> list[str]:
    """The texts of `fig`, drawn, that reach past its edges (tick labels aside: those of ticks
    outside the axes' limits are laid out but not drawn)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    FigureCanvasAgg(fig).draw()
    ticks = {id(t) for ax in fig.axes for which in ("major", "minor")
             for t in ax.get_xticklabels(which=which) + ax.get_yticklabels(which=which)}
    box = fig.bbox
    return [t.get_text() for t in fig.findobj(Text)
            if t.get_visible() and t.get_text() and id(t) not in ticks
            and not (box.x0 - 1 <= (e := t.get_window_extent()).x0 and e.x1 <= box.x1 + 1
                     and box.y0 - 1 <= e.y0 and e.y1 <= box.y1 + 1)]


def test_every_title_fits_its_figure():
    """A setup's long label wraps inside the figure: a Fig. 2 of one model (the narrowest) and a
    crossover figure, each titled with everything a setup can say."""
    long = dict(hardware="gpu:NVIDIA H200 (x86_64, 1 dev, CUDA 12.8, driver 570.124.06)",
                pinning="pinned: prefill cpu 0-15, decode cpu 16-31", prefill_devices=4,
                decode_devices=2)
    recs = [dataclasses.replace(r, **long) for r in _sweep() + _sweep(2.0, seq_len=512)]
    prompt = [dataclasses.replace(r, interval="prompt", prefill="split") for r in recs]
    fig = figures.fig2_figure(prompt)
    assert "timed from the prompt" in fig.get_suptitle()
    assert not _outside(fig), _outside(fig)
    links = [dataclasses.replace(r, link_gbps=w, prefill_devices=1, decode_devices=1)
             for w in (0.5, 5.0, 50.0) for r in recs if r.seq_len == 256]  # one device a side
    profile = dataclasses.replace(analytic_profile(TINY, 256), source="fitted to " + "x" * 90)
    fig = figures.crossover_plot(links, profile)
    assert "fitted to" in fig.get_suptitle()
    assert not _outside(fig), _outside(fig)


def test_wrapped_breaks_at_separators_and_keeps_every_word():
    text = "first line\n" + " · ".join(f"part {i} of a label" for i in range(8))
    out = figures.wrapped(text, 3.0)
    limit = int(3.0 * figures.CHARS_PER_INCH)
    assert all(len(line) <= limit for line in out.splitlines())
    assert out.splitlines()[0] == "first line"
    assert " ".join(out.replace(" · ", " ").split()) == " ".join(text.replace(" · ", " ").split())
    assert figures.wrapped("short", 6.0) == "short"


@pytest.mark.parametrize("change, match", [
    (lambda r: r.pop("reps_ms"), "reps_ms"),
    (lambda r: r.update(schedule="both"), "schedule"),
    (lambda r: r.update(reps_ms=[]), "no reps_ms"),
    (lambda r: r.update(bits=6), "bits 6"),
])
def test_bad_records_raise(change, match):
    r = _rec("q8:r=2", 16.0).to_json()
    assert Summary.from_json(r) == _rec("q8:r=2", 16.0)  # the JSON form round-trips
    change(r)
    with pytest.raises(ValueError, match=match):
        Summary.from_json(r)
    with pytest.raises(ValueError, match="no summary records"):
        report.write_report([], "unused")


def test_conclusion_names_the_fastest_speedups_and_schedule_gain():
    recs = _sweep() + [_rec("bf16:r=2", 30.0, "sequential"), _rec("bf16:r=2", 20.0)]
    text = "\n".join(report.conclusion(recs))
    assert text.startswith("Fastest: q8:r=2 at 16.00 ms")
    assert "joint q8:r=2 vs BF16 transfer: 2.50× [" in text  # 40 / 16
    # best single: the faster of Q8 transfer (22) and the best BF16 recompute (bf16:r=2, 20)
    assert "vs the best single mechanism: 1.25× [" in text and "over bf16:r=2" in text
    assert "Schedule gain at bf16:r=2: sequential 30.00 ms -> overlapped 20.00 ms, 1.50×" in text
    assert "Why so little" not in text  # paced, and BF16 transfer is beaten
    unpaced = "\n".join(report.conclusion(_sweep(link=None)))
    assert "Why so little: over unpaced loopback" in unpaced


def test_fig3_speedup_uses_the_paired_bootstrap():
    seq = np.array([100.0, 140.0, 90.0, 160.0, 120.0, 110.0])  # reps drift together in pairs
    ov = seq * 0.8
    recs = [dataclasses.replace(_rec("bf16:r=2", 1.0, s, interval="prompt", paired=True),
                                reps_ms=tuple(t), median_ms=float(np.median(t)))
            for s, t in (("sequential", seq), ("overlapped", ov))]
    (row,) = study_tables.fig3_rows(recs + _sweep())  # ready-interval records are not Fig. 3's
    assert row.paired and row.speedup == pytest.approx(1.25)
    assert row.ci95 == pytest.approx((1.25, 1.25))  # every paired ratio is exactly 1.25
    unpaired = study_tables.fig3_rows([dataclasses.replace(r, paired=False) for r in recs])[0]
    assert not unpaired.paired and unpaired.ci95[0] < 1.2 < 1.3 < unpaired.ci95[1]
    text = study_tables.fig3_markdown(recs)
    assert "Prompt to first token" in text and "paired bootstrap" in text and "1.25×" in text


def test_batch_table_completion_time_and_requests_per_second(tmp_path):
    recs = [dataclasses.replace(_rec(a, m, s), batch=4)
            for a, m, s in (("q8:r=2", 40.0, "overlapped"), ("q8:full", 50.0, "n/a"))]
    (row,) = study_tables.batch_rows(recs + _sweep())  # batch-1 records have no batch row
    assert row.batch == 4 and str(row.joint.action) == "q8:r=2"
    assert row.requests_per_s == pytest.approx({"joint": 100.0, "transfer": 80.0})
    assert row.joint_vs_transfer.x == pytest.approx(1.25)
    names = {p.name for p in report.write_report(recs, tmp_path)}
    assert "batch.md" in names and "fig3.md" not in names
    assert "| 100.00 |" in (tmp_path / "batch.md").read_text()
