"""The cost model's prediction of a handoff: its plan (`Mode.plan`) played against a profile.

Each step takes the profile's time for what it does (ms; `T` of a step's token chunk of `S`
tokens is its share `T / S` of the per-prompt terms; `γ_i` the chunk's per-layer cost,
`Profile.chunk_layer`):

    Prefill   layers n on chunk i         [embeds] E T/S + r0 + n γ_i   on the prefill device
    Quantize  layers n on chunk i         q0 + n α_b T/S                on the prefill device
    Receive   one message                 h0 (the first) or m, + bytes / W   on the link
    Restore   prefix layers n             x0_b + n restore_b T/S        on the link
    Suffix    layers n on chunk i         [embeds] E T/S + r0 + n γ_i   on the decode device
    Join                                  J of the action's kind

A message's bytes are the ids (`B_tok`), its share of h_c (`B_H T/S`) and of its prefix layers
(`n B_KV,b T/S`); the first token's are not counted. The profile's `X_b(c)` counts a prefix's
restore with its transfer (`β_b = B_KV,b / W + restore_b`), so a restore holds the link as the
closed forms have it. Each device runs its steps one at a time in the plan's order: a step starts
once the steps it needs are done and its device is free, and the predicted total is when the join
ends (the plan's critical path). Among other requests (`Contention`) the link is free only from
`link_free_ms` (at `link_gbps`, the link's live estimate, where given), the decode device from
`decode_free_ms`, a suffix runs `stretch` times its own cost and a prefill-side step
`prefill_stretch` times. With equal chunks (and a prefill stretch of 1) the closed forms of
`costmodel` are special cases of this (tested).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from fractions import Fraction

from rekv_jax.plan import (
    Join,
    Message,
    Part,
    Plan,
    Prefill,
    Quantize,
    Receive,
    Restore,
    Step,
    Suffix,
)
from rekv_jax.planning.profile import Profile, transfer_ms


@dataclasses.dataclass(frozen=True)
class Contention:
    """Other requests' work on the two resources a handoff shares when it is served among
    others, as its plan sees them (ms after its interval starts): nothing of this handoff
    crosses the link before `link_free_ms`, and its decode-side compute (suffix or
    recomputation) starts no earlier than `decode_free_ms` and runs `stretch` times its own
    cost, interleaved with the decode steps of the requests already running
    (`queueing.DecodeCosts.stretch`) and as the device has lately run against its price. Its
    prefill-side compute runs `prefill_stretch` times the profile's cost: what the prefill
    device has lately taken per ms of the profile's price (`serving.ledger.ComputeEstimate`).
    Either is below 1 where a device computes faster than it was profiled. The default, an
    idle link and device, gives the paper's formulas exactly (its values are ints, so exact
    rationals stay exact)."""

    link_free_ms: float = 0
    decode_free_ms: float = 0
    stretch: float = 1
    prefill_stretch: float = 1
    link_gbps: float | None = None  # the link's bandwidth as lately measured; None: the profile's

    def __post_init__(self) -> None:
        if not (self.link_free_ms >= 0 and self.decode_free_ms >= 0 and self.stretch > 0
                and self.prefill_stretch > 0
                and (self.link_gbps is None or self.link_gbps > 0)):
            raise ValueError(f"contention needs free times >= 0 and positive stretches and "
                             f"bandwidth, got {self}")

    def after(self, ms: float) -> Contention:
        """The same contention seen from `ms` later (what is left of each wait)."""
        return dataclasses.replace(self, link_free_ms=max(0, self.link_free_ms - ms),
                                   decode_free_ms=max(0, self.decode_free_ms - ms))


IDLE = Contention()


@dataclasses.dataclass(frozen=True)
class Ends:
    """When the parts of one handoff end, ms after its interval starts."""

    end_ms: float  # the complete cache and the first token: the predicted total
    link_ms: float  # its last message has crossed the link (and been restored)

    def shifted(self, ms: float) -> Ends:
        """The same ends in a frame that starts `ms` earlier."""
        return Ends(ms + self.end_ms, ms + self.link_ms)


class Device(enum.StrEnum):
    """What a played step occupies."""

    PREFILL = "prefill"
    LINK = "link"
    DECODE = "decode"


DEVICES = {Prefill: Device.PREFILL, Quantize: Device.PREFILL, Receive: Device.LINK,
           Restore: Device.LINK, Suffix: Device.DECODE}  # a join occupies none


def play(plan: Plan, profile: Profile, contention: Contention = IDLE) -> Ends:
    """When the handoff of `plan` ends under `profile`, timed from its interval, on a link and
    decode device that `contention` shares with other requests."""
    free = {Device.PREFILL: 0, Device.LINK: contention.link_free_ms,
            Device.DECODE: contention.decode_free_ms}
    stretch = {Device.PREFILL: contention.prefill_stretch, Device.LINK: 1,
               Device.DECODE: contention.stretch}
    gbps = profile.link_gbps if contention.link_gbps is None else contention.link_gbps
    ends: list[float] = []
    link = 0
    for after, own, nbytes, device in _costs(plan, _Same(profile)):
        cost = own if nbytes is None else own + transfer_ms(nbytes, gbps)
        begin = max(map(ends.__getitem__, after), default=0)
        if device is None:
            ends.append(begin + cost)
            continue
        end = max(begin, free[device]) + cost * stretch[device]
        free[device] = end
        ends.append(end)
        if device == Device.LINK:
            link = end
    return Ends(ends[-1], link)


def busy_ms(plan: Plan, profile: Profile, device: Device) -> float:
    """How long the handoff of `plan` occupies `device`, alone (its steps' summed costs)."""
    return sum(own if nbytes is None else own + transfer_ms(nbytes, profile.link_gbps)
               for _, own, nbytes, on in _costs(plan, _Same(profile)) if on == device)


class _Same:
    """A profile as a cache key, by identity (a profile holds dicts, so it has no hash)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def __hash__(self) -> int:
        return id(self.profile)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.profile is self.profile


@functools.lru_cache(maxsize=4096)  # a policy plays the same plans under one profile per request
def _costs(plan: Plan, profile: _Same
           ) -> tuple[tuple[tuple[int, ...], float, float | None, Device | None], ...]:
    """Each step's predecessors, its own cost less its transfer, the bytes it moves over the
    link (None: a step that moves none), and the device it occupies (None: the join). The
    link's bandwidth is left to `play`: a policy plays one profile's plans on each link's live
    estimate."""
    first = next(i for i, s in enumerate(plan.steps) if isinstance(s, Receive))
    return tuple((s.after, *_own_ms(plan, profile.profile, s, i == first), DEVICES.get(type(s)))
                 for i, s in enumerate(plan.steps))


def step_ms(plan: Plan, profile: Profile, step: Step, first: bool = False) -> float:
    """One step's own cost under `profile` (the module docstring's table); `first`: the plan's
    first message (its fixed cost is `h0`, which also holds the handoff's start)."""
    own, nbytes = _own_ms(plan, profile, step, first)
    return own if nbytes is None else own + transfer_ms(nbytes, profile.link_gbps)


def _own_ms(plan: Plan, profile: Profile, step: Step, first: bool) -> tuple[float, float | None]:
    """`step_ms` less a message's transfer, and the message's bytes (None: not a message)."""
    p, action, S = profile, plan.action, plan.seq_len
    if isinstance(step, Join):
        return p.join_ms[action.kind], None
    if isinstance(step, Receive):
        return (p.boundary_fixed_ms if first else p.message_ms), _bytes(plan, p, step.message)
    if isinstance(step, Restore):
        m = step.message
        restore = _span(m.layers) * p.restore_ms[action.bits]
        return p.restore_fixed_ms[action.bits] + _share(restore, m.tokens, S), None
    layers, tokens = _span(step.layers), step.chunk.tokens
    if isinstance(step, Quantize):
        return p.quantize_fixed_ms + _share(layers * p.quantize_ms[action.bits], tokens, S), None
    embed = _share(p.embed_ms, tokens, S) if step.layers[0] == 0 else 0
    if step.chunk.of == 1:
        return embed + p.suffix_fixed_ms + layers * p.suffix_layer_ms, None
    return embed + p.suffix_fixed_ms + layers * p.chunk_layer(step.chunk.index, step.chunk.of), None


def _bytes(plan: Plan, p: Profile, m: Message) -> float:
    """A message's bytes: the ids, its share of h_c and of its prefix layers."""
    out = 0
    if Part.TOKENS in m.parts:
        out += p.token_bytes
    if Part.BOUNDARY in m.parts:
        out += _share(p.boundary_bytes, m.tokens, plan.seq_len)
    if Part.PREFIX in m.parts:
        layer = p.prefix_layer_bytes(plan.action.bits, plan.action.format)
        out += _share(_span(m.layers) * layer, m.tokens, plan.seq_len)
    return out


def _share(x: float, tokens: tuple[int, int], seq_len: int) -> float:
    """x's share for a token range: x T / S (exact for an exact x: an int or a Fraction)."""
    n = tokens[1] - tokens[0]
    if n == seq_len:
        return x
    return Fraction(x * n, seq_len) if isinstance(x, int) else x * n / seq_len


def _span(span: tuple[int, int]) -> int:
    return span[1] - span[0]
