"""Every script in examples/ runs in its tiny setting (``IDPSGD_EXAMPLE_TINY=1``) from an empty folder, as
a user runs it.  The default suite runs each script as ``__main__`` in the test's process (``runpy``; a
fresh interpreter's imports of torch, opacus and transformers were most of each run's time); the slow suite
runs the same tests in a fresh process each (the script changed back to Opacus always runs in one).  A
script added to examples/ is picked up by the glob."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
OPACUS_LINES = (
    ("from idpsgd import IndividualizedPrivacyEngine", "from opacus import PrivacyEngine"),
    ("IndividualizedPrivacyEngine()", "PrivacyEngine()"),
)


def run_example(script: Path, cwd: Path, *args: str) -> str:
    """The script in a fresh process (as a user runs it); its stdout."""
    env = {
        **os.environ,
        "IDPSGD_EXAMPLE_TINY": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_example_here(script: Path, cwd: Path, *args: str) -> str:
    """The script as ``__main__`` in this process, from ``cwd``, with the tiny setting; its stdout.  What it
    changes in the process is put back: the working folder, argv, the environment, the warning filters, the
    global random states of torch, numpy and ``random`` (transformers' Trainer seeds all three), torch's thread
    count (the next test file on this worker sees none of it)."""
    saved = (os.getcwd(), sys.argv, os.environ.copy(), torch.get_num_threads())
    states = (np.random.get_state(), random.getstate())  # noqa: NPY002 (the legacy global state, put back)
    out = io.StringIO()
    try:
        os.chdir(cwd)
        sys.argv = [str(script), *args]
        os.environ["IDPSGD_EXAMPLE_TINY"] = "1"
        with torch.random.fork_rng(), warnings.catch_warnings(), contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        os.chdir(saved[0])
        sys.argv = saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
        torch.set_num_threads(saved[3])
        np.random.set_state(states[0])  # noqa: NPY002
        random.setstate(states[1])
    return out.getvalue()


# in this process by default; in a fresh one in the slow suite (the process a user starts)
RUNNERS = [
    pytest.param(run_example_here, id="here"),
    pytest.param(run_example, id="fresh", marks=pytest.mark.slow),
]


def _check_run_folder(run: Path, out: str) -> None:
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] > 0 and (run / "report.html").is_file() and (run / "private").is_dir()
    assert len(report["groups"]) >= 2 and all(g["epsilon_spent"] <= g["budget"] + 1e-9 for g in report["groups"])
    assert f"report: {Path('runs') / run.parent.name / 'run' / 'report.html'}" in out


def _check_cnn(out: str, cwd: Path) -> None:
    _check_run_folder(cwd / "runs/cnn_image_files/run", out)
    assert (cwd / "runs/cnn_image_files/tiny-images/train-images-idx3-ubyte.gz").is_file()


def _check_csv(out: str, cwd: Path) -> None:
    run = cwd / "runs/csv_budget_column/run"
    _check_run_folder(run, out)
    assert (run / "private/data_split.csv").is_file() and "features: x0, x1, x2, x3, x4, x5" in out


def _check_text(out: str, cwd: Path) -> None:
    assert "budget 1: epsilon spent" in out and "budget 4: epsilon spent" in out
    assert sum(int(line.split()[0]) for line in out.splitlines() if " layers: " in line) == 20  # every trained layer


def _check_hf_finetune(out: str, cwd: Path) -> None:
    assert "group with budget 1" in out and "test perplexity" in out


def _check_opacus_port(out: str, cwd: Path) -> None:
    assert out.strip().splitlines()[-1].startswith("epoch 1:") and "epsilon 3.00" in out


CHECKS = {
    "cnn_image_files": _check_cnn,
    "csv_budget_column": _check_csv,
    "text_transformer": _check_text,
    "opacus_port": _check_opacus_port,
    "hf_finetune_gpt2": _check_hf_finetune,
}


def test_examples_are_there():
    assert {"cnn_image_files", "csv_budget_column", "text_transformer", "opacus_port"} <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_tiny(script, runner, tmp_path):
    out = runner(script, tmp_path)
    if script.stem in CHECKS:
        CHECKS[script.stem](out, tmp_path)


def test_opacus_port_runs_on_opacus_with_the_two_lines_changed_back(tmp_path):
    """In a fresh process in the default suite too: importing idpsgd registers its own convolution and
    Embedding grad samplers in Opacus's tables, so only a process that never imported idpsgd runs Opacus."""
    code = (ROOT / "examples" / "opacus_port.py").read_text()
    assert code.count("IndividualizedPrivacyEngine") == 2 and code.count("  # changed: ") == 2
    for ours, theirs in OPACUS_LINES:
        assert code.count(ours) == 1
        code = code.replace(ours, theirs)
    assert not re.search(r"^\s*(from|import) idpsgd", code, re.M)  # nothing of idpsgd is left
    script = tmp_path / "opacus_script.py"
    script.write_text(code)
    out = run_example(script, tmp_path)
    assert out.strip().splitlines()[-1].startswith("epoch 1:") and "epsilon 3.00" in out


@pytest.mark.parametrize("runner", RUNNERS)
def test_opacus_port_with_per_class_budgets(runner, tmp_path):
    out = runner(ROOT / "examples" / "opacus_port.py", tmp_path, "--per-class-budgets")
    assert "budget  examples    epsilon" in out and "the loosest group's" in out
