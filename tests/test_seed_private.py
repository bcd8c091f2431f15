"""The seed never reaches a public output (issue 29).

With the seed and every record but one, anyone can replay a run on both neighbouring data sets and
compare with the released model (ε = ∞).  Every command that trains is run with ``--seed S`` on a
tiny CSV data set; then every public output is searched for S (and every seed recorded privately,
e.g. the ones derived from S): each file of the run folder outside ``private/``, every file with
group or other read permission, stdout, stderr and the ``--json`` output — as decimal text, hex
text and the raw bytes a pickle or npz would hold.  Private files must be 0600, private folders
0700.  Also: the secure-mode line of the public report, the "Secure RNG turned off" warning (once
per command) and every bit of the seed reaching the noise.
"""

from __future__ import annotations

import json
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from idpsgd.cli import main
from idpsgd.runfolder import PRIVATE, SEED_FILE
from support import cli_process, mode_problems, public_files
from test_output_kinds import _csv_dataset

S = 987654321
FAST = ["--epochs", "1", "--no-progress", "--batch-size", "32"]
BUDGETS = ["--budgets", "1,2,3", "--fractions", "0.34,0.43,0.23"]


def _commands(data: list[str]) -> dict[str, list[str]]:
    train = ["train", *BUDGETS, *data, *FAST, "--seed", str(S)]
    return {
        "sample": [*train, "--method", "sample"],
        "individual": [
            *train,
            "--method",
            "scale",
            "--individual-accounting",
            "--validate-subset",
            "0",
            "--save-norms",
        ],
        "filter": [*train, "--method", "sample", "--filter", "individual"],
        # user level (issue 37): a column as the user id (dropped from the features), users sampled and
        # clipped as units; nothing of the users, nor the seed, in a public output
        "users": [*train, "--method", "scale", "--user-column", "f5", "--max-rows-per-user", "2"],
        "pdp-sgd": [*train, "--method", "pdp-sgd", "--rounds", "2"],
        "per-instance": [
            "per-instance",
            *data,
            *FAST,
            "--seed",
            str(S),
            "--points",
            "0,1",
            "--runs",
            "1",
            "--samples",
            "2,2",
        ],
        "demo": ["demo", *data, *FAST, "--seed", str(S)],
        "reproduce": [
            "reproduce",
            "boenisch-table3",
            *data,
            "--seeds",
            "1",
            "--calibrated-steps",
            "3",
            "--no-progress",
            "--seed",
            str(S),
        ],
        "audit": ["audit", "--method", "sample", *BUDGETS, *data, *FAST, "--seed", str(S), "--attack", "loss"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (run folder, stdout + stderr) for every command, each run once with --seed S."""
    base = tmp_path_factory.mktemp("seed")
    data = _csv_dataset(base / "data")
    out = {}
    for name, argv in _commands(data).items():
        folder = base / name
        cap = _Capture()
        with cap:
            assert main([*argv, "--out", str(folder), "--json"]) == 0, name
        out[name] = (folder, cap.text)
    # a resumed run (no --seed: the one its private checkpoint recorded), then the report command
    cap = _Capture()
    with cap:
        assert (
            main(
                [
                    "train",
                    "--method",
                    "sample",
                    *BUDGETS,
                    *data,
                    "--epochs",
                    "2",
                    "--no-progress",
                    "--batch-size",
                    "32",
                    "--out",
                    str(base / "sample"),
                    "--resume",
                    "--json",
                ]
            )
            == 0
        )
        assert main(["report", str(base / "individual"), "--json"]) == 0
        assert main(["report", str(base / "individual"), "--include-private", "--json"]) == 0
    out["resume+report"] = (base / "sample", cap.text)
    return out


class _Capture:
    """``sys.stdout`` and ``sys.stderr`` of an in-process command (progress lines, errors, printed output)."""

    def __enter__(self):
        import contextlib
        import io

        self._out, self._err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._out))
        self._stack.enter_context(contextlib.redirect_stderr(self._err))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self.text = self._out.getvalue() + self._err.getvalue()
        return False


def _forms(seed: int) -> tuple[list[str], list[bytes]]:
    """Text forms (decimal, hex) and byte forms (little-endian int32/int64, as pickle and npz write
    them) of ``seed``."""
    text = [str(seed), f"{seed:x}", f"{seed:X}"]
    raw = [struct.pack("<q", seed)] + ([struct.pack("<i", seed)] if seed < 2**31 else [])
    return text, raw


def _private_seeds(folder: Path) -> set[int]:
    """S and every integer recorded under a key with 'seed' in a private JSON file of ``folder``."""
    seeds = {S}

    def walk(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                if "seed" in str(k) and isinstance(v, int) and not isinstance(v, bool) and v > 1000:
                    seeds.add(v)
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    for p in folder.rglob(f"{PRIVATE}/*.json"):
        walk(json.loads(p.read_text()))
    return seeds


def _blobs(path: Path) -> list[bytes]:
    """The file's bytes, and each member's for a zip (torch.save)."""
    data = path.read_bytes()
    out = [data]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            out += [z.read(name) for name in z.namelist()]
    return out


def seed_leaks(folder: Path, printed: str) -> list[str]:
    """Where a seed of the run appears in a public output."""
    leaks = []
    for seed in sorted(_private_seeds(folder)):
        text, raw = _forms(seed)
        leaks += [f"stdout/stderr holds {t}" for t in text if t in printed]
        for p in public_files(folder):
            for blob in _blobs(p):
                found = [t for t in text if t.encode() in blob] + [r.hex() for r in raw if r in blob]
                if found:
                    leaks.append(f"{p.relative_to(folder)} holds seed {seed} as {found}")
                    break
    return leaks


@pytest.mark.parametrize(
    "name", ["sample", "individual", "filter", "pdp-sgd", "per-instance", "demo", "reproduce", "audit", "resume+report"]
)
def test_no_public_output_holds_the_seed(runs, name):
    folder, printed = runs[name]
    assert seed_leaks(folder, printed) == []
    assert mode_problems(folder) == []


@pytest.mark.parametrize("name", ["sample", "filter", "pdp-sgd", "demo", "reproduce"])
def test_the_seed_is_recorded_privately_and_the_report_says_where(runs, name):
    folder, _ = runs[name]
    record = json.loads((folder / PRIVATE / SEED_FILE).read_text())
    assert record["seed"] == S
    public = json.loads(
        next(
            folder / f for f in ("report.json", "summary.json", "boenisch_table3.json") if (folder / f).is_file()
        ).read_text()
    )
    assert "seed" not in public and f"{PRIVATE}/{SEED_FILE}" in public["randomness"]
    assert "secure mode" in public["randomness"]


def test_per_instance_keeps_its_seed_private(runs):
    folder, _ = runs["per-instance"]
    assert json.loads((folder / PRIVATE / SEED_FILE).read_text())["seed"] == S
    settings = json.loads((folder / "settings.json").read_text())
    assert "seed" not in settings and settings["secure_mode"] is False and "private/seed.json" in settings["randomness"]


def test_resume_continues_with_the_private_seed(runs):
    """The resume in the fixture gave no --seed: it ran only because the seed came from the private
    checkpoint (a fresh seed would differ from the checkpoint's settings and be refused)."""
    folder, printed = runs["resume+report"]
    report = json.loads(printed[: printed.index("\n}\n") + 3])
    assert report["out"] == str(folder) and report["steps"] > 0 and "seed" not in report
    assert json.loads((folder / PRIVATE / SEED_FILE).read_text())["seed"] == S


def test_show_private_prints_the_seed_only_on_request(tmp_path, capsys):
    data = _csv_dataset(tmp_path / "data")
    argv = ["train", "--method", "uniform", "--budgets", "2", *data, *FAST, "--seed", str(S)]
    assert main([*argv, "--out", str(tmp_path / "a"), "--json"]) == 0
    assert str(S) not in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "b"), "--json", "--show-private"]) == 0
    assert json.loads(capsys.readouterr().out)["private"]["seed"] == S


def test_an_old_public_seed_moves_to_private_and_the_run_still_resumes(tmp_path, capsys):
    """A run folder of an earlier version holds the seed in report.json: ``idpsgd report`` moves it to
    private/seed.json and rewrites report.json without it; ``--resume`` reads the private checkpoint."""
    data = _csv_dataset(tmp_path / "data")
    out = tmp_path / "old"
    argv = ["train", "--method", "sample", *BUDGETS, *data, "--no-progress", "--batch-size", "32", "--out", str(out)]
    assert main([*argv, "--epochs", "1", "--seed", str(S)]) == 0
    report = json.loads((out / "report.json").read_text())
    report["seed"] = S  # as written before the fix
    report.pop("randomness")
    (out / "report.json").write_text(json.dumps(report))
    (out / PRIVATE / SEED_FILE).unlink()
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert "moved the seed" in capsys.readouterr().out
    fixed = json.loads((out / "report.json").read_text())
    assert "seed" not in fixed and "private/seed.json" in fixed["randomness"]
    assert json.loads((out / PRIVATE / SEED_FILE).read_text())["seed"] == S
    assert seed_leaks(out, "") == [] and mode_problems(out) == []
    assert main([*argv, "--epochs", "2", "--resume"]) == 0  # no --seed: the checkpoint's
    assert seed_leaks(out, capsys.readouterr().out) == []


def test_library_harness_keeps_the_seed_private(tmp_path):
    """The Trainer (``train``) with a run folder: the seed only in private/; the returned report keeps
    it under "private" (what stdout shows only with --show-private)."""
    from idpsgd.assignment import Budgets
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig, train
    from idpsgd.training.loop import public_report

    data_dir = tmp_path / "data"
    _csv_dataset(data_dir)
    data = load_dataset("csv", str(data_dir), num_classes=3)
    budgets = Budgets.from_groups([1.0, 3.0], [0.5, 0.5], len(data.y_train), 1e-5, seed=0)
    cfg = TrainConfig(method="scale", epochs=1, batch_size=32, seed=S, progress=False)
    report = train(data, budgets, cfg, tmp_path / "run")
    assert report["private"]["seed"] == S and "seed" not in public_report(report)
    assert str(S) not in json.dumps(public_report(report))
    assert seed_leaks(tmp_path / "run", "") == [] and mode_problems(tmp_path / "run") == []
    assert json.loads((tmp_path / "run" / PRIVATE / SEED_FILE).read_text())["seed"] == S
    # without a folder the report says the seed is in its private part
    bare = train(data, budgets, cfg)
    assert "seed" not in public_report(bare) and "private part" in bare["randomness"]


def test_secure_mode_is_stated_and_no_seed_is_written(tmp_path, capsys):
    data = _csv_dataset(tmp_path / "data")
    assert (
        main(
            [
                "train",
                "--method",
                "sample",
                *BUDGETS,
                *data,
                *FAST,
                "--secure-mode",
                "--out",
                str(tmp_path / "s"),
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["secure_mode"] is True and out["randomness"].startswith("secure mode")
    assert not (tmp_path / "s" / PRIVATE / SEED_FILE).exists()
    assert "secure mode" in (tmp_path / "s" / "report.html").read_text()


def test_a_resume_error_never_prints_the_recorded_seed(tmp_path, capsys):
    data = _csv_dataset(tmp_path / "data")
    argv = [
        "train",
        "--method",
        "sample",
        *BUDGETS,
        *data,
        "--no-progress",
        "--batch-size",
        "32",
        "--out",
        str(tmp_path / "r"),
        "--epochs",
        "1",
    ]
    assert main([*argv, "--seed", str(S)]) == 0
    capsys.readouterr()
    assert main([*argv, "--seed", "5", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config.seed differs" in err and str(S) not in err


# --- the warning ----------------------------------------------------------------------------
def test_the_engine_warns_without_secure_mode_as_opacus_does():
    from idpsgd.engine import IndividualizedPrivacyEngine

    with pytest.warns(UserWarning, match="Secure RNG turned off.*retrain one last time before production"):
        IndividualizedPrivacyEngine(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        IndividualizedPrivacyEngine(secure_mode=True)
    assert not [w for w in caught if "Secure RNG" in str(w.message)]


def test_a_command_that_trains_several_models_warns_once(tmp_path, capsys):
    data = _csv_dataset(tmp_path / "data")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # no deduplication by Python: the CLI's own
        assert main(["demo", *data, *FAST, "--seed", "3", "--out", str(tmp_path / "d")]) == 0  # four engines
    # the CLI collects the engines' warnings and prints one line of its own (issue 38)
    assert not any("Secure RNG turned off" in str(w.message) for w in caught)
    assert capsys.readouterr().err.count("Secure RNG turned off") == 1


def test_stderr_of_a_real_process_warns_once_and_holds_no_seed(tmp_path):
    data = _csv_dataset(tmp_path / "data")
    argv = ["demo", *data, *FAST, "--seed", str(S), "--out", str(tmp_path / "d")]
    code, stdout, stderr = cli_process(argv, tmp_path, timeout_s=300, show_warnings=True)
    assert code == 0, stderr
    assert stderr.count("Secure RNG turned off") == 1
    # the CLI's one clean line (issue 38), not Python's "path.py:229: UserWarning: ..." form
    assert "idpsgd demo: warning: Secure RNG turned off" in stderr and "UserWarning" not in stderr
    assert seed_leaks(tmp_path / "d", stdout + stderr) == []


# --- every bit of the seed reaches the noise ---------------------------------------------------
def test_cpu_noise_depends_on_every_bit_of_the_seed():
    """``torch.Generator().manual_seed`` keeps 32 bits on CPU (S and S + 2^32 give one stream); the
    noise generator takes the whole seed."""
    from idpsgd.engine.noise.randomness import noise_generator

    def draw(seed):
        return torch.randn(8, generator=noise_generator("cpu", seed, False))

    assert torch.equal(
        torch.randn(8, generator=torch.Generator().manual_seed(S)),
        torch.randn(8, generator=torch.Generator().manual_seed(S + 2**32)),
    )  # the flaw
    assert torch.equal(draw(S), draw(S))
    for other in (S + 2**32, S + 2**62, S ^ 1):
        assert not torch.equal(draw(S), draw(other))


def test_full_seed_noise_is_standard_normal_and_resumable():
    from scipy import stats

    from idpsgd.engine.noise.randomness import noise_generator

    gen = noise_generator("cpu", 2**63 - 1, False)
    z = torch.randn(200_000, generator=gen, dtype=torch.float64).numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-4 and abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    state = gen.get_state()
    a = torch.randn(5, generator=gen)
    resumed = torch.Generator()
    resumed.set_state(state)
    assert torch.equal(a, torch.randn(5, generator=resumed))


def test_two_engines_whose_seeds_agree_in_32_bits_add_different_noise():
    from idpsgd.assignment import Budgets
    from idpsgd.engine import IndividualizedPrivacyEngine

    results = []
    for seed in (S, S + 2**32):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 2
        # q = 1: every example in every batch, so the two runs differ only through the noise
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = IndividualizedPrivacyEngine(seed=seed)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            budgets=Budgets.from_array(np.full(64, 2.0), 1e-5),
            method="uniform",
            epochs=1,
            max_grad_norm=1.0,
        )
        xb, yb = next(iter(loader))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        results.append(torch.cat([p.detach().ravel() for p in model.parameters()]))
    assert not torch.equal(*results)


def test_experiments_draw_a_fresh_private_seed_and_replay_a_given_one(tmp_path):
    """The paper experiments no longer train with public seeds 0..N-1: without ``seed`` each call draws
    a fresh base seed (kept under "private"); with one, the repetitions' seeds derive from it and the
    experiment replays."""
    from idpsgd.data import load_dataset
    from idpsgd.engine.noise.randomness import derive_seed
    from idpsgd.experiments.boenisch import run_boenisch_table3

    _csv_dataset(tmp_path / "data")
    data = load_dataset("csv", str(tmp_path / "data"), num_classes=3)
    kw = dict(seeds=1, calibrated_steps=2, progress=False)
    a, b = run_boenisch_table3(data, **kw), run_boenisch_table3(data, **kw)
    assert a["private"]["seed"] != b["private"]["seed"]
    c, d = run_boenisch_table3(data, seed=S, **kw), run_boenisch_table3(data, seed=S, **kw)
    assert c["private"]["seed"] == S and c["columns"] == d["columns"]
    assert "seed" not in {k for k in c if k != "private"} and str(S) not in json.dumps(
        {k: v for k, v in c.items() if k != "private"}
    )
    assert derive_seed(S, 0) != derive_seed(S, 1) and 0 <= derive_seed(S, 0) < 2**63
