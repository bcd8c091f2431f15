"""Issue 48: what a new user met fine-tuning with users, resume and several processes — errors that
name the user's own flags, user-level outputs that count users, a split by user, progress with ε,
resume notes, one spelling per concept, and the docs' examples run verbatim."""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import warnings

import numpy as np
import pytest

from doc_blocks import blocks, doc_block
from idpsgd.cli.main import main
from idpsgd.validation import InvalidParameterError
from support import file_mode


# --- errors ----------------------------------------------------------------------------------------
def test_a_rank_error_whose_value_is_an_object_is_readable(tmp_path):
    """A rank's InvalidParameterError holding an object (``Users``) was pickled whole and read back
    as "not a readable idpsgd distributed error report (Weights only load failed ...)"."""
    from idpsgd import Users
    from idpsgd.engine.distributed import _load_error, _rebuild, _save_error

    exc = InvalidParameterError("user_column", Users(["a", "b", "b"], 2), "is refused here")
    _save_error(tmp_path / "error0.pt", exc)
    record = _load_error(tmp_path / "error0.pt")
    assert record["type"] == "InvalidParameterError" and record["value"] == "Users(max_rows_per_user=2)"
    err = _rebuild(record)
    assert isinstance(err, InvalidParameterError) and err.name == "user_column" and str(err) == str(exc)


def _args(**given):
    return argparse.Namespace(command="finetune", **given)


def test_cli_errors_name_the_flags_and_values_the_user_gave():
    from idpsgd import Users
    from idpsgd.cli.main import refusal_line

    args = _args(user_column="user", out="run", resume=True, budgets=None, clip_norm=0.0)
    args._typed = {"clip_norm": "--max-grad-norm"}
    line = refusal_line(InvalidParameterError("user_column", Users([1, 2], 4), "x"), args)
    assert line == "--user-column='user' is invalid: x"  # never "Users(k=4)"
    assert refusal_line(InvalidParameterError("output_dir", "/abs/run", "holds a run"), args) == (
        "--out='run' is invalid: holds a run"
    )
    assert refusal_line(InvalidParameterError("resume_from_checkpoint", "/a/b.pt", "differs"), args) == (
        "--resume is invalid: differs"
    )
    assert refusal_line(InvalidParameterError("budgets", None, "give --budgets ..."), args) == (
        "--budgets is missing: give --budgets ..."
    )
    assert refusal_line(InvalidParameterError("max_grad_norm", 0.0, "must be > 0"), args) == (
        "--max-grad-norm=0.0 is invalid: must be > 0"  # the alias the user typed
    )
    # a value from a data column, not from the flag (not given): no --flag the user never typed
    rows = InvalidParameterError("budgets", "a per-row column", "differ")
    assert refusal_line(rows, _args(budgets=None)) == "budgets='a per-row column' is invalid: differ"
    # a library name that is no flag of the command: left as it is, never a made-up --flag
    assert refusal_line(InvalidParameterError("num_examples", 3, "x"), args) == "num_examples=3 is invalid: x"


def test_numpy_values_show_as_numbers():
    from idpsgd.accounting.conversion import rdp_to_delta

    with pytest.raises(ValueError, match=r"^epsilon=-1.0 is invalid") as info:
        rdp_to_delta(np.ones(3), [2.0, 4.0, 8.0], np.float64(-1.0))
    assert "np.float64" not in str(info.value)


def test_under_torchrun_a_refusal_is_said_once_by_rank_0(monkeypatch, capsys):
    argv = ["epsilon", "--sample-rate", "2", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 2 and capsys.readouterr().err.count("\n") == 1


def test_bare_idpsgd_prints_its_help_on_stdout(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert "COMMAND" in out and "finetune" in out and err == ""


def test_warnings_are_one_line_without_their_source():
    """The CLI formats warnings as one line (no ``file:line: UserWarning:`` and source line), through
    ``warnings.formatwarning``, so code that records warnings (a test, a caller) still gets them."""
    from idpsgd.cli.main import _OneLineWarnings

    with _OneLineWarnings("train"):
        line = warnings.formatwarning("two\n  lines", UserWarning, "src/x.py", 3)
    assert line == "idpsgd train: warning: two lines\n"
    assert "src/x.py:3" in warnings.formatwarning("w", UserWarning, "src/x.py", 3)  # restored


def test_nproc_over_the_cores_is_warned(monkeypatch, capsys):
    import os

    from idpsgd.cli.budget_args import warn_nproc

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    warn_nproc(2, "cpu")
    assert capsys.readouterr().err == ""
    warn_nproc(4, "cpu")
    assert "--nproc 4 processes on 2 CPU core(s)" in capsys.readouterr().err


# --- finetune --nproc with its defaults --------------------------------------------------------------
def test_finetune_nproc_takes_each_process_share_by_default():
    pytest.importorskip("transformers")
    from idpsgd.integrations.hf.finetune import FinetuneOptions, physical_per_process

    assert physical_per_process(FinetuneOptions(nproc=2), 2) == 8  # --batch-size 16 over 2 processes
    assert physical_per_process(FinetuneOptions(batch_size=16, physical_batch_size=4, nproc=2), 2) == 4
    with pytest.raises(InvalidParameterError, match=r"batch_size=16 is invalid: .*e\.g\. --batch-size 18"):
        FinetuneOptions(nproc=3)
    with pytest.raises(InvalidParameterError, match=r"physical_batch_size=16 is invalid: .*--physical-batch-size 8\)"):
        FinetuneOptions(batch_size=16, physical_batch_size=16, nproc=2)


# --- users -------------------------------------------------------------------------------------------
def test_users_spelling_and_the_rows_of_an_inconsistent_budget():
    from idpsgd import Users

    u = Users(["a", "a", "b", "a"], max_rows_per_user=3)
    assert u.k == u.max_rows_per_user == 3 and repr(u) == "Users(max_rows_per_user=3)"
    with pytest.raises(InvalidParameterError, match="once"):
        Users(["a"], 2, max_rows_per_user=2)
    with pytest.raises(InvalidParameterError, match=r"row 1 and row 4 have 1 and 3"):
        u.budgets_from_rows([1.0, 1.0, 2.0, 3.0], 1e-5)
    with pytest.raises(InvalidParameterError, match=r"line 2 and line 5 have"):
        u.budgets_from_rows([1.0, 1.0, 2.0, 3.0], 1e-5, row_names=[f"line {i + 2}" for i in range(4)])
    with pytest.raises(InvalidParameterError, match="must hold numbers"):
        u.budgets_from_rows(["1", "x", "2", "1"], 1e-5)
    assert u.rows_beyond_k() == {
        "max_rows_per_user": 3,
        "users": 2,
        "rows": 4,
        "users_with_more_than_k_rows": 0,
        "rows_beyond_k": 0,
    }


def test_group_epsilons_at_user_level_count_users():
    from idpsgd.engine.budget.accountant import GroupEpsilons

    eps = GroupEpsilons([0.5, 1.0], [1.0, 2.0], [3, 4], 1e-5, "rdp", 5, unit="user")
    assert "users" in repr(eps) and "examples" not in repr(eps)
    assert "examples" in repr(GroupEpsilons([0.5, 1.0], [1.0, 2.0], [3, 4], 1e-5, "rdp", 5))


def test_the_split_by_user_keeps_users_whole_and_each_side_depends_on_the_user_alone():
    from idpsgd.data import _user_split

    rng = np.random.default_rng(0)
    ids = [f"u{i}" for i in rng.integers(0, 80, 400)]
    tr, te = _user_split(ids, "x")
    train_users, test_users = {ids[i] for i in tr}, {ids[i] for i in te}
    assert not train_users & test_users and 0.05 < len(test_users) / 80 < 0.4
    kept = [u for u in ids if u != ids[0]]  # one user less: nobody else changes side
    _, te2 = _user_split(kept, "x")
    assert {kept[i] for i in te2} == test_users - {ids[0]}


def _users_csv(folder, users=60):
    rng = np.random.default_rng(1)
    folder.mkdir()
    rows = []
    with (folder / "train.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user", "x1", "x2", "label", "epsilon"])
        for u in range(users):
            for _ in range(int(rng.integers(1, 10))):
                x = rng.normal(size=2)
                w.writerow([f"p,{u}", f"{x[0]:.3f}", f"{x[1]:.3f}", int(x.sum() > 0), 1.0 if u % 2 else 3.0])
                rows.append(f"p,{u}")
    return rows


def test_user_level_train_speaks_of_users(tmp_path, capsys):
    rows = _users_csv(tmp_path / "data")
    out = tmp_path / "run"
    argv = ["train", "--method", "sample", "--dataset", "csv", "--data-dir", str(tmp_path / "data")]
    argv += ["--num-classes", "2", "--user-column", "user", "--batch-size", "8", "--epochs", "2"]
    assert main([*argv, "--seed", "0", "--out", str(out)]) == 0  # budgets: train.csv's epsilon column
    text, err = capsys.readouterr()
    assert "   users  sample_rate" in text.splitlines()[1]
    assert "ε " in err and "/1, " in err  # the per-epoch progress lines with each group's ε (not a terminal)
    report = json.loads((out / "report.json").read_text())
    assert report["phases"][0]["unit"] == "user" and report["nproc"] == 1
    assert [g["budget"] for g in report["groups"]] == [1.0, 3.0]
    html = (out / "report.html").read_text()
    assert "every user with budget 1 received" in html and "k = 4" in html and "<th>users</th>" in html
    counts = {u: rows.count(u) for u in set(rows)}
    summary = json.loads((out / "private" / "users.json").read_text())
    split = list(csv.DictReader((out / "private" / "data_split.csv").open()))
    trained = {rows[int(r["row"])] for r in split if r["split"] == "train"}
    tested = {rows[int(r["row"])] for r in split if r["split"] == "test"}
    assert not trained & tested and tested  # whole users on each side
    assert summary["users"] == len(trained) and summary["rows_beyond_k"] == sum(max(counts[u] - 4, 0) for u in trained)
    assert file_mode(out / "private" / "users.json") == 0o600
    assert main([*argv, "--user-column", "usr", "--out", str(tmp_path / "x")]) == 2
    assert "--user-column='usr' is invalid" in capsys.readouterr().err  # not --drop-columns


# --- finetune: the docs' model folder --------------------------------------------------------------
@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory):
    """The docs' recipe for a local model folder and a text file with users (it runs as written)."""
    pytest.importorskip("transformers")
    import os

    folder = tmp_path_factory.mktemp("docs")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(doc_block("finetune-model-folder"), "finetune-model-folder", "exec"), {"__name__": "doc"})
    finally:
        os.chdir(cwd)
    return folder


def _finetune(folder, out, *extra):
    model, data = folder / "models" / "tiny-gpt2", folder / "texts.jsonl"
    base = ["--method", "scale", "--epochs", "1", "--seed", "3", "--out", str(out)]
    return ["finetune", "--model", str(model), "--data", str(data), *base, *extra]


def test_finetune_resume_says_where_it_continues_and_starts_fresh_without_a_checkpoint(docs_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_finetune(docs_folder, out, "--save-every", "3", "--resume", "--progress")) == 0
    err = capsys.readouterr().err
    assert "held no checkpoint" in err and "a new run started" in err and "ε " in err  # the bar's postfix
    assert main(_finetune(docs_folder, out, "--save-every", "3")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"idpsgd finetune: error: --out='{out}' is invalid: holds a run with checkpoints")
    assert "--resume continues it, --overwrite replaces it" in err and "PrivacyArguments" not in err
    assert main(_finetune(docs_folder, out, "--save-every", "3", "--resume")) == 0
    assert "resumed from" in capsys.readouterr().err


def test_finetune_user_level_spellings_and_budget_flags(docs_folder, tmp_path, capsys):
    out = tmp_path / "users"
    extra = ["--user-column", "user", "--batch-size", "8", "--budgets", "1,2", "--fractions", "0.5,0.5"]
    extra += ["--max-grad-norm", "0.5", "--gradient-checkpointing", "--no-progress"]
    assert main(_finetune(docs_folder, out, *extra)) == 0  # --budgets wins over the file's epsilon column
    text, err = capsys.readouterr()
    assert "ε " not in err and "   users  sample_rate" in text
    report = json.loads((out / "report.json").read_text())
    assert [g["budget"] for g in report["groups"]] == [1.0, 2.0] and report["clip_norm"] == 0.5
    assert report["phases"][0]["unit"] == "user" and report["nproc"] == 1
    lines = (out / "private" / "epsilons.csv").read_text().splitlines()
    assert lines[0] == "user,rows,budget,epsilon" and len(lines) == 41
    assert {line.split(",")[0] for line in lines[1:]} == {f"u{i}" for i in range(40)}


def test_a_trainer_resume_says_secure_rng_once(tmp_path):
    """The resumed trainer replaced its engine by one with the checkpoint's seed, which warned again."""
    pytest.importorskip("transformers")
    from idpsgd.integrations.hf import PrivacyArguments
    from test_hf_longrun import _trainer
    from test_hf_longrun import tok as tok_fixture

    tok = tok_fixture.__wrapped__()
    _trainer(tok, tmp_path / "run", num_train_epochs=1).train()
    privacy = PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale")  # seed=None: the checkpoint's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tok, tmp_path / "run", privacy=privacy, num_train_epochs=1).train(resume_from_checkpoint=True)
    assert sum("Secure RNG turned off" in str(w.message) for w in caught) == 1


def test_finetune_refuses_before_it_spawns_the_processes(docs_folder, tmp_path, monkeypatch):
    """What a rank would refuse is refused in the launching process: no rank starts for a bad argument."""
    from idpsgd import Budgets
    from idpsgd.engine import distributed
    from idpsgd.integrations.hf.finetune import FinetuneOptions, finetune
    from idpsgd.integrations.hf.text_data import load_text_data

    def spawned(*a, **k):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(distributed, "launch", spawned)
    data = load_text_data(docs_folder / "texts.jsonl", "text", None, None)
    options = FinetuneOptions(nproc=2, batch_size=8)
    with pytest.raises(InvalidParameterError, match="budgets"):
        finetune(docs_folder / "models" / "tiny-gpt2", data, Budgets(np.ones(5), 1e-5), tmp_path / "r", options=options)
    with pytest.raises(InvalidParameterError, match="model"):
        finetune(tmp_path / "nope", data, Budgets(np.ones(len(data)), 1e-5), tmp_path / "r", options=options)


# --- the docs' examples, verbatim ------------------------------------------------------------------
def _run_block_commands(tag, monkeypatch, capsys):
    (block,) = [b for b in blocks("bash") if b.tag == tag]
    for line in block.code.replace("\\\n", " ").splitlines():
        if line.strip():
            argv = shlex.split(line)
            assert argv[0] == "idpsgd"
            assert main(argv[1:]) == 0, (line, capsys.readouterr().err)


@pytest.mark.slow
def test_docs_finetune_examples_run_verbatim(docs_folder, monkeypatch, capsys):
    """huggingface.md: one process, --nproc 2 without --fsdp (the defaults), user level."""
    monkeypatch.chdir(docs_folder)
    _run_block_commands("finetune-quickstart", monkeypatch, capsys)
    one, two = (json.loads((docs_folder / "runs" / d / "report.json").read_text()) for d in ("ft-quick", "ft-2proc"))
    assert two["nproc"] == 2 and [g["epsilon_spent"] for g in one["groups"]] == [
        g["epsilon_spent"] for g in two["groups"]
    ]


@pytest.mark.slow
def test_docs_user_level_train_examples_run_verbatim(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(doc_block("user-level-csv"), "user-level-csv", "exec"), {"__name__": "doc"})
    _run_block_commands("user-level-commands", monkeypatch, capsys)
    assert json.loads((tmp_path / "runs" / "users-2proc" / "report.json").read_text())["nproc"] == 2
