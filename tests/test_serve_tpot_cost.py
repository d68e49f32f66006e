"""`scripts/serve_tpot_cost.py`: a request's suffix counts against the TPOT of each other request
whose decode its compute overlapped, in proportion, and the line through (beside, TPOT) recovers
a known cost."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("serve_tpot_cost",
                                               ROOT / "scripts" / "serve_tpot_cost.py")
serve_tpot_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_tpot_cost)


def _record(i: int, first_s: float, suffix_ms: float, tpot_ms: float, stretch: float = 1.0):
    times = [first_s + k * tpot_ms / 1e3 for k in range(32)]
    return {"kind": "served_request", "policy": "adaptive", "rate": 1.0, "id": i,
            "completed": True, "token_times_s": times, "tpot_ms": tpot_ms,
            "assignment": {"why": {"predicted": {"decode_busy_ms": suffix_ms,
                                                 "stretch": stretch}}}}


def _records() -> list[dict]:
    # B's suffix (100 ms priced, stretched 2x: 1.0-1.2 s) half inside A's decode (from 1.1 s);
    # C decodes long after; A pays 2 ms of TPOT per priced ms beside it per token
    beside = 50.0 / 31
    return [_record(0, 1.1, 0.0, 30 + 2 * beside), _record(1, 1.2, 100.0, 30.0, 2.0),
            _record(2, 9.0, 0.0, 30.0)]


def test_a_suffix_counts_in_proportion_to_its_overlap_with_each_other_decode():
    assert serve_tpot_cost.beside_ms(_records()) == pytest.approx([50.0 / 31, 0.0, 0.0])


def test_the_line_through_the_records_recovers_the_cost(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_tpot_cost.py"),
                          str(path)], capture_output=True, text=True, check=True).stdout
    (line,) = [json.loads(t) for t in out.splitlines()]
    assert line["requests"] == 3 and line["slope"] == 2.0 and line["intercept_ms"] == 30.0
    assert line["alone"] == {"requests": 2, "tpot_p50_ms": 30.0, "tpot_p90_ms": 30.0}  # B, C
