"""scripts/bench_third_party.py reads both sides of a run right: AIPerf's per-request export (in
the form AIPerf 0.13 writes it, its warm-up left out) pairs with rekv's `--json` records in arrival
order after each run's warm-up requests, a pair whose token counts differ is flagged, and the
verdict compares the two sides' medians against the tolerance. (The run itself needs AIPerf and a
server: results/third_party_bench.md.)"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_third_party.py"
WARMUP, MEASURED = 2, 5


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_third_party", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export_line(i: int, phase: str, sent_s: float, ttft: float, itl: float, prompt: int,
                 new: int) -> str:
    ms = lambda v: {"value": v, "unit": "ms"}  # noqa: E731
    return json.dumps({
        "metadata": {"x_request_id": f"r{i}", "request_start_ns": int(sent_s * 1e9),
                     "benchmark_phase": phase},
        "metrics": {"time_to_first_token": ms(ttft), "inter_token_latency": ms(itl),
                    "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
                    "usage_completion_tokens": {"value": new, "unit": "tokens"},
                    "inter_chunk_latency": {"value": [itl] * (new - 1), "unit": "ms"}}})


def _run(rng, start_s: float, prompt: int, new: int, offset_s: float, first_id: int):
    """One API's run: AIPerf's export and rekv's records of the same requests (rekv's clock is
    the client's less `offset_s`); the client's TTFT is rekv's plus 3 ms."""
    sent = start_s + np.cumsum(rng.exponential(0.5, WARMUP + MEASURED))
    lines, records = [], []
    for k, t in enumerate(sent):
        ttft, itl = rng.uniform(50, 150), rng.uniform(5, 10)
        lines.append(_export_line(k, "warmup" if k < WARMUP else "profiling", t, ttft + 3, itl,
                                  prompt, new))
        records.append({"kind": "served_request", "id": first_id + k, "arrival_s": t - offset_s,
                        "prompt_len": prompt, "ttft_ms": ttft, "tpot_ms": itl,
                        "completed": True, "tokens": [7] * new})
    return "\n".join(lines) + "\n", records


def test_requests_pair_in_arrival_order_after_each_runs_warmup(bench, tmp_path):
    rng = np.random.default_rng(0)
    runs, rekv = [], []
    for n, (prompt, new) in enumerate([(128, 32), (140, 16)]):  # completions, then chat
        export, records = _run(rng, 1e9 + 100 * n, prompt, new, 1e9 - 5.0, 100 * n)
        (tmp_path / f"{n}.jsonl").write_text(export)
        runs.append(bench.client_records(tmp_path / f"{n}.jsonl"))
        rekv += records
    stdout = "rekv serve: the banner\n" + "".join(json.dumps(r) + "\n" for r in rekv[::-1])
    mine = bench.split(bench.rekv_records(stdout), runs, WARMUP)
    for n, (client, served) in enumerate(zip(runs, mine, strict=True)):
        pairs = bench.pair(client, served)
        assert [p["rekv"]["id"] for p in pairs] == list(range(100 * n + WARMUP,
                                                              100 * n + WARMUP + MEASURED))
        assert all(p["agree"] for p in pairs)
        verdict = bench.compare(pairs, 0.10)
        assert verdict["arrival_spread_ms"] < 1e-3
        assert verdict["ttft_ms"]["client_minus_rekv_p50"] == pytest.approx(3.0)
        assert verdict["itl_ms"]["ratio_p50"] == pytest.approx(1.0)
        assert verdict["short_of_text_chunks"] == 0
    served = [dict(r) for r in mine[0]]
    served[1]["tokens"] = served[1]["tokens"][:-1]  # one token fewer than the client's usage
    assert [p["agree"] for p in bench.pair(runs[0], served)] == [True, False, True, True, True]
    with pytest.raises(SystemExit, match="rekv recorded"):
        bench.split(bench.rekv_records(stdout)[1:], runs, WARMUP)


@pytest.mark.parametrize("scale, within", [(1.09, True), (0.92, True), (1.11, False),
                                           (0.85, False)])
def test_the_verdict_is_the_medians_ratio_against_the_tolerance(bench, scale, within):
    rekv = np.random.default_rng(1).uniform(20, 200, 41)
    got = bench.figures(list(rekv * scale), list(rekv), 0.10)
    assert got["rekv_p50"] == np.median(rekv)
    assert got["ratio_p50"] == pytest.approx(scale)
    assert got["within"] is within
