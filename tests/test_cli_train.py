"""The train and demo commands: report.json contract, budget sources, and one-line errors."""

import json

import pytest

from idpsgd.cli import main
from idpsgd.engine.per_example.bk.keeper import BY_SHAPES

FAST = ["--epochs", "1", "--no-progress"]


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_train_json_and_report_file(capsys, tmp_path):
    out = run_json(
        capsys,
        "train",
        "--dataset",
        "digits",
        "--method",
        "scale",
        "--budgets",
        "1,2,3",
        "--fractions",
        "0.34,0.43,0.23",
        "--delta",
        "1e-5",
        "--out",
        str(tmp_path),
        *FAST,
    )
    saved = json.loads((tmp_path / "report.json").read_text())
    assert out["out"] == str(tmp_path) and saved["method"] == "scale" and saved["dataset"] == "digits"
    assert [g["count"] for g in saved["groups"]] == [489, 618, 330]  # largest remainder of 1437
    assert all(g["epsilon_spent"] <= g["budget"] for g in saved["groups"])
    assert (tmp_path / "private" / "ledger.csv").is_file() and (tmp_path / "report.html").is_file()
    assert "private" not in out
    # book-keeping by default; the report gives each layer's path rule, a function of the model only — not
    # the path taken, which depends on the batches' shapes (digits CNN: no fallback)
    assert saved["grad_sample_mode"] == "bk"
    assert set(saved["layer_paths"].values()) <= {BY_SHAPES, "ghost norm", "per-sample gradient"}
    assert BY_SHAPES in saved["layer_paths"].values()
    assert "per-example gradient norms (bk): " in (tmp_path / "report.html").read_text()


def test_train_text_budgets_per_class_and_file(capsys, tmp_path):
    assert (
        main(
            [
                "train",
                "--method",
                "sample",
                "--budgets-per-class",
                "0:1,1:1,2:2,3:2,4:2,5:3,6:3,7:3,8:3,9:3",
                "--delta",
                "1e-5",
                "--out",
                str(tmp_path / "a"),
                *FAST,
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "sample on digits (digits_cnn): test accuracy" in text and "eps_spent" in text
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert [g["budget"] for g in report["groups"]] == [1.0, 2.0, 3.0]
    budgets = tmp_path / "b.csv"
    budgets.write_text("eps\n" + "\n".join(["1.5"] * 700 + ["4"] * 737) + "\n")
    out = run_json(
        capsys,
        "train",
        "--method",
        "exclude",
        "--budgets-file",
        str(budgets),
        "--budget-column",
        "eps",
        "--delta",
        "1e-5",
        "--out",
        str(tmp_path / "b"),
        *FAST,
    )
    assert [g["trained"] for g in out["groups"]] == [False, True] and out["groups"][0]["epsilon_spent"] == 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--budgets", "1,2", "--fractions", "0.5,0.6"], "--fractions"),
        (["--budgets", "1,2", "--fractions", "0.5,0.5", "--dataset", "mnist"], "needs --data-dir"),
        (
            ["--budgets", "1,2", "--fractions", "0.5,0.5", "--dataset", "mnist", "--data-dir", "/nonexistent"],
            "train-images-idx3-ubyte[.gz] not found in /nonexistent",
        ),
        (["--budgets", "1,2", "--fractions", "0.5,0.5", "--dataset", "bogus"], "--dataset='bogus' is invalid"),
        (["--budgets", "0,2", "--fractions", "0.5,0.5"], "--budgets=0.0 is invalid"),
        (["--budgets", "1,2", "--fractions", "0.5,0.5", "--lr", "-1"], "--lr=-1.0 is invalid"),
        (["--budgets", "1,2", "--fractions", "0.5,0.5", "--delta", "1"], "--delta=1.0 is invalid"),
        (["--budgets", "1,2", "--fractions", "0.5,0.5", "--model", "vgg"], "--model='vgg' is invalid"),
    ],
)
def test_train_errors_are_one_line(capsys, tmp_path, argv, needle):
    assert main(["train", "--method", "sample", "--out", str(tmp_path), *argv, *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_demo_prints_one_table(capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path), "--epochs", "1", "--no-progress", "--seed", "0"]) == 0
    text = capsys.readouterr().out
    for run in ("uniform eps=1", "sample", "scale", "uniform eps=3"):
        assert run in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["uniform eps=1", "sample", "scale", "uniform eps=3"]
    for r in summary["runs"][:3]:
        assert all(g["epsilon_spent"] <= g["budget"] for g in r["groups"])


def test_train_with_the_individual_filter(capsys, tmp_path):
    out = run_json(
        capsys,
        "train",
        "--method",
        "sample",
        "--budgets",
        "1,3",
        "--fractions",
        "0.5,0.5",
        "--filter",
        "individual",
        "--filter-extend",
        "1.5",
        "--seed",
        "0",
        "--out",
        str(tmp_path),
        *FAST,
    )
    assert out["filter"]["run_steps"] == 2 * out["filter"]["calibrated_steps"]  # ceil(1.5 x 1 epoch) = 2
    assert all(g["epsilon_spent"] <= g["budget"] + 1e-9 for g in out["groups"]) and "private" not in out
    assert (tmp_path / "private" / "filter_epsilons.csv").is_file()
    assert "Rényi filter" in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--individual-accounting"], "--individual-accounting"),
        (["--accountant", "pld"], "--accountant='pld'"),
        (["--method", "pdp-sgd"], "--method='pdp-sgd'"),
    ],
)
def test_train_filter_refuses_what_it_cannot_honour(capsys, tmp_path, extra, needle):
    argv = [
        "train",
        "--method",
        "sample",
        "--budgets",
        "1,3",
        "--fractions",
        "0.5,0.5",
        "--filter",
        "individual",
        "--out",
        str(tmp_path / "run"),
        *FAST,
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "report.json").exists()
