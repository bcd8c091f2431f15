"""Adaptive Rényi orders (accounting/orders.py): exact values at the chosen order, never above the
grid, the dense-universe minimum, window mode, the chord bound, and dp_accounting as reference."""

import sys
from pathlib import Path

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa

from idpsgd.accounting import (
    DEFAULT_ORDERS,
    SampledGaussianEvent,
    chord_refined_epsilon,
    compute_rdp,
    compute_rdp_pointwise,
    epsilon_sgm,
    order_universe,
    rdp_epsilon,
    rdp_to_epsilon,
    search_orders,
)
from idpsgd.accounting.orders import epsilon_at_orders, sgm_rdp_at

sys.path.insert(0, str(Path(__file__).parent))
from test_rdp import rdp_integral

DELTA = 1e-5


def random_cases(rng, n):
    return (10 ** rng.uniform(-4, -0.7, n), rng.uniform(0.6, 6.0, n), np.round(10 ** rng.uniform(1, 4, n)))


def test_a_small_rate_long_run_beats_the_grid_and_dense_integer_orders():
    # issue 15: grid 0.0793 (0.0791 today), dp_accounting with a dense integer grid 0.0685 (0.0680 on 2..399)
    eps, order = rdp_epsilon([SampledGaussianEvent(0.0021, 3.17, 727)], DELTA)
    grid, _ = rdp_epsilon([SampledGaussianEvent(0.0021, 3.17, 727)], DELTA, refine=False)
    dense = np.arange(2, 400, dtype=float)
    ref = dpa.compute_epsilon(dense, dpa._compute_rdp_poisson_subsampled_gaussian(0.0021, 3.17, dense) * 727, DELTA)[0]
    assert grid == pytest.approx(0.0791, abs=2e-4) and ref <= 0.0686
    assert eps <= ref * (1 + 1e-12) and eps < 0.87 * grid
    # exact at its order: recompute ε(α) from the RDP at that order
    r = compute_rdp(0.0021, 3.17, [order], steps=727)
    assert eps == pytest.approx(float(epsilon_at_orders(r, order, DELTA)[0]), rel=1e-12)


def test_refined_is_exact_at_its_order_and_never_above_the_grid(rng):
    q, s, t = random_cases(rng, 60)
    res = search_orders(sgm_rdp_at(q[:, None], s[:, None], t[:, None]), q.size, DELTA)
    grid = rdp_to_epsilon(compute_rdp(q, s, DEFAULT_ORDERS, steps=t), DEFAULT_ORDERS, DELTA)[0]
    assert np.all(res.epsilon <= grid)
    again = epsilon_at_orders(compute_rdp_pointwise(q, s, res.order) * t, res.order, DELTA)
    np.testing.assert_allclose(res.epsilon, again, rtol=1e-12)
    np.testing.assert_allclose(epsilon_sgm(q, s, t, DELTA), res.epsilon, rtol=1e-12)


def test_search_finds_the_minimum_over_the_whole_universe(rng):
    """Brute force over every order of the universe (~3,200): the search's coarse-to-fine path
    finds the same minimum (ε(α) is unimodal here)."""
    u, _ = order_universe()
    q, s, t = random_cases(rng, 6)
    for i in range(q.size):
        r = compute_rdp_pointwise(q[i], s[i], u) * t[i]
        brute = float(np.min(epsilon_at_orders(r, u, DELTA)))
        eps, _ = rdp_epsilon([SampledGaussianEvent(q[i], s[i], int(t[i]))], DELTA)
        assert eps == pytest.approx(brute, rel=1e-12)


def test_window_mode_equals_full_search_and_falls_back_at_edges(rng):
    q, s, t = random_cases(rng, 40)
    fn = sgm_rdp_at(q[:, None], s[:, None], t[:, None])
    full = search_orders(fn, q.size, DELTA)
    u, _ = order_universe()
    good = (full.index - 3, full.index + 3)
    assert np.array_equal(search_orders(fn, q.size, DELTA, window=good).epsilon, full.epsilon)
    # windows far off: the minimum sits on the window's edge, so the full search takes over
    off = np.clip(full.index - 400, 0, u.size - 1)
    far = search_orders(fn, q.size, DELTA, window=(off, off + 10))
    np.testing.assert_array_equal(far.epsilon, full.epsilon)


def test_agrees_with_dp_accounting_at_the_chosen_order(rng):
    q, s, t = random_cases(rng, 20)
    for i in range(q.size):
        eps, order = rdp_epsilon([SampledGaussianEvent(q[i], s[i], int(t[i]))], DELTA)
        ref = dpa.compute_epsilon(
            [order], dpa._compute_rdp_poisson_subsampled_gaussian(q[i], s[i], [order]) * t[i], DELTA
        )[0]
        # integer orders: equal; fractional: dp_accounting sums absolute values (an upper bound)
        assert eps <= ref * (1 + 1e-9)
        if float(order).is_integer():
            assert eps == pytest.approx(ref, rel=1e-9)


def test_heterogeneous_events_and_custom_orders():
    events = [
        SampledGaussianEvent(0.01, 1.2, 300),
        SampledGaussianEvent(0.02, 2.0, 200),
        SampledGaussianEvent(0.0, 1.0, 50),
        SampledGaussianEvent(0.3, np.inf, 10),
    ]
    eps, order = rdp_epsilon(events, DELTA)
    grid, _ = rdp_epsilon(events, DELTA, refine=False)
    rdp = 300 * compute_rdp_pointwise(0.01, 1.2, order) + 200 * compute_rdp_pointwise(0.02, 2.0, order)
    assert eps <= grid and eps == pytest.approx(float(epsilon_at_orders(rdp, order, DELTA)), rel=1e-12)
    coarse = [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    e2, o2 = rdp_epsilon(events, DELTA, orders=coarse)
    assert 2.0 <= o2 <= 64.0 and e2 <= rdp_epsilon(events, DELTA, orders=coarse, refine=False)[0]
    assert rdp_epsilon([], DELTA)[0] == 0.0


def test_pointwise_rdp_matches_compute_rdp_and_the_integral(rng):
    q = 10 ** rng.uniform(-5, -0.2, 300)
    s = 10 ** rng.uniform(-0.3, 1.5, 300)
    a = np.where(rng.random(300) < 0.5, rng.integers(2, 300, 300), 1 + 10 ** rng.uniform(-1.5, 2, 300)).astype(float)
    pw = compute_rdp_pointwise(q, s, a)
    one = np.array([compute_rdp(q[i], s[i], [a[i]])[0] for i in range(300)])
    np.testing.assert_allclose(pw, one, rtol=1e-6, atol=1e-14)
    for i in range(4):
        assert pw[i] == pytest.approx(rdp_integral(q[i], s[i], a[i], dps=25), rel=1e-8)
    assert compute_rdp_pointwise(1.0, 2.0, 3.0) == pytest.approx(0.375)
    assert np.all(compute_rdp_pointwise([0.0, 0.3], [1.0, np.inf], [2.5, 7.0]) == 0)


def test_chord_bound_is_valid_and_never_above_the_grid(rng):
    """(α − 1)·r(α) is convex: the chord between grid orders bounds the composed RDP from above."""
    q, s, t = random_cases(rng, 30)
    rdp = compute_rdp(q, s, DEFAULT_ORDERS, steps=t)
    eps, order = chord_refined_epsilon(rdp, DEFAULT_ORDERS, DELTA)
    grid = rdp_to_epsilon(rdp, DEFAULT_ORDERS, DELTA)[0]
    assert np.all(eps <= grid)
    exact_at = epsilon_at_orders(compute_rdp_pointwise(q, s, order) * t, order, DELTA)
    assert np.all(exact_at <= eps * (1 + 1e-12))
    # the chord itself lies above the exact RDP between every pair of grid orders
    for i in range(5):
        j = rng.integers(0, DEFAULT_ORDERS.size - 1)
        a1, a2 = DEFAULT_ORDERS[j], DEFAULT_ORDERS[j + 1]
        mid = np.linspace(a1, a2, 7)[1:-1]
        chord = ((a2 - mid) * (a1 - 1) * rdp[i, j] + (mid - a1) * (a2 - 1) * rdp[i, j + 1]) / ((a2 - a1) * (mid - 1))
        assert np.all(chord >= compute_rdp_pointwise(q[i], s[i], mid) * t[i] * (1 - 1e-12))
