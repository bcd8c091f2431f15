"""User-level privacy in the Hugging Face Trainer (issue 37): PrivacyArguments(user_column=...)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments
from test_hf_integration import _args, _lines, _llama, tok  # noqa: F401  (tok: the fixture)


def _user_data(tok, n=48, seed=0):  # noqa: F811
    enc = tok(_lines(n, seed), truncation=True, max_length=16)
    user = [f"member-{i // 3:02d}-xq" for i in range(n)]  # 16 users of 3 rows
    eps = [1.0 if (i // 3) % 2 == 0 else 8.0 for i in range(n)]  # one budget per user
    return datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "epsilon": eps, "user": user}
    )


def test_trainer_with_a_user_column(tok, tmp_path):  # noqa: F811
    from transformers import DataCollatorForLanguageModeling

    out = tmp_path / "run"
    t = IndividualizedTrainer(
        model=_llama(tok),
        args=_args(out, per_device_train_batch_size=4),
        train_dataset=_user_data(tok),
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        privacy=PrivacyArguments(
            budgets="epsilon", delta=1e-5, method="sample", seed=3, user_column="user", max_rows_per_user=2
        ),
    )
    assert t.users is not None and t.users.num_users == 16 and len(t.budgets) == 16
    assert "user" not in t.train_dataset.column_names
    t.train()
    r = json.loads((out / "report.json").read_text())
    assert r["privacy_unit"] == "user" and r["max_rows_per_user"] == 2
    assert all(g["epsilon_spent"] <= g["budget"] * (1 + 1e-9) for g in r["groups"])
    for p in out.rglob("*"):
        if p.is_file() and "private" not in p.relative_to(out).parts:
            assert b"member-" not in p.read_bytes()


def test_trainer_user_column_must_be_a_column(tok, tmp_path):  # noqa: F811
    from idpsgd import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="user_column"):
        IndividualizedTrainer(
            model=_llama(tok),
            args=_args(tmp_path / "r"),
            train_dataset=_user_data(tok),
            processing_class=tok,
            privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, user_column="nope"),
        )


def test_finetune_user_column(tok, tmp_path, capsys):  # noqa: F811
    from idpsgd.cli import main
    from test_hf_integration import _llama as build

    model_dir = tmp_path / "model"
    build(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    lines = _lines(36, seed=5)
    rows = [
        {"text": s, "who": f"member-{i // 4:02d}-xq", "epsilon": 1.0 if (i // 4) % 2 else 8.0}
        for i, s in enumerate(lines)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(model_dir), "--data", str(train), "--method", "sample", "--epochs", "1"]
    argv += ["--batch-size", "3", "--user-column", "who", "--max-rows-per-user", "2", "--seed", "0", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert r["privacy_unit"] == "user" and r["max_rows_per_user"] == 2
    assert [g["budget"] for g in r["groups"]] == [1.0, 8.0]
    assert all(g["epsilon_spent"] <= g["budget"] * (1 + 1e-9) for g in r["groups"])
    assert "member-" not in captured.out + captured.err
    for p in out.rglob("*"):
        if p.is_file() and "private" not in p.relative_to(out).parts:
            assert b"member-" not in p.read_bytes()
