"""Our SGM RDP against ground truth (mpmath integration), Opacus and dp_accounting."""

import mpmath as mp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa
from opacus.accountants.analysis import rdp as opacus_rdp

from idpsgd.accounting import DEFAULT_ORDERS, compute_rdp
from idpsgd.validation import InvalidParameterError


def rdp_integral(q, sigma, alpha, dps=30):
    """Ground truth: log E_{z~N(0,σ²)}[((1−q)+q e^{(2z−1)/(2σ²)})^α]/(α−1) by mpmath quadrature."""
    mp.mp.dps = dps
    q, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)

    def f(z):
        return mp.npdf(z, 0, s) * ((1 - q) + q * mp.exp((2 * z - 1) / (2 * s**2))) ** a

    z0 = s**2 * mp.log(1 / q - 1) + mp.mpf(0.5) if q < 1 else mp.mpf(1)
    pts = sorted({-mp.inf, -12 * s, mp.mpf(0), mp.mpf(0.5), z0, a, a + 12 * s, mp.inf}, key=float)
    return float(mp.log(mp.quad(f, pts)) / (a - 1))


CASES = [  # (q, σ, α): integer, fractional, the regimes of each evaluation path
    (0.01, 1.0, 2),
    (0.01, 1.0, 32),
    (0.1, 0.8, 7),
    (0.02, 4.0, 256),
    (0.001, 20.0, 1024),
    (0.01, 1.1, 1.5),
    (0.05, 0.5, 3.5),
    (0.3, 0.7, 1.01),
    (0.5, 0.7, 1.01),
    (0.01, 0.5, 1.5),
    (0.4, 12.0, 59.5),
    (1e-6, 3.0, 7.25),
    (0.9, 2.0, 3.5),
    (0.99, 100.0, 1.5),
    (1e-9, 0.3, 7.5),
    (0.2, 2.0, 5.75),
    (0.08, 3.0, 10.5),
]


@pytest.mark.parametrize(("q", "sigma", "alpha"), CASES)
def test_matches_numerical_integral(q, sigma, alpha):
    truth = rdp_integral(q, sigma, alpha)
    ours = compute_rdp(q, sigma, [alpha])[0]
    assert ours == pytest.approx(truth, rel=1e-8)
    assert ours >= truth * (1 - 1e-12)  # never an under-estimate beyond rounding


def test_matches_integral_at_random_points(rng):
    for _ in range(10):
        q = 10 ** rng.uniform(-5, -0.1)
        s = 10 ** rng.uniform(-0.5, 1.3)
        a = rng.uniform(1.05, 12) if rng.random() < 0.6 else float(rng.integers(2, 80))
        assert compute_rdp(q, s, [a])[0] == pytest.approx(rdp_integral(q, s, a, dps=30), rel=1e-8), (q, s, a)


def test_agrees_with_opacus_and_dp_accounting(rng):
    """Integer orders: all three agree. Fractional: where the libraries disagree, the integral decides."""
    checked_disagreements = 0
    for _ in range(60):
        q = 10 ** rng.uniform(-4, -0.3)
        s = 10 ** rng.uniform(-0.2, 1.2)
        a = float(rng.integers(2, 64)) if rng.random() < 0.5 else round(rng.uniform(1.1, 20), 2)
        ours = compute_rdp(q, s, [a])[0]
        op = float(opacus_rdp.compute_rdp(q=q, noise_multiplier=s, steps=1, orders=[a])[0])
        dp = float(dpa._compute_rdp_poisson_subsampled_gaussian(q, s, [a])[0])
        if a.is_integer():
            assert ours == pytest.approx(op, rel=1e-9) and ours == pytest.approx(dp, rel=1e-9)
            continue
        # dp_accounting sums absolute values of the series: an upper bound of the truth.
        assert ours <= dp * (1 + 1e-9)
        if not (np.isclose(ours, op, rtol=1e-7) and np.isclose(ours, dp, rtol=1e-7)):
            checked_disagreements += 1
            assert ours == pytest.approx(rdp_integral(q, s, a), rel=1e-8)


def test_opacus_fractional_underestimate_is_not_ours():
    """Opacus's fractional series stops early here and is far too small; the integral agrees with us."""
    q, s, a = 0.4, 12.0, 59.5
    op = float(opacus_rdp.compute_rdp(q=q, noise_multiplier=s, steps=1, orders=[a])[0])
    ours = compute_rdp(q, s, [a])[0]
    truth = rdp_integral(q, s, a)
    assert ours == pytest.approx(truth, rel=1e-9)
    assert op < 0.5 * truth


def test_reference_values_from_library_tests():
    # tensorflow_privacy / dp_accounting rdp tests: compute_rdp(0.1, 2, steps=10, orders=5) and the
    # sequence at q=0.01, σ=2.5, 50 steps.
    assert compute_rdp(0.1, 2.0, [5], steps=10)[0] == pytest.approx(0.07737, abs=1e-5)
    seq = compute_rdp(0.01, 2.5, [1.5, 2.5, 5, 50, 100], steps=50)
    np.testing.assert_allclose(seq, [6.5007e-04, 1.0854e-03, 2.1808e-03, 2.3846e-02, 1.6742e02], rtol=1e-4)


def test_plain_gaussian_and_no_leak():
    orders = np.array([1.5, 2, 10, 1024])
    np.testing.assert_allclose(compute_rdp(1.0, 3.0, orders), orders / 18, rtol=1e-15)
    assert np.all(compute_rdp(0.3, np.inf, orders) == 0)
    assert np.all(compute_rdp(0.0, 1.0, orders) == 0)


def test_vectorized_shapes_and_broadcasting():
    q = np.array([[0.01], [0.02]])
    s = np.array([1.0, 2.0, 3.0])
    out = compute_rdp(q, s, DEFAULT_ORDERS)
    assert out.shape == (2, 3, DEFAULT_ORDERS.size)
    np.testing.assert_allclose(out[1, 2], compute_rdp(0.02, 3.0, DEFAULT_ORDERS))
    steps = np.array([1, 10, 100])
    np.testing.assert_allclose(
        compute_rdp(0.01, s, [4.0], steps=steps)[:, 0], compute_rdp(0.01, s, [4.0])[:, 0] * steps
    )


def test_monotone_in_q_sigma_alpha():
    qs = np.logspace(-6, 0, 25)
    r = compute_rdp(qs, 1.3, DEFAULT_ORDERS)
    assert np.all(np.diff(r, axis=0) >= -1e-15 * np.abs(r[1:]))
    sig = np.logspace(-1, 4, 40)
    r = compute_rdp(0.05, sig, DEFAULT_ORDERS)
    assert np.all(np.diff(r, axis=0) <= 1e-15 * np.abs(r[:-1]))
    r = compute_rdp(np.array([1e-4, 0.01, 0.3]), np.array([[0.5], [2.0], [30.0]]), DEFAULT_ORDERS)
    assert np.all(np.diff(r, axis=-1) >= -1e-12 * np.abs(r[..., 1:]))


def test_default_orders_reach_1024():
    assert DEFAULT_ORDERS.min() <= 1.01 and DEFAULT_ORDERS.max() >= 1024


def test_extremes_without_overflow_or_nan():
    qs = np.array([1e-9, 1e-5, 0.3, 0.5, 0.999999, 1.0])
    sig = np.array([0.1, 0.5, 1.0, 10.0, 1e3, 1e6, np.inf])
    out = compute_rdp(qs[:, None], sig[None, :], DEFAULT_ORDERS)
    assert np.all(np.isfinite(out)) and np.all(out >= 0)
    # tiny RDP keeps relative precision: leading term α(α−1)q²/(2σ²)·… for huge σ
    a = np.array([2.0, 8.0, 1024.0])
    r = compute_rdp(1e-3, 1e6, a)
    np.testing.assert_allclose(r, a * 1e-6 / 2 * 1e-12, rtol=1e-3)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(sample_rate=1.5, noise_multiplier=1.0), "sample_rate"),
        (dict(sample_rate=-0.1, noise_multiplier=1.0), "sample_rate"),
        (dict(sample_rate=0.1, noise_multiplier=0.0), "noise_multiplier"),
        (dict(sample_rate=0.1, noise_multiplier=np.nan), "noise_multiplier"),
    ],
)
def test_bad_input_is_a_clear_error(kw, match):
    with pytest.raises(InvalidParameterError, match=match):
        compute_rdp(orders=[2.0], **kw)
    with pytest.raises(InvalidParameterError, match="orders"):
        compute_rdp(0.1, 1.0, [1.0])


def test_a_batch_evaluated_again_is_looked_up_bit_identical_and_a_copy(rng):
    """The memo of evaluated batches (``_BatchMemo``): the second evaluation of the same (q, σ, α) is a hit,
    bit-identical to the first, and a copy (writing to a result leaves the memo's value alone); the LRU keeps
    at most its capacity."""
    from idpsgd.accounting import rdp

    q, sigma = rng.uniform(1e-3, 0.9, 300), rng.uniform(0.5, 20.0, 300)
    first = compute_rdp(q, sigma, DEFAULT_ORDERS)
    hits = []
    original = rdp._MEMO.get
    rdp._MEMO.get = lambda key: hits.append(original(key) is not None) or original(key)
    try:
        again = compute_rdp(q, sigma, DEFAULT_ORDERS)
        again[:] = -1.0
        third = compute_rdp(q, sigma, DEFAULT_ORDERS)
    finally:
        del rdp._MEMO.get
    assert hits and all(hits)
    np.testing.assert_array_equal(third, first)
    small = rdp._BatchMemo(capacity=10)
    small.put(b"a", np.zeros(6))
    small.put(b"b", np.ones(6))
    assert small.get(b"a") is None and small.size == 6 and small.get(b"b").tolist() == [1.0] * 6
