"""Per-instance RDP (Thudi et al.): Thm. 3.2 and 3.6 per step, Thm. 3.3 composition, Cor. 3.1, NPIU, runner."""
import json
import math
import os

import numpy as np
import pytest
import torch
from scipy.special import comb

from idpsgd import InvalidParameterError
from idpsgd.accounting.per_instance import (
    composition_bound,
    composition_orders,
    corollary_3_1,
    fact_3_5_samples,
    mean_rule_bound,
    npiu_decisions,
    step_orders,
    sum_rule_step_rdp,
)
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


def test_gram_estimator_with_a_target_outside_the_pool(rng):
    """x* from the test set: X = the pool, X' = pool + {x*}; rows after n_pool are never in pool batches."""
    from idpsgd.training.per_instance import _MeanRuleEstimator
    grads = torch.from_numpy(rng.normal(size=(21, 5)))         # 20 training examples, then x*
    est = _MeanRuleEstimator(grads, 0.3, outer=3, inner=4, order=2, rng=np.random.default_rng(2), n_pool=20)
    assert est.mask.shape[1] == 20
    inc_t, inc_o = rng.random((3, 4, 2)) < 0.3, rng.random(3) < 0.3
    g = grads.numpy()

    def update(b, inc):
        rows = list(np.flatnonzero(est.mask[b])) + ([20] if inc else [])
        return g[rows].mean(axis=0) if rows else np.zeros(5)
    outer = np.stack([update(b, inc_o[b]) for b in range(3)])
    tb = 3 + np.arange(24).reshape(3, 4, 2)
    tuples = np.stack([[[update(tb[o, k, i], inc_t[o, k, i]) for i in range(2)] for k in range(4)] for o in range(3)])
    assert est.direction(20, 0.7, inc_t, inc_o) == pytest.approx(mean_rule_bound(outer, tuples, 2, 0.7), rel=1e-9)


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


def test_runner_sum_rule_both_directions(digits, tmp_path):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance
    cfg = TrainConfig(epochs=2, progress=False)          # the paper's C = 1, expected batch 128
    s = run_per_instance(digits, [0, 5], runs=2, alpha=4, config=cfg, epsilon=10.0, out_dir=tmp_path)
    assert s["kind"] == "estimate" and s["target_set"] == "test" and s["steps"] == 22 and s["checkpoints"] == 2
    assert s["runs_trained"] == 2 * 3 and s["clip_norm"] == 1.0 and 0 <= s["test_accuracy"] <= 1
    for p in s["points"]:
        assert p["rdp"] == max(p["rdp_add"], p["rdp_remove"]) > 0
        assert p["rdp_upper"] == max(p["rdp_add_upper"], p["rdp_remove_upper"]) >= p["rdp"] - 1e-12
        assert p["baseline_rdp"] > 0 and 0 <= p["correct_fraction"] <= 1
    import csv
    with open(tmp_path / "private" / "per_instance.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and all(float(r["rdp"]) == max(float(r["rdp_add"]), float(r["rdp_remove"])) for r in rows)
    steps = (tmp_path / "private" / "per_instance_steps.csv").read_text().splitlines()
    assert steps[0] == "point,step,contribution_add,contribution_remove,baseline,ratio_add,ratio_remove"
    assert sum(float(r.split(",")[2]) for r in steps[1:23]) == pytest.approx(s["points"][0]["rdp_add"], rel=1e-9)
    assert sum(float(r.split(",")[3]) for r in steps[1:23]) == pytest.approx(s["points"][0]["rdp_remove"], rel=1e-9)
    saved = json.loads((tmp_path / "private" / "per_instance.json").read_text())
    assert saved["test_accuracy"] == pytest.approx(s["test_accuracy"]) and len(saved["test_accuracy_runs"]) == 2
    for name in ("per_instance.csv", "per_instance.json", "per_instance_steps.csv", "per_instance.png",
                 "per_instance_stages.png"):
        assert os.stat(tmp_path / "private" / name).st_mode & 0o777 == 0o600
    assert [r["point"] for r in s["unlearning"]["requests"]] == [0, 5] and s["unlearning"]["direction"] == "add"


def test_runner_train_targets_use_the_public_algorithm(digits):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance
    cfg = TrainConfig(epochs=1, clip_norm=10.0, lr=0.005, progress=False)
    s = run_per_instance(digits, [3], runs=1, alpha=3, config=cfg, target_set="train")
    p = s["points"][0]
    assert s["target_set"] == "train" and s["runs_trained"] == 2
    assert p["rdp"] == max(p["rdp_add"], p["rdp_remove"])
    assert s["sample_rate"] == pytest.approx(128 / len(digits.y_train))   # q = B/N on X and on X \ {x*}
    with pytest.raises(InvalidParameterError, match="points"):
        run_per_instance(digits, [len(digits.y_test)], runs=1, config=cfg)
    with pytest.raises(InvalidParameterError, match="target_set"):
        run_per_instance(digits, [1], runs=1, config=cfg, target_set="validation")


def test_runner_mean_rule(digits):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance
    cfg = TrainConfig(epochs=1, progress=False)
    s = run_per_instance(digits, [3], runs=1, alpha=2, update_rule="mean", config=cfg, checkpoint_every=4,
                         samples=(3, 3))
    p = s["points"][0]
    assert np.isfinite(p["rdp"]) and p["rdp_add"] >= 0 and p["rdp_remove"] >= 0
    assert p["rdp"] == pytest.approx(max(p["rdp_add"], p["rdp_remove"])) and p["rdp_upper"] >= p["rdp"]
    assert s["unlearning"] is None


def test_per_instance_cli(capsys, tmp_path):
    from idpsgd.cli import build_parser
    args = build_parser().parse_args(["per-instance", "--num-points", "2", "--out", str(tmp_path)])
    assert (args.clip_norm, args.batch_size, args.epsilon, args.alpha, args.target_set) == (1.0, 128, 10.0, 8, "test")
    argv = ["per-instance", "--points", "1,2", "--runs", "1", "--epochs", "1", "--alpha", "3", "--out", str(tmp_path),
            "--no-progress"]
    assert main([*argv, "--json", "--show-private"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"steps", "alpha", "update_rule", "test_accuracy", "baseline_rdp"} <= set(out)
    assert {"points", "unlearning", "median_ratio_to_baseline"} <= set(out["private"])
    assert main([*argv, "--overwrite"]) == 0
    text = capsys.readouterr().out
    assert "rdp_add" in text and "unlearning" not in text and "median" not in text      # nothing private by default
    assert main(["per-instance", "--out", str(tmp_path)]) == 2
    assert "--points" in capsys.readouterr().err
    assert main([*argv[:2], "1,99999", *argv[3:]]) == 2
    assert "--points=" in capsys.readouterr().err
