"""`rekv doctor`: a self-check to run on a fresh allocation before trusting any measurement.

Checks, each pass or fail: the Pallas quantization kernels bitwise against the XLA reference
computed on `jax.devices("cpu")`; the suffix bitwise equal to `prefill` at two cuts for each
family (Qwen2, Qwen3, Llama) with this process's attention backend; the quantizer's RMS
round-trip error on Gaussian data within `RMS_ERR_BAND` of its theoretical value (its speed is
reported: a missed target is not a failure); one short two-process handoff whose first tokens
and caches check out; on a GPU, a stream of requests of every kind through the serving workers
(the decode engine with its Pallas paged attention, `check_engine`). The model benchmark is
information (INFO), a measurement, not a verdict.
On a GPU the shapes are real (published configs, synthetic shared-layer weights; a few minutes
on an H100/H200); on CPU the same checks run on small shapes in well under a minute.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant as kernels
from rekv_jax import sizes
from rekv_jax.action import Action
from rekv_jax.config import Llama3RopeScaling, ModelConfig
from rekv_jax.errors import one_line
from rekv_jax.handoff.check import SUFFIX_ACROSS, reference
from rekv_jax.launch.environments import visible_gpus
from rekv_jax.launch.group import run_child
from rekv_jax.model.loader import load_config, synthetic_model
from rekv_jax.model.transformer import (
    attention_backend,
    greedy_decode,
    prefill,
    run_prefix,
    run_suffix,
)
from rekv_jax.serving.member import MemberSetup
from rekv_jax.serving.pages import PoolConfig
from rekv_jax.serving.requests import ServeRequest
from rekv_jax.serving.scripted import Ask, Driven, serve_pair
from rekv_jax.study import bench
from rekv_jax.study.experiment import Experiment
from rekv_jax.study.records import Summary
from rekv_jax.study.sweep import run_experiment
from rekv_jax.transport import TransportError


class Record(Protocol):
    """What a check measured, as it prints in the JSON report."""

    def to_json(self) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one check found: a verdict, a line for a person and the measurements behind them."""

    passed: bool | None  # None: a measurement, not a verdict (printed as INFO)
    detail: str
    data: Record | None = None  # None: the check crashed before measuring


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report: a named, timed Finding."""

    name: str
    passed: bool | None  # None: a measurement, not a verdict (printed as INFO)
    detail: str
    seconds: float
    data: Record | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail,
                "seconds": self.seconds, "data": {} if self.data is None else self.data.to_json()}


@dataclasses.dataclass(frozen=True)
class KernelsData:
    """The Pallas kernels against the reference: the shape tried and what differed."""

    shape: tuple[int, ...]
    mismatches: tuple[str, ...]  # e.g. "q4/bfloat16"

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "mismatches": list(self.mismatches)}


@dataclasses.dataclass(frozen=True)
class ExactData:
    """The split prefill against `prefill` of one model: the cuts tried and those that differ."""

    model: str
    seq_len: int
    attention: str
    cuts: tuple[int, ...]
    differ: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "seq_len": self.seq_len, "attention": self.attention,
                "cuts": list(self.cuts), "differ": list(self.differ)}


@dataclasses.dataclass(frozen=True)
class QuantData:
    """The quantizer benchmark with the round-trip errors it is judged against."""

    bench: bench.QuantBench
    rms_rel_err_expected: dict[str, float]  # "q8" / "q4" -> gaussian_rms_rel_err

    def to_json(self) -> dict[str, Any]:
        return {**self.bench.to_json(), "rms_rel_err_expected": self.rms_rel_err_expected}


@dataclasses.dataclass(frozen=True)
class HandoffData:
    """The two-process handoff's summaries."""

    summaries: tuple[Summary, ...]

    def to_json(self) -> dict[str, Any]:
        return {"summaries": [s.to_json() for s in self.summaries]}


@dataclasses.dataclass(frozen=True)
class Report:
    """The doctor's verdict on this device: every check, and whether those that judge passed."""

    device: dict[str, str]  # bench.device_info()
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks if c.passed is not None)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "doctor", **self.device, "passed": self.passed,
                "checks": [c.to_json() for c in self.checks]}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the checks run on: real shapes on a GPU, small ones on CPU."""

    quant_rows: tuple[int, ...]  # quantizer input [S, K, H] (S odd: ragged blocks)
    families: dict[str, ModelConfig]
    exact_seq_len: int
    exact_cuts: tuple[float, ...]  # as fractions of L (each cut at least 1)
    bench_model: str
    bench_seq_len: int
    handoff_seq_len: int


def _tiny_llama() -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), name="tiny-llama", model_type="llama",
                               qkv_bias=False, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64))


def shapes_for(platform: str) -> Shapes:
    """Real shapes on a GPU, small ones elsewhere."""
    if platform == "gpu":
        return Shapes((8191, 4, 128), {f: ModelConfig.preset(p) for f, p in (
            ("qwen2", "qwen2.5-7b"), ("qwen3", "qwen3-8b"), ("llama", "llama-3.1-8b"))},
            2048, (0.0, 0.5), "qwen2.5-7b", 8192, 1024)
    # the bench_model run reuses the programs the tiny exactness check compiled
    return Shapes((33, 2, 64), {"qwen2": ModelConfig.preset("tiny"),
                                "qwen3": ModelConfig.preset("tiny-qwen3"), "llama": _tiny_llama()},
                  64, (0.5,), "tiny", 64, 64)


def _timed(name: str, fn: Callable[[], Finding]) -> Check:
    t0 = time.perf_counter()
    try:
        found = fn()
    except Exception as e:  # a check that crashes is a failed check, reported with its reason
        found = Finding(False, one_line(e))
    return Check(name, found.passed, found.detail, time.perf_counter() - t0, found.data)


def _same_bits(a: jax.Array, b: jax.Array) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


def check_kernels(shape: tuple[int, ...]) -> Finding:
    """Pallas kernels (interpret mode off a GPU) against the reference on the CPU device."""
    interpret = jax.default_backend() != "gpu"
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    groups = rng.standard_normal((*shape[:-1], shape[-1] // 64, 64))
    groups *= np.exp2(rng.uniform(-30, 12, groups.shape[:-1] + (1,)))  # f16-subnormal scales too
    mismatches = []
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(groups.reshape(shape), dtype)
        for bits in (8, 4):
            ref = kernels.quantize_xla(jax.device_put(x, cpu), bits, sizes.GROUP_SIZE)
            got = kernels.quantize(x, bits, sizes.GROUP_SIZE, interpret=interpret)
            back = kernels.dequantize(got, interpret=interpret)
            same = (_same_bits(got.values, ref.values) and _same_bits(got.scales, ref.scales)
                    and _same_bits(back, kernels.dequantize_xla(ref)))
            if not same:
                mismatches.append(f"q{bits}/{jnp.dtype(dtype).name}")
    detail = f"{shape} bf16+f32 q8+q4 " + ("bitwise" if not mismatches else
                                            f"differ: {', '.join(mismatches)}")
    return Finding(not mismatches, detail, KernelsData(tuple(shape), tuple(mismatches)))


def check_exact(cfg: ModelConfig, seq_len: int, fractions: tuple[float, ...]) -> Finding:
    """prefill vs run_prefix + run_suffix at the cuts `max(1, f * L)`, bitwise (bf16)."""
    params = synthetic_model(cfg).params
    tokens = jax.random.randint(jax.random.key(1), (1, seq_len), 0, cfg.vocab_size, jnp.int32)
    kv, logits = prefill(cfg, params, tokens)
    cuts, bad = [max(1, int(f * cfg.num_layers)) for f in fractions], []
    for cut in cuts:
        h_c, prefix = run_prefix(cfg, params, tokens, cut)
        suffix, suffix_logits = run_suffix(cfg, params, h_c, cut)
        pairs = [(prefix.k, kv.k[:cut]), (prefix.v, kv.v[:cut]), (suffix.k, kv.k[cut:]),
                 (suffix.v, kv.v[cut:]), (suffix_logits, logits)]
        if not all(_same_bits(a, b) for a, b in pairs):
            bad.append(cut)
    backend = attention_backend(cfg, jnp.bfloat16)
    detail = f"{cfg.name} S={seq_len} {backend} cuts {cuts}: " + (
        "bitwise" if not bad else f"differ at cuts {bad}")
    return Finding(not bad, detail, ExactData(cfg.name, seq_len, backend, tuple(cuts),
                                              tuple(bad)))


# Measured / expected RMS error may depart this far from 1. bench_quant's bf16 Gaussians have
# light tails (smaller group maxima), measured 1.5-3.5% under the estimate; a quantizer that
# truncates instead of rounding doubles the error, a wrong scale or code layout does worse.
RMS_ERR_BAND = 0.1
CHECKS_TIMEOUT_S = 3600.0  # the single-process checks, real shapes on a GPU included


def gaussian_rms_rel_err(bits: int, group_size: int = sizes.GROUP_SIZE) -> float:
    """Expected RMS relative round-trip error of the contract on N(0, 1) data, from first
    principles: in each group all but the max (restored exactly) carry a uniform rounding error
    of variance s^2 / 12, s = max|x| / qmax, so err^2 = (G - 1) / G * E[max^2] / (12 qmax^2);
    E[max^2] of G half-normals is the integral of 2 m P(max > m)."""
    m = np.linspace(0.0, 12.0, 12001)
    below = np.array([math.erf(v / math.sqrt(2.0)) for v in m]) ** group_size
    f = 2 * m * (1 - below)
    e_max2 = float(np.sum((f[1:] + f[:-1]) / 2 * np.diff(m)))  # trapezoid rule (numpy >= 1.26)
    return math.sqrt((group_size - 1) / group_size * e_max2 / (12 * kernels.QMAX[bits] ** 2))


def check_bench_quant(cfg: ModelConfig, seq_len: int) -> Finding:
    """bench_quant summary; passes when Q8's and Q4's RMS round-trip error on Gaussian data lie
    within `RMS_ERR_BAND` of `gaussian_rms_rel_err` (the 0.8 / 0.5 speed target is reported)."""
    r = bench.bench_quant(cfg, seq_len, trials=3)
    fracs = {f"q{b}/{op}": rate.frac_of_copy for b, rates in r.tunings[0].rates.items()
             for op, rate in rates.by_op().items()}
    expected = {f"q{b}": gaussian_rms_rel_err(b) for b in (8, 4)}
    measured = r.rms_rel_err_gaussian
    ok = all(abs(measured[k] / expected[k] - 1) <= RMS_ERR_BAND for k in expected)
    detail = (f"{r.backend} copy {r.copy_gbps:.1f} GB/s; of copy: " + ", ".join(
        f"{k} {v:.2f}" for k, v in fracs.items()) + f"; target {r.target_frac_of_copy} "
        f"{'met' if r.meets_target else 'NOT met'}; rms err " + ", ".join(
        f"{k} {measured[k]:.3g} (expected {v:.3g})" for k, v in expected.items())
        + f" within {RMS_ERR_BAND:.0%}: {'yes' if ok else 'NO'}")
    return Finding(ok, detail, QuantData(r, expected))


def check_bench_model(cfg: ModelConfig, seq_len: int) -> Finding:
    """bench_model summary: information, not a verdict (no speed is right on every machine)."""
    r = bench.bench_model(cfg, seq_len, reps=3)
    s = r.run_suffix
    detail = (f"{cfg.name} S={seq_len} {r.attention}: suffix {s.ms_per_layer:.2f} ms/layer "
              f"= {s.frac_of_matmul:.2f} of matmul ({r.matmul_tflops:.1f} TFLOP/s); "
              f"decode {r.decode_step.ms:.2f} ms = {r.ratio_to_byte_bound:.2f}x byte bound")
    return Finding(None, detail, r)


def check_handoff(seq_len: int) -> Finding:
    """A short two-process handoff (tiny model): first tokens and caches must check out, and
    the decode side's suffix must equal the prefill process's own (by checksum) on every rep.

    It runs as a sweep's experiments do (`sweep.run_experiment`: both sides spawned)."""
    action = Action.parse("q8:r=2", ModelConfig.preset("tiny").num_layers)
    exp = Experiment(model="tiny", seq_len=seq_len, actions=(action,),
                     schedules=("overlapped",),
                     warmup=1, reps=3, timeout=120.0)
    try:
        summaries = run_experiment(exp, timeout=4 * exp.timeout)
    except (ValueError, TransportError, TimeoutError) as e:
        return Finding(False, str(e))
    ok = len(summaries) == 1 and all(  # the suffix bitwise, and the same in both processes
        s.first_token_match and s.cache_check.startswith("suffix bitwise")
        and s.cache_check.endswith(SUFFIX_ACROSS) for s in summaries)
    detail = "; ".join(f"{s.action} {s.median_ms:.1f} ms, {s.cache_check}" for s in summaries)
    return Finding(ok, detail, HandoffData(tuple(summaries)))


@dataclasses.dataclass(frozen=True)
class EngineData:
    """The serving stream through the decode engine: per request its action, what it
    produced, its cache check and the single-process greedy tokens."""

    actions: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    want: tuple[tuple[int, ...], ...]
    checks: tuple[str, ...]
    errors: tuple[str | None, ...]
    used_pages: int

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


ENGINE_MODEL = "tiny-7b"  # 28 layers: a decode step and a suffix chunk of real depth
ENGINE_ACTIONS = ("bf16:full", "bf16:r=8", "q8:r=8", "bf16:recompute", "q8:full", "q4:r=12")
ENGINE_NEW_TOKENS = 16


def engine_asks(seq_len: int, vocab: int) -> list[Ask]:
    """Requests of every kind and two lengths, 0.2 s apart, each suffix in chunks of 128."""
    rng = np.random.default_rng(0)
    return [Ask(ServeRequest(i, rng.integers(0, vocab, seq_len // (1 + i % 2)).tolist(),
                             ENGINE_NEW_TOKENS, arrival_s=0.2 * i), action, 128)
            for i, action in enumerate(ENGINE_ACTIONS)]


def greedy_references(model: str, asks: list[Ask]) -> list[tuple[int, ...]]:
    """Each request's greedy tokens on the single-process reference of its mode."""
    m = synthetic_model(ModelConfig.preset(model))
    out = []
    for ask in asks:
        mode = ask.mode(m.cfg.num_layers)
        tokens = jnp.asarray([ask.request.tokens], jnp.int32)
        kv, logits = reference(m.cfg, m.params, tokens, mode.reference, mode.action.cut)
        out.append(tuple(np.asarray(greedy_decode(m.cfg, m.params, kv, logits,
                                                  ask.request.max_new_tokens))[0].tolist()))
    return out


def engine_verdict(asks: list[Ask], driven: Driven, want: list[tuple[int, ...]]) -> Finding:
    """Passes when no request failed, every request's pages pass their cache check, every
    first token is the single process's and the pool ends empty. How many requests decoded
    all their tokens as the single process does is reported, not judged: the engine's paged
    attention on a GPU (Pallas) has its own bits."""
    served = driven.served
    tokens = tuple(s.finished.tokens if s.finished else () for s in served)
    checks = tuple(s.finished.checks if s.finished else "" for s in served)
    errors = tuple(s.failure for s in served)
    data = EngineData(tuple(a.action for a in asks), tokens, tuple(want), checks, errors,
                      driven.used_pages)
    failed = [f"{a.action}: {e}" for a, e in zip(asks, errors, strict=True) if e]
    unchecked = [a.action for a, e, c in zip(asks, errors, checks, strict=True)
                 if not e and not c.startswith(("bitwise", "suffix bitwise"))]
    first = [a.action for a, e, t, w in zip(asks, errors, tokens, want, strict=True)
             if not e and t[:1] != w[:1]]
    same = sum(t == w for t, w in zip(tokens, want, strict=True))
    ok = not (failed or unchecked or first) and driven.used_pages == 0
    detail = (f"{len(asks)} requests: " + ("; ".join(
        [*failed, *(f"{a} cache check failed" for a in unchecked),
         *(f"{a} first token differs" for a in first)]) or "every cache check and first token "
        "holds") + f", {same} of {len(asks)} decode as the single process, "
        f"{driven.used_pages} pages left")
    return Finding(ok, detail, data)


def check_engine(seq_len: int) -> Finding:
    """The serving workers (a prefill worker and the decode engine, spawned) through requests
    of every kind arriving while others decode, against single-process references computed in
    a fresh process."""
    asks = engine_asks(seq_len, load_config(ENGINE_MODEL).vocab_size)
    pool = PoolConfig.holding(len(asks) * (seq_len + ENGINE_NEW_TOKENS))
    try:
        driven = serve_pair(MemberSetup(ENGINE_MODEL, pool=pool, check=True, timeout=600.0), asks)
    except (ValueError, TransportError, TimeoutError) as e:
        return Finding(False, str(e))
    want = run_child(greedy_references, ENGINE_MODEL, asks, env=os.environ,
                     what="the engine's references", timeout=CHECKS_TIMEOUT_S)
    return engine_verdict(asks, driven, want)


def run_checks() -> list[Check]:
    """Every check, on this platform's shapes, each in a process spawned for it: the two-process
    handoff first (and on a GPU the serving engine), on the shapes of the platform that
    `visible_gpus` predicts (reported last), then the single-process checks in one fresh
    process (this one starts no JAX backend, whose GPU memory the pair would need)."""
    gpu = bool(visible_gpus())
    guess = shapes_for("gpu" if gpu else "cpu")
    pairs = [_timed("handoff", lambda: check_handoff(guess.handoff_seq_len))]
    if gpu:
        pairs.append(_timed("engine", lambda: check_engine(guess.handoff_seq_len)))
    checks = run_child(single_process_checks, env=os.environ, what="the doctor's checks",
                       timeout=CHECKS_TIMEOUT_S)
    return [*checks, *pairs]


def single_process_checks() -> list[Check]:
    """The kernels, exactness and benchmark checks, on this process's platform's shapes."""
    shapes = shapes_for(jax.default_backend())
    checks = [_timed("pallas_kernels", lambda: check_kernels(shapes.quant_rows))]
    for family, cfg in shapes.families.items():
        checks.append(_timed(f"exact_suffix/{family}",
                             lambda cfg=cfg: check_exact(cfg, shapes.exact_seq_len,
                                                         shapes.exact_cuts)))
    model = ModelConfig.preset(shapes.bench_model)
    checks.append(_timed("bench_quant", lambda: check_bench_quant(model, shapes.bench_seq_len)))
    checks.append(_timed("bench_model", lambda: check_bench_model(model, shapes.bench_seq_len)))
    return checks


def report(checks: list[Check]) -> Report:
    """The device, every check and the overall verdict (of the checks that give one)."""
    return Report(bench.device_info(), tuple(checks))


def print_table(checks: list[Check]) -> None:
    """The readable form: one line per check."""
    width = max(len(c.name) for c in checks)
    for c in checks:
        verdict = "INFO" if c.passed is None else "PASS" if c.passed else "FAIL"
        print(f"{verdict}  {c.name:<{width}}  {c.seconds:6.1f} s  {c.detail}")
