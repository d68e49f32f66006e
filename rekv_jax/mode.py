"""How one handoff runs, described once: the `Mode` record (action, schedule, prefill mode, token
chunks, timed interval), validated at construction, and everything that follows from it: its
plan (the typed steps of `rekv_jax.plan`: what each side computes and when, the messages that
cross and their order), which single-process cache it must equal, and which of the cost model's
closed forms it has.

Every other module takes a `Mode` and asks it; none compares schedule, prefill or interval
values itself. The modes' values are `StrEnum`s: each member equals its string, so JSON, the
command line and the records see plain strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
from collections.abc import Sequence

from rekv_jax.action import Action, ActionKind
from rekv_jax.plan import (
    Builder,
    Message,
    Part,
    Plan,
    Prefill,
    Quantize,
    Receive,
    chunks_of,
)


class Interval(enum.StrEnum):
    """What a handoff's time counts from."""

    READY = "ready"  # the prefill state being ready (the paper's interval)
    PROMPT = "prompt"  # the prompt's arrival at the prefill worker


class PrefillMode(enum.StrEnum):
    """How the prefill side computes and sends."""

    FULL = "full"  # all L layers, then the handoff
    SPLIT = "split"  # only 0..c-1, each layer streamed as computed
    PIPELINED = "pipelined"  # token chunks through 0..c-1, each streamed as computed


class Schedule(enum.StrEnum):
    """How the decode side runs a joint action's suffix against the prefix's arrival (Eqs. 8-9)."""

    OVERLAPPED = "overlapped"  # the suffix while the prefix is in flight
    SEQUENTIAL = "sequential"  # the suffix after the prefix has arrived
    CHUNKED = "chunked"  # the boundary in token chunks, each run through c..L-1 as it arrives


class Fallback(enum.StrEnum):
    """What the decode side does when the prefix transfer fails."""

    ERROR = "error"  # raise
    RECOMPUTE = "recompute"  # rebuild the cache from the token ids


class Formula(enum.StrEnum):
    """The cost model's closed form for a mode (`planning.costmodel.closed_form_ends`)."""

    SEQUENTIAL = "sequential"  # Eq. 8 (transfer-only and full recomputation too)
    OVERLAPPED = "overlapped"  # Eq. 9
    CHUNKED = "chunked"  # the boundary in chunks, each suffix chunk as it arrives
    SPLIT = "split"  # the prefix streamed per layer as the prefill computes it
    PIPELINED = "pipelined"  # both sides as a two-stage pipeline over token chunks


INTERVALS = tuple(m.value for m in Interval)  # the values, as plain strings (argparse, messages)
PREFILL_MODES = tuple(m.value for m in PrefillMode)
SCHEDULES = tuple(m.value for m in Schedule)
PAPER_SCHEDULES = (Schedule.OVERLAPPED.value, Schedule.SEQUENTIAL.value)  # Eqs. 8-9
OVERLAPPING = (Schedule.OVERLAPPED.value, Schedule.CHUNKED.value)  # the suffix beside the prefix
DEFAULT_SCHEDULE = Schedule.OVERLAPPED.value  # a joint action's schedule unless one is asked
FALLBACKS = tuple(m.value for m in Fallback)
NO_SCHEDULE = "n/a"  # a record's schedule where the action has nothing to overlap
DEFAULT_CHUNKS = 4  # token chunks when a chunked run asks for none


@dataclasses.dataclass(frozen=True)
class Reference:
    """The single-process computation a handoff's cache must equal (a Q8/Q4 prefix within its
    error bound): a prefill over all layers, or the prefix then a suffix from `h_c`, each in
    `chunks` token chunks."""

    chunks: int = 1
    split_at_cut: bool = False  # run_prefix, then run_suffix(chunks) from h_c

    @property
    def name(self) -> str:
        """How the checks name it; "" for the plain prefill."""
        if self.split_at_cut:
            return f"run_suffix(chunks={self.chunks})"
        return f"prefill(chunks={self.chunks})" if self.chunks > 1 else ""


@dataclasses.dataclass(frozen=True)
class Mode:
    """How one handoff of `action` runs. Built by `Mode.of`, which drops what does not apply (a
    non-joint action has no schedule; chunks only where something is chunked) and then checks
    the rest; the constructor checks that it was given a normal form."""

    action: Action
    schedule: Schedule | None = Schedule.OVERLAPPED  # None: not a joint action
    prefill: PrefillMode = PrefillMode.FULL
    chunks: int = 1  # token chunks of the chunked schedule and of a pipelined prefill
    interval: Interval = Interval.READY

    def __post_init__(self) -> None:
        for name, kind in (("prefill", PrefillMode), ("interval", Interval)):
            _check_member(name, getattr(self, name), kind)
        if self.schedule is not None:
            _check_member("schedule", self.schedule, Schedule)
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {self.chunks!r}")
        if (self.schedule is None) == self.joint:
            raise ValueError(f"{self.action}: a joint action needs a schedule, another none "
                             "(use Mode.of)")
        check_timing(self.interval, self.prefill)
        if self.schedule == Schedule.CHUNKED and self.prefill == PrefillMode.SPLIT:
            raise ValueError("a split prefill streams per layer; chunk the boundary with a full "
                             "prefill, or use prefill 'pipelined'")
        pipelined = self.prefill == PrefillMode.PIPELINED
        if pipelined and self.schedule not in (None, Schedule.CHUNKED):
            raise ValueError("a pipelined prefill runs a joint action's suffix chunk by chunk: "
                             "use schedule 'chunked'")
        if (self.chunks > 1) != _chunked(self.schedule, self.prefill):
            raise ValueError(f"token chunks (N >= 2) go with the chunked schedule or a "
                             f"pipelined prefill, and they need them: got {self.chunks} under "
                             f"{self.schedule_text}, {self.prefill} prefill")

    @classmethod
    def of(cls, action: Action, schedule: str | None = Schedule.OVERLAPPED,
           prefill: str = PrefillMode.FULL, chunks: int = 1, interval: str | None = None
           ) -> Mode:
        """The mode of `action` as a run asks for it, normalized: a non-joint action drops the
        schedule; the chunks (a run's token chunks) apply only under the chunked schedule or a
        pipelined prefill; the interval defaults to the one the prefill needs. A ValueError
        names what does not go together."""
        _check_member("prefill", prefill, PrefillMode)
        prefill = PrefillMode(prefill)
        if interval is None:
            interval = Interval.READY if prefill == PrefillMode.FULL else Interval.PROMPT
        if schedule is not None:
            _check_member("schedule", schedule, Schedule)
            schedule = Schedule(schedule)
        if action.kind != ActionKind.JOINT:
            schedule = None
        return cls(action, schedule, prefill, chunks if _chunked(schedule, prefill) else 1,
                   Interval(interval))

    @classmethod
    def in_chunks(cls, action: Action, chunks: int) -> Mode:
        """`action` timed from the prompt with its decode-side compute in `chunks` token chunks
        (if 2 or more): a joint action's suffix chunked, a recomputation as a pipelined prefill of
        no layers (the decode side prefills in chunks), transfer-only as it is."""
        if chunks < 2 or action.kind == ActionKind.TRANSFER:
            return cls.of(action, interval=Interval.PROMPT)
        if action.kind == ActionKind.JOINT:
            return cls.of(action, Schedule.CHUNKED, chunks=chunks, interval=Interval.PROMPT)
        return cls.of(action, None, PrefillMode.PIPELINED, chunks, Interval.PROMPT)

    @classmethod
    def of_record(cls, action: Action, schedule: str, prefill: str, chunks: int, interval: str
                  ) -> Mode:
        """The mode a record states (its schedule NO_SCHEDULE where it has none)."""
        return cls.of(action, None if schedule == NO_SCHEDULE else schedule, prefill, chunks,
                      interval)

    @classmethod
    def candidates(cls, action: Action, schedules: Sequence[str], prefills: Sequence[str],
                   chunks: Sequence[int], interval: str) -> list[Mode]:
        """The distinct modes to try for `action`, as `rekv handoff` runs them: each schedule
        under each prefill mode where they go together, the chunked ones at each of `chunks`
        (>= 2), one mode where the action has no suffix to overlap and nothing chunks."""
        out = []
        for schedule, prefill in itertools.product(schedules, prefills):
            counts = chunks if _chunked(Schedule(schedule), PrefillMode(prefill)) else (1,)
            for n in counts:
                with contextlib.suppress(ValueError):  # a pair that does not go together
                    out.append(cls.of(action, schedule, prefill, n, interval))
        return list(dict.fromkeys(out))

    @property
    def label(self) -> str:
        """e.g. `q8:r=13 chunked x4`, `q8:r=13 split overlapped`, `q8:r=13 pipelined x8`."""
        how = {PrefillMode.FULL: self.schedule_text + f" x{self.chunks}" * (self.chunks > 1),
               PrefillMode.SPLIT: f"split {self.schedule_text}",
               PrefillMode.PIPELINED: f"pipelined x{self.chunks}"}[self.prefill]
        return f"{self.action} {how}"

    def __str__(self) -> str:
        text = f"{self.action} {self.schedule_text}, {self.prefill} prefill"
        return text + f", {self.chunks} chunks" * (self.chunks > 1) + f", from {self.interval}"

    # -- what it is ------------------------------------------------------------------------

    @property
    def joint(self) -> bool:
        return self.action.kind == ActionKind.JOINT

    @property
    def schedule_text(self) -> str:
        """The schedule a record states: NO_SCHEDULE where the action has nothing to overlap."""
        return NO_SCHEDULE if self.schedule is None else str(self.schedule)

    @property
    def paper_schedule(self) -> bool:
        """A joint action under Eq. 8 or 9 (sequential or overlapped), full prefill."""
        return self.formula in (Formula.SEQUENTIAL, Formula.OVERLAPPED) and self.joint

    @property
    def formula(self) -> Formula:
        """Which of the cost model's closed forms its played plan has."""
        if self.prefill == PrefillMode.PIPELINED:
            return Formula.PIPELINED
        if self.prefill == PrefillMode.SPLIT:
            return Formula.SPLIT
        if self.schedule is None:
            return Formula.SEQUENTIAL
        return Formula(self.schedule.value)

    @property
    def overlapped(self) -> bool:
        """A joint action under Eq. 9's schedule (whose phases are segments of one timeline, not
        the uncontended costs a profile is fitted from)."""
        return self.schedule == Schedule.OVERLAPPED

    @property
    def overlaps_transfer(self) -> bool:
        """The decode side computes its suffix while a message is still in flight (a joint action
        under any schedule but the sequential one)."""
        return self.joint and self.schedule != Schedule.SEQUENTIAL

    @property
    def from_prompt(self) -> bool:
        """Timed from the prompt's arrival: the prefill side's compute is inside the interval."""
        return self.interval == Interval.PROMPT

    @property
    def streams(self) -> bool:
        """The prefill side sends while it computes (split or pipelined), timed from the prompt."""
        return self.prefill != PrefillMode.FULL

    @property
    def streams_layers(self) -> bool:
        """The prefill side streams each prefix layer as it computes it (split)."""
        return self.prefill == PrefillMode.SPLIT

    @property
    def streams_chunks(self) -> bool:
        """The prefill side streams each token chunk as it computes it (pipelined)."""
        return self.prefill == PrefillMode.PIPELINED

    # -- the decode side's compute -------------------------------------------------------------

    @property
    def suffix_chunks(self) -> int:
        """Token chunks the decode side recomputes in (a joint suffix or a full recomputation)."""
        return self.chunks

    @property
    def suffix_waits_for_prefix(self) -> bool:
        """The suffix starts only once the whole prefix has arrived (Eq. 8)."""
        return self.schedule == Schedule.SEQUENTIAL

    @property
    def suffix_waits_for_input(self) -> bool:
        """The suffix phase includes waits for its input (chunks that arrive as they are sent,
        or computed), not only compute: a fidelity figure is then recorded, not judged."""
        return self.chunks > 1

    @property
    def reference(self) -> Reference:
        """The single-process computation its cache must equal."""
        if self.chunks == 1:
            return Reference()
        return Reference(self.chunks, split_at_cut=self.prefill == PrefillMode.FULL)

    # -- the plan ------------------------------------------------------------------------------

    def plan(self, seq_len: int, num_layers: int) -> Plan:
        """The handoff as typed steps (`rekv_jax.plan`): what each side computes, every message
        in the order sent, and what each step waits for."""
        if self.action.num_layers != num_layers:
            raise ValueError(f"{self.action} is not for a {num_layers}-layer model")
        return _plan(self, seq_len)

    def messages(self, seq_len: int, num_layers: int) -> list[Message]:
        """Every message of the handoff in the order the prefill side sends it."""
        return self.plan(seq_len, num_layers).messages


@functools.lru_cache(maxsize=1024)  # pure; the serving policy plays every mode it weighs
def _plan(mode: Mode, seq_len: int) -> Plan:
    build = Builder(mode.action, seq_len)
    if mode.prefill == PrefillMode.SPLIT:
        _split(mode, build)
    elif mode.prefill == PrefillMode.PIPELINED:
        _pipelined(mode, build)
    else:
        _full(mode, build)
    return build.plan()


def _full(mode: Mode, build: Builder) -> None:
    """A full prefill (from the prompt: computed first), the prefix quantized at once; the ids
    and first token cross with h_c's first chunk, then its other chunks, then the prefix. The
    suffix runs on each chunk as it lands (sequential: once the prefix is restored too)."""
    action, S = mode.action, build.seq_len
    c, L = action.cut, action.num_layers
    whole, chunks = chunks_of(S, 1), chunks_of(S, mode.chunks)
    ready: tuple[int, ...] = ()
    if mode.from_prompt:
        ready = (build.add(Prefill((0, L), whole[0])),)
    if c and action.bits < 16:
        ready = (build.add(Quantize((0, c), whole[0], ready)),)
    head = (Part.TOKENS, Part.FIRST) + (Part.BOUNDARY,) * mode.joint
    first = Message("boundary", head, chunks[0].tokens if mode.joint else (0, S))
    pieces = [build.add(Receive(first, ready))]
    pieces += [build.add(Receive(Message(f"boundary{k.index}", (Part.BOUNDARY,), k.tokens,
                                         chunk=k.index), ready)) for k in chunks[1:]]
    restored: tuple[int, ...] = ()
    if c:
        restored = (build.prefix(Message("prefix", (Part.PREFIX,), (0, S), (0, c)), ready),)
    if mode.joint:
        waits = restored if mode.schedule == Schedule.SEQUENTIAL else ()
        build.suffixes(c, chunks, pieces, waits)
    elif c == 0:
        build.suffixes(0, whole, pieces)


def _split(mode: Mode, build: Builder) -> None:
    """A split prefill: the ids at once, then layers 0..c-1 one call each, each layer's prefix
    quantized and sent as computed; h_c (transfer-only: the first token) leaves once layer c-1
    is computed, before that layer's payload."""
    action, S = mode.action, build.seq_len
    c, whole = action.cut, chunks_of(S, 1)
    tokens = build.add(Receive(Message("tokens", (Part.TOKENS,), (0, S))))
    done: tuple[int, ...] = ()
    restored, boundary = [], tokens
    for layer in range(c):
        computed = build.add(Prefill((layer, layer + 1), whole[0], done))
        done = (computed,)
        if layer == c - 1:
            part = Part.BOUNDARY if mode.joint else Part.FIRST
            boundary = build.add(Receive(Message("boundary", (part,), (0, S)), done))
        if action.bits < 16:
            done = (build.add(Quantize((layer, layer + 1), whole[0], done)),)
        message = Message(f"layer{layer}", (Part.PREFIX,), (0, S), (layer, layer + 1))
        restored.append(build.prefix(message, done))
    if mode.joint:
        waits = tuple(restored) if mode.schedule == Schedule.SEQUENTIAL else ()
        build.suffixes(c, whole, [boundary], waits)
    elif c == 0:
        build.suffixes(0, whole, [tokens])


def _pipelined(mode: Mode, build: Builder) -> None:
    """A pipelined prefill: the ids at once, then per token chunk its layers 0..c-1 in one call,
    its piece of h_c (transfer-only: the first token, once), its quantized prefix; the suffix
    runs on each piece as it lands, a recomputation on the ids' chunks."""
    action, S = mode.action, build.seq_len
    c, chunks = action.cut, chunks_of(S, mode.chunks)
    tokens = build.add(Receive(Message("tokens", (Part.TOKENS,), (0, S))))
    if c == 0:
        build.suffixes(0, chunks, [tokens] * len(chunks))
        return
    done: tuple[int, ...] = ()
    pieces = []
    for k in chunks:
        done = (build.add(Prefill((0, c), k, done)),)
        if mode.joint:
            name = "boundary" + (str(k.index) if k.index else "")
            message = Message(name, (Part.BOUNDARY,), k.tokens, chunk=k.index)
            pieces.append(build.add(Receive(message, done)))
        elif k.last:
            first = Message("boundary", (Part.FIRST,), (0, S), chunk=k.index)
            build.add(Receive(first, done))
        if action.bits < 16:
            done = (build.add(Quantize((0, c), k, done)),)
        build.prefix(Message(f"prefix{k.index}", (Part.PREFIX,), k.tokens, (0, c), k.index), done)
    if mode.joint:
        build.suffixes(c, chunks, pieces)


def check_timing(interval: str, prefill: str) -> None:
    """ValueError unless a handoff timed from `interval` can run a `prefill` prefill (a split or
    pipelined one streams while it computes, so it is timed from the prompt)."""
    _check_member("interval", interval, Interval)
    _check_member("prefill", prefill, PrefillMode)
    if prefill != PrefillMode.FULL and interval != Interval.PROMPT:
        raise ValueError(f"a {prefill} prefill streams while it computes, so its interval "
                         "starts at the prompt: use interval 'prompt'")


def timed_from_prompt(interval: str) -> bool:
    """Whether a record's interval starts at the prompt (its prefill compute is inside)."""
    _check_member("interval", interval, Interval)
    return interval == Interval.PROMPT


def paper_timing(interval: str, prefill: str) -> bool:
    """Timed as the paper times a handoff: from the ready prefill state, after a full prefill."""
    return not timed_from_prompt(interval) and prefill == PrefillMode.FULL


def run_chunks(schedules: Sequence[str], prefill: str, chunks: int | None) -> int:
    """The token chunks a run of `schedules` under `prefill` uses: `chunks` (None: DEFAULT_CHUNKS)
    where one of them chunks, else 1."""
    _check_member("prefill", prefill, PrefillMode)
    chunked = any(_chunked(Schedule(s), PrefillMode(prefill)) for s in schedules)
    return (chunks or DEFAULT_CHUNKS) if chunked else 1


def run_schedules(asked: Sequence[str] | None, prefill: str) -> tuple[str, ...]:
    """The schedules a run asks for (None: the paper's two); a pipelined prefill runs a joint
    action's suffix chunked, whatever was asked."""
    _check_member("prefill", prefill, PrefillMode)
    if prefill == PrefillMode.PIPELINED:
        return (Schedule.CHUNKED.value,)
    return PAPER_SCHEDULES if asked is None else tuple(asked)


def prefills_for(interval: str) -> tuple[str, ...]:
    """The prefill modes a handoff timed from `interval` can run (the ready interval starts after
    a full prefill)."""
    _check_member("interval", interval, Interval)
    return PREFILL_MODES if interval == Interval.PROMPT else (PrefillMode.FULL.value,)


def _chunked(schedule: Schedule | None, prefill: PrefillMode) -> bool:
    """Whether token chunks apply: the chunked schedule, or a pipelined prefill."""
    return schedule == Schedule.CHUNKED or prefill == PrefillMode.PIPELINED


def check_fallback(fallback: str) -> Fallback:
    """The `Fallback` named `fallback`; ValueError naming the choices."""
    _check_member("fallback", fallback, Fallback)
    return Fallback(fallback)


def _check_member(name: str, value: object, kind: type[enum.StrEnum]) -> None:
    if value not in tuple(m.value for m in kind):
        raise ValueError(f"{name} must be one of {tuple(m.value for m in kind)}, got {value!r}")
