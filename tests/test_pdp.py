"""(Φ, Δ)-PDP bookkeeping, threshold selection, the exponential budgets, and PDP-SGD training."""

import json
import math

import numpy as np
import pytest

from idpsgd import InvalidParameterError
from idpsgd.accounting import DEFAULT_ORDERS, compute_rdp, rdp_to_epsilon
from idpsgd.accounting.pdp import (
    adaptive_weighted_loss,
    compose,
    irdp_to_pdp,
    sampling_guarantee,
    sampling_probabilities,
    select_threshold,
    threshold_losses,
)
from idpsgd.assignment import Budgets
from idpsgd.cli import main
from support import file_mode

DELTA = 1e-5


def test_sampling_probabilities_and_amplification_identity():
    eps = np.array([0.0, 0.3, 0.9, 1.2, 2.0])
    tau = 1.2
    pi = sampling_probabilities(eps, tau)
    assert pi[0] == 0 and pi[3] == 1 and pi[4] == 1
    assert pi[1] == pytest.approx(math.expm1(0.3) / math.expm1(1.2))
    # Thm. 4.2's core: a (τ, δ)-DP algorithm on a π-sample is ln(1 + π(e^τ − 1)) = ε_i-DP for ε_i < τ
    assert np.allclose(np.log1p(pi[1:3] * math.expm1(tau)), eps[1:3])
    spent, d = sampling_guarantee(eps, tau, DELTA)
    assert np.allclose(spent, [0, 0.3, 0.9, 1.2, 1.2]) and np.allclose(d, pi * DELTA)
    with pytest.raises(InvalidParameterError, match="threshold"):
        sampling_probabilities(eps, 0.0)


def test_composition_and_irdp_conversion():
    e, d = compose([(np.array([0.5, 1.0]), np.array([1e-6, 1e-5])), (np.array([0.25, 0.0]), np.array([1e-6, 0]))])
    assert np.allclose(e, [0.75, 1.0]) and np.allclose(d, [2e-6, 1e-5])
    # Gaussian mechanism: ρ(α) = α/(2σ²); Thm. 4.8 is the classical conversion min_α ρ(α) + log(1/δ)/(α−1)
    sigma = 3.0
    orders = np.linspace(1.01, 200, 20000)
    rho = orders / (2 * sigma**2)
    closed = 1 / (2 * sigma**2) + math.sqrt(2 * math.log(1 / DELTA)) / sigma
    assert irdp_to_pdp(rho, orders, DELTA)[0] == pytest.approx(closed, rel=1e-4)
    # per-user δ_i: a larger δ gives a smaller ε; never below the improved conversion
    r = compute_rdp([0.01, 0.05], [1.0, 1.0], DEFAULT_ORDERS, steps=100)
    classical = irdp_to_pdp(r, DEFAULT_ORDERS, [1e-5, 1e-5])
    assert np.all(classical >= rdp_to_epsilon(r, DEFAULT_ORDERS, 1e-5)[0])  # the improved one is tighter
    assert irdp_to_pdp(r[1], DEFAULT_ORDERS, 1e-3)[0] < irdp_to_pdp(r[1], DEFAULT_ORDERS, 1e-5)[0]


def test_threshold_losses_by_hand():
    eps = np.array([0.5, 1.0, 2.0])
    wu, ws, lf, la = threshold_losses(eps, [1.0], w1=0.7, w2=0.3)
    pi = math.expm1(0.5) / math.expm1(1.0)
    assert wu[0] == pytest.approx(0.5 * (1 - pi)) and ws[0] == pytest.approx(1.0)
    assert lf[0] == pytest.approx(0.7 * wu[0] + 0.3) and la[0] == pytest.approx(2 * wu[0] / (wu[0] + 1))
    tau = select_threshold(eps, "fixed", 0.7, 0.3)
    grid = np.linspace(0.5, 2.0, 5001)
    assert threshold_losses(eps, [tau], 0.7, 0.3)[2][0] <= threshold_losses(eps, grid, 0.7, 0.3)[2].min() + 1e-9
    tau_a = select_threshold(eps, "adaptive")  # our reading: the AM–GM equality point
    wu, ws, _, la = threshold_losses(eps, [tau_a])
    assert 0.5 < tau_a < 2.0 and wu[0] == pytest.approx(ws[0], rel=1e-9)
    assert la[0] == pytest.approx(adaptive_weighted_loss(eps, [tau_a])[0], rel=1e-9)  # the bound is attained there
    assert select_threshold([0.0, 0.7, 0.7], "fixed") == 0.7
    with pytest.raises(InvalidParameterError, match="threshold_loss"):
        select_threshold(eps, "median")


def test_exponential_budget_distribution():
    flat = Budgets.from_exponential(2000, 1, 3, 0.0, DELTA, seed=1)
    values, counts, _ = flat.groups()
    assert values.size == 20 and values[0] == 1 and values[-1] == 3 and counts.max() - counts.min() <= 1
    skewed = Budgets.from_exponential(2000, 0.5, 1.0, -0.2, DELTA)
    _, c, _ = skewed.groups()
    assert c.sum() == 2000 and np.all(np.diff(c) <= 0) and c[0] > 10 * c[-1]
    _, c2, _ = Budgets.from_exponential(2000, 0.5, 1.0, 0.2, DELTA).groups()
    assert np.all(np.diff(c2) >= 0)
    with pytest.raises(InvalidParameterError, match="range"):
        Budgets.from_exponential(100, 3, 1, 0.0, DELTA)


@pytest.mark.parametrize("method", ["pdp-sgd", "pdp-sampling", "adapdp"])
def test_pdp_training_respects_every_budget(digits, method, tmp_path):
    from idpsgd.training import TrainConfig, train

    budgets = Budgets.from_exponential(len(digits.y_train), 1, 3, 0.0, DELTA, seed=0)
    from idpsgd.training.pdp import PdpOptions

    report = train(
        digits, budgets, TrainConfig(method=method, epochs=3, progress=False), tmp_path, pdp=PdpOptions(rounds=2)
    )
    rounds = report["rounds"]
    assert len(rounds) == (1 if method == "pdp-sampling" else 2)
    for r in rounds:
        assert r["epsilon_round"] <= r["threshold"] * (1 + 1e-12)
    import csv

    with open(tmp_path / "private" / "pdp_guarantees.csv") as fh:
        rows = list(csv.DictReader(fh))
    eps = np.array([float(r["epsilon"]) for r in rows])
    dl = np.array([float(r["delta"]) for r in rows])
    bud = np.array([float(r["budget"]) for r in rows])
    assert np.all(eps <= bud + 1e-12) and np.all(dl <= DELTA * (1 + 1e-12))  # δ is the total by default
    assert file_mode(tmp_path / "private" / "pdp_guarantees.csv") == 0o600
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["method"] == method and len(saved["groups"]) == 20
    assert saved["max_delta"] == pytest.approx(dl.max()) and saved["delta_mode"] == "total"
    assert all(g["epsilon_spent"] <= g["budget"] + 1e-12 for g in saved["groups"])
    assert saved["models"] == (len(rounds) if method == "adapdp" else 1)
    # the strictest group (below the first threshold) spends its whole budget in the first round
    assert saved["groups"][0]["epsilon_spent"] == pytest.approx(1.0)


def test_pdp_cli(capsys, tmp_path):
    argv = [
        "train",
        "--method",
        "pdp-sgd",
        "--budget-distribution",
        "exponential",
        "--range",
        "1,3",
        "--skew",
        "0.2",
        "--epochs",
        "2",
        "--rounds",
        "2",
        "--threshold-loss",
        "adaptive",
        "--no-progress",
    ]
    assert main([*argv, "--out", str(tmp_path / "a"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["threshold_loss"] == "adaptive" and 1.0 < out["rounds"][0]["threshold"] < 3.0
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "pdp_guarantees.csv" in capsys.readouterr().out
    assert (
        main(
            [
                "train",
                "--method",
                "adapdp",
                "--budget-distribution",
                "exponential",
                "--range",
                "3",
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "--range=" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--method",
                "pdp-sgd",
                "--budgets",
                "1,2",
                "--fractions",
                ".5,.5",
                "--w1",
                "2",
                "--out",
                str(tmp_path / "d"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "--w1=2.0 is invalid" in capsys.readouterr().err
