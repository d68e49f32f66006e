"""`rekv doctor` on CPU: every verdict passes and the JSON has every check; bench_model is
information only; the quantizer-error estimate the doctor judges against is right and sharp."""

import json
import math

import numpy as np
import pytest

from rekv_jax.cli.main import main
from rekv_jax.serving.metrics import Served
from rekv_jax.serving.requests import Finished, ServeRequest
from rekv_jax.serving.scripted import Driven
from rekv_jax.study import doctor

CHECKS = {"pallas_kernels", "exact_suffix/qwen2", "exact_suffix/qwen3", "exact_suffix/llama",
          "bench_quant", "bench_model", "handoff"}
INFO = {"bench_model"}  # measurements, not verdicts


def test_doctor_passes_on_cpu(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    main(["doctor", "--json", "--out", str(out)])  # SystemExit(1) if any check fails
    printed = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert printed == written and written["kind"] == "doctor" and written["passed"]
    checks = {c["name"]: c for c in written["checks"]}
    assert set(checks) == CHECKS
    assert {n for n, c in checks.items() if c["passed"] is None} == INFO
    failed = [(n, c["detail"]) for n, c in checks.items() if c["passed"] is False]
    assert not failed
    quant = checks["bench_quant"]["data"]
    for k, expected in quant["rms_rel_err_expected"].items():
        assert abs(quant["rms_rel_err_gaussian"][k] / expected - 1) <= doctor.RMS_ERR_BAND
    model = checks["bench_model"]["data"]
    assert all(math.isfinite(x) and x > 0 for x in (model["run_suffix"]["tflops"],
                                                     model["decode_step"]["ms"]))
    assert checks["handoff"]["data"]["summaries"][0]["first_token_match"]


@pytest.mark.parametrize("bits", [8, 4])
def test_gaussian_error_estimate_matches_a_simulation(bits):
    """The first-principles estimate against a float64 simulation of the contract (round half
    away from zero, float16 scales); truncating instead of rounding falls outside the band."""
    x = np.random.default_rng(0).standard_normal((50_000, 64))
    qmax = {8: 127, 4: 7}[bits]
    s = (np.abs(x).max(axis=1, keepdims=True) / qmax).astype(np.float16).astype(np.float64)

    def rms(codes):
        return math.sqrt(np.sum((x - codes * s) ** 2) / np.sum(x**2))

    expected = doctor.gaussian_rms_rel_err(bits)
    rounded = np.sign(x) * np.minimum(np.floor(np.abs(x) / s + 0.5), qmax)
    assert rms(rounded) == pytest.approx(expected, rel=0.01)
    truncated = np.sign(x) * np.minimum(np.floor(np.abs(x) / s), qmax)
    assert rms(truncated) / expected - 1 > doctor.RMS_ERR_BAND


def served(tokens, checks="bitwise", error=None, request_id=0):
    finished = Finished(request_id, tuple(tokens), 0.1, 0.01, 5.0, None, checks, False, error)
    return Served(ServeRequest(request_id, [0], 3), "asked", 0.0, (), finished=finished)


def refused(request_id=0):
    """Ended by the router before a decode worker had it."""
    return Served(ServeRequest(request_id, [0], 3), "asked", 0.0, (), error="needs 31 pages")


def test_engine_verdict_judges_failures_cache_checks_first_tokens_and_pages():
    """The engine check (run on a GPU only) fails on a failed request, a failed cache check, a
    first token unlike the single process's or pages left over; later tokens that differ (the
    Pallas paged attention's own bits) are reported, not judged."""
    asks = doctor.engine_asks(64, 512)[:3]
    want = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    good = [served(w, c) for w, c in zip(want, ("bitwise", "suffix bitwise, prefix within the "
                                                "q8 error bound", "bitwise vs prefill(chunks=2)"),
                                         strict=True)]
    found = doctor.engine_verdict(asks, Driven(good, [], 0), want)
    assert found.passed and "3 of 3 decode as the single process" in found.detail
    later = [served((1, 2, 0)), *good[1:]]
    found = doctor.engine_verdict(asks, Driven(later, [], 0), want)
    assert found.passed and "2 of 3" in found.detail
    for bad, words in (([served((), error="TransportError: lost"), *good[1:]], "lost"),
                       ([served((1, 2, 3), "MISMATCH in prefix"), *good[1:]], "cache check"),
                       ([served((0, 2, 3)), *good[1:]], "first token differs"),
                       ([refused(), *good[1:]], "needs 31 pages")):
        found = doctor.engine_verdict(asks, Driven(bad, [], 0), want)
        assert not found.passed and words in found.detail
    assert not doctor.engine_verdict(asks, Driven(good, [], 1), want).passed
    assert json.loads(json.dumps(found.data.to_json()))["want"] == [list(w) for w in want]


@pytest.mark.parametrize("gpus, want", [([], {"handoff"}), (["0"], {"handoff", "engine"})])
def test_the_engine_check_runs_when_a_gpu_is_present(monkeypatch, gpus, want):
    monkeypatch.setattr(doctor, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(doctor, "run_child", lambda *a, **k: [])
    for name in ("check_handoff", "check_engine"):
        monkeypatch.setattr(doctor, name, lambda seq_len, name=name: doctor.Finding(True, name))
    assert {c.name for c in doctor.run_checks()} == want
