"""Per-instance RDP (Thudi et al.): Thm. 3.2 and 3.6 per step, Thm. 3.3 composition, Cor. 3.1, NPIU, runner."""

import json
import math

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
from support import file_mode


def thm_3_2(q, delta_norm, sigma, alpha):
    k = np.arange(alpha + 1)
    terms = comb(alpha, k) * (1 - q) ** (alpha - k) * q**k * np.exp(delta_norm**2 * (k**2 - k) / (2 * sigma**2))
    return math.log(terms.sum()) / (alpha - 1)


@pytest.mark.parametrize(
    ("q", "norm", "sigma", "alpha"),
    [(0.01, 1.0, 1.1, 8), (0.1, 0.3, 2.0, 16), (0.5, 2.0, 4.0, 3), (1.0, 1.0, 1.5, 5), (0.02, 0.0, 1.0, 4)],
)
def test_sum_rule_is_theorem_3_2(q, norm, sigma, alpha):
    assert float(sum_rule_step_rdp(q, norm, sigma, alpha)) == pytest.approx(
        thm_3_2(q, norm, sigma, alpha), rel=1e-9, abs=1e-15
    )
    with pytest.raises(InvalidParameterError, match="alpha=1 is invalid"):
        sum_rule_step_rdp(q, norm, sigma, 1)


def _divergence_by_quadrature(log_p, log_q, alpha, lo, hi):
    from scipy.integrate import quad

    val, _ = quad(
        lambda x: math.exp(alpha * log_p(x) + (1 - alpha) * log_q(x)), lo, hi, limit=400, epsabs=0, epsrel=1e-10
    )
    return math.log(val) / (alpha - 1)


@pytest.mark.parametrize(
    ("q", "norm", "sigma", "alpha"), [(0.05, 0.7, 0.8, 2.5), (0.002, 1.0, 0.48, 1.7), (0.2, 0.4, 1.0, 3.3)]
)
def test_sum_rule_at_real_orders(q, norm, sigma, alpha):
    """Thm. 3.2's reduction holds at real orders: the bound is the divergence of (1−q)N(0,σ²) + qN(s,σ²)
    from N(0,σ²) (by quadrature), which also bounds the reverse divergence (Mironov et al. Thm. 5)."""
    from scipy.stats import norm as gauss

    def mix(x):
        return np.logaddexp(
            math.log1p(-q) + gauss.logpdf(x, 0, sigma),
            math.log(q) + gauss.logpdf(x, norm, sigma),
        )

    base = lambda x: gauss.logpdf(x, 0, sigma)  # noqa: E731
    lo, hi = -20 * sigma, norm + 20 * sigma * alpha
    value = float(sum_rule_step_rdp(q, norm, sigma, alpha))
    assert value == pytest.approx(_divergence_by_quadrature(mix, base, alpha, lo, hi), rel=1e-6)
    assert _divergence_by_quadrature(base, mix, alpha, lo, hi) <= value * (1 + 1e-9)
    below = float(sum_rule_step_rdp(q, norm, sigma, math.floor(alpha))) if math.floor(alpha) > 1 else 0.0
    assert below <= value <= float(sum_rule_step_rdp(q, norm, sigma, math.ceil(alpha)))  # monotone in the order


def test_mean_rule_bound_known_cases(rng):
    mu = rng.normal(size=(4, 6))
    same = np.broadcast_to(mu[:, None, None, :], (4, 5, 3, 6))
    assert mean_rule_bound(mu, same, 3, 1.0) == pytest.approx(0.0, abs=1e-12)  # x* never changes the update
    v = rng.normal(size=6)
    shifted = np.broadcast_to((mu + v)[:, None, None, :], (4, 5, 3, 6))
    sigma = 1.7
    gauss = 3 * float(v @ v) / (2 * sigma**2)  # D_α of N(v, σ²) vs N(0, σ²)
    assert mean_rule_bound(mu, shifted, 3, sigma) == pytest.approx(gauss, rel=1e-9)


def test_gram_estimator_with_a_target_outside_the_pool(rng):
    """x* from the test set: X = the pool, X' = pool + {x*}; rows after n_pool are never in pool batches."""
    from idpsgd.training.per_instance import _MeanRuleEstimator

    grads = torch.from_numpy(rng.normal(size=(21, 5)))  # 20 training examples, then x*
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
    assert est.direction(point, noise, inc_t, inc_o) == pytest.approx(
        mean_rule_bound(outer, tuples, 3, noise), rel=1e-9
    )


def test_composition_of_identical_steps_is_plain_composition():
    n, alpha, d = 50, 8, 0.013
    res = composition_bound(np.full((4, n), d), alpha)  # same per-step value at every order
    assert res["bound"] == pytest.approx(n * d, rel=1e-9)  # Thm. 3.3 collapses to n·d
    assert np.allclose(res["contributions"], d)
    g = composition_orders(alpha, 3 * n, n)
    assert g[0] == alpha and np.all(np.diff(g) > 0) and g[-1] <= 2 * alpha  # Fact 3.4 with p = 3n
    assert composition_orders(1.0, 10, 5)[-1] == pytest.approx(1.0)  # 1 is g_p's fixed point


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
    assert base <= res["bound"] <= n * float(sum_rule_step_rdp(q, 1.0, sigma, 2 * alpha))  # order blow-up
    half = np.array([[float(sum_rule_step_rdp(q, 0.5, sigma, o)) for o in orders]])
    assert composition_bound(half, alpha)["bound"] < base  # smaller gradients: better


def test_fact_3_5_and_corollary_3_1():
    log10_l = fact_3_5_samples(2, 0.001, 0.002, 10, precision=0.5, failure=0.1)
    expected = math.log(2 / 0.1) / (2 * 0.25) * math.exp(6 * 3 * 0.02 - 6 * 1 * 0.01)
    assert 10**log10_l == pytest.approx(expected, rel=1e-9)
    q, s, sigma, delta = 0.05, 0.8, 2.0, 1e-5
    c = math.sqrt(2 * math.log(1.25 / delta)) / sigma
    classical = math.log(q * math.exp(c * s) + 1 - q)
    eps, dd = corollary_3_1(q, [s] * 10, sigma, delta, 1e-6, p=1e6)
    assert eps == pytest.approx(classical, rel=1e-4) and dd == pytest.approx(q * delta + 1e-6)
    spread = corollary_3_1(q, np.r_[np.zeros(99), s], sigma, delta, 1e-6, p=4.0)[0]
    assert spread < corollary_3_1(q, [s] * 100, sigma, delta, 1e-6, p=4.0)[0]  # concentrated sensitivities help


def test_npiu_recursion_by_hand():
    div = [lambda a: 0.1 * a] * 3
    out = npiu_decisions(div, alpha=2.0, beta=1.0)
    assert [d["decision"] for d in out] == ["keep", "retrain", "keep"]
    assert out[0]["bound"] == pytest.approx(0.3) and out[1]["bound"] == pytest.approx(1.5 * 0.7 + 0.3)
    assert [d["decision"] for d in npiu_decisions([lambda a: math.inf], 2.0, 1.0)] == ["retrain"]


def test_runner_sum_rule_both_directions(digits, tmp_path):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance

    cfg = TrainConfig(epochs=2, progress=False)  # the paper's C = 1, expected batch 128
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
    for name in (
        "per_instance.csv",
        "per_instance.json",
        "per_instance_steps.csv",
        "per_instance.png",
        "per_instance_stages.png",
    ):
        assert file_mode(tmp_path / "private" / name) == 0o600
    assert [r["point"] for r in s["unlearning"]["requests"]] == [0, 5] and s["unlearning"]["direction"] == "add"


def test_runner_train_targets_use_the_public_algorithm(digits):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance

    cfg = TrainConfig(epochs=1, clip_norm=10.0, lr=0.005, progress=False)
    s = run_per_instance(digits, [3], runs=1, alpha=3, config=cfg, target_set="train")
    p = s["points"][0]
    assert s["target_set"] == "train" and s["runs_trained"] == 2
    assert p["rdp"] == max(p["rdp_add"], p["rdp_remove"])
    assert s["sample_rate"] == pytest.approx(128 / len(digits.y_train))  # q = B/N on X and on X \ {x*}
    with pytest.raises(InvalidParameterError, match="points"):
        run_per_instance(digits, [len(digits.y_test)], runs=1, config=cfg)
    with pytest.raises(InvalidParameterError, match="target_set"):
        run_per_instance(digits, [1], runs=1, config=cfg, target_set="validation")


def test_runner_mean_rule(digits):
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance

    cfg = TrainConfig(epochs=1, progress=False)
    s = run_per_instance(
        digits, [3], runs=1, alpha=2, update_rule="mean", config=cfg, checkpoint_every=4, samples=(3, 3)
    )
    p = s["points"][0]
    assert np.isfinite(p["rdp"]) and p["rdp_add"] >= 0 and p["rdp_remove"] >= 0
    assert p["rdp"] == pytest.approx(max(p["rdp_add"], p["rdp_remove"])) and p["rdp_upper"] >= p["rdp"]
    assert s["unlearning"] is None


def test_per_instance_cli(capsys, tmp_path):
    from idpsgd.cli import build_parser

    args = build_parser().parse_args(["per-instance", "--num-points", "2", "--out", str(tmp_path)])
    assert (args.clip_norm, args.batch_size, args.epsilon, args.alpha, args.target_set) == (
        1.0,
        128,
        10.0,
        None,
        "test",
    )
    assert build_parser().parse_args(["per-instance", "--alpha", "2.5", "--out", str(tmp_path)]).alpha == 2.5
    argv = [
        "per-instance",
        "--points",
        "1,2",
        "--runs",
        "1",
        "--epochs",
        "1",
        "--alpha",
        "3",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert main([*argv, "--json", "--show-private"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"steps", "alpha", "update_rule", "test_accuracy", "baseline_rdp"} <= set(out)
    assert {"points", "unlearning", "median_ratio_to_baseline"} <= set(out["private"])
    assert main([*argv, "--overwrite"]) == 0
    text = capsys.readouterr().out
    assert "rdp_add" in text and "unlearning" not in text and "median" not in text  # nothing private by default
    assert main(["per-instance", "--out", str(tmp_path)]) == 2
    assert "--points" in capsys.readouterr().err
    assert main([*argv[:2], "1,99999", *argv[3:]]) == 2
    assert "--points=" in capsys.readouterr().err


# --- many runs at once, the paper's regime, the reproduce experiment ------------------------------
def _small_cnn():
    from torch import nn

    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, stride=1),
        nn.ReLU(),
        nn.AvgPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(6, 5),
    )


def _images(rng, n=12):
    x = torch.from_numpy(rng.normal(size=(n, 1, 8, 8))).float()
    y = torch.from_numpy(rng.integers(0, 5, n))
    return x, y


def test_parallel_runs_per_example_gradients(rng):
    """Per-example norms and the clipped sum of the stacked runs equal plain autograd on each run's model."""
    import copy

    from idpsgd.models import create_model
    from idpsgd.training.per_instance_runs import ParallelRuns, supports

    model = _small_cnn()
    x, y = _images(rng)
    assert supports(model) and supports(create_model("lenet5", (1, 28, 28), 10))
    assert not supports(create_model("resnet20", (3, 32, 32), 10))
    pr = ParallelRuns(model, x, y, np.ones((3, 12), bool), 0.5, 1.0, 0.7, 6.0, 0.1, 0.0, seed=0)
    for _ in range(2):
        pr.step()  # the runs drift apart
    runs, rows = np.repeat(np.arange(3), 4), np.tile([0, 3, 5, 11], 3)
    norms = pr.grad_norms(runs, rows)
    for m in range(3):
        ref = copy.deepcopy(model)
        params = [v[m] for p in pr.params for v in p.values()]
        with torch.no_grad():
            for mine, theirs in zip(ref.parameters(), params, strict=True):
                mine.copy_(theirs)
        for i, j in enumerate([0, 3, 5, 11]):
            ref.zero_grad()
            torch.nn.functional.cross_entropy(ref(x[j : j + 1]), y[j : j + 1]).backward()
            g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
            assert norms[4 * m + i] == pytest.approx(float(g.norm()), rel=1e-5)
    assert not np.allclose(norms[:4], norms[4:8])


@pytest.mark.parametrize("layout", [0.0, math.inf])  # flat (gathered weights), padded blocks
def test_parallel_runs_step_is_dp_sgd(rng, layout):
    """With σ = 0 one step of run m is θ − η·Σ_batch clip_C(g)/normaliser; momentum as torch.optim.SGD; the
    batches are Poisson draws from the run's own members only."""
    import copy

    from idpsgd.training.per_instance_runs import ParallelRuns

    model = _small_cnn()
    x, y = _images(rng)
    members = np.ones((2, 12), bool)
    members[1, :6] = False  # run 1 trains on rows 6..11 only
    pr = ParallelRuns(model, x, y, members, 0.5, 0.0, 0.3, 4.0, 0.2, 0.9, seed=1)
    pr.padding_limit = layout
    refs = [copy.deepcopy(model) for _ in range(2)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.2, momentum=0.9) for r in refs]
    for _ in range(3):
        pr.step()
        for m, (ref, opt) in enumerate(zip(refs, opts, strict=True)):
            batch = pr.last_batches[m].numpy()
            assert members[m, batch].all()
            opt.zero_grad()
            total = [torch.zeros_like(p) for p in ref.parameters()]
            for j in batch:
                grads = torch.autograd.grad(
                    torch.nn.functional.cross_entropy(ref(x[j : j + 1]), y[j : j + 1]), list(ref.parameters())
                )
                norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
                for t, g in zip(total, grads, strict=True):
                    t += g * min(1.0, 0.3 / (norm + 1e-6))
            for p, t in zip(ref.parameters(), total, strict=True):
                p.grad = t / 4.0
            opt.step()
    for m, ref in enumerate(refs):
        mine = torch.cat([v[m].reshape(-1) for p in pr.params for v in p.values()])
        theirs = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        assert torch.allclose(mine, theirs, atol=1e-5)
    sizes = []
    pr2 = ParallelRuns(model, x, y, members, 0.25, 1.0, 0.3, 3.0, 0.0, 0.0, seed=2)
    for _ in range(400):
        pr2._draw()
        sizes.append([len(b) for b in pr2.last_batches])
    assert np.mean(sizes, axis=0) == pytest.approx([3.0, 1.5], rel=0.1)  # q·|members|


def test_parallel_engine_starts_where_the_trainer_starts(digits):
    """Both engines train from the same initialisation: the first recorded sensitivities (before any step) agree."""
    from idpsgd.assignment import Budgets
    from idpsgd.models import create_model
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import _trainer_chains
    from idpsgd.training.per_instance_runs import parallel_chains
    from idpsgd.training.plans import build_plan

    cfg = TrainConfig(epochs=1, batch_size=64, model="mlp", seed=5, progress=False)
    budgets = Budgets.from_array(np.full(len(digits.y_train), 10.0), 1e-5)
    plan = build_plan(budgets, "uniform", 64, 1, 1.0)
    a = plan.phases[0].assignment
    pts = np.array([2, 7])
    x, y = digits.x_test[pts], digits.y_test[pts]
    chains, _, _ = _trainer_chains(
        digits, budgets, plan, cfg, x, y, pts, "test", 1, 2.0, None, 1000, "sum", (1, 1), 0.05, "remove", 10.0, 1e-5
    )
    torch.manual_seed(5)
    model = create_model("mlp", digits.input_shape, digits.num_classes)
    res = parallel_chains(
        digits,
        x,
        y,
        pts,
        "test",
        1,
        model,
        a.sample_rate,
        a.noise_multiplier,
        1.0,
        a.expected_batch_size,
        plan.steps,
        1000,
        0.05,
        0.9,
        5,
    )
    assert np.allclose(chains["remove"]["sens"][0, 0], res["shared"]["sens"][0, 0], rtol=1e-4)
    assert np.allclose(chains["add"]["sens"][0, 0], res["own"]["sens"][0, 0], rtol=1e-4)


def test_runner_reports_ratios_baselines_and_guarantees(digits, tmp_path):
    """Issue 25: per-step ratio statistics, the same-composition baseline, min(per-instance, data-independent)."""
    import csv

    from idpsgd.accounting.per_instance import best_order
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance

    cfg = TrainConfig(epochs=1, batch_size=16, lr=0.03, momentum=0.0, model="mlp", seed=1, progress=False)
    s = run_per_instance(digits, [0, 4, 8], runs=2, config=cfg, checkpoint_every=3, out_dir=tmp_path, figures=False)
    assert s["engine"] == "parallel" and s["checkpoint_every"] == 3 and "same composition" in s["alpha_rule"]
    assert s["best_order_data_independent"] == best_order(s["sample_rate"], s["noise_multiplier"], s["steps"], 1e-5)
    assert 1 < s["alpha"] <= s["best_order_data_independent"]  # best_composition_order: not a fixed 8
    assert not (tmp_path / "private" / "per_instance.png").exists()
    assert s["data_independent_epsilon"] <= 10.0 * (1 + 1e-6)
    assert s["same_composition_rdp"] >= s["baseline_rdp"]
    with open(tmp_path / "private" / "per_instance.csv") as fh:
        rows = list(csv.DictReader(fh))
    steps = np.loadtxt(tmp_path / "private" / "per_instance_steps.csv", delimiter=",", skiprows=1)
    for r, _point in zip(rows, s["points"], strict=True):
        f = {k: float(v) for k, v in r.items()}
        assert f["ratio_to_same_composition"] == pytest.approx(f["rdp"] / s["same_composition_rdp"], rel=1e-9)
        # sensitivities every 3 steps: the upper values are estimates, the guarantee the data-independent bound
        assert f["guarantee_rdp"] == f["baseline_rdp"] and f["guarantee_epsilon"] == s["data_independent_epsilon"]
        assert f["estimate_min_epsilon"] <= f["guarantee_epsilon"] + 1e-9
        mine = steps[steps[:, 0] == f["point"]]
        assert f["step_ratio_add_mean"] == pytest.approx(mine[:, 5].mean(), rel=1e-9)
        assert f["step_ratio_remove_p10"] == pytest.approx(np.percentile(mine[:, 6], 10), rel=1e-9)
        assert f["step_ratio_add_late_mean"] == pytest.approx(mine[s["steps"] // 2 :, 5].mean(), rel=1e-9)
        assert 0 <= f["late_thm32_ratio_add"] <= 1 + 1e-9  # Thm. 3.2 alone never exceeds the baseline
    curves = np.loadtxt(tmp_path / "private" / "per_instance_curves.csv", delimiter=",", skiprows=1)
    ratio_add = np.stack([steps[steps[:, 0] == p["point"], 5] for p in s["points"]])
    assert np.allclose(curves[:, 1], ratio_add.mean(axis=0)) and np.allclose(
        curves[:, 2], np.percentile(ratio_add, 10, 0)
    )
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert "points" not in settings and "curves" not in settings and settings["alpha"] == s["alpha"]
    assert file_mode(tmp_path / "private" / "per_instance_curves.csv") == 0o600
    fixed = run_per_instance(digits, [0], runs=1, alpha=8, config=cfg, checkpoint_every=3)
    assert fixed["alpha"] == 8 and fixed["alpha_rule"] == "given" and fixed["baseline_rdp"] > 100 * s["baseline_rdp"]


@pytest.mark.parametrize("every", [1, 4])
def test_upper_values_are_confidence_bounds_only_when_every_step_is_measured(digits, tmp_path, every):
    """Steps between checkpoints reuse the last measured sensitivity, so *_upper and
    guarantee_* are confidence bounds only with checkpoint_every = 1; the summary, settings.json and the
    command's text say which, and that the failure probability is per point."""
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import FAILURE_SCOPE, run_per_instance

    cfg = TrainConfig(epochs=1, batch_size=64, lr=0.03, momentum=0.0, model="mlp", seed=1, progress=False)
    s = run_per_instance(digits, [0, 4], runs=1, config=cfg, checkpoint_every=every, out_dir=tmp_path, figures=False)
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["failure_scope"] == s["failure_scope"] == FAILURE_SCOPE and "no union bound" in FAILURE_SCOPE
    assert settings["upper_kind"] == s["upper_kind"] == ("confidence upper bound" if every == 1 else "estimate")
    for p in s["points"]:
        if every == 1:
            assert p["guarantee_rdp"] == min(p["rdp_upper"], p["baseline_rdp"])
            assert p["guarantee_epsilon"] == min(p["epsilon_upper"], s["data_independent_epsilon"])
        else:  # the upper values are estimates: only the data-independent bound is a guarantee
            assert p["guarantee_rdp"] == p["baseline_rdp"] and p["guarantee_epsilon"] == s["data_independent_epsilon"]
    assert ("every 4 steps" in s["guarantee_rule"]) == (every == 4)
    from idpsgd.cli.per_instance_command import _per_instance_text

    text = _per_instance_text({**s, "out": str(tmp_path), "private": s})
    assert ("no union bound over the points" in text) == (every == 1)
    assert ("--checkpoint-every 1 makes it a confidence bound" in text) == (every == 4)


def _thudi(tmp_path, *extra):
    from idpsgd.cli import main

    return main(["reproduce", "thudi-figure1", "--out", str(tmp_path), "--no-progress", *extra])


def test_thudi_figure1_smoke(tmp_path, capsys):
    """`idpsgd reproduce thudi-figure1`, tiny: the public JSON has no per-point value; the figure, the curves and
    the per-instance files are private (0600)."""
    assert (
        _thudi(
            tmp_path,
            "--seeds",
            "1",
            "--points",
            "2",
            "--epochs",
            "1",
            "--batch-size",
            "64",
            "--checkpoint-every",
            "5",
            "--epsilons",
            "2,10",
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "thudi_figure1.png" in text and "[private]" not in text and "Paper (MNIST" in text
    from test_output_kinds import _kinds_problems, private_on_stdout

    assert not _kinds_problems(tmp_path) and not private_on_stdout(tmp_path, text, [])
    public = json.loads((tmp_path / "thudi_figure1.json").read_text())
    assert public["experiment"] == "thudi-figure1" and public["epsilons"] == [2.0, 10.0]
    assert public["batch_size"] == 64 and public["model"] == "mlp" and len(public["per_epsilon"]) == 2
    assert all("points" not in pe and "curves" not in pe for pe in public["per_epsilon"])
    assert "private" not in public and public["load_average_before"] is not None
    assert public["per_epsilon"][0]["noise_multiplier"] > public["per_epsilon"][1]["noise_multiplier"]
    private = json.loads((tmp_path / "private" / "thudi_figure1_private.json").read_text())
    curves = private["per_epsilon"][1]["curves"]
    steps = public["per_epsilon"][1]["steps"]
    assert len(curves["add"]["mean"]) == len(curves["remove"]["p10"]) == steps
    for name in (
        "thudi_figure1.png",
        "thudi_figure1_private.json",
        "thudi_figure1.md",
        "eps10_per_instance.csv",
        "eps2_per_instance_curves.csv",
        "eps10_per_instance_steps.csv",
    ):
        assert file_mode(tmp_path / "private" / name) == 0o600
    assert (tmp_path / "eps10_settings.json").exists()
    assert _thudi(tmp_path, "--overwrite", "--alpha", "1") == 2
    assert "--alpha='1' is invalid" in capsys.readouterr().err


@pytest.mark.slow
def test_thudi_figure1_in_the_papers_regime(tmp_path):
    """The paper's q ≈ 0.002 on digits (a batch of 3), both directions, every step's own sensitivity."""
    from idpsgd.data import load_dataset
    from idpsgd.experiments.thudi import run_thudi_figure1, write_thudi_figure1
    from idpsgd.runfolder import RunFolder

    out = RunFolder(tmp_path / "t")
    r = run_thudi_figure1(load_dataset("digits"), seeds=2, points=4, epochs=2, progress=False, out=out)
    files = write_thudi_figure1(out, r)
    pe, pv = r["per_epsilon"][0], r["private"]["per_epsilon"][0]
    assert r["batch_size"] == 3 and pe["steps"] == 2 * 479 and pe["alpha"] < 3 and pe["checkpoint_every"] == 1
    assert pe["baseline_rdp"] == pytest.approx(pe["steps"] * pe["baseline_step_rdp"])
    assert pe["same_composition_rdp"] >= pe["baseline_rdp"]
    for dn in ("add", "remove"):
        mean, p10 = np.asarray(pv["curves"][dn]["mean"]), np.asarray(pv["curves"][dn]["p10"])
        assert np.all(p10 <= mean + 1e-12) and np.all(mean > 0)
        assert pv["median_late_thm32_ratio"][dn] <= 1 + 1e-9
    assert "private/thudi_figure1.png" in files
