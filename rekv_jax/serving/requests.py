"""What the router and the workers of a serving run tell each other: small frozen records, each
picklable (they cross the launcher's pipes: `Group.send` to a worker, `Member.emit` back).

Router -> prefill worker: `Prefill`. Router -> decode worker: `Admit`. Router -> either:
`Abort`. Prefill worker -> router: `Prefilled` (its device is done with the prompt), then
`PrefillDone` (its handoff's verdicts came). Decode worker -> router: `Token` (each generated
token as it is known), `Finished` (once per request) and `Load` (its state, after an iteration
that changed it). Every worker -> router, once, when it can serve: `Ready`. The router's own:
`ServeRequest` (what arrives), `Assignment` (what its policy chose, and `Why`). What a
front end hears of a request: its `Token`s, then `Ended`.

Ids are the router's, unique in a run; a handoff's transport tags carry the id (`tag`). Times a
worker stamps are `time.monotonic()` seconds of its own clock (the router measures latency on
its own clock, when items arrive).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rekv_jax.mode import Mode
from rekv_jax.phases import Phases
from rekv_jax.planning.queueing import ServedPrediction
from rekv_jax.serving.sampling import Sampling, Stops

FINISH_REASONS = ("length", "stop", "abort")  # why a request that did not fail ended


def tag(request_id: int) -> str:
    """The transport tag under which request `request_id`'s handoff messages cross."""
    return f"req/{request_id}"


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """One request of a run, as it arrives at the router."""

    id: int  # unique in the run; the load generator numbers them 0.. in arrival order
    tokens: tuple[int, ...]  # the prompt's token ids
    max_new_tokens: int  # tokens to generate, the handoff's first token included
    arrival_s: float = 0.0  # when it arrives, seconds after the run's start
    sampling: Sampling = Sampling()  # greedy unless asked
    stops: Stops = Stops()  # what else ends it (EOS, stop strings and ids)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.id < 0:
            raise ValueError(f"a request id must be >= 0, got {self.id}")
        if not self.tokens or min(self.tokens) < 0:
            raise ValueError(f"request {self.id}: a prompt needs at least one token id >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: max_new_tokens must be >= 1, got "
                             f"{self.max_new_tokens}")
        if not self.arrival_s >= 0:
            raise ValueError(f"request {self.id}: arrival_s must be >= 0, got {self.arrival_s}")

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def to_json(self) -> dict[str, Any]:
        """Its record without the token ids (a run's JSON names prompts by length), with what
        replays its tokens (its sampling and seed) and what could end it early."""
        return {"id": self.id, "prompt_len": self.prompt_len,
                "max_new_tokens": self.max_new_tokens, "arrival_s": self.arrival_s,
                "sampling": dataclasses.asdict(self.sampling),
                "stops": dataclasses.asdict(self.stops)}


@dataclasses.dataclass(frozen=True)
class Weighed:
    """Another mode a policy weighed for a request, and its predicted time to first token and
    cost (`ServedPrediction.cost_ms`)."""

    label: str  # `Mode.label`
    ttft_ms: float
    cost_ms: float
    prefill_worker: int
    decode_worker: int


@dataclasses.dataclass(frozen=True)
class Why:
    """Why a policy chose a request's mode and workers."""

    policy: str  # the policy's name, e.g. "adaptive", "bf16:full", "q8:balanced"
    predicted: ServedPrediction  # the cost model's parts for the choice, under the load it saw
    link_gbps: float  # the link bandwidth the prediction used (the live estimate)
    quality: str  # the action at the gate: lossless (BF16), eligible, ineligible or unchecked
    runners_up: tuple[Weighed, ...] = ()  # the next fastest modes it weighed, fastest first
    # the suffix compute its decode may take beside it (`queueing.tpot_slack_ms`; None: any)
    tpot_slack_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "predicted": self.predicted.to_json(),
                "link_gbps": self.link_gbps, "quality": self.quality,
                "runners_up": [dataclasses.asdict(w) for w in self.runners_up],
                "tpot_slack_ms": self.tpot_slack_ms}


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The router's decision for one request: how it is handed off and by which workers."""

    request_id: int
    mode: Mode  # timed from the prompt (`Interval.PROMPT`)
    prefill_worker: int  # index among the prefill workers
    decode_worker: int  # index among the decode workers
    why: Why

    def to_json(self) -> dict[str, Any]:
        m = self.mode
        return {"request_id": self.request_id, "action": str(m.action),
                "schedule": m.schedule_text, "prefill": str(m.prefill), "chunks": m.chunks,
                "label": m.label, "prefill_worker": self.prefill_worker,
                "decode_worker": self.decode_worker, "why": self.why.to_json()}


@dataclasses.dataclass(frozen=True)
class Prefill:
    """Router -> prefill worker: compute this prompt as `mode` asks and send its handoff to
    `decode_worker` under `tag(request_id)`; queued first come, first served."""

    request_id: int
    tokens: tuple[int, ...]  # the prompt's ids
    mode: Mode
    decode_worker: int
    sampling: Sampling = Sampling()  # of its first token, where the prefill side draws it
    # its `Admit` went with it (its pages are taken): a streamed prefill computes at once and
    # holds its messages until its admission, which comes within a decode iteration
    admitted: bool = False


@dataclasses.dataclass(frozen=True)
class Admit:
    """Router -> decode worker: reserve pages for a request (prompt plus `max_new_tokens`) and
    receive its handoff from `prefill_worker` under `tag(request_id)` (the router counted the
    decode worker's pages: they are free)."""

    request_id: int
    prompt_len: int  # its tokens
    max_new_tokens: int
    mode: Mode
    prefill_worker: int
    suffix_ms: float  # the cost model's decode-side compute of its handoff, alone
    # (`costmodel.decode_busy_ms`): what it adds to `Load.queued_suffix_ms` until it has run
    sampling: Sampling = Sampling()
    stops: Stops = Stops()


@dataclasses.dataclass(frozen=True)
class Abort:
    """Router -> a worker holding a request: end it now, wherever it is (queued, prefilled and
    held, on the link, decoding). A prefill worker drops it (never prefilled if still queued)
    and answers `PrefillDone` with `error` = `why`; a decode worker frees its pages and answers
    `Finished` with `finish_reason` "abort". A worker that no longer holds it ignores it."""

    request_id: int
    why: str  # one line


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """Prefill worker -> router, once per `Prefill` and before its `PrefillDone`: its prefill
    device is done with the request (its prompt computed, or dropped before it was: then
    `compute_ms` is None), so its next prompt starts now. Its handoff may still wait for the
    decode side's pages, and for the link."""

    request_id: int
    worker: int
    compute_ms: float | None  # its prompt compute and quantize calls on the prefill device
    compile_ms: float = 0.0  # XLA compiles while it was computed (streamed: and sent)


@dataclasses.dataclass(frozen=True)
class PrefillDone:
    """Prefill worker -> router: a request's prompt was computed and its handoff sent (or it
    failed: `error`, one line)."""

    request_id: int
    worker: int
    compute_ms: float  # its prompt compute and quantize calls on the prefill device
    link_ms: float  # from its first message handed to the link to its last verdict
    sent_bytes: int  # what its transport put on the wire
    error: str | None = None
    # of link_ms, the time its first message waited for the handoff before it on its link (the
    # link is one FIFO): its bytes crossed in link_ms - queued_ms
    queued_ms: float = 0.0
    compile_ms: float = 0.0  # XLA compiles while this worker computed or sent it


@dataclasses.dataclass(frozen=True)
class Token:
    """Decode worker -> router: a request's generated token, as soon as it is known."""

    request_id: int
    index: int  # 0: the handoff's first token
    token: int
    t_s: float  # time.monotonic() on the decode worker
    logprob: float | None = None  # its log probability under the model (`Sampling.logprobs`)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the likeliest (id, log probability)


@dataclasses.dataclass(frozen=True)
class Ended:
    """How a backend's request ended, after its last `Token`."""

    finish_reason: str  # `FINISH_REASONS`
    stop: str | int | None = None  # the stop string or token id that ended it ("stop")

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got "
                             f"{self.finish_reason!r}")


@dataclasses.dataclass(frozen=True)
class Finished:
    """Decode worker -> router, once per request: what it produced and how its handoff went."""

    request_id: int
    tokens: tuple[int, ...]  # every generated id, the first token first (() if it failed)
    ttft_s: float  # from its admission to its first token, on the decode worker's clock
    tpot_s: float  # mean time between its later tokens there (0 with one token)
    handoff_ms: float  # the handoff's measured total (`Handoff.total_ms`), for the cost model
    phases: Phases | None  # the handoff's measured phases (None if it failed before them)
    checks: str  # what held of its cache (`handoff.check.check_cache`'s text; "" unchecked)
    fell_back: bool  # its prefix failed and its cache was recomputed from the ids
    error: str | None = None  # one line if it failed (others keep decoding)
    finish_reason: str = "length"  # `FINISH_REASONS` (meaningless when `error` is set)
    stop: str | int | None = None  # the stop string or token id that ended it ("stop")
    suffix_queued: bool = False  # its suffix waited behind another's: its phase holds the wait
    compile_ms: float = 0.0  # XLA compiles on this worker while it held the request


@dataclasses.dataclass(frozen=True)
class Load:
    """Decode worker -> router: its state after an iteration that changed it."""

    worker: int
    running: int  # requests in its decode batch
    queued_suffix_ms: float  # the `Admit.suffix_ms` of admitted suffix compute not yet run
    free_pages: int  # pages of its pool no request holds


@dataclasses.dataclass(frozen=True)
class Ready:
    """Worker -> router, once its links are up, its model loaded and its programs warm: it can
    serve. A decode worker adds its measured batched-step cost, `step_ms[b]` for a step of
    b running requests (the router's `DecodeCosts`); a prefill worker none."""

    worker: str  # its name, e.g. "decode-0"
    step_ms: tuple[tuple[int, float], ...] = ()  # (batch, ms), batch ascending
