"""What a serving run measured: each request's latencies (`Served`), a summary per policy and rate
(`ServeSummary`: TTFT quantiles with bootstrap 95% CIs, TPOT, end-to-end latency, tokens/s,
goodput), the highest rate that meets the SLO (`Capacity`), the readable table and the figures.

Latencies are on the router's clock, as a client sees them: TTFT from a request's arrival to its
first token, TPOT the mean gap between its later tokens ((last - first) / (n - 1)), end-to-end
from arrival to its last token. A request meets the SLO when it completed (every token, no
error), its TTFT is within `Slo.ttft_ms` and its TPOT within `Slo.tpot_ms` (a one-token request
has no TPOT to miss). Goodput is the requests per second that met the SLO, over the run's span
(first arrival to last token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rekv_jax import stats
from rekv_jax.serving.lifecycle import Status, Transition, entered_s
from rekv_jax.serving.requests import Assignment, Finished, PrefillDone, ServeRequest

TTFT_QUANTILES = (0.5, 0.9, 0.99)
CAPACITY_SHARE = 0.9  # the share of requests that must meet the SLO at a sustainable rate


@dataclasses.dataclass(frozen=True)
class Slo:
    """The service-level objective a request must meet (ms)."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO targets must be positive ms, got {self}")


@dataclasses.dataclass(frozen=True)
class Stage:
    """When one stage of a served request ended, as the cost model predicted it when the
    request was assigned and as the router saw it, both in ms after that assignment (None:
    never reached)."""

    name: str  # `STAGES`
    predicted_ms: float
    measured_ms: float | None


# each stage and the status a request enters when it ends: its prompt computed, its handoff's
# verdicts in (the link done with it), its first token at the router
STAGES = (("prefill", Status.PREFILLED), ("link", Status.SENT), ("first_token", Status.DECODING))


@dataclasses.dataclass(frozen=True)
class Served:
    """One request as the router saw it served under `policy` at arrival `rate`."""

    request: ServeRequest
    policy: str
    rate: float  # requests per second of its run
    token_times_s: tuple[float, ...]  # when each token reached the router (run clock)
    assignment: Assignment | None = None  # None: it failed before one was made
    finished: Finished | None = None  # the decode worker's report (None: none came)
    error: str | None = None  # the router's one line, if it failed there
    prefill_done: PrefillDone | None = None  # the prefill worker's report (None: none came)
    lifecycle: tuple[Transition, ...] = ()  # its statuses and when each began, arrival first
    aborted: str | None = None  # why it was aborted (not a failure: `Router.abort`)

    @property
    def status(self) -> Status | None:
        """How it ended (None: no lifecycle recorded)."""
        return self.lifecycle[-1].status if self.lifecycle else None

    @property
    def finish_reason(self) -> str | None:
        """Why it ended if it did not fail: "length", "stop" or "abort" (`FINISH_REASONS`)."""
        if self.aborted is not None:
            return "abort"
        return None if self.failure else self.finished.finish_reason

    @property
    def completed(self) -> bool:
        """Every token it was to generate arrived (its `max_new_tokens`, or up to the stop that
        ended it) and nothing failed."""
        f = self.finished
        if self.error is not None or f is None or f.error is not None:
            return False
        want = {"length": self.request.max_new_tokens, "stop": len(f.tokens)}.get(f.finish_reason)
        return len(self.token_times_s) == want

    @property
    def failure(self) -> str | None:
        """Why it failed (one line: the router's, else its worker's), None if it did not (an
        aborted request did not fail)."""
        if self.aborted is not None:
            return None
        if self.error is not None or self.finished is None:
            return self.error or "no report"
        return self.finished.error

    @property
    def compile_ms(self) -> float:
        """The XLA compile time its workers reported while they held it: what its measured
        times hold of the compiler's (0 once they are warm)."""
        return sum(r.compile_ms for r in (self.prefill_done, self.finished) if r is not None)

    @property
    def ttft_ms(self) -> float | None:
        t = self.token_times_s
        return (t[0] - self.request.arrival_s) * 1e3 if t else None

    @property
    def tpot_ms(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) * 1e3 / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e_ms(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - self.request.arrival_s) * 1e3 if t else None

    def entered_s(self, status: Status) -> float | None:
        return entered_s(self.lifecycle, status)

    def stages(self) -> tuple[Stage, ...]:
        """Each of `STAGES`, predicted and measured from its (last) assignment; () if it was
        never assigned."""
        assigned = self.entered_s(Status.PREFILLING)
        if self.assignment is None or assigned is None:
            return ()
        p = self.assignment.why.predicted
        predicted = {"prefill": p.prefill_wait_ms + p.prefill_busy_ms,
                     "link": p.after.link_free_ms, "first_token": p.ttft_ms}
        return tuple(Stage(name, predicted[name], None if (t := self.entered_s(status)) is None
                           else (t - assigned) * 1e3) for name, status in STAGES)

    def meets(self, slo: Slo) -> bool:
        tpot = self.tpot_ms
        return (self.completed and self.ttft_ms <= slo.ttft_ms
                and (tpot is None or tpot <= slo.tpot_ms))

    def to_json(self, slo: Slo | None = None) -> dict[str, Any]:
        """Its record: arrival, the choice and why, the phases, its tokens and checks."""
        f = self.finished
        out = {"kind": "served_request", "policy": self.policy, "rate": self.rate,
               **self.request.to_json(), "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
               "e2e_ms": self.e2e_ms, "compile_ms": self.compile_ms,
               "completed": self.completed,
               "assignment": self.assignment.to_json() if self.assignment else None,
               "token_times_s": list(self.token_times_s), "error": self.error,
               "finish_reason": self.finish_reason, "aborted": self.aborted,
               "lifecycle": [t.to_json() for t in self.lifecycle],
               "stages": [dataclasses.asdict(stage) for stage in self.stages()]}
        if f is not None:
            out |= {"tokens": list(f.tokens), "stop": f.stop,
                    "handoff_ms": f.handoff_ms,
                    "phases_ms": f.phases.to_json() if f.phases else None, "checks": f.checks,
                    "fell_back": f.fell_back, "worker_error": f.error}
        if self.prefill_done is not None:
            out["prefill_side"] = dataclasses.asdict(self.prefill_done)
        return out | ({"meets_slo": self.meets(slo)} if slo else {})


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A statistic and its bootstrap 95% CI."""

    value: float
    ci: tuple[float, float]

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "ci": list(self.ci)}


@dataclasses.dataclass(frozen=True)
class ServeSummary:
    """One policy at one rate."""

    policy: str
    rate: float
    slo: Slo
    requests: int
    completed: int
    span_s: float  # first arrival to last token
    ttft_ms: tuple[Estimate, ...]  # at TTFT_QUANTILES, over completed requests
    tpot_ms: tuple[float, float] | None  # p50, p99 (None: no request had two tokens)
    e2e_ms: tuple[float, float]  # p50, p99
    tokens_per_s: float
    goodput_rps: float  # requests per second that met the SLO
    slo_share: float  # the share of all requests that met it
    ttft_error: float | None  # median |predicted - measured| / measured TTFT
    handoff_error: float | None  # the same of the handoff (the cost model's prediction)
    choices: tuple[tuple[str, int], ...]  # each mode label chosen and how often, commonest first
    compiled: int = 0  # requests whose measured times hold an XLA compile (`Served.compile_ms`)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"kind": "serve_summary", **d, "slo": dataclasses.asdict(self.slo),
                "ttft_ms": {f"p{round(q * 100)}": e.to_json()
                            for q, e in zip(TTFT_QUANTILES, self.ttft_ms, strict=True)},
                "choices": dict(self.choices)}


def summarize(served: Sequence[Served], slo: Slo, seed: int = 0) -> ServeSummary:
    """The summary of one policy's run at one rate (every request of it, completed or not)."""
    keys = {(s.policy, s.rate) for s in served}
    if len(keys) != 1:
        raise ValueError(f"a summary is of one policy at one rate, got {sorted(keys)}")
    (policy, rate), = keys
    done = [s for s in served if s.completed]
    if not done:
        raise ValueError(f"{policy} at {rate:g}/s: no request completed")
    ttft = [s.ttft_ms for s in done]
    tpot = [s.tpot_ms for s in done if s.tpot_ms is not None]
    e2e = [s.e2e_ms for s in done]
    ends = [s.token_times_s[-1] for s in served if s.token_times_s]
    span = max(ends) - min(s.request.arrival_s for s in served)
    met = sum(s.meets(slo) for s in served)
    labels = [s.assignment.mode.label for s in served if s.assignment]
    return ServeSummary(
        policy, rate, slo, len(served), len(done), span,
        tuple(Estimate(stats.quantile(ttft, q), stats.quantile_ci(ttft, q, seed=seed))
              for q in TTFT_QUANTILES),
        (stats.quantile(tpot, 0.5), stats.quantile(tpot, 0.99)) if tpot else None,
        (stats.quantile(e2e, 0.5), stats.quantile(e2e, 0.99)),
        sum(len(s.token_times_s) for s in served) / span, met / span, met / len(served),
        _median_error([(s.assignment.why.predicted.ttft_ms, s.ttft_ms) for s in done
                       if s.assignment]),
        _median_error([(s.assignment.why.predicted.handoff_ms, s.finished.handoff_ms)
                       for s in done if s.assignment]),
        tuple(sorted(((m, labels.count(m)) for m in set(labels)), key=lambda c: (-c[1], c[0]))),
        sum(s.compile_ms > 0 for s in served))


def _median_error(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Median relative error |predicted - measured| / measured (None: no pair)."""
    errors = [abs(p - m) / m for p, m in pairs if m > 0]
    return stats.median(errors) if errors else None


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The highest swept rate at which a policy serves at least `share` of its requests within
    the SLO, as must every lower swept rate (None: not even the lowest)."""

    policy: str
    rate: float | None
    share: float
    slo: Slo

    def to_json(self) -> dict[str, Any]:
        return {"kind": "serve_capacity", "policy": self.policy, "rate": self.rate,
                "share": self.share, "slo": dataclasses.asdict(self.slo)}


def capacities(summaries: Sequence[ServeSummary], share: float = CAPACITY_SHARE
               ) -> list[Capacity]:
    """Each policy's `Capacity` over the rates of `summaries`, in order of first appearance."""
    out = []
    for policy in dict.fromkeys(s.policy for s in summaries):
        best = None
        for s in sorted((s for s in summaries if s.policy == policy), key=lambda s: s.rate):
            if s.slo_share < share:
                break
            best = s.rate
        slo = next(s.slo for s in summaries if s.policy == policy)
        out.append(Capacity(policy, best, share, slo))
    return out


def table(summaries: Sequence[ServeSummary]) -> str:
    """The readable table: a row per policy and rate."""
    head = (f"{'policy':<16}{'rate/s':>7}{'done':>9}  {'TTFT p50 ms [95% CI]':<24}"
            f"{'p90 [95% CI]':<24}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'E2E p50':>9}"
            f"{'tok/s':>8}{'goodput/s':>10}{'SLO met':>9}")
    rows = [head]
    for s in sorted(summaries, key=lambda s: (s.rate, s.policy)):
        p50, p90, p99 = s.ttft_ms
        tpot = s.tpot_ms or (float("nan"),) * 2
        rows.append(f"{s.policy:<16}{s.rate:>7.3g}{f'{s.completed}/{s.requests}':>9}  "
                    f"{_with_ci(p50):<24}{_with_ci(p90):<24}{p99.value:>8.0f}"
                    f"{tpot[0]:>10.1f}{tpot[1]:>8.1f}{s.e2e_ms[0]:>9.0f}{s.tokens_per_s:>8.1f}"
                    f"{s.goodput_rps:>10.3f}{s.slo_share:>9.0%}")
    return "\n".join(rows)


def _with_ci(e: Estimate) -> str:
    return f"{e.value:.0f} [{e.ci[0]:.0f}, {e.ci[1]:.0f}]"


def capacity_lines(caps: Sequence[Capacity]) -> list[str]:
    """One line per policy: its highest sustainable rate under the SLO."""
    return [f"{c.policy}: {c.share:.0%} within the SLO (TTFT <= {c.slo.ttft_ms:g} ms, TPOT <= "
            f"{c.slo.tpot_ms:g} ms) up to " + (f"{c.rate:g} req/s" if c.rate is not None
                                               else "no swept rate") for c in caps]


def plot(summaries: Sequence[ServeSummary], served: Sequence[Served], folder: str | Path
         ) -> list[Path]:
    """PNGs in `folder`: the TTFT distribution per policy at each rate (`ttft_r<rate>.png`), and
    TTFT and goodput against rate (`ttft_rate.png`, `goodput_rate.png`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = [_ttft_cdf([s for s in served if s.rate == rate], rate,
                     folder / f"ttft_r{rate:g}.png")
           for rate in sorted({s.rate for s in served})]
    return out + [_against_rate(summaries, folder / "ttft_rate.png", ttft=True),
                  _against_rate(summaries, folder / "goodput_rate.png", ttft=False)]


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # object API: no global pyplot state, no display

    return Figure(figsize=(width, height), layout="constrained")


def _ttft_cdf(served: Sequence[Served], rate: float, path: Path) -> Path:
    fig = _figure(6.0, 4.0)
    ax = fig.subplots()
    for policy in dict.fromkeys(s.policy for s in served):
        ttft = np.sort([s.ttft_ms for s in served if s.policy == policy and s.completed])
        ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=policy)
    ax.set(xlabel="time to first token (ms)", ylabel="share of requests",
           title=f"TTFT distribution at {rate:g} req/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path


def _against_rate(summaries: Sequence[ServeSummary], path: Path, ttft: bool) -> Path:
    fig = _figure(6.0, 4.0)
    ax = fig.subplots()
    for k, policy in enumerate(dict.fromkeys(s.policy for s in summaries)):
        mine = sorted((s for s in summaries if s.policy == policy), key=lambda s: s.rate)
        rates = [s.rate for s in mine]
        if ttft:  # one colour per policy: p50 solid, p90 dashed
            for q, style in ((0, "-o"), (1, "--s")):
                est = [s.ttft_ms[q] for s in mine]
                err = np.abs(np.array([e.ci for e in est]).T - [e.value for e in est])
                ax.errorbar(rates, [e.value for e in est], yerr=err, fmt=style, capsize=3,
                            color=f"C{k}", label=f"{policy} p{round(TTFT_QUANTILES[q] * 100)}")
        else:
            ax.plot(rates, [s.goodput_rps for s in mine], "-o", color=f"C{k}", label=policy)
    what = "TTFT (ms), p50 and p90 with 95% CIs" if ttft else "goodput (req/s within the SLO)"
    ax.set(xlabel="arrival rate (req/s)", ylabel=what.split(",")[0],
           title=("TTFT" if ttft else "Goodput") + " against arrival rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path
