"""The accounting commands' JSON contract and their one-line errors (exit code 2)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from idpsgd.accounting import epsilon_sgm
from idpsgd.cli import main
from support import file_mode


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_json(capsys):
    out = run_json(
        capsys, "epsilon", "--sample-rate", "0.01", "--noise-multiplier", "1.1", "--steps", "1000", "--delta", "1e-5"
    )
    assert set(out) == {"epsilon", "delta", "accountant", "order"}
    assert out["epsilon"] == pytest.approx(float(epsilon_sgm(0.01, 1.1, 1000, 1e-5)))
    assert out["accountant"] == "rdp" and out["delta"] == 1e-5
    pld = run_json(
        capsys,
        "epsilon",
        "--sample-rate",
        "0.01",
        "--noise-multiplier",
        "1.1",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--accountant",
        "pld",
    )
    assert set(pld) == {"epsilon", "delta", "accountant"} and pld["epsilon"] < out["epsilon"]


def test_noise_multiplier_json(capsys):
    out = run_json(
        capsys, "noise-multiplier", "--epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "1000"
    )
    assert set(out) == {"noise_multiplier", "epsilon", "accountant"}
    assert 2 * (1 - 1e-4) <= out["epsilon"] <= 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["epsilon", "--sample-rate", "1.5", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"],
            "--sample-rate=1.5 is invalid: must be in (0, 1]",
        ),
        (
            ["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "0", "--steps", "10", "--delta", "1e-5"],
            "--noise-multiplier=0.0 is invalid",
        ),
        (
            ["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "0", "--delta", "1e-5"],
            "--steps=0 is invalid",
        ),
        (
            ["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "10", "--delta", "1"],
            "--delta=1.0 is invalid: must be in (0, 1)",
        ),
        (
            ["noise-multiplier", "--epsilon", "0", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
            "--epsilon=0.0 is invalid",
        ),
        (
            ["noise-multiplier", "--epsilon", "1e6", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
            "unreachable",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_python_dash_m_entry_point():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "idpsgd",
            "epsilon",
            "--sample-rate",
            "0.01",
            "--noise-multiplier",
            "1.0",
            "--steps",
            "10",
            "--delta",
            "1e-5",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "epsilon" in json.loads(res.stdout)


# --- resource guards, honest calibration, flags in errors ------------------------------------
SGM = ["--delta", "1e-5"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            [
                "epsilon",
                "--accountant",
                "pld",
                "--sample-rate",
                "1",
                "--noise-multiplier",
                "0.001",
                "--steps",
                "100",
                *SGM,
            ],
            "--noise-multiplier=0.001 is invalid: is too small for PLD accounting",
        ),
        (
            [
                "epsilon",
                "--accountant",
                "pld",
                "--sample-rate",
                "0.01",
                "--noise-multiplier",
                "1",
                "--steps",
                "1000000000000",
                *SGM,
            ],
            "--steps=1000000000000 is invalid: is too many for PLD accounting",
        ),
        (
            ["epsilon", "--sample-rate", "0.5", "--noise-multiplier", "1e-300", "--steps", "10", *SGM],
            "--noise-multiplier=1e-300 is invalid: must be >= 0.001",
        ),
        (
            ["noise-multiplier", "--epsilon", "1e-9", "--sample-rate", "0.01", "--steps", "100", *SGM],
            "--epsilon=1e-09 cannot be met within rtol",
        ),
        (
            [
                "noise-multiplier",
                "--accountant",
                "pld",
                "--epsilon",
                "1e-9",
                "--sample-rate",
                "0.01",
                "--steps",
                "100",
                *SGM,
            ],
            "--epsilon=1e-09 cannot be met within rtol",
        ),
        (
            [
                "assign",
                "--method",
                "sample",
                "--budgets",
                "1,2,3",
                "--fractions",
                "0.3,0.3,0.4",
                "--num-examples",
                "2",
                "--sample-rate",
                "0.05",
                "--steps",
                "100",
                "--clip-norm",
                "1",
                *SGM,
            ],
            "--num-examples=2 is invalid: leaves no example for budget(s)",
        ),
        (
            [
                "assign",
                "--method",
                "scale",
                "--budgets",
                "1,2,3",
                "--fractions",
                "0.3,0.3,0.4",
                "--num-examples",
                "0",
                "--sample-rate",
                "0.05",
                "--steps",
                "100",
                "--clip-norm",
                "1",
                *SGM,
            ],
            "--num-examples=0 is invalid",
        ),
        (
            [
                "assign",
                "--method",
                "sample",
                "--budgets",
                "1,20",
                "--fractions",
                "0.5,0.5",
                "--sample-rate",
                "0.6",
                "--steps",
                "330",
                "--clip-norm",
                "1",
                *SGM,
            ],
            "--sample-rate=0.6 is unreachable with method sample",
        ),
        (
            [
                "assign",
                "--method",
                "scale",
                "--budgets",
                "1,2",
                "--fractions",
                "0.5,0.5",
                "--sample-rate",
                "0.05",
                "--steps",
                "100",
                "--clip-norm",
                "0",
                *SGM,
            ],
            "--clip-norm=0.0 is invalid",
        ),
    ],
)
def test_guards_and_unreachable_targets_name_the_flag(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_assign_sample_feasible_with_a_large_budget(capsys):
    out = run_json(
        capsys,
        "assign",
        "--method",
        "sample",
        "--budgets",
        "1,20",
        "--fractions",
        "0.5,0.5",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.089",
        "--steps",
        "330",
        "--clip-norm",
        "1",
    )
    rates = [g["sample_rate"] for g in out["groups"]]
    assert max(rates) <= 1 and sum(0.5 * r for r in rates) == pytest.approx(0.089, rel=1e-4)


def test_budgets_file_errors_name_the_flag(capsys, tmp_path):
    argv = [
        "assign",
        "--method",
        "scale",
        "--budgets-file",
        str(tmp_path / "b.csv"),
        "--sample-rate",
        "0.05",
        "--steps",
        "100",
        "--clip-norm",
        "1",
        *SGM,
    ]
    for content, needle in (
        (b"id,epsilon\n0,1\n1\n", "row 3 has a missing or non-numeric value None"),
        (b"epsilon\n1\n\xff\xfe\n", "not UTF-8"),
        (b"epsilon\n1\nnan\n", "every budget must be > 0"),
        (b"epsilon\n", "no data rows"),
    ):
        (tmp_path / "b.csv").write_bytes(content)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


ACCOUNT = ["--sample-rate", "0.1", "--noise-multiplier", "1.5", "--clip-norm", "1", "--delta", "1e-5", "--overwrite"]


def test_account_pld_reports_both_bounds_and_their_sources(capsys, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "n.npz", norms=rng.lognormal(-1, 1, (5, 60)), steps=np.full(5, 10))
    rdp = run_json(
        capsys,
        "account",
        "--norms",
        str(tmp_path / "n.npz"),
        "--out",
        str(tmp_path / "acc"),
        *ACCOUNT,
        "--rounding",
        "ceil",
        "--show-private",
    )["private"]
    public = run_json(
        capsys,
        "account",
        "--norms",
        str(tmp_path / "n.npz"),
        "--out",
        str(tmp_path / "acc"),
        *ACCOUNT,
        "--rounding",
        "ceil",
        "--accountant",
        "pld",
    )
    assert "private" not in public and "mean" not in public
    pld = {
        **public,
        **run_json(
            capsys,
            "account",
            "--norms",
            str(tmp_path / "n.npz"),
            "--out",
            str(tmp_path / "acc"),
            *ACCOUNT,
            "--rounding",
            "ceil",
            "--accountant",
            "pld",
            "--show-private",
        )["private"],
    }
    assert set(rdp["source_counts"]) == {"rdp"}
    assert (
        pld["mean"] <= pld["mean_rdp"] and pld["mean_pld"] < pld["mean_rdp"] and pld["worst_case_accountant"] == "pld"
    )
    assert sum(pld["source_counts"].values()) == 60
    header = (tmp_path / "acc" / "private" / "individual_epsilons.csv").read_text().splitlines()[0]
    assert header == "index,epsilon,source,rdp_epsilon,pld_epsilon,worst_case_epsilon"


def _bad_npz(path, kind):
    if kind == "empty":
        np.savez(path, norms=np.zeros((0, 0)), steps=np.zeros(0))
    elif kind == "strings":
        np.savez(path, norms=np.array([["a", "b"]]), steps=np.array([1]))
    elif kind == "truncated":
        np.savez(path, norms=np.ones((3, 4)), steps=np.ones(3))
        path.write_bytes(path.read_bytes()[:100])
    elif kind == "nan":
        np.savez(path, norms=np.array([[1.0, np.nan]]), steps=np.array([1]))
    elif kind == "shape":
        np.savez(path, norms=np.ones((2, 3, 4)), steps=np.ones(2))
    elif kind == "steps":
        np.savez(path, norms=np.ones((3, 4)), steps=np.ones(2))
    elif kind == "garbage":
        path.write_bytes(b"not a zip file at all")


@pytest.mark.parametrize("kind", ["empty", "strings", "truncated", "nan", "shape", "steps", "garbage"])
def test_account_bad_norms_files_are_one_line_errors(capsys, tmp_path, kind):
    path = tmp_path / "bad.npz"
    _bad_npz(path, kind)
    assert main(["account", "--norms", str(path), "--out", str(tmp_path / "acc"), *ACCOUNT]) == 2
    err = capsys.readouterr().err
    assert f"--norms='{path}' is invalid" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--rounding-step", "1e-12"], "--rounding-step=1e-12 is invalid: gives 1e+12 sensitivity levels"),
        (
            ["--rounding", "exact", "--accountant", "pld"],
            "--rounding='exact' is invalid: cannot be used with --accountant pld",
        ),
        (["--rounding-step", "-1"], "--rounding-step=-1.0 is invalid"),
    ],
)
def test_account_guards(capsys, tmp_path, extra, needle):
    np.savez(tmp_path / "n.npz", norms=np.ones((2, 5)), steps=np.ones(2))
    assert main(["account", "--norms", str(tmp_path / "n.npz"), "--out", str(tmp_path / "acc"), *ACCOUNT, *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_account_reads_the_run_parameters_from_the_norms_file(capsys, tmp_path):
    """A training run's norms file records q_i, c_i, σ and C: ``account`` needs no more flags."""
    rng = np.random.default_rng(1)
    n = 30
    rates, clips = np.where(np.arange(n) < 10, 0.05, 0.1), np.where(np.arange(n) < 10, 0.7, 1.0)
    np.savez(
        tmp_path / "n.npz",
        norms=rng.lognormal(-1, 1, (3, n)),
        steps=np.full(3, 20),
        sample_rates=rates,
        clip_norms=clips,
        noise_multiplier=np.float64(1.2),
        clip_norm=np.float64(1.0),
    )
    out = run_json(
        capsys,
        "account",
        "--norms",
        str(tmp_path / "n.npz"),
        "--delta",
        "1e-5",
        "--show-private",
        "--out",
        str(tmp_path / "acc"),
    )
    out["max"] = out["private"]["max"]
    expected = float(epsilon_sgm(0.1, 1.2, 60, 1e-5))  # the worst case of the q = 0.1, c = 1 group
    assert out["worst_case_epsilon"] == pytest.approx(expected, rel=1e-9) and out["max"] <= expected
    np.savez(tmp_path / "m.npz", norms=np.ones((2, 4)), steps=np.ones(2))
    assert (
        main(
            [
                "account",
                "--norms",
                str(tmp_path / "m.npz"),
                "--delta",
                "1e-5",
                "--out",
                str(tmp_path / "acc"),
                "--overwrite",
            ]
        )
        == 2
    )
    assert "--sample-rate is required (the norms file does not record it)" in capsys.readouterr().err


def test_train_save_norms_then_account_round_trip(capsys, tmp_path):
    """``train --save-norms`` writes private/norms.npz; ``account`` reads it with no other flag than δ
    and reproduces the run's per-example ε (same norms, same bounds, same accountants)."""
    import csv

    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--method",
                "scale",
                "--budgets",
                "1,2",
                "--fractions",
                "0.5,0.5",
                "--delta",
                "1e-5",
                "--epochs",
                "1",
                "--batch-size",
                "128",
                "--clip-norm",
                "10",
                "--accountant",
                "pld",
                "--individual-accounting",
                "--individual-accountant",
                "pld",
                "--rounding",
                "ceil",
                "--refreshes-per-epoch",
                "2",
                "--validate-subset",
                "0",
                "--save-norms",
                "--seed",
                "0",
                "--no-progress",
                "--out",
                str(run),
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    npz = run / "private" / "norms.npz"
    assert file_mode(npz) == 0o600
    with np.load(npz) as f:
        assert f["norms"].shape[0] == f["steps"].size == 2 and f["norms"].shape[1] == f["sample_rates"].size
    out = run_json(
        capsys, "account", "--norms", str(npz), "--delta", "1e-5", "--accountant", "pld", "--out", str(tmp_path / "acc")
    )
    assert out["rounding"] == "ceil" and out["accountant"] == "pld"

    def column(path, name):
        with open(path) as fh:
            return np.array([float(r[name]) for r in csv.DictReader(fh)])

    trained = column(run / "private" / "individual_epsilons.csv", "epsilon")
    budgets = column(run / "private" / "individual_epsilons.csv", "budget")
    offline = column(tmp_path / "acc" / "private" / "individual_epsilons.csv", "epsilon")
    np.testing.assert_allclose(offline, trained, rtol=1e-9)
    assert np.all(trained <= budgets)
    with open(run / "private" / "individual_epsilons.csv") as fh:
        sources = {r["source"] for r in csv.DictReader(fh)}
    assert sources <= {"rdp", "pld", "cap"} and "pld" in sources
