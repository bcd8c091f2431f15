"""``idpsgd reproduce NAME`` (issue 25, "one command per paper"): the registry and dispatcher, and a
tiny run of every experiment (Boenisch et al. Tables 2 and 3, Yu et al.'s figures).

The default suite runs each experiment's library function on a 240-example slice of digits for an
epoch or two (a few seconds in all); the slow suite runs each command end to end on digits.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from idpsgd.cli import main
from idpsgd.experiments import EXPERIMENTS, Experiment, Option, load
from idpsgd.experiments.registry import register
from idpsgd.runfolder import MANIFEST, PRIVATE, RunFolder

PAPERS = {"heo-table1", "boenisch-table2", "boenisch-table3", "yu-figure", "thudi-figure1"}


@pytest.fixture(scope="module")
def tiny():
    """240 training and 120 test examples of digits (a slice: every class present)."""
    from idpsgd.data import Dataset, load_dataset

    d = load_dataset("digits")
    return Dataset(
        "digits", d.x_train[:240], d.y_train[:240], d.x_test[:120], d.y_test[:120], d.num_classes, d.preprocessing
    )


def _manifest_ok(folder: Path) -> dict:
    """Every file of the folder is in its manifest with the mode of its kind; returns the manifest."""
    manifest = json.loads((folder / MANIFEST).read_text())["files"]
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert on_disk == set(manifest)
    for name, entry in manifest.items():
        mode = stat.S_IMODE((folder / name).stat().st_mode)
        assert (entry["kind"] == "private") == name.startswith(f"{PRIVATE}/"), name
        assert mode == (0o600 if entry["kind"] == "private" else 0o644), (name, oct(mode))
    return manifest


# --- registry and dispatcher ------------------------------------------------------------------------
def test_help_lists_every_papers_experiment(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert set(load()) >= PAPERS
    for name in load():
        assert name in out


def test_every_option_is_a_keyword_with_its_default():
    for exp in load().values():
        defaults = exp.defaults()
        assert {"model", "progress"} <= set(defaults), exp.name
        assert all(o.name in defaults for o in exp.options), exp.name


def test_register_refuses_an_option_without_default():
    def run(data, seeds, model=None, progress=True):
        return {}

    with pytest.raises(TypeError, match="seeds"):
        register(Experiment("x-bad", "", run, lambda out, r: [], options=(Option("seeds", "n"),)))
    assert "x-bad" not in EXPERIMENTS


def test_a_registered_experiment_gets_its_subcommand(tmp_path, monkeypatch, capsys):
    """Adding an experiment is one register() call: its flags, defaults and checks come from it."""
    from idpsgd.experiments.registry import at_least_one

    calls = []

    def run_demo(data, seeds: int = 2, scale: float = 1.5, model=None, progress=True, out=None):
        calls.append((data.name, seeds, scale, model, out is not None))
        return {"accuracy": 0.5, "private": {"secret": 1.25, "per_example": {"eps": np.ones(3)}}}

    def write(out, r):
        out.write_json("demo.json", {k: v for k, v in r.items() if k != "private"}, "public", "demo")
        return ["demo.json"]

    monkeypatch.setitem(
        EXPERIMENTS,
        "zz-demo",
        Experiment(
            "zz-demo", "a demo", run_demo, write, options=(Option("seeds", "n", at_least_one), Option("scale", "s"))
        ),
    )
    assert main(["reproduce", "zz-demo", "--seeds", "3", "--out", str(tmp_path / "a"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert calls == [("digits", 3, 1.5, None, True)]
    assert r["experiment"] == "zz-demo" and r["files"] == ["demo.json"] and "private" not in r
    assert main(["reproduce", "zz-demo", "--seeds", "0", "--out", str(tmp_path / "b")]) == 2
    assert "--seeds=0" in capsys.readouterr().err and not (tmp_path / "b").exists()
    # --show-private prints the private statistics, never the per-example arrays
    assert main(["reproduce", "zz-demo", "--out", str(tmp_path / "c"), "--json", "--show-private"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["private"] == {"secret": 1.25}


def test_json_flag_works_before_and_after_the_experiment():
    from idpsgd.cli.main import build_parser

    p = build_parser()
    for argv in (
        ["reproduce", "--json", "heo-table1", "--out", "x"],
        ["reproduce", "heo-table1", "--out", "x", "--json"],
    ):
        assert p.parse_args(argv).json is True
    assert p.parse_args(["reproduce", "heo-table1", "--out", "x"]).json is False


# --- Boenisch et al. -------------------------------------------------------------------------------
def test_boenisch_table2_tiny(tiny, tmp_path):
    from idpsgd.experiments.boenisch import run_boenisch_table2, table2_markdown, write_boenisch_table2

    r = run_boenisch_table2(tiny, seeds=1, setups="34-43-23", epochs=1, batch_size=32, progress=False)
    assert r["runs"] == 4 and r["columns"][0] == "DP-SGD (eps 1)" and (r["epochs"], r["lr"]) == (1, 0.05)
    row = r["table"][0]
    for c in r["columns"]:
        assert len(row[c]["runs"]) == 1 and 0 <= row[c]["mean"] <= 1
    sample = row["Sample"]["parameters"]
    assert [g["budget"] for g in sample["groups"]] == [1.0, 2.0, 3.0]
    rates = [g["sample_rate"] for g in sample["groups"]]
    assert rates[0] < rates[1] < rates[2]  # Sample: larger budget, larger rate
    clips = [g["clip_norm"] for g in row["Scale"]["parameters"]["groups"]]
    assert clips[0] < clips[1] < clips[2]  # Scale: larger budget, larger clip norm
    assert all(g["epsilon_spent"] <= g["budget"] * (1 + 1e-9) for g in sample["groups"])
    assert "| 34%-43%-23% |" in table2_markdown(r)
    folder = RunFolder(tmp_path / "t2")
    assert write_boenisch_table2(folder, r) == [
        "boenisch_table2.json",
        "boenisch_table2.md",
        "boenisch_table2.png",
        "private/seed.json",
    ]
    manifest = _manifest_ok(tmp_path / "t2")
    assert all(e["kind"] == ("private" if k == "private/seed.json" else "public") for k, e in manifest.items())
    assert json.loads((tmp_path / "t2" / "private" / "seed.json").read_text())["seed"] == r["private"]["seed"]
    assert "seed" not in json.loads((tmp_path / "t2" / "boenisch_table2.json").read_text())


def test_boenisch_table2_paper_settings_and_setups():
    from idpsgd.experiments.boenisch import _hyper, parse_setups
    from idpsgd.validation import InvalidParameterError

    assert _hyper("mnist", None, None, None, None) == {"epochs": 80, "batch_size": 512, "lr": 0.6, "clip_norm": 0.2}
    assert _hyper("cifar10", 5, None, None, None)["epochs"] == 5
    assert _hyper("digits", None, None, None, None) == {"epochs": 20, "batch_size": 128, "lr": 0.05, "clip_norm": 1.0}
    assert parse_setups("54-37-9, 34-43-23") == ["54-37-9", "34-43-23"]
    for bad in ("", "50-50", "34-43-23,34-43-23"):
        with pytest.raises(InvalidParameterError, match="setups"):
            parse_setups(bad)


def test_boenisch_table3_tiny(tiny, tmp_path):
    from idpsgd.experiments.boenisch import run_boenisch_table3, table3_markdown, write_boenisch_table3

    r = run_boenisch_table3(tiny, seeds=1, calibrated_steps=3, progress=False)
    assert (r["epsilon"], r["epsilon_high"]) == (10.0, pytest.approx(10.33))
    assert set(r["columns"]) == {"vanilla", "accounting", "accounting_assignment"}
    assert r["columns"]["vanilla"]["runs_detail"][0]["steps"] == 3
    assert r["columns"]["accounting"]["runs_detail"][0]["steps"] == 6  # extend 2x, fixed in advance
    assert "ε = 10 / 10.33" in table3_markdown(r)
    files = write_boenisch_table3(RunFolder(tmp_path / "t3"), r)
    manifest = _manifest_ok(tmp_path / "t3")
    assert manifest["private/fig3_active.png"]["kind"] == "private" and "private/fig3_active.png" in files
    public = json.loads((tmp_path / "t3" / "boenisch_table3.json").read_text())
    assert "private" not in public and "active_per_step" not in json.dumps(public)


def test_boenisch_table3_epsilons():
    from idpsgd.experiments.boenisch import table3_epsilons
    from idpsgd.validation import InvalidParameterError

    assert table3_epsilons("mnist", None, None) == (0.3, pytest.approx(0.31))
    assert table3_epsilons("digits", 1.0, None) == (1.0, pytest.approx(1.033))
    with pytest.raises(InvalidParameterError, match="epsilon_high"):
        table3_epsilons("digits", 2.0, 1.0)


def test_bench_filter_calls_the_experiment(monkeypatch):
    """bench/bench_filter.py's Table 3 is the experiment's code with the bench's settings (no copy)."""
    import inspect

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_filter
    from idpsgd.experiments.boenisch import run_boenisch_table3

    assert set(bench_filter.TABLE3) <= set(inspect.signature(run_boenisch_table3).parameters)
    assert "run_boenisch_table3" in inspect.getsource(bench_filter.bench_filter_table3)
    sys.modules.pop("bench_filter", None)


def _scrambled(value):
    """A copy of a nested result with every number and array replaced by another (for leak tests)."""
    if isinstance(value, dict):
        return {k: _scrambled(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrambled(v) for v in value)
    if isinstance(value, np.ndarray):
        return value * 3.0 + 7.0 if value.dtype.kind == "f" else value
    if isinstance(value, float):
        return value * 3.0 + 7.0
    return value


# --- Yu et al. ------------------------------------------------------------------------------------
def test_yu_figure_tiny(tiny, tmp_path):
    from idpsgd.experiments.yu import run_yu_figure, write_yu_figure, yu_markdown

    # no exact-tracked subset here: its exact RDP table costs ~10 s whatever the data size (the slow test has it)
    r = run_yu_figure(tiny, seeds=1, epochs=1, batch_size=32, validate_subset=0, progress=False, seed=0)
    assert r["variants"] == ["estimate", "individual_clipping"] and r["trainings"] == 2
    assert {run["kind"] for run in r["runs"]["estimate"]} == {"estimate"}
    assert {run["kind"] for run in r["runs"]["individual_clipping"]} == {"guarantee"}
    stats = r["private"]["statistics"]["estimate"][0]
    assert stats["max"] <= r["epsilon"] * (1 + 1e-9) and "estimate_vs_exact" not in stats
    pe = r["private"]["per_example"]["estimate_seed0"]
    assert pe["epsilon"].shape == (240,) and np.all(pe["epsilon"] <= pe["worst"] * (1 + 1e-12))
    # individual clipping: every ε a guarantee, the exact-tracked comparison shows it bounds the truth
    ic = r["private"]["per_example"]["individual_clipping_seed0"]
    assert np.all(ic["epsilon"] <= ic["worst"] * (1 + 1e-12))
    s = r["summary"]["estimate"]
    assert len(s["per_class"]) == 10 and 0 <= s["released_mean_epsilon"]["mean"] <= r["epsilon"]
    assert r["release"]["epsilon"] == 1.5
    md = yu_markdown(r)
    assert "private/" in md
    # the public text reads nothing private: scrambling every private value leaves it byte-identical
    # (a string search for the exact mean fails by coincidence when it rounds like a public figure)
    scrambled = {**r, "private": _scrambled(r["private"])}
    assert yu_markdown(scrambled) == md
    files = write_yu_figure(RunFolder(tmp_path / "yu"), r)
    manifest = _manifest_ok(tmp_path / "yu")
    for name in (
        "fig1_epsilon_histogram.png",
        "fig5_epsilon_vs_loss.png",
        "fig2_class_epsilon_exact.png",
        "yu_per_example.npz",
        "yu_figure_exact.json",
    ):
        assert manifest[f"{PRIVATE}/{name}"]["kind"] == "private" and f"private/{name}" in files
    for name in ("yu_figure.json", "yu_figure.md", "yu_class_accuracy_vs_epsilon.png", "yu_released_quantiles.png"):
        assert manifest[name]["kind"] == "public"
    public = (tmp_path / "yu" / "yu_figure.json").read_text()
    assert "per_example" not in public and '"class_mean_epsilon"' not in public and "pearson_r_log_loss" not in public


# --- end to end on digits (slow) ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "files"),
    [
        (
            ["boenisch-table2", "--seeds", "2", "--epochs", "2", "--setups", "34-43-23"],
            ["boenisch_table2.json", "boenisch_table2.md", "boenisch_table2.png"],
        ),
        (
            ["boenisch-table3", "--seeds", "2", "--calibrated-steps", "5"],
            ["boenisch_table3.json", "boenisch_table3.md", "private/fig3_active.png"],
        ),
        (
            ["yu-figure", "--seeds", "2", "--epochs", "2", "--validate-subset", "30"],
            [
                "yu_figure.json",
                "yu_figure.md",
                "yu_class_accuracy_vs_epsilon.png",
                "private/fig1_epsilon_histogram.png",
                "private/fig5_epsilon_vs_loss.png",
                "private/fig4_estimate_vs_exact.png",
            ],
        ),
    ],
    ids=["boenisch-table2", "boenisch-table3", "yu-figure"],
)
def test_reproduce_cli_on_digits(argv, files, tmp_path, capsys):
    out = tmp_path / argv[0]
    assert main(["reproduce", *argv, "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "files in" in text
    manifest = _manifest_ok(out)
    for f in files:
        assert f in manifest
    r = json.loads((out / files[0]).read_text())
    assert r["experiment"] == argv[0] and r["seeds"] == 2 and "private" not in r
