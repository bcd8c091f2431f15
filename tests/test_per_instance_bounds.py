"""Per-instance estimates with their error and mean-rule training (issue 19)."""

import math

import numpy as np
import pytest
import torch

from idpsgd import InvalidParameterError
from idpsgd.accounting.per_instance import (
    composition_bound,
    exponents_to_bound,
    exponents_to_upper,
    hoeffding_radius,
    mean_rule_bound,
    step_orders,
    sum_rule_step_rdp,
    tuple_exponents,
)


def test_hoeffding_radius():
    assert hoeffding_radius(8, 0.05) == pytest.approx(math.sqrt(math.log(20) / 16))
    with pytest.raises(InvalidParameterError, match="failure"):
        hoeffding_radius(3, 1.5)


def test_composition_upper_bound(rng):
    n, alpha, q, sigma = 30, 4, 0.05, 1.0
    orders = step_orders(alpha, n)
    worst = np.array([float(sum_rule_step_rdp(q, 1.0, sigma, o)) for o in orders])
    d = np.stack(
        [
            [float(sum_rule_step_rdp(q, s, sigma, o)) for s, o in zip(rng.uniform(0.1, 1.0, n), orders, strict=True)]
            for _ in range(5)
        ]
    )
    res = composition_bound(d, alpha, worst_step_rdp=worst, failure=0.05)
    assert res["upper"] >= res["bound"] and np.all(res["contributions_upper"] >= res["contributions"] - 1e-15)
    assert res["contributions_upper"][0] == res["contributions"][0]  # the first step is exact
    worst_case = composition_bound(worst[None, :], alpha)["bound"]
    assert res["upper"] <= worst_case * (1 + 1e-12)  # never above the worst case
    # by hand for one estimated step: ln min(F, mean f + (F - 1)·r)
    t, p = n - 1, 3.0 * n
    from idpsgd.accounting.per_instance import composition_orders

    gi = composition_orders(alpha, p, n)[0]
    f = np.exp(p * (gi - 1) * d[:, t])
    big_f = math.exp(p * (gi - 1) * worst[t])
    r = hoeffding_radius(5, 0.05 / (n - 1))
    expect = (1 / p) / (alpha - 1) * math.log(min(big_f, f.mean() + (big_f - 1) * r))
    assert res["contributions_upper"][t] == pytest.approx(expect, rel=1e-9)
    many = composition_bound(np.repeat(d, 2000, axis=0), alpha, worst_step_rdp=worst)
    assert many["upper"] < res["upper"] and many["bound"] == pytest.approx(res["bound"], rel=1e-9)


def test_thm_3_6_upper_bound(rng):
    alpha, sigma, clip = 3, 2.0, 1.0
    mu = rng.normal(size=(6, 4))
    mu /= np.maximum(np.linalg.norm(mu, axis=1, keepdims=True) / clip, 1.0)
    tup = rng.normal(size=(6, 10, alpha, 4))
    tup /= np.maximum(np.linalg.norm(tup, axis=-1, keepdims=True) / clip, 1.0)
    est = mean_rule_bound(mu, tup, alpha, sigma)
    gram_tt = np.einsum("mkid,mkjd->mkij", tup, tup)
    gram_tw = np.einsum("mkid,md->mki", tup, mu)
    norm_w = np.einsum("md,md->m", mu, mu)[:, None]
    delta = tuple_exponents(gram_tt, gram_tw, norm_w, alpha)
    assert exponents_to_bound(delta, alpha, sigma) == pytest.approx(est)
    up = exponents_to_upper(delta, alpha, sigma, np.linalg.norm(mu, axis=1), clip, 0.05)
    assert up >= est
    assert up <= alpha * (2 * clip) ** 2 / (2 * sigma**2) + 1e-12  # the range's top
    # the exponent's range: −Δ ≤ α(α−1)(c + ‖μ‖)² for every tuple
    assert np.all(-delta <= alpha * (alpha - 1) * (clip + np.linalg.norm(mu, axis=1))[:, None] ** 2 + 1e-9)


def test_mean_rule_training_divides_by_the_realised_batch():
    """One step with σ = 1e-3 and lr = 1: the update is minus the mean of the batch's clipped gradients
    (plus noise of std 1e-3·c/(qN) ≈ 4e-5), not their sum over the expected batch size."""
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd.assignment import Budgets
    from idpsgd.engine import IndividualizedPrivacyEngine
    from idpsgd.training.per_instance import (
        _install_mean_rule,
        per_example_clipped_grads,
    )

    torch.manual_seed(0)
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    model = torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    q, clip = 0.3, 0.5
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=3)
    gsm, dp_opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
        budgets=Budgets.from_array(np.full(40, 100.0), 1e-5),
        sample_rates=np.full(40, q),
        clip_norms=np.full(40, clip),
        noise_multiplier=1e-3,
        max_grad_norm=clip,
        privacy_filter=None,
    )
    handle = _install_mean_rule(opt, q * 40, model)
    xb, yb = next(iter(loader))
    assert len(yb) > 0 and len(yb) != q * 40
    dp_opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(gsm(xb), yb).backward()
    dp_opt.step()
    handle.remove()
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict({"weight": before[0], "bias": before[1]})
    mean = per_example_clipped_grads(ref, xb, yb, clip).mean(dim=0)
    change = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)]).double()
    assert torch.allclose(change, mean, atol=4e-4)
    assert not torch.allclose(change, mean * len(yb) / (q * 40), atol=4e-4)  # the sum rule's update differs


# --- orders, the same-composition baseline, the default order -----------------------------------
def _composition_reference(d, alpha, p, worst=None, failure=0.05):
    """Thm. 3.3 step by step (the loop the vectorized composition_bound replaced)."""
    from idpsgd.accounting.per_instance import _log_mean_upper, composition_orders
    from idpsgd.accounting.rdp import logsumexp

    runs, n = d.shape
    g = composition_orders(alpha, p, n)
    radius = hoeffding_radius(runs, failure / max(n - 1, 1))
    contrib, upper = np.empty(n), np.empty(n)
    for t in range(n):
        i = n - 1 - t
        if i == n - 1:
            contrib[t] = upper[t] = ((p - 1) / p) ** (n - 1) * (g[i] - 1) * float(np.max(d[:, t]))
        else:
            log_w = i * math.log((p - 1) / p) - math.log(p)
            z = p * (g[i] - 1) * d[:, t]
            contrib[t] = math.exp(log_w) * (float(logsumexp(z)) - math.log(runs))
            if worst is not None:
                log_hi = p * (g[i] - 1) * max(float(worst[t]), float(np.max(d[:, t])))
                upper[t] = math.exp(log_w) * _log_mean_upper(z, log_hi, 0.0, radius)
    return contrib / (alpha - 1), upper / (alpha - 1)


@pytest.mark.parametrize(("alpha", "p"), [(4, None), (2.41, 90.0)])
def test_vectorized_composition_matches_the_step_loop(rng, alpha, p):
    n, q, sigma = 30, 0.05, 1.0
    orders = step_orders(alpha, n, p, integer=False)
    worst = np.array([float(sum_rule_step_rdp(q, 1.0, sigma, o)) for o in orders])
    d = np.stack(
        [
            [float(sum_rule_step_rdp(q, s, sigma, o)) for s, o in zip(rng.uniform(0, 1, n), orders, strict=True)]
            for _ in range(4)
        ]
    )
    res = composition_bound(d, alpha, p, worst_step_rdp=worst)
    contrib, upper = _composition_reference(d, alpha, float(3 * n if p is None else p), worst)
    assert np.allclose(res["contributions"], contrib, rtol=1e-12, atol=0)
    assert np.allclose(res["contributions_upper"], upper, rtol=1e-12, atol=0)


def test_lattice_step_orders():
    from idpsgd.accounting.per_instance import composition_orders

    n, alpha = 4790, 2.414
    exact = composition_orders(alpha, 3 * n, n)[::-1]
    lat = step_orders(alpha, n, integer=False)
    assert lat[-1] == pytest.approx(alpha) and np.all(lat >= exact - 1e-12)  # rounded up: a valid order
    assert np.all((lat - 1) / (exact - 1) <= 2 ** (1 / 64) + 1e-12)  # by at most 1.1 % in α − 1
    assert np.unique(lat).size <= 33  # e^{1/3}: ~31 lattice points
    assert np.array_equal(step_orders(alpha, n), np.ceil(exact - 1e-12))  # ⌈g⌉ for integers
    assert np.all(np.diff(lat) <= 0)  # orders fall towards the end


def test_same_composition_baseline():
    from idpsgd.accounting import compute_rdp
    from idpsgd.accounting.per_instance import same_composition_rdp

    q, sigma, n, alpha = 3 / 1437, 0.477, 400, 2.414
    same = same_composition_rdp(q, sigma, alpha, n)
    orders = step_orders(alpha, n, integer=False)
    direct = sum(float(compute_rdp(q, sigma, [float(o)])[0]) for o in orders)
    assert same["rdp"] == pytest.approx(direct, rel=1e-9)  # Thm. 3.3 at sensitivity C: Σ_t ρ_{o_t}(C)
    assert same["rdp"] >= n * float(compute_rdp(q, sigma, [alpha])[0])  # never below the plain n·ρ_α(C)
    assert same["rdp"] == pytest.approx(composition_bound(np.tile(same["per_step"], (3, 1)), alpha)["bound"], rel=1e-9)
    integer = same_composition_rdp(q, sigma, 2, n, integer=True)  # ⌈g⌉ = 3 at all but the last step
    assert integer["rdp"] > 5 * same_composition_rdp(q, sigma, 2, n)["rdp"]


def test_default_order_minimises_the_data_independent_epsilon():
    from idpsgd.accounting import compute_rdp, epsilon_sgm
    from idpsgd.accounting.conversion import rdp_to_epsilon
    from idpsgd.accounting.per_instance import best_order, epsilon_at_order

    q, sigma, steps, delta = 128 / 60000, 0.478, 4690, 1e-5  # the paper's MNIST setting at eps = 10
    ints = np.arange(2, 65, dtype=float)
    rdp = compute_rdp(q, sigma, ints) * steps
    eps_int = [float(rdp_to_epsilon(rdp[i : i + 1], ints[i : i + 1], delta)[0]) for i in range(ints.size)]
    assert best_order(q, sigma, steps, delta, integer=True) == ints[int(np.argmin(eps_int))]
    a = best_order(q, sigma, steps, delta)
    at_a = float(epsilon_at_order(float(compute_rdp(q, sigma, [a])[0]) * steps, a, delta))
    assert at_a == pytest.approx(float(epsilon_sgm(q, sigma, steps, delta)), rel=1e-9)
    assert at_a <= min(eps_int) and 2 <= a < 3
    assert float(compute_rdp(q, sigma, [8.0])[0]) * steps > 1e4  # the paper's α = 8: past the phase transition


def test_default_order_keeps_the_composition_below_the_phase_transition():
    """The per-instance default: the order minimising the ε of Thm. 3.3 at sensitivity C.  At ε = 1 the run's
    own best order pushes the composition's growing orders past the phase transition."""
    from idpsgd.accounting import calibrate_noise_multiplier
    from idpsgd.accounting.per_instance import (
        best_composition_order,
        best_order,
        epsilon_at_order,
        same_composition_rdp,
    )

    q, steps, delta = 3 / 1437, 4790, 1e-5
    sigma = float(np.ravel(calibrate_noise_multiplier(1.0, delta, q, steps))[0])

    def composed_eps(a, integer=False):
        return float(epsilon_at_order(same_composition_rdp(q, sigma, a, steps, integer=integer)["rdp"], a, delta))

    plain, auto = best_order(q, sigma, steps, delta), best_composition_order(q, sigma, steps, delta)
    assert composed_eps(plain) > 100 and composed_eps(auto) < 1.5 and auto < plain
    for other in (auto * 0.97, auto * 1.03, 8.0, 12.0, 2.0):
        assert composed_eps(auto) <= composed_eps(other)
    ints = np.arange(2, 65)
    best_int = best_composition_order(q, sigma, steps, delta, integer=True)
    assert best_int == ints[int(np.argmin([composed_eps(float(a), True) for a in ints]))]
