"""Individual privacy accounting (Yu et al. 2023): rounding, per-example RDP, release, training, CLI."""

import json

import numpy as np
import pytest
import torch

from idpsgd import InvalidParameterError
from idpsgd.accounting import (
    DEFAULT_ORDERS,
    IndividualAccountant,
    RdpInterpolator,
    account_from_norms,
    compute_rdp,
    epsilon_sgm,
    rdp_to_epsilon,
    round_sensitivities,
)
from idpsgd.accounting.release import analytic_gaussian_sigma, release_mean, release_quantile
from idpsgd.cli import main
from support import file_mode

DELTA = 1e-5


def test_rounding_modes():
    norms = np.array([0.0, 0.004, 0.006, 0.333, 0.9951, 2.0])
    clip = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.55])
    assert np.allclose(round_sensitivities(norms, clip, "exact"), [0, 0.004, 0.006, 0.333, 0.9951, 0.55])
    assert np.allclose(round_sensitivities(norms, clip, "nearest", 0.01), [0.01, 0.01, 0.01, 0.33, 1.0, 0.55])
    ceil = round_sensitivities(norms, clip, "ceil", 0.01)
    assert np.allclose(ceil, [0, 0.01, 0.01, 0.34, 1.0, 0.55])
    assert np.all(ceil >= np.minimum(norms, clip)) and np.all(ceil <= clip)
    with pytest.raises(InvalidParameterError, match="rounding='up' is invalid"):
        round_sensitivities(norms, clip, "up")
    with pytest.raises(InvalidParameterError, match="norms=-1.0 is invalid"):
        round_sensitivities([-1.0], 1.0)


@pytest.mark.parametrize(
    ("q", "sigma"),
    [
        (0.0819, 3.0),
        pytest.param(0.01, 0.8, marks=pytest.mark.slow),
        pytest.param(0.3, 2.0, marks=pytest.mark.slow),
        (1.0, 1.5),
    ],
)
def test_interpolated_rdp_is_a_tight_upper_bound(rng, q, sigma):
    """(each table is ~2 million exact RDP values: ~8 s of CPU; two cases run in the default suite)"""
    table = RdpInterpolator([q], 1 / sigma)
    t = (1 / sigma) * rng.uniform(0, 1, 400) ** 2
    exact = compute_rdp(np.full(t.size, q), 1.0 / np.maximum(t, 1e-300), DEFAULT_ORDERS)  # effective σ = 1/t
    got = table(t)
    assert np.all(got >= exact * (1 - 1e-12))
    eps_got = rdp_to_epsilon(got * 500, DEFAULT_ORDERS, DELTA)[0]
    eps_exact = rdp_to_epsilon(exact * 500, DEFAULT_ORDERS, DELTA)[0]
    assert np.all(eps_got >= eps_exact - 1e-12)
    assert np.all(eps_got <= eps_exact * (1 + 2e-3) + 1e-6), (q, sigma, np.max((eps_got - eps_exact) / eps_exact))
    assert np.all(table([0.0]) == 0)


@pytest.mark.parametrize(
    ("rounding", "rates"),
    [
        # exact rounding builds an RDP table per distinct rate (~6 s of CPU each): two rates are slow,
        # the default suite's twin composes one rate through the same table
        pytest.param("exact", (0.02, 0.08), marks=pytest.mark.slow, id="exact"),
        pytest.param("exact", (0.05,), id="exact-one-rate"),
        pytest.param("ceil", (0.02, 0.08), id="ceil"),
        pytest.param("nearest", (0.02, 0.08), id="nearest"),
    ],
)
def test_accountant_matches_direct_composition(rng, rounding, rates):
    n, c, sigma = 300, 1.5, 1.2
    q = np.where(np.arange(n) < 100, rates[0], rates[-1])
    clip = np.where(np.arange(n) % 3 == 0, 1.0, c)
    acc = IndividualAccountant(q, sigma, c, clip, rounding=rounding)
    direct = np.zeros((n, DEFAULT_ORDERS.size))
    for k in (3, 5, 1):
        norms = rng.lognormal(-0.5, 1.0, n)
        s = acc.update_norms(norms)
        acc.add_steps(k)
        with np.errstate(divide="ignore"):
            direct += k * compute_rdp(q, np.where(s > 0, sigma * c / np.maximum(s, 1e-300), np.inf), DEFAULT_ORDERS)
    assert acc.steps == 9 and acc.refreshes == 3
    if rounding == "exact":
        assert np.all(acc.rdp() >= direct * (1 - 1e-12)) and np.allclose(acc.rdp(), direct, rtol=2e-3, atol=1e-300)
    else:
        assert np.allclose(acc.rdp(), direct, rtol=1e-12)
    eps, worst = acc.epsilon(DELTA), acc.worst_case_epsilon(DELTA)
    assert np.all(eps <= worst + 1e-12)
    state = acc.state_dict()
    other = IndividualAccountant(q, sigma, c, clip, rounding=rounding)
    other.load_state_dict(state)
    assert np.array_equal(other.epsilon(DELTA), eps)


@pytest.mark.parametrize("rounding", ["ceil", pytest.param("exact", marks=pytest.mark.slow)])
def test_worst_case_and_zero_gradients(rounding):
    n = 50
    eps, worst = account_from_norms(np.full((4, n), 10.0), [25, 25, 25, 25], 0.05, 1.1, 1.0, DELTA, rounding)
    assert np.allclose(eps, epsilon_sgm(0.05, 1.1, 100, DELTA), rtol=1e-9) and np.allclose(worst, eps, rtol=1e-9)
    eps0, _ = account_from_norms(np.zeros((2, n)), 10, 0.05, 1.1, 1.0, DELTA, rounding)
    assert np.all(eps0 == 0)
    with pytest.raises(InvalidParameterError, match="2-D"):
        account_from_norms(np.zeros(5), 1, 0.05, 1.1, 1.0, DELTA)


def test_analytic_gaussian_and_private_release(rng):
    from scipy.stats import norm

    sigma = analytic_gaussian_sigma(1.0, 1e-5, 1.0)
    assert sigma == pytest.approx(3.7306, abs=1e-3)  # Balle & Wang 2018
    d = norm.cdf(0.5 / sigma - sigma) - np.e * norm.cdf(-0.5 / sigma - sigma)
    assert d <= 1e-5 and d == pytest.approx(1e-5, rel=1e-5)
    values = rng.uniform(0, 3, 20000)
    m = release_mean(values, 3.0, 1.0, 1e-5, rng)
    assert abs(m["value"] - values.mean()) < 6 * m["noise_std"] and m["noise_std"] < 0.01
    med = release_quantile(values, 3.0, 0.5, 1.0, rng)
    assert abs(med - np.median(values)) < 0.05


# --- inside training ----------------------------------------------------------------------------
def _autograd_norm(model, loss):
    model.zero_grad()
    loss.backward()
    return float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))


def test_per_example_norms_match_autograd(digits):
    from torch.utils.data import TensorDataset

    from idpsgd.engine.per_example.norms import example_batches, per_example_grad_norms
    from idpsgd.models import create_model

    torch.manual_seed(0)
    model = create_model("digits_cnn", digits.input_shape, 10)
    x, y = digits.x_train[:7], digits.y_train[:7]
    norms, losses = per_example_grad_norms(model, example_batches(TensorDataset(x, y), range(7), batch_size=3))
    for i in range(7):
        loss = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        assert losses[i] == pytest.approx(float(loss), rel=1e-5)
        assert norms[i] == pytest.approx(_autograd_norm(model, loss), rel=1e-4)
    assert model.training


def test_per_example_norms_of_any_loss_on_dict_batches():
    """A custom per-sample loss (squared error on a dict batch) gives the norms of its own gradients."""
    from idpsgd.engine.per_example.norms import per_example_grad_norms

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    batch = {"f": torch.randn(5, 4), "t": torch.randn(5)}

    def sq(module, b):
        return (module(b["f"]).squeeze(1) - b["t"]) ** 2

    norms, _losses = per_example_grad_norms(model, [batch], per_sample_loss=sq)
    for i in range(5):
        loss = (model(batch["f"][i : i + 1]).squeeze(1) - batch["t"][i : i + 1]).pow(2).sum()
        assert norms[i] == pytest.approx(_autograd_norm(model, loss), rel=1e-4)


def _run(digits, out, epochs=8, validate_subset=300, **kw):
    from idpsgd.assignment import Budgets
    from idpsgd.training import IndividualAccountingOptions, TrainConfig, train

    budgets = Budgets.from_array([3.0] * len(digits.y_train), DELTA)
    cfg = TrainConfig(method="uniform", epochs=epochs, clip_norm=6.0, progress=False, seed=0)
    return train(
        digits, budgets, cfg, out, individual=IndividualAccountingOptions(validate_subset=validate_subset, **kw)
    )


@pytest.fixture(scope="module")
def small_digits(digits):
    """400 training examples of digits: the fast versions of the training tests."""
    import dataclasses

    return dataclasses.replace(digits, x_train=digits.x_train[:400], y_train=digits.y_train[:400])


def _csv(path):
    import csv

    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return rows, {k: np.array([float(r[k]) for r in rows]) for k in rows[0] if k != "source"}


@pytest.mark.parametrize("individual_accountant", ["rdp", "pld"])
def test_reported_epsilon_is_the_minimum_of_the_bounds_and_never_above_the_budget(
    small_digits, tmp_path, individual_accountant
):
    """Issue 15: a run calibrated with PLD (budgets 1/2/3) reports, per example, the minimum of its own
    RDP ε, its own PLD ε (individual accountant pld) and its group's ε from the run's accountant —
    never above its budget (RDP alone can be: 1.10 / 2.21 / 3.33) — and says which bound gave it."""
    from idpsgd.assignment import Budgets
    from idpsgd.training import IndividualAccountingOptions, TrainConfig, train

    n = len(small_digits.y_train)
    budgets = Budgets.from_groups([1.0, 2.0, 3.0], [0.3, 0.4, 0.3], n, DELTA, seed=0)
    cfg = TrainConfig(method="scale", epochs=1, clip_norm=6.0, accountant="pld", progress=False, seed=0)
    opts = IndividualAccountingOptions(validate_subset=20, rounding="ceil", accountant=individual_accountant)
    report = train(small_digits, budgets, cfg, tmp_path, individual=opts)
    rows, cols = _csv(tmp_path / "private" / "individual_epsilons.csv")
    bounds = [cols["rdp_epsilon"], cols["worst_case_epsilon"]] + (
        [cols["pld_epsilon"]] if "pld_epsilon" in cols else []
    )
    assert ("pld_epsilon" in cols) == (individual_accountant == "pld")
    np.testing.assert_array_equal(cols["epsilon"], np.min(bounds, axis=0))
    assert np.all(cols["epsilon"] <= cols["budget"]) and np.all(cols["budget"] == budgets.epsilons)
    names = {"rdp": cols["rdp_epsilon"], "pld": cols.get("pld_epsilon"), "cap": cols["worst_case_epsilon"]}
    assert all(float(r["epsilon"]) == names[r["source"]][i] for i, r in enumerate(rows))
    if individual_accountant == "pld":
        assert np.all(cols["pld_epsilon"] <= cols["rdp_epsilon"]) and "pld" in {r["source"] for r in rows}
    ip = report["private"]["individual_privacy"]
    assert ip["all_at_or_below_budget"] and sum(ip["source_counts"].values()) == n
    public = json.loads((tmp_path / "report.json").read_text())["individual_privacy"]
    assert public["accountants"]["individual"] == individual_accountant
    assert public["accountants"]["data_independent"] == "pld"
    assert not {"mean", "max", "quantiles", "validation", "source_counts"} & set(public)
    assert public["released"]["total"]["epsilon"] == 0.5 and "validation" in ip


def test_individual_clipping_makes_a_guarantee_fast(small_digits, tmp_path):
    report = _run(small_digits, tmp_path, epochs=1, validate_subset=30, individual_clipping=True, rounding="ceil")
    ip = report["private"]["individual_privacy"]
    assert ip["kind"] == "guarantee" and ip["validation"]["min_estimate_minus_exact"] >= -1e-6
    _, cols = _csv(tmp_path / "private" / "individual_epsilons.csv")
    assert np.all(cols["epsilon"] <= ip["worst_case_epsilon"] + 1e-12)


@pytest.mark.slow
def test_uniform_run_individual_epsilons(digits, tmp_path):
    report = _run(digits, tmp_path)
    ip = report["private"]["individual_privacy"]
    assert ip["kind"] == "estimate" and ip["all_at_or_below_worst_case"] and ip["all_at_or_below_budget"]
    assert ip["worst_case_epsilon"] == pytest.approx(report["groups"][0]["epsilon_spent"], rel=1e-9)
    assert ip["max"] <= ip["worst_case_epsilon"] and ip["quantiles"]["0.1"] < 0.8 * ip["worst_case_epsilon"]
    assert ip["pearson_r_log_loss"] > 0.3
    v = ip["validation"]
    assert v["examples"] == 300 and v["pearson_r"] > 0.95 and v["mean_abs_error"] < 0.15
    rows = (tmp_path / "private" / "individual_epsilons.csv").read_text().splitlines()
    assert rows[0] == ("index,label,budget,epsilon,source,rdp_epsilon,worst_case_epsilon,final_loss,correct")
    assert len(rows) == 1438
    for name in (
        "individual_epsilons.csv",
        "individual_privacy.json",
        "epsilon_histogram.png",
        "epsilon_vs_loss.png",
        "class_epsilon_vs_accuracy.png",
    ):
        assert file_mode(tmp_path / "private" / name) == 0o600
    public = json.loads((tmp_path / "report.json").read_text())["individual_privacy"]
    assert not {"mean", "max", "quantiles", "validation", "pearson_r_log_loss"} & set(
        public
    )  # exact values stay private
    rel = public["released"]
    assert rel["total"]["epsilon"] == 0.5 and "mean" in rel and len(rel["quantiles"]["values"]) == 5
    assert "released statistics: an additional (0.5" in report["guarantee"]


@pytest.mark.slow
def test_individual_clipping_makes_a_guarantee(digits, tmp_path):
    report = _run(digits, tmp_path, individual_clipping=True, rounding="ceil")
    ip = report["private"]["individual_privacy"]
    assert ip["kind"] == "guarantee" and report["individual_privacy"]["kind"] == "guarantee"
    saved = json.loads((tmp_path / "private" / "individual_privacy.json").read_text())
    assert saved["validation"]["pearson_r"] > 0.95
    # accounted at the clip thresholds Z_i, which bound every clipped norm: never below exact tracking
    assert saved["validation"]["min_estimate_minus_exact"] >= -1e-6
    import csv

    with open(tmp_path / "private" / "individual_epsilons.csv") as fh:
        eps = np.array([float(r["epsilon"]) for r in csv.DictReader(fh)])
    assert np.all(eps <= ip["worst_case_epsilon"] + 1e-12)


def test_individual_accounting_with_sample_and_resume(small_digits, tmp_path, crash_after_first_checkpoint):
    from idpsgd.assignment import Budgets
    from idpsgd.training import IndividualAccountingOptions, TrainConfig, train

    budgets = Budgets.from_groups([1, 3], [0.5, 0.5], len(small_digits.y_train), DELTA, seed=0)
    cfg = TrainConfig(method="sample", epochs=2, progress=False, seed=0)
    opts = IndividualAccountingOptions(refreshes_per_epoch=2, validate_subset=0)
    full = train(small_digits, budgets, cfg, tmp_path / "full", individual=opts)
    assert "validation" not in full["private"]["individual_privacy"]
    import csv

    with open(tmp_path / "full" / "private" / "individual_epsilons.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert all(float(r["epsilon"]) <= float(r["budget"]) for r in rows)
    with crash_after_first_checkpoint():
        train(small_digits, budgets, cfg, tmp_path / "cut", individual=opts)
    resumed = train(small_digits, budgets, cfg, tmp_path / "cut", resume=True, individual=opts)
    assert resumed["private"]["individual_privacy"]["mean"] == full["private"]["individual_privacy"]["mean"]
    assert (tmp_path / "cut" / "private" / "individual_epsilons.csv").read_text() == (
        tmp_path / "full" / "private" / "individual_epsilons.csv"
    ).read_text()


def test_config_errors(digits):
    from idpsgd.assignment import Budgets
    from idpsgd.training import IndividualAccountingOptions, TrainConfig, train

    with pytest.raises(InvalidParameterError, match="rounding"):
        IndividualAccountingOptions(rounding="up").validate()
    with pytest.raises(InvalidParameterError, match="validate_subset"):
        IndividualAccountingOptions(validate_subset=-1).validate()
    with pytest.raises(InvalidParameterError, match="accountant='moments' is invalid"):
        IndividualAccountingOptions(accountant="moments").validate()
    with pytest.raises(InvalidParameterError, match="rounding='exact' is invalid: cannot be used with the pld"):
        IndividualAccountingOptions(accountant="pld", rounding="exact").validate()
    b = Budgets.from_groups([1, 3], [0.5, 0.5], len(digits.y_train), DELTA, seed=0)
    with pytest.raises(InvalidParameterError, match="one-phase methods"):
        train(digits, b, TrainConfig(method="sequential"), individual=IndividualAccountingOptions())
    assert main(["train", "--method", "uniform", "--budgets", "3", "--individual-clipping", "--out", "/tmp/x"]) == 2


# --- offline CLI --------------------------------------------------------------------------------
def test_account_cli(capsys, tmp_path, rng):
    np.savez(tmp_path / "n.npz", norms=rng.lognormal(-1, 1, (5, 40)), steps=np.full(5, 10))
    argv = [
        "account",
        "--norms",
        str(tmp_path / "n.npz"),
        "--sample-rate",
        "0.1",
        "--noise-multiplier",
        "1.5",
        "--clip-norm",
        "1",
        "--delta",
        "1e-5",
        "--rounding",
        "exact",
        "--out",
        str(tmp_path / "acc"),
    ]
    assert main([*argv, "--json", "--show-private"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"epsilons", "worst_case_epsilon"} <= set(out) and {"mean", "max", "quantiles"} <= set(out["private"])
    assert out["private"]["max"] <= out["worst_case_epsilon"]
    assert out["epsilons"] == str(tmp_path / "acc" / "private" / "individual_epsilons.csv")
    assert file_mode(out["epsilons"]) == 0o600
    assert out["worst_case_epsilon"] == pytest.approx(float(epsilon_sgm(0.1, 1.5, 50, 1e-5)), rel=1e-9)
    saved = json.loads((tmp_path / "acc" / "account.json").read_text())
    assert "private" not in saved and saved["worst_case_epsilon"] == out["worst_case_epsilon"]
    argv = [*argv, "--overwrite"]
    np.savez(tmp_path / "bad.npz", norms=np.ones((2, 3)))
    assert main([*argv[:2], str(tmp_path / "bad.npz"), *argv[3:]]) == 2
    assert "lacks ['steps']" in capsys.readouterr().err
    assert main([*argv[:2], str(tmp_path / "none.npz"), *argv[3:]]) == 2
    err = capsys.readouterr().err
    assert "--norms=" in err and "not found" in err
