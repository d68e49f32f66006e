"""Quality gate: metrics on hand-built cases with known answers, and on the shipped model."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rekv_jax.action import Action
from rekv_jax.cli.main import main
from rekv_jax.gate_result import GateMetrics, GateResult, load_gate
from rekv_jax.kv import KVCache
from rekv_jax.model.loader import SHIPPED_MODEL, load_model
from rekv_jax.model.params import load_hf, restore_params
from rekv_jax.model.transformer import forward, prefill
from rekv_jax.phases import Phases
from rekv_jax.quality import data
from rekv_jax.quality import gate as quality
from rekv_jax.study import selection
from rekv_jax.study.records import Summary


def outputs(probs: list[list[float]], niah_ok: list[bool]) -> quality.Outputs:
    """Outputs of one window whose positions have the given next-token distributions."""
    return quality.Outputs(np.log(np.array([probs], np.float32)), np.array(niah_ok))


def test_identical_outputs_give_zero_kl_full_agreement_ratio_one():
    ref = outputs([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], [True, True])
    m = quality.compare(ref, ref, np.array([[0, 2]]))
    assert m.kl == 0.0 and m.top1_agree == 1.0
    assert m.top1_flips == 0 and m.top1_flip_margin is None
    assert m.ppl == m.ppl_bf16 and m.ppl_rel_change == 0.0
    assert m.ppl_bf16 == pytest.approx(math.exp(-(math.log(0.6) + math.log(0.3)) / 2), 1e-6)
    assert (m.niah_pass, m.niah_total, quality.eligible(m)) == (2, 2, True)


def test_known_kl_agreement_and_perplexity():
    p, q = [[0.7, 0.3], [0.5, 0.5]], [[0.4, 0.6], [0.5, 0.5]]  # top-1 flips at position 0 only
    m = quality.compare(outputs(p, [True]), outputs(q, [True]), np.array([[0, 1]]))
    kl0 = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    assert m.kl == pytest.approx(kl0 / 2, rel=1e-5)
    assert (m.top1_agree, m.top1_flips) == (0.5, 1)
    assert m.top1_flip_margin == pytest.approx(math.log(0.7 / 0.3), rel=1e-5)
    assert m.ppl == pytest.approx(math.exp(-(math.log(0.4) + math.log(0.5)) / 2), rel=1e-6)
    assert m.ppl_rel_change == pytest.approx(math.sqrt(0.7 / 0.4) - 1, rel=1e-5)
    assert not quality.eligible(m)


def test_gate_rule_edges():
    ok = GateMetrics(top1_agree=1.0, top1_flips=0, top1_flip_margin=None, kl=0.0, ppl_bf16=1.0,
                     ppl=1.01, ppl_rel_change=0.01, niah_pass=4, niah_total=4, niah_pass_bf16=4)
    assert quality.eligible(ok)
    assert not quality.eligible(dataclasses.replace(ok, ppl_rel_change=0.0101))
    assert not quality.eligible(dataclasses.replace(ok, niah_pass=3))
    assert not quality.eligible(dataclasses.replace(ok, top1_agree=0.999))
    assert quality.eligible(dataclasses.replace(ok, ppl_rel_change=-0.5))  # lower never rejects


def test_committed_gate_results_read_and_write_back_the_same_lines():
    """Every committed `rekv quality --json` file reads as GateResults; a line with every metric
    writes back as the same JSON, key order included."""
    files = sorted((pathlib.Path(__file__).parents[1] / "results" / "quality").glob("*.jsonl"))
    assert files
    for path in files:
        for line, result in zip(path.read_text().splitlines(), load_gate(path), strict=True):
            if result.metrics is not None:
                assert json.dumps(result.to_json()) == line
    chunked = GateResult("m", 512, "q8:r=2", False, chunks=4, pipelined=True,
                         metrics=GateMetrics(0.5, 1, 0.1, 0.2, 3.0, 3.1, 0.03, 1, 2, 2))
    assert GateResult.from_json(chunked.to_json()) == chunked


def timing(action: str, ms: float, schedule: str = "n/a", batch: int = 1) -> Summary:
    """A measured summary of a 6-layer model "m" at 512 tokens whose reps all took `ms`."""
    return Summary(model="m", seq_len=512, batch=batch, action=Action.parse(action, 6),
                   transport="local", schedule=schedule, link_gbps=None, hardware="test",
                   reps_ms=(ms,) * 3, phases_ms=Phases(0.0, 0.0, 0.0, 0.0, 0.0), payload_bytes=0)


def test_select_picks_fastest_eligible_action():
    rows = [GateResult("m", 512, a, e)
            for a, e in [("q4:full", False), ("q8:full", True), ("q8:r=2", True)]]
    timings = [timing(a, t) for a, t in [("q4:full", 1.0), ("q8:full", 3.0), ("q8:r=2", 2.0),
                                         ("bf16:full", 0.5)]]
    [choice] = selection.select(rows, timings)
    assert (choice.chosen, choice.median_ms) == ("q8:r=2", 2.0)
    assert choice.eligible == ("q8:full", "q8:r=2") and choice.untimed_eligible == ()
    # a second setup (another link) is chosen on its own, not mixed with the first
    fast = [dataclasses.replace(timing("q8:full", 0.1), link_gbps=9.0)]
    first, second = selection.select(rows, timings + fast)
    assert first == choice and (second.chosen, second.median_ms) == ("q8:full", 0.1)
    assert second.untimed_eligible == ("q8:r=2",) and second.setup.link_gbps == 9.0
    [untimed] = selection.select(rows, [])
    assert untimed.chosen is None and untimed.untimed_eligible == ("q8:full", "q8:r=2")


def test_select_picks_a_prefix_format_only_where_the_gate_passes_it():
    rows = [GateResult("m", 512, a, e) for a, e in [("q4:full", False), ("q4:full/debias", True),
                                                    ("q4:full/hadamard", False)]]
    timings = [timing(a, t) for a, t in [("q4:full", 1.0), ("q4:full/hadamard", 1.1),
                                         ("q4:full/debias", 1.2)]]
    [choice] = selection.select(rows, timings)
    assert (choice.chosen, choice.eligible) == ("q4:full/debias", ("q4:full/debias",))
    # a record's action text keeps its format through the summary's JSON
    assert Summary.from_json(timings[2].to_json()).action == Action(4, 6, 6, "debias")


def test_select_cli_joins_quality_with_sweep_summaries(tmp_path, capsys):
    quality_rows = [{"model": "m", "seq_len": 512, "action": a, "eligible": True}
                    for a in ("q8:full", "q8:r=2")]
    sweep = [timing(a, t, sch, b).to_json()
             for a, b, sch, t in [("q8:full", 1, "n/a", 3.0), ("q8:r=2", 1, "sequential", 4.0),
                                  ("q8:r=2", 1, "overlapped", 2.5), ("q8:full", 4, "n/a", 1.0)]]
    sweep.append({"kind": "rep", "model": "m", "seq_len": 512, "action": "q8:full"})
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in quality_rows))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sweep))
    main(["select", "--quality", str(tmp_path / "q.jsonl"), "--timings", str(tmp_path / "t.jsonl"),
          "--json"])
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["chosen"] == "q8:r=2" and json.loads(line)["median_ms"] == 2.5
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit):
        main(["select", "--quality", str(tmp_path / "bad.jsonl")])
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err


@pytest.fixture(scope="module")
def shipped():
    model = load_model(str(SHIPPED_MODEL))
    return model.cfg, model.params, model.tokenizer


def test_shipped_model_loads_from_both_formats_with_equal_logits(shipped):
    """The shipped orbax checkpoint is in the older stacked-layer layout (leaves [L, ...]):
    `restore_params` unstacks it into the per-layer list, equal to the safetensors' weights."""
    cfg, params, tok = shipped
    hf_cfg, hf_params = load_hf(SHIPPED_MODEL)
    assert hf_cfg.to_hf() == cfg.to_hf()
    jax.tree.map(np.testing.assert_array_equal, params, hf_params)
    tokens = jnp.asarray(data.encode(tok, " The lobster is a species of crustacean .")[None])
    assert np.array_equal(np.asarray(forward(cfg, params, tokens)),
                          np.asarray(forward(hf_cfg, hf_params, tokens)))
    orbax_cfg, _ = restore_params(SHIPPED_MODEL / "orbax")
    assert orbax_cfg == cfg and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


def test_reconstruct_cache_rejects_action_of_another_model(shipped):
    cfg, params, _ = shipped
    with pytest.raises(ValueError, match="layers"):
        quality.reconstruct_cache(cfg, params, jnp.zeros((1, 8), jnp.int32),
                                  Action(8, 2, cfg.num_layers + 1))


@pytest.fixture(scope="module")
def small_eval(shipped):
    _, _, tok = shipped
    test_ids = data.encode(tok, data.read_split("test"))
    return quality.eval_set(tok, test_ids, 512, cont_len=16, num_windows=2, depths=(0.25, 0.75))


def test_bf16_joint_action_is_exact_and_passes(shipped, small_eval):
    cfg, params, _ = shipped
    [m] = quality.evaluate(cfg, params, small_eval, [Action(16, 2, cfg.num_layers)])
    assert m.metrics.niah_pass_bf16 == m.metrics.niah_total == 2  # retrieves at 512
    assert (m.metrics.kl, m.metrics.top1_agree, m.metrics.ppl_rel_change) == (0.0, 1.0, 0.0)
    assert m.eligible


# Mean KL(BF16 || a) on `small_eval` (512 tokens, 2 windows x 16 continuation positions) is
# 1.25e-5 for q8:r=2 (1.2e-5 at 8 windows: docs/quality.md) and 1.05e-4 for q4:r=2.
Q8_KL_BOUND = 5e-5


def test_q8_joint_action_keeps_kl_small_and_below_q4(shipped, small_eval):
    """End to end on the shipped model: q8:r=2 stays within a small KL of BF16, and Q4 at the
    same cut departs further (coarser codes, larger error)."""
    cfg, params, _ = shipped
    q8, q4 = quality.evaluate(cfg, params, small_eval,
                              [Action(8, 2, cfg.num_layers), Action(4, 2, cfg.num_layers)])
    assert 0 < q8.metrics.kl < Q8_KL_BOUND and q8.metrics.top1_agree == 1.0
    assert q4.metrics.kl > q8.metrics.kl


def test_corrupted_prefix_is_rejected(shipped, small_eval):
    cfg, params, _ = shipped

    def corrupted(tokens):  # a q8:r=2 handoff whose prefix keys arrive scrambled
        kv, logits = quality.reconstruct_cache(cfg, params, tokens, Action(8, 2, cfg.num_layers))
        k = kv.k.at[:2].set(jax.random.permutation(jax.random.key(0), kv.k[:2], axis=2))
        return KVCache.stacked(k, kv.v), logits

    ref = quality.run_outputs(cfg, params, lambda t: prefill(cfg, params, t), small_eval)
    bad = quality.run_outputs(cfg, params, corrupted, small_eval)
    m = quality.compare(ref, bad, small_eval.continuation)
    assert m.kl > 1e-2 and m.top1_agree < 1.0
    assert not quality.eligible(m)


def test_quality_cli_prints_every_field(capsys):
    main(["quality", "--actions", "q8:r=2", "--seq-len", "256", "--cont-len", "8",
          "--windows", "1", "--json"])
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"action", "top1_agree", "kl", "ppl_bf16", "ppl", "ppl_rel_change", "niah_pass",
            "niah_total", "eligible"} <= row.keys()
    assert row["action"] == "q8:r=2" and row["niah_total"] == len(quality.NIAH_DEPTHS)
