"""Runs that cannot be half-written: SIGKILL at several points, then --resume, gives exactly the
uninterrupted run; checkpoints load without running code (weights_only=True).  The killed runs are
processes of their own (a real SIGKILL, forked from a server that imported idpsgd once); the uninterrupted
run and the final resume run in this process."""

import json
import os
import warnings

import pytest
import torch

from idpsgd.assignment import Budgets
from idpsgd.cli import main
from idpsgd.io import CheckpointError
from idpsgd.training import TrainConfig, train
from support import cli_process, independent_epsilons

ARGS = [
    "train",
    "--method",
    "sample",
    "--budgets",
    "1,2,3",
    "--fractions",
    "0.34,0.43,0.23",
    "--epochs",
    "3",
    "--seed",
    "0",
    "--no-progress",
    "--individual-accounting",
]


def _run(out, *extra, kill, validate="0"):
    """The CLI in a process of its own, killed by ``IDPSGD_TEST_KILL`` (a real SIGKILL), forked from a server
    that did the imports once (:func:`support.cli_process`); its exit code and stderr."""
    assert "IDPSGD_TEST_KILL" not in os.environ
    code, _, err = cli_process(
        [*ARGS, "--validate-subset", validate, "--out", str(out), *extra],
        out.parent,
        {"IDPSGD_TEST_KILL": kill},
    )
    return code, err


def _run_here(out, *extra, validate="0"):
    """The same command in this process (a run that is not killed needs no process of its own: a fresh
    interpreter's imports were most of a run's time); its exit code."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main([*ARGS, "--validate-subset", validate, "--out", str(out), *extra])


def _kill_and_resume_is_exact(tmp_path, kills, validate):
    assert "IDPSGD_TEST_KILL" not in os.environ
    assert _run_here(tmp_path / "full", validate=validate) == 0
    cut = tmp_path / "cut"
    for kill in kills:
        code, err = _run(cut, "--resume", kill=kill, validate=validate)
        assert code == -9, (kill, err)
        assert not list(cut.glob("report.json")) or kill.startswith("individual")
    assert _run_here(cut, "--resume", validate=validate) == 0
    for name in ("private/ledger.csv", "private/individual_epsilons.csv", "private/history.json"):
        assert (cut / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    reports = [json.loads((d / "report.json").read_text()) for d in (tmp_path / "full", cut)]
    for r in reports:  # the private release draws fresh OS entropy in every run, by design
        del r["individual_privacy"]["released"]
    assert reports[0] == reports[1]
    a = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    b = torch.load(cut / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(cut.glob(".*.tmp")) and not list((cut / "private").glob(".*.tmp"))  # leftovers removed


def test_sigkill_mid_epoch_and_during_the_checkpoint_write_then_resume_is_exact(tmp_path):
    _kill_and_resume_is_exact(tmp_path, ("checkpoint.pt:2", "step:16"), validate="0")


@pytest.mark.slow  # the exactly tracked validation subset costs a fine RDP table in every run (~25 s each)
def test_sigkill_at_every_point_with_the_validation_subset_then_resume_is_exact(tmp_path):
    _kill_and_resume_is_exact(tmp_path, ("checkpoint.pt:2", "step:16", "individual_epsilons.csv:1"), validate="50")


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_a_crafted_checkpoint_runs_no_code_and_fails_in_one_line(tmp_path, capsys, digits):
    marker = tmp_path / "pwned"
    _Evil.marker = marker
    run = tmp_path / "run"
    (run / "private").mkdir(parents=True)
    torch.save({"signature": _Evil()}, run / "private" / "checkpoint.pt")
    budgets = Budgets.from_array([3.0] * len(digits.y_train), 1e-5)
    with pytest.raises(CheckpointError, match="is not a readable idpsgd checkpoint"):
        train(digits, budgets, TrainConfig(method="uniform", epochs=1, progress=False), run, resume=True)
    assert not marker.exists()
    assert (
        main(
            [
                "train",
                "--method",
                "uniform",
                "--budgets",
                "3",
                "--epochs",
                "1",
                "--no-progress",
                "--out",
                str(run),
                "--resume",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "is not a readable idpsgd checkpoint" in err and len(err.splitlines()) == 1 and not marker.exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", None])
def test_empty_truncated_or_foreign_checkpoints_are_clear_errors(tmp_path, capsys, content):
    run = tmp_path / "run"
    (run / "private").mkdir(parents=True)
    ckpt = run / "private" / "checkpoint.pt"
    if content is None:
        torch.save({"weights": torch.zeros(3)}, ckpt)  # a loadable file of another program
    else:
        ckpt.write_bytes(content)
    assert (
        main(
            [
                "train",
                "--method",
                "uniform",
                "--budgets",
                "3",
                "--epochs",
                "1",
                "--no-progress",
                "--out",
                str(run),
                "--resume",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("checkpoint" in err) and "Traceback" not in err


def test_changed_settings_or_data_are_named_on_resume(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*ARGS[:-4], "--epochs", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*ARGS[:-4], "--epochs", "1", "--out", str(out), "--resume", "--lr", "0.1"]) == 2
    assert "config.lr: 0.05 -> 0.1" in capsys.readouterr().err
    assert main([*ARGS[:-4], "--epochs", "1", "--out", str(out), "--clip-norm", "2"]) == 2  # no --resume
    assert "already holds files of another run" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert main([*ARGS[:-4], "--epochs", "1", "--out", str(out), "--overwrite", "--clip-norm", "2"]) == 0
    assert json.loads((out / "report.json").read_text())["clip_norm"] == 2.0 != report["clip_norm"]


def test_a_secure_run_resumed_after_a_crash_charges_the_draws_after_its_checkpoint(tmp_path, digits, monkeypatch):
    """Secure mode (issue 53): a run crashes 3 steps after its checkpoint of the first epoch; the resume
    draws those steps again with fresh noise, so the crashed attempt's 3 draws are charged beside the
    kept steps (private/drawn_steps.jsonl): the filter stops the resumed run 3 steps early, with the ε
    of every planned step (dp_accounting's composition), and the report says which were kept and charged."""
    import idpsgd.io
    import idpsgd.training.loop as loop

    budgets = Budgets.from_array([3.0] * len(digits.y_train), 1e-5)
    cfg = TrainConfig(method="uniform", epochs=2, batch_size=256, secure_mode=True, progress=False)
    seen = {"checkpoint": False, "after": 0}

    def written(point):
        seen["checkpoint"] |= point == "checkpoint.pt"

    def crash(point):
        if seen["checkpoint"]:
            seen["after"] += 1
            if seen["after"] == 3:
                raise KeyboardInterrupt("crash")

    with monkeypatch.context() as m:
        m.setattr(idpsgd.io, "fault_point", written)
        m.setattr(loop, "fault_point", crash)
        with pytest.raises(KeyboardInterrupt):
            train(digits, budgets, cfg, tmp_path / "cut")
    r = train(digits, budgets, cfg, tmp_path / "cut", resume=True)
    planned = r["planned_steps"]
    assert (r["steps"], r["steps_kept"], r["steps_charged"], r["steps_released"]) == (
        planned - 3,
        planned - 3,
        planned,
        3,
    )
    assert r["stopped_early"]
    g = r["groups"][0]
    rdp_eps, pld_eps = independent_epsilons(g["sample_rate"], g["noise_multiplier"], planned, 1e-5)
    assert pld_eps <= g["epsilon_spent"] <= min(rdp_eps * (1 + 1e-9), 3.0) and rdp_eps <= g["epsilon_spent"] * (
        1 + 1e-3
    )
    assert json.loads((tmp_path / "cut" / "report.json").read_text())["steps_charged"] == planned
    assert "private/drawn_steps.jsonl" in json.loads((tmp_path / "cut" / "outputs.json").read_text())["files"]
