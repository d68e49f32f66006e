"""Planner: every action predicted, the best is the argmin, Prop. 2 agrees, links shift plans."""

import json

import numpy as np
import pytest

from rekv_jax import costmodel as cm
from rekv_jax import planner
from rekv_jax.action import Action, action_space
from rekv_jax.cli import main
from rekv_jax.config import ModelConfig

QWEN7B = ModelConfig.preset("qwen2.5-7b")
TINY = ModelConfig.preset("tiny")


def test_analytic_plan_is_labelled_and_consistent():
    out = planner.plan(QWEN7B, 8192)
    assert "analytic" in out["note"] and out["profile"]["source"] == "analytic"
    L = QWEN7B.num_layers
    # the transfer terms use the profile's link: full BF16 sends L layers of 2 S K H bf16 bytes
    # (16 MiB per layer, as the paper's §2.2 states for Qwen2.5-7B at 8K)
    layer_bytes = 2 * 8192 * QWEN7B.num_kv_heads * QWEN7B.head_dim * 2
    assert layer_bytes == 16 * 2**20
    full = next(c for c in out["candidates"] if c["action"] == str(Action(16, L, L)))
    assert full["phases_ms"]["prefix"] == pytest.approx(
        L * layer_bytes / (out["profile"]["link_gbps"] * 1e6))
    assert [c["action"] for c in out["candidates"]] == [str(a) for a in action_space(L)]
    best = min(out["candidates"], key=lambda c: c["predicted_ms"])
    assert out["best"]["action"] == best["action"]
    for c in out["candidates"]:
        assert c["predicted_ms"] == c["t_ov_ms"] <= c["t_seq_ms"]
    for prec, bc in out["balanced_cut"].items():  # Prop. 2 finds the best interior cut
        interior = [c for c in out["candidates"]
                    if c["action"].startswith(prec) and 0 < c["cut"] < L]
        fastest = min(c["predicted_ms"] for c in interior)
        assert min(c["predicted_ms"] for c in interior if c["cut"] in bc["cuts"]) == fastest
        assert bc["suffix_lens"] == [L - c for c in bc["cuts"]]


def test_analytic_bf16_transfer_is_the_papers_link_time():
    # §4.4: 448 MiB in 202.13 ms on the H100 TCP path defines the default link.
    bf16 = planner.plan(QWEN7B, 8192, actions=[Action(16, 28, 28)])["candidates"][0]
    assert bf16["phases_ms"]["prefix"] == pytest.approx(202.13)
    assert bf16["payload_bytes"] == 448 * 2**20


def test_faster_link_moves_the_cut_toward_transfer():
    profile = planner.analytic_profile(QWEN7B, 8192)
    for bits in (16, 8, 4):
        stars = [profile.at_link(w).balanced_cut(bits)[0] for w in (0.5, 2, 8, 32)]
        assert stars == sorted(stars) and stars[0] < stars[-1]
    slow = planner.plan(QWEN7B, 8192, profile, link_gbps=0.01)["best"]
    fast = planner.plan(QWEN7B, 8192, profile, link_gbps=1000)["best"]
    assert slow["kind"] == "recompute" and fast["kind"] == "transfer"


def test_sequential_schedule_and_restricted_actions():
    acts = [Action(8, c, TINY.num_layers) for c in (2, 4)]
    out = planner.plan(TINY, 256, actions=acts, schedule="sequential")
    assert [c["action"] for c in out["candidates"]] == ["q8:r=4", "q8:r=2"]
    assert all(c["predicted_ms"] == c["t_seq_ms"] for c in out["candidates"])


def test_measured_profile_is_used_and_must_match():
    p = planner.analytic_profile(TINY, 256)
    measured = cm.Profile.from_json({**p.to_json(), "source": "measured", "hardware": "H200"})
    out = planner.plan(TINY, 256, measured)
    assert "note" not in out and out["profile"]["hardware"] == "H200"
    with pytest.raises(ValueError, match="no profile for model 'tiny', seq_len 512"):
        planner.plan(TINY, 512, measured)
    with pytest.raises(ValueError, match="no profile"):
        planner.plan(ModelConfig.preset("qwen2.5-3b"), 256, measured)


def test_cli_plan_with_profile_file_and_link(tmp_path, capsys):
    p = planner.analytic_profile(TINY, 256, link_gbps=1.0)
    path = tmp_path / "gpu.jsonl"
    path.write_text(json.dumps({**p.to_json(), "source": "measured"}) + "\n")
    main(["plan", "--model", "tiny", "--seq-len", "256", "--profile", str(path),
          "--link-gbps", "4", "--bits", "16,8", "--json"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["profile"]["link_gbps"] == 4.0 and out["profile"]["source"] == "measured"
    assert {c["bits"] for c in out["candidates"]} == {16, 8}
    expected = cm.predicted_ms(p.at_link(4.0), Action.parse(out["best"]["action"], 6))
    assert out["best"]["predicted_ms"] == pytest.approx(expected)


def test_cli_plan_reads_as_a_short_table(capsys):
    main(["plan", "--model", "qwen2.5-7b", "--seq-len", "8192", "--link-gbps", "2.32"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 40
    best = planner.plan(QWEN7B, 8192, link_gbps=2.32)["best"]
    assert f"predicted best: {best['action']} at {best['predicted_ms']:.2f} ms" in lines
    assert any(line.startswith("bf16:full ") for line in lines)  # the baseline is always shown


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
    assert by_link[0]["best"] == "bf16:recompute" and by_link[-1]["best"] == "bf16:full"
    (change,) = planner.crossovers(by_link)
    lo, hi = change["between_gbps"]
    assert (change["from"], change["to"]) == ("bf16:recompute", "bf16:full")
    assert lo <= w_star <= hi
