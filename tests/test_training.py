"""The training loop: privacy ledger, filter, baselines, resume, determinism and outputs."""

import csv
import dataclasses
import json

import numpy as np
import pytest
import torch
from dp_accounting import dp_event, rdp

from idpsgd.accounting import DEFAULT_ORDERS
from idpsgd.assignment import Budgets
from idpsgd.training import TrainConfig, Trainer, train
from idpsgd.training.loop import CHECKPOINT
from support import file_mode

DELTA = 1e-5


@pytest.fixture(scope="module")
def budgets(digits):
    return Budgets.from_groups([1, 2, 3], [0.34, 0.43, 0.23], len(digits.y_train), DELTA, seed=0)


def _cfg(**kw):
    return TrainConfig(**{"epochs": 2, "batch_size": 128, "progress": False, **kw})


DENSE_ORDERS = sorted(set(np.round(np.linspace(1.05, 16, 300), 4).tolist()) | set(range(17, 257)) | set(DEFAULT_ORDERS))


def _dp_accounting_eps(q, sigma, steps):
    """dp_accounting's RDP ε on a dense order grid (an independent reference for our adaptive orders)."""
    acc = rdp.RdpAccountant(DENSE_ORDERS)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("method", ["sample", "scale"])
def test_groups_spend_their_budgets_checked_by_dp_accounting(digits, budgets, method, tmp_path):
    report = train(digits, budgets, _cfg(method=method), tmp_path)
    assert report["steps"] == report["planned_steps"] == 2 * 11 and not report["stopped_early"]
    for g in report["groups"]:
        assert g["steps"] == report["steps"]
        assert g["epsilon_spent"] <= g["budget"]
        assert g["epsilon_spent"] >= 0.999 * g["budget"]
        # our adaptive orders against dp_accounting on a dense grid: agreement to 1e-3 either way
        independent = _dp_accounting_eps(g["sample_rate"], g["noise_multiplier"], g["steps"])
        assert abs(g["epsilon_spent"] - independent) <= 1e-3 * independent
    rates = [g["sample_rate"] for g in report["groups"]]
    assert (rates[0] < rates[1] < rates[2]) if method == "sample" else len(set(rates)) == 1


def test_outputs_ledger_csv_and_private_files(digits, budgets, tmp_path):
    report = train(digits, budgets, _cfg(method="sample"), tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    for key in ("method", "dataset", "test_accuracy", "per_class_accuracy", "noise_multiplier", "steps", "groups"):
        assert key in saved
    for g in saved["groups"]:
        assert {"budget", "count", "sample_rate", "clip_norm", "epsilon_spent"} <= set(g)
    assert saved["test_accuracy"] == report["test_accuracy"] and len(saved["per_class_accuracy"]) == 10
    assert sum(g["count"] for g in saved["groups"]) == len(digits.y_train)
    with open(tmp_path / "private" / "ledger.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == report["steps"] and rows[-1]["step"] == str(report["steps"])
    for g in report["groups"]:
        col = [float(r[f"epsilon_rdp_budget_{g['budget']:g}"]) for r in rows]
        assert (
            np.all(np.diff(col) > 0)
            and col[-1] == pytest.approx(g["epsilon_rdp"], rel=1e-12)
            and col[-1] >= g["epsilon_spent"]
        )
    for name in (CHECKPOINT, "ledger.csv", "history.json"):
        assert file_mode(tmp_path / "private" / name) == 0o600
    for name in ("model.pt", "report.json", "report.html", "outputs.json"):
        assert file_mode(tmp_path / name) == 0o644
    assert len(report["history"]) == 2 and all(0 <= h["test_accuracy"] <= 1 for h in report["history"])
    assert all("train_loss" not in h for h in saved["history"])  # training losses are private
    assert "private" not in saved and set(saved["files"]) == set(
        json.loads((tmp_path / "outputs.json").read_text())["files"]
    )


def test_filter_stops_before_any_group_exceeds_its_budget(digits, budgets):
    trainer = Trainer(digits, budgets, _cfg(method="sample"))
    phase = trainer.plan.phases[0]  # calibrated for 2 epochs; ask for 4
    trainer.plan = dataclasses.replace(trainer.plan, phases=(dataclasses.replace(phase, epochs=4),))
    report = trainer.run()
    assert report["stopped_early"]
    assert phase.steps - 1 <= report["steps"] < 4 * phase.steps_per_epoch
    assert all(g["epsilon_spent"] <= g["budget"] for g in report["groups"])
    # one more step would have crossed a group's budget (checked by dp_accounting on a dense grid)
    assert not trainer.engine.can_step()
    over = [
        _dp_accounting_eps(g["sample_rate"], g["noise_multiplier"], g["steps"] + 1) > g["budget"] * (1 - 1e-3)
        for g in report["groups"]
    ]
    assert any(over)


def test_uniform_matches_opacus_accountant(digits, budgets):
    from opacus.accountants import RDPAccountant

    report = train(digits, budgets, _cfg(method="uniform"))
    acc = RDPAccountant()
    acc.history = [(report["noise_multiplier"], report["groups"][0]["sample_rate"], report["steps"])]
    opacus_grid = acc.get_epsilon(DELTA, alphas=list(DEFAULT_ORDERS))
    opacus_int = acc.get_epsilon(DELTA, alphas=list(range(2, 257)))
    for g in report["groups"]:  # adaptive orders: at most Opacus's ε on every integer order, close to it
        assert g["epsilon_spent"] <= min(opacus_grid, opacus_int) * (1 + 1e-9) and g["epsilon_spent"] <= 1.0
        assert g["epsilon_spent"] >= 0.97 * opacus_int


def test_exclude_and_sequential_baselines(digits, budgets):
    ex = train(digits, budgets, _cfg(method="exclude"))
    g1, g2, g3 = ex["groups"]
    assert not g1["trained"] and g1["epsilon_spent"] == 0 and g1["steps"] == 0
    assert g2["epsilon_spent"] <= 2 and g3["epsilon_spent"] == pytest.approx(g2["epsilon_spent"])
    assert ex["phases"][0]["examples"] == g2["count"] + g3["count"]
    seq = train(digits, budgets, _cfg(method="sequential"))
    assert len(seq["phases"]) == 3 and isinstance(seq["noise_multiplier"], list)
    for g, ph in zip(seq["groups"], seq["phases"], strict=True):
        assert g["steps"] == ph["steps"] and 0.999 * g["budget"] <= g["epsilon_spent"] <= g["budget"]
    assert seq["steps"] == sum(p["steps"] for p in seq["phases"])


def test_pld_accountant_run(digits, budgets):
    report = train(digits, budgets, _cfg(method="scale", accountant="pld"))
    for g in report["groups"]:
        assert 0.99 * g["budget"] <= g["epsilon_spent"] <= g["budget"]
        assert g["epsilon_rdp"] > g["epsilon_spent"]  # the RDP bound is looser


def test_resume_continues_exactly(digits, budgets, tmp_path, crash_after_first_checkpoint):
    cfg = _cfg(method="scale", epochs=3, seed=0)
    full = train(digits, budgets, cfg, tmp_path / "full")
    with crash_after_first_checkpoint():
        train(digits, budgets, cfg, tmp_path / "cut")
    resumed = train(digits, budgets, cfg, tmp_path / "cut", resume=True)
    assert resumed["history"] == full["history"] and resumed["groups"] == full["groups"]
    a = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"other settings \(config.lr: 0.05 -> 0.1\)"):
        train(digits, budgets, dataclasses.replace(cfg, lr=0.1), tmp_path / "cut", resume=True)


def test_resume_without_seed_continues_with_the_recorded_seed(digits, budgets, tmp_path, crash_after_first_checkpoint):
    cfg = _cfg(method="sample", epochs=2)  # no seed: a fresh one, recorded
    with crash_after_first_checkpoint():
        train(digits, budgets, cfg, tmp_path / "cut")
    resumed = train(digits, budgets, cfg, tmp_path / "cut", resume=True)
    replay = train(digits, budgets, dataclasses.replace(cfg, seed=resumed["private"]["seed"]))
    assert isinstance(resumed["private"]["seed"], int) and resumed["history"] == replay["history"]
    assert (
        "seed" not in resumed
        and json.loads((tmp_path / "cut" / "private" / "seed.json").read_text())["seed"] == resumed["private"]["seed"]
    )


def test_same_seed_same_run_other_seed_differs(digits, budgets):
    a = train(digits, budgets, _cfg(method="sample", epochs=1, seed=5))
    b = train(digits, budgets, _cfg(method="sample", epochs=1, seed=5))
    c = train(digits, budgets, _cfg(method="sample", epochs=1, seed=6))
    # the training losses (private history): test accuracy after one epoch can sit at chance for both seeds
    assert a["private"]["history"] == b["private"]["history"] and a["private"]["history"] != c["private"]["history"]


def test_bad_configuration_errors(digits, budgets):
    from idpsgd import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="method=.bogus. is invalid"):
        train(digits, budgets, _cfg(method="bogus"))
    with pytest.raises(InvalidParameterError, match="batch_size=100000 is invalid"):
        train(digits, budgets, _cfg(batch_size=100000))
    with pytest.raises(InvalidParameterError, match="budgets"):
        train(digits, Budgets.from_array([1.0] * 10, DELTA), _cfg())
    with pytest.raises(InvalidParameterError, match="exclude_below=9 is invalid"):
        train(digits, budgets, _cfg(method="exclude", exclude_below=9))
