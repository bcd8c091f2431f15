"""Per-instance estimates with their error (issue 19, item 10) and mean-rule training (item 9)."""
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
    d = np.stack([[float(sum_rule_step_rdp(q, s, sigma, o)) for s, o in zip(rng.uniform(0.1, 1.0, n), orders)]
                  for _ in range(5)])
    res = composition_bound(d, alpha, worst_step_rdp=worst, failure=0.05)
    assert res["upper"] >= res["bound"] and np.all(res["contributions_upper"] >= res["contributions"] - 1e-15)
    assert res["contributions_upper"][0] == res["contributions"][0]           # the first step is exact
    worst_case = composition_bound(worst[None, :], alpha)["bound"]
    assert res["upper"] <= worst_case * (1 + 1e-12)                           # never above the worst case
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
    assert up <= alpha * (2 * clip) ** 2 / (2 * sigma ** 2) + 1e-12              # the range's top
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
    engine = IndividualizedPrivacyEngine(seed=3)
    gsm, dp_opt, loader = engine.make_private_with_parameters(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
        budgets=Budgets.from_array(np.full(40, 100.0), 1e-5), sample_rates=np.full(40, q),
        clip_norms=np.full(40, clip), noise_multiplier=1e-3, max_grad_norm=clip, privacy_filter=None)
    handle = _install_mean_rule(opt, q * 40)
    xb, yb = next(iter(loader))
    assert 0 < len(yb) and len(yb) != q * 40
    dp_opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(gsm(xb), yb).backward()
    dp_opt.step()
    handle.remove()
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict({"weight": before[0], "bias": before[1]})
    mean = per_example_clipped_grads(ref, xb, yb, clip).mean(dim=0)
    change = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())]).double()
    assert torch.allclose(change, mean, atol=4e-4)
    assert not torch.allclose(change, mean * len(yb) / (q * 40), atol=4e-4)     # the sum rule's update differs
