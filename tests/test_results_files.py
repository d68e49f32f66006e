"""Every committed results/**/*.jsonl line still reads through the typed records, and writing it
back gives the same JSON (keys in the same order), so the line format stays as committed."""

import json
from pathlib import Path

import pytest

from rekv_jax.planning.costmodel import Profile
from rekv_jax.serving.metrics import TTFT_QUANTILES
from rekv_jax.study.records import Rep, Summary

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "results").rglob("*.jsonl"))


def _same(line: dict, written: dict) -> None:
    """`written` says what `line` says, in its key order; fields added since (with their
    defaults) may follow."""
    assert json.dumps({k: written[k] for k in line}) == json.dumps(line)


def _serve_record(d: dict) -> None:
    """A serving run's record holds what its kind promises (`serving.metrics` writes them)."""
    keys = {"served_request": {"id", "policy", "rate", "prompt_len", "arrival_s", "ttft_ms",
                               "completed", "assignment", "token_times_s", "error"},
            "serve_summary": {"policy", "rate", "requests", "completed", "ttft_ms", "tpot_ms",
                              "goodput_rps", "handoff_error", "choices"},
            "serve_capacity": {"policy", "rate", "share", "slo"}}[d["kind"]]
    assert keys <= set(d), sorted(keys - set(d))
    if d["kind"] == "serve_summary":
        assert set(d["ttft_ms"]) == {f"p{round(q * 100)}" for q in TTFT_QUANTILES}
    if d["kind"] == "served_request" and d["completed"]:  # all its tokens, or up to its stop
        assert len(d["tokens"]) == len(d["token_times_s"]) <= d["max_new_tokens"]
        assert d.get("finish_reason", "length") == "stop" or len(d["tokens"]) == d["max_new_tokens"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_results_round_trip(path):
    lines = [json.loads(t) for t in path.read_text().splitlines() if t.strip()]
    layers = {d["action"]: d["num_layers"] for d in lines if d.get("kind") == "summary"}
    read = 0
    for d in lines:
        if d.get("kind") == "summary":
            _same(d, Summary.from_json(d).to_json())
        elif d.get("kind") == "rep":
            _same(d, Rep.from_json(d, layers[d["action"]]).to_json())
        elif d.get("kind") == "profile":
            _same(d, Profile.from_json(d).to_json())
        elif d.get("kind", "").startswith("serve"):  # rekv serve --json
            _serve_record(d)
        else:  # quality gate rows (rekv quality --json): read by the gate's own records
            continue
        read += 1
    assert FILES and (read or "quality" in path.parts)
