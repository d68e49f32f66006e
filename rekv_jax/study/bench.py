"""Speed of the quantizer and the model on this device, against this device's own peaks (JSON).

Each benchmark measures its yardstick in the same run on the same device: the quantizer against
a jitted copy of the same bytes (bandwidth counts bytes read plus written), the model against a
BF16 matmul (FLOPs from `sizes.layer_flops`) and its decode step against (weight + KV bytes) /
copy bandwidth. `scripts/bench_quant.py`, `scripts/bench_model.py` and `rekv doctor` call these.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant as kernels
from rekv_jax import quantize as Q
from rekv_jax import sizes
from rekv_jax.config import ModelConfig
from rekv_jax.kv import KVCache
from rekv_jax.model.loader import synthetic_model
from rekv_jax.model.transformer import (
    attention_backend,
    decode_step,
    prefill,
    run_prefix,
    run_suffix,
)
from rekv_jax.study.device import Device


def device_info() -> dict[str, str]:
    """Platform, device kind and JAX version of the device (`Device.to_json`)."""
    return Device.here().to_json()


K = TypeVar("K", bound=Hashable)


def best_seconds(ops: dict[K, tuple[Callable, list]], trials: int, reps: int, wait_each: bool
                 ) -> dict[K, float]:
    """Best over `trials` of the mean time of one pass of each `fn` over its inputs; the ops take
    turns within a trial, so load from other processes hits them alike."""
    for fn, inputs in ops.values():
        jax.block_until_ready([fn(x) for x in inputs])  # compile and warm up
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(trials):
        for name, (fn, inputs) in ops.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                for x in inputs:
                    out = fn(x)
                    if wait_each:
                        jax.block_until_ready(out)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    return best


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of `fn()` (waited for) over `reps` runs after one warm-up run."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_gbps(nbytes: int, reps: int) -> float:
    """Copy bandwidth of this device (bytes read + written per second / 1e9), jitted `jnp.copy`."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    return 2 * x.nbytes / median_seconds(lambda: _copy(x), reps) / 1e9


def matmul_tflops(n: int, reps: int) -> float:
    """Rate of one BF16 `[n, n] @ [n, n]` matmul on this device, TFLOP/s."""
    a = jnp.ones((n, n), jnp.bfloat16)
    return 2 * n**3 / median_seconds(lambda: _matmul(a, a), reps) / 1e12


_copy = jax.jit(jnp.copy)
_matmul = jax.jit(jnp.matmul)


# ---------------------------------------------------------------------------- quantizer


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Pallas launch parameters (ignored by the XLA reference)."""

    block_elements: int = kernels.BLOCK_ELEMENTS
    num_warps: int = kernels.NUM_WARPS


@dataclasses.dataclass(frozen=True)
class OpRate:
    """One quantizer op's speed over the prefix KV (bandwidth: bytes read plus written)."""

    gbps: float
    frac_of_copy: float  # of the copy bandwidth measured in the same run
    ms_per_layer: float  # K and V of one layer

    @classmethod
    def of(cls, nbytes: int, seconds: float, copy_gbps: float, layers: int) -> OpRate:
        gbps = nbytes / seconds / 1e9
        return cls(gbps, gbps / copy_gbps, seconds * 1e3 / layers)


@dataclasses.dataclass(frozen=True)
class QuantRates:
    """Both directions of the quantizer at one bit width."""

    quantize: OpRate
    dequantize: OpRate

    def by_op(self) -> dict[str, OpRate]:
        return {"quantize": self.quantize, "dequantize": self.dequantize}

    def to_json(self) -> dict[str, float]:
        return {f"{op}_{k}": v for op, rate in self.by_op().items()
                for k, v in dataclasses.asdict(rate).items()}


@dataclasses.dataclass(frozen=True)
class QuantRun:
    """One tuning's quantize and dequantize speeds at 8 and 4 bits."""

    tuning: Tuning | None  # None: the XLA reference (nothing to tune)
    rates: dict[int, QuantRates]  # bits -> speeds
    meets_target: bool  # every op reaches the target fraction of copy

    def to_json(self) -> dict[str, Any]:
        tuning = {} if self.tuning is None else dataclasses.asdict(self.tuning)
        return {**tuning, **{f"q{b}": r.to_json() for b, r in self.rates.items()},
                "meets_target": self.meets_target}


@dataclasses.dataclass(frozen=True)
class QuantBench:
    """`bench_quant`'s result: the quantizer's speed per tuning beside the copy bandwidth."""

    device: dict[str, str]  # device_info()
    backend: str
    model: str
    kv_shape: tuple[int, ...]  # [c, B, S, K, H] of the prefix KV timed
    layers_per_call: int
    input_mib: float
    copy_gbps: float
    target_frac_of_copy: float
    tunings: tuple[QuantRun, ...]
    rms_rel_err_gaussian: dict[str, float]  # "q8" / "q4" -> round-trip error on the inputs

    @property
    def meets_target(self) -> bool:
        return any(r.meets_target for r in self.tunings)

    def to_json(self) -> dict[str, Any]:
        return {"bench": "quant", **self.device, "backend": self.backend, "model": self.model,
                "kv_shape": list(self.kv_shape), "dtype": "bfloat16",
                "layers_per_call": self.layers_per_call, "input_mib": self.input_mib,
                "copy_gbps": self.copy_gbps, "target_frac_of_copy": self.target_frac_of_copy,
                "tunings": [r.to_json() for r in self.tunings], "meets_target": self.meets_target,
                "rms_rel_err_gaussian": self.rms_rel_err_gaussian}


def _quant_ops(backend: str, bits: int, tuning: Tuning) -> tuple[Callable, Callable]:
    """(quantize, dequantize) of one backend and tuning, without the finiteness check."""
    if backend == "xla":
        return (functools.partial(kernels.quantize_xla, bits=bits, group_size=sizes.GROUP_SIZE),
                kernels.dequantize_xla)
    launch = dict(dataclasses.asdict(tuning), interpret=backend == "pallas-interpret")
    return (functools.partial(kernels.quantize, bits=bits, group_size=sizes.GROUP_SIZE, **launch),
            functools.partial(kernels.dequantize, **launch))


def bench_quant(cfg: ModelConfig, seq_len: int, batch: int = 1, layers: int | None = None,
                backend: str | None = None, trials: int = 10, reps: int | None = None,
                tunings: Sequence[Tuning] = (Tuning(),)) -> QuantBench:
    """Quantize/dequantize throughput of the prefix KV (`layers` layers, K and V, bf16) per
    tuning, as a fraction of the copy bandwidth. Target 0.5 on CPU (XLA), 0.8 on a GPU (Pallas).

    On CPU each call handles one layer and is waited for, so the allocator reuses its buffers
    (fresh multi-MiB buffers cost page faults that would dominate both sides); on a GPU a call
    handles all layers and a trial waits once, so launch overhead does not dominate.
    """
    backend = Q.resolve_backend(backend)
    if backend == "xla":
        tunings = tunings[:1]  # nothing to tune
    layers = layers or cfg.num_layers
    on_cpu = jax.default_backend() == "cpu"
    reps = reps or (1 if on_cpu else 20)
    per_call = 1 if on_cpu else layers
    shape = (per_call, batch, seq_len, cfg.num_kv_heads, cfg.head_dim)  # [c, B, S, K, H]
    keys = jax.random.split(jax.random.key(0), 2 * layers // per_call)
    xs = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]  # K and V chunks
    in_bytes = sum(x.nbytes for x in xs)
    ops: dict[Hashable, tuple[Callable, list]] = {"copy": (_copy, xs)}  # (tuning, bits, op)
    moved = {}
    for b in (8, 4):
        quantize, dequantize = _quant_ops(backend, b, tunings[0])
        qs = [quantize(x) for x in xs]
        moved[b] = in_bytes + sum(q.nbytes for q in qs)  # bf16 in, codes + scales out (or back)
        for i, t in enumerate(tunings):
            quantize, dequantize = _quant_ops(backend, b, t)
            ops[i, b, "quantize"], ops[i, b, "dequantize"] = (quantize, xs), (dequantize, qs)
    seconds = best_seconds(ops, trials, reps, on_cpu)
    copy = 2 * in_bytes / seconds["copy"] / 1e9
    target = 0.5 if on_cpu else 0.8
    runs = []
    for i, t in enumerate(tunings):
        rates = {b: QuantRates(*(OpRate.of(moved[b], seconds[i, b, op], copy, layers)
                                 for op in ("quantize", "dequantize"))) for b in (8, 4)}
        runs.append(QuantRun(None if backend == "xla" else t, rates, all(
            op.frac_of_copy >= target for r in rates.values() for op in r.by_op().values())))
    return QuantBench(device_info(), backend, cfg.name, (layers, *shape[1:]), per_call,
                      in_bytes / sizes.MIB, copy, target, tuple(runs),
                      {f"q{b}": rms_rel_err(xs[:2], b, backend) for b in (8, 4)})


def rms_rel_err(xs: list[jax.Array], bits: int, backend: str | None = None) -> float:
    """sqrt(sum (x - deq)^2 / sum x^2) over all tensors after a round trip, in float64."""
    num = den = 0.0
    for x in xs:
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        q = Q.quantize(x, bits, backend=backend)
        d64 = np.asarray(Q.dequantize(q, jnp.float32, backend=backend), np.float64)
        num += float(np.sum((x64 - d64) ** 2))
        den += float(np.sum(x64**2))
    return (num / den) ** 0.5


# ---------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class Rate:
    """One timed program beside the BF16 matmul's rate."""

    ms: float
    ms_per_layer: float
    flops: float
    tflops: float
    frac_of_matmul: float


def _rate(seconds: float, flops: float, layers: int, peak_tflops: float) -> Rate:
    tflops = flops / seconds / 1e12
    return Rate(seconds * 1e3, seconds * 1e3 / max(layers, 1), flops, tflops,
                tflops / peak_tflops)


@dataclasses.dataclass(frozen=True)
class ModelBench:
    """`bench_model`'s result: each program's rate, and the decode step beside its byte bound."""

    device: dict[str, str]  # device_info()
    model: str
    seq_len: int
    batch: int
    attention: str
    matmul_tflops: float  # the yardsticks, measured in the same run
    copy_gbps: float
    prefill: Rate
    cut: int  # run_prefix's layers, L - r
    run_prefix: Rate
    suffix_len: int  # r
    run_suffix: Rate
    capacity: int  # the decode step's cache positions
    decode_step: Rate
    decode_bytes: int  # weights + the whole cache, read once per step
    byte_bound_ms: float  # decode_bytes / copy bandwidth

    @property
    def ratio_to_byte_bound(self) -> float:
        return self.decode_step.ms / self.byte_bound_ms

    def to_json(self) -> dict[str, Any]:
        rate = dataclasses.asdict
        return {"bench": "model", **self.device, "model": self.model, "seq_len": self.seq_len,
                "batch": self.batch, "attention": self.attention, "dtype": "bfloat16",
                "matmul_tflops": self.matmul_tflops, "copy_gbps": self.copy_gbps,
                "prefill": rate(self.prefill),
                "run_prefix": {"cut": self.cut, **rate(self.run_prefix)},
                "run_suffix": {"suffix_len": self.suffix_len, **rate(self.run_suffix)},
                "decode_step": {"capacity": self.capacity, **rate(self.decode_step),
                                "bytes": self.decode_bytes, "byte_bound_ms": self.byte_bound_ms,
                                "ratio_to_byte_bound": self.ratio_to_byte_bound}}


def bench_model(cfg: ModelConfig, seq_len: int, suffix_len: int | None = None,
                capacity: int | None = None, batch: int = 1, reps: int = 10,
                matmul_n: int | None = None, copy_mib: int | None = None) -> ModelBench:
    """Times `prefill`, `run_prefix(L - r)`, `run_suffix(r)` and one `decode_step` at `capacity`
    (default `seq_len + 1`) with synthetic BF16 weights (`loader.synthetic_model`: one shared
    layer when the full stack would exceed 2 GiB),
    as achieved TFLOP/s beside a BF16 matmul and the decode step beside its byte bound."""
    on_cpu = jax.default_backend() == "cpu"
    L = cfg.num_layers
    r = L // 2 if suffix_len is None else suffix_len
    cut = cfg.check_cut(L - r)
    capacity = capacity or seq_len + 1
    params = synthetic_model(cfg).params
    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, cfg.vocab_size, jnp.int32)
    peak = matmul_tflops(matmul_n or (1024 if on_cpu else 8192), reps)
    copy = copy_gbps((copy_mib or (64 if on_cpu else 2048)) * sizes.MIB, reps)

    h_c, _ = run_prefix(cfg, params, tokens, cut)
    shape = (L, batch, capacity, cfg.num_kv_heads, cfg.head_dim)  # [L, B, C, K, H]
    cache = [KVCache.stacked(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))]
    token = tokens[:, -1]

    def step() -> jax.Array:  # the step donates the cache: run the next one on its result
        logits, cache[0] = decode_step(cfg, params, cache[0], token, capacity - 1)
        return logits

    layer, head = sizes.layer_flops(cfg, seq_len, batch), sizes.head_flops(cfg, 1, batch)
    step_flops = L * sizes.layer_flops(cfg, 1, batch, past=capacity - 1) + head
    step_bytes = (sizes.WEIGHT_BYTES * (L * sizes.layer_weight_count(cfg)
                                        + sizes.head_weight_count(cfg))
                  + L * sizes.kv_layer_bytes(cfg, capacity, batch))  # weights + whole cache
    return ModelBench(
        device_info(), cfg.name, seq_len, batch, attention_backend(cfg, jnp.bfloat16), peak, copy,
        prefill=_rate(median_seconds(lambda: prefill(cfg, params, tokens), reps),
                      L * layer + head, L, peak),
        cut=cut, run_prefix=_rate(median_seconds(lambda: run_prefix(cfg, params, tokens, cut),
                                                 reps), cut * layer, cut, peak),
        suffix_len=r, run_suffix=_rate(median_seconds(lambda: run_suffix(cfg, params, h_c, cut),
                                                      reps), r * layer + head, r, peak),
        capacity=capacity, decode_step=_rate(median_seconds(step, reps), step_flops, L, peak),
        decode_bytes=step_bytes, byte_bound_ms=step_bytes / (copy * 1e9) * 1e3)
