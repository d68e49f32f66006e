"""What the router knows of its workers' queues: the `Ledger` a policy reads (`queues`) and the
router updates as it assigns requests and hears from the workers. Every record is frozen; an
update returns a new ledger.

Times are seconds of the router's clock (from the run's start). Each resource's "free at" is
predicted when a request is assigned (`queueing.ServedPrediction.after`) and corrected by what
the workers report: a prefill worker's queue restarts from each `Prefilled` (the next prompt
starts then, and the compute it reports re-estimates the device's speed against the profile,
`ComputeEstimate`), a decode worker's from each `Load`, and each link's bandwidth is
re-estimated from the transfers just timed (`LinkEstimate`). The router notes each arrival
(`arrived`) before its policy chooses, so the ledger knows the recent arrival rate.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from rekv_jax.mode import PrefillMode
from rekv_jax.planning.queueing import DecodeCosts, Queues
from rekv_jax.serving.requests import Assignment, Load

T = TypeVar("T")

WINDOW = 8  # transfers a link's bandwidth estimate is taken over
ARRIVALS = 16  # arrivals the arrival rate is estimated over


@dataclasses.dataclass(frozen=True)
class LinkEstimate:
    """A link's bandwidth: the bytes of its latest `window` timed transfers over their time
    (each transfer's fixed per-message costs count as transfer time, a slight underestimate for
    small transfers), or `prior_gbps` until one is timed."""

    prior_gbps: float
    samples: tuple[tuple[int, float], ...] = ()  # (bytes, ms) of the latest transfers, oldest first
    window: int = WINDOW

    def __post_init__(self) -> None:
        if not self.prior_gbps > 0 or self.window < 1:
            raise ValueError(f"a link estimate needs a positive prior and window, got {self}")

    @property
    def gbps(self) -> float:
        ms = sum(t for _, t in self.samples)
        return sum(b for b, _ in self.samples) / (ms * 1e6) if ms > 0 else self.prior_gbps

    def observed(self, nbytes: int, ms: float) -> LinkEstimate:
        """The estimate after a transfer of `nbytes` took `ms` (an empty one tells nothing)."""
        if nbytes <= 0 or not ms > 0:
            return self
        return dataclasses.replace(self, samples=(*self.samples, (nbytes, ms))[-self.window:])


class Setting(enum.StrEnum):
    """What a device's compute ran beside, which its speed depends on where the two sides share
    a host's memory and power (where they do not, every setting agrees)."""

    ALONE = "alone"  # no device of the other side busy
    BESIDE = "beside"  # a busy device of the other side
    # a streamed prompt, its own handoff crossing as it computes: one program per token chunk
    # (pipelined) or per layer (split), each apart from its price its own way
    PIPELINED = "pipelined"
    SPLIT = "split"


def octave(tokens: int) -> int:
    """A prompt length's octave (182..362 tokens: 8). A price errs by its length as well as by
    its device's speed: the profile's terms are fitted at a few lengths, each at its own time,
    so a device is timed apart per octave."""
    if tokens < 1:
        raise ValueError(f"a prompt has at least one token, got {tokens}")
    return round(math.log2(tokens))


@dataclasses.dataclass(frozen=True)
class Timed:
    """One timed computation of a device: where it ran, its prompt's octave, its price and
    its measured time (ms)."""

    setting: Setting
    octave: int
    priced_ms: float
    measured_ms: float


@dataclasses.dataclass(frozen=True)
class ComputeEstimate:
    """How long a device takes per ms of the cost model's price for its compute (a prefill
    device's prompts; a decode device's suffixes, priced with their stretch beside the running
    decodes): the measured time of its latest `window` in a setting and octave over their
    price; the setting's other octaves until its octave is timed; 1 until the setting is."""

    samples: tuple[Timed, ...] = ()  # oldest first
    window: int = WINDOW

    def stretch(self, setting: Setting, tokens: int | None = None) -> float:
        """The stretch of a prompt of `tokens` (None: of any length) computing in `setting`."""
        timed = [t for t in self.samples if t.setting == setting]
        if tokens is not None:
            timed = [t for t in timed if t.octave == octave(tokens)] or timed
        priced = sum(t.priced_ms for t in timed)
        return sum(t.measured_ms for t in timed) / priced if priced > 0 else 1.0

    def observed(self, priced_ms: float, measured_ms: float, setting: Setting, tokens: int
                 ) -> ComputeEstimate:
        """The estimate after compute of a `tokens`-token prompt priced at `priced_ms` took
        `measured_ms` in `setting` (compute not done, or priced at nothing, tells nothing); a
        setting keeps its latest `window` per octave."""
        if not (priced_ms > 0 and measured_ms > 0):
            return self
        new = Timed(setting, octave(tokens), priced_ms, measured_ms)
        return dataclasses.replace(self, samples=_windowed(
            self.samples, new, lambda t: (t.setting, t.octave) == (new.setting, new.octave),
            self.window))


@dataclasses.dataclass(frozen=True)
class Extra:
    """What a stage has lately taken beyond its price (ms), apart by kind (`key`): the median
    of the key's latest `window`; 0 until the key is timed. A prefill worker's `overhead` is
    what its streamed prompts held it beyond their compute: from a prompt's turn (its arrival at
    an idle worker, or the `Prefilled` of the one before it) to its own `Prefilled`, less its
    compute; such a prompt prefilled ahead of its pages waits at the head of the queue for its
    decode side's admission, and its messages leave on the worker's thread between its steps. A
    decode worker's `tail` is by how much its first tokens have lately come after their link's
    end later than priced (by `(streams, octave, beside decodes)`: the decode side's work after
    the last message differs by schedule and length, and by whether it runs inside the
    iterations of running decodes)."""

    samples: tuple[tuple[Hashable, float], ...] = ()  # (key, ms), oldest first
    window: int = WINDOW

    def ms(self, key: Hashable = None) -> float:
        timed = [ms for k, ms in self.samples if k == key]
        return statistics.median(timed) if timed else 0.0

    def observed(self, ms: float, key: Hashable = None) -> Extra:
        """The estimate once a stage of kind `key` took `ms` beyond its price."""
        return dataclasses.replace(self, samples=_windowed(
            self.samples, (key, ms), lambda sample: sample[0] == key, self.window))


@dataclasses.dataclass(frozen=True)
class Queued:
    """A prompt assigned to a prefill worker and not yet computed."""

    busy_ms: float  # its predicted device time
    priced_ms: float  # its price at the profile's costs
    prefill: PrefillMode  # how it computes (split and pipelined ones stream)
    tokens: int  # its length


@dataclasses.dataclass(frozen=True)
class PrefillQueue:
    """One prefill worker: the prompts assigned and not done, in the order it serves them,
    when the first of them started and in which setting, how the device's compute has lately
    compared with its price, and what its streamed prompts have held it beyond that."""

    queued: tuple[Queued, ...] = ()
    started_s: float = 0.0
    setting: Setting = Setting.ALONE
    estimate: ComputeEstimate = ComputeEstimate()
    overhead: Extra = Extra()

    def free_at(self) -> float:
        return self.started_s + sum(q.busy_ms for q in self.queued) / 1e3


@dataclasses.dataclass(frozen=True)
class Slack:
    """The suffix compute a request can still take beside its decode (`queueing.tpot_slack_ms`,
    less each suffix chosen on its decode worker since), and when its decode ends as its tokens
    have come so far (inf: before its second token)."""

    request_id: int
    ms: float
    ends_s: float = math.inf


@dataclasses.dataclass(frozen=True)
class DecodeQueue:
    """One decode worker: when its admitted suffix work ends, its running requests, and how its
    suffixes have lately compared with their price."""

    free_at_s: float = 0.0
    running: int = 0
    estimate: ComputeEstimate = ComputeEstimate()
    held_pages: int = 0  # what its admitted requests hold: they decode there now or soon
    tail: Extra = Extra()  # its first tokens' lag after their link beyond the price
    slack: tuple[Slack, ...] = ()  # of each request assigned to it, until the request ends


@dataclasses.dataclass(frozen=True)
class LinkQueue:
    """The link from one prefill worker to one decode worker."""

    estimate: LinkEstimate
    free_at_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The router's view of P prefill workers, D decode workers and the P x D links."""

    prefill: tuple[PrefillQueue, ...]
    decode: tuple[DecodeQueue, ...]
    links: tuple[LinkQueue, ...]  # prefill-major: the link (p, d) is links[p * D + d]
    arrivals_s: tuple[float, ...] = ()  # the latest ARRIVALS arrival times, oldest first

    @classmethod
    def idle(cls, prefill_workers: int, decode_workers: int, link_gbps: float) -> Ledger:
        if prefill_workers < 1 or decode_workers < 1:
            raise ValueError("a ledger needs at least one prefill and one decode worker")
        return cls((PrefillQueue(),) * prefill_workers, (DecodeQueue(),) * decode_workers,
                   (LinkQueue(LinkEstimate(link_gbps)),) * (prefill_workers * decode_workers))

    def pairs(self) -> list[tuple[int, int]]:
        return [(p, d) for p in range(len(self.prefill)) for d in range(len(self.decode))]

    def link(self, p: int, d: int) -> LinkQueue:
        return self.links[p * len(self.decode) + d]

    @property
    def arrival_rate(self) -> float:
        """Requests per second over the latest arrivals (0 before two)."""
        t = self.arrivals_s
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0

    def queues(self, p: int, d: int, now_s: float, tokens: int) -> Queues:
        """What a request of `tokens` prompt tokens arriving at `now_s` finds on prefill worker
        p, decode worker d and their link (ms from now)."""
        def wait(at_s: float) -> float:
            return max(0.0, (at_s - now_s) * 1e3)
        queue, decode = self.prefill[p], self.decode[d]
        setting = (Setting.BESIDE if queue.queued  # beside the handoffs before it
                   else self._prompt_setting(PrefillMode.FULL, now_s))
        return Queues(wait(queue.free_at()), wait(self.link(p, d).free_at_s),
                      wait(decode.free_at_s), decode.running, self.arrival_rate,
                      queue.estimate.stretch(setting, tokens),
                      decode.estimate.stretch(self._decode_setting(), tokens),
                      queue.estimate.stretch(Setting.PIPELINED, tokens),
                      queue.estimate.stretch(Setting.SPLIT, tokens),
                      self.link(p, d).estimate.gbps, queue.overhead.ms(),
                      decode.tail.ms((False, octave(tokens), decode.running > 0)),
                      decode.tail.ms((True, octave(tokens), decode.running > 0)),
                      tuple((x.ms, wait(x.ends_s)) for x in decode.slack))

    def decoding(self, now_s: float) -> bool:
        """Whether some decode worker is busy at `now_s` or about to be: requests running or
        admitted (their handoffs on the way), or suffix work."""
        return any(q.running or q.held_pages or q.free_at_s > now_s for q in self.decode)

    def prefilling(self) -> bool:
        """Whether some prefill worker's device is computing a prompt."""
        return any(q.queued for q in self.prefill)

    def _prompt_setting(self, prefill: PrefillMode, now_s: float) -> Setting:
        """Where a prompt computed as `prefill` asks, starting at `now_s`, computes."""
        if prefill != PrefillMode.FULL:
            return Setting(prefill.value)
        return Setting.BESIDE if self.decoding(now_s) else Setting.ALONE

    def _decode_setting(self) -> Setting:
        return Setting.BESIDE if self.prefilling() else Setting.ALONE

    def arrived(self, now_s: float) -> Ledger:
        """The ledger once a request has arrived at `now_s`."""
        return dataclasses.replace(self, arrivals_s=(*self.arrivals_s, now_s)[-ARRIVALS:])

    def assigned(self, a: Assignment, now_s: float, tokens: int) -> Ledger:
        """The ledger once `a`, for a prompt of `tokens` tokens chosen at `now_s`, holds its
        resources as predicted."""
        p, d, predicted = a.prefill_worker, a.decode_worker, a.why.predicted
        after, queue = predicted.after, self.prefill[p]
        if not queue.queued:  # an idle worker starts the prompt now
            queue = dataclasses.replace(queue, started_s=now_s,
                                        setting=self._prompt_setting(a.mode.prefill, now_s))
        queue = dataclasses.replace(queue, queued=(*queue.queued, Queued(
            predicted.prefill_busy_ms, predicted.prefill_priced_ms, a.mode.prefill, tokens)))
        link = dataclasses.replace(self.link(p, d), free_at_s=now_s + after.link_free_ms / 1e3)
        decode = self.decode[d]
        # FIFO prompts: the requests assigned before it decode by the time its suffix starts,
        # unless their decode has ended by then
        from_s = now_s + predicted.suffix_from_ms / 1e3
        slack = tuple(dataclasses.replace(x, ms=x.ms - predicted.decode_busy_ms)
                      if x.ends_s > from_s else x for x in decode.slack)
        if a.why.tpot_slack_ms is not None:
            slack += (Slack(a.request_id, a.why.tpot_slack_ms),)
        decode = dataclasses.replace(decode, free_at_s=now_s + after.decode_free_ms / 1e3,
                                     slack=slack)
        return self._with(p, d, queue, link, decode)

    def decodes_until(self, a: Assignment, times_s: Sequence[float], new_tokens: int
                      ) -> Ledger:
        """`a`'s request of `new_tokens` tokens got its first ones at `times_s` (two or more):
        its decode ends when its last comes at their pace."""
        first, last = times_s[0], times_s[-1]
        ends_s = first + (last - first) * (new_tokens - 1) / (len(times_s) - 1)
        queue = self.decode[a.decode_worker]
        return self._with(decode_worker=a.decode_worker, decode=dataclasses.replace(
            queue, slack=tuple(dataclasses.replace(x, ends_s=ends_s)
                               if x.request_id == a.request_id else x for x in queue.slack)))

    def released(self, a: Assignment | None) -> Ledger:
        """The ledger once `a`'s request ended, or left its workers to be assigned again (None:
        it had none)."""
        if a is None:
            return self
        queue = self.decode[a.decode_worker]
        return self._with(decode_worker=a.decode_worker, decode=dataclasses.replace(
            queue, slack=tuple(x for x in queue.slack if x.request_id != a.request_id)))

    def prefilled(self, worker: int, now_s: float, compute_ms: float | None = None) -> Ledger:
        """Prefill worker `worker`'s device finished its oldest prompt at `now_s` after
        `compute_ms` of compute (`Prefilled`: its handoff may still be on the link; None: its
        time tells nothing of the device, it compiled or was dropped): the next one starts
        now."""
        queue = self.prefill[worker]
        if not queue.queued:
            return self
        done, rest = queue.queued[0], queue.queued[1:]
        estimate, overhead = queue.estimate, queue.overhead
        if compute_ms is not None:
            estimate = estimate.observed(done.priced_ms, compute_ms, queue.setting, done.tokens)
            if done.prefill != PrefillMode.FULL:
                overhead = overhead.observed(
                    max(0.0, (now_s - queue.started_s) * 1e3 - compute_ms))
        return self._with(prefill_worker=worker, prefill=PrefillQueue(
            rest, now_s, self._prompt_setting(rest[0].prefill if rest else PrefillMode.FULL,
                                              now_s), estimate,
            overhead))

    def loaded(self, load: Load, now_s: float, costs: DecodeCosts) -> Ledger:
        """A decode worker's report at `now_s`: its suffix work left, stretched by its batch and
        by how its suffixes have lately compared with their price."""
        queue = self.decode[load.worker]
        stretch = costs.stretch(load.running) * queue.estimate.stretch(self._decode_setting())
        return self._with(decode_worker=load.worker, decode=dataclasses.replace(
            queue, free_at_s=now_s + load.queued_suffix_ms * stretch / 1e3,
            running=load.running))

    def holding(self, worker: int, pages: int) -> Ledger:
        """Decode worker `worker`'s admitted requests now hold `pages` of its pool."""
        return self._with(decode_worker=worker, decode=dataclasses.replace(
            self.decode[worker], held_pages=pages))

    def suffix_done(self, worker: int, a: Assignment, tokens: int, suffix_ms: float,
                    beside: bool, queued: bool = False) -> Ledger:
        """Decode worker `worker` ran the suffix of `a`'s handoff of `tokens` prompt tokens in
        `suffix_ms`, `beside` a prompt's compute or alone, `queued` behind another suffix's
        work or not. Only a suffix after a full prefill, in one piece, that no other suffix held
        up times the device: its phase is its compute, stretched by the decodes beside it. A
        streamed prefill's suffix waits for the prompt's pieces, and a queued one for the suffix
        work before it, which the decode device's backlog (`Queues.decode_free_ms`) counts
        already: timing the device by it would count that wait twice."""
        if a.mode.streams or a.mode.chunks > 1 or queued or not suffix_ms > 0:
            return self
        p, queue = a.why.predicted, self.decode[worker]
        price = p.decode_busy_ms * p.stretch / p.decode_stretch
        return self._with(decode_worker=worker, decode=dataclasses.replace(
            queue, estimate=queue.estimate.observed(
                price, suffix_ms, Setting.BESIDE if beside else Setting.ALONE, tokens)))

    def first_token(self, a: Assignment, tokens: int, tail_ms: float) -> Ledger:
        """The first token of `a`'s handoff of `tokens` prompt tokens came `tail_ms` after the
        router heard its link's end (its `PrefillDone`)."""
        p, queue = a.why.predicted, self.decode[a.decode_worker]
        priced = p.ttft_ms - p.tail_ms - p.after.link_free_ms  # the plan's own tail
        return self._with(decode_worker=a.decode_worker, decode=dataclasses.replace(
            queue, tail=queue.tail.observed(tail_ms - priced, (a.mode.streams, octave(tokens),
                                                               p.after.running > 0))))

    def link_timed(self, p: int, d: int, nbytes: int, ms: float, streamed: bool = False
                   ) -> Ledger:
        """A transfer of `nbytes` from prefill worker p to decode worker d took `ms`. A
        `streamed` one (a split or pipelined prefill) times nothing: its messages left as its
        prompt computed, so its time from the first to the last verdict holds that compute."""
        if streamed:
            return self
        link = self.link(p, d)
        return self._with(p, d, link=dataclasses.replace(link,
                                                         estimate=link.estimate.observed(nbytes,
                                                                                         ms)))

    def _with(self, prefill_worker: int | None = None, decode_worker: int | None = None,
              prefill: PrefillQueue | None = None, link: LinkQueue | None = None,
              decode: DecodeQueue | None = None) -> Ledger:
        """This ledger with the given worker's (and pair's link's) records replaced."""
        p, d = prefill_worker, decode_worker
        return Ledger(_put(self.prefill, p, prefill), _put(self.decode, d, decode),
                      _put(self.links, None if link is None else p * len(self.decode) + d,
                           link), self.arrivals_s)


def _put(items: Sequence, index: int | None, item: object) -> tuple:
    if item is None or index is None:
        return tuple(items)
    return (*items[:index], item, *items[index + 1:])


def _windowed(samples: tuple[T, ...], new: T, kin: Callable[[T], bool], window: int
              ) -> tuple[T, ...]:
    """`samples` with `new` appended, its kind (`kin`) keeping only its latest `window`."""
    of_kind = [i for i, sample in enumerate(samples) if kin(sample)]
    if len(of_kind) >= window:  # drop its oldest
        samples = samples[:of_kind[0]] + samples[of_kind[0] + 1:]
    return (*samples, new)
