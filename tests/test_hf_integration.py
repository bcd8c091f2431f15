"""Hugging Face integration (issue 30, items 6 and 8): the private Trainer, the per-example loss
convention, the ``finetune`` command, the example.  Tiny models built from configs and a word-level
tokenizer trained here: no download."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import datasets
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    TrainingArguments,
)

from hf_text import WORDS, word_tokenizer
from idpsgd import Budgets, InvalidParameterError
from idpsgd.cli.main import main
from idpsgd.integrations.hf import IndividualizedTrainer, PerExampleLoss, PrivacyArguments
from support import file_mode

ROOT = Path(__file__).resolve().parents[1]
# the engine's SparseSamplingWarning where a tiny run gives Sample's strict group few expected draws (not the point)
SPARSE_SAMPLE = "ignore:method sample. the examples of budget.s. 1 are expected to be sampled fewer:UserWarning"


def _lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(_lines(200))


def _llama_config(tok, **kw):
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        **kw,
    )


def _llama(tok, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config(tok))


def _lm_data(tok, n, seed=0, budgets=(1.0, 8.0)):
    enc = tok(_lines(n, seed), truncation=True, max_length=16)
    eps = np.where(np.arange(n) % 2 == 0, budgets[0], budgets[1])
    return datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "epsilon": eps}
    )


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        learning_rate=1e-2,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=2,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


def _trainer(tok, model, train, out, privacy=None, **kw):
    kwargs = {k: kw.pop(k) for k in ("eval_dataset", "per_example_loss") if k in kw}
    return IndividualizedTrainer(
        model=model,
        args=_args(out, **kw),
        train_dataset=train,
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        privacy=privacy or PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=3),
        **kwargs,
    )


def test_trainer_end_to_end_budgets_from_a_column(tok, tmp_path):
    """Two consent groups (ε = 1, 8) from a Dataset column: ε per group in the logs and the report, each
    within its budget; the budget column never reaches the model; public/private run folder; the
    saved model loads back and equals the trained one."""
    train, test = _lm_data(tok, 48), _lm_data(tok, 16, seed=1).remove_columns(["epsilon"])
    model = _llama(tok)
    out = tmp_path / "run"
    t = _trainer(
        tok,
        model,
        train,
        out,
        eval_dataset=test,
        num_train_epochs=2,
        eval_strategy="epoch",
        remove_unused_columns=False,
    )  # the budget column would reach forward() if it were kept
    t.train()
    logs = t.state.log_history
    eps_logs = [h for h in logs if "epsilon" in h]
    assert eps_logs and all({"epsilon_group_1", "epsilon_group_8"} <= set(h) for h in eps_logs)
    assert any("eval_loss" in h for h in logs)
    private_keys = {"loss", "train_loss", "grad_norm", "total_flos", "num_input_tokens_seen"}
    assert not any(private_keys & set(h) for h in logs)  # kept out of the Trainer's logs
    assert any("loss" in h for h in t.private_logs)  # ... and kept privately
    last = eps_logs[-1]
    assert last["epsilon_group_1"] <= 1.0 and last["epsilon_group_8"] <= 8.0
    assert last["epsilon_group_1"] > 0.9 and last["epsilon_group_8"] > 7.2  # the plan spends the budgets
    assert last["epsilon"] == max(last["epsilon_group_1"], last["epsilon_group_8"])
    r = json.loads((out / "report.json").read_text())
    assert [g["budget"] for g in r["groups"]] == [1.0, 8.0] and [g["count"] for g in r["groups"]] == [24, 24]
    assert all(g["epsilon_spent"] <= g["budget"] for g in r["groups"])
    assert r["steps"] == r["planned_steps"] == 12 and not r["stopped_early"]
    assert r["task"] == "causal_lm" and r["test_metrics"]["test_perplexity"] > 1
    assert "seed" not in r and "private" not in r and r["grad_sample_mode"] == "bk"
    assert r["secure_mode"] is False and "private/seed.json" in r["randomness"]
    assert "seed 3" not in (out / "report.html").read_text()
    assert set(r["files"]) == {
        "model",
        "report.json",
        "report.html",
        "private/epsilons.csv",
        "private/ledger.csv",
        "private/history.json",
        "private/seed.json",
        "private/drawn_steps.jsonl",  # every noise draw, before it is drawn (issue 53)
    }
    for name in ("report.json", "report.html", "model/config.json", "model/model.safetensors", "model/tokenizer.json"):
        assert file_mode(out / name) == 0o644, name
    assert file_mode(out / "model") == 0o755 and file_mode(out / "private") == 0o700
    for name in ("epsilons.csv", "ledger.csv", "history.json", "seed.json", "drawn_steps.jsonl"):
        assert file_mode(out / "private" / name) == 0o600, name
    assert json.loads((out / "private" / "seed.json").read_text())["seed"] == 3
    rows = np.genfromtxt(out / "private" / "epsilons.csv", delimiter=",", names=True)
    assert np.array_equal(rows["budget"], np.asarray(train["epsilon"])) and np.all(rows["epsilon"] <= rows["budget"])
    ledger = np.genfromtxt(out / "private" / "ledger.csv", delimiter=",", names=True)
    assert ledger["step"].tolist() == list(range(1, 13))
    html = (out / "report.html").read_text()
    assert "perplexity" in html and "within budget" in html
    loaded = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    for (name, a), b in zip(t.model.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert not torch.equal(loaded.lm_head.weight, _llama(tok).lm_head.weight)  # it trained
    assert AutoTokenizer.from_pretrained(out / "model").vocab_size == tok.vocab_size
    assert "_idpsgd_bookkeeper" not in t.model.__dict__  # the model is plain again
    assert t.layer_paths and not any("fallback" in path for path in t.layer_paths.values())


def test_the_noise_never_follows_the_trainers_public_seed(tok, tmp_path):
    """TrainingArguments.seed (42 by default) seeds torch's global RNG; without a privacy seed the
    engine's sampling and noise come from OS entropy instead — two runs with the same public seed
    differ — and the seed used is recorded privately."""
    seeds, params = [], []
    for k in range(2):
        model = _llama(tok)
        t = _trainer(
            tok,
            model,
            _lm_data(tok, 16),
            tmp_path / f"r{k}",
            max_steps=2,
            seed=42,
            privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale"),
        )
        t.train()
        seeds.append(t.engine.seed)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert json.loads((tmp_path / f"r{k}" / "private" / "seed.json").read_text())["seed"] == t.engine.seed
    assert None not in seeds and seeds[0] != seeds[1]
    assert not torch.equal(params[0], params[1])


def test_each_examples_gradient_is_that_of_its_own_loss(tok, tmp_path):
    """The per-example gradient the engine clips is ∇ℓ_i with ℓ_i the mean over example i's tokens — not
    a share of the Hugging Face mean over the batch's tokens, which would depend on the others' lengths:
    the norms equal per-example autograd and do not change when a long example joins the batch."""
    base = _lm_data(tok, 6, seed=2)
    long_one = tok(" ".join(["privacy budget"] * 7), truncation=True, max_length=16)
    grown = datasets.concatenate_datasets(
        [
            base,
            datasets.Dataset.from_dict(
                {"input_ids": [long_one["input_ids"]], "attention_mask": [long_one["attention_mask"]], "epsilon": [8.0]}
            ),
        ]
    )
    model0 = _llama(tok).double()
    collate = DataCollatorForLanguageModeling(tok, mlm=False)
    loss_fn = PerExampleLoss("causal_lm")
    batch = collate([{k: base[i][k] for k in ("input_ids", "attention_mask")} for i in range(len(base))])
    assert len(set((batch["labels"] != -100).sum(1).tolist())) > 1  # lengths differ: HF's mean would matter
    ref = []
    for i in range(len(base)):
        model0.zero_grad()
        out = model0(input_ids=batch["input_ids"][i : i + 1], attention_mask=batch["attention_mask"][i : i + 1])
        loss_fn(out, batch["labels"][i : i + 1]).sum().backward()
        ref.append(torch.sqrt(sum((p.grad**2).sum() for p in model0.parameters())))
    ref = torch.stack(ref)
    norms = {}
    for name, data in (("base", base), ("grown", grown)):
        t = _trainer(
            tok,
            copy.deepcopy(model0),
            data,
            tmp_path / name,
            per_device_train_batch_size=len(data),
            max_steps=1,
            optim="sgd",
            logging_steps=1,
        )  # rate 1: every example in the batch
        t.train()
        opt = t.dp_optimizer
        assert opt.last_indices.tolist() == list(range(len(data)))
        norms[name] = opt.last_norms.detach()
    # LlamaRMSNorm computes in float32 even in a float64 model: agreement to float32 rounding
    torch.testing.assert_close(norms["base"], ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(norms["grown"][: len(base)], ref, rtol=1e-6, atol=1e-9)
    # the Hugging Face loss (mean over the batch's tokens) would scale example i's gradient by B·T_i/ΣT, which
    # the long example changes for every other example by far more than that tolerance:
    tokens = (batch["labels"] != -100).sum().item()
    long_tokens = len(long_one["input_ids"]) - 1
    assert abs((len(grown) / (tokens + long_tokens)) / (len(base) / tokens) - 1) > 0.05


def test_gradient_accumulation_is_physical_batches_of_one_step(tok, tmp_path):
    """per_device_train_batch_size × gradient_accumulation_steps is the expected batch; each Poisson batch
    runs in physical parts of at most per_device_train_batch_size rows and is one DP-SGD step: the same
    run (same privacy seed) as one forward pass per batch."""
    train = _lm_data(tok, 32)
    model0 = _llama(tok).double()
    results, seen = {}, []
    for name, (per_device, accum) in {"one": (8, 1), "parts": (2, 4)}.items():
        model = copy.deepcopy(model0)
        if name == "parts":
            model.model.embed_tokens.register_forward_pre_hook(
                lambda m, a: seen.append(a[0].shape[0]) if torch.is_grad_enabled() else None
            )
        t = _trainer(
            tok,
            model,
            train,
            tmp_path / name,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accum,
            num_train_epochs=2,
            optim="sgd",
        )
        t.train()
        results[name] = (
            torch.cat([p.detach().flatten() for p in model.parameters()]),
            t.state.global_step,
            [row[1] for row in t.ledger_rows],
            t.report["groups"],
        )
    assert results["one"][1] == results["parts"][1] == 8
    assert results["one"][2] == results["parts"][2] and max(results["one"][2]) > 2
    assert seen and max(seen) <= 2
    # float64 model; LlamaRMSNorm's float32 internals see other padding in the parts: float32 rounding
    torch.testing.assert_close(results["one"][0], results["parts"][0], rtol=1e-6, atol=1e-9)
    assert results["one"][3] == results["parts"][3]


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_bf16_autocast(tok, tmp_path, mode):
    """bf16=True: the forward runs under bfloat16 autocast (accelerate's), the parameters stay float32,
    and the per-example norms the engine clips are those of float32 to bfloat16's precision."""
    train = _lm_data(tok, 16)
    norms, dtypes = {}, []
    for bf16 in (False, True):
        model = _llama(tok)
        if bf16:
            model.model.layers[0].self_attn.q_proj.register_forward_hook(
                lambda m, i, o: dtypes.append(o.dtype) if torch.is_grad_enabled() else None
            )
        t = _trainer(
            tok,
            model,
            train,
            tmp_path / f"{mode}{bf16}",
            per_device_train_batch_size=16,
            max_steps=1,
            bf16=bf16,
            privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=5, grad_sample_mode=mode),
        )
        t.train()
        norms[bf16] = t.dp_optimizer.last_norms.detach().float()
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert dtypes and set(dtypes) == {torch.bfloat16}
    torch.testing.assert_close(norms[True], norms[False], rtol=3e-2, atol=1e-3)


def test_empty_poisson_batches_are_noise_only_steps(tok, tmp_path):
    """Expected batch size 1: many batches are empty; the model never sees zero rows (transformers
    cannot run them) and every step is taken and charged."""
    t = _trainer(tok, _llama(tok), _lm_data(tok, 24), tmp_path / "run", per_device_train_batch_size=1)
    t.train()
    sizes = [row[1] for row in t.ledger_rows]
    assert len(sizes) == 24 == t.engine.steps == t.state.global_step and 0 in sizes
    assert t.report["groups"][0]["epsilon_spent"] <= 1.0


@pytest.mark.filterwarnings(SPARSE_SAMPLE)
def test_the_filter_stops_the_run_before_a_step_beyond_the_budgets(tok, tmp_path):
    """Should the Trainer want more steps than the budgets were calibrated for, the run stops before the
    step that would exceed them (the engine's filter), and the report says so."""

    class Short(IndividualizedTrainer):
        def planned_steps_for(self, per_epoch):
            return 3

    t = Short(
        model=_llama(tok),
        args=_args(tmp_path / "run", num_train_epochs=2),
        train_dataset=_lm_data(tok, 32),
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="sample", seed=0),
    )
    t.train()
    assert t.state.global_step == 3 == t.engine.steps and t.stopped_early
    r = json.loads((tmp_path / "run" / "report.json").read_text())
    assert r["stopped_early"] and all(g["epsilon_spent"] <= g["budget"] for g in r["groups"])


@pytest.mark.parametrize(("arch", "mode"), [("llama", "hooks"), ("bert", "bk")])
def test_a_classifier_with_an_array_of_budgets(tok, tmp_path, arch, mode):
    """Sequence classification (per-example cross-entropy), budgets as an array; accuracy and per-class
    accuracy in the report."""
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForSequenceClassification(_llama_config(tok, num_labels=2))
    else:
        from transformers import BertConfig, BertForSequenceClassification

        model = BertForSequenceClassification(
            BertConfig(
                vocab_size=tok.vocab_size,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=32,
                num_labels=2,
            )
        )
    lines = _lines(40, seed=4)
    enc = tok(lines, truncation=True, max_length=16)
    data = datasets.Dataset.from_dict(
        {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "labels": [int("cat" in s) for s in lines],
        }
    )
    from transformers import DataCollatorWithPadding

    budgets = np.where(np.arange(30) < 10, 2.0, 6.0)
    t = IndividualizedTrainer(
        model=model,
        args=_args(tmp_path / "run"),
        train_dataset=data.select(range(30)),
        eval_dataset=data.select(range(30, 40)),
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        privacy=PrivacyArguments(budgets=budgets, delta=1e-5, method="sample", grad_sample_mode=mode, seed=1),
    )
    t.train()
    r = t.report
    assert r["task"] == "sequence_classification" and 0 <= r["test_accuracy"] <= 1
    assert len(r["per_class_accuracy"]) == 2
    assert [g["count"] for g in r["groups"]] == [10, 20]
    if mode == "bk":
        assert not any("fallback" in path for path in t.layer_paths.values())
    assert all(g["epsilon_spent"] <= g["budget"] for g in r["groups"])


@pytest.mark.filterwarnings(
    "ignore:fan_in_fan_out is set to False:UserWarning",  # peft on GPT-2's Conv1D
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",  # peft calls transformers' old name
)
def test_gpt2_with_lora_trains_in_bk(tok, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=16,
            n_head=2,
            vocab_size=tok.vocab_size,
            n_positions=32,
            bos_token_id=2,
            eos_token_id=2,
            pad_token_id=0,
        )
    )
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, task_type="CAUSAL_LM"))
    t = _trainer(tok, model, _lm_data(tok, 32), tmp_path / "run")
    t.train()
    assert t.report["model"].startswith("GPT2LMHeadModel + LORA")
    assert set(t.layer_paths) and all("lora" in name for name in t.layer_paths)
    assert (tmp_path / "run" / "model" / "adapter_config.json").is_file()


def _gpt2(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=16,
            n_head=2,
            vocab_size=tok.vocab_size,
            n_positions=32,
            bos_token_id=2,
            eos_token_id=2,
            pad_token_id=0,
        )
    )


@pytest.fixture(scope="module")
def tied_gpt2_run(tok, tmp_path_factory):
    t = _trainer(tok, _gpt2(tok), _lm_data(tok, 32), tmp_path_factory.mktemp("gpt2") / "run")
    t.train()
    return t


def test_tied_gpt2_full_fine_tuning(tied_gpt2_run):
    """GPT-2 with its tied wte/lm_head and broadcast position embeddings, every weight trained in bk."""
    t = tied_gpt2_run
    assert t.model.lm_head.weight is t.model.transformer.wte.weight
    assert "tied with 'lm_head'" in t.layer_paths["transformer.wte"]
    assert all(g["epsilon_spent"] <= g["budget"] for g in t.report["groups"])


def test_tied_gpt2_has_no_fallback_layer(tied_gpt2_run):
    assert "Opacus per-sample gradient (fallback)" not in tied_gpt2_run.layer_paths.values()


def test_what_the_trainer_cannot_honour_is_refused(tok, tmp_path):
    train = _lm_data(tok, 16)
    good = PrivacyArguments(budgets="epsilon", delta=1e-5)

    def make(privacy=good, data=train, model=None, **kw):
        extra = {k: kw.pop(k) for k in ("model_init", "compute_loss_func") if k in kw}
        return IndividualizedTrainer(
            model=model or _llama(tok),
            args=_args(tmp_path / "r", **kw),
            train_dataset=data,
            privacy=privacy,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            **extra,
        )

    cases = [
        (dict(fp16=True), "fp16=True is invalid: on cpu: accelerate runs neither float16 autocast nor a GradScaler"),
        (dict(save_strategy="best"), "save_strategy='best' is invalid: must be 'no', 'steps' or 'epoch'"),
        (dict(max_grad_norm=0.0), "max_grad_norm=0.0 is invalid: must be > 0"),
        (dict(per_device_train_batch_size=17), "must be <= the 16 training examples"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1 is invalid"),
        (dict(privacy=PrivacyArguments(budgets="eps", delta=1e-5)), "budgets='eps' is invalid: is not a column"),
        (dict(privacy=PrivacyArguments(budgets="input_ids", delta=1e-5)), "the column must hold numbers"),
        (dict(privacy=PrivacyArguments(budgets=[1.0] * 15, delta=1e-5)), "need one per training example (16)"),
        (dict(privacy=PrivacyArguments(budgets=[1.0] * 16)), "delta=None is invalid: is required"),
        (dict(privacy=PrivacyArguments(budgets=[-1.0] * 16, delta=1e-5)), "budgets=-1.0 is invalid"),
        (dict(model_init=lambda: None), "model_init="),
        (dict(compute_loss_func=lambda *a, **k: 0), "give per_example_loss"),
        (dict(model=torch.nn.Linear(2, 2)), "has no known per-example loss"),
    ]
    for kw, match in cases:
        with pytest.raises(InvalidParameterError, match=match.replace("(", r"\(").replace(")", r"\)")):
            make(**kw)
    ghost = PrivacyArguments(budgets="epsilon", delta=1e-5, grad_sample_mode="ghost")
    with pytest.raises(InvalidParameterError, match="checkpointing=True is invalid: .*grad_sample_mode='ghost'"):
        make(activation_checkpointing=True, privacy=ghost)
    with pytest.raises(InvalidParameterError, match="method='exclude' is invalid"):
        PrivacyArguments(budgets="epsilon", delta=1e-5, method="exclude")
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())  # refused runs leave nothing
    t = make(privacy=PrivacyArguments(budgets=Budgets.from_array(np.full(16, 4.0), 1e-5)))
    with pytest.raises(InvalidParameterError, match="resume_from_checkpoint=True is invalid: .* holds no checkpoint"):
        t.train(resume_from_checkpoint=True)
    t.train()
    with pytest.raises(RuntimeError, match="trains once"):
        t.train()


# --- the finetune command ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "model"
    _llama(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_finetune_jsonl_causal_lm_with_a_budget_column(model_dir, tmp_path, capsys):
    lines = _lines(40, seed=5)
    train = _write_jsonl(
        tmp_path / "train.jsonl", [{"text": s, "epsilon": 1.0 if i % 2 else 8.0} for i, s in enumerate(lines[:32])]
    )
    test = _write_jsonl(tmp_path / "test.jsonl", [{"text": s} for s in lines[32:]])
    out = tmp_path / "run"
    code, stdout, err = _run(
        [
            "finetune",
            "--model",
            str(model_dir),
            "--data",
            str(train),
            "--eval-data",
            str(test),
            "--method",
            "scale",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--physical-batch-size",
            "4",
            "--lr",
            "1e-2",
            "--seed",
            "0",
            "--out",
            str(out),
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    r = json.loads(stdout)  # stdout is the command's JSON only
    assert r["task"] == "causal_lm" and r["physical_batch_size"] == 4 and r["batch_size"] == 8
    assert [g["budget"] for g in r["groups"]] == [1.0, 8.0] and all(
        g["epsilon_spent"] <= g["budget"] for g in r["groups"]
    )
    assert r["data"]["train"]["budget_column"] == "epsilon" and r["test_metrics"]["test_perplexity"] > 1
    assert "private" not in r and "seed" not in r
    assert "test_accuracy" not in r and "per_class_accuracy" not in r  # a language model: omitted, not null / []
    assert (out / "model" / "config.json").is_file() and (out / "private" / "epsilons.csv").is_file()
    assert AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True) is not None


@pytest.mark.filterwarnings(SPARSE_SAMPLE)
def test_finetune_csv_classifier_with_group_flags(model_dir, tmp_path, capsys):
    lines = _lines(40, seed=6)
    rows = ["text,label"] + [f"{s},{'pos' if 'cat' in s else 'neg'}" for s in lines]
    (tmp_path / "train.csv").write_text("\n".join(rows[:31]) + "\n")
    (tmp_path / "test.csv").write_text("\n".join([rows[0], *rows[31:]]) + "\n")
    out = tmp_path / "run"
    code, stdout, err = _run(
        [
            "finetune",
            "--model",
            str(model_dir),
            "--data",
            str(tmp_path / "train.csv"),
            "--eval-data",
            str(tmp_path / "test.csv"),
            "--label-column",
            "label",
            "--labels",
            "neg,pos",
            "--method",
            "sample",
            "--budgets",
            "1,8",
            "--fractions",
            "0.5,0.5",
            "--epochs",
            "1",
            "--batch-size",
            "6",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    assert "finetune (sample, sequence_classification)" in stdout and "test accuracy" in stdout
    r = json.loads((out / "report.json").read_text())
    assert [g["count"] for g in r["groups"]] == [15, 15] and r["model"] == "LlamaForSequenceClassification"
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["id2label"] == {"0": "neg", "1": "pos"}


def test_finetune_aligns_special_tokens_before_the_trainer_so_it_does_not_warn(model_dir):
    """Issue 38: transformers' "The tokenizer has new PAD/BOS/EOS tokens ..." was logged on every run."""
    import logging

    from transformers.trainer_utils import align_special_tokens

    from idpsgd.integrations.hf.finetune import align_special_tokens_quietly, load_model, load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, "causal_lm", None, tok.pad_token_id)
    align_special_tokens_quietly(model, tok)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.trainer_utils")
    logger.addHandler(handler)
    try:
        align_special_tokens(model, tok)  # what the Trainer calls: nothing left to align, nothing logged
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "PAD/BOS/EOS" in r.getMessage()]
    assert model.config.pad_token_id == tok.pad_token_id


def test_finetune_bad_inputs(model_dir, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": s, "epsilon": 2.0} for s in _lines(12)])
    no_tok = tmp_path / "notok"
    _llama(AutoTokenizer.from_pretrained(model_dir)).save_pretrained(no_tok)
    bad_eps = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "a cat", "epsilon": "x"}])
    no_text = _write_jsonl(tmp_path / "notext.jsonl", [{"body": "a cat", "epsilon": 1}])
    plain = _write_jsonl(tmp_path / "plain.jsonl", [{"text": s} for s in _lines(12)])
    base = ["finetune", "--method", "scale", "--out", str(tmp_path / "o")]
    cases = [
        (["--model", str(tmp_path / "missing"), "--data", str(data)], "--model="),
        (["--model", str(no_tok), "--data", str(data)], "has no tokenizer"),
        (["--model", str(model_dir), "--data", str(tmp_path / "none.jsonl")], "--data="),
        (["--model", str(model_dir), "--data", str(tmp_path / "d.txt")], "--data="),
        (["--model", str(model_dir), "--data", str(bad_eps)], "line 1, column 'epsilon': 'x' is not a budget"),
        (["--model", str(model_dir), "--data", str(no_text)], "no column 'text'"),
        (
            # the column named explicitly (unnamed, --budgets wins over the default epsilon column: issue 48)
            ["--model", str(model_dir), "--data", str(data), "--budget-column", "epsilon", "--budgets", "1,2"],
            "give the budgets one way",
        ),
        (
            ["--model", str(model_dir), "--data", str(plain)],
            "--budget-column='epsilon' is invalid: is not a column of --data",
        ),
        (
            ["--model", str(model_dir), "--data", str(data), "--batch-size", "6", "--physical-batch-size", "4"],
            "--physical-batch-size=4 is invalid: must divide",
        ),
        (["--model", str(model_dir), "--data", str(data), "--label-column", "label"], "no column 'label'"),
    ]
    for extra, match in cases:
        code, _, err = _run(base + extra, capsys)
        assert code == 2 and match in err, (extra, err)
    assert not (tmp_path / "o").exists()


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_finetune_gpt2", ROOT / "examples" / "hf_finetune_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings(
    "ignore:fan_in_fan_out is set to False:UserWarning",  # peft on GPT-2's Conv1D
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",  # peft calls transformers' old name
)
def test_example_tiny_with_lora(tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    monkeypatch.setenv("IDPSGD_EXAMPLE_TINY", "1")
    report = _example().main(["--out", str(tmp_path / "run"), "--lora-r", "4"])
    out = capsys.readouterr().out
    assert "group with budget 1: " in out and "group with budget 8: " in out and "test perplexity" in out
    assert [g["budget"] for g in report["groups"]] == [1.0, 8.0]
    assert all(g["epsilon_spent"] <= g["budget"] for g in report["groups"])
    assert (tmp_path / "run" / "report.json").is_file()


def test_example_tiny_full_fine_tuning(tmp_path, capsys):
    report = _example().main(["--tiny", "--out", str(tmp_path / "run")])
    assert "test perplexity" in capsys.readouterr().out and report["steps"] > 0


@pytest.mark.slow  # fast twins: test_examples.py runs the script in a fresh process (its output checked there too)
def test_example_script_runs_as_a_command(tmp_path):  # and test_example_tiny_with_lora the LoRA path, in this one
    """The example as users run it (a fresh process, the tiny setting from the environment), with LoRA."""
    env = {**os.environ, "IDPSGD_EXAMPLE_TINY": "1", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "hf_finetune_gpt2.py"),
            "--lora-r",
            "2",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "group with budget 1" in proc.stdout and "test perplexity" in proc.stdout


def test_finetune_keeps_its_seed_private(model_dir, tmp_path, capsys):
    """Issue 29's search over every public output (test_seed_private), for ``idpsgd finetune --seed S``,
    with private checkpoints (``--save-every``) and a ``--resume`` from them (issue 40)."""
    from support import mode_problems
    from test_seed_private import S, seed_leaks

    lines = _lines(24, seed=6)
    train = _write_jsonl(
        tmp_path / "train.jsonl", [{"text": s, "epsilon": 1.0 if i % 2 else 8.0} for i, s in enumerate(lines[:16])]
    )
    test = _write_jsonl(tmp_path / "test.jsonl", [{"text": s} for s in lines[16:]])
    out = tmp_path / "run"
    code, stdout, err = _run(
        [
            "finetune",
            "--model",
            str(model_dir),
            "--data",
            str(train),
            "--eval-data",
            str(test),
            "--method",
            "scale",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--seed",
            str(S),
            "--save-every",
            "1",
            "--out",
            str(out),
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    assert json.loads((out / "private" / "seed.json").read_text())["seed"] == S
    assert sorted(p.name for p in (out / "private").glob("checkpoint-*.pt")) == ["checkpoint-1.pt", "checkpoint-2.pt"]
    assert seed_leaks(out, stdout + err) == [] and mode_problems(out) == []
    from idpsgd.engine.budget.journal import (
        read_records,  # every draw recorded (issue 53); private, 0600 (mode_problems)
    )

    assert [r["step"] for r in read_records(out / "private" / "drawn_steps.jsonl")] == [1, 2]
    assert "private/drawn_steps.jsonl" in json.loads((out / "outputs.json").read_text())["files"]
    argv = ["finetune", "--model", str(model_dir), "--data", str(train), "--eval-data", str(test)]
    argv += ["--method", "scale", "--epochs", "1", "--batch-size", "8", "--save-every", "1", "--out", str(out)]
    code, stdout2, err2 = _run([*argv, "--resume"], capsys)  # no --seed: the checkpoint's, never printed
    assert code == 0, err2
    report = json.loads((out / "report.json").read_text())  # the finished run's resume draws nothing more
    assert (report["steps_kept"], report["steps_charged"]) == (2, 2)
    assert json.loads((out / "private" / "seed.json").read_text())["seed"] == S
    assert seed_leaks(out, stdout2 + err2) == [] and mode_problems(out) == []
