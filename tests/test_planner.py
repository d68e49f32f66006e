"""Planner: every action predicted, the best is the argmin, Prop. 2 agrees, links shift plans,
the quality gate bounds the choice."""

import dataclasses
import json

import numpy as np
import pytest

from rekv_jax import sizes
from rekv_jax.action import Action, action_space
from rekv_jax.cli.main import main
from rekv_jax.config import ModelConfig
from rekv_jax.gate_result import GateResult
from rekv_jax.mode import Mode
from rekv_jax.planning import costmodel as cm
from rekv_jax.planning import planner

QWEN7B = ModelConfig.preset("qwen2.5-7b")
TINY = ModelConfig.preset("tiny")


def _by_action(out: planner.Plan, **way) -> dict[str, planner.Candidate]:
    """The candidates of one (schedule, prefill, chunks), keyed by action text."""
    return {str(c.action): c for c in out.candidates
            if all(getattr(c, k) == v for k, v in way.items())}


def test_analytic_plan_is_labelled_and_consistent():
    out = planner.plan(QWEN7B, 8192, schedules=("overlapped",))
    assert "analytic" in out.note and out.profile.source == "analytic"
    L = QWEN7B.num_layers
    # the transfer terms use the profile's link: full BF16 sends L layers of 2 S K H bf16 bytes
    # (16 MiB per layer, as the paper's §2.2 states for Qwen2.5-7B at 8K)
    layer_bytes = 2 * 8192 * QWEN7B.num_kv_heads * QWEN7B.head_dim * 2
    assert layer_bytes == 16 * 2**20
    full = _by_action(out)[str(Action(16, L, L))]
    assert full.phases_ms.prefix == pytest.approx(
        L * layer_bytes / (out.profile.link_gbps * 1e6))
    assert [str(c.action) for c in out.candidates] == [str(a) for a in action_space(L)]
    assert out.best == min(out.candidates, key=lambda c: c.predicted_ms)
    for c in out.candidates:
        # the played plan is Eq. 9 (its floats summed in its steps' order)
        assert c.predicted_ms == pytest.approx(cm.predict(out.profile, c.action).t_ov_ms,
                                               rel=1e-12)
        schedule = "overlapped" if c.action.kind == "joint" else "n/a"
        assert (c.schedule, c.prefill, c.chunks, c.quality) == (schedule, "full", 1,
                                                                 "unchecked")
    for prec, bc in out.balanced_cut.items():  # Prop. 2 finds the best interior cut
        interior = [c for c in out.candidates
                    if c.action.precision == prec and 0 < c.action.cut < L]
        fastest = min(c.predicted_ms for c in interior)
        assert min(c.predicted_ms for c in interior if c.action.cut in bc.cuts) == fastest
        assert bc.suffix_lens == tuple(L - c for c in bc.cuts)


def test_analytic_bf16_transfer_is_the_papers_link_time():
    # §4.4: 448 MiB in 202.13 ms on the H100 TCP path defines the default link.
    (bf16,) = planner.plan(QWEN7B, 8192, actions=[Action(16, 28, 28)]).candidates
    assert bf16.phases_ms.prefix == pytest.approx(202.13)
    assert bf16.payload_bytes == 448 * 2**20


def test_faster_link_moves_the_cut_toward_transfer():
    profile = planner.analytic_profile(QWEN7B, 8192)
    for bits in (16, 8, 4):
        stars = [profile.at_link(w).balanced_cut(bits)[0] for w in (0.5, 2, 8, 32)]
        assert stars == sorted(stars) and stars[0] < stars[-1]
    slow = planner.plan(QWEN7B, 8192, profile, link_gbps=0.01).best
    fast = planner.plan(QWEN7B, 8192, profile, link_gbps=1000).best
    assert slow.action.kind == "recompute" and fast.action.kind == "transfer"


def test_sequential_schedule_and_restricted_actions():
    acts = [Action(8, c, TINY.num_layers) for c in (2, 4)]
    out = planner.plan(TINY, 256, actions=acts, schedules=("sequential",))
    assert [str(c.action) for c in out.candidates] == ["q8:r=4", "q8:r=2"]
    assert all(c.predicted_ms == pytest.approx(cm.predict(out.profile, c.action).t_seq_ms,
                                               rel=1e-12) for c in out.candidates)


def test_plan_tries_every_schedule_and_chunk_count_where_they_matter():
    L = QWEN7B.num_layers
    for interval in ("ready", "prompt"):
        out = planner.plan(QWEN7B, 8192, interval=interval, chunks=(1, 2, 4, 9000))
        ways = {(str(c.action), c.schedule, c.prefill, c.chunks) for c in out.candidates}
        assert len(ways) == len(out.candidates)
        for c in out.candidates:  # every prediction is the cost model's
            assert c.predicted_ms == cm.predicted_ms(out.profile, c.mode)
            assert c.mode == Mode.of(c.action, c.mode.schedule, c.prefill, c.chunks, interval)
            assert c.chunks in (1, 2, 4)  # at most one chunk per token
        joint, transfer = "q8:r=13", "q8:full"
        assert {(s, n) for a, s, p, n in ways if a == joint and p == "full"} == {
            ("overlapped", 1), ("sequential", 1), ("chunked", 2), ("chunked", 4)}
        assert {s for a, s, p, n in ways if a == transfer and p == "full"} == {"n/a"}
        prefills = {p for a, s, p, n in ways}
        assert prefills == ({"full", "split", "pipelined"} if interval == "prompt" else {"full"})
        assert out.best == min(out.candidates, key=lambda c: c.predicted_ms)
    # a pipelined full recomputation: the ids at once, the decode side's chunked prefill
    assert str(Action(16, 0, L)) in _by_action(out, prefill="pipelined", chunks=2)


QWEN7B_GATE = [  # the paper's verdicts at 8K (§4.1, Table 2): joint Q8 passes, joint Q4 fails
    GateResult("qwen2.5-7b", 8192, "q8:r=13", True),
    GateResult("qwen2.5-7b", 8192, "q4:r=13", False),
    GateResult("qwen2.5-7b", 8192, "q4:full", False),
    GateResult("qwen2.5-7b", 2048, "q4:r=10", True),
]


def test_the_quality_gate_decides_which_actions_can_be_chosen():
    unchecked = planner.plan(QWEN7B, 8192)
    assert str(unchecked.best.action) == "q4:full"  # fastest, but the gate rejects it
    assert {c.quality for c in unchecked.candidates} == {"unchecked"}
    gated = planner.plan(QWEN7B, 8192, gate=QWEN7B_GATE, gate_file="gate.jsonl")
    eligible = [c for c in gated.candidates if c.quality == "eligible"]
    assert {str(c.action) for c in eligible} == {"q8:r=13"}
    assert gated.best == min(eligible, key=lambda c: c.predicted_ms)
    assert gated.best.predicted_ms > unchecked.best.predicted_ms
    standing = {str(c.action): c.quality for c in gated.candidates}
    assert standing["q4:full"] == standing["q4:r=13"] == "ineligible"
    assert standing["q4:r=10"] == standing["bf16:full"] == "unchecked"  # 2048 tokens: not 8K
    assert gated.to_json()["quality_file"] == "gate.jsonl"
    assert gated.to_json()["best"]["quality"] == "eligible"


def test_a_gate_result_of_a_chunked_cache_counts_for_that_chunking():
    gate = [GateResult("qwen2.5-7b", 8192, "q8:r=13", True),
            GateResult("qwen2.5-7b", 8192, "q8:r=13", False, chunks=4)]
    out = planner.plan(QWEN7B, 8192, actions=[Action(8, 15, 28)], gate=gate)
    standing = {(c.schedule, c.chunks): (c.quality, c.gated_chunks) for c in out.candidates}
    assert standing[("chunked", 4)] == ("ineligible", 4)
    assert standing[("chunked", 2)] == standing[("overlapped", 1)] == ("eligible", 1)
    assert (out.best.schedule, out.best.chunks) != ("chunked", 4)


def test_gate_results_must_cover_the_plan():
    with pytest.raises(ValueError, match="none for model 'tiny' at 256 tokens"):
        planner.plan(TINY, 256, gate=QWEN7B_GATE)
    with pytest.raises(ValueError, match="no eligible candidate"):
        planner.plan(QWEN7B, 8192, gate=QWEN7B_GATE[1:3])
    with pytest.raises(ValueError, match="not a quality gate result"):
        GateResult.from_json({"model": "tiny", "seq_len": 256})


def test_measured_profile_is_used_and_must_match():
    p = planner.analytic_profile(TINY, 256)
    measured = cm.Profile.from_json({**p.to_json(), "source": "measured", "hardware": "H200"})
    out = planner.plan(TINY, 256, measured)
    assert out.note is None and "note" not in out.to_json() and out.profile.hardware == "H200"
    with pytest.raises(ValueError, match="no profile for model 'tiny', seq_len 512"):
        planner.plan(TINY, 512, measured)
    with pytest.raises(ValueError, match="no profile"):
        planner.plan(ModelConfig.preset("qwen2.5-3b"), 256, measured)


def test_one_rule_picks_a_profile_for_the_planner_and_the_report():
    """`find_profile`: same model (layers too), length and batch; a paced link re-targets the
    first; unpaced, one fitted over an unpaced link wins; `bits` needs that quantizer timed."""
    base = planner.analytic_profile(TINY, 256, link_gbps=1.0)
    paced = cm.Profile.from_json({**base.to_json(), "link": "tcp paced 1 GB/s"})
    unpaced = cm.Profile.from_json({**base.to_json(), "link": "tcp unpaced", "hardware": "U"})
    no_q4 = dataclasses.replace(paced, **{f: {b: v for b, v in getattr(paced, f).items() if b != 4}
                                          for f in ("quantize_ms", "restore_ms", "kv_layer_bytes",
                                                    "restore_fixed_ms")})
    other = cm.Profile.from_json({**base.to_json(), "num_layers": 7})
    profiles = [other, paced, unpaced]
    assert planner.find_profile(profiles, "tiny", 6, 256) == unpaced
    assert planner.find_profile(profiles, "tiny", 6, 256, link_gbps=4.0) == paced.at_link(4.0)
    assert planner.find_profile(profiles, "tiny", 7, 256) == other
    assert planner.find_profile(profiles, "tiny", None, 256, link_gbps=2.0) == other.at_link(2.0)
    assert planner.find_profile([no_q4], "tiny", 6, 256, bits=8) == no_q4
    assert planner.find_profile([no_q4], "tiny", 6, 256, bits=4) is None
    assert planner.find_profile(profiles, "tiny", 6, 512) is None
    assert planner.find_profile(profiles, "tiny", 6, 256, batch=2) is None
    assert planner.select_profile(profiles, TINY, 256, link_gbps=3.0) == paced.at_link(3.0)
    with pytest.raises(ValueError, match="no profile for model 'tiny', seq_len 512"):
        planner.select_profile(profiles, TINY, 512)


def test_cli_plan_with_profile_file_and_link(tmp_path, capsys):
    p = planner.analytic_profile(TINY, 256, link_gbps=1.0)
    path = tmp_path / "gpu.jsonl"
    path.write_text(json.dumps({**p.to_json(), "source": "measured"}) + "\n")
    main(["plan", "--model", "tiny", "--seq-len", "256", "--profile", str(path),
          "--link-gbps", "4", "--bits", "16,8", "--schedule", "overlapped,chunked",
          "--chunks", "4", "--json"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["profile"]["link_gbps"] == 4.0 and out["profile"]["source"] == "measured"
    assert {c["bits"] for c in out["candidates"]} == {16, 8}
    assert {(c["schedule"], c["chunks"]) for c in out["candidates"]} == {
        ("overlapped", 1), ("chunked", 4), ("n/a", 1)}  # n/a: transfer-only, full recompute
    best = out["best"]
    expected = cm.predicted_ms(p.at_link(4.0), Mode.of_record(
        Action.parse(best["action"], 6), best["schedule"], "full", best["chunks"], "ready"))
    assert best["predicted_ms"] == pytest.approx(expected)


def test_cli_plan_reads_as_a_short_table(tmp_path, capsys):
    main(["plan", "--model", "qwen2.5-7b", "--seq-len", "8192", "--link-gbps", "2.32"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 40
    best = planner.plan(QWEN7B, 8192, link_gbps=2.32).best
    assert f"predicted best: {best.label} at {best.predicted_ms:.2f} ms (quality: unchecked)" \
        in lines
    assert any(line.startswith("quality: unchecked for every action") for line in lines)
    assert any(line.startswith("bf16:full ") for line in lines)  # the baseline is always shown
    gate = tmp_path / "gate.jsonl"
    gate.write_text("".join(json.dumps(dataclasses.asdict(g)) + "\n" for g in QWEN7B_GATE))
    main(["plan", "--model", "qwen2.5-7b", "--seq-len", "8192", "--link-gbps", "2.32",
          "--quality", str(gate)])
    lines = capsys.readouterr().out.splitlines()
    best = planner.plan(QWEN7B, 8192, link_gbps=2.32, gate=QWEN7B_GATE).best
    assert f"predicted best eligible: {best.label} at {best.predicted_ms:.2f} ms " \
        "(quality: eligible)" in lines
    assert any(line.startswith(f"quality: gate results from {gate}: of 85 actions 1 eligible, "
                               "2 ineligible, 82 unchecked") for line in lines)
    assert any(line.startswith(f"{best.action!s:<16}{best.schedule}") for line in lines)


def test_cli_plan_bad_input_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "tiny", "--seq-len", "256", "--actions", "q8:r=9"])
    err = capsys.readouterr().err  # names what the user typed (r=9), not the derived cut (-3)
    assert e.value.code == 2 and "suffix length r must be in 0..6" in err and "got 9" in err


def test_predicted_crossover_brackets_the_analytic_break_even_link():
    # BF16 transfer vs full recomputation (both send the token IDs): L B_KV / W = embed + L gamma.
    p = planner.analytic_profile(QWEN7B, 8192)
    L = QWEN7B.num_layers
    w_star = L * p.kv_layer_bytes[16] / (p.embed_ms + L * p.suffix_layer_ms) / 1e6  # GB/s
    links = list(np.geomspace(w_star / 10, w_star * 10, 101))
    by_link = planner.preferred_by_link(p, [Action(16, L, L), Action(16, 0, L)], links)
    assert by_link[0].best == "bf16:recompute" and by_link[-1].best == "bf16:full"
    (change,) = planner.crossovers(by_link)
    lo, hi = change.between_gbps
    assert (change.before, change.after) == ("bf16:recompute", "bf16:full")
    assert lo <= w_star <= hi


def test_a_prefix_format_is_chosen_only_where_the_gate_passes_it():
    """Gate results that fail paper Q4 and pass it debiased: the plan's action space gains the
    judged formats, the choice is the debiased Q4 (its label names the format), and where the
    paper's format passes too it wins the tie (a format's transforms are not in the profile)."""
    gate = [GateResult("qwen2.5-7b", 8192, "q4:full", False),
            GateResult("qwen2.5-7b", 8192, "q4:full/debias", True),
            GateResult("qwen2.5-7b", 8192, "q4:full/hadamard", False),
            GateResult("qwen2.5-7b", 8192, "q8:r=13", True)]
    out = planner.plan(QWEN7B, 8192, gate=gate, schedules=("overlapped",))
    formats = {c.action.format for c in out.candidates}
    assert formats == {"paper", "debias", "hadamard"}
    assert str(out.best.action) == "q4:full/debias" and out.best.quality == "eligible"
    assert "q4:full/debias" in planner.plan_text(out).splitlines()[1]
    assert out.to_json()["best"]["format"] == "debias"
    standing = {str(c.action): c.quality for c in out.candidates}
    assert standing["q4:full"] == standing["q4:full/hadamard"] == "ineligible"
    assert standing["q4:r=2/debias"] == "unchecked"
    both = [*gate, GateResult("qwen2.5-7b", 8192, "q4:full", True)][1:]
    assert str(planner.plan(QWEN7B, 8192, gate=both).best.action) == "q4:full"
    unchecked = planner.plan(QWEN7B, 8192)  # no gate: the paper's format only
    assert {c.action.format for c in unchecked.candidates} == {"paper"}


def test_a_per_channel_prefix_costs_its_padded_keys():
    p = planner.analytic_profile(TINY, 100)
    for bits in (8, 4):
        a, b = Action(bits, 3, 6), Action(bits, 3, 6, "per-channel")
        extra = cm.phase_ms(p, b).prefix - cm.phase_ms(p, a).prefix
        padded = sizes.prefix_bytes(TINY, 100, 3, bits, 1, "per-channel") - sizes.prefix_bytes(
            TINY, 100, 3, bits)
        assert padded > 0 and extra == pytest.approx(cm.transfer_ms(padded, p.link_gbps))
