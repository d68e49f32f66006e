"""One request's life as the router sees it: a `Status`, changed only by `move`, which checks
each change against `LEGAL` (the one table of legal transitions) and stamps its time.

The router observes a request's arrival, its `Prefill` sent, its prefill worker's
`PrefillDone`, its first `Token` and its decode worker's `Finished`, and it ends requests itself
(an abort, a deadline, a worker's end). So a request is

    waiting -> prefilling -> prefilled -> sent -> decoding -> length | stop | aborted | error

where `prefilling` is its prompt's wait for the prefill device and its compute there, until
the prefill worker reports it `Prefilled`; `prefilled` spans its wait for decode pages (it may
be prefilled before they are free) and its handoff on the link, until the prefill worker
reports it sent (`PrefillDone`). Its first token may come before either report (the decode
worker's items and the prefill worker's cross different pipes): it moves to `decoding`, and
the reports change no status then. A request whose prefill worker ended before its handoff
completed goes back to `waiting` for another: at once if its decode worker holds nothing of
it, else through `requeuing` until that decode worker's `Finished` for it came back (its pages
free). Every
non-final status can end: aborted (told to, by a client that left) or error (failed).
The transitions' times (the router's run clock) give each stage's queue wait and service time.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from rekv_jax.serving.requests import Assignment, Finished, PrefillDone, ServeRequest


class Status(enum.Enum):
    WAITING = "waiting"  # queued for a pair, first come first served
    PREFILLING = "prefilling"  # its `Prefill` sent: queued on the prefill device or computing
    PREFILLED = "prefilled"  # its prompt computed (`Prefilled`): held for pages or on the link
    SENT = "sent"  # its prefill worker reported its handoff sent (`PrefillDone`)
    DECODING = "decoding"  # its first token came
    REQUEUING = "requeuing"  # its prefill worker ended: its decode worker's `Finished` awaited
    LENGTH = "length"  # ended: every token it was to generate
    STOP = "stop"  # ended: a stop (EOS, a stop string or id)
    ABORTED = "aborted"  # ended: told to (`Router.abort`), not a failure
    ERROR = "error"  # ended: failed (a worker's error or end, its deadline, no worker left)


ENDS = frozenset({Status.LENGTH, Status.STOP, Status.ABORTED, Status.ERROR})
HANDING_OFF = frozenset({Status.PREFILLING, Status.PREFILLED})  # on the prefill side
_ENDED_EARLY = frozenset({Status.ABORTED, Status.ERROR})

LEGAL: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.PREFILLING}) | _ENDED_EARLY,
    Status.PREFILLING: frozenset({Status.PREFILLED, Status.SENT, Status.DECODING,
                                  Status.REQUEUING, Status.WAITING}) | _ENDED_EARLY,
    Status.PREFILLED: frozenset({Status.SENT, Status.DECODING, Status.REQUEUING,
                                 Status.WAITING}) | _ENDED_EARLY,
    Status.SENT: frozenset({Status.DECODING}) | _ENDED_EARLY,
    Status.DECODING: ENDS,
    Status.REQUEUING: frozenset({Status.WAITING}) | _ENDED_EARLY,
    **{end: frozenset() for end in ENDS},
}


@dataclasses.dataclass(frozen=True)
class Transition:
    """A request entered `status` at `t_s` (the router's run clock)."""

    status: Status
    t_s: float

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "t_s": self.t_s}


def move(lifecycle: list[Transition], to: Status, now_s: float) -> None:
    """Append the transition to `to` at `now_s`; ValueError naming both states if `LEGAL`
    does not allow it."""
    at = lifecycle[-1].status
    if to not in LEGAL[at]:
        raise ValueError(f"a request cannot go from {at.value} to {to.value}")
    lifecycle.append(Transition(to, now_s))


@dataclasses.dataclass(eq=False)
class OpenRequest:
    """A request the router holds: arrived, not yet ended."""

    request: ServeRequest
    pages: int  # what it takes of a decode worker's pool (its prompt and its new tokens)
    order: int  # its place in arrival order (first come first served, after a requeue too)
    lifecycle: list[Transition]  # arrival first
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # router's clock
    assignment: Assignment | None = None  # while assigned
    admitted: bool = False  # its `Admit` sent, its decode worker's `Finished` not yet back
    prefill_done: PrefillDone | None = None  # its prefill worker's report, once it came
    # its decode worker's failure before its handoff completed, held until its prefill worker
    # reports (it failed) or ends (it goes again)
    finished: Finished | None = None
    suffix_beside: bool = False  # a prompt was computing when its own was done (its suffix beside)

    @property
    def status(self) -> Status:
        return self.lifecycle[-1].status

    def move(self, to: Status, now_s: float) -> None:
        move(self.lifecycle, to, now_s)

    def entered_s(self, status: Status) -> float | None:
        return entered_s(self.lifecycle, status)


def entered_s(lifecycle: Sequence[Transition], status: Status) -> float | None:
    """When a request last entered `status` (the router's run clock; None: never)."""
    return next((t.t_s for t in reversed(lifecycle) if t.status == status), None)


def ending(finished: Finished) -> Status:
    """The status a decode worker's `Finished` ends a request in."""
    if finished.error:
        return Status.ERROR
    return {"length": Status.LENGTH, "stop": Status.STOP,
            "abort": Status.ABORTED}.get(finished.finish_reason, Status.ERROR)
