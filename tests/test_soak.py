"""The short soak: 100 handoffs with faults through one pair of processes hold (scripts/soak.py)."""

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).parents[1] / "scripts" / "soak.py"


def test_short_soak_holds():
    out = subprocess.run([sys.executable, str(SOAK), "--handoffs", "100", "--fault-rate", "0.15",
                          "--seed", "1", "--json", "--timeout", "1200"],
                         capture_output=True, text=True, timeout=1500)
    report = json.loads(out.stdout.splitlines()[-1])
    assert out.returncode == 0 and report["passed"], report
    assert report["wrong"] == report["hangs"] == report["unexpected"] == 0
    assert report["ok"] + report["recovered"] + report["failed_clean"] == 100
    # faults of every kind were injected, each planned one exactly once by its side's hook
    assert report["recovered"] > 0 and report["failed_clean"] > 0
    assert all(n > 0 for n in report["injected"].values()), report["injected"]
    assert report["injected"] == report["faults"]
