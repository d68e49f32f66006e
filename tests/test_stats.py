"""Bootstrap CIs: exact cases, determinism, equivariance, and coverage on known distributions."""

import numpy as np
import pytest

from rekv_jax import stats


def _lognormal(rng, n=30, scale=1.0):
    return scale * np.exp(rng.normal(0.0, 0.3, n))


def test_median_and_ci_contain_the_sample_median():
    rng = np.random.default_rng(1)
    for _ in range(20):
        xs = _lognormal(rng)
        lo, hi = stats.median_ci(xs)
        assert stats.median(xs) == np.median(xs)
        assert lo <= stats.median(xs) <= hi and lo < hi


def test_deterministic_given_seed():
    xs, ys = _lognormal(np.random.default_rng(2)), _lognormal(np.random.default_rng(3))
    assert stats.median_ci(xs, seed=7) == stats.median_ci(xs, seed=7)
    assert stats.ratio_ci(xs, ys, seed=5) == stats.ratio_ci(xs, ys, seed=5)
    np.random.seed(0)  # global NumPy state must not matter
    first = stats.ratio_ci(xs, ys, paired=True, seed=5)
    np.random.seed(1)
    assert stats.ratio_ci(xs, ys, paired=True, seed=5) == first


def test_exact_intervals():
    xs = _lognormal(np.random.default_rng(4))
    assert stats.median_ci([3.5] * 30) == (3.5, 3.5)
    assert stats.ratio_ci(xs, xs, paired=True) == (1.0, (1.0, 1.0))
    # Scaling by 2 is exact in floating point, so the paired ratio is exactly 2 in every resample.
    assert stats.ratio_ci(2 * xs, xs, paired=True) == (2.0, (2.0, 2.0))
    # Independent resampling of the same data does not know the pairing: a real interval.
    point, (lo, hi) = stats.ratio_ci(2 * xs, xs)
    assert point == 2.0 and lo < 2.0 < hi


def test_ratio_ci_is_scale_equivariant():
    rng = np.random.default_rng(5)
    a, b = _lognormal(rng, scale=3.0), _lognormal(rng)
    for paired in (False, True):
        point, (lo, hi) = stats.ratio_ci(a, b, paired=paired)
        assert stats.ratio_ci(4 * a, b, paired=paired) == (4 * point, (4 * lo, 4 * hi))


def test_interval_narrows_with_more_reps():
    rng = np.random.default_rng(6)
    widths = [np.diff(stats.median_ci(_lognormal(rng, n))).item() for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2]


@pytest.mark.parametrize("kind", ["median", "independent", "paired"])
def test_coverage_near_95_percent(kind):
    # True median of exp(N(0, 0.3^2)) is 1; of 2x that is 2, so the true ratio is 2.
    rng = np.random.default_rng(7)
    trials, hits = 300, 0
    for t in range(trials):
        a, b = _lognormal(rng, scale=2.0), _lognormal(rng)
        if kind == "median":
            lo, hi = stats.median_ci(b, n_boot=1000, seed=t)
            hits += lo <= 1.0 <= hi
        else:
            _, (lo, hi) = stats.ratio_ci(a, b, paired=kind == "paired", n_boot=1000, seed=t)
            hits += lo <= 2.0 <= hi
    assert 0.88 <= hits / trials <= 0.995


@pytest.mark.parametrize("call, match", [
    (lambda: stats.median([]), "non-empty"),
    (lambda: stats.median_ci([1.0, float("nan")]), "non-finite"),
    (lambda: stats.median_ci([1.0, 2.0], level=1.5), "level"),
    (lambda: stats.ratio_ci([1.0, 2.0], [1.0], paired=True), "differ in length"),
    (lambda: stats.ratio_ci([1.0], [0.0]), "positive denominators"),
    (lambda: stats.ratio_ci([[1.0]], [1.0]), "1-D"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_middle_quantile_is_the_median_with_the_same_interval():
    xs = _lognormal(np.random.default_rng(4), n=41)
    assert stats.quantile(xs, 0.5) == stats.median(xs)
    assert stats.quantile_ci(xs, 0.5, seed=3) == stats.median_ci(xs, seed=3)


def test_quantile_ci_covers_the_true_p90_about_95_percent_of_the_time():
    """An exponential's p90 is ln 10; 200 samples of 200 draws, 1,000 resamples each."""
    rng, truth, hits = np.random.default_rng(5), np.log(10.0), 0
    for seed in range(200):
        lo, hi = stats.quantile_ci(rng.exponential(1.0, 200), 0.9, n_boot=1000, seed=seed)
        hits += lo <= truth <= hi
    assert 0.88 <= hits / 200 <= 0.99, hits


@pytest.mark.parametrize("q", [-0.1, 1.5])
def test_a_quantile_outside_0_1_is_refused(q):
    with pytest.raises(ValueError, match="quantile must be in"):
        stats.quantile_ci([1.0, 2.0], q)
