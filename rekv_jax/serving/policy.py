"""How each request is handed off, and by which workers: the serving policies.

A policy weighs modes (`Mode`, timed from the prompt) on every (prefill, decode) worker pair and
picks the one of least predicted cost under the load the `Ledger` shows: its time to first
token, given the prefill worker's queue, the link's queue at its live bandwidth estimate, and
the decode worker's admitted suffix work and running batch, plus the delays it imposes on the
requests arriving after it and on those decoding beside its suffix, whose tokens its suffix
compute holds back (`planning.queueing.served`, `ServedPrediction.cost_ms`), among the modes whose
suffix compute fits what the requests on its decode worker can still take beside their decodes
(`Context.tpot_stretch`, `queueing.tpot_slack_ms`). They differ in the modes they weigh:

- a fixed action `PREC:CUT` (e.g. `bf16:full`, which is what vLLM and SGLang do; `q8:full`;
  `bf16:recompute`): that action after a full prefill, overlapped (the paper's setting);
- `PREC:balanced`: the paper's balanced joint cut at that precision (Proposition 2 under the
  profile of the request's length, the better of its adjacent cuts), the same way;
- `asked` (`Asked`, not a `--policy`): each request's own mode, as its caller asked; tests, soaks
  and the doctor run the actions they choose through the router this way;
- `adaptive`: every action of the precisions it is given, each under the overlapped and chunked
  schedules after a full, split or pipelined prefill, among the actions the quality gate allows.
  A split or pipelined prefill stops at the cut, so a cut moves prompt compute from the prefill
  worker to the decode worker; the queues decide whether that pays.

Quality: a BF16 action's cache equals the single-process prefill's bit for bit, so it is
lossless; a Q8/Q4 action is allowed under a gate (`--quality FILE`) only where the gate judged
it eligible at the request's length (`planner.standing`), and without a gate it is unchecked
(`Policy.unchecked` names them). A fixed policy runs its action whatever the gate says and
records its standing.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence

from rekv_jax.action import Action, action_space
from rekv_jax.gate_result import GateResult
from rekv_jax.mode import DEFAULT_SCHEDULE, OVERLAPPING, PREFILL_MODES, Interval, Mode, PrefillMode
from rekv_jax.planning.costmodel import Profile, predicted_ms
from rekv_jax.planning.planner import gate_verdicts, standing
from rekv_jax.planning.queueing import (
    TPOT_STRETCH,
    DecodeCosts,
    check_tpot_stretch,
    served,
    tpot_slack_ms,
)
from rekv_jax.serving.ledger import Ledger
from rekv_jax.serving.requests import Assignment, ServeRequest, Weighed, Why

ADAPTIVE = "adaptive"
ASKED = "asked"  # `Asked`: each request's mode as its caller asked
BALANCED = "balanced"  # the cut of `PREC:balanced`
ADAPTIVE_BITS = (16, 8)  # the precisions `adaptive` weighs unless told
ADAPTIVE_CHUNKS = (2, 4)  # the token chunks it weighs for the chunked schedule and prefill
ADAPTIVE_SCHEDULES = OVERLAPPING  # the schedules it weighs
LOSSLESS = "lossless"  # a BF16 action's standing: nothing for a gate to judge
ALLOWED = (LOSSLESS, "eligible")  # the standings adaptive may choose under a gate


@dataclasses.dataclass(frozen=True)
class Context:
    """What every policy of a run predicts with: the model, its profiles (one per measured prompt
    length; other lengths scale the nearest, `Profile.at_length`), the decode worker's iteration
    costs, and the quality gate's results (None: no gate)."""

    model: str  # the config's name (gate results are per model)
    num_layers: int
    profiles: tuple[Profile, ...]
    decode: DecodeCosts
    gate: tuple[GateResult, ...] | None = None
    adaptive_bits: tuple[int, ...] = ADAPTIVE_BITS
    adaptive_chunks: tuple[int, ...] = ADAPTIVE_CHUNKS
    runners_up: int = 3  # modes recorded beside each choice
    tpot_stretch: float | None = TPOT_STRETCH  # None: no bound on a TPOT's stretch

    def __post_init__(self) -> None:
        if self.tpot_stretch is not None:
            check_tpot_stretch(self.tpot_stretch)
        if not self.profiles:
            raise ValueError("a policy needs at least one profile")
        other = sorted({(p.model, p.num_layers) for p in self.profiles}
                       - {(self.model, self.num_layers)})
        if other:
            raise ValueError(f"profiles of {other} cannot predict {self.model} "
                             f"({self.num_layers} layers)")
        missing = sorted(set(self.adaptive_bits) - set.intersection(
            *(set(p.quantize_ms) for p in self.profiles)))
        if missing:
            raise ValueError(f"the profiles hold no costs for "
                             f"{', '.join(map(str, missing))}-bit prefixes")

    def profile(self, seq_len: int) -> Profile:
        """The profile of `seq_len`: the one measured at it, else the nearest length's, scaled."""
        nearest = min(self.profiles, key=lambda p: (abs(math.log(p.seq_len / seq_len)),
                                                   p.seq_len))
        return nearest.at_length(seq_len)

    def quality(self, action: Action, chunks: int, seq_len: int) -> str:
        """An action's standing at the gate for a prompt of `seq_len` tokens."""
        if action.bits == 16:
            return LOSSLESS
        if self.gate is None:
            return "unchecked"
        return standing(gate_verdicts(self.gate, self.model, seq_len), action, chunks)[0]


class Policy(abc.ABC):
    """Chooses each request's mode and workers: the fastest of `modes(seq_len)` on the
    ledger's pairs. A policy keeps what depends only on the prompt length (its modes, its
    profile) from one request to the next."""

    def __init__(self, name: str, context: Context):
        self.name, self.context = name, context
        self._modes: dict[int, tuple[Mode, ...]] = {}
        self._profiles: dict[int, Profile] = {}

    def modes(self, seq_len: int) -> tuple[Mode, ...]:
        """The modes it weighs for a prompt of `seq_len` tokens (at least one)."""
        if seq_len not in self._modes:
            self._modes[seq_len] = self._weighed(seq_len)
        return self._modes[seq_len]

    @abc.abstractmethod
    def _weighed(self, seq_len: int) -> tuple[Mode, ...]:
        """The modes this policy weighs at `seq_len` (computed once per length)."""

    def profile(self, seq_len: int) -> Profile:
        if seq_len not in self._profiles:
            self._profiles[seq_len] = self.context.profile(seq_len)
        return self._profiles[seq_len]

    def unchecked(self, seq_len: int) -> list[str]:
        """The actions it may run at `seq_len` that no gate has judged."""
        return sorted({str(m.action) for m in self.modes(seq_len)
                       if self.context.quality(m.action, m.chunks, seq_len) == "unchecked"})

    def choose(self, request: ServeRequest, ledger: Ledger, now_s: float,
               pairs: Sequence[tuple[int, int]] | None = None) -> Assignment:
        """The (mode, prefill worker, decode worker) of least predicted cost for `request`,
        arriving at `now_s` (the ledger has noted its arrival), with why; among `pairs` of
        workers (default: all the ledger's). A mode whose suffix compute exceeds what its decode
        worker's requests can still take (`ServedPrediction.tpot_room_ms`) is chosen only where
        none fits."""
        ctx, n = self.context, request.prompt_len
        weighed = []
        profile = self.profile(n)  # played on each link's live estimate (`Queues.link_gbps`)
        for p, d in ledger.pairs() if pairs is None else pairs:
            queues = ledger.queues(p, d, now_s, n)
            for i, mode in enumerate(self._modes_for(request)):
                w = served(profile, mode, queues, ctx.decode, idle=False)
                over = w.tpot_room_ms is not None and w.decode_busy_ms > max(0, w.tpot_room_ms)
                weighed.append((over, w.cost_ms, i, w, mode, p, d))
        weighed.sort(key=lambda w: w[:3])  # ties: the earlier mode
        *_, mode, p, d = weighed[0]
        queues = ledger.queues(p, d, now_s, n)
        pred = served(profile, mode, queues, ctx.decode)
        others = [Weighed(m.label, w.ttft_ms, w.cost_ms, wp, wd)
                  for *_, w, m, wp, wd in weighed[1:ctx.runners_up + 1]]
        # those assigned to its decode worker before it (`Queues.tpot_slack`) whose decode has
        # not ended by its first token decode beside it
        beside = sum(ends_ms > pred.ttft_ms for _, ends_ms in queues.tpot_slack)
        slack = None if ctx.tpot_stretch is None else tpot_slack_ms(
            ctx.decode, beside, request.max_new_tokens, ctx.tpot_stretch)
        why = Why(self.name, pred, queues.link_gbps, ctx.quality(mode.action, mode.chunks, n),
                  tuple(others), slack)
        return Assignment(request.id, mode, p, d, why)

    def _modes_for(self, request: ServeRequest) -> tuple[Mode, ...]:
        return self.modes(request.prompt_len)


class Fixed(Policy):
    """One action, after a full prefill, overlapped where it is joint."""

    def __init__(self, name: str, context: Context):
        super().__init__(name, context)
        self.action = Action.parse(name, context.num_layers)

    def _weighed(self, seq_len: int) -> tuple[Mode, ...]:
        return (served_mode(self.action),)


class Balanced(Policy):
    """Proposition 2's cut at one precision for each prompt length, run as `Fixed` runs."""

    def __init__(self, name: str, context: Context, bits: int):
        super().__init__(name, context)
        self.bits = bits

    def _weighed(self, seq_len: int) -> tuple[Mode, ...]:
        profile, L = self.profile(seq_len), self.context.num_layers
        _, cuts = profile.balanced_cut(self.bits)
        modes = [served_mode(Action(self.bits, c, L)) for c in cuts]
        return (min(modes, key=lambda m: predicted_ms(profile, m)),)


class Adaptive(Policy):
    """Every allowed action of the context's precisions, under each schedule and prefill."""

    def _weighed(self, seq_len: int) -> tuple[Mode, ...]:
        ctx = self.context
        chunks = [n for n in ctx.adaptive_chunks if n <= seq_len]
        modes = []
        for action in dict.fromkeys(a for b in ctx.adaptive_bits
                                    for a in action_space(ctx.num_layers, (b,))):
            for mode in Mode.candidates(action, ADAPTIVE_SCHEDULES, PREFILL_MODES, chunks,
                                        Interval.PROMPT):
                quality = ctx.quality(action, mode.chunks, seq_len)
                if ctx.gate is None or quality in ALLOWED:
                    modes.append(mode)
        if not modes:
            raise ValueError(f"adaptive: the gate allows no action for {ctx.model} at "
                             f"{seq_len} tokens")
        return tuple(modes)


class Asked(Policy):
    """Each request's own mode (`modes[request id]`), on the pair of least predicted cost, or
    on the pair `pairs[request id]` where one is asked."""

    def __init__(self, context: Context, modes: Mapping[int, Mode],
                 pairs: Mapping[int, tuple[int, int]] | None = None):
        super().__init__(ASKED, context)
        self._asked, self._pairs = dict(modes), dict(pairs or {})

    def choose(self, request: ServeRequest, ledger: Ledger, now_s: float,
               pairs: Sequence[tuple[int, int]] | None = None) -> Assignment:
        """`Policy.choose` on the request's asked pair, if it has one; a ValueError if that
        pair is not among `pairs` (it cannot take the request now)."""
        asked = self._pairs.get(request.id)
        if asked is not None:
            if pairs is not None and asked not in pairs:
                raise ValueError(f"request {request.id} asked for workers {asked}, which "
                                 f"cannot take it now (those that can: {list(pairs)})")
            pairs = [asked]
        return super().choose(request, ledger, now_s, pairs)

    def _modes_for(self, request: ServeRequest) -> tuple[Mode, ...]:
        if request.id not in self._asked:
            raise ValueError(f"no mode was asked for request {request.id}")
        return (self._asked[request.id],)

    def _weighed(self, seq_len: int) -> tuple[Mode, ...]:
        """Every mode asked, whatever its request's length."""
        return tuple(dict.fromkeys(self._asked.values()))


def served_mode(action: Action) -> Mode:
    """How a fixed action is served: after a full prefill, overlapped, timed from the prompt."""
    return Mode.of(action, DEFAULT_SCHEDULE, PrefillMode.FULL, 1, Interval.PROMPT)


def check_policy_names(text: str, num_layers: int) -> tuple[str, ...]:
    """The policy names of a comma list, each checked: `adaptive`, `PREC:balanced` or an action
    `PREC:CUT`; a ValueError names a bad one."""
    names = tuple(n.strip() for n in text.split(","))
    for name in names:
        prec, _, cut = name.partition(":")
        if name == ADAPTIVE or (cut == BALANCED and prec in ("q8", "q4")):
            continue
        try:
            Action.parse(name, num_layers)
        except ValueError as e:
            raise ValueError(f"policy {name!r}: expected {ADAPTIVE}, q8:{BALANCED}, "
                             f"q4:{BALANCED} or an action PREC:CUT ({e})") from None
    if len(set(names)) < len(names):
        raise ValueError(f"policies {text!r} name one twice")
    return names


def make_policies(names: Sequence[str], context: Context) -> list[Policy]:
    """The policies `check_policy_names` accepted, over one context."""
    out: list[Policy] = []
    for name in check_policy_names(",".join(names), context.num_layers):
        prec, _, cut = name.partition(":")
        if name == ADAPTIVE:
            out.append(Adaptive(name, context))
        elif cut == BALANCED:
            out.append(Balanced(name, context, Action.parse(f"{prec}:full", 2).bits))
        else:
            out.append(Fixed(name, context))
    return out
