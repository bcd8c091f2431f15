"""Nothing public derives from the private rows' label set or from the real batches (issue 35).

The label set: the class set (names, number, order) of a released model comes from public information only
(the model folder's config when it names its classes, ``--labels`` / ``--num-classes``; for
``train --dataset csv`` a required ``--num-classes``).  Neighbouring data sets D (with one extra row
whose label is unique) and D' (without it), same seed, non-secure mode: the public model config
and the classifier head are identical, or both runs give the same refusal; a label outside the
public set is a per-row error.

The real batches: what ``IndividualizedTrainer`` exposes or saves (``TrainOutput``, ``save_state``,
``save_metrics``) holds no value derived from the real batch sizes or training losses.
"""

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from transformers import LlamaForSequenceClassification

from idpsgd import InvalidParameterError
from idpsgd.cli.main import main
from idpsgd.data import DatasetFileError, load_dataset
from idpsgd.integrations.hf import PrivacyArguments
from idpsgd.io import load_torch
from idpsgd.runfolder import PRIVATE
from support import file_mode
from test_hf_integration import _lines, _llama, _llama_config, _lm_data, _trainer, _write_jsonl, tok  # noqa: F401

RARE = "hiv_positive"


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def lm_dir(tok, tmp_path_factory):  # noqa: F811
    """A language-model folder: its config names no classes (LABEL_0, LABEL_1)."""
    folder = tmp_path_factory.mktemp("lm") / "model"
    _llama(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def named_dir(tok, tmp_path_factory):  # noqa: F811
    """A classifier folder whose config names its classes (neg, pos)."""
    folder = tmp_path_factory.mktemp("cls") / "model"
    torch.manual_seed(0)
    cfg = _llama_config(tok, num_labels=2, id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1})
    LlamaForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _text_rows(rare: bool):
    """D (rare=True: one extra row with the unique label RARE) or D' (without it)."""
    lines = _lines(24, seed=11)
    rows = [
        {"text": s, "label": "pos" if "cat" in s else "neg", "epsilon": 2.0 if i % 2 else 8.0}
        for i, s in enumerate(lines)
    ]
    if rare:
        rows.append({"text": "privacy consent group", "label": RARE, "epsilon": 8.0})
    return rows


def _finetune(model, data, out, capsys, *extra):
    return _run(
        [
            "finetune",
            "--model",
            str(model),
            "--data",
            str(data),
            "--label-column",
            "label",
            "--method",
            "scale",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--seed",
            "0",
            "--out",
            str(out),
            *extra,
        ],
        capsys,
    )


def _public_class_set(out):
    cfg = json.loads((out / "model" / "config.json").read_text())
    from safetensors.torch import load_file

    state = load_file(out / "model" / "model.safetensors")
    head = [tuple(v.shape) for k, v in state.items() if k.startswith("score.")]
    return {k: cfg.get(k) for k in ("id2label", "label2id", "num_labels")}, head


def test_finetune_without_a_public_class_set_refuses_d_and_d_prime_alike(lm_dir, tmp_path, capsys):
    """On main, D released id2label {0: hiv_positive, 1: neg, 2: pos} and D' {0: neg, 1: pos}."""
    errors = []
    for name in ("d", "d_prime"):
        data = _write_jsonl(tmp_path / f"{name}.jsonl", _text_rows(rare=name == "d"))
        code, _, err = _finetune(lm_dir, data, tmp_path / f"out_{name}", capsys)
        assert code == 2, err
        assert "--labels" in err and "--num-classes" in err and "public" in err
        errors.append(err)
        assert not (tmp_path / f"out_{name}").exists()
    assert errors[0] == errors[1]
    assert RARE not in errors[0]


def test_finetune_with_labels_publishes_the_same_class_set_for_d_and_d_prime(lm_dir, tmp_path, capsys):
    released = []
    for name in ("d", "d_prime"):
        data = _write_jsonl(tmp_path / f"{name}.jsonl", _text_rows(rare=name == "d"))
        out = tmp_path / f"out_{name}"
        code, _, err = _finetune(lm_dir, data, out, capsys, "--labels", f"neg,pos,{RARE}")
        assert code == 0, err
        released.append(_public_class_set(out))
    assert released[0] == released[1]
    cfg, head = released[0]
    assert cfg["id2label"] == {"0": "neg", "1": "pos", "2": RARE} and head == [(3, 16)]


def test_finetune_with_num_classes_publishes_the_same_class_set(lm_dir, tmp_path, capsys):
    released = []
    for name, extra in (("d", [{"text": "a lazy dog", "label": 3, "epsilon": 8.0}]), ("d_prime", [])):
        rows = [{"text": s, "label": int("cat" in s), "epsilon": 8.0} for s in _lines(20, seed=3)] + extra
        data = _write_jsonl(tmp_path / f"{name}.jsonl", rows)
        out = tmp_path / f"out_{name}"
        code, _, err = _finetune(lm_dir, data, out, capsys, "--num-classes", "4")
        assert code == 0, err
        released.append(_public_class_set(out))
    assert released[0] == released[1]
    assert released[0][0]["id2label"] == {str(i): str(i) for i in range(4)} and released[0][1] == [(4, 16)]


def test_a_label_outside_the_public_set_is_a_per_row_error(lm_dir, named_dir, tmp_path, capsys):
    d = _write_jsonl(tmp_path / "d.jsonl", _text_rows(rare=True))
    line = len(_text_rows(rare=True))  # the rare row is the last line
    code, _, err = _finetune(lm_dir, d, tmp_path / "o1", capsys, "--labels", "neg,pos")
    assert code == 2
    assert f"d.jsonl, line {line}, column 'label': '{RARE}' is not one of the 2 public classes (neg, pos" in err
    # the model's config names neg, pos: the same refusal without any flag
    code, _, err = _finetune(named_dir, d, tmp_path / "o2", capsys)
    assert code == 2 and f"line {line}, column 'label': '{RARE}' is not one of the 2 public classes" in err
    # integer labels beyond --num-classes
    ints = _write_jsonl(tmp_path / "ints.jsonl", [{"text": "a cat", "label": i % 3, "epsilon": 1} for i in range(9)])
    code, _, err = _finetune(lm_dir, ints, tmp_path / "o3", capsys, "--num-classes", "2")
    assert code == 2 and "ints.jsonl, line 3, column 'label': 2 is not one of the 2 public classes (0, 1" in err
    # the evaluation data: the same set
    dp = _write_jsonl(tmp_path / "dp.jsonl", _text_rows(rare=False))
    ev = _write_jsonl(tmp_path / "ev.jsonl", [{"text": "a cat", "label": "pos"}, {"text": "a dog", "label": "maybe"}])
    code, _, err = _finetune(lm_dir, dp, tmp_path / "o4", capsys, "--labels", "neg,pos", "--eval-data", str(ev))
    assert code == 2 and "ev.jsonl, line 2, column 'label': 'maybe' is not one of the 2 public classes" in err
    for k in range(1, 5):
        assert not (tmp_path / f"o{k}").exists()


def test_finetune_class_flags_are_checked(lm_dir, named_dir, tmp_path, capsys):
    dp = _write_jsonl(tmp_path / "dp.jsonl", _text_rows(rare=False))
    cases = [
        ((lm_dir, "--labels", "neg"), "--labels='neg' is invalid: classification needs at least 2 classes"),
        ((lm_dir, "--labels", "neg,neg"), "names class 'neg' twice"),
        ((lm_dir, "--labels", "neg,,pos"), "must be non-empty class names"),
        ((lm_dir, "--num-classes", "1"), "--num-classes=1 is invalid: must be an integer >= 2"),
        ((lm_dir, "--labels", "neg,pos", "--num-classes", "2"), "give the classes one way"),
        ((named_dir, "--labels", "pos,neg"), "differs from the classes the model's config names (neg, pos"),
        ((named_dir, "--num-classes", "3"), "differs from the classes the model's config names"),
    ]
    for (model, *extra), match in cases:
        code, _, err = _finetune(model, dp, tmp_path / "o", capsys, *extra)
        assert code == 2 and match in err, (extra, err)
    assert not (tmp_path / "o").exists()


def test_finetune_budgets_per_class_follow_the_public_set(lm_dir, tmp_path, capsys):
    """D' has no row of class RARE: per-class budgets still need one for it (the public set), and
    class names work as keys."""
    dp = _write_jsonl(
        tmp_path / "dp.jsonl", [{k: v for k, v in r.items() if k != "epsilon"} for r in _text_rows(rare=False)]
    )
    labels = ["--labels", f"neg,pos,{RARE}"]
    code, _, err = _finetune(lm_dir, dp, tmp_path / "o", capsys, *labels, "--budgets-per-class", "neg:1,pos:8")
    assert code == 2 and "has no budget for class(es) [2]" in err, err
    code, _, err = _finetune(
        lm_dir, dp, tmp_path / "o", capsys, *labels, "--budgets-per-class", f"neg:1,pos:8,{RARE}:4,other:2"
    )
    assert code == 2 and "outside the public classes [0, 1, 2]" in err, err
    out = tmp_path / "ok"
    code, _, err = _finetune(lm_dir, dp, out, capsys, *labels, "--budgets-per-class", f"neg:1,1:8,{RARE}:4")
    assert code == 0, err
    r = json.loads((out / "report.json").read_text())
    assert sorted(g["budget"] for g in r["groups"]) == [1.0, 8.0]


def test_finetune_api_takes_the_class_set(lm_dir, tmp_path):
    from idpsgd import Budgets
    from idpsgd.integrations.hf.finetune import FinetuneOptions, finetune
    from idpsgd.integrations.hf.text_data import load_text_data

    data = load_text_data(
        _write_jsonl(tmp_path / "d.jsonl", _text_rows(rare=True)), label_column="label", budget_column="epsilon"
    )
    budgets = Budgets.from_array(data.budgets, 1e-5)
    with pytest.raises(InvalidParameterError, match="--labels a,b,c"):
        finetune(lm_dir, data, budgets, tmp_path / "o", options=FinetuneOptions(epochs=1, batch_size=8, seed=0))
    with pytest.raises(DatasetFileError, match=f"'{RARE}' is not one of the 2 public classes"):
        finetune(lm_dir, data, budgets, tmp_path / "o", options=FinetuneOptions(batch_size=8, labels=("neg", "pos")))
    with pytest.raises(InvalidParameterError, match="num_classes=0 is invalid"):
        FinetuneOptions(num_classes=0)
    report = finetune(
        lm_dir,
        data,
        budgets,
        tmp_path / "run",
        options=FinetuneOptions(epochs=1, batch_size=8, seed=0, labels=["neg", "pos", RARE]),
    )
    assert report["task"] == "sequence_classification"
    assert report["data"]["classes"] == ["neg", "pos", RARE] and report["data"]["classes_from"] == "labels"
    assert len(json.loads((tmp_path / "run" / "model" / "config.json").read_text())["id2label"]) == 3


# --- idpsgd train --dataset csv -------------------------------------------------------------------
def _csv(folder, rare: bool, test_label=None):
    """D (rare=True: one extra training row with the unique label 5) or D'; classes 0, 1 otherwise."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for name, n in (("train", 60), ("test", 20)):
        y = np.arange(n) % 2
        if name == "test" and test_label is not None:
            y[-1] = test_label
        x = rng.normal(size=(n, 3)) + y[:, None]
        rows = ["f0,f1,f2,label"] + [",".join(f"{v:.4f}" for v in x[i]) + f",{y[i]}" for i in range(n)]
        if name == "train" and rare:
            rows.append("9.0,9.0,9.0,5")
        (folder / f"{name}.csv").write_text("\n".join(rows) + "\n")
    return ["--dataset", "csv", "--data-dir", str(folder)]


def _train(data, out, capsys, *extra):
    return _run(
        [
            "train",
            "--method",
            "scale",
            "--budgets",
            "1,3",
            "--fractions",
            "0.5,0.5",
            "--epochs",
            "1",
            "--batch-size",
            "16",
            "--no-progress",
            "--seed",
            "0",
            *data,
            "--out",
            str(out),
            "--json",
            *extra,
        ],
        capsys,
    )


def _released_classes(out):
    r = json.loads((out / "report.json").read_text())
    state = load_torch(out / "model.pt", "model")
    last = [k for k in state if k.endswith("weight")][-1]
    return len(r["per_class_accuracy"]), int(state[last].shape[0])


def test_train_csv_with_num_classes_publishes_the_same_class_count(tmp_path, capsys):
    released = []
    for name in ("d", "d_prime"):
        data = _csv(tmp_path / name, rare=name == "d")
        out = tmp_path / f"out_{name}"
        code, _, err = _train(data, out, capsys, "--num-classes", "6")
        assert code == 0, err
        released.append(_released_classes(out))
    assert released[0] == released[1]
    assert released[0] == (6, 6)


def test_train_csv_without_num_classes_refuses_d_and_d_prime_alike(tmp_path, capsys):
    errors = []
    for name in ("d", "d_prime"):
        code, _, err = _train(_csv(tmp_path / name, rare=name == "d"), tmp_path / f"out_{name}", capsys)
        assert code == 2 and "--num-classes" in err and "required for dataset csv" in err, err
        errors.append(err)
        assert not (tmp_path / f"out_{name}").exists()
    assert errors[0] == errors[1]


def test_train_csv_label_outside_num_classes_is_a_per_row_error(tmp_path, capsys):
    code, _, err = _train(_csv(tmp_path / "d", rare=True), tmp_path / "o", capsys, "--num-classes", "2")
    assert code == 2 and "train.csv, line 62, column 'label': '5' is not a class label" in err, err
    assert "0..1 of --num-classes 2" in err
    code, _, err = _train(_csv(tmp_path / "t", rare=False, test_label=2), tmp_path / "o", capsys, "--num-classes", "2")
    assert code == 2 and "test.csv, line 21, column 'label': '2' is not a class label" in err, err
    assert not (tmp_path / "o").exists()


def test_train_budgets_per_class_follow_num_classes(tmp_path, capsys):
    data = _csv(tmp_path / "d", rare=False)  # classes 0 and 1 only in the rows
    per_class = ["--budgets-per-class", "0:1,1:3"]
    argv = list(data)
    code, _, err = _run(
        [
            "train",
            "--method",
            "scale",
            *per_class,
            *argv,
            "--num-classes",
            "3",
            "--epochs",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 2 and "has no budget for class(es) [2]" in err, err
    code, _, err = _run(
        [
            "train",
            "--method",
            "scale",
            "--budgets-per-class",
            "0:1,1:3,2:2,3:2",
            *argv,
            "--num-classes",
            "3",
            "--epochs",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 2 and "outside the public classes [0, 1, 2]" in err, err
    assert not (tmp_path / "o").exists()


def test_load_dataset_num_classes(tmp_path):
    _csv(tmp_path / "d", rare=True)
    with pytest.raises(InvalidParameterError, match="num_classes=None is invalid: is required for dataset csv"):
        load_dataset("csv", tmp_path / "d")
    d = load_dataset("csv", tmp_path / "d", num_classes=7)
    assert d.num_classes == 7 and d.source["num_classes"] == 7
    with pytest.raises(DatasetFileError, match=re.escape("line 62, column 'label': '5' is not a class label")):
        load_dataset("csv", tmp_path / "d", num_classes=3)
    for bad in (1, True, 2.5, "3"):
        with pytest.raises(InvalidParameterError, match="num_classes="):
            load_dataset("csv", tmp_path / "d", num_classes=bad)
    assert load_dataset("digits", num_classes=10).num_classes == 10
    with pytest.raises(InvalidParameterError, match="dataset 'digits' has 10 classes"):
        load_dataset("digits", num_classes=3)


# --- the Trainer exposes and saves public values only --------------------------------------------
def _public_files(out):
    return [p for p in out.rglob("*") if p.is_file() and PRIVATE not in p.relative_to(out).parts]


def _trainer_run(tok, tmp_path, name, data_seed):  # noqa: F811
    train = _lm_data(tok, 40, seed=data_seed)
    privacy = PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=3 + data_seed)
    t = _trainer(tok, _llama(tok), train, tmp_path / name, privacy=privacy, logging_steps=1)
    out = t.train()
    t.save_state()
    t.save_metrics("train", out.metrics)
    t.log_metrics("train", out.metrics)
    return t, out


TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def _strip_timing(value):
    if isinstance(value, dict):
        return {k: _strip_timing(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [_strip_timing(v) for v in value]
    return value


def test_trainer_exposes_and_saves_no_real_batch_value(tok, tmp_path):  # noqa: F811
    runs = [_trainer_run(tok, tmp_path, name, seed) for name, seed in (("a", 0), ("b", 1))]
    ledgers = []
    for (t, out), name in zip(runs, "ab", strict=True):
        folder = tmp_path / name
        loss, flos = t.private_metrics["train_loss"], t.private_metrics["total_flos"]
        assert loss > 0 and flos > 0  # the private values exist (and are kept privately)
        assert out.training_loss is None and t.state.total_flos == 0
        assert set(out.metrics) == set(TIMING)
        runtime, steps = out.metrics["train_runtime"], t.state.global_step
        assert out.metrics["train_samples_per_second"] == round(t.expected_batch_size * steps / runtime, 3)
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["total_flos"] == 0 and state["num_input_tokens_seen"] == 0
        assert not any("loss" in k for h in state["log_history"] for k in h)
        saved = json.loads((folder / "train_results.json").read_text())
        assert set(saved) == set(TIMING) and json.loads((folder / "all_results.json").read_text()) == saved
        # no public file holds the real loss or FLOPs (as JSON writes them, or rounded)
        needles = {json.dumps(loss), json.dumps(float(flos)), f"{loss:.4f}", f"{flos:.6g}", '"train_loss"', '"loss"'}
        for p in _public_files(folder):
            if p.suffix in (".json", ".html", ".csv", ".txt", ".md"):
                text = p.read_text(errors="replace")
                hits = [n for n in needles if n in text]
                assert not hits, (p, hits)
        manifest = json.loads((folder / "outputs.json").read_text())["files"]
        assert manifest["trainer_state.json"]["kind"] == "public"
        assert manifest["train_results.json"]["kind"] == "public"
        ledgers.append((folder / PRIVATE / "ledger.csv").read_text())
    assert ledgers[0] != ledgers[1]  # different real batch draws (sizes) ...
    a, b = (tmp_path / "a"), (tmp_path / "b")
    for name in ("trainer_state.json", "train_results.json", "all_results.json"):
        # ... and the same public state and metrics (but for the wall-clock timing)
        assert _strip_timing(json.loads((a / name).read_text())) == _strip_timing(json.loads((b / name).read_text()))


def test_save_metrics_routes_private_keys_to_private(tok, tmp_path):  # noqa: F811
    t = _trainer(tok, _llama(tok), _lm_data(tok, 24), tmp_path / "run")
    t.train()
    t.save_metrics("train", {"train_loss": 1.234, "train_mem_cpu_peaked_delta": 77, "eval_loss": 2.5, "epoch": 1.0})
    public = json.loads((tmp_path / "run" / "train_results.json").read_text())
    assert public == {"eval_loss": 2.5, "epoch": 1.0}
    private = tmp_path / "run" / PRIVATE / "train_results.json"
    assert json.loads(private.read_text()) == {"train_loss": 1.234, "train_mem_cpu_peaked_delta": 77}
    assert file_mode(private) == 0o600


def test_the_trainer_refuses_labels_outside_the_models_classes(tok, tmp_path):  # noqa: F811
    """IndividualizedTrainer: the class set is the model's config (public); a training or evaluation
    label outside it is refused before any work (on main: an IndexError in the first step, or for
    evaluation a longer per_class_accuracy)."""
    import datasets
    from transformers import DataCollatorWithPadding, TrainingArguments

    from idpsgd.integrations.hf import IndividualizedTrainer

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(_llama_config(tok, num_labels=2))
    enc = tok(_lines(12, seed=2), truncation=True, max_length=16)

    def ds(labels):
        return datasets.Dataset.from_dict(
            {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
        )

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, save_strategy="no", use_cpu=True, report_to=[]
    )
    good, bad = [i % 2 for i in range(12)], [i % 2 for i in range(11)] + [2]
    for train, evaluation, flag in ((bad, good, "train_dataset"), (good, bad, "eval_dataset")):
        with pytest.raises(InvalidParameterError, match=rf"{flag}='row 11: labels 2' is invalid: labels are the class"):
            IndividualizedTrainer(
                model=model,
                args=args,
                train_dataset=ds(train),
                eval_dataset=ds(evaluation),
                processing_class=tok,
                data_collator=DataCollatorWithPadding(tok),
                privacy=PrivacyArguments(budgets=np.full(12, 4.0), delta=1e-5, method="scale", seed=1),
            )
    assert not (tmp_path / "run").exists()
