"""Two kinds of output, by construction (issue 16): a run folder of every command that writes
one, each file's mode checked against the kind its manifest (``outputs.json``) declares, every file
on disk in the manifest, and nothing private on stdout without ``--show-private``.

Runs go through the CLI in-process on a tiny CSV data set (240 examples, an MLP, one epoch).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from idpsgd.cli import main
from idpsgd.runfolder import MANIFEST, PRIVATE

BUDGETS = ["--budgets", "1,2,3", "--fractions", "0.34,0.43,0.23"]
FAST = ["--epochs", "1", "--no-progress", "--seed", "0", "--batch-size", "32"]


def _csv_dataset(folder: Path) -> list[str]:
    rng = np.random.default_rng(0)
    folder.mkdir()
    for name, n in (("train", 240), ("test", 60)):
        y = np.arange(n) % 3
        x = rng.normal(size=(n, 6)) + y[:, None]
        rows = ["label," + ",".join(f"f{i}" for i in range(6))]
        rows += [f"{y[i]}," + ",".join(f"{v:.4f}" for v in x[i]) for i in range(n)]
        (folder / f"{name}.csv").write_text("\n".join(rows) + "\n")
    return ["--dataset", "csv", "--num-classes", "3", "--data-dir", str(folder)]


def _commands(data: list[str]) -> dict[str, list[str]]:
    train = ["train", *BUDGETS, *data, *FAST]
    return {
        "uniform": [*train, "--method", "uniform"],
        "scale": [*train, "--method", "scale"],
        "sequential": [*train, "--method", "sequential"],
        # sample with individual accounting: per-example ε, exact statistics, norms (no exact-tracked
        # validation subset: its exact RDP table takes minutes)
        "individual": [
            *train,
            "--method",
            "sample",
            "--individual-accounting",
            "--save-norms",
            "--validate-subset",
            "0",
        ],
        "pdp-sgd": [*train, "--method", "pdp-sgd", "--rounds", "2"],
        "per-instance": ["per-instance", *data, *FAST, "--points", "0,1", "--runs", "1", "--samples", "2,2"],
        "demo": ["demo", *data, *FAST],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (run folder, stdout, argv) for every command (each run once per module)."""
    base = tmp_path_factory.mktemp("kinds")
    data = _csv_dataset(base / "data")
    out = {}
    for name, argv in _commands(data).items():
        argv = [*argv, "--out", str(base / name)]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0, name
        out[name] = (base / name, buf.getvalue(), argv)
    # the report command on a finished run, public and with --include-private
    for flags in ([], ["--include-private"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["report", str(base / "individual"), *flags]) == 0
    return out


# --- the folder walk --------------------------------------------------------------------------
def _run_folders(top: Path) -> list[Path]:
    """Every folder holding a manifest (the demo's four runs sit under the demo's own folder)."""
    return sorted(p.parent for p in top.rglob(MANIFEST))


def _owned_files(folder: Path) -> list[str]:
    """Files of ``folder``'s run (relative paths), not those of runs nested in it."""
    nested = [p for p in _run_folders(folder) if p != folder]
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST and not any(n in p.parents for n in nested)
    )


def _kinds_problems(folder: Path) -> list[str]:
    """Everything wrong with ``folder``'s files against its manifest (empty: all good)."""
    problems = []
    manifest = json.loads((folder / MANIFEST).read_text())["files"]
    on_disk = _owned_files(folder)
    problems += [f"{f}: on disk but not in {MANIFEST}" for f in on_disk if f not in manifest]
    problems += [f"{f}: in {MANIFEST} but not on disk" for f in manifest if f not in on_disk]
    mode = stat.S_IMODE((folder / MANIFEST).stat().st_mode)
    if mode != 0o644:
        problems.append(f"{MANIFEST}: mode {mode:o}, expected 644")
    private_dir = folder / PRIVATE
    if private_dir.exists() and stat.S_IMODE(private_dir.stat().st_mode) != 0o700:
        problems.append(f"{PRIVATE}/: mode {stat.S_IMODE(private_dir.stat().st_mode):o}, expected 700")
    for name, entry in manifest.items():
        path = folder / name
        if not path.is_file():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        if entry["kind"] == "private":
            if not name.startswith(f"{PRIVATE}/"):
                problems.append(f"{name}: private but outside {PRIVATE}/")
            if mode != 0o600:
                problems.append(f"{name}: private with mode {mode:o}, expected 600")
        elif entry["kind"] == "public":
            if name.startswith(f"{PRIVATE}/"):
                problems.append(f"{name}: public but inside {PRIVATE}/")
            if mode != 0o644:
                problems.append(f"{name}: public with mode {mode:o}, expected 644")
        else:
            problems.append(f"{name}: unknown kind {entry['kind']!r}")
    report = folder / "report.json"
    if report.is_file():  # the report says which file is which, as the manifest does
        files = json.loads(report.read_text()).get("files") or {}
        wrong = {k: v for k, v in files.items() if manifest.get(k, {}).get("kind") != v}
        if wrong:
            problems.append(f"report.json 'files' disagrees with {MANIFEST}: {wrong}")
    return problems


# --- values in files and on stdout ----------------------------------------------------------------
_NUMBER = re.compile(r"(?<![\w.])-?(\d+)\.(\d+)(?:[eE]([-+]?\d+))?(?![\w.])")


def _decimal_tokens(text: str) -> list[tuple[float, float, str]]:
    """(value, half the last printed digit, token) of every decimal number with >= 2 decimals."""
    out = []
    for m in _NUMBER.finditer(text):
        if len(m.group(2)) >= 2:
            exp = int(m.group(3) or 0)
            out.append((float(m.group(0)), 0.5 * 10.0 ** (exp - len(m.group(2))), m.group(0)))
    return out


def _leaves(obj) -> list[float]:
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in _leaves(x)]
    if isinstance(obj, list):
        return [v for x in obj for v in _leaves(x)]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return [float(obj)]
    return []


def _csv_columns(path: Path) -> dict[str, np.ndarray]:
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    cols = {}
    for j, name in enumerate(rows[0]):
        try:
            cols[name] = np.array([float(r[j]) for r in rows[1:]])
        except ValueError:
            continue
    return cols


def _values(folder: Path, kind: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """All numbers in ``folder``'s (and nested runs') files of ``kind`` (JSON, CSV, npz and the
    numbers written in their text), and the CSV columns by file."""
    values, columns = [], {}
    for run in _run_folders(folder):
        manifest = json.loads((run / MANIFEST).read_text())["files"]
        for name, entry in manifest.items():
            path = run / name
            if entry["kind"] != kind or not path.is_file():
                continue
            if path.suffix in (".json", ".md", ".csv"):
                text = path.read_text()
                values += [v for v, _, _ in _decimal_tokens(text)]
            if path.suffix == ".json":
                values += _leaves(json.loads(path.read_text()))
            elif path.suffix == ".csv":
                for col, arr in _csv_columns(path).items():
                    values += arr.tolist()
                    columns[f"{run.name}/{name}:{col}"] = arr
            elif path.suffix == ".npz":
                with np.load(path) as z:
                    values += [
                        float(v) for k in z.files for v in np.ravel(z[k]) if np.issubdtype(z[k].dtype, np.number)
                    ]
    return np.unique(np.asarray(values, dtype=float)), columns


def _near(sorted_values: np.ndarray, x: float, tol: float) -> bool:
    i = np.searchsorted(sorted_values, x - tol * (1 + 1e-9))
    return i < sorted_values.size and sorted_values[i] <= x + tol * (1 + 1e-9)


def private_on_stdout(folder: Path, stdout: str, argv: list[str]) -> list[str]:
    """Private values printed on stdout: decimal numbers that round to a value of a private file and
    to no value of a public file (nor of the command line), and runs of 3 consecutive real batch sizes
    (a private CSV's batch-size column, e.g. the ledger's) among the printed numbers."""
    private, columns = _values(folder, "private")
    public, _ = _values(folder, "public")
    public = np.unique(np.concatenate([public, [v for v, _, _ in _decimal_tokens(" ".join(argv).replace(",", " "))]]))
    leaks = [
        f"{tok} (a private value)"
        for v, tol, tok in _decimal_tokens(stdout)
        if _near(private, v, tol) and not _near(public, v, tol)
    ]
    printed = np.array([float(m) for m in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", stdout)])
    for name, col in columns.items():
        if "batch" not in name.rsplit(":", 1)[1]:  # real batch sizes (single values: too many coincidences)
            continue
        if col.size >= 3 and printed.size >= 3:
            w = np.lib.stride_tricks.sliding_window_view(col, 3)
            p = np.lib.stride_tricks.sliding_window_view(printed, 3)
            hit = np.isclose(p[:, None, :], w[None, :, :], rtol=1e-3, atol=0).all(axis=2)
            if hit.any() and len(np.unique(w[np.argwhere(hit)[0][1]])) > 1:
                leaks.append(f"3 consecutive values of {name}")
    return leaks


# --- the tests ------------------------------------------------------------------------------------
NAMES = list(_commands([]))


@pytest.mark.parametrize("name", NAMES)
def test_every_file_has_its_kinds_mode(runs, name):
    folder = runs[name][0]
    folders = _run_folders(folder)
    assert folder in folders and (name != "demo" or len(folders) == 5)
    problems = [f"{f.relative_to(folder.parent)}: {p}" for f in folders for p in _kinds_problems(f)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "per-instance"])
def test_stdout_holds_no_private_value(runs, name):
    folder, stdout, argv = runs[name]
    assert stdout.strip()
    leaks = private_on_stdout(folder, stdout, argv)
    assert not leaks, f"{name} prints private values without --show-private: {leaks}\n{stdout}"


def test_per_instance_stdout_holds_no_private_value(runs):
    folder, stdout, argv = runs["per-instance"]
    assert not private_on_stdout(folder, stdout, argv)


def test_the_check_sees_private_values(runs):
    """The stdout check has teeth: the train command's own text with the private section (what
    --show-private prints) is caught."""
    from idpsgd.cli.train_commands import _train_text

    folder, stdout, argv = runs["individual"]
    report = json.loads((folder / "report.json").read_text())
    exact = json.loads((folder / PRIVATE / "individual_privacy.json").read_text())
    shown = _train_text({**report, "out": str(folder), "private": {"individual_privacy": exact}})
    assert "[private] exact" in shown and "[private] exact" not in stdout
    assert private_on_stdout(folder, shown, argv)
    ledger = _csv_columns(folder / PRIVATE / "ledger.csv")["batch_size"]
    assert private_on_stdout(folder, stdout + "\nbatch sizes " + " ".join(f"{v:g}" for v in ledger), argv)


def test_report_command_adds_only_declared_files(runs):
    """``idpsgd report`` (run by the fixture, with and without --include-private) keeps the folder
    consistent: the private HTML is private, in private/, mode 0600."""
    folder = runs["individual"][0]
    manifest = json.loads((folder / MANIFEST).read_text())["files"]
    assert manifest["report.html"]["kind"] == "public"
    assert manifest.get(f"{PRIVATE}/report.html", {}).get("kind") == "private"
    assert not _kinds_problems(folder)


def test_account_keeps_per_example_values_private(runs, tmp_path):
    folder = runs["individual"][0]
    out = tmp_path / "account"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(["account", "--norms", str(folder / PRIVATE / "norms.npz"), "--delta", "1e-5", "--out", str(out)]) == 0
        )
    cols = _csv_columns(next(out.rglob("individual_epsilons.csv")))
    eps, caps = cols["epsilon"], np.unique(cols["worst_case_epsilon"])  # the caps are data-independent
    stats = [s for s in (eps.mean(), *np.quantile(eps, [0.1, 0.25, 0.5, 0.75, 0.9])) if not np.isclose(caps, s).any()]
    assert not [tok for v, tol, tok in _decimal_tokens(buf.getvalue()) if any(abs(v - s) <= tol for s in stats)]
    assert (out / MANIFEST).is_file() and not _kinds_problems(out)


@pytest.mark.slow
def test_more_commands_folders_and_stdout(tmp_path):
    """The rest: exclude, pdp-sampling, adapdp, individual clipping, reproduce and audit."""
    data = _csv_dataset(tmp_path / "data")
    train = ["train", *BUDGETS, *data, *FAST]
    commands = {
        "exclude": [*train, "--method", "exclude"],
        "pdp-sampling": [*train, "--method", "pdp-sampling"],
        "adapdp": [*train, "--method", "adapdp", "--rounds", "2"],
        "individual-clipping": [
            *train,
            "--method",
            "scale",
            "--individual-accounting",
            "--individual-clipping",
            "--validate-subset",
            "0",
        ],
        # digits: 20 budget groups need more than the CSV's 240 examples
        "reproduce": [
            "reproduce",
            "heo-table1",
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--rounds",
            "2",
            "--no-figures",
            "--no-progress",
        ],
        # issue 25: the other papers' experiments (per-example figures and exact statistics in private/)
        "reproduce-boenisch-table2": [
            "reproduce",
            "boenisch-table2",
            *data,
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--batch-size",
            "32",
            "--setups",
            "34-43-23",
            "--no-progress",
        ],
        "reproduce-boenisch-table3": [
            "reproduce",
            "boenisch-table3",
            *data,
            "--seeds",
            "1",
            "--calibrated-steps",
            "3",
            "--no-progress",
        ],
        "reproduce-yu-figure": [
            "reproduce",
            "yu-figure",
            *data,
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--batch-size",
            "32",
            "--validate-subset",
            "10",
            "--no-progress",
        ],
        "reproduce-thudi-figure1": [
            "reproduce",
            "thudi-figure1",
            *data,
            "--seeds",
            "1",
            "--points",
            "3",
            "--epochs",
            "1",
            "--no-progress",
        ],
        "audit": ["audit", "--method", "sample", *BUDGETS, *data, *FAST, "--attack", "loss"],
    }
    failures = []
    for name, argv in commands.items():
        argv = [*argv, "--out", str(tmp_path / name)]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0, name
        folder = tmp_path / name
        failures += [
            f"{name}: {f.relative_to(tmp_path)}: {p}" for f in _run_folders(folder) for p in _kinds_problems(f)
        ]
        failures += [f"{name}: stdout: {leak}" for leak in private_on_stdout(folder, buf.getvalue(), argv)]
    assert not failures, "\n".join(failures)
