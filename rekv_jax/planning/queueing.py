"""The cost model of a handoff served among other requests: the wait at each shared resource and
the stretch of a suffix interleaved with running decodes.

A served request shares three resources with the requests before it: the prefill worker's device
(first come, first served), the link (FIFO) and the decode worker's device. `Queues` says when
each has finished the work already assigned to it, in ms after the request arrives, and how many
requests the decode worker is running (B). Then, for a handoff run as `mode` (timed from its
prompt, `costmodel.handoff_ends`):

    W_p = when the prefill device is free: the prompt waits that long
    O   = what a split or pipelined prompt then holds it before its interval starts (0 else)
    TTFT = W_p + O + T(mode | link free at max(0, L - W_p - O),
                              decode device free at max(0, D - W_p - O), k) + E

where `T` is the mode's formula with its link messages held until the link is free and its
decode-side compute started no earlier than the device is free (`costmodel.Contention`). The
decode worker runs a suffix in chunks of at most `u` ms of compute per iteration, each beside one
batched decode step of the B running requests, `d(B) = d0 + B d1` (Sarathi-style interleaving),
so a suffix of R ms alone takes `k R` with the stretch

    k = 1 + d(B) / u   (B >= 1; k = 1 on an idle worker).

`E` is by how much the decode worker's first tokens have lately come after their link's end
later than `T` priced, for handoffs of the same kind (streamed or not), prompt octave and load
(decodes running or not; `Queues.tail_ms`, `streamed_tail_ms`; the first token never before
the link's end): the decode side's work after the last message runs beside the engine's
iteration and the other side's compute, which the profile, measured alone, does not price.
A streamed prompt (split or pipelined) prefilled ahead of its pages waits at the head of its
worker's queue until its decode side admits it (one sent with its `Admit` computes at once), and
its messages leave on the worker's thread between its steps: `O` is
what such prompts have lately held their worker beyond their compute
(`Queues.streamed_overhead_ms`). A full prefill computes before its admission, so its own wait
for pages is the link's and the decode worker's queue. The prefill device's steps run
`Queues.prefill_stretch` times the profile's cost
(`pipelined_stretch` or `split_stretch` for a pipelined or split prefill, whose handoff crosses
as it computes: one program per token chunk or per layer, each apart from its price its own way),
and the decode device's `Queues.decode_stretch` times `k R`: what each device has lately
taken against its price (`serving.ledger.ComputeEstimate`; on a host whose devices share
memory and power, each computes slower while the other side computes too).

What a choice costs the requests after it is in `ServedPrediction.after`: the prefill device is
busy for O and the mode's prompt compute and quantize calls (`costmodel.prefill_busy_ms`,
stretched: a split or pipelined prefill stops at the cut), the link until its last message has
crossed (FIFO: the next request's messages follow), and the decode device for its suffix's
stretched compute (a backlog of work, not a reservation: the device runs whatever suffix has
arrived, so a suffix waiting for its boundary holds nothing up). Each ms a choice adds to a
resource's busy time delays every request that arrives before that resource drains: at the
recent arrival rate λ, about `λ F_r` of them, where `F_r` is when it drains after this
request. The delay it imposes is

    I = Σ_r Δ_r λ F_r        (Δ_r: how much later resource r is free because of it)

A choice also slows the requests already decoding on its decode worker: every ms of its suffix
compute runs inside an iteration beside their step, so each of the B running requests gets its
later tokens that much later. The delay it imposes on them, summed, is

    J = B R                  (R: its decode-side compute, unstretched)

and a policy that weighs both (`ServedPrediction.cost_ms = TTFT + I + J`) moves work off
whichever resource has a queue: as the link's queue grows, toward fewer bytes; as the decode
worker's grows, or as more requests decode there, toward less recomputation. With no queues, no
running decodes and a light load, I and J are 0 and the fastest handoff wins.

J weighs those delays against TTFT, summed; it does not bound what one request's TPOT takes. A
request that decodes for n tokens beside suffix work of S ms in all has its TPOT stretched by
`S / (n - 1)`, whoever chose that work. A policy with a TPOT stretch f bounds each request's
TPOT at f times its step's price alone, `f d(1)`: the batch it decodes in takes its share of
that first, so a request with B others decoding beside it once its first token comes has a
slack of `(n - 1) max(0, f d(1) - d(B + 1))` (`tpot_slack_ms`) for suffix compute. Every
suffix chosen on its decode worker before its decode ends spends R of it, and a mode whose R
exceeds the least slack left among the requests still decoding when its suffix starts
(`ServedPrediction.tpot_room_ms`) is chosen only where no mode fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rekv_jax.mode import Mode, PrefillMode
from rekv_jax.planning.costmodel import (
    Contention,
    Profile,
    decode_busy_ms,
    handoff_ends,
    prefill_busy_ms,
)

TPOT_STRETCH = 1.25  # a policy's default f: a request's TPOT over its step's price alone, at most


@dataclasses.dataclass(frozen=True)
class DecodeCosts:
    """What one iteration of a decode worker costs: a batched decode step of B running requests
    takes `step_fixed_ms + B * step_per_request_ms`, and beside it the iteration runs at most
    `suffix_budget_ms` of admitted suffix compute."""

    step_fixed_ms: float  # d0: the part of a step every batch size pays
    step_per_request_ms: float  # d1: what each running request adds
    suffix_budget_ms: float  # u: suffix compute per iteration

    def __post_init__(self) -> None:
        if self.step_fixed_ms < 0 or self.step_per_request_ms < 0 or not self.suffix_budget_ms > 0:
            raise ValueError(f"decode costs need step costs >= 0 and a positive suffix budget, "
                             f"got {self}")

    def step_ms(self, running: int) -> float:
        """d(B): one batched decode step of `running` requests (0: no step)."""
        return self.step_fixed_ms + running * self.step_per_request_ms if running else 0

    def stretch(self, running: int) -> float:
        """k: wall time per ms of suffix compute beside `running` decoding requests."""
        return 1 + self.step_ms(running) / self.suffix_budget_ms


@dataclasses.dataclass(frozen=True)
class Queues:
    """When each shared resource has finished the work assigned before a request, ms after its
    arrival (0: free now), the requests running on its decode worker, and how fast each
    resource has lately run."""

    prefill_free_ms: float = 0
    link_free_ms: float = 0
    decode_free_ms: float = 0
    running: int = 0
    arrival_rate: float = 0  # λ: requests per second arriving lately (0: unknown)
    prefill_stretch: float = 1  # the prefill device's compute per ms of the profile's, lately
    decode_stretch: float = 1  # the decode device's suffix time per ms of its price, lately
    pipelined_stretch: float = 1  # prefill_stretch of a pipelined prompt
    split_stretch: float = 1  # ... of a split prompt
    link_gbps: float | None = None  # the link's bandwidth as lately measured; None: the profile's
    streamed_overhead_ms: float = 0  # O: a streamed prompt's hold on its worker beyond compute
    tail_ms: float = 0  # the first token's lag after the link beyond its price, lately
    streamed_tail_ms: float = 0  # ... of a streamed prompt's handoff
    # (slack ms, ms until its decode ends; inf: not yet known) of each request on the decode
    # worker: the suffix compute it can still take beside its decode (`tpot_slack_ms`, less what
    # was chosen beside it since)
    tpot_slack: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if min(self.prefill_free_ms, self.link_free_ms, self.decode_free_ms, self.running,
               self.arrival_rate, self.streamed_overhead_ms) < 0 or min(
                   self.prefill_stretch, self.decode_stretch, self.pipelined_stretch,
                   self.split_stretch, self.link_gbps or 1) <= 0:
            raise ValueError(f"queues cannot be negative, got {self}")


@dataclasses.dataclass(frozen=True)
class ServedPrediction:
    """The predicted time to first token of one request handed off as a mode among others, and
    its parts (ms): why a policy chose what it chose."""

    ttft_ms: float  # arrival to first token: prefill_wait_ms + overhead_ms + handoff_ms + tail_ms
    prefill_wait_ms: float  # W_p: the prompt waits for the prefill device
    handoff_ms: float  # the handoff from its prompt's start, under the contention
    idle_ms: float | None  # the same handoff on an idle link and decode device (the paper's
    # model; None where it was not asked for)
    link_wait_ms: float  # what is left of the link's queue when its interval starts
    decode_wait_ms: float  # ... and of the decode device's
    stretch: float  # k: its decode-side compute beside the running decodes (and as lately timed)
    prefill_busy_ms: float  # the prefill device time it takes (stretched, and O)
    decode_busy_ms: float  # the decode device compute it adds, unstretched
    after: Queues  # the queues a request arriving at the same moment would find after it
    imposed_ms: float  # I: the delay it is expected to impose on the requests after it
    decode_delay_ms: float = 0.0  # J: the delay it imposes on the running decodes, summed
    prefill_stretch: float = 1.0  # its prefill device time per ms of the profile's price
    decode_stretch: float = 1.0  # of `stretch`, the decode device's lately measured share
    overhead_ms: float = 0.0  # O: a streamed prompt's hold on its worker before its interval
    tail_ms: float = 0.0  # the lately measured lag added after its handoff's end (>= its link's)
    tpot_room_ms: float | None = None  # the least slack of the requests decoding once its
    # suffix starts (`Queues.tpot_slack`; None: none bounds it)

    @property
    def suffix_from_ms(self) -> float:
        """When its decode-side compute starts at the latest (its stretched compute ends by its
        handoff's end), no sooner than its prompt's turn."""
        return max(self.prefill_wait_ms,
                   self.ttft_ms - self.tail_ms - self.decode_busy_ms * self.stretch)

    @property
    def prefill_priced_ms(self) -> float:
        """Its prompt compute at the profile's price: its prefill device time less O,
        unstretched."""
        return (self.prefill_busy_ms - self.overhead_ms) / self.prefill_stretch

    @property
    def cost_ms(self) -> float:
        """What a policy minimizes: its own TTFT and the delays it imposes on others, those
        arriving after it (I) and those decoding beside its suffix (J)."""
        return self.ttft_ms + self.imposed_ms + self.decode_delay_ms

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        after = {k: v for k, v in dataclasses.asdict(self.after).items() if k != "tpot_slack"}
        return d | {"after": after, "cost_ms": self.cost_ms}


def served(profile: Profile, mode: Mode, queues: Queues, decode: DecodeCosts, idle: bool = True
           ) -> ServedPrediction:
    """The prediction of the module docstring for a request handed off as `mode` (timed from its
    prompt) that finds `queues`; `idle`: with the paper's, on an idle link and decode device (a
    second play of its plan, which a policy weighing many modes asks for only its choice's)."""
    if not mode.from_prompt:
        raise ValueError(f"a served request is timed from its prompt's arrival; {mode} is timed "
                         "from the ready prefill state")
    k = decode.stretch(queues.running) * queues.decode_stretch
    f = {PrefillMode.FULL: queues.prefill_stretch, PrefillMode.SPLIT: queues.split_stretch,
         PrefillMode.PIPELINED: queues.pipelined_stretch}[mode.prefill]
    o = queues.streamed_overhead_ms if mode.streams else 0
    wait, start = queues.prefill_free_ms, queues.prefill_free_ms + o
    seen = Contention(max(0, queues.link_free_ms - start), max(0, queues.decode_free_ms - start),
                      k, f, queues.link_gbps)
    ends = handoff_ends(profile, mode, seen)
    tail = max(queues.streamed_tail_ms if mode.streams else queues.tail_ms,
               ends.link_ms - ends.end_ms)  # no first token before its cache has crossed
    busy = prefill_busy_ms(profile, mode) * f + o
    decode_busy = decode_busy_ms(profile, mode)
    after = dataclasses.replace(queues, prefill_free_ms=wait + busy,
                                link_free_ms=max(queues.link_free_ms, start + ends.link_ms),
                                decode_free_ms=queues.decode_free_ms + decode_busy * k)
    suffix_from = max(wait, start + ends.end_ms - decode_busy * k)  # `suffix_from_ms`
    return ServedPrediction(
        ttft_ms=start + ends.end_ms + tail, prefill_wait_ms=wait, handoff_ms=ends.end_ms,
        idle_ms=handoff_ends(profile, mode, Contention(link_gbps=queues.link_gbps)).end_ms
        if idle else None,
        link_wait_ms=seen.link_free_ms,
        decode_wait_ms=seen.decode_free_ms, stretch=k, prefill_busy_ms=busy,
        decode_busy_ms=decode_busy, after=after, imposed_ms=imposed_ms(queues, after),
        decode_delay_ms=queues.running * decode_busy, prefill_stretch=f,
        decode_stretch=queues.decode_stretch, overhead_ms=o, tail_ms=tail,
        tpot_room_ms=min((ms for ms, ends_ms in queues.tpot_slack if ends_ms > suffix_from),
                         default=None))


def tpot_slack_ms(decode: DecodeCosts, beside: int, new_tokens: int, tpot_stretch: float
                  ) -> float:
    """What suffix compute (ms, at its price) may run beside the decode of a request of
    `new_tokens` tokens with `beside` others decoding beside it, if its TPOT is to stay within
    `tpot_stretch` times its step's price alone, `d(1)`: its steps of `d(beside + 1)` take
    their part of that bound first, and every ms of suffix compute on its decode worker while it
    decodes delays its later tokens by that ms, so over its `new_tokens - 1` steps the delays
    may add up to what is left (none, where its batch alone exceeds the bound)."""
    check_tpot_stretch(tpot_stretch)
    per_step = tpot_stretch * decode.step_ms(1) - decode.step_ms(beside + 1)
    return max(0.0, per_step) * max(0, new_tokens - 1)


def check_tpot_stretch(tpot_stretch: float) -> None:
    """A ValueError unless `tpot_stretch` is a finite factor of at least 1."""
    if not 1 <= tpot_stretch < float("inf"):
        raise ValueError(f"a TPOT stretch is at least 1 and finite, got {tpot_stretch}")


def imposed_ms(before: Queues, after: Queues) -> float:
    """I = Σ_r Δ_r λ F_r over the prefill device, the link and the decode device (module
    docstring), from the queues before and after a request."""
    pairs = ((before.prefill_free_ms, after.prefill_free_ms),
             (before.link_free_ms, after.link_free_ms),
             (before.decode_free_ms, after.decode_free_ms))
    return sum(max(0, f - b) * after.arrival_rate * f / 1e3 for b, f in pairs)
