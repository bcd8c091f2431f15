"""The private Trainer sharded with FSDP2 (``PrivacyArguments(fsdp=True)``, issue 51): LoRA on a sharded
frozen base, ghost clipping, gradient accumulation (with phantom rows for empty parts), user level and
gradient checkpointing on two gloo processes give the one-process run's parameters (1e-5), ε and ledger.

The two-process runs share one spawned job (:func:`_cases`: every case, one after the other, in the same
two processes), compared with the same cases run in this process without FSDP."""

import pytest
import torch

from idpsgd.engine import distributed
from support import launch

N, T, VOCAB = 32, 6, 30


def _gpt2(tie=True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # the ranks' dropout draws would differ from one process's
    cfg.tie_word_embeddings = tie
    return GPT2LMHeadModel(cfg)


def _model(case: str):
    model = _gpt2(tie=not case.startswith("ghost"))  # ghost clipping: no tied parameters
    if case.startswith("ghost"):  # and GPT-2's (1, T) position ids are one shared input: frozen
        model.transformer.wpe.weight.requires_grad_(False)
    if case == "lora":
        import peft

        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
    return model


#: case -> (PrivacyArguments extras, gradient_accumulation_steps, max_steps, expected batch of all ranks)
#: (an expected batch of 4 in 2 passes on 2 ranks: a rank's share often has fewer rows than passes, phantom rows)
CASES = {
    "lora": ({}, 1, 4, 8),
    "ghost": ({"grad_sample_mode": "ghost"}, 1, 4, 8),
    "accum": ({}, 2, 5, 4),
    "ghost_accum": ({"grad_sample_mode": "ghost"}, 2, 4, 4),
    "users": ({"user_column": "user", "max_rows_per_user": 2}, 1, 4, 8),
    "ckpt": ({}, 1, 3, 8),
}
#: one process only: the ghost case's model in book-keeping mode (the same update in one backward pass)
ONE_PROCESS = {"ghost_bk": ({}, 1, 4, 8)}


class _Crash(Exception):
    """Every rank stops at the end of a step (after that step's checkpoint, if one is due)."""


def _run(case: str, folder: str, save_steps: int | None = None, crash_at: int | None = None, resume=False) -> dict:
    """One Trainer run of ``case`` (sharded under a process group); with ``save_steps`` sharded checkpoints,
    ``crash_at``: every rank raises at the end of that step; ``resume``: from the latest checkpoint."""
    import datasets
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    extra, accumulation, steps, batch = {**CASES, **ONE_PROCESS}[case]
    world = distributed.rank_and_world()[1]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (N, T), generator=g).tolist()
    users = [i // 2 for i in range(N)]  # 16 users of 2 rows
    eps = [1.0 if (u if case == "users" else i) % 2 == 0 else 8.0 for i, u in enumerate(users)]  # row order
    columns = {"input_ids": ids, "labels": ids, "epsilon": eps}
    if case == "users":
        columns["user"] = users
    args = TrainingArguments(
        output_dir=f"{folder}/{case}" + ("-cut" if save_steps else ""),
        per_device_train_batch_size=batch // (accumulation * world),
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=5e-2,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
        gradient_checkpointing=case == "ckpt",
    )
    model = _model(case)
    t = IndividualizedTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict(columns),
        data_collator=default_data_collator,
        privacy=PrivacyArguments(
            budgets="epsilon", delta=1e-5, method="sample", seed=None if resume else 3, fsdp=world > 1, **extra
        ),
    )
    if crash_at is not None:

        class Crash(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == crash_at:
                    raise _Crash

        t.add_callback(Crash)
        try:
            t.train()
        except _Crash:
            return {}
    t.train(resume_from_checkpoint=True if resume else None)
    out = {
        "epsilon": t.engine.get_epsilon().per_group.tolist(),
        "ledger": [[float(v) for v in r] for r in t.ledger_rows],
        "checkpointed": any(getattr(m, "gradient_checkpointing", False) for m in model.modules()),
    }
    if t.is_world_process_zero():
        out["params"] = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    return out


def _cases(folder: str, cases=tuple(CASES), resumed=()) -> dict:
    """Every case in this process (or on every rank); with several ranks, also how many phantom passes
    (an empty part of a rank's share) each case ran on all ranks together.  Each case of ``resumed`` is
    also run with a checkpoint at step 2, stopped at the end of step 3 and resumed (``out[case + "-resumed"]``)."""
    from idpsgd.engine.distributed import fsdp

    torch.set_num_threads(1)
    marked, out = [0], {}
    mark = fsdp.mark_phantom_pass

    def counted(clipping):
        marked[0] += 1
        mark(clipping)

    fsdp.mark_phantom_pass = counted
    try:
        for case in cases:
            marked[0] = 0
            out[case] = _run(case, folder)
            if distributed.is_distributed():
                import torch.distributed as dist

                counts = [None] * dist.get_world_size()
                dist.all_gather_object(counts, marked[0])
                out[case]["phantoms"] = sum(counts)
    finally:
        fsdp.mark_phantom_pass = mark
    for case in resumed:
        _run(case, folder, save_steps=2, crash_at=3)
        out[case + "-resumed"] = _run(case, folder, save_steps=2, resume=True)
    return out


def _same_run(two: dict, one: dict, case: str) -> None:
    assert two["epsilon"] == one["epsilon"], case
    assert two["ledger"] == one["ledger"], case  # the same steps, real batch sizes and ε per step
    assert two["params"].keys() == one["params"].keys(), case
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{case} {k}: {m}")


@pytest.mark.slow  # two processes importing transformers and training five Trainer runs (~2 min here)
def test_two_processes_match_one_process(tmp_path):
    pytest.importorskip("peft")
    two = launch(_cases, 2, (str(tmp_path / "two"), tuple(CASES), ("lora", "users")), timeout_s=900)
    one = _cases(str(tmp_path / "one"))
    for case in CASES:
        _same_run(two[case], one[case], case)
    assert two["ckpt"]["checkpointed"] and one["ckpt"]["checkpointed"]  # (the blocks ran checkpointed)
    assert two["accum"]["phantoms"] > 0 and two["ghost_accum"]["phantoms"] > 0  # empty parts ran as phantom rows
    for case in ("lora", "users"):  # sharded checkpoints of LoRA and of user level resume bit for bit
        whole, resumed = two[case], two[case + "-resumed"]
        assert whole["epsilon"] == resumed["epsilon"] and whole["ledger"] == resumed["ledger"], case
        assert all(torch.equal(v, resumed["params"][k]) for k, v in whole["params"].items()), case
    from idpsgd.integrations.hf import export_checkpoint

    exported = export_checkpoint(tmp_path / "two" / "lora-cut", tmp_path / "exported")  # its latest: step 4
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in exported.iterdir()}
    import peft

    back = peft.PeftModel.from_pretrained(_gpt2(), exported).state_dict()
    assert all(torch.equal(v, back[k]) for k, v in two["lora"]["params"].items() if "lora_" in k)
    lora = one["lora"]["params"]
    init = _model("lora").state_dict()
    assert all(torch.equal(lora[k], init[k]) for k in lora if "lora_" not in k)  # the base stayed frozen
    assert any(not torch.equal(lora[k], init[k]) for k in lora if "lora_" in k)


def test_equal_parts_give_every_rank_the_same_number_of_passes():
    from idpsgd.integrations.hf.trainer import equal_parts

    batch = {"input_ids": torch.arange(10).reshape(5, 2), "labels": torch.arange(5)}
    parts = equal_parts(batch, 5, 2)
    assert [p["labels"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    parts = equal_parts({"labels": torch.arange(1)}, 1, 3)
    assert parts[0]["labels"].tolist() == [0] and parts[1:] == [None, None]  # empty parts: phantom rows
    assert equal_parts({"labels": torch.zeros(0)}, 0, 2) == [None, None]


@pytest.mark.slow  # finetune in one process and on two spawned processes
def test_finetune_fsdp_lora_with_accumulation_equals_one_process(tmp_path, capsys):
    """``idpsgd finetune --fsdp --nproc 2 --lora-r 4`` with two passes per process and step (--batch-size 4,
    --physical-batch-size 1) against the same finetune in one process: the adapter to 1e-5, the same
    ledger and ε."""
    import json

    from safetensors.torch import load_file

    from idpsgd.cli.main import main
    from test_fsdp_checkpoints import _model_dir

    model = _model_dir(tmp_path / "model", dropout=0.0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat"]
    rows = [{"text": " ".join(words[i % 7 : i % 7 + 3 + i % 4]), "epsilon": 1.0 if i % 2 else 8.0} for i in range(24)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["finetune", "--model", str(model), "--data", str(data), "--method", "sample", "--epochs", "1"]
    base += ["--batch-size", "4", "--physical-batch-size", "1", "--lr", "1e-2", "--seed", "4", "--lora-r", "4"]
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    assert main([*base, "--fsdp", "--nproc", "2", "--out", str(tmp_path / "two")]) == 0
    capsys.readouterr()
    a, b = (load_file(tmp_path / d / "model" / "adapter_model.safetensors") for d in ("one", "two"))
    assert a.keys() == b.keys() and a
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    for name in ("ledger.csv", "epsilons.csv"):
        assert (tmp_path / "one" / "private" / name).read_bytes() == (tmp_path / "two" / "private" / name).read_bytes()


def test_ghost_clipping_in_the_trainer_gives_the_book_keeping_update(tmp_path):
    """One process: the Trainer's ghost clipping (two backward passes through Opacus's loss wrapper on the
    per-example losses) gives bk's parameters (one pass) to float precision, with the same ε and ledger."""
    ghost, bk = _run("ghost", str(tmp_path)), _run("ghost_bk", str(tmp_path))
    _same_run(ghost, bk, "ghost")
