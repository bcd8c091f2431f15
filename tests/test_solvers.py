"""Every solver reaches its target or says why (issue 19), refined calibration, and
max_steps_within."""

import numpy as np
import pytest

from idpsgd.accounting import (
    SampledGaussianEvent,
    calibrate_noise_multiplier,
    calibrate_sample_rate,
    epsilon_sgm,
    max_steps_within,
    pld_epsilon,
    rdp_epsilon,
    solve_monotone,
)
from idpsgd.accounting.release import analytic_gaussian_sigma
from idpsgd.assignment import Budgets, assign
from idpsgd.validation import InvalidParameterError, UnreachableTargetError

DELTA = 1e-5


# --- solve_monotone ------------------------------------------------------------------------------
def _f(fn):
    return lambda x, idx: fn(np.asarray(x, dtype=float))


def test_solve_monotone_hits_the_band_from_the_feasible_side():
    x = solve_monotone(_f(lambda x: x**2), np.array([4.0, 9.0]), 0.1, 100.0, increasing=True, rtol=1e-6)
    assert np.all(x**2 <= [4.0, 9.0]) and np.all(x**2 >= np.array([4.0, 9.0]) * (1 - 1e-6))
    y = solve_monotone(_f(lambda x: 1 / x), np.array([0.5]), 0.01, 100.0, increasing=False, rtol=1e-6)
    assert 0.5 * (1 - 1e-6) <= 1 / y[0] <= 0.5


@pytest.mark.parametrize(("target", "match"), [(1e5, "unreachable"), (1e-5, "unreachable")])
def test_solve_monotone_refuses_targets_outside_the_bracket(target, match):
    with pytest.raises(UnreachableTargetError, match=match) as err:
        solve_monotone(_f(lambda x: x), np.array([target]), 1.0, 10.0, increasing=True, name="goal")
    assert f"goal={target:.6g}" in str(err.value) and "[1, 10]" in str(err.value)


def test_solve_monotone_refuses_a_jump_over_the_band():
    step = _f(lambda x: np.where(x < 3.0, 1.0, 5.0))
    with pytest.raises(UnreachableTargetError, match="jumps from 5 to 1"):
        solve_monotone(step, np.array([2.0]), 1.0, 10.0, increasing=True, name="goal")


def test_solve_monotone_refuses_to_stop_unconverged():
    with pytest.raises(UnreachableTargetError, match="did not converge in 2 iterations"):
        solve_monotone(_f(np.exp), np.array([10.0]), 1e-3, 50.0, increasing=True, max_iter=2, rtol=1e-12)


def test_solve_monotone_returns_an_end_only_when_it_meets_the_band():
    x = solve_monotone(_f(lambda x: x), np.array([10.0]), 1.0, 10.0, increasing=True)
    assert x[0] == pytest.approx(10.0)
    with pytest.raises(UnreachableTargetError):
        solve_monotone(_f(lambda x: x), np.array([10.5]), 1.0, 10.0, increasing=True)


# --- calibrators -----------------------------------------------------------------------------
def test_calibrate_noise_multiplier_uses_the_refined_epsilon():
    """σ falls: the refined calibration needs less noise than one on the fixed grid (issue example)."""
    sigma = calibrate_noise_multiplier(0.07, DELTA, 0.0021, 727)
    assert 0.07 * (1 - 1e-4) <= epsilon_sgm(0.0021, sigma, 727, DELTA) <= 0.07
    assert epsilon_sgm(0.0021, sigma, 727, DELTA, refine=False) > 0.075  # the grid would need more noise


def test_calibrate_noise_multiplier_errors_name_the_target():
    with pytest.raises(UnreachableTargetError, match=r"target_epsilon=1e\+06 is unreachable"):
        calibrate_noise_multiplier(1e6, DELTA, 0.1, 10)
    # ε jumps to 0 where δ covers the total variation: no σ gives ε in the band
    with pytest.raises(UnreachableTargetError, match="target_epsilon=1e-09 cannot be met"):
        calibrate_noise_multiplier(1e-9, DELTA, 0.01, 100)
    with pytest.raises(UnreachableTargetError, match="eps=1e-09 cannot be met"):
        calibrate_noise_multiplier(1e-9, DELTA, 0.01, 100, accountant="pld", name="eps")


def test_calibrate_sample_rate_errors_name_the_target():
    with pytest.raises(UnreachableTargetError, match=r"target_epsilon=1e\+06 is unreachable.*reachable epsilon"):
        calibrate_sample_rate(1e6, DELTA, 5.0, 10)
    q = calibrate_sample_rate(np.array([0.5, 1.0]), DELTA, 1.5, 400, accountant="rdp")
    eps = epsilon_sgm(q, 1.5, 400, DELTA)
    assert np.all(eps <= [0.5, 1.0]) and np.all(eps >= np.array([0.5, 1.0]) * (1 - 1e-4))


def test_sample_method_brackets_every_rate_below_one():
    """Issue 16: budgets 1 and 20, q = 0.089, 330 steps is feasible (a σ gives the mean rate with
    every q_p ≤ 1); a mean rate above what rate-1 groups allow is unreachable, and says so."""
    b = Budgets.from_array([1.0, 20.0], DELTA)
    a = assign(b, "sample", 0.089, 330, 1.0, group_weights=np.array([0.5, 0.5]))
    rates = np.array([g.sample_rate for g in a.groups])
    assert np.all(rates <= 1) and 0.5 * rates.sum() == pytest.approx(0.089, rel=1e-4)
    for g in a.groups:
        assert 0.999 * g.budget <= g.epsilon <= g.budget
    with pytest.raises(UnreachableTargetError, match="sample_rate=0.6 is unreachable with method sample"):
        assign(b, "sample", 0.6, 330, 1.0, group_weights=np.array([0.5, 0.5]))


def test_release_noise_solver_refuses_outside_its_bracket():
    assert analytic_gaussian_sigma(1.0, 1e-5, 1.0) == pytest.approx(3.7306, abs=1e-3)
    with pytest.raises(UnreachableTargetError, match="epsilon=1e"):
        analytic_gaussian_sigma(1e-12, 1e-12, 1.0)  # would need σ ≈ 4e11 > e^20


# --- max_steps_within ----------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_max_steps_within_is_the_last_step_within_budget(accountant):
    before = [SampledGaussianEvent(0.02, 1.5, 100)]
    t = max_steps_within(before, 0.05, 2.0, 2.0, DELTA, accountant)

    def eps(k):
        events = [*before, SampledGaussianEvent(0.05, 2.0, k)]
        return rdp_epsilon(events, DELTA)[0] if accountant == "rdp" else pld_epsilon(events, DELTA)

    assert t > 0 and eps(t) <= 2.0 < eps(t + 1)
    assert max_steps_within([], 0.05, 2.0, 2.0, DELTA, accountant) > t


def test_max_steps_within_errors():
    with pytest.raises(UnreachableTargetError, match="budget=0.5 is already exceeded"):
        max_steps_within([SampledGaussianEvent(0.05, 1.0, 500)], 0.05, 1.0, 0.5, DELTA)
    with pytest.raises(InvalidParameterError, match="without privacy cost"):
        max_steps_within([], 0.0, 1.0, 1.0, DELTA)
    with pytest.raises(UnreachableTargetError, match="not exhausted by limit=1000"):
        max_steps_within([], 1e-4, 50.0, 5.0, DELTA, limit=1000)
    with pytest.raises(InvalidParameterError, match="accountant"):
        max_steps_within([], 0.01, 1.0, 1.0, DELTA, accountant="moments")
