"""`scripts/bench_policy_choice.py`: each policy's choice timed on a link estimate that changes
between requests, a JSON row per policy and prompt length."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "results" / "serve" / "2026-12-04e" / "profiles.jsonl"


def test_each_policy_and_length_is_timed_over_its_modes():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_policy_choice.py"),
                          "--profile", str(PROFILES), "--policy", "bf16:full,adaptive",
                          "--prompt-lens", "256,300", "--reps", "2"],
                         capture_output=True, text=True, check=True, timeout=300)
    report = json.loads(out.stdout)
    rows = report["choices"]
    assert report["reps"] == 2 and report["model"] == "tiny-7b"
    assert [(r["policy"], r["prompt_len"]) for r in rows] == [
        ("bf16:full", 256), ("bf16:full", 300), ("adaptive", 256), ("adaptive", 300)]
    for r in rows:
        assert 0 < r["choice_ms_p50"] <= r["choice_ms_max"]
        assert (r["modes"] == 1) == (r["policy"] == "bf16:full")
