"""Long fine-tuning runs with the private Trainer (issue 40): private checkpoints and exact resume,
several processes, gradient checkpointing, fp16.  Tiny models from configs, a word-level tokenizer
trained here: no download."""

import json
import os
import shutil
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
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
)

from hf_text import word_tokenizer
from idpsgd import InvalidParameterError
from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments
from idpsgd.io import CheckpointError
from support import file_mode, independent_epsilons

# transformers' own calls to its deprecated gradient-checkpointing names
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat", "on", "mat", "privacy"]
ROOT = Path(__file__).resolve().parents[1]


def _lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(_lines(200))


def _gpt2(tok, seed=0):
    """GPT-2 with its dropout (0.1): a resumed run must restore the global RNG states too."""
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=tok.vocab_size, n_embd=16, n_layer=2, n_head=2, n_positions=32, pad_token_id=tok.pad_token_id
    )
    return GPT2LMHeadModel(cfg)


def _data(tok, n, seed=0):
    enc = tok(_lines(n, seed), truncation=True, max_length=16)
    eps = np.where(np.arange(n) % 2 == 0, 1.0, 8.0)
    return datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "epsilon": eps}
    )


def _trainer(tok, out, train=None, privacy=None, callbacks=None, eval_dataset=None, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=4,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=2,
        seed=0,
    )
    return IndividualizedTrainer(
        model=_gpt2(tok),
        args=TrainingArguments(**{**base, **kw}),
        train_dataset=train if train is not None else _data(tok, 48),
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        privacy=privacy or PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=3),
        callbacks=callbacks,
        eval_dataset=eval_dataset,
    )


class _Crash(TrainerCallback):
    """Dies (an exception, as a crash would) at the end of step ``at``."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt(f"crash at step {self.at}")


def _die_while_writing(monkeypatch, name):
    """The process dies half-way through writing ``name`` (after the data, before the rename)."""
    import idpsgd.io

    def fault(point):
        if point == name:
            raise KeyboardInterrupt(f"killed while writing {name}")

    monkeypatch.setattr(idpsgd.io, "fault_point", fault)


def _params(t):
    return torch.cat([p.detach().flatten() for p in t.model.parameters()])


@pytest.fixture(scope="module")
def full_run(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    t = _trainer(tok, out)
    t.train()
    return t, out


@pytest.mark.parametrize("crash", ["step 6", "writing checkpoint 8"])
def test_a_run_killed_after_a_checkpoint_resumes_bit_equal(tok, tmp_path, full_run, monkeypatch, crash):
    """12 steps (2 epochs of 6), a checkpoint every 4; the run dies at step 6 (mid-epoch, two steps after
    its last checkpoint) or while writing checkpoint 8, and a new trainer resumes from checkpoint 4: the
    same parameters (bit-equal), the same ε per group, the same ledger (every step charged exactly once)
    and per-example ε.  (A real SIGKILL: the finetune test below.)"""
    full, full_out = full_run
    out = tmp_path / "cut"
    with monkeypatch.context() as m:
        if crash == "step 6":
            crashing = _trainer(tok, out, callbacks=[_Crash(6)])
        else:
            _die_while_writing(m, "checkpoint-8.pt")
            crashing = _trainer(tok, out)
        with pytest.raises(KeyboardInterrupt):
            crashing.train()
    assert sorted(p.name for p in (out / "private").glob("checkpoint-*.pt")) == ["checkpoint-4.pt"]
    with pytest.raises(InvalidParameterError, match="holds a run with checkpoints"):
        _trainer(tok, out).train()  # not resumed: refused, never silently restarted
    resumed = _trainer(tok, out, privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale"))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == full.state.global_step == 12
    assert torch.equal(_params(resumed), _params(full))
    assert resumed.engine.steps == full.engine.steps == 12
    np.testing.assert_array_equal(resumed.engine.get_epsilon().per_group, full.engine.get_epsilon().per_group)
    for name in ("ledger.csv", "epsilons.csv"):
        assert (out / "private" / name).read_bytes() == (full_out / "private" / name).read_bytes(), name
    public = [h for h in resumed.state.log_history if "train_runtime" not in h]
    assert public == [h for h in full.state.log_history if "train_runtime" not in h]
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, full_out))
    assert a["groups"] == b["groups"] and a["steps"] == b["steps"] == 12


def test_checkpoints_are_private_files_only(full_run):
    """Checkpoints are in private/ with mode 0600; nothing of them (seed, RNG or sampler states,
    losses, batch sizes) is in a public file, and the public files are those of a run without them."""
    _, out = full_run
    names = sorted(p.name for p in (out / "private").glob("checkpoint-*.pt"))
    assert names == ["checkpoint-12.pt", "checkpoint-4.pt", "checkpoint-8.pt"]
    for name in names:
        assert file_mode(out / "private" / name) == 0o600
    public = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and "private" not in p.parts}
    assert not any("checkpoint" in p for p in public if p != "outputs.json")
    manifest = json.loads((out / "outputs.json").read_text())["files"]
    assert {k for k, v in manifest.items() if v["kind"] == "private" and "checkpoint" in k} == {
        f"private/{n}" for n in names
    }
    ckpt = torch.load(out / "private" / "checkpoint-8.pt", weights_only=True)
    assert ckpt["engine"]["seed"] == 3 and "sampler" in ckpt["engine"] and "noise" in ckpt["engine"]
    text = "".join((out / p).read_text(errors="ignore") for p in public if not p.endswith(".safetensors"))
    for secret in ('"seed": 3', "bit_generator", '"loss"', '"train_loss"'):
        assert secret not in text, secret


def test_save_total_limit_keeps_the_latest(tok, tmp_path):
    out = tmp_path / "r"
    _trainer(tok, out, save_total_limit=1, max_steps=4, save_steps=2, num_train_epochs=1).train()
    assert [p.name for p in (out / "private").glob("checkpoint-*.pt")] == ["checkpoint-4.pt"]
    files = json.loads((out / "outputs.json").read_text())["files"]
    assert "private/checkpoint-2.pt" not in files and "private/checkpoint-4.pt" in files


def test_a_checkpoint_of_other_data_budgets_or_settings_is_refused(tok, tmp_path, full_run):
    _, full_out = full_run
    out = tmp_path / "other"
    shutil.copytree(full_out, out)
    other = _data(tok, 48, seed=7)
    with pytest.raises(InvalidParameterError, match=r"other settings or data \(data_sha256 differs\)"):
        _trainer(tok, out, train=other).train(resume_from_checkpoint=True)
    flipped = _data(tok, 48).map(lambda r: {"epsilon": 9.0 - r["epsilon"]})
    with pytest.raises(InvalidParameterError, match="budgets_sha256 differs"):
        _trainer(tok, out, train=flipped).train(resume_from_checkpoint=True)
    with pytest.raises(InvalidParameterError, match="learning_rate: 0.01 -> 0.02"):
        _trainer(tok, out, learning_rate=2e-2).train(resume_from_checkpoint=True)
    with pytest.raises(InvalidParameterError, match="privacy.method: 'scale' -> 'sample'"):
        _trainer(tok, out, privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="sample")).train(
            resume_from_checkpoint=True
        )
    with pytest.raises(InvalidParameterError, match="differs from the seed of the run that wrote the checkpoint"):
        _trainer(tok, out, privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=4)).train(
            resume_from_checkpoint=True
        )
    with pytest.raises(InvalidParameterError, match="resume_from_checkpoint=.* not found"):
        _trainer(tok, out).train(resume_from_checkpoint=str(out / "private" / "checkpoint-5.pt"))
    (out / "private" / "checkpoint-99.pt").write_bytes(b"PK\x03\x04 truncated")  # the latest, unreadable
    with pytest.raises(CheckpointError, match="checkpoint-99.pt is not a readable idpsgd checkpoint"):
        _trainer(tok, out).train(resume_from_checkpoint=True)
    torch.save({"weights": torch.zeros(2)}, out / "private" / "checkpoint-99.pt")  # another program's
    with pytest.raises(CheckpointError, match="is not an idpsgd Trainer checkpoint"):
        _trainer(tok, out).train(resume_from_checkpoint=True)


# --- finetune --save-every / --resume, with a real SIGKILL ------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "model"
    _gpt2(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _finetune_argv(model_dir, data, out, *extra):
    return [
        "finetune",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--method",
        "sample",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--physical-batch-size",
        "4",
        "--lr",
        "1e-2",
        "--save-every",
        "3",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow  # three finetune runs, one in a fresh interpreter (~10 s unloaded, ~35 s on a busy machine)
def test_finetune_killed_while_writing_a_checkpoint_resumes_exactly(model_dir, tmp_path, capsys):
    """``finetune --save-every 3`` (8 steps) is SIGKILLed while writing checkpoint 6: checkpoint 3 is
    whole and ``--resume`` (without --seed: the run's own seed, from its checkpoint) ends with the
    uninterrupted run's model, ledger and per-example ε."""
    from safetensors.torch import load_file

    from idpsgd.cli.main import main

    rows = [{"text": s, "epsilon": 1.0 if i % 2 else 8.0} for i, s in enumerate(_lines(32, seed=5))]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_finetune_argv(model_dir, data, full, "--seed", "11")) == 0
    env = {**os.environ, "IDPSGD_TEST_KILL": "checkpoint-6.pt:1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "idpsgd", *_finetune_argv(model_dir, data, cut, "--seed", "11")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (cut / "private" / "checkpoint-3.pt").is_file() and not (cut / "private" / "checkpoint-6.pt").exists()
    assert list((cut / "private").glob(".checkpoint-6.pt.*.tmp"))  # the write that was killed
    assert main(_finetune_argv(model_dir, data, cut)) == 2  # not resumed: refused
    assert "holds a run with checkpoints" in capsys.readouterr().err
    assert main(_finetune_argv(model_dir, data, cut, "--resume", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 8
    assert not list((cut / "private").glob(".*.tmp"))
    a, b = (load_file(d / "model" / "model.safetensors") for d in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("ledger.csv", "epsilons.csv"):
        assert (cut / "private" / name).read_bytes() == (full / "private" / name).read_bytes(), name


# --- several processes: torchrun with the Trainer, finetune --nproc ----------------------------------
@pytest.fixture(scope="module")
def dropout_free_model_dir(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "nodrop"
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=tok.vocab_size,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        pad_token_id=tok.pad_token_id,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow  # two torchrun processes and one plain one, each importing transformers (~30 s here)
def test_torchrun_two_processes_equal_one_process(dropout_free_model_dir, tmp_path):
    """``torchrun --nproc-per-node 2`` (gloo, CPU) with per-device batch 4 × accumulation 2 × 2 processes
    is the one-process run with accumulation 4 (expected batch 16): the same ε per group, the same
    ledger (real batch sizes over both processes) and the parameters to float64 rounding."""
    job = str(ROOT / "tests" / "hf_torchrun_job.py")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    model = str(dropout_free_model_dir)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    runs = [[sys.executable, job, model, str(one), "4", "bk"], [*torchrun, job, model, str(two), "2", "bk"]]
    for argv in runs:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(d / "result.pt", weights_only=True) for d in (one, two))
    assert a["epsilon"] == b["epsilon"] and a["ledger"] == b["ledger"]
    assert len(a["ledger"]) == 6
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=1e-12)
    assert not (two / "private" / "history.json").read_text().count("rank")  # one run folder, rank 0's
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())


@pytest.mark.slow  # three torchrun runs of two processes (~60 s here)
def test_torchrun_two_processes_killed_and_resumed_equal_the_uninterrupted_run(dropout_free_model_dir, tmp_path):
    """2 processes, a checkpoint every 2 of 6 steps; both die at step 3 and resume from checkpoint 2
    (every rank reads rank 0's checkpoint): bit-equal to the uninterrupted 2-process run."""
    job = str(ROOT / "tests" / "hf_torchrun_job.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", job]
    model = str(dropout_free_model_dir)
    base = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "SAVE_STEPS": "2"}
    full, cut = tmp_path / "full", tmp_path / "cut"
    runs = [(full, {}, 0), (cut, {"CRASH_AT": "3"}, "fail"), (cut, {"RESUME": "1"}, 0)]
    for out, extra, expect in runs:
        proc = subprocess.run(
            [*torchrun, model, str(out), "2", "bk"], env={**base, **extra}, capture_output=True, text=True, timeout=600
        )
        assert (proc.returncode != 0) if expect == "fail" else proc.returncode == 0, proc.stderr[-3000:]
        if expect == "fail":
            assert sorted(p.name for p in (cut / "private").glob("checkpoint-*.pt")) == ["checkpoint-2.pt"]
    a, b = (torch.load(d / "result.pt", weights_only=True) for d in (full, cut))
    assert torch.equal(a["params"], b["params"]) and a["epsilon"] == b["epsilon"] and a["ledger"] == b["ledger"]
    assert (full / "private" / "ledger.csv").read_bytes() == (cut / "private" / "ledger.csv").read_bytes()


@pytest.mark.slow  # spawns two processes (~35 s here)
def test_finetune_nproc_2_equals_one_process(dropout_free_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from idpsgd.cli.main import main

    rows = [{"text": s, "epsilon": 1.0 if i % 2 else 8.0} for i, s in enumerate(_lines(32, seed=5))]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = _finetune_argv(dropout_free_model_dir, data, tmp_path / "one", "--seed", "4")
    assert main(argv) == 0
    capsys.readouterr()
    argv = _finetune_argv(dropout_free_model_dir, data, tmp_path / "two", "--seed", "4", "--nproc", "2", "--json")
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 8  # rank 0's report, the command's only output
    a, b = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("one", "two"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    for name in ("ledger.csv", "epsilons.csv"):
        assert (tmp_path / "one" / "private" / name).read_bytes() == (tmp_path / "two" / "private" / name).read_bytes()


def test_finetune_nproc_is_checked_before_anything_starts():
    from idpsgd.integrations.hf import FinetuneOptions

    with pytest.raises(InvalidParameterError, match=r"batch_size=16 is invalid: must be a multiple of the 3 processes"):
        FinetuneOptions(batch_size=16, physical_batch_size=4, nproc=3)
    with pytest.raises(InvalidParameterError, match="nproc=0 is invalid"):
        FinetuneOptions(nproc=0)
    assert FinetuneOptions(batch_size=16, physical_batch_size=4, nproc=2).nproc == 2


# --- gradient (activation) checkpointing ------------------------------------------------------------
def _tiny(arch, tok):
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=tok.vocab_size, n_embd=16, n_layer=2, n_head=2, n_positions=32, pad_token_id=tok.pad_token_id
        )
        return GPT2LMHeadModel(cfg).double()
    if arch == "bert":
        cfg = BertConfig(
            vocab_size=tok.vocab_size,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            num_labels=2,
            pad_token_id=tok.pad_token_id,
        )
        return BertForSequenceClassification(cfg).double()
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg).double()


def _one_step(tok, tmp_path, arch, mode, checkpointing, model=None, **kw):
    from transformers import DataCollatorWithPadding

    n = 10
    data = _data(tok, n, seed=3)
    collate = DataCollatorForLanguageModeling(tok, mlm=False)
    if arch == "bert":
        data = data.add_column("labels", [i % 2 for i in range(n)])
        collate = DataCollatorWithPadding(tok)
    model = model if model is not None else _tiny(arch, tok)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"{arch}-{mode}-{checkpointing}-{len(list(tmp_path.iterdir()))}"),
        per_device_train_batch_size=n,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        gradient_checkpointing=checkpointing,
        **kw,
    )
    t = IndividualizedTrainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=collate,
        privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="uniform", seed=1, grad_sample_mode=mode),
    )
    recomputed = []
    layer = next(m for m in model.modules() if type(m).__name__ in ("Conv1D", "Linear"))
    layer.register_forward_hook(lambda *_: recomputed.append(torch.is_grad_enabled()))
    t.train()
    opt = t.dp_optimizer
    assert opt.last_indices.tolist() == list(range(n))  # rate 1: every example, one step
    return opt.last_norms.detach().clone(), torch.cat([p.detach().flatten() for p in model.parameters()]), recomputed


@pytest.mark.parametrize(("arch", "mode"), [("gpt2", "bk"), ("bert", "bk"), ("llama", "hooks")])
def test_gradient_checkpointing_leaves_norms_and_clipped_sums_unchanged(tok, tmp_path, arch, mode):
    """float64, one step at sampling rate 1 with the same privacy seed: the per-example norms and the
    noisy update (clipped sum + the same noise) with checkpointing equal those without it to 1e-10; the
    checkpointed layers ran a forward without gradients, then their recompute (with gradients) once."""
    plain_norms, plain_params, plain_calls = _one_step(tok, tmp_path, arch, mode, False)
    norms, params, calls = _one_step(tok, tmp_path, arch, mode, True)
    torch.testing.assert_close(norms, plain_norms, rtol=0, atol=1e-10)
    torch.testing.assert_close(params, plain_params, rtol=0, atol=1e-10)
    grad_calls = [c for c in calls if c]
    assert calls.count(False) > plain_calls.count(False) and len(grad_calls) == plain_calls.count(True) == 1


def test_what_gradient_checkpointing_cannot_honour_is_refused(tok, tmp_path):
    with pytest.raises(InvalidParameterError, match="grad_sample_mode='functorch'"):
        _one_step(tok, tmp_path, "llama", "functorch", True)
    with pytest.raises(InvalidParameterError, match="use_reentrant=False is not supported"):
        _one_step(tok, tmp_path, "gpt2", "bk", True, gradient_checkpointing_kwargs={"use_reentrant": False})


def test_checkpointing_enabled_on_the_model_beforehand(tok, tmp_path):
    """``model.gradient_checkpointing_enable()`` before the Trainer (non-reentrant by default in
    transformers 5) runs reentrant under the Trainer: the same step as without checkpointing."""
    plain_norms, plain_params, _ = _one_step(tok, tmp_path, "gpt2", "bk", False)
    model = _tiny("gpt2", tok)
    model.gradient_checkpointing_enable()
    norms, params, calls = _one_step(tok, tmp_path, "gpt2", "bk", False, model=model)
    assert calls.count(True) == 1 and calls.count(False) >= 1
    torch.testing.assert_close(norms, plain_norms, rtol=0, atol=1e-10)
    torch.testing.assert_close(params, plain_params, rtol=0, atol=1e-10)


# --- fp16: the GradScaler across physical batches ------------------------------------------------------
def test_a_grad_scaler_across_physical_batches_changes_nothing_in_float32(tok, tmp_path):
    """fp16's GradScaler (here on the CPU in float32, where scaling by 2^k is exact): every physical
    batch's loss is scaled, the scale is divided out of each example's gradient before clipping — in the
    parts (the Trainer hands it over) and at the step (GradScaler.step) — so the run equals the one
    without a scaler bit for bit; the scale grows with the step count only (it sees no private gradient)."""
    params, scales = {}, {}
    for scaled in (False, True):
        t = _trainer(tok, tmp_path / str(scaled), max_steps=2, save_strategy="no", gradient_accumulation_steps=4)
        t.model = t.model.float()
        if scaled:  # what accelerate sets up for fp16 on CUDA, on the CPU
            t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
        t.train()
        params[scaled] = _params(t)
        scales[scaled] = t.accelerator.scaler.get_scale() if scaled else None
    assert torch.equal(params[True], params[False])
    assert scales[True] == 2.0**14  # grown at each of the 2 steps: no overflow seen, none data-dependent


def test_fp16_is_refused_where_it_cannot_be_honoured(tok, tmp_path):
    with pytest.raises(InvalidParameterError, match="fp16=True is invalid: on cpu: accelerate runs neither"):
        _trainer(tok, tmp_path / "r", fp16=True)


@pytest.mark.slow  # worker processes (~3 s unloaded)
def test_data_loader_workers_drawing_ahead_do_not_shift_the_resumed_batches(tok, tmp_path, full_run):
    """With 2 workers the loader draws Poisson batches ahead of training; a checkpoint saves the sampler
    as it was before the first batch not yet trained on, so the resumed run (and the whole run) equals
    the run without workers."""
    full, _ = full_run
    out = tmp_path / "w"
    crashing = _trainer(tok, out, callbacks=[_Crash(6)], dataloader_num_workers=2)
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    resumed = _trainer(tok, out, dataloader_num_workers=2)
    resumed.train(resume_from_checkpoint=True)
    assert torch.equal(_params(resumed), _params(full))
    assert [r[:2] for r in resumed.ledger_rows] == [r[:2] for r in full.ledger_rows]


def test_secure_mode_resume_draws_fresh_entropy_and_says_so(tok, tmp_path):
    """Secure mode saves no generator state: the resumed run continues with fresh OS entropy (a warning
    says so); the accounting continues from the checkpoint's steps and charges the crashed attempt's
    draw of step 3 too (issue 53), so the budgets' filter stops the resumed run after its step 3: 4
    steps charged, the planned ε."""
    secure = PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", secure_mode=True)
    out = tmp_path / "s"
    crashing = _trainer(tok, out, privacy=secure, callbacks=[_Crash(3)], max_steps=4, save_steps=2)
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    ckpt = torch.load(out / "private" / "checkpoint-2.pt", weights_only=True)
    assert "sampler" not in ckpt["engine"] and "noise" not in ckpt["engine"] and ckpt["engine"]["seed"] is None
    resumed = _trainer(tok, out, privacy=secure, max_steps=4, save_steps=2)
    with pytest.warns(UserWarning, match="secure mode: the resumed run draws fresh OS entropy"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.engine.steps == 3 and [r[0] for r in resumed.ledger_rows] == list(range(1, 4))
    assert resumed.engine.accountant.charged_steps == 4 and resumed.stopped_early
    uninterrupted = _trainer(tok, tmp_path / "u", privacy=secure, max_steps=4, save_steps=2)
    uninterrupted.train()
    np.testing.assert_allclose(
        resumed.engine.get_epsilon().per_group, uninterrupted.engine.get_epsilon().per_group, rtol=1e-12
    )


SECURE = PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", secure_mode=True)


def test_a_secure_run_killed_after_publishing_step_4_has_that_draw_charged_on_resume(tok, tmp_path):
    """Issue 53's crash case: a secure run evaluates at step 4 (its eval_loss is in the public log) and
    dies while writing checkpoint 4; the resume from checkpoint 2 draws steps 3 and 4 again with fresh
    noise, so the first draws of 3 and 4 are charged beside the kept steps: the budgets' filter stops
    the resumed run after 6 kept steps (8 charged), the report says so, and each group's ε is
    dp_accounting's composition of 8 sampled-Gaussian steps at its rate and noise multiplier."""
    out = tmp_path / "s"
    run = dict(privacy=SECURE, max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=4)
    with pytest.MonkeyPatch.context() as m:
        _die_while_writing(m, "checkpoint-4.pt")
        crashing = _trainer(tok, out, eval_dataset=_data(tok, 8, seed=1), **run)
        with pytest.raises(KeyboardInterrupt):
            crashing.train()
    assert any("eval_loss" in h for h in crashing.state.log_history)  # step 4's output left the process
    assert sorted(p.name for p in (out / "private").glob("checkpoint-*.pt")) == ["checkpoint-2.pt"]
    assert file_mode(out / "private" / "drawn_steps.jsonl") == 0o600
    resumed = _trainer(tok, out, eval_dataset=_data(tok, 8, seed=1), **run)
    with pytest.warns(UserWarning, match="the steps earlier attempts drew after it are charged"):
        resumed.train(resume_from_checkpoint=True)
    report = json.loads((out / "report.json").read_text())
    assert resumed.stopped_early and report["stopped_early"]
    assert (report["steps"], report["steps_kept"], report["steps_charged"], report["steps_released"]) == (6, 6, 8, 2)
    for g in report["groups"]:  # our RDP conversion is tighter than dp_accounting's (test_assignment)
        rdp_eps, pld_eps = independent_epsilons(g["sample_rate"], g["noise_multiplier"], 8, 1e-5)
        fewer, _ = independent_epsilons(g["sample_rate"], g["noise_multiplier"], 7, 1e-5)
        eps = g["epsilon_spent"]
        assert pld_eps <= eps <= rdp_eps * (1 + 1e-9) and rdp_eps <= eps * (1 + 1e-3) and eps > fewer
        assert eps <= g["budget"]
    assert "Steps charged: <b>8</b>" in (out / "report.html").read_text()


def test_resuming_a_finished_secure_run_from_an_older_checkpoint_is_refused(tok, tmp_path):
    """Issue 53's re-resume case: ``train(resume_from_checkpoint=".../checkpoint-2.pt")`` on a secure run
    that finished its 8 steps would redraw 3..8 with new noise; the 6 earlier draws are charged, which
    spends the budgets, so the resume is refused (naming the charge) and the run's outputs stand."""
    out = tmp_path / "f"
    _trainer(tok, out, privacy=SECURE, max_steps=8, save_steps=2).train()
    report = (out / "report.json").read_bytes()
    again = _trainer(tok, out, privacy=SECURE, max_steps=8, save_steps=2)
    with (
        pytest.warns(UserWarning, match="secure mode"),
        pytest.raises(
            InvalidParameterError,
            match=r"keeps 2 steps, but earlier attempts of this run drew 6 more.*no further step fits",
        ),
    ):
        again.train(resume_from_checkpoint=str(out / "private" / "checkpoint-2.pt"))
    assert (out / "report.json").read_bytes() == report


def _user_rows(tok, grouping):
    """48 rows in 16 users of 3 rows, one budget for all (the per-user budgets the same for either grouping)."""
    ids = np.arange(48) // 3 if grouping == "blocks" else np.arange(48) % 16
    return _data(tok, 48).map(lambda r: {"epsilon": 8.0}).add_column("user", [f"u{i}" for i in ids])


def test_a_user_level_checkpoint_of_other_users_or_k_is_refused(tok, tmp_path):
    """The data digest is of the rows without the user column: another grouping of the same rows into users
    (or another k) resumed silently, charging one user's history to another."""

    def user_level(k=4):
        return PrivacyArguments(
            budgets="epsilon", delta=1e-5, method="scale", seed=3, user_column="user", max_rows_per_user=k
        )

    small = dict(num_train_epochs=1, save_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    out = tmp_path / "run"
    first = _trainer(tok, out, train=_user_rows(tok, "blocks"), privacy=user_level(), callbacks=[_Crash(2)], **small)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    with pytest.raises(InvalidParameterError, match=r"\(users_sha256 differs\)"):
        _trainer(tok, out, train=_user_rows(tok, "strided"), privacy=user_level(), **small).train(
            resume_from_checkpoint=True
        )
    with pytest.raises(InvalidParameterError, match=r"users_k: 4 -> 2"):
        _trainer(tok, out, train=_user_rows(tok, "blocks"), privacy=user_level(k=2), **small).train(
            resume_from_checkpoint=True
        )
    resumed = _trainer(tok, out, train=_user_rows(tok, "blocks"), privacy=user_level(), **small)
    resumed.train(resume_from_checkpoint=True)  # the same users and k resume
    assert resumed.state.global_step > 2
