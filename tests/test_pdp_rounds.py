"""PDP-SGD's options (issue 19): adaptive threshold, noise history (Alg. 4), total δ, PdpOptions and
their flags, the PDP path's own checks, and ``idpsgd reproduce heo-table1``."""

import argparse
import itertools
import json
import math

import numpy as np
import pytest

from idpsgd import InvalidParameterError, UnreachableTargetError
from idpsgd.accounting import SampledGaussianEvent, rdp_epsilon
from idpsgd.accounting.pdp import (
    adaptive_threshold,
    adaptive_weighted_loss,
    calibrate_round_noise,
    history_guarantee,
    sampling_probabilities,
    select_threshold,
    threshold_losses,
)
from idpsgd.assignment import Budgets
from idpsgd.cli import main

DELTA = 1e-5


@pytest.mark.parametrize("skew", [-0.2, 0.0, 0.2])
def test_adaptive_first_threshold_is_interior_for_app_c1(skew):
    eps = Budgets.from_exponential(1437, 0.5, 1.0, skew, DELTA, seed=0).epsilons
    tau = select_threshold(eps, "adaptive")
    assert 0.5 < tau < 1.0
    wu, ws, _, _ = threshold_losses(eps, [tau])
    assert wu[0] == pytest.approx(ws[0], rel=1e-8)  # AM–GM equality: waste_u = waste_s
    grid = np.linspace(0.5, 1.0, 2001)
    la = adaptive_weighted_loss(eps, grid)
    assert abs(tau - grid[np.argmin(la)]) < 0.01  # close to the weighted loss's own minimum
    assert adaptive_threshold([0.7, 0.7]) == 0.7  # one budget: that budget
    with pytest.raises(InvalidParameterError, match="threshold_loss"):
        select_threshold(eps, "median")
    with pytest.raises(InvalidParameterError, match="w1"):
        select_threshold(eps, "fixed", w1=1.5)


def test_history_guarantee_is_the_mixture_over_sampled_rounds():
    rng = np.random.default_rng(0)
    pi = rng.uniform(0, 1, (3, 5))
    pi[:, 0] = 1.0
    pi[:, 1] = 0.0
    e = np.array([0.4, 0.7, 0.9])
    eps, dl = history_guarantee(pi, e, DELTA)
    for i in range(5):  # brute force over the sampled sets S: ln Σ_S P(S) e^{E_max S}
        total, p_any = 0.0, 0.0
        for s in itertools.product([0, 1], repeat=3):
            prob = np.prod([pi[r, i] if s[r] else 1 - pi[r, i] for r in range(3)])
            last = max([r for r in range(3) if s[r]], default=-1)
            total += prob * math.exp(e[last] if last >= 0 else 0.0)
            p_any += prob if last >= 0 else 0.0
        assert eps[i] == pytest.approx(math.log(total), abs=1e-12)
        assert dl[i] == pytest.approx(p_any * DELTA, rel=1e-12)
    assert eps[0] == pytest.approx(0.9) and eps[1] == 0 and dl[1] == 0


def test_history_guarantee_equals_the_per_round_charges_on_eq4_rates():
    # eq. (4) on remaining budgets: sampled surely until the exhausting round; with E_m = τ_1 + … + τ_m
    # the mixture is exactly the budget (Thm. 4.2/4.3's sum), smaller E_m give less
    budgets = np.array([0.3, 0.55, 0.8, 1.2, 2.0])
    remaining, pis, taus = budgets.copy(), [], [0.6, 0.5, 0.4]
    for tau in taus:
        pi = sampling_probabilities(np.maximum(remaining, 0), tau)
        pis.append(pi)
        remaining = np.maximum(remaining - np.where(remaining > 0, np.minimum(remaining, tau), 0), 0)
    cum = np.cumsum(taus)
    eps, dl = history_guarantee(np.stack(pis), cum, DELTA)
    assert np.allclose(eps, np.minimum(budgets, cum[-1]), atol=1e-12) and np.all(dl <= DELTA)
    assert np.all(history_guarantee(np.stack(pis), 0.9 * cum, DELTA)[0] < eps)


def test_calibrate_round_noise_with_history():
    hist = [SampledGaussianEvent(0.1, 3.0, 100)]
    spent = rdp_epsilon(hist, DELTA)[0]
    sigma = calibrate_round_noise(spent + 0.3, DELTA, 0.2, 20, "rdp", hist)
    total = rdp_epsilon([*hist, SampledGaussianEvent(0.2, sigma, 20)], DELTA)[0]
    assert (1 - 1e-4) * (spent + 0.3) <= total <= spent + 0.3 and sigma < 100
    with pytest.raises(UnreachableTargetError, match=r"target_epsilon=.* unreachable.*already spend"):
        calibrate_round_noise(0.9 * spent, DELTA, 0.2, 20, "rdp", hist)  # below what the history spent
    alone = calibrate_round_noise(0.5, DELTA, 0.2, 20)  # no history: the plain calibration
    assert rdp_epsilon([SampledGaussianEvent(0.2, alone, 20)], DELTA)[0] <= 0.5


def _budgets(digits, low=0.5, high=1.0, skew=0.0):
    return Budgets.from_exponential(len(digits.y_train), low, high, skew, DELTA, seed=0)


def _train(digits, budgets, epochs=1, method="pdp-sgd", **opts):
    from idpsgd.training import TrainConfig
    from idpsgd.training.pdp import PdpOptions, train_pdp

    return train_pdp(
        digits, budgets, TrainConfig(method=method, epochs=epochs, progress=False), options=PdpOptions(**opts)
    )


def test_noise_history_is_reachable_and_valid(digits, tmp_path):
    from idpsgd.training import TrainConfig
    from idpsgd.training.pdp import PdpOptions, train_pdp

    budgets = _budgets(digits)
    r = train_pdp(
        digits,
        budgets,
        TrainConfig(method="pdp-sgd", epochs=1, progress=False),
        tmp_path,
        options=PdpOptions(rounds=3, noise_history=True),
    )
    assert len(r["rounds"]) == 3 and r["noise_history"]
    assert all(x["noise_multiplier"] < 100 for x in r["rounds"])
    for x in r["rounds"]:  # the composed history stays within the cumulative thresholds
        assert x["epsilon_composed"] <= x["cumulative_threshold"] * (1 + 1e-12)
    rows = np.genfromtxt(tmp_path / "private" / "pdp_guarantees.csv", delimiter=",", names=True)
    assert np.all(rows["epsilon"] <= rows["budget"] * (1 + 1e-9)) and np.all(rows["delta"] <= DELTA * (1 + 1e-12))
    assert r["max_delta"] <= DELTA


def test_total_delta_by_default_and_per_round_flag(digits):
    budgets = _budgets(digits)
    total = _train(digits, budgets, rounds=3)
    assert len(total["rounds"]) == 3 and total["max_delta"] <= DELTA * (1 + 1e-12)
    assert all(x["delta_round"] == pytest.approx(DELTA / 3) for x in total["rounds"])
    paper = _train(digits, budgets, rounds=3, per_round_delta=True)
    assert paper["delta_mode"] == "per-round" and DELTA < paper["max_delta"] <= 3 * DELTA * (1 + 1e-12)
    # mean_sampling_probability: π of the group's *remaining* budget in each round
    g = paper["groups"][-1]  # the largest budget (1.0): above the first threshold
    tau1, tau2 = paper["rounds"][0]["threshold"], paper["rounds"][1]["threshold"]
    assert g["mean_sampling_probability"][0] == 1.0
    expect = float(sampling_probabilities([1.0 - tau1], tau2)[0])
    assert g["mean_sampling_probability"][1] == pytest.approx(expect)


def test_pdp_checks_name_the_flags(digits, capsys, tmp_path):
    from idpsgd.training import TrainConfig
    from idpsgd.training.pdp import PdpOptions, train_pdp

    budgets = _budgets(digits)
    for field, value in (("batch_size", 0), ("epochs", 0)):
        with pytest.raises(InvalidParameterError, match=f"{field}=0 is invalid"):
            train_pdp(digits, budgets, TrainConfig(method="pdp-sgd", progress=False, **{field: value}))
    with pytest.raises(InvalidParameterError, match="w1=2"):
        PdpOptions(w1=2).validate()
    with pytest.raises(InvalidParameterError, match="threshold_loss"):
        PdpOptions(threshold_loss="median").validate()
    base = [
        "train",
        "--method",
        "pdp-sgd",
        "--budget-distribution",
        "exponential",
        "--range",
        "0.5,1",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    for flag in ("--batch-size", "--epochs"):
        assert main([*base, flag, "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag}=0 is invalid" in err[0]


def test_pdp_arguments_make_options():
    from idpsgd.cli.pdp_args import add_pdp_arguments, pdp_options_from_args

    p = argparse.ArgumentParser()
    add_pdp_arguments(p.add_argument_group("pdp"))
    opts = pdp_options_from_args(
        p.parse_args(["--threshold-loss", "adaptive", "--rounds", "4", "--noise-history", "--per-round-delta"])
    )
    assert (opts.threshold_loss, opts.rounds, opts.noise_history, opts.per_round_delta) == ("adaptive", 4, True, True)
    assert pdp_options_from_args(p.parse_args([])).per_round_delta is False
    with pytest.raises(InvalidParameterError, match="w1"):
        pdp_options_from_args(p.parse_args(["--w1", "-0.1"]))


def test_reproduce_heo_table1_small(digits, tmp_path, capsys):
    from idpsgd.experiments.heo import _markdown, _plots, run_heo_table1

    r = run_heo_table1(digits, seeds=1, epochs=1, rounds=1, figures=False, progress=False)
    assert [row["skew"] for row in r["table"]] == [-0.2, 0.0, 0.2] and r["runs"] == 13
    for row in r["table"]:
        for col in r["columns"]:
            assert 0 <= row[col]["mean"] <= 1 and len(row[col]["runs"]) == 1
    assert r["table"][0]["DP-SGD (min eps)"] == r["table"][2]["DP-SGD (min eps)"]  # uniform at min ε = 0.5
    assert "| -0.2 |" in _markdown(r)
    fake = {
        "dataset": "digits",
        "fig4_accuracy_vs_w1": {"0.0": {"0.3": {"mean": 0.5, "std": 0.1}, "0.7": {"mean": 0.6, "std": 0.0}}},
        "fig5_accuracy_vs_interval": {"fixed": {"0.1": {"mean": 0.4, "std": 0.0}, "0.5": {"mean": 0.6, "std": 0.1}}},
    }
    from idpsgd.runfolder import RunFolder

    assert _plots(RunFolder(tmp_path / "figs"), fake) == ["fig4_w1.png", "fig5_interval.png"]
    assert (tmp_path / "figs" / "fig4_w1.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["reproduce", "heo-table1", "--seeds", "0", "--out", str(tmp_path / "cli")]) == 2
    assert "--seeds=0 is invalid" in capsys.readouterr().err


@pytest.mark.slow
def test_reproduce_cli_writes_table_and_figures(tmp_path, capsys):
    argv = [
        "reproduce",
        "heo-table1",
        "--seeds",
        "1",
        "--epochs",
        "1",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert "PDP-SGD loss_a" in capsys.readouterr().out
    r = json.loads((tmp_path / "heo_table1.json").read_text())
    assert set(r["fig4_accuracy_vs_w1"]) == {"-0.2", "0.0", "0.2"} and len(r["fig5_accuracy_vs_interval"]["fixed"]) == 9
    for name in ("heo_table1.md", "fig4_w1.png", "fig5_interval.png"):
        assert (tmp_path / name).is_file()


def test_an_empty_round_still_releases_its_noisy_steps():
    import torch

    from idpsgd.training.pdp import run_dp_round

    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    out = run_dp_round(
        model,
        opt,
        (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),
        np.zeros(0, dtype=int),
        budgets=None,
        noise_multiplier=1.0,
        sample_rate=0.5,
        clip_norm=1.0,
        steps=3,
        steps_per_epoch=2,
        expected_batch_size=4.0,
        seed=0,
        noise_generator=gen,
    )
    assert out is model and all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
