"""Per-instance RDP (Thudi et al.): Thm. 3.2 and 3.6 per step, Thm. 3.3 composition, Cor. 3.1, NPIU, runner."""
import json
import math
import os

import numpy as np
import pytest
import torch
from scipy.special import comb

from idpsgd import InvalidParameterError
from idpsgd.accounting.per_instance import (composition_bound, composition_orders, corollary_3_1, fact_3_5_samples,
                                            mean_rule_bound, npiu_decisions, step_orders, sum_rule_step_rdp)
from idpsgd.cli import main


def thm_3_2(q, delta_norm, sigma, alpha):
    k = np.arange(alpha + 1)
    terms = comb(alpha, k) * (1 - q) ** (alpha - k) * q ** k * np.exp(delta_norm ** 2 * (k ** 2 - k) / (2 * sigma ** 2))
    return math.log(terms.sum()) / (alpha - 1)


@pytest.mark.parametrize("q,norm,sigma,alpha", [(0.01, 1.0, 1.1, 8), (0.1, 0.3, 2.0, 16), (0.5, 2.0, 4.0, 3),
                                                (1.0, 1.0, 1.5, 5), (0.02, 0.0, 1.0, 4)])
def test_sum_rule_is_theorem_3_2(q, norm, sigma, alpha):
    assert float(sum_rule_step_rdp(q, norm, sigma, alpha)) == pytest.approx(thm_3_2(q, norm, sigma, alpha), rel=1e-9,
                                                                             abs=1e-15)
    with pytest.raises(InvalidParameterError, match="alpha=2.5 is invalid"):
        sum_rule_step_rdp(q, norm, sigma, 2.5)


def test_mean_rule_bound_known_cases(rng):
    mu = rng.normal(size=(4, 6))
    same = np.broadcast_to(mu[:, None, None, :], (4, 5, 3, 6))
    assert mean_rule_bound(mu, same, 3, 1.0) == pytest.approx(0.0, abs=1e-12)      # x* never changes the update
    v = rng.normal(size=6)
    shifted = np.broadcast_to((mu + v)[:, None, None, :], (4, 5, 3, 6))
    sigma = 1.7
    gauss = 3 * float(v @ v) / (2 * sigma ** 2)                                   # D_α of N(v, σ²) vs N(0, σ²)
    assert mean_rule_bound(mu, shifted, 3, sigma) == pytest.approx(gauss, rel=1e-9)


def test_gram_estimator_matches_explicit_updates(rng):
    from idpsgd.training.per_instance import _MeanRuleEstimator
    grads = torch.from_numpy(rng.normal(size=(30, 5)))
    est = _MeanRuleEstimator(grads, 0.2, outer=3, inner=4, order=3, rng=np.random.default_rng(1))
    point, noise = 7, 0.9
    inc_t = rng.random((3, 4, 3)) < 0.2
    inc_o = np.zeros(3, bool)
    g = grads.numpy()

    def update(b, inc):
        members = est.mask[b].copy()
        members[point] = inc
        return g[members].mean(axis=0) if members.any() else np.zeros(5)
    outer = np.stack([update(b, False) for b in range(3)])
    tb = 3 + np.arange(36).reshape(3, 4, 3)
    tuples = np.stack([[[update(tb[o, k, i], inc_t[o, k, i]) for i in range(3)] for k in range(4)] for o in range(3)])
    assert est.direction(point, noise, inc_t, inc_o) == pytest.approx(mean_rule_bound(outer, tuples, 3, noise), rel=1e-9)


def test_composition_of_identical_steps_is_plain_composition():
    n, alpha, d = 50, 8, 0.013
    res = composition_bound(np.full((4, n), d), alpha)          # same per-step value at every order
    assert res["bound"] == pytest.approx(n * d, rel=1e-9)        # Thm. 3.3 collapses to n·d
    assert np.allclose(res["contributions"], d)
    g = composition_orders(alpha, 3 * n, n)
    assert g[0] == alpha and np.all(np.diff(g) > 0) and g[-1] <= 2 * alpha       # Fact 3.4 with p = 3n
    assert composition_orders(1.0, 10, 5)[-1] == pytest.approx(1.0)              # 1 is g_p's fixed point


def test_composition_uses_the_lp_norm_over_runs(rng):
    d = rng.uniform(0, 0.02, (6, 30))
    res = composition_bound(d, 4)
    mean_based = composition_bound(np.broadcast_to(d.mean(axis=0), d.shape), 4)["bound"]
    max_based = composition_bound(np.broadcast_to(d.max(axis=0), d.shape), 4)["bound"]
    assert mean_based <= res["bound"] <= max_based


def test_sum_rule_composition_against_baseline():
    n, alpha, q, sigma = 40, 4, 0.05, 1.2
    orders = step_orders(alpha, n)
    worst = np.array([[float(sum_rule_step_rdp(q, 1.0, sigma, o)) for o in orders]])
    res = composition_bound(worst, alpha)
    base = n * float(sum_rule_step_rdp(q, 1.0, sigma, alpha))
    assert base <= res["bound"] <= n * float(sum_rule_step_rdp(q, 1.0, sigma, 2 * alpha))   # order blow-up
    half = np.array([[float(sum_rule_step_rdp(q, 0.5, sigma, o)) for o in orders]])
    assert composition_bound(half, alpha)["bound"] < base                       # smaller gradients: better


def test_fact_3_5_and_corollary_3_1():
    log10_l = fact_3_5_samples(2, 0.001, 0.002, 10, precision=0.5, failure=0.1)
    expected = math.log(2 / 0.1) / (2 * 0.25) * math.exp(6 * 3 * 0.02 - 6 * 1 * 0.01)
    assert 10 ** log10_l == pytest.approx(expected, rel=1e-9)
    q, s, sigma, delta = 0.05, 0.8, 2.0, 1e-5
    c = math.sqrt(2 * math.log(1.25 / delta)) / sigma
    classical = math.log(q * math.exp(c * s) + 1 - q)
    eps, dd = corollary_3_1(q, [s] * 10, sigma, delta, 1e-6, p=1e6)
    assert eps == pytest.approx(classical, rel=1e-4) and dd == pytest.approx(q * delta + 1e-6)
    spread = corollary_3_1(q, np.r_[np.zeros(99), s], sigma, delta, 1e-6, p=4.0)[0]
    assert spread < corollary_3_1(q, [s] * 100, sigma, delta, 1e-6, p=4.0)[0]   # concentrated sensitivities help


def test_npiu_recursion_by_hand():
    div = [lambda a: 0.1 * a] * 3
    out = npiu_decisions(div, alpha=2.0, beta=1.0)
    assert [d["decision"] for d in out] == ["keep", "retrain", "keep"]
    assert out[0]["bound"] == pytest.approx(0.3) and out[1]["bound"] == pytest.approx(1.5 * 0.7 + 0.3)
    assert [d["decision"] for d in npiu_decisions([lambda a: math.inf], 2.0, 1.0)] == ["retrain"]


@pytest.fixture(scope="module")
def digits():
    from idpsgd.data import load_dataset
    return load_dataset("digits")


def test_runner_sum_rule(digits, tmp_path):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance
    cfg = TrainConfig(epochs=3, clip_norm=10.0, lr=0.005, progress=False)
    s = run_per_instance(digits, [0, 5, 9], runs=2, alpha=4, config=cfg, epsilon=8.0, out_dir=tmp_path)
    assert s["kind"] == "estimate" and s["steps"] == 33 and s["checkpoints"] == 3
    for p in s["points"]:
        assert 0 < p["rdp"] and p["baseline_rdp"] > 0 and 0 <= p["correct_fraction"] <= 1
    rows = (tmp_path / "per_instance_steps.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 33
    contrib = [float(r.split(",")[2]) for r in rows[1:34]]
    assert sum(contrib) == pytest.approx(s["points"][0]["rdp"], rel=1e-9)
    for name in ("per_instance.csv", "per_instance.json", "per_instance_steps.csv", "per_instance.png"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o600
    assert [r["point"] for r in s["unlearning"]["requests"]] == [0, 5, 9]


def test_runner_mean_rule(digits):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance
    cfg = TrainConfig(epochs=1, clip_norm=10.0, lr=0.005, progress=False)
    s = run_per_instance(digits, [3], runs=1, alpha=2, update_rule="mean", config=cfg, epsilon=8.0,
                         checkpoint_every=4, samples=(3, 3))
    p = s["points"][0]
    assert np.isfinite(p["rdp"]) and p["bound_forward"] >= 0 and p["bound_backward"] >= 0
    assert p["rdp"] == pytest.approx(max(p["bound_forward"], p["bound_backward"]))


def test_per_instance_cli(capsys, tmp_path):
    argv = ["per-instance", "--points", "1,2", "--runs", "1", "--epochs", "1", "--alpha", "3", "--out", str(tmp_path),
            "--no-progress"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"points", "unlearning", "steps", "alpha", "update_rule"} <= set(out)
    assert main(argv) == 0 and "unlearning" in capsys.readouterr().out
    assert main(["per-instance", "--out", str(tmp_path)]) == 2
    assert "--points" in capsys.readouterr().err
    assert main([*argv[:2], "1,99999", *argv[3:]]) == 2
    assert "--points=" in capsys.readouterr().err
