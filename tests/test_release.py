"""Private release of ε statistics (accounting/release.py): OS-entropy noise, add/remove
sensitivity, and useful quantiles on a digits-sized set at the default ε."""

import numpy as np
import pytest

from idpsgd.accounting.release import (
    DEFAULT_RELEASE_EPSILON,
    MEAN_SENSITIVITY,
    MEAN_SHARE,
    analytic_gaussian_sigma,
    release_mean,
    release_quantile,
    release_statistics,
)
from idpsgd.validation import InvalidParameterError

N_DIGITS, U = 1437, 3.0


def synthetic_epsilons(rng):
    """Digits-sized: 30 % of the examples at the worst case U, the rest spread below it."""
    return np.where(rng.random(N_DIGITS) < 0.3, U, np.clip(rng.lognormal(0.0, 0.5, N_DIGITS), 0, U))


def test_noise_comes_from_os_entropy_not_a_seed():
    values = np.linspace(0.1, 2.9, 200)
    a = release_statistics(values, U)
    b = release_statistics(values, U)
    assert a["mean"]["value"] != b["mean"]["value"] and a["noise_source"].startswith("OS entropy (secrets)")
    with pytest.warns(DeprecationWarning, match="ignored"):
        c = release_statistics(values, U, seed=0)
    with pytest.warns(DeprecationWarning, match="ignored"):
        d = release_statistics(values, U, seed=0)
    assert c["mean"]["value"] != d["mean"]["value"]  # a recorded seed cannot replay the release
    assert "seed" not in str(c)


def test_os_entropy_rng_draws_normals_and_choices_with_the_right_law():
    from idpsgd.accounting.release import OsEntropyRng, secure_rng

    r = secure_rng()
    assert isinstance(r, OsEntropyRng)
    z = np.array([r.normal(1.0, 2.0) for _ in range(20_000)])
    assert abs(z.mean() - 1.0) < 0.06 and abs(z.std() - 2.0) < 0.06
    c = np.bincount([r.choice(3, p=[0.2, 0.3, 0.5]) for _ in range(20_000)], minlength=3) / 20_000
    np.testing.assert_allclose(c, [0.2, 0.3, 0.5], atol=0.015)


def test_mean_uses_add_remove_sensitivity(rng):
    """(Σ v/U, n) moves by sqrt((v/U)² + 1) ≤ √2 when one value v ∈ [0, U] is added or removed."""
    v = rng.uniform(0, U, 50)
    for extra in (0.0, 1.7, U):
        d_plus = np.hypot(extra / U, 1.0)
        assert d_plus <= MEAN_SENSITIVITY + 1e-15
    m = release_mean(v, U, 0.5, 1e-5, rng)
    assert m["sum_count_noise_std"] == pytest.approx(analytic_gaussian_sigma(0.5, 1e-5, np.sqrt(2)))
    assert "add/remove" in m["mechanism"] and 0 <= m["value"] <= U


def test_default_release_is_useful_on_a_digits_sized_set(rng):
    """At the default ε (0.5, as ``train --release-epsilon``) the released quantiles are ordered, and
    within ±5 percentile points of the truth in ≥ 95 % of releases; the mean within 0.1·U in ≥ 95 %.
    (The former release gave q0.1 = 0.006 where the truth was 1.0.)"""
    assert DEFAULT_RELEASE_EPSILON == 0.5
    outside, mean_far, reps = 0, 0, 60
    for _ in range(reps):
        v = synthetic_epsilons(rng)
        out = release_statistics(v, U, epsilon=DEFAULT_RELEASE_EPSILON, rng=rng)
        qs = out["quantiles"]["values"]
        vals = [qs[k] for k in sorted(qs, key=float)]
        assert vals == sorted(vals)
        for p, x in qs.items():
            p = float(p)
            lo, hi = np.quantile(v, max(p - 0.05, 0)), np.quantile(v, min(p + 0.05, 1))
            outside += not (lo - 1e-12 <= x <= hi + 1e-12)
        mean_far += abs(out["mean"]["value"] - v.mean()) > 0.1 * U
        assert out["total"] == {"epsilon": DEFAULT_RELEASE_EPSILON, "delta": 1e-5}
        assert out["mean"]["epsilon"] == pytest.approx(MEAN_SHARE * DEFAULT_RELEASE_EPSILON)
    assert outside <= 0.05 * reps * 5 and mean_far <= 0.05 * reps


def test_quantile_utility_sensitivity_is_max_p_one_minus_p(rng):
    """Adding or removing one value changes the quantile utility by at most max(p, 1 − p)."""
    from idpsgd.accounting.release import quantile_sensitivity

    def utility(v, p, x):
        v = np.sort(v)
        below, at_most = np.searchsorted(v, x, side="left"), np.searchsorted(v, x, side="right")
        return -np.maximum(np.maximum(below - p * v.size, p * v.size - at_most), 0.0)

    x = np.linspace(0, U, 301)
    for p in (0.1, 0.5, 0.9):
        worst = 0.0
        for _ in range(30):
            v = rng.uniform(0, U, rng.integers(1, 40))
            base = utility(v, p, x)
            for extra in (0.0, U, float(rng.uniform(0, U)), float(v[0])):
                worst = max(worst, np.max(np.abs(utility(np.append(v, extra), p, x) - base)))
            if v.size > 1:
                worst = max(worst, np.max(np.abs(utility(v[1:], p, x) - base)))
        assert worst <= quantile_sensitivity(p) + 1e-12


def test_analytic_gaussian_errors_are_clear():
    from idpsgd.validation import UnreachableTargetError

    with pytest.raises(UnreachableTargetError, match="epsilon=1e\\+300 is too large"):
        analytic_gaussian_sigma(1e300, 1e-5, 1.0)
    with pytest.raises(UnreachableTargetError, match="epsilon=1e-12 is unreachable"):
        analytic_gaussian_sigma(1e-12, 1e-12, 1.0)
    with pytest.raises(InvalidParameterError, match="epsilon=inf is invalid"):
        analytic_gaussian_sigma(float("inf"), 1e-5, 1.0)
    assert analytic_gaussian_sigma(700.0, 1e-5, 1.0) > 0  # no overflow of e^ε


def test_quantiles_handle_atoms_and_bad_input(rng):
    assert release_quantile(np.full(100, U), U, 0.9, 1.0, rng) == U
    assert release_quantile(np.zeros(100), U, 0.1, 1.0, rng) == 0.0
    with pytest.raises(InvalidParameterError, match="quantile"):
        release_quantile([1.0], U, 1.5, 1.0, rng)
    with pytest.raises(InvalidParameterError, match="values"):
        release_mean([], U, 1.0, 1e-5, rng)
    with pytest.raises(InvalidParameterError, match="release_epsilon"):
        release_statistics([1.0], U, epsilon=0)


def test_an_empty_set_is_released_as_noise_when_allowed(rng):
    """A set chosen by public values (a class of the public label set) is released even when empty:
    skipping it would publish that it is empty (issue 35)."""
    r = release_mean([], U, 1.0, 1e-5, rng, allow_empty=True)
    assert 0.0 <= r["value"] <= U and r["noisy_sum"] != 0.0 and r["noisy_count"] != 0.0
