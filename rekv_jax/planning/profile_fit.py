"""Fit a cost-model `Profile` to measured phase times (nonnegative least squares).

Every unknown of `rekv_jax.planning.costmodel` is a cost (or 1 / W), so each group of phases is a
nonnegative least-squares problem in them. A record of a chunked handoff (`chunks` N > 1) counts
with the N - 1 extra messages and chunk calls it makes; the per-chunk terms are fitted only when
such records are given (else they stay 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls  # scipy: a dependency of jax

from rekv_jax import sizes
from rekv_jax.action import ACTION_KINDS, Action
from rekv_jax.config import ModelConfig
from rekv_jax.phases import Phases
from rekv_jax.planning.costmodel import Profile, chunk_share


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What the fit needs of one measured summary (`study.records.Summary` has these fields)."""

    model: str
    seq_len: int  # S
    batch: int  # B
    action: Action
    phases_ms: Phases  # the phase medians
    chunks: int = 1  # token chunks (1: unchunked)
    pipelined: bool = False  # a pipelined prefill's (`Mode.streams_chunks`)


def fit_profile(cfg: ModelConfig, records: Sequence[Measurement], hardware: str, link: str
                ) -> Profile:
    """Least-squares profile from measured summaries of one model, length and batch.

    Each record gives its action, the phase medians and, when chunked, its chunks and prefill
    mode. Transfer terms are fitted jointly over the boundary and prefix phases (`h0`,
    `m`, `1 / W`, `restore_b`, `x0_b`; BF16 needs no restore), so `W` is the bandwidth the link
    actually delivered. Pass records measured without contention (the sequential schedule; a
    chunked record's `boundary` is the link time of the ids and all N pieces of `h_c`, its
    `suffix` the sum of its N chunk calls) for per-phase costs that add up. A pipelined record
    gives only its quantize and suffix sums (its link phases interleave). `J` is the median join
    per action kind (over all records for a kind that has none).
    """
    seq_len, batch = _one_setup(cfg, records)
    low = sorted({r.action.bits for r in records if 0 < r.action.cut and r.action.bits < 16},
                 reverse=True)
    wire = _fit_link(cfg, records, seq_len, batch, low)
    quant = [r for r in records if r.action.bits < 16 and r.action.cut > 0]
    q0, *alpha = (_lstsq([[float(r.chunks)] + [float(r.action.cut) if r.action.bits == b else 0.0
                                               for b in low] for r in quant],
                         [r.phases_ms.quantize for r in quant], "quantize times")
                  if low else [0.0])  # [q0 (per call: one per chunk), alpha_b for b in low]
    share = sizes.attention_share(cfg, seq_len)
    r0, gamma, embed, kappa = _fit_suffix(cfg, records, seq_len, share)
    joins = {k: [r.phases_ms.join for r in records if r.action.kind == k] for k in ACTION_KINDS}
    everything = [t for ts in joins.values() for t in ts]  # for a kind without records
    return Profile.for_config(
        cfg, seq_len, batch, hardware=hardware, link=link, link_gbps=1e-6 / wire.inv_w,
        source="fitted",
        quantize_ms={16: 0.0} | dict(zip(low, alpha, strict=True)),
        restore_ms={16: 0.0} | dict(zip(low, wire.restore, strict=True)),
        restore_fixed_ms=dict(zip(low, wire.restore_fixed, strict=True)),
        suffix_layer_ms=gamma, join_ms={k: float(np.median(ts or everything))
                                        for k, ts in joins.items()},
        embed_ms=embed, quantize_fixed_ms=q0, boundary_fixed_ms=wire.h0, message_ms=wire.m,
        suffix_fixed_ms=r0, chunk_layer_ms=kappa, attention_share=share)


def _one_setup(cfg: ModelConfig, records: Sequence[Measurement]) -> tuple[int, int]:
    """The (seq_len, batch) all `records` share; a ValueError where they are not one model's
    records of one length and batch."""
    if not records:
        raise ValueError("fit_profile needs at least one record")
    models = {r.model for r in records}
    if models != {cfg.name}:
        raise ValueError(f"records are for {sorted(models)}, the config is {cfg.name!r}")
    if any(r.action.num_layers != cfg.num_layers for r in records):
        raise ValueError(f"records' actions are not all for {cfg.num_layers} layers")
    keys = {(r.seq_len, r.batch) for r in records}
    if len(keys) != 1:
        raise ValueError(f"records span several (seq_len, batch): {sorted(keys)}")
    return keys.pop()


@dataclasses.dataclass(frozen=True)
class _LinkFit:
    """The transfer terms: `h0`, `m`, `1 / W`, per low precision its restore per layer and
    fixed restore cost."""

    h0: float
    m: float
    inv_w: float
    restore: list[float]
    restore_fixed: list[float]


def _fit_link(cfg: ModelConfig, records: Sequence[Measurement], seq_len: int, batch: int,
              low: list[int]) -> _LinkFit:
    """Messages: unknowns [h0, m, 1/W, restore_b for b in low, x0_b for b in fixed]. The
    boundary phase holds the token IDs, plus h_c for a joint action (in N messages); the prefix
    phase the prefix and its restore. A restore's fixed cost is told apart from its per-layer
    one only over two prefix lengths (e.g. a grid that runs Q4 transfer-only alone): else 0."""
    L = cfg.num_layers
    fixed = [b for b in low
             if len({r.action.cut for r in records if r.action.bits == b and r.action.cut}) > 1]
    b_h, b_tok = sizes.boundary_bytes(cfg, seq_len, batch), sizes.token_bytes(seq_len, batch)
    rows, ys = [], []
    for r in (r for r in records if not r.pipelined):
        c, bits, ph, n = r.action.cut, r.action.bits, r.phases_ms, r.chunks
        rows.append([1.0, n - 1.0, b_tok + (0 < c < L) * b_h] + [0.0] * (len(low) + len(fixed)))
        ys.append(ph.boundary)
        if c > 0:
            rows.append([0.0, 1.0, c * sizes.kv_layer_bytes(cfg, seq_len, batch, bits)]
                        + [c * float(bits == b) for b in low]
                        + [float(bits == b) for b in fixed])
            ys.append(ph.prefix)
    h0, m, inv_w, *rest = _lstsq(rows, ys, "boundary and prefix times")
    if not inv_w > 0:
        raise ValueError("cannot fit a link bandwidth: transfer time does not grow with bytes")
    fixed_of = dict(zip(fixed, rest[len(low):], strict=True))
    return _LinkFit(h0, m, inv_w, rest[:len(low)], [fixed_of.get(b, 0.0) for b in low])


def _fit_suffix(cfg: ModelConfig, records: Sequence[Measurement], seq_len: int, share: float
                ) -> tuple[float, float, float, float]:
    """Suffix: (r0 per call, gamma, embed, kappa per layer of each chunk after the first)."""
    suf = [r for r in records if r.action.cut < cfg.num_layers]
    has_embed = any(r.action.cut == 0 for r in suf)
    has_chunks = any(r.chunks > 1 for r in suf)
    r0, gamma, *extra = _lstsq(
        [[float(r.chunks), r.action.suffix_len * sum(chunk_share(seq_len, i, r.chunks, share)
                                                     for i in range(r.chunks))]
         + ([float(r.action.cut == 0)] if has_embed else [])
         + ([float(r.action.suffix_len * (r.chunks - 1))] if has_chunks else []) for r in suf],
        [r.phases_ms.suffix for r in suf], "suffix times")
    embed = extra.pop(0) if has_embed else 0.0
    kappa = extra.pop(0) if has_chunks else 0.0
    return r0, gamma, embed, kappa


def attention_shares(profiles: Sequence[Profile]) -> list[Profile]:
    """`profiles` of one model at two or more lengths, each with the attention share its γ
    implies: γ(S) = a S + b S² fitted over the lengths (nonnegative), s(S) = b S² / γ(S). FLOPs
    understate it on hardware where attention runs slower than the projections (a CPU:
    results/study.md), and it sets what token chunks save."""
    if len({p.seq_len for p in profiles}) < 2 or len({p.model for p in profiles}) != 1:
        raise ValueError("attention shares need profiles of one model at two or more lengths")
    a, b = _lstsq([[p.seq_len, p.seq_len**2] for p in profiles],
                  [p.suffix_layer_ms for p in profiles], "attention shares")
    return [dataclasses.replace(p, attention_share=min(1.0, b * p.seq_len**2 / p.suffix_layer_ms))
            if p.suffix_layer_ms > 0 else p for p in profiles]


def _lstsq(rows: list[list[float]], ys: list[float], what: str) -> list[float]:
    """Nonnegative least squares. Clipping an unconstrained fit instead would keep the partner
    of a clipped term (a restore's per-call cost of its per-layer one) fitted to the negative
    value: noise in 2 reps of one cut mispredicted a Q4 transfer by +390% that way."""
    a = np.asarray(rows, dtype=np.float64)
    if a.size == 0 or np.linalg.matrix_rank(a) < a.shape[1]:
        raise ValueError(f"not enough distinct cuts/precisions in the records to fit {what}")
    scale = np.abs(a).max(axis=0)  # column scaling: bytes and layer counts differ by 1e9
    coef = nnls(a / scale, np.asarray(ys, dtype=np.float64))[0] / scale
    return [float(v) for v in coef]
