"""RDP→(ε,δ) conversion against dp_accounting and Opacus; the per-example ledger."""

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa
from opacus.accountants.analysis.rdp import get_privacy_spent

from idpsgd.accounting import DEFAULT_ORDERS, RdpLedger, compute_rdp, rdp_to_delta, rdp_to_epsilon
from support import file_mode


def test_epsilon_matches_dp_accounting_and_opacus(rng):
    orders = DEFAULT_ORDERS[DEFAULT_ORDERS > 1.01]  # dp_accounting skips α ≤ 1.01
    for _ in range(20):
        q, s, t = 10 ** rng.uniform(-3, -1), rng.uniform(0.6, 5), int(rng.integers(10, 5000))
        delta = 10 ** rng.uniform(-8, -3)
        rdp = compute_rdp(q, s, orders, steps=t)
        eps, order = rdp_to_epsilon(rdp, orders, delta)
        ref_eps, ref_order = dpa.compute_epsilon(orders, rdp, delta)
        assert eps == pytest.approx(ref_eps, rel=1e-12) and order == ref_order
        op_eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
        assert eps == pytest.approx(op_eps, rel=1e-12)


def test_delta_matches_dp_accounting_and_round_trips(rng):
    orders = DEFAULT_ORDERS[DEFAULT_ORDERS > 1.01]
    for _ in range(10):
        rdp = compute_rdp(0.01, rng.uniform(0.8, 3), orders, steps=1000)
        eps = rng.uniform(0.5, 8)
        d, _ = rdp_to_delta(rdp, orders, eps)
        ref, _ = dpa.compute_delta(orders, rdp, eps)
        assert d == pytest.approx(ref, rel=1e-10)
        if 1e-300 < d < 1:
            e2, _ = rdp_to_epsilon(rdp, orders, d)
            assert e2 <= eps * (1 + 1e-9)


def test_vectorized_over_rows():
    rdp = compute_rdp(np.array([0.01, 0.02, 0.05]), 1.0, DEFAULT_ORDERS, steps=500)
    eps, orders = rdp_to_epsilon(rdp, DEFAULT_ORDERS, 1e-5)
    assert eps.shape == (3,) and orders.shape == (3,)
    for i in range(3):
        assert eps[i] == rdp_to_epsilon(rdp[i], DEFAULT_ORDERS, 1e-5)[0]
    assert np.all(np.diff(eps) > 0)


def test_zero_rdp_means_zero_epsilon_and_delta():
    eps, _ = rdp_to_epsilon(np.zeros((2, DEFAULT_ORDERS.size)), DEFAULT_ORDERS, 1e-5)
    assert np.all(eps == 0)
    d, _ = rdp_to_delta(np.zeros(DEFAULT_ORDERS.size), DEFAULT_ORDERS, 1.0)
    assert d == 0


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta"):
        rdp_to_epsilon(np.zeros(DEFAULT_ORDERS.size), DEFAULT_ORDERS, delta)


def test_ledger_accumulates_like_direct_composition(tmp_path):
    led = RdpLedger(4)
    led.add_step(0.01, np.array([1.0, 2.0, 1.0, np.inf]))
    led.add_step(0.02, 1.5, indices=[0, 2])
    led.add(compute_rdp(0.05, 3.0, led.orders), indices=[1, 1], counts=np.array([2, 3]))
    expected = np.stack(
        [
            compute_rdp(0.01, 1.0) + compute_rdp(0.02, 1.5),
            compute_rdp(0.01, 2.0) + 5 * compute_rdp(0.05, 3.0),
            compute_rdp(0.01, 1.0) + compute_rdp(0.02, 1.5),
            np.zeros(DEFAULT_ORDERS.size),
        ]
    )
    np.testing.assert_allclose(led.rdp, expected, rtol=1e-13)
    eps, _ = led.epsilon(1e-5)
    assert eps[3] == 0 and eps[0] == eps[2] and eps[1] > 0
    path = led.save(tmp_path / "ledger.npz")
    assert oct(file_mode(path)) == "0o600"
    back = RdpLedger.load(path)
    np.testing.assert_array_equal(back.rdp, led.rdp)
    assert back.steps == 2
    with pytest.raises(IndexError):
        led.add(compute_rdp(0.01, 1.0), indices=[4])
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        RdpLedger.load(tmp_path / "missing.npz")
