"""`scripts/serve_bounds.py`: the TTFT a policy could reach by sparing the link alone is a FIFO
queue of the measured prompt computes, and no measured TTFT of a one-prefill-worker run beats
it (a prompt cannot start before it arrives, nor before the one ahead of it is computed)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "results" / "serve" / "2026-12-04c" / "tiny-7b-1p1d.jsonl"
_spec = importlib.util.spec_from_file_location("serve_bounds",
                                               ROOT / "scripts" / "serve_bounds.py")
serve_bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_bounds)


def _record(arrival_s: float, compute_ms: float) -> dict:
    return {"arrival_s": arrival_s, "prefill_side": {"compute_ms": compute_ms}}


def test_the_link_free_ttft_is_a_fifo_queue_of_the_prompt_computes():
    # in arrival order: the second arrives while the first computes and waits 300 ms for it;
    # the third finds the device idle
    records = [_record(0.5, 500.0), _record(0.0, 800.0), _record(5.0, 100.0)]
    assert serve_bounds.link_free_ttft_ms(records) == pytest.approx([800.0, 800.0, 100.0])
    # a record without its prefill side's report: its phases carry the same compute
    records[0] = {"arrival_s": 0.5, "prefill_side": None, "phases_ms": {"prefill": 500.0}}
    assert serve_bounds.link_free_ttft_ms(records) == pytest.approx([800.0, 800.0, 100.0])


def test_covered_is_the_length_of_a_union():
    assert serve_bounds.covered([(3.0, 4.0), (0.0, 2.0), (1.0, 1.5), (1.5, 2.5)]) == 2.5 + 1.0
    assert serve_bounds.covered([]) == 0.0


def test_no_measured_ttft_beats_its_link_free_bound():
    by_rate: dict[float, list[dict]] = {}
    for line in RECORDS.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "served_request" and r["policy"] == "bf16:full":
            by_rate.setdefault(r["rate"], []).append(r)
    for records in by_rate.values():
        ordered = sorted(records, key=lambda r: r["arrival_s"])
        bound = serve_bounds.link_free_ttft_ms(ordered)
        assert all(r["ttft_ms"] >= b for r, b in zip(ordered, bound, strict=True))
    out = subprocess.run([sys.executable, ROOT / "scripts" / "serve_bounds.py", RECORDS,
                          "--link-gbps", "0.0041826"], capture_output=True, text=True,
                         check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["rate"] for row in rows] == sorted(by_rate)
    for row in rows:
        assert min(row["ratio_bound"].values()) >= 1.0
        assert 0 < row["decode_busy"] <= 1 and np.isfinite(list(row["utilization"].values())).all()
