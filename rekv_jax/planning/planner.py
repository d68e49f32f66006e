"""Choose the handoff action: predict every candidate with the cost model and rank them.

A plan uses a `Profile` measured elsewhere (e.g. `rekv profile` on a GPU, possibly re-targeted to
another link), or, without one, an *analytic* profile: a roofline estimate of an H100-class GPU
(`ANALYTIC_TFLOPS` effective dense BF16, `ANALYTIC_HBM_GBPS` memory bandwidth) on the paper's
cross-node TCP path (`PAPER_LINK_GBPS`). The analytic profile is an assumption, not a measurement,
and every plan made from it says so. As the paper notes (§2.3), the model guides the cut sweep;
the final choice is made on measured latency.

A plan ranks every (action, schedule, prefill mode, token chunks) for one interval. Output quality
is not the cost model's: given the quality gate's results (`rekv quality --json`), a plan chooses
among the eligible actions only; without them it marks every candidate's quality unchecked. The
action space holds the paper's prefix format and, with gate results, every format they judged,
so a format is chosen only where the gate passed it (ties go to the earlier format, the paper's
first: a format's transforms are not in the profile).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rekv_jax import sizes
from rekv_jax.action import PAPER, Action, ActionKind, action_space
from rekv_jax.config import ModelConfig
from rekv_jax.gate_result import GateResult
from rekv_jax.mode import SCHEDULES, Interval, Mode, check_timing, prefills_for
from rekv_jax.phases import PHASES, Phases
from rekv_jax.planning.costmodel import Profile, phase_ms, predicted_ms

# The paper's H100 TCP path moves the 8K Qwen2.5-7B BF16 cache (448 MiB) in 202.13 ms (§4.4).
PAPER_LINK_GBPS = 448 * sizes.MIB / 202.13e-3 / 1e9  # ~2.32 GB/s
ANALYTIC_TFLOPS = 700.0  # assumed effective dense BF16 rate of an H100-class GPU
ANALYTIC_HBM_GBPS = 3350.0  # H100 SXM memory bandwidth


def analytic_profile(cfg: ModelConfig, seq_len: int, batch: int = 1,
                     link_gbps: float = PAPER_LINK_GBPS, tflops: float = ANALYTIC_TFLOPS,
                     hbm_gbps: float = ANALYTIC_HBM_GBPS) -> Profile:
    """A roofline profile: each cost is max(FLOPs / rate, bytes moved / memory bandwidth)."""
    if not (tflops > 0 and hbm_gbps > 0):
        raise ValueError(f"device rates must be positive, got {tflops} TFLOP/s, {hbm_gbps} GB/s")

    def roofline(flops: float, nbytes: float) -> float:  # ms
        return max(flops / (tflops * 1e9), nbytes / (hbm_gbps * 1e6))

    kv16 = sizes.kv_layer_bytes(cfg, seq_len, batch)
    # Quantize reads BF16 and writes codes + scales; restore reads those and writes BF16. A head
    # dim that is not whole groups cannot be quantized: its profile has no Q8/Q4 costs.
    bits = (8, 4) if cfg.head_dim % sizes.GROUP_SIZE == 0 else ()
    memory = {16: 0.0} | {b: roofline(0, kv16 + sizes.kv_layer_bytes(cfg, seq_len, batch, b))
                          for b in bits}
    # the first token: LM head of the last position (transfer-only receives it with the KV)
    head_ms = roofline(sizes.head_flops(cfg, 1, batch),
                       sizes.head_weight_count(cfg) * sizes.WEIGHT_BYTES)
    return Profile.for_config(
        cfg, seq_len, batch, hardware=f"analytic ({tflops:g} TFLOP/s, {hbm_gbps:g} GB/s memory)",
        link=f"analytic {link_gbps:g} GB/s", link_gbps=link_gbps, source="analytic",
        quantize_ms=memory, restore_ms=memory,
        suffix_layer_ms=roofline(sizes.layer_flops(cfg, seq_len, batch),
                                 sizes.layer_weight_count(cfg) * sizes.WEIGHT_BYTES),
        join_ms={ActionKind.TRANSFER: 0.0} | dict.fromkeys((ActionKind.RECOMPUTE, ActionKind.JOINT),
                                                           head_ms),
        embed_ms=roofline(0, sizes.boundary_bytes(cfg, seq_len, batch)),  # writes [B, S, D] BF16
        # each extra token chunk reads a layer's weights once more; attention grows per chunk
        chunk_layer_ms=roofline(0, sizes.layer_weight_count(cfg) * sizes.WEIGHT_BYTES),
        attention_share=sizes.attention_share(cfg, seq_len))


def find_profile(profiles: Sequence[Profile], model: str, num_layers: int | None, seq_len: int,
                 batch: int = 1, link_gbps: float | None = None, bits: int | None = None
                 ) -> Profile | None:
    """The profile to predict `model` (of `num_layers` layers; None: any) at `seq_len` and
    `batch` with: the one rule the planner and the report pick profiles by. Among those that
    timed `bits`' quantizer (None: any), on a paced `link_gbps` the first, re-targeted to it;
    unpaced, one fitted over an unpaced link where there is one, else the first; None if none."""
    fits = [p for p in profiles if (p.model, p.seq_len, p.batch) == (model, seq_len, batch)
            and num_layers in (None, p.num_layers) and (bits is None or bits in p.quantize_ms)]
    if link_gbps is not None:
        return fits[0].at_link(link_gbps) if fits else None
    return next((p for p in fits if p.link.endswith("unpaced")), fits[0] if fits else None)


def select_profile(profiles: Sequence[Profile], cfg: ModelConfig, seq_len: int, batch: int = 1,
                   link_gbps: float | None = None) -> Profile:
    """The profile of exactly this model, prompt length and batch (`find_profile`); a
    ValueError names the ones there are."""
    profile = find_profile(profiles, cfg.name, cfg.num_layers, seq_len, batch, link_gbps)
    if profile is None:
        have = sorted({(p.model, p.seq_len, p.batch) for p in profiles})
        raise ValueError(f"no profile for model {cfg.name!r}, seq_len {seq_len}, batch {batch}; "
                         f"have (model, seq_len, batch) {have}")
    return profile


CHUNK_CHOICES = (2, 4, 8, 16)  # token chunks the planner tries for the chunked schedules
QUALITY = ("eligible", "ineligible", "unchecked")  # a candidate's standing at the gate (§2.4)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to hand off (its `Mode`), with its prediction and standing at the gate."""

    mode: Mode
    predicted_ms: float  # the total for the plan's interval
    phases_ms: Phases  # the action's unchunked ready-interval phases (no prefill)
    payload_bytes: int
    quality: str  # QUALITY
    gated_chunks: int | None = None  # the chunks of the gate result used (None: unchecked)

    @property
    def action(self) -> Action:
        return self.mode.action

    @property
    def schedule(self) -> str:
        return self.mode.schedule_text

    @property
    def prefill(self) -> str:
        return self.mode.prefill

    @property
    def chunks(self) -> int:
        return self.mode.chunks

    @property
    def label(self) -> str:
        """e.g. `q8:r=13 chunked x4`, `q8:r=13 split overlapped`, `q8:r=13 pipelined x8`."""
        return self.mode.label

    def to_json(self) -> dict[str, Any]:
        a = self.action
        return {"action": str(a), "kind": a.kind, "bits": a.bits, "cut": a.cut,
                "format": a.format, "suffix_len": a.suffix_len, "schedule": self.schedule,
                "prefill": self.prefill,
                "chunks": self.chunks, "predicted_ms": self.predicted_ms,
                "phases_ms": self.phases_ms.to_json(PHASES), "payload_bytes": self.payload_bytes,
                "quality": self.quality, "gated_chunks": self.gated_chunks}


@dataclasses.dataclass(frozen=True)
class BalancedCut:
    """Proposition 2 for one precision: c* (Eq. 11 with the profile's fixed terms) and the cuts
    (with their suffix lengths) that can minimize T_ov."""

    c_star: float
    cuts: tuple[int, ...]
    suffix_lens: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"c_star": self.c_star, "cuts": list(self.cuts),
                "suffix_lens": list(self.suffix_lens)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate with its prediction and quality, and the chosen one."""

    model: str
    seq_len: int
    batch: int
    interval: str
    profile: Profile
    candidates: tuple[Candidate, ...]
    best: Candidate  # the fastest eligible candidate (with a gate), else the fastest
    balanced_cut: dict[str, BalancedCut]  # precision (e.g. "q8") -> Prop. 2's cuts
    quality_file: str | None  # the gate results the choice respected (None: unchecked)

    @property
    def note(self) -> str | None:
        """What to know about the profile (an analytic one is an assumption)."""
        p = self.profile
        if p.source != "analytic":
            return None
        return (f"analytic profile: {p.hardware} on a {p.link_gbps:g} GB/s link; assumed rates, "
                "not a measurement")

    def to_json(self) -> dict[str, Any]:
        out = {"kind": "plan", "model": self.model, "seq_len": self.seq_len, "batch": self.batch,
               "interval": self.interval, "quality_file": self.quality_file,
               "profile": {k: v for k, v in self.profile.to_json().items() if k != "kind"},
               "best": self.best.to_json(),
               "balanced_cut": {k: b.to_json() for k, b in self.balanced_cut.items()},
               "candidates": [c.to_json() for c in self.candidates]}
        return out | ({"note": self.note} if self.note else {})


def plan(cfg: ModelConfig, seq_len: int, profile: Profile | None = None,
         link_gbps: float | None = None, actions: Sequence[Action] | None = None,
         batch: int = 1, schedules: Sequence[str] = SCHEDULES, interval: str = Interval.READY,
         prefills: Sequence[str] | None = None, chunks: Sequence[int] = CHUNK_CHOICES,
         gate: Sequence[GateResult] | None = None, gate_file: str | None = None,
         bits: Sequence[int] | None = None, formats: Sequence[str] | None = None) -> Plan:
    """Predict every (action, schedule, prefill, chunks) and choose the fastest; with `gate`
    (the quality gate's results), the fastest eligible one. `link_gbps` re-targets the profile's
    transfer terms; `interval` chooses the timed interval, whose prefill modes are `prefills`
    (default: all that suit it). Without `actions`, every action of `bits` (default: the
    profile's precisions) in `formats` (default: the paper's prefix format and each format the
    gate judged at this model and length)."""
    prefills = prefills_for(interval) if prefills is None else prefills
    for prefill in prefills:
        check_timing(interval, prefill)
    if profile is None:
        profile = analytic_profile(cfg, seq_len, batch,
                                   PAPER_LINK_GBPS if link_gbps is None else link_gbps)
    else:
        profile = select_profile([profile], cfg, seq_len, batch, link_gbps)
    verdicts = _verdicts(gate, cfg.name, seq_len) if gate is not None else None
    if actions is None:
        if formats is None:
            formats = tuple(dict.fromkeys([PAPER, *(Action.parse(a, cfg.num_layers).format
                                                    for a, _ in verdicts or {})]))
        bits = sorted(profile.quantize_ms if bits is None else bits, reverse=True)
        actions = list(action_space(cfg.num_layers, bits, formats))
    chunks = sorted({n for n in chunks if 1 < n <= seq_len})
    candidates = []
    for a in actions:
        phases = phase_ms(profile, a)
        payload = sizes.action_bytes(cfg, a, seq_len, batch).total_bytes
        for mode in Mode.candidates(a, schedules, prefills, chunks, interval):
            quality, gated = standing(verdicts, a, mode.chunks)
            candidates.append(Candidate(mode, predicted_ms(profile, mode), phases, payload,
                                        quality, gated))
    if not candidates:
        raise ValueError("no candidate: no action, or no schedule and prefill mode that suit "
                         f"the {interval} interval")
    pool = [c for c in candidates if c.quality == "eligible"] if gate is not None else candidates
    if not pool:
        raise ValueError(f"no eligible candidate: the gate results for {cfg.name} at {seq_len} "
                         f"tokens pass none of the {len(candidates)} candidates' actions")
    return Plan(cfg.name, seq_len, batch, interval, profile, tuple(candidates),
                min(pool, key=lambda c: c.predicted_ms),
                _balanced_cuts(profile) if cfg.num_layers >= 2 else {},
                gate_file if gate is not None else None)


def gate_verdicts(gate: Sequence[GateResult], model: str, seq_len: int
                  ) -> dict[tuple[str, int], bool]:
    """(action text, chunks) -> eligible, from the gate results of this model and length (empty
    where it has none)."""
    return {(g.action, g.chunks): g.eligible for g in gate
            if (g.model, g.seq_len) == (model, seq_len)}


def _verdicts(gate: Sequence[GateResult], model: str, seq_len: int
              ) -> dict[tuple[str, int], bool]:
    """`gate_verdicts`, which must hold some."""
    mine = gate_verdicts(gate, model, seq_len)
    if not mine:
        have = sorted({(g.model, g.seq_len) for g in gate})
        raise ValueError(f"the quality gate results have none for model {model!r} at {seq_len} "
                         f"tokens; they have (model, seq_len) {have}")
    return mine


def standing(verdicts: dict[tuple[str, int], bool] | None, action: Action, chunks: int
              ) -> tuple[str, int | None]:
    """A candidate's quality and the chunks of the gate result it rests on: its own chunking's,
    else the unchunked cache's (chunking reorders only the suffix's sums; the gate judges the
    quantized prefix)."""
    for n in dict.fromkeys((chunks, 1)):
        if verdicts is not None and (str(action), n) in verdicts:
            return ("eligible" if verdicts[str(action), n] else "ineligible"), n
    return "unchecked", None


def _balanced_cuts(profile: Profile) -> dict[str, BalancedCut]:
    """Per precision: c* (Eq. 11 with the profile's fixed terms) and the cuts Prop. 2 allows."""
    out = {}
    for bits in sorted(profile.quantize_ms, reverse=True):
        c_star, cuts = profile.balanced_cut(bits)
        out[Action(bits, cuts[0], profile.num_layers).precision] = BalancedCut(
            c_star, cuts, tuple(profile.num_layers - c for c in cuts))
    return out


@dataclasses.dataclass(frozen=True)
class LinkChoice:
    """The fastest action at one link bandwidth, and its time."""

    link_gbps: float
    best: str  # Action in its text form
    ms: float  # predicted or measured


@dataclasses.dataclass(frozen=True)
class Crossover:
    """The preferred action changes from `before` to `after` between two link bandwidths."""

    before: str  # Action in its text form
    after: str
    between_gbps: tuple[float, float]


def preferred_by_link(profile: Profile, actions: Sequence[Action], links: Sequence[float],
                      schedule: str = SCHEDULES[0]) -> list[LinkChoice]:
    """The predicted fastest of `actions` (ready interval, `schedule`) at each link bandwidth
    (GB/s), the profile re-targeted."""
    if not actions:
        raise ValueError("no candidate actions")
    out = []
    for w in links:
        p = profile.at_link(w)
        ms = {str(a): predicted_ms(p, Mode.of(a, schedule)) for a in actions}
        best = min(ms, key=ms.get)
        out.append(LinkChoice(w, best, ms[best]))
    return out


def crossovers(by_link: Sequence[LinkChoice]) -> list[Crossover]:
    """Where the preferred action changes between consecutive links of `preferred_by_link`."""
    return [Crossover(a.best, b.best, (a.link_gbps, b.link_gbps))
            for a, b in zip(by_link, by_link[1:], strict=False) if a.best != b.best]


def plan_text(result: Plan, top: int = 12) -> str:
    """The readable form of a `Plan`: the profile, the choice and its quality, the fastest per
    schedule, Prop. 2's cut per precision, and the `top` fastest candidates with the fastest of
    each precision and kind."""
    prof, best, cands = result.profile, result.best, sorted(result.candidates,
                                                          key=lambda c: c.predicted_ms)
    gated = result.quality_file is not None
    lines = [f"{result.model}, {result.seq_len} tokens, batch {result.batch}, {result.interval} "
             f"interval; {prof.source} profile: {prof.hardware}, link {prof.link_gbps:.3g} GB/s",
             f"predicted best{' eligible' if gated else ''}: {best.label} at "
             f"{best.predicted_ms:.2f} ms (quality: {best.quality})"]
    counts = {q: len({str(c.action) for c in cands if c.quality == q}) for q in QUALITY}
    if gated:
        worse = next((c for c in cands if c.quality != "eligible"), None)
        lines.append(f"quality: gate results from {result.quality_file}: of {sum(counts.values())}"
                     f" actions {counts['eligible']} eligible, {counts['ineligible']} ineligible, "
                     f"{counts['unchecked']} unchecked (only eligible ones are chosen)"
                     + (f"; the fastest excluded: {worse.label} at {worse.predicted_ms:.2f} ms "
                        f"({worse.quality})" if worse and worse.predicted_ms < best.predicted_ms
                        else ""))
    else:
        lossless = next((c for c in cands if c.action.bits == 16), None)
        lines.append("quality: unchecked for every action (no --quality FILE of `rekv quality "
                     "--json`); a low-bit prefix can fail the gate (paper §2.4: Qwen2.5-7B "
                     "joint Q4 at 8K)" + (f"; fastest with a BF16 prefix: {lossless.label} at "
                                          f"{lossless.predicted_ms:.2f} ms" if lossless else ""))
    fastest_way: dict[tuple[str, str], Candidate] = {}
    for c in cands:
        if c.quality == "eligible" or not gated:
            fastest_way.setdefault((c.prefill, c.schedule), c)
    lines.append("fastest per schedule: " + "; ".join(
        f"{c.label} {c.predicted_ms:.2f} ms" for c in fastest_way.values()))
    lines += [f"balanced cut c* (Prop. 2), {prec}: {b.c_star:.2f} -> cut(s) {list(b.cuts)} "
              f"(suffix {list(b.suffix_lens)})" for prec, b in result.balanced_cut.items()]
    rows: dict[tuple[Action, str, str], Candidate] = {}
    for c in cands:  # one row per action and schedule: its fastest (fewest) chunks
        rows.setdefault((c.action, c.prefill, c.schedule), c)
    ranked = list(rows.values())
    best_of: dict[tuple[int, str], Candidate] = {}
    for c in ranked:  # fastest per (precision, kind), beyond the top rows
        best_of.setdefault((c.action.bits, c.action.kind), c)
    shown = sorted({id(c): c for c in (*ranked[:top], *best_of.values(), rows[
        best.action, best.prefill, best.schedule])}.values(), key=lambda c: c.predicted_ms)
    width = max(16, *(len(str(c.action)) + 2 for c in shown))
    lines += ["", f"{'action':<{width}}{'schedule':<28}{'predicted ms':>13}{'MiB':>10}  quality"]
    lines += [f"{str(c.action):<{width}}{c.label.split(' ', 1)[1]:<28}{c.predicted_ms:>13.2f}"
              f"{c.payload_bytes / sizes.MIB:>10.2f}  {c.quality}" for c in shown]
    lines.append(f"({len(shown)} of {len(cands)} candidates: the {top} fastest action-schedule "
                 "pairs, each at its best chunk count, the fastest of each precision and kind, "
                 "and the choice; --json for all, with phases)")
    if result.note:
        lines.append(result.note)
    return "\n".join(lines)
