"""`rekv doctor` on CPU: every check runs on small shapes and passes; the JSON has every check."""

import json

from rekv_jax.cli import main

CHECKS = {"pallas_kernels", "exact_suffix/qwen2", "exact_suffix/qwen3", "exact_suffix/llama",
          "bench_quant", "bench_model", "handoff"}


def test_doctor_passes_on_cpu(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    main(["doctor", "--json", "--out", str(out)])  # SystemExit(1) if any check fails
    printed = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert printed == written and written["kind"] == "doctor" and written["passed"]
    assert {c["name"] for c in written["checks"]} == CHECKS
    failed = [(c["name"], c["detail"]) for c in written["checks"] if not c["passed"]]
    assert not failed
    handoff = next(c for c in written["checks"] if c["name"] == "handoff")
    assert handoff["data"]["summaries"][0]["first_token_match"]
