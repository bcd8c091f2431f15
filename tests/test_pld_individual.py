"""Per-example PLD (accounting/pld_individual.py) against dp_accounting, the accountant's level
counts, the minimum-of-bounds report, and "never above the budget" in every accountant mode."""

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from idpsgd.accounting import (
    IndividualAccountant,
    SampledGaussianEvent,
    combine_bounds,
    epsilon_sgm,
    individual_pld_epsilon,
    rdp_epsilon,
)
from idpsgd.accounting import output_specific as individual_module
from idpsgd.assignment import Budgets, assign
from idpsgd.validation import InvalidParameterError

DELTA = 1e-5


def dp_accounting_pld(q, sigma, counts, discretization):
    """dp_accounting's PLDAccountant composing the example's events one by one (not our code)."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization)
    events = [
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q[k], dp_event.GaussianDpEvent(sigma[k])), int(counts[k])
        )
        for k in range(len(q))
        if counts[k] > 0 and np.isfinite(sigma[k])
    ]
    if not events:
        return 0.0
    acc.compose(dp_event.ComposedDpEvent(events))
    return acc.get_epsilon(DELTA)


@pytest.fixture(scope="module")
def levels_and_counts():
    rng = np.random.default_rng(7)
    q = np.array([0.05, 0.05, 0.05, 0.1, 0.1, 0.1])
    sigma = np.array([1.2, 3.0, 10.0, 1.5, 4.0, np.inf])
    counts = rng.integers(0, 60, (7, q.size))
    counts[0] = 0
    counts[1] = [100, 0, 0, 0, 0, 0]
    return q, sigma, counts


@pytest.mark.parametrize("discretization", [1e-3, 2e-3])
def test_matches_dp_accounting_composing_one_by_one(levels_and_counts, discretization):
    """Equal to dp_accounting's PLD of the same events up to the charged tail (≤ 1e-12 of δ-mass →
    a relative 1e-6 here), never below it, and never above the example's RDP ε."""
    q, sigma, counts = levels_and_counts
    ours = individual_pld_epsilon(counts, q, sigma, DELTA, discretization=discretization)
    for i in range(counts.shape[0]):
        ref = dp_accounting_pld(q, sigma, counts[i], discretization)
        assert ours[i] >= ref * (1 - 1e-9)
        assert ours[i] <= ref * (1 + 2e-6) + 1e-9
        rdp = rdp_epsilon([SampledGaussianEvent(q[k], sigma[k], int(counts[i, k])) for k in range(q.size)], DELTA)[0]
        assert ours[i] <= rdp
    assert ours[0] == 0.0


def test_refuses_bad_input(levels_and_counts):
    q, sigma, counts = levels_and_counts
    with pytest.raises(InvalidParameterError, match="counts"):
        individual_pld_epsilon(-counts, q, sigma, DELTA)
    with pytest.raises(InvalidParameterError, match="levels"):
        individual_pld_epsilon(counts, q[:3], sigma[:3], DELTA)
    with pytest.raises(InvalidParameterError, match="noise_multiplier=0.001 is invalid"):
        individual_pld_epsilon(np.ones((1, 1)), [1.0], [0.001], DELTA)


def _run_accountant(rng, n=120, rounding="ceil", epochs=6, q=None, clip=None, sigma=1.3):
    q = np.where(np.arange(n) < n // 2, 0.04, 0.1) if q is None else q
    acc = IndividualAccountant(q, sigma, 1.0, clip, rounding=rounding, rounding_step=0.05)
    for _ in range(epochs):
        acc.update_norms(rng.lognormal(-0.7, 0.8, n))
        acc.add_steps(15)
    return acc


def test_accountant_tracks_level_counts_and_its_pld(rng):
    acc = _run_accountant(rng)
    assert acc.level_counts.sum(axis=1).tolist() == [acc.steps] * acc.num_examples
    pld = acc.pld_epsilon(DELTA)
    rdp = acc.epsilon(DELTA)
    assert np.all(pld <= rdp) and np.mean(1 - pld / rdp) > 0.03
    # one example by hand: its own events through dp_accounting
    i = 5
    lv = np.flatnonzero(acc.level_counts[i])
    ref = dp_accounting_pld(np.full(lv.size, acc.q[i]), 1.3 / acc.levels[lv], acc.level_counts[i, lv], 2e-3)
    assert pld[i] == pytest.approx(ref, rel=2e-6)
    # resume keeps the counts
    other = IndividualAccountant(acc.q, 1.3, 1.0, rounding="ceil", rounding_step=0.05)
    other.load_state_dict(acc.state_dict())
    np.testing.assert_array_equal(other.pld_epsilon(DELTA), pld)
    old = acc.state_dict()
    old.pop("level_counts")
    other.load_state_dict(old)
    with pytest.raises(InvalidParameterError, match="rounding_step"):
        other.pld_epsilon(DELTA)


def test_pld_needs_rounded_levels_and_bounded_tables(rng, monkeypatch):
    exact = _run_accountant(rng, n=20, rounding="exact", epochs=1)
    with pytest.raises(InvalidParameterError, match="rounding='exact' is invalid: cannot be used with the pld"):
        exact.pld_epsilon(DELTA)
    with pytest.raises(InvalidParameterError, match="rounding_step=1e-12 is invalid: gives 1e\\+12 sensitivity levels"):
        IndividualAccountant(np.full(5, 0.1), 1.0, 1.0, rounding="nearest", rounding_step=1e-12)
    monkeypatch.setattr(individual_module, "MAX_LEVEL_COUNT_BYTES", 100)
    acc = _run_accountant(rng, n=20, epochs=1)
    assert acc.level_counts is None and np.all(np.isfinite(acc.epsilon(DELTA)))
    with pytest.raises(InvalidParameterError, match="rounding_step=0.05 is invalid: gives 21 levels"):
        acc.pld_epsilon(DELTA)


def test_report_is_the_minimum_with_its_source(rng):
    acc = _run_accountant(rng)
    cap = np.full(acc.num_examples, 10.0)
    cap[:3] = 0.01
    rep = acc.report(DELTA, "pld", cap=cap)
    np.testing.assert_array_equal(rep.epsilon, np.minimum(np.minimum(rep.rdp, rep.pld), cap))
    assert set(rep.source[:3]) == {"cap"} and np.all(rep.source[3:] == "pld")
    assert rep.counts() == {"cap": 3, "pld": acc.num_examples - 3}
    only = acc.report(DELTA)
    assert only.pld is None and set(only.source) == {"rdp"}
    both = combine_bounds(DELTA, [1.0, 2.0], [1.5, 1.0], 1.2)
    assert both.epsilon.tolist() == [1.0, 1.0] and both.source.tolist() == ["rdp", "pld"]
    with pytest.raises(InvalidParameterError, match="accountant"):
        acc.report(DELTA, "moments")


@pytest.mark.parametrize(("method", "accountant"), [("sample", "rdp"), ("scale", "rdp"), ("scale", "pld")])
def test_no_example_is_ever_above_its_budget(rng, accountant, method):
    """Synthetic run calibrated to budgets 1/2/3 with each accountant: the reported ε (the minimum of
    the example's RDP, PLD and its group's ε from the run's accountant) never exceeds the budget —
    although RDP alone can, for a PLD-calibrated run (issue 15: 1.10 / 2.21 / 3.33)."""
    budgets = Budgets.from_groups([1.0, 2.0, 3.0], [0.3, 0.4, 0.3], 150, DELTA, seed=1)
    steps = 200
    a = assign(budgets, method, 0.05, steps, 1.0, accountant=accountant)
    group_eps = np.array([g.epsilon for g in a.groups])[a.example_group]
    assert np.all(group_eps <= budgets.epsilons)
    acc = IndividualAccountant(
        a.sample_rates, a.noise_multiplier, a.clip_norm, a.clip_norms, rounding="ceil", rounding_step=0.05
    )
    for _ in range(4):
        acc.update_norms(rng.lognormal(-0.3, 0.7, budgets.epsilons.size))
        acc.add_steps(steps // 4)
    for mode in ("rdp", "pld"):
        rep = acc.report(DELTA, mode, cap=group_eps)
        assert np.all(rep.epsilon <= budgets.epsilons), (mode, np.max(rep.epsilon - budgets.epsilons))
    if accountant == "pld":
        worst = acc.worst_case_epsilon(DELTA)  # RDP of the worst case: above the PLD-calibrated budget
        assert np.any(worst > budgets.epsilons)
    np.testing.assert_allclose(
        acc.worst_case_epsilon(DELTA, accountant=accountant),
        epsilon_sgm(a.sample_rates, a.noise_multiplier * a.clip_norm / a.clip_norms, steps, DELTA, accountant),
        rtol=1e-9,
    )
