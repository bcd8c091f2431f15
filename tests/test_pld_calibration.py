"""PLD through dp_accounting, and calibration of σ and q for both accountants."""

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants.utils import get_noise_multiplier

from idpsgd.accounting import (
    SampledGaussianEvent,
    calibrate_noise_multiplier,
    calibrate_sample_rate,
    epsilon_sgm,
    pld_epsilon,
    rdp_epsilon,
)
from idpsgd.validation import InvalidParameterError, UnreachableTargetError


def test_pld_heterogeneous_events_match_dp_accounting():
    events = [SampledGaussianEvent(0.01, 1.2, 300), SampledGaussianEvent(0.02, 2.0, 200)]
    ours = pld_epsilon(events, 1e-5, discretization=1e-4)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(
        dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.2)), 300),
                dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(2.0)), 200),
            ]
        )
    )
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    rdp_eps, _ = rdp_epsilon(events, 1e-5)
    assert ours < rdp_eps  # PLD is tighter
    coarse = pld_epsilon(events, 1e-5)  # the default 1e-3 grid: pessimistic, barely looser
    assert ours <= coarse <= ours * (1 + 1e-3)
    assert pld_epsilon([SampledGaussianEvent(0.0, 1.0, 10)], 1e-5) == 0.0


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_multiplier_round_trip_never_overshoots(accountant):
    for target in [0.5, 1.0, 3.0, 8.0] if accountant == "rdp" else [1.0, 3.0]:
        sigma = calibrate_noise_multiplier(target, 1e-5, 0.02, 500, accountant=accountant)
        eps = epsilon_sgm(0.02, sigma, 500, 1e-5, accountant)
        assert target * (1 - 1e-4) <= eps <= target


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_sample_rate_round_trip_never_overshoots(accountant):
    for target in [1.0, 2.0]:
        q = calibrate_sample_rate(target, 1e-5, 1.5, 400, accountant=accountant)
        eps = epsilon_sgm(q, 1.5, 400, 1e-5, accountant)
        assert target * (1 - 1e-4) <= eps <= target


def test_calibration_is_vectorized_and_monotone():
    sig = calibrate_noise_multiplier(np.array([1.0, 2.0, 3.0]), 1e-5, 0.01, 1000)
    assert sig.shape == (3,) and np.all(np.diff(sig) < 0)
    eps = epsilon_sgm(0.01, sig, 1000, 1e-5)
    assert np.all(eps <= [1, 2, 3]) and np.all(eps >= np.array([1, 2, 3]) * (1 - 1e-4))
    q = calibrate_sample_rate(np.array([1.0, 2.0, 3.0]), 1e-5, 1.2, 1000)
    assert np.all(np.diff(q) > 0)


def test_against_opacus_get_noise_multiplier():
    # Opacus stops anywhere within 0.01 below the target; ours is within 1e-4, so needs no more noise.
    ours = calibrate_noise_multiplier(1.0, 1e-5, 0.004, 2000)
    theirs = get_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.004, steps=2000)
    assert ours <= theirs and ours == pytest.approx(theirs, rel=0.03)


def test_pld_needs_less_noise_than_rdp():
    s_rdp = calibrate_noise_multiplier(2.0, 1e-5, 0.01, 1000)
    s_pld = calibrate_noise_multiplier(2.0, 1e-5, 0.01, 1000, accountant="pld")
    assert s_pld < s_rdp


def test_unreachable_targets_say_what_is_reachable():
    with pytest.raises(UnreachableTargetError, match="reachable epsilon"):
        calibrate_sample_rate(1e6, 1e-5, 5.0, 10)
    with pytest.raises(UnreachableTargetError, match="unreachable"):
        calibrate_noise_multiplier(1e-9, 1e-5, 1.0, 100000)
    with pytest.raises(InvalidParameterError, match="target_epsilon"):
        calibrate_noise_multiplier(-1.0, 1e-5, 0.01, 10)
    with pytest.raises(InvalidParameterError, match="steps"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 0)
    with pytest.raises(ValueError, match="accountant"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 10, accountant="moments")
