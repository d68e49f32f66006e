"""Medians, quantiles and their 95% percentile-bootstrap confidence intervals for timed
repetitions (paper §3) and served requests.

Separately executed baselines are compared by resampling each sample independently; paired reps
(the same rep index measured under two conditions) are resampled with one shared index set, so a
paired comparison of identical samples has the exact interval [1, 1]. Every function is
deterministic given `seed`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

N_BOOT = 10_000
LEVEL = 0.95


def _sample(xs: Sequence[float], name: str = "sample") -> np.ndarray:
    a = np.asarray(xs, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains a non-finite value")
    return a


def median(xs: Sequence[float]) -> float:
    """The sample median."""
    return float(np.median(_sample(xs)))


def _interval(boot: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _boot_medians(a: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Medians of `n_boot` resamples of `a` (with replacement): [n_boot]."""
    return np.median(a[rng.integers(0, a.size, size=(n_boot, a.size))], axis=1)


def median_ci(xs: Sequence[float], level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0
              ) -> tuple[float, float]:
    """Bootstrap CI of the median of one sample."""
    return _interval(_boot_medians(_sample(xs), np.random.default_rng(seed), n_boot), level)


def quantile(xs: Sequence[float], q: float) -> float:
    """The sample's `q` quantile (0 <= q <= 1; linear interpolation, numpy's default)."""
    return float(np.quantile(_sample(xs), _level(q)))


def quantile_ci(xs: Sequence[float], q: float, level: float = LEVEL, n_boot: int = N_BOOT,
                seed: int = 0) -> tuple[float, float]:
    """Bootstrap CI of the `q` quantile of one sample (a tail quantile of a small sample has a
    wide interval: the resamples rarely reach past its largest values)."""
    a, rng = _sample(xs), np.random.default_rng(seed)
    boot = np.quantile(a[rng.integers(0, a.size, size=(n_boot, a.size))], _level(q), axis=1)
    return _interval(boot, level)


def _level(q: float) -> float:
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile must be in [0, 1], got {q}")
    return q


def ratio_ci(num: Sequence[float], den: Sequence[float], paired: bool = False,
             level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0
             ) -> tuple[float, tuple[float, float]]:
    """`median(num) / median(den)` and its bootstrap CI (e.g. a speedup: baseline / candidate).

    `paired=False` resamples the two samples independently (separately executed runs);
    `paired=True` resamples rep indices jointly (reps measured in pairs; equal lengths required).
    """
    a, b = _sample(num, "numerator"), _sample(den, "denominator")
    if np.any(b <= 0) or np.any(a < 0):
        raise ValueError("ratio of medians needs non-negative numerators and positive denominators")
    rng = np.random.default_rng(seed)
    if paired:
        if a.size != b.size:
            raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
        idx = rng.integers(0, a.size, size=(n_boot, a.size))
        boot = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    else:
        boot = _boot_medians(a, rng, n_boot) / _boot_medians(b, rng, n_boot)
    return float(np.median(a) / np.median(b)), _interval(boot, level)
