"""What `rekv sweep` runs: its presets, the experiments of each model, and the dry run's plan
and wall-time estimate (`rekv sweep --dry-run`).

A sweep runs one process pair (`sweep.Pair`) for all its models, model after model: each model's
start profiles, its grid over every length and link block, its crossover links, Fig. 3 and batch
runs, one `Experiment` after another, with each model's weights built once per process. The
sweep (measured start profiles) and the dry run (analytic stand-ins for them) build each model's
experiments with the same functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from rekv_jax.action import Action
from rekv_jax.config import ModelConfig
from rekv_jax.mode import PAPER_SCHEDULES, Interval, Mode, PrefillMode, Schedule, run_chunks
from rekv_jax.model.loader import load_config
from rekv_jax.planning import costmodel
from rekv_jax.planning.planner import PAPER_LINK_GBPS, analytic_profile
from rekv_jax.study.experiment import Experiment, total_handoffs

# The paper's H100 path (§4, Table 3; Qwen2.5-7B, 8K): one BF16 KV layer (16 MiB) takes 7.23 ms
# on the 2.32 GB/s link, and one suffix layer about 6.3 ms (216.31 ms sequential = 25.3 ms
# boundary + 15 x 7.23 ms prefix + 13 suffix layers + join). Link time per BF16 layer over suffix
# time per layer is therefore ~1.15; the CPU preset paces its link to the same ratio.
PAPER_LINK_TO_SUFFIX = 1.15


@dataclasses.dataclass(frozen=True)
class SweepPreset:
    """Where a sweep runs: its models, prompt lengths, cut grid, schedules, transport and link."""

    models: tuple[str, ...]
    lengths: tuple[int, ...]
    suffix_lens: tuple[int, ...]  # fixed r grid of recompute-only and joint actions
    transport: str
    link_gbps: float | None  # None: calibrate to PAPER_LINK_TO_SUFFIX on this machine
    crossover_factors: tuple[float, ...]  # crossover links, as multiples of the sweep's link
    joint_bits: tuple[int, ...] = (8, 4)
    # None: the fixed `suffix_lens` grid; k: per precision, the balanced cut (Prop. 2) of a
    # profile measured at the start of the run, and k cuts either side (replaces suffix_lens)
    cut_spread: int | None = None
    unpaced_block: bool = False  # also run the grid over the unpaced link, as its own block
    prompt_length: int | None = None  # Fig. 3: prompt to first token at this length, per model
    batch_model: str | None = None  # batch 2 and 4 at the longest length: joint vs Q8 transfer
    batches: tuple[int, ...] = (2, 4)
    schedules: tuple[str, ...] = PAPER_SCHEDULES  # of the grid's joint actions (Table 3: both)
    chunks: int = 1  # token chunks of the `chunked` schedule, when it is among the schedules
    machine: str = "cpu"  # what it runs on: its start-up and compile costs (`COSTS`)
    reps: int = 30  # timed handoffs per action, unless `rekv sweep --reps` says otherwise

    def __post_init__(self) -> None:
        if self.cut_spread is None and len(set(self.suffix_lens)) < 2:
            raise ValueError("a sweep needs at least two suffix lengths to fit its cost model")
        if (self.prompt_length is not None or self.batch_model is not None) and (
                self.cut_spread is None or self.prompt_length not in (None, *self.lengths)
                or self.batch_model not in (None, *self.models)):
            raise ValueError("Fig. 3 and batch runs take their cut from a start profile: they "
                             "need cut_spread, a prompt length among the lengths and a batch "
                             "model among the models")

    @property
    def mid_length(self) -> int:
        """The length of the link calibration and the crossover runs."""
        return self.lengths[len(self.lengths) // 2]


_GPU = SweepPreset(
    models=("qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b"), lengths=(512, 2048, 8192),
    suffix_lens=(), transport="transfer-server", link_gbps=PAPER_LINK_GBPS,
    crossover_factors=(0.5, 1.0, 4.0, 16.0), cut_spread=1, unpaced_block=True,
    prompt_length=8192, batch_model="qwen2.5-7b", machine="gpu")

SWEEP_PRESETS = {
    # Scaled: 6-layer models at 128-512 tokens on 2 CPU cores. Two suffix lengths far apart keep
    # the fit well posed: refitting a full run's records, r = {1, 4} erred 7.0% (median over
    # actions), {1, 2, 4} 7.6%, and {1, 2} 20.5% (cuts 4 and 5 barely separate per-layer from
    # fixed costs).
    "cpu": SweepPreset(models=("tiny", "tiny-qwen3"), lengths=(128, 256, 512),
                       suffix_lens=(1, 4), transport="transfer-server", link_gbps=None,
                       crossover_factors=(0.25, 1.0, 4.0)),
    # The paper's shapes (synthetic weights, one layer's weights repeated) on a GPU per side, or
    # one GPU shared with a memory share each (`launch.environments.pair_environments`), over the
    # transfer-server transport, paced to the paper's 2.32 GB/s, then unpaced; Fig. 3 at 8K per
    # model, batch 2 and 4 at 8K for Qwen2.5-7B. Its duration: `rekv sweep --dry-run`.
    "gpu": _GPU,
    # The paper's Table 1 / Fig. 2 / Table 3 at Qwen2.5-7B's proportions (`tiny-7b`: 28 layers,
    # B_H / B_KV = 3.5) on a 2-core CPU, each side on its own core (the launcher's default):
    # the link paced to the paper's ratio, calibrated on the decode side's core at 512 tokens.
    # The grid is the balanced one of a start profile per length (BF16 recompute and joint Q8
    # near c*, the paper's Table 1 mechanisms); no crossover, Fig. 3 or batch runs. Joint
    # actions also run the token-chunked boundary, in 2 chunks, with Q8 also at the cut the
    # chunked schedule is predicted fastest at. 16 reps keep the run within 12 minutes on two
    # idle cores (its duration: results/study.md).
    "cpu-paper": SweepPreset(models=("tiny-7b",), lengths=(256, 512), suffix_lens=(),
                             transport="transfer-server", link_gbps=None, crossover_factors=(),
                             joint_bits=(8,), cut_spread=0,
                             schedules=tuple(Schedule), chunks=2, reps=16),
}

# `--quick`: the same study on fewer models, lengths and cuts (use with fewer reps). The GPU
# one is sized by the dry run's estimate to fit 8 minutes of one GPU (tests/test_sweep_plan.py),
# which Qwen2.5-3B as well would not.
QUICK_PRESETS = {
    "cpu": dataclasses.replace(SWEEP_PRESETS["cpu"], models=("tiny",), lengths=(128,),
                               crossover_factors=(1.0, 4.0)),
    "cpu-paper": dataclasses.replace(SWEEP_PRESETS["cpu-paper"], lengths=(256,)),
    "gpu": dataclasses.replace(_GPU, models=("qwen2.5-7b",), lengths=(8192,),
                               crossover_factors=(1.0, 4.0), batches=(4,), cut_spread=0),
}


def action_grid(cfg: ModelConfig, suffix_lens: tuple[int, ...], joint_bits: tuple[int, ...]
                ) -> list[Action]:
    """BF16 / Q8 / Q4 transfer-only, BF16 recompute-only and joint actions over the r grid, and
    full recomputation."""
    L = cfg.num_layers
    rs = [r for r in suffix_lens if 0 < r < L]
    actions = [Action(b, L, L) for b in (16, 8, 4)]
    actions += [Action(b, L - r, L) for b in (16, *joint_bits) for r in rs]
    return actions + [Action(16, 0, L)]


def balanced_grid(prof: costmodel.Profile, joint_bits: tuple[int, ...], spread: int = 1,
                  chunks: int = 1) -> list[Action]:
    """BF16 / Q8 / Q4 transfer-only; per precision (BF16: recompute-only) the profile's balanced
    cuts (Prop. 2) and `spread` interior cuts either side; `chunks` > 1: per joint precision also
    the cut predicted fastest in that many token chunks (`chunked_cut`: an earlier start of the
    suffix moves it to longer suffixes); and full recomputation.

    The fit of its records needs two distinct interior cuts (the suffix's fixed and per-layer
    costs) and, per precision, one besides `c = L` (the prefix's): when every balanced cut is
    the same one, BF16 also runs at its nearest interior neighbour (with L = 2 there is none)."""
    L = prof.num_layers
    actions = [Action(b, L, L) for b in (16, 8, 4)]
    for bits in (16, *joint_bits):
        cuts = prof.balanced_cut(bits)[1]
        grid = set(range(min(cuts) - spread, max(cuts) + spread + 1))
        if chunks > 1 and bits != 16:
            grid.add(chunked_cut(prof, bits, chunks))
        actions += [Action(bits, c, L) for c in sorted(grid) if 0 < c < L]
    interior = {a.cut for a in actions if 0 < a.cut < L}
    if len(interior) == 1 and L > 2:
        (c,) = interior
        near = c + 1 if c + 1 < L else c - 1
        actions.insert(3 + (near > c), Action(16, near, L))  # BF16's cuts stay ascending
    return actions + [Action(16, 0, L)]


def best_cut(prof: costmodel.Profile, bits: int) -> int:
    """The interior cut of `bits` the profile predicts fastest overlapped (Prop. 2's candidates)."""
    L = prof.num_layers
    return min(prof.balanced_cut(bits)[1],
               key=lambda c: costmodel.predicted_ms(prof, Mode.of(Action(bits, c, L))))


def chunked_cut(prof: costmodel.Profile, bits: int, chunks: int) -> int:
    """The interior cut of `bits` the profile predicts fastest under the chunked schedule."""
    L = prof.num_layers
    return min(range(1, L), key=lambda c: costmodel.predicted_ms(
        prof, Mode.of(Action(bits, c, L), "chunked", chunks=chunks)))


def far_cuts(num_layers: int) -> list[int]:
    """Two interior cuts far apart (L/3 and 2L/3): the profile's grid, and the sweep's where a
    start profile could not be fitted."""
    L = num_layers
    return sorted({max(1, L // 3), max(1, 2 * L // 3)} - {L})


def profile_experiment(model: str, seq_len: int, transport: str, link_gbps: float | None,
                       reps: int = 5, warmup: int = 2) -> Experiment:
    """`rekv profile`'s run: short sequential handoffs at two cuts per precision."""
    L = load_config(model).num_layers
    actions = [Action(b, L, L) for b in (16, 8, 4)] + [
        Action(b, c, L) for b in (16, 8, 4) for c in far_cuts(L)] + [Action(16, 0, L)]
    return Experiment(model=model, seq_len=seq_len, actions=tuple(actions),
                      schedules=("sequential",), transport=transport, link_gbps=link_gbps,
                      warmup=warmup, reps=reps)


def start_experiments(preset: SweepPreset, model: str, link: float) -> list[Experiment]:
    """The start profiles of `model`, one per length (none for a fixed grid)."""
    if preset.cut_spread is None:
        return []
    return [profile_experiment(model, s, preset.transport, link) for s in preset.lengths]


def suffix_lens(preset: SweepPreset, model: str) -> tuple[int, ...]:
    """The fixed r grid of `model`: the preset's, or, in a sweep of balanced grids whose start
    profile is missing, the suffixes of `far_cuts` (far apart: the fit stays well posed)."""
    if preset.cut_spread is None:
        return preset.suffix_lens
    L = load_config(model).num_layers
    return tuple(L - c for c in reversed(far_cuts(L)))


def grid_experiments(preset: SweepPreset, model: str, link: float,
                     start: Mapping[int, costmodel.Profile], reps: int, warmup: int
                     ) -> list[Experiment]:
    """`model`'s grid runs: per link block (paced, then unpaced) and length, the balanced grid
    of its start profile (`start`: length -> profile), else the fixed grid; both schedules."""
    chunks = run_chunks(preset.schedules, PrefillMode.FULL, preset.chunks or 1)

    def actions(s: int) -> list[Action]:
        if s in start:
            return balanced_grid(start[s], preset.joint_bits, preset.cut_spread, chunks)
        return action_grid(load_config(model), suffix_lens(preset, model), preset.joint_bits)

    return [Experiment(model=model, seq_len=s, actions=tuple(actions(s)),
                       schedules=preset.schedules, chunks=preset.chunks,
                       transport=preset.transport, link_gbps=lk,
                       warmup=warmup, reps=reps)
            for lk in (link, None)[:1 + preset.unpaced_block] for s in preset.lengths]


def tail_experiments(preset: SweepPreset, model: str, link: float,
                     start: Mapping[int, costmodel.Profile],
                     fits: Mapping[int, costmodel.Profile], reps: int, warmup: int
                     ) -> tuple[list[Experiment], list[str]]:
    """After `model`'s grid: the crossover links (the first model, at the middle length), Fig. 3
    and batch runs; and what could not run for want of a profile to take its cut from (`start`,
    else `fits`: the grid's fits on the paced link, length -> profile)."""
    out, skipped = [], []
    L = load_config(model).num_layers
    if model == preset.models[0]:
        lens = suffix_lens(preset, model)
        mid = preset.mid_length
        q8_cut = best_cut(start[mid], 8) if mid in start else L - lens[len(lens) // 2]
        crossover = (Action(16, L, L), Action(8, L, L), Action(8, q8_cut, L), Action(16, 0, L))
        out += [Experiment(model=model, seq_len=mid, actions=crossover,
                           schedules=("overlapped",),
                           transport=preset.transport, link_gbps=round(link * f, 6),
                           warmup=warmup, reps=reps)
                for f in preset.crossover_factors if f != 1.0]
    extra = [(preset.prompt_length, None)] if preset.prompt_length is not None else []
    extra += [(max(preset.lengths), b) for b in preset.batches if preset.batch_model == model]
    for s, b in extra:
        prof = start.get(s) or fits.get(s)
        if prof is None:
            skipped.append(f"{'Fig. 3' if b is None else f'batch {b}'} of {model} at {s}")
        elif b is None:
            out.append(prompt_experiment(model, s, prof, preset.transport, link, reps, warmup))
        else:
            out.append(batch_experiment(model, s, b, prof, preset.transport, link, reps, warmup))
    return out, skipped


def prompt_experiment(model: str, seq_len: int, prof: costmodel.Profile, transport: str,
                      link_gbps: float | None, reps: int = 30, warmup: int = 3) -> Experiment:
    """Fig. 3: prompt to first token of the BF16 joint action (the profile's best BF16 cut),
    sequential and overlapped as paired reps; the prefill worker runs the full prompt."""
    L = prof.num_layers
    return Experiment(model=model, seq_len=seq_len, actions=(Action(16, best_cut(prof, 16), L),),
                      schedules=("sequential", "overlapped"), transport=transport,
                      link_gbps=link_gbps, warmup=warmup, reps=reps, interval=Interval.PROMPT,
                      prefill=PrefillMode.FULL, paired=True)


def batch_experiment(model: str, seq_len: int, batch: int, prof: costmodel.Profile,
                     transport: str, link_gbps: float | None, reps: int = 30, warmup: int = 3
                     ) -> Experiment:
    """`batch` simultaneously ready requests of equal length: joint Q8 at the profile's best Q8
    cut (overlapped) vs Q8 transfer-only."""
    L = prof.num_layers
    return Experiment(model=model, seq_len=seq_len, batch=batch,
                      actions=(Action(8, best_cut(prof, 8), L), Action(8, L, L)),
                      schedules=("overlapped",), transport=transport, link_gbps=link_gbps,
                      warmup=warmup, reps=reps)


# -- the dry run: plan and wall-time estimate ---------------------------------------------------

ProfileOf = Callable[[str, int, int, float], costmodel.Profile]  # (model, length, batch, GB/s)


@dataclasses.dataclass(frozen=True)
class PairCosts:
    """The parts of a sweep's wall time besides its timed handoffs, and where each comes from."""

    startup_s: float  # the pair: both processes, JAX, jax.distributed, the first weights
    compile_s: float  # one model program (`MODEL_PROGRAMS`)
    small_compile_s: float  # one small program (checksums, packing, quantize; `programs`)
    handoff_overhead_ms: float  # per handoff, beyond its timed interval (checks, messages)
    weights_s: float  # each later model's weights (the first model's are in `startup_s`)
    source: str


COSTS = {
    # Start-up and a model program's compile: one-action `rekv handoff` runs of tiny on a
    # loaded 2-core CPU, inflated by that load; a later model's weights: tiny's in a fresh
    # process (results/study.md, "The sweep's cost constants"). The rest is assumed.
    "cpu": PairCosts(40.0, 3.0, 0.3, 20.0, 3.0, "start-up and model-program compile measured "
                     "on a 2-core CPU under load ~6 (one-action handoff run: 52 s; a tiny "
                     "prefill program, before the per-layer model core: 2.4-3.3 s), 3 s per "
                     "later model's weights measured idle; 0.3 s per small program and 20 ms "
                     "per handoff beyond its timed interval: assumed"),
    # Never measured: no GPU has run this code. Guesses for an H100/H200 with autotuning off
    # (`launch.environments.GPU_XLA_FLAGS`) and the shared compile cache.
    "gpu": PairCosts(60.0, 10.0, 1.0, 20.0, 15.0, "ASSUMED, never measured on a GPU: 60 s "
                     "pair start-up (CUDA, jax.distributed, synthetic weights), 15 s per later "
                     "model's weights, 10 s per model program and 1 s per small program to "
                     "compile, 20 ms per handoff beyond its timed interval"),
}


# A CPU's memory rate, assumed by the dry run's roofline (quantize, restore; not measured)
CPU_MEMORY_GBPS = 10.0


# The model core's programs per prompt shape, whatever the cut (`model.py`)
MODEL_PROGRAMS = ("embed", "layer", "head")
# Small programs (checksums, packing, quantize and restore of a phase's buffers) the dry run
# charges each new action: an upper bound (a new cut of a warm model compiles none, and CPU
# buffers are checksummed by numpy, `transport.checksums`), so the dry run errs long on CPU.
SMALL_PROGRAMS_PER_ACTION = 5


def programs(experiments: list[Experiment]) -> tuple[set[tuple], set[tuple]]:
    """(model programs, small programs) a model's experiments compile: per prompt shape
    (length, batch),
    `MODEL_PROGRAMS`; per distinct action at a shape, SMALL_PROGRAMS_PER_ACTION."""
    model, small = set(), set()
    for e in experiments:
        shape = (e.seq_len, e.batch)
        model |= {(*shape, p) for p in MODEL_PROGRAMS}
        small |= {(*shape, a.bits, a.cut, i) for a in e.actions
                  for i in range(SMALL_PROGRAMS_PER_ACTION)}
    return model, small


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """One model's part of a sweep: its experiments, in run order (on the sweep's one pair)."""

    model: str
    experiments: tuple[Experiment, ...]

    @property
    def handoffs(self) -> int:
        return sum(total_handoffs(e) for e in self.experiments)

    @property
    def programs(self) -> tuple[int, int]:
        """(model programs, small programs) it compiles."""
        model, small = programs(list(self.experiments))
        return len(model), len(small)


def plan_models(preset: SweepPreset, link: float, reps: int, warmup: int, profile_of: ProfileOf
                ) -> list[ModelPlan]:
    """What a sweep of `preset` runs, per model, with `profile_of` standing in for every start
    profile and grid fit (the sweep measures those, so its balanced cuts may differ)."""
    plans = []
    for m in preset.models:
        start = ({s: profile_of(m, s, 1, link) for s in preset.lengths}
                 if preset.cut_spread is not None else {})
        fits = {s: profile_of(m, s, 1, link) for s in preset.lengths}
        tail, _ = tail_experiments(preset, m, link, start, fits, reps, warmup)
        plans.append(ModelPlan(m, tuple(start_experiments(preset, m, link)
                                        + grid_experiments(preset, m, link, start, reps, warmup)
                                        + tail)))
    return plans


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A sweep's wall time from its parts (seconds)."""

    pairs: int  # process pairs started (one for the whole sweep)
    experiments: int
    handoffs: int
    programs: tuple[int, int]  # model programs, small programs
    startup_s: float  # pairs x start-up + each later model's weights
    compile_s: float  # programs x their compile times
    handoff_s: float  # sum of (warmup + reps) x (predicted median + overhead), per action

    @property
    def total_s(self) -> float:
        return self.startup_s + self.compile_s + self.handoff_s


def estimate(plans: list[ModelPlan], costs: PairCosts, link: float, profile_of: ProfileOf
             ) -> Estimate:
    """The wall time of a sweep of `plans` on one pair: its start-up, compiles, and every handoff
    at `profile_of`'s predicted median for its action, schedule and interval (an unpaced run
    priced at `link`)."""
    handoff_ms = 0.0
    for plan in plans:
        for e in plan.experiments:
            prof = profile_of(e.model, e.seq_len, e.batch, e.link_gbps or link)
            handoff_ms += (e.warmup + e.reps) * sum(
                costmodel.predicted_ms(prof, mode) + costs.handoff_overhead_ms
                for a in e.actions for mode in e.modes(a))
    model = sum(p.programs[0] for p in plans)
    small = sum(p.programs[1] for p in plans)
    pairs = int(bool(plans))
    startup_s = pairs * costs.startup_s + max(0, len(plans) - 1) * costs.weights_s
    return Estimate(pairs, sum(len(p.experiments) for p in plans),
                    sum(p.handoffs for p in plans), (model, small), startup_s,
                    model * costs.compile_s + small * costs.small_compile_s, handoff_ms / 1e3)


def analytic_profile_of(**rates: float) -> ProfileOf:
    """`planner.analytic_profile` of each model, length, batch and link, at `rates`
    (tflops, hbm_gbps; default: the planner's H100-class roofline)."""
    return lambda m, s, b, lk: analytic_profile(load_config(m), s, b, lk, **rates)


def estimate_text(title: str, plans: list[ModelPlan], est: Estimate, costs: PairCosts,
                  profile_note: str, unpaced: bool) -> str:
    """The dry run's output: each model's experiments, handoffs and programs; the estimate's
    parts; what is measured and what is assumed (`unpaced`: how an unpaced block is priced)."""
    lines = [title]
    lines += [f"  {p.model}: {len(p.experiments)} experiments, {p.handoffs} handoffs, "
              f"{p.programs[0]} model + {p.programs[1]} small programs to compile"
              for p in plans]
    (model, small) = est.programs
    lines += [f"total: {est.pairs} pair, {est.experiments} experiments, {est.handoffs} "
              f"handoffs, {model} model + {small} small programs",
              f"estimate: {est.total_s:.0f} s ({est.total_s / 60:.1f} min) = {est.pairs} pair x "
              f"{costs.startup_s:g} s start-up + {max(0, len(plans) - 1)} later models x "
              f"{costs.weights_s:g} s weights ({est.startup_s:.0f} s) + compiles "
              f"({est.compile_s:.0f} s: {model} x {costs.compile_s:g} s + {small} x "
              f"{costs.small_compile_s:g} s) + handoffs "
              f"({est.handoff_s:.0f} s: (warmup + reps) x predicted median + "
              f"{costs.handoff_overhead_ms:g} ms, per action and schedule)",
              f"  costs: {costs.source}", f"  predicted medians: {profile_note}",
              "  start profiles and fits are these predictions, so the measured balanced cuts "
              "may differ" + "; unpaced runs are priced at the paced link" * unpaced]
    return "\n".join(lines)
