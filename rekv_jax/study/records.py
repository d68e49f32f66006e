"""`Summary`: the measured result of one handoff action under one schedule and setup.

The handoff emits one per action and schedule, the sweep stores them (`sweep.jsonl`), the report
turns them into tables and figures, and `rekv select` joins them with the quality gate. The JSON
form (`to_json` / `from_json`) writes the action as its text (`q8:r=2`) with `bits`, `cut`,
`suffix_len` and `num_layers` beside it, so every line is readable on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rekv_jax import stats
from rekv_jax.action import Action, ActionKind
from rekv_jax.jsonl import read_jsonl
from rekv_jax.mode import NO_SCHEDULE, SCHEDULES, Interval, Mode, PrefillMode
from rekv_jax.phases import Phases, Timeline

FIDELITY_LIMIT = 1.10  # a suffix phase past this many times its standalone time is warned of

RECORD_SCHEDULES = (*SCHEDULES, NO_SCHEDULE)  # what a record's schedule may state


def serializes(transport: str, mode: Mode, platform: str) -> bool:
    """Whether a handoff that overlaps its suffix with a transfer ran serialized on the device:
    on a GPU the collective transport's cross-process ppermute is its own program on the compute
    stream, so it runs before or after the suffix program, not beside it (see rekv_jax/transport).
    Such a record states `serialized: true`; its times are not an overlapping schedule's."""
    return transport == "collective" and mode.overlaps_transfer and platform == "gpu"


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """How faithfully a CPU pair emulated the decode device during a handoff's suffix: its suffix
    phase beside the same layers run alone, at once after, in the same process on the same
    core; and what the device's threads lost to other threads meanwhile (`cores.CoreUse`)."""

    suffix_alone_ms: float  # the same layers (and chunks) alone, outside any handoff
    ratio: float  # suffix phase / suffix_alone_ms (1: the handoff cost the suffix nothing)
    device_wait_ms: float | None = None  # the device's threads waited for their core
    host_ms: float | None = None  # this process's other threads ran (on any core)

    def to_json(self) -> dict[str, float | None]:
        return {k: None if v is None else round(v, 4) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def median(cls, of: Iterable[Fidelity | None]) -> Fidelity | None:
        """The field-wise median of reps' figures (None where no rep has one)."""
        got = [f for f in of if f is not None]
        if not got:
            return None
        waits = [f.device_wait_ms for f in got if f.device_wait_ms is not None]
        hosts = [f.host_ms for f in got if f.host_ms is not None]
        return cls(stats.median([f.suffix_alone_ms for f in got]),
                   stats.median([f.ratio for f in got]),
                   stats.median(waits) if waits else None, stats.median(hosts) if hosts else None)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where a record was measured; every table and figure is made per setup."""

    hardware: str
    transport: str
    link_gbps: float | None  # the paced link (None: unpaced)
    batch: int
    interval: str  # costmodel.INTERVALS
    prefill: str  # costmodel.PREFILL_MODES
    prefill_devices: int
    decode_devices: int
    pinning: str = ""  # Summary.pinning

    def sort_key(self) -> tuple:
        """Tables list setups in this order (an unpaced link first)."""
        return tuple(-1 if v is None else v for v in dataclasses.astuple(self))


@dataclasses.dataclass(frozen=True)
class Summary:
    """Median latency with its bootstrap CI, phase medians, payload and checks of one action."""

    model: str
    seq_len: int  # S
    batch: int  # B
    action: Action
    transport: str
    schedule: str  # one of RECORD_SCHEDULES
    link_gbps: float | None  # the paced link (None: unpaced)
    hardware: str
    reps_ms: tuple[float, ...]  # every timed rep's total
    phases_ms: Phases  # median per phase
    payload_bytes: int
    median_ms: float = float("nan")  # filled from reps_ms when not given
    ci95_ms: tuple[float, float] = (float("nan"), float("nan"))  # bootstrap CI of the median
    first_token_match: bool = True  # every rep's first token equals a one-process prefill's
    cache_check: str = ""  # what held of the cache (e.g. "bitwise")
    fallbacks: int = 0  # reps whose prefix transfer failed and were recomputed
    predicted_ms: float | None = None  # the cost model's prediction, when one was made
    weights: str = ""  # where the weights came from (loader.LoadedModel.weights)
    interval: str = Interval.READY  # timed from the prefill state, or the prompt
    prefill: str = PrefillMode.FULL  # the prefill side ran all L layers, or 0..c-1
    prefill_devices: int = 1  # tensor-parallel devices of each side (rekv_jax.sharding)
    decode_devices: int = 1
    paired: bool = False  # its reps alternated with the other schedule's: rep i is a pair
    # bytes the prefill side's transport sent per handoff (measured; the largest over the reps):
    # payload_bytes (Eqs. 5, 7) plus the token ids and, where sent, the first token
    sent_bytes: int | None = None
    serialized: bool = False  # overlapped, but serialized on the device (`serializes`)
    # CPU sides on one machine: "pinned: prefill cpu 0, decode cpu 1" or "cores shared"
    # (`transport.cores`); "" elsewhere (GPUs, one process, a multi-host pair, older lines)
    pinning: str = ""
    chunks: int = 1  # token chunks of the chunked schedule / pipelined prefill (1: unchunked)
    fidelity: Fidelity | None = None  # the emulation's, over the reps (medians)

    def __post_init__(self) -> None:
        if isinstance(self.fidelity, dict):  # from JSON
            object.__setattr__(self, "fidelity", Fidelity(**self.fidelity))
        if self.schedule not in RECORD_SCHEDULES:
            raise ValueError(f"record {self.action}: schedule {self.schedule!r} not in "
                             f"{RECORD_SCHEDULES}")
        if not self.reps_ms:
            raise ValueError(f"record {self.action} has no reps_ms")
        object.__setattr__(self, "reps_ms", tuple(float(t) for t in self.reps_ms))
        if self.median_ms != self.median_ms:  # NaN: not given
            object.__setattr__(self, "median_ms", stats.median(self.reps_ms))
            object.__setattr__(self, "ci95_ms", stats.median_ci(self.reps_ms))
        object.__setattr__(self, "ci95_ms", tuple(self.ci95_ms))

    @property
    def setup(self) -> Setup:
        """Where it was measured; every table and figure is made per setup."""
        return Setup(self.hardware, self.transport, self.link_gbps, self.batch, self.interval,
                     self.prefill, self.prefill_devices, self.decode_devices, self.pinning)

    def fidelity_warning(self) -> str | None:
        """One line when the suffix ran more than FIDELITY_LIMIT times its standalone time where
        it waits for no input (the chunked schedule and a pipelined prefill wait for their
        chunks, so there the figure is recorded, not judged)."""
        f = self.fidelity
        if f is None or self.mode.suffix_waits_for_input or f.ratio <= FIDELITY_LIMIT:
            return None
        lost = "" if f.device_wait_ms is None else (
            f"; its device threads waited {f.device_wait_ms:.1f} ms for their core and this "
            f"process's other threads ran {f.host_ms:.1f} ms")
        return (f"warning: the suffix of {self.action} ({self.schedule}) took {f.ratio:.2f}× the "
                f"{f.suffix_alone_ms:.1f} ms of the same layers alone on the same core{lost}: "
                "the emulation charged it for other work, so its speedups understate ReKV's")

    @property
    def mode(self) -> Mode:
        """How its handoffs ran."""
        return Mode.of_record(self.action, self.schedule, self.prefill, self.chunks,
                              self.interval)

    @property
    def family(self) -> str:
        """The mechanism: `BF16 transfer`, `Q8 transfer`, `Q4 transfer`, `BF16 recompute` (any
        BF16 cut < L, full recomputation included), `joint Q8` or `joint Q4`."""
        prec = self.action.precision.upper()
        if self.action.kind == ActionKind.TRANSFER:
            return f"{prec} transfer"
        return "BF16 recompute" if self.action.bits == 16 else f"joint {prec}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`kind: "summary"`); inverse of `from_json`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        a = self.action
        return {"kind": "summary", **d, "action": str(a), "phases_ms": self.phases_ms.to_json(),
                "fidelity": self.fidelity and self.fidelity.to_json(),
                "bits": a.bits, "cut": a.cut,
                "suffix_len": a.suffix_len, "num_layers": a.num_layers,
                "reps_ms": list(self.reps_ms), "ci95_ms": list(self.ci95_ms)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Summary:
        """Parse a summary line; a clear ValueError names missing or inconsistent fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING} | {"cut", "suffix_len"}
        missing = sorted(required - set(d))
        if missing:
            raise ValueError(f"record {d.get('action')!r} lacks fields {missing}")
        num_layers = d.get("num_layers", d["cut"] + d["suffix_len"])
        action = Action.parse(d["action"], num_layers)
        if (action.bits, action.cut) != (d.get("bits", action.bits), d["cut"]):
            raise ValueError(f"record {d['action']!r}: bits {d.get('bits')} / cut {d['cut']} "
                             f"do not match the action")
        try:
            phases = Phases.from_json(d["phases_ms"])
        except ValueError as e:
            raise ValueError(f"record {action}: {e}") from None
        return cls(**{k: v for k, v in d.items() if k in names}
                   | {"action": action, "phases_ms": phases})


def read_summaries(paths: str | Path | Iterable[str | Path]) -> list[Summary]:
    """The summary lines of one or more JSONL files (other kinds of lines are skipped)."""
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    return [Summary.from_json(d) for path in paths for d in read_jsonl(path)
            if d.get("kind", "summary") == "summary"]


@dataclasses.dataclass(frozen=True)
class Rep:
    """One timed handoff of an action (the handoff's `kind: "rep"` line), checked on its own."""

    action: Action
    schedule: str  # one of RECORD_SCHEDULES (`Mode.schedule_text`)
    rep: int  # index among the timed reps (warmups excluded)
    total_ms: float
    phases_ms: Phases
    fallback: bool = False
    timeline_ms: Timeline | None = None  # None: not timed ({} in JSON)
    sent_bytes: int = 0  # what the prefill side's transport sent
    first_token_match: bool = True  # equals a single-process prefill's first token
    cache_check: str = ""  # what held of this rep's cache (cache_check.check_cache)
    serialized: bool = False  # overlapped, but serialized on the device (`serializes`)
    chunks: int = 1  # token chunks of the chunked schedule / pipelined prefill (1: unchunked)
    fidelity: Fidelity | None = None  # None: nothing recomputed, or not measured

    def __post_init__(self) -> None:
        if isinstance(self.fidelity, dict):  # from JSON
            object.__setattr__(self, "fidelity", Fidelity(**self.fidelity))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`kind: "rep"`); inverse of `from_json`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        timeline = self.timeline_ms.to_json() if self.timeline_ms else {}
        return {"kind": "rep", **d, "action": str(self.action),
                "phases_ms": self.phases_ms.to_json(), "timeline_ms": timeline,
                "fidelity": self.fidelity and self.fidelity.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any], num_layers: int) -> Rep:
        """Parse a rep line of an action of a `num_layers`-layer model (a rep line names the
        action by its text only, which needs the layer count)."""
        names = {f.name for f in dataclasses.fields(cls)}
        timeline = d.get("timeline_ms")
        return cls(**{k: v for k, v in d.items() if k in names}
                   | {"action": Action.parse(d["action"], num_layers),
                      "phases_ms": Phases.from_json(d["phases_ms"]),
                      "timeline_ms": Timeline.from_json(timeline) if timeline else None})


# ------------------------------------------------------------------ the report's rows (tables.py)


@dataclasses.dataclass(frozen=True)
class Speedup:
    """How many times faster an action is than the one `over`, with a bootstrap 95% CI."""

    x: float
    ci95: tuple[float, float]
    over: str  # the slower action's text

    def text(self) -> str:
        return f"{self.x:.2f}× [{self.ci95[0]:.2f}, {self.ci95[1]:.2f}]"


@dataclasses.dataclass(frozen=True)
class Table1Row:
    """Table 1: one setup, model and length, each mechanism's fastest record and the speedups."""

    setup: Setup
    model: str
    seq_len: int
    reps: int
    bf16: Summary | None  # BF16 transfer
    q8: Summary | None  # Q8 transfer
    recompute: Summary | None  # the fastest BF16 action with a recomputed suffix
    joint: Summary | None  # the fastest joint action at the table's bits
    best: Summary  # the fastest record of the cell
    joint_vs_bf16: Speedup | None
    joint_vs_single: Speedup | None  # over the faster of Q8 transfer and recompute
    clean: bool  # every record's first token matched and none fell back


@dataclasses.dataclass(frozen=True)
class PredictionRow:
    """A measured record beside the cost model's prediction for it."""

    model: str
    seq_len: int
    schedule: str
    link_gbps: float | None
    hardware: str
    transport: str
    batch: int
    action: str
    measured_ms: float
    predicted_ms: float
    error_pct: float  # 100 (predicted - measured) / measured


@dataclasses.dataclass(frozen=True)
class ScheduleGain:
    """Table 3's schedule comparison: one action run sequential and overlapped."""

    action: str
    sequential_ms: float
    overlapped_ms: float
    gain: float  # sequential / overlapped
    gain_ci95: tuple[float, float]
    efficiency_sequential_phases: float  # overlapped / Eq. 9's ideal from the sequential phases


@dataclasses.dataclass(frozen=True)
class Table3Row:
    """Table 3: payload MiB per configuration and the schedule gain of one setup, model, length."""

    setup: Setup
    model: str
    seq_len: int
    payload_mib: dict[str, float]  # configuration -> MiB
    schedule: ScheduleGain | None  # None: no action was run under both schedules


@dataclasses.dataclass(frozen=True)
class ChunkedRow:
    """Past the paper: the best chunked joint action of one setup, model, length and N against
    the best overlapped one."""

    setup: Setup
    model: str
    seq_len: int
    chunks: int
    overlapped: Summary
    chunked: Summary
    speedup: Speedup  # chunked over overlapped


@dataclasses.dataclass(frozen=True)
class Fig3Row:
    """Fig. 3: one joint action timed from the prompt under both schedules."""

    setup: Setup
    model: str
    seq_len: int
    action: str
    reps: int
    sequential_ms: float
    overlapped_ms: float
    speedup: float  # sequential / overlapped
    ci95: tuple[float, float]
    paired: bool  # the CI resampled rep indices jointly


@dataclasses.dataclass(frozen=True)
class BatchRow:
    """Simultaneously ready requests: the best joint action against its transfer-only action."""

    setup: Setup
    model: str
    seq_len: int
    batch: int
    joint: Summary | None
    transfer: Summary | None
    requests_per_s: dict[str, float | None]  # "joint" / "transfer" -> batch / completion time
    joint_vs_transfer: Speedup | None


@dataclasses.dataclass(frozen=True)
class CrossoverRow:
    """One paced link of a crossover group: the fastest action measured, and predicted."""

    group: tuple  # (hardware, transport, batch, model, seq_len)
    link_gbps: float
    measured_best: str
    measured_ms: float
    families_ms: dict[str, float]  # family -> its fastest median
    predicted_best: str | None = None  # None: no profile matches the group
    predicted_ms: float | None = None
