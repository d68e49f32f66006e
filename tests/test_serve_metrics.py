"""A serving run's metrics: per-request latencies, summaries with CIs, goodput, capacity, the
table and the figures, on synthetic records."""

import dataclasses
import json

import numpy as np
import pytest

from rekv_jax.action import Action
from rekv_jax.phases import Phases
from rekv_jax.planning.queueing import Queues, ServedPrediction
from rekv_jax.serving import metrics
from rekv_jax.serving.lifecycle import Status, Transition
from rekv_jax.serving.metrics import Served, Slo
from rekv_jax.serving.policy import served_mode
from rekv_jax.serving.requests import Assignment, Finished, ServeRequest, Why

SLO = Slo(ttft_ms=300.0, tpot_ms=20.0)


def _served(i: int, policy: str, rate: float, ttft_s: float, tpot_s: float, n: int = 4,
            predicted_ms: float = 100.0, tokens: int | None = None) -> Served:
    req = ServeRequest(i, (1, 2, 3), n, arrival_s=i / rate)
    times = tuple(req.arrival_s + ttft_s + k * tpot_s for k in range(n if tokens is None
                                                                      else tokens))
    pred = ServedPrediction(predicted_ms, 0, predicted_ms, predicted_ms, 0, 0, 1, 1, 0,
                            Queues(), 0)
    mode = served_mode(Action.parse("q8:full", 4))
    a = Assignment(i, mode, 0, 0, Why(policy, pred, 1.0, "unchecked"))
    f = Finished(i, tuple(range(len(times))), ttft_s, tpot_s, 2 * predicted_ms,
                 Phases(1, 2, 3, 4, 5), "bitwise", False)
    return Served(req, policy, rate, times, a, f)


def test_a_requests_stages_are_predicted_and_measured_from_its_assignment():
    """Each stage's end, in ms after the (last) assignment: the prediction's parts, and when
    the lifecycle entered the stage's status (a requeued request: its last attempt)."""
    s = _served(0, "p", 1.0, 0.25, 0.01)
    pred = dataclasses.replace(s.assignment.why.predicted, prefill_wait_ms=30.0,
                               prefill_busy_ms=40.0, ttft_ms=180.0,
                               after=Queues(link_free_ms=120.0))
    a = dataclasses.replace(s.assignment, why=dataclasses.replace(s.assignment.why,
                                                                  predicted=pred))
    life = [Transition(st, t) for st, t in ((Status.WAITING, 0.0), (Status.PREFILLING, 0.01),
                                            (Status.REQUEUING, 0.05), (Status.WAITING, 0.06),
                                            (Status.PREFILLING, 0.1), (Status.PREFILLED, 0.18),
                                            (Status.DECODING, 0.25), (Status.LENGTH, 0.3))]
    s = dataclasses.replace(s, assignment=a, lifecycle=tuple(life))
    got = {st.name: (st.predicted_ms, st.measured_ms) for st in s.stages()}
    assert got["prefill"] == (70.0, pytest.approx(80.0))
    assert got["link"] == (120.0, None)  # its PrefillDone never came
    assert got["first_token"] == (180.0, pytest.approx(150.0))
    assert json.loads(json.dumps(s.to_json()))["stages"][0]["name"] == "prefill"
    assert dataclasses.replace(s, assignment=None).stages() == ()


def test_a_requests_latencies():
    s = _served(0, "p", 1.0, 0.25, 0.01, n=5)
    assert s.ttft_ms == pytest.approx(250) and s.tpot_ms == pytest.approx(10)
    assert s.e2e_ms == pytest.approx(290) and s.completed and s.meets(SLO)
    assert not _served(0, "p", 1.0, 0.35, 0.01).meets(SLO)  # TTFT too long
    assert not _served(0, "p", 1.0, 0.25, 0.03).meets(SLO)  # TPOT too long
    short = _served(0, "p", 1.0, 0.1, 0.01, n=4, tokens=2)
    assert not short.completed and not short.meets(SLO)
    one = _served(0, "p", 1.0, 0.1, 0.0, n=1)
    assert one.tpot_ms is None and one.meets(SLO)
    record = json.loads(json.dumps(s.to_json(SLO)))
    assert record["meets_slo"] and record["assignment"]["action"] == "q8:full"
    assert record["phases_ms"]["suffix"] == 4 and record["tokens"] == [0, 1, 2, 3, 4]
    assert record["finish_reason"] == "length" and record["sampling"]["temperature"] == 0


def test_a_request_that_stopped_early_completed():
    """A request its stop ended after 2 of 4 tokens completed (all its tokens arrived); one
    whose 2 tokens say "length" did not, nor did an aborted one."""
    short = _served(0, "p", 1.0, 0.1, 0.01, n=4, tokens=2)
    stopped = dataclasses.replace(short, finished=dataclasses.replace(
        short.finished, finish_reason="stop", stop="\n"))
    assert stopped.completed and not short.completed
    assert not dataclasses.replace(stopped, finished=dataclasses.replace(
        stopped.finished, finish_reason="abort")).completed
    record = json.loads(json.dumps(stopped.to_json()))
    assert (record["finish_reason"], record["stop"]) == ("stop", "\n")


def test_a_summary_of_known_latencies():
    rng = np.random.default_rng(0)
    ttft = rng.uniform(0.1, 0.5, 200)
    runs = [_served(i, "p", 2.0, t, 0.01) for i, t in enumerate(ttft)]
    s = metrics.summarize(runs, SLO)
    p50, p90, p99 = s.ttft_ms
    assert p50.value == pytest.approx(np.quantile(ttft * 1e3, 0.5))
    assert p90.value == pytest.approx(np.quantile(ttft * 1e3, 0.9))
    assert p50.ci[0] <= p50.value <= p50.ci[1] and p99.ci[0] <= p99.value <= p99.ci[1]
    met = int(np.sum(ttft <= 0.3))
    span = max(r.token_times_s[-1] for r in runs)
    assert s.slo_share == met / 200 and s.goodput_rps == pytest.approx(met / span)
    assert s.tokens_per_s == pytest.approx(800 / span) and s.tpot_ms == pytest.approx((10, 10))
    assert s.handoff_error == pytest.approx(0.5)  # predicted 100, measured 200
    assert s.choices == (("q8:full n/a", 200),)
    assert json.loads(json.dumps(s.to_json()))["ttft_ms"]["p90"]["value"] == p90.value
    with pytest.raises(ValueError, match="one policy at one rate"):
        metrics.summarize(runs + [_served(0, "q", 2.0, 0.1, 0.01)], SLO)


# TTFT (s) per policy and rate: "slow" meets the SLO at 1 and 4 req/s but not at 2
TTFT_S = {"fast": {1.0: 0.1, 2.0: 0.2, 4.0: 0.4}, "slow": {1.0: 0.2, 2.0: 0.4, 4.0: 0.25}}


def _sweep() -> tuple[list, list]:
    served, summaries = [], []
    for rate in (1.0, 2.0, 4.0):
        for policy, ttft in TTFT_S.items():
            runs = [_served(i, policy, rate, ttft[rate] * (1 + i % 5 / 100), 0.005)
                    for i in range(30)]
            served += runs
            summaries.append(metrics.summarize(runs, SLO))
    return served, summaries


def test_capacity_is_the_highest_rate_below_which_every_rate_meets_the_slo():
    _, summaries = _sweep()
    shares = {(s.policy, s.rate): s.slo_share for s in summaries}
    assert shares == {(p, r): float(t * 1.04 <= 0.3) for p, ts in TTFT_S.items()
                      for r, t in ts.items()}
    caps = metrics.capacities(summaries)
    assert {c.policy: c.rate for c in caps} == {"fast": 2.0, "slow": 1.0}
    lines = metrics.capacity_lines(caps)
    assert lines[0].startswith("fast: 90% within the SLO") and "up to 2 req/s" in lines[0]


def test_the_table_and_the_figures(tmp_path):
    served, summaries = _sweep()
    text = metrics.table(summaries)
    assert len(text.splitlines()) == 1 + len(summaries) and "goodput/s" in text
    paths = metrics.plot(summaries, served, tmp_path / "figs")
    assert sorted(p.name for p in paths) == ["goodput_rate.png", "ttft_r1.png", "ttft_r2.png",
                                             "ttft_r4.png", "ttft_rate.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
