"""The Prometheus metrics of `rekv serve --http` (`GET /metrics`), fed the router's records as they
come (`ServingMetrics`), in a `CollectorRegistry` of their own (never the process-wide one, so
two servers in one process never mix).

- `rekv_time_to_first_token_seconds`, `rekv_time_per_output_token_seconds`,
  `rekv_e2e_request_latency_seconds` (histograms): each ended request's (`metrics.Served`, on
  the router's clock, as a client sees them).
- `rekv_queue_depth{stage}` (gauge): requests in flight at each stage: `waiting` (arrived, no
  pair with the pages yet), `prefill` (assigned: its prompt computed or its handoff on the link,
  no token yet), `decode` (its first token came).
- `rekv_kv_pages_used{worker}`, `rekv_kv_pages_free{worker}` (gauges): each decode worker's
  pool, as its latest `Load` reported it.
- `rekv_requests_total{outcome}` (counter): ended requests by finish reason, or `error`;
  `rekv_request_actions_total{action}` and `rekv_request_choices_total{choice}` (counters): the
  assigned ones by their mode's action and by the mode the policy chose (`Mode.label`).
- `rekv_link_bytes_total` (counter): what handoffs put on the link (`PrefillDone.sent_bytes`);
  `rekv_fallbacks_total` (counter): requests whose cache was recomputed (`Finished.fell_back`);
  `rekv_prompt_tokens_total`, `rekv_generation_tokens_total` (counters).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from rekv_jax.serving.metrics import Served
from rekv_jax.serving.requests import Assignment, Load, PrefillDone, ServeRequest, Token

STAGES = ("waiting", "prefill", "decode")
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                  0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                 120.0, 300.0)


class ServingMetrics:
    """The metrics of the module docstring. Its methods take the router's records on one
    thread (the router's loop); `exposition` may run on any other."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pages: int | None = None) -> None:
        """`pages`: each decode worker's usable pages (None: pages used are not shown)."""
        self.registry = r = CollectorRegistry()
        self._pages = pages
        self._stage: dict[int, str] = {}  # the stage of each request in flight
        self._ttft = Histogram("rekv_time_to_first_token_seconds", "Arrival to first token",
                               buckets=TTFT_BUCKETS_S, registry=r)
        self._tpot = Histogram("rekv_time_per_output_token_seconds", "Mean gap between "
                               "a request's later tokens", buckets=TPOT_BUCKETS_S, registry=r)
        self._e2e = Histogram("rekv_e2e_request_latency_seconds", "Arrival to last token",
                              buckets=E2E_BUCKETS_S, registry=r)
        self._depth = Gauge("rekv_queue_depth", "Requests in flight by stage", ["stage"],
                            registry=r)
        for stage in STAGES:
            self._depth.labels(stage)
        self._used = Gauge("rekv_kv_pages_used", "Pages requests hold", ["worker"], registry=r)
        self._free = Gauge("rekv_kv_pages_free", "Pages no request holds", ["worker"],
                           registry=r)
        self._outcomes = Counter("rekv_requests", "Ended requests by finish reason or error",
                                 ["outcome"], registry=r)
        self._actions = Counter("rekv_request_actions", "Assigned requests by action",
                                ["action"], registry=r)
        self._choices = Counter("rekv_request_choices", "Assigned requests by the mode their "
                                "policy chose", ["choice"], registry=r)
        self._link = Counter("rekv_link_bytes", "Bytes handoffs put on the link", registry=r)
        self._fallbacks = Counter("rekv_fallbacks", "Requests whose cache was recomputed",
                                  registry=r)
        self._prompt = Counter("rekv_prompt_tokens", "Prompt tokens of ended requests",
                               registry=r)
        self._generated = Counter("rekv_generation_tokens", "Tokens generated", registry=r)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)

    def _move(self, request_id: int, stage: str | None) -> None:
        """Request `request_id` is now at `stage` (None: it ended)."""
        before = self._stage.pop(request_id, None)
        if before is not None:
            self._depth.labels(before).dec()
        if stage is not None:
            self._stage[request_id] = stage
            self._depth.labels(stage).inc()

    def arrived(self, request: ServeRequest) -> None:
        self._move(request.id, "waiting")

    def assigned(self, assignment: Assignment) -> None:
        self._move(assignment.request_id, "prefill")

    def emitted(self, item: object) -> None:
        """A worker's record: a first token, a handoff sent, a pool's state."""
        if isinstance(item, Token) and item.index == 0 and item.request_id in self._stage:
            self._move(item.request_id, "decode")
        elif isinstance(item, PrefillDone):
            self._link.inc(item.sent_bytes)
        elif isinstance(item, Load):
            self._free.labels(str(item.worker)).set(item.free_pages)
            if self._pages is not None:
                self._used.labels(str(item.worker)).set(self._pages - item.free_pages)

    def served(self, served: Served) -> None:
        """A request ended (`Served`): its latencies, outcome, choice and tokens."""
        self._move(served.request.id, None)
        for histogram, ms in ((self._ttft, served.ttft_ms), (self._tpot, served.tpot_ms),
                              (self._e2e, served.e2e_ms)):
            if ms is not None:
                histogram.observe(ms / 1e3)
        f = served.finished
        self._outcomes.labels(served.finish_reason or "error").inc()
        if served.assignment is not None:
            self._actions.labels(str(served.assignment.mode.action)).inc()
            self._choices.labels(served.assignment.mode.label).inc()
        self._fallbacks.inc(bool(f and f.fell_back))
        self._prompt.inc(served.request.prompt_len)
        self._generated.inc(len(served.token_times_s))
