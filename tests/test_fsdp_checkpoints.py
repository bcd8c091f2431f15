"""Sharded (FSDP2, DCP) checkpoints: bit-exact resume, a rank crashing, resharding, export, refusals.

Two gloo processes on the CPU (``distributed.launch``; each launch imports torch in two fresh
processes, so the default suite launches once and the crash tests across launches are slow).  A run
of STEPS steps is compared with the same run stopped after a checkpoint and resumed: parameters
bit-identical."""

import os
import stat
from pathlib import Path

import pytest
import torch

from idpsgd.engine import distributed
from idpsgd.engine.distributed import sharded_checkpoint as sc
from idpsgd.io import CheckpointError
from idpsgd.validation import InvalidParameterError
from support import cpu_fsdp, launch

STEPS = 6


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.drop = torch.nn.Dropout(0.2)
        self.b = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def _sharded_net():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = _Net()
    if distributed.is_distributed():
        fully_shard(net.a)
        fully_shard(net.b)
        fully_shard(net)
    return net


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + distributed.rank_and_world()[0])
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _plain_run(folder, *, start=None, stop=STEPS, save_at=(), crash_at=None, crash_rank=1, reshard=False):
    """Train a fully_shard model (AdamW, dropout) from step ``start`` (a checkpoint) to ``stop``; return
    rank 0's full parameters.  ``crash_at``: rank ``crash_rank`` raises in the middle of that step."""
    net = _sharded_net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    first = 0
    if start is not None:
        extra = sc.load_sharded_checkpoint(folder, module=net, optimizer=opt, allow_reshard=reshard)
        sched.load_state_dict(extra["scheduler"])
        first = extra["step"]
    for step in range(first, stop):
        x, y = _batch(step)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        if step == crash_at and distributed.rank_and_world()[0] == crash_rank:
            raise RuntimeError("rank crashed mid-step")
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 in save_at:
            sc.save_sharded_checkpoint(
                folder, step + 1, module=net, optimizer=opt, extra={"scheduler": sched.state_dict(), "step": step + 1}
            )
    full = sc.full_model_state(net)
    return {k: v.clone() for k, v in full.items()}


def _private_run(folder, *, start=None, stop=STEPS, save_at=(), world=None, secure=False):
    """The same network trained privately (the engine, bk, two privacy groups, AdamW, the journal of
    drawn steps in ``folder``): sharded under a process group, plain in one process.  Returns rank 0's
    full parameters, ε per group, steps kept and charged."""
    import numpy as np

    from idpsgd import Budgets
    from idpsgd.engine import IndividualizedPrivacyEngine
    from idpsgd.engine.budget.journal import JOURNAL

    net = _sharded_net()
    net.drop.p = 0.0  # resharded, each rank's dropout draws would differ (the slow plain runs test dropout)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    engine = IndividualizedPrivacyEngine(seed=None if secure else 5, accountant="rdp", secure_mode=secure)
    engine.attach_journal(Path(folder) / JOURNAL)  # rank 0 writes; every rank charges alike
    model, opt, loader = engine.make_private(
        module=net,
        optimizer=opt,
        data_loader=torch.utils.data.DataLoader(data, batch_size=8),
        budgets=Budgets.from_array(np.where(np.arange(64) % 2, 2.0, 8.0), 1e-5),
        method="sample",
        steps=STEPS,
        max_grad_norm=1.0,
        grad_sample_mode="bk",
    )
    batches = iter(loader)  # (it draws its base seed from torch's RNG: before the checkpoint's RNG state)
    step = 0
    if start is not None:
        step = sc.load_sharded_checkpoint(
            folder, module=model, optimizer=opt, engine=engine, allow_reshard=world is not None
        )["step"]
    while step < stop and engine.can_step():
        x, y = next(batches)  # every rank runs the forward pass, its share empty or not (FSDP2 collectives)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step in save_at:
            sc.save_sharded_checkpoint(folder, step, module=model, optimizer=opt, engine=engine, extra={"step": step})
    full = sc.full_model_state(model) if distributed.is_distributed() else net.state_dict()
    return {
        "params": {k: v.detach().clone() for k, v in full.items()},
        "eps": engine.get_epsilon().per_group.tolist(),
        "steps": engine.steps,
        "charged": engine.accountant.charged_steps,
    }


def _private_scenario(folder):
    """One launch: the uninterrupted private run; the run checkpointed at step 3 and abandoned; a fresh
    model, optimizer and engine (another RNG state) resumed from it."""
    whole = _private_run(folder + "/whole")
    _private_run(folder + "/b", stop=4, save_at=(3,))
    torch.manual_seed(12345)
    resumed = _private_run(folder + "/b", start=3)
    # secure mode (issue 53): the abandoned draw of step 4 is charged; the filter stops the resumed run a step early
    _private_run(folder + "/s", stop=4, save_at=(3,), secure=True)
    secure = _private_run(folder + "/s", start=3, secure=True)
    return {"whole": whole, "resumed": resumed, "secure": secure, "modes": _modes(folder + "/b")}


@cpu_fsdp
def test_private_resume_is_bit_exact_and_reshards(tmp_path):
    out = launch(_private_scenario, 2, (str(tmp_path),), timeout_s=300)
    whole, resumed = out["whole"], out["resumed"]
    assert _same(whole["params"], resumed["params"])
    assert whole["eps"] == resumed["eps"] and whole["steps"] == resumed["steps"] == STEPS
    assert resumed["charged"] == STEPS  # the seeded resume replays the abandoned step 4: charged once
    assert (out["secure"]["steps"], out["secure"]["charged"]) == (STEPS - 1, STEPS)
    assert out["secure"]["eps"] == pytest.approx(whole["eps"], rel=1e-12)  # every drawn step, within the budgets
    files = {k: m for k, m in out["modes"].items() if "/" in k}
    assert {Path(k).name for k in files} >= {".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"}
    assert set(files.values()) == {0o600} and out["modes"]["checkpoint-3"] == 0o700
    ranks = sc.read_sharded_state(tmp_path / "b" / "checkpoint-3")["ranks"]
    assert ranks[0]["engine"]["seed"] == 5 and len(ranks) == 2  # private: the seed is in the 0600 state
    # one process resumes the 2-process checkpoint (engine state the same on both ranks): the same ε,
    # the parameters up to the order of floating-point sums
    one = _private_run(str(tmp_path / "b"), start=3, world=1)
    assert one["eps"] == whole["eps"] and one["steps"] == STEPS
    for k, v in whole["params"].items():
        torch.testing.assert_close(one["params"][k], v, rtol=0, atol=1e-5)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _modes(folder) -> dict:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in Path(folder).rglob("*")}


def _scenario(folder):
    """In one launch: the uninterrupted run; a run saving at steps 2 and 4 and abandoned in the middle
    of step 5; a fresh model and optimizer (other RNG state) resumed from the latest checkpoint."""
    whole = _plain_run(folder + "/whole")
    _plain_run(folder + "/b", stop=4, save_at=(2, 4))
    torch.manual_seed(12345)  # the resumed run must not depend on this process's RNG state
    resumed = _plain_run(folder + "/b", start=4)
    at4 = _plain_run(folder + "/c", stop=4)  # the state the checkpoint holds (for the resharding check)
    return {"whole": whole, "resumed": resumed, "at4": at4, "modes": _modes(folder + "/b")}


@pytest.mark.slow  # the private scenario above runs in the default suite; this one adds dropout and a schedule
def test_resume_is_bit_exact_private_and_reshards(tmp_path):
    out = launch(_scenario, 2, (str(tmp_path),), timeout_s=120)
    assert _same(out["whole"], out["resumed"])
    assert not _same(out["whole"], out["at4"])
    found = sc.sharded_checkpoints(tmp_path / "b")
    assert [s for s, _ in found] == [2, 4]
    modes = out["modes"]
    assert modes["checkpoint-4"] == 0o700
    files = {k: m for k, m in modes.items() if "/" in k}
    assert {Path(k).name for k in files} >= {".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"}
    assert set(files.values()) == {0o600}
    state = sc.read_sharded_state(found[-1][1])
    assert state["world_size"] == 2 and len(state["ranks"]) == 2 and state["step"] == 4
    # one process (world size 1): refused unless resharding is asked for; nothing changes when refused
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(InvalidParameterError, match="differs from the 2 processes.*allow_reshard=True"):
        sc.load_sharded_checkpoint(tmp_path / "b", module=net, optimizer=opt)
    assert _same(before, net.state_dict())
    extra = sc.load_sharded_checkpoint(tmp_path / "b", module=net, optimizer=opt, allow_reshard=True)
    assert extra["step"] == 4
    assert _same(out["at4"], net.state_dict())  # DCP joined the two ranks' shards exactly
    assert int(opt.state_dict()["state"][0]["step"]) == 4


def _one_process_checkpoint(folder, **kwargs):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    x, y = _batch(0)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    return net, opt, sc.save_sharded_checkpoint(folder, 1, module=net, optimizer=opt, **kwargs)


def test_one_process_round_trip_and_keep(tmp_path):
    for step in (1, 2, 3):
        net, opt, _ = _one_process_checkpoint(tmp_path, extra={"k": step})
        sc.save_sharded_checkpoint(tmp_path, step, module=net, optimizer=opt, extra={"k": step}, keep=2)
    assert [s for s, _ in sc.sharded_checkpoints(tmp_path)] == [2, 3]
    assert not list(tmp_path.glob(".*.tmp"))
    other = _Net()
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.05)
    assert sc.load_sharded_checkpoint(tmp_path, module=other, optimizer=other_opt) == {"k": 3}
    assert _same(net.state_dict(), other.state_dict())
    assert _same(opt.state_dict()["state"][0], other_opt.state_dict()["state"][0])


def test_foreign_model_optimizer_or_signature_is_refused(tmp_path):
    _one_process_checkpoint(tmp_path, signature={"data_sha256": "a", "lr": 0.05})
    with pytest.raises(InvalidParameterError, match="another model.*layout.model"):
        sc.load_sharded_checkpoint(tmp_path, module=torch.nn.Sequential(torch.nn.Linear(6, 3)))
    net = _Net()
    with pytest.raises(InvalidParameterError, match="optimizer: 'AdamW' -> 'SGD'"):
        sc.load_sharded_checkpoint(
            tmp_path, module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1), signature={"data_sha256": "a"}
        )
    with pytest.raises(InvalidParameterError, match=r"data_sha256 differs; lr: 0.05 -> 0.1") as err:
        sc.load_sharded_checkpoint(
            tmp_path,
            module=net,
            optimizer=torch.optim.AdamW(net.parameters()),
            signature={"data_sha256": "b", "lr": 0.1},
        )
    assert "'a'" not in str(err.value)  # digests are named, never shown
    with pytest.raises(CheckpointError, match="holds no complete sharded checkpoint"):
        sc.load_sharded_checkpoint(tmp_path / "nothing", module=net)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="step"):
            sc.save_sharded_checkpoint(tmp_path, bad, module=net)


def test_tampered_checkpoint_runs_no_code(tmp_path):
    import pickle

    _, _, ck = _one_process_checkpoint(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    net = _Net()
    (ck / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not allowed"):
        sc.load_sharded_checkpoint(ck, module=net, optimizer=torch.optim.AdamW(net.parameters()))
    (ck / "state.pt").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not a readable"):
        sc.load_sharded_checkpoint(ck, module=net)
    assert not (tmp_path / "pwned").exists()


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=8, n_layer=2, n_head=2, n_positions=16))


def test_export_pretrained_holds_only_the_model(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    sc.save_sharded_checkpoint(tmp_path / "ck", 1, module=model, optimizer=opt, extra={"loss": 1.5})
    fresh = _tiny_gpt2().apply(lambda m: torch.nn.init.zeros_(m.weight) if isinstance(m, torch.nn.Linear) else None)
    out = sc.export_pretrained(tmp_path / "ck", fresh, tmp_path / "model")
    names = {p.name for p in out.iterdir()}
    assert names <= {"config.json", "generation_config.json", "model.safetensors"}, names
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    back = GPT2LMHeadModel.from_pretrained(out)
    assert _same(dict(model.state_dict()), dict(back.state_dict()))
    with pytest.raises(InvalidParameterError, match="is not the checkpoint's model"):
        sc.export_pretrained(tmp_path / "ck", _Net(), tmp_path / "other")
    assert not (tmp_path / "other").exists()


# --- across launches (slow: three launches of two processes each) -------------------------------------
@pytest.mark.slow
def test_rank_crash_keeps_last_checkpoint_and_resumes_bit_exactly(tmp_path):
    whole = launch(_plain_run, 2, (str(tmp_path / "a"),), timeout_s=60)
    with pytest.raises(RuntimeError, match="crashed mid-step"):
        launch(_plain_run, 2, (str(tmp_path / "b"),), {"save_at": (2,), "crash_at": 3}, timeout_s=20)
    assert [s for s, _ in sc.sharded_checkpoints(tmp_path / "b")] == [2]
    resumed = launch(_plain_run, 2, (str(tmp_path / "b"),), {"start": 2}, timeout_s=60)
    assert _same(whole, resumed)


def _die_while_saving(folder):
    if distributed.rank_and_world()[0] == 1:
        os.environ["IDPSGD_TEST_KILL"] = "checkpoint-4.tmp:1"  # rank 1 SIGKILLed after writing its shards
    return _plain_run(folder, stop=STEPS, save_at=(2, 4))


@pytest.mark.slow
def test_rank_killed_while_saving_leaves_previous_checkpoint(tmp_path):
    with pytest.raises(distributed.DistributedTrainingError, match="rank 1 of 2"):
        launch(_die_while_saving, 2, (str(tmp_path),), timeout_s=10)
    assert [s for s, _ in sc.sharded_checkpoints(tmp_path)] == [2]
    assert (tmp_path / ".checkpoint-4.tmp").is_dir()  # the unfinished one is never listed
    assert sc.latest_sharded_checkpoint(tmp_path).name == "checkpoint-2"


# --- the Trainer and finetune with fsdp: refusals and checkpoint discovery (one process, fast) ---------
def _hf_bits():
    pytest.importorskip("datasets")
    import datasets
    from transformers import TrainingArguments

    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    return datasets, TrainingArguments, IndividualizedTrainer, PrivacyArguments


def test_fsdp_refusals(tmp_path, monkeypatch):
    datasets, TrainingArguments, IndividualizedTrainer, PrivacyArguments = _hf_bits()
    from idpsgd.integrations.hf.finetune import FinetuneOptions

    train = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 8, "epsilon": [1.0] * 8})
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, use_cpu=True, report_to=[]
    )

    def trainer(**privacy):
        return IndividualizedTrainer(
            model=_tiny_gpt2(), args=args, train_dataset=train, privacy=PrivacyArguments(**privacy)
        )

    base = {"budgets": "epsilon", "delta": 1e-5, "fsdp": True}
    with pytest.raises(InvalidParameterError, match="fsdp.*torchrun --nproc-per-node"):
        trainer(**base)
    with pytest.raises(InvalidParameterError, match="grad_sample_mode.*only 'bk'"):
        trainer(**base, grad_sample_mode="hooks")
    with pytest.raises(InvalidParameterError, match="user_column.*needs grad_sample_mode='bk'"):
        trainer(**base, user_column="u", grad_sample_mode="ghost")
    with pytest.raises(InvalidParameterError, match="fsdp.*True or False"):
        PrivacyArguments(budgets="epsilon", fsdp="yes")
    with pytest.raises(InvalidParameterError, match="grad_sample_mode.*only bk and ghost"):
        FinetuneOptions(fsdp=True, grad_sample_mode="hooks")
    FinetuneOptions(fsdp=True, lora_r=4, grad_sample_mode="ghost")  # LoRA and ghost clipping with fsdp (issue 51)
    FinetuneOptions(fsdp=True, nproc=2, batch_size=4, physical_batch_size=1)  # two passes per process and step
    with pytest.raises(InvalidParameterError, match="batch_size=3 .*multiple of the 2 processes"):
        FinetuneOptions(fsdp=True, nproc=2, batch_size=3)
    assert not (tmp_path / "run").exists()  # a refused run leaves no folder


def test_finetune_under_torchrun_refuses_nproc_and_uneven_batches(tmp_path, monkeypatch):
    _hf_bits()
    from idpsgd.integrations.hf.finetune import FinetuneOptions, finetune

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(InvalidParameterError, match="nproc.*torchrun already started 3 processes"):
        finetune("m", None, None, tmp_path, options=FinetuneOptions(nproc=2, batch_size=8, physical_batch_size=4))
    with pytest.raises(InvalidParameterError, match="batch_size.*multiple of the 3 processes"):
        finetune("m", None, None, tmp_path, options=FinetuneOptions(batch_size=8, physical_batch_size=4))


def test_trainer_finds_sharded_checkpoints_and_their_seed(tmp_path):
    _hf_bits()
    from idpsgd.integrations.hf import checkpoints as ckpts

    net = _Net()
    private = tmp_path / "private"
    sc.save_sharded_checkpoint(private, 3, module=net, extra={"engine": {"seed": 77}})
    (private / ".checkpoint-5.tmp").mkdir()  # an unfinished save is never found
    assert [(s, p.name) for s, p in ckpts.checkpoints_in(tmp_path)] == [(3, "checkpoint-3")]
    assert ckpts.checkpoint_seed(tmp_path) == 77
    assert ckpts.find_checkpoint(tmp_path, True).name == "checkpoint-3"
    assert ckpts.find_checkpoint(tmp_path, private / "checkpoint-3").name == "checkpoint-3"


# --- the private Trainer sharded under torchrun (slow: each run starts two processes with transformers)
ROOT = Path(__file__).resolve().parents[1]


def _model_dir(folder: Path, dropout: float = 0.1) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_text import word_tokenizer

    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat", "on", "mat", "privacy"]
    tok = word_tokenizer([" ".join(words[i:] + words[:i]) for i in range(len(words))])
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=tok.vocab_size, n_embd=16, n_layer=2, n_head=2, n_positions=32, pad_token_id=tok.pad_token_id
    )
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = dropout
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _torchrun(model, out, **env):
    import subprocess
    import sys

    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    argv += [str(ROOT / "tests" / "hf_fsdp_job.py"), str(model), str(out)]
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # three torchrun runs of two processes
def test_trainer_fsdp_crash_resume_and_export(tmp_path):
    pytest.importorskip("datasets")
    from transformers import GPT2LMHeadModel

    from idpsgd.integrations.hf import export_checkpoint

    model = _model_dir(tmp_path / "model")
    full, cut = tmp_path / "full", tmp_path / "cut"
    proc = _torchrun(model, full)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loss" not in proc.stdout  # the training loss is private: never on stdout
    assert proc.stdout.count("'epsilon':") == 7  # 6 public logs (every 2 of 12 steps) and the summary, once
    proc = _torchrun(model, cut, SAVE_STEPS="2", CRASH_AT="3")  # rank 1 dies after step 3
    assert proc.returncode != 0
    private = cut / "private"
    assert sorted(p.name for p in private.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    assert stat.S_IMODE((private / "checkpoint-2").stat().st_mode) == 0o700
    manifest = (cut / "outputs.json").read_text()
    assert "private/checkpoint-2" in manifest
    exported = export_checkpoint(cut, tmp_path / "exported")
    assert {p.name for p in exported.iterdir()} <= {"config.json", "generation_config.json", "model.safetensors"}
    GPT2LMHeadModel.from_pretrained(exported)
    proc = _torchrun(model, cut, SAVE_STEPS="2", RESUME="1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = (torch.load(d / "result.pt", weights_only=True) for d in (full, cut))
    assert a["epsilon"] == b["epsilon"] and a["ledger"] == b["ledger"] and len(a["ledger"]) == 12
    assert torch.equal(a["params"], b["params"])
    assert (full / "private" / "ledger.csv").read_bytes() == (cut / "private" / "ledger.csv").read_bytes()
    back = GPT2LMHeadModel.from_pretrained(full / "model")  # rank 0's plain copy of the sharded model
    assert torch.equal(torch.cat([p.detach().flatten() for p in back.parameters()]), a["params"])
    assert json_arch(full / "model") == ["GPT2LMHeadModel"]


def json_arch(folder: Path):
    import json

    return json.loads((folder / "config.json").read_text())["architectures"]


@pytest.mark.slow  # finetune in one process and on two spawned processes (~45 s here)
def test_finetune_fsdp_equals_one_process(tmp_path, capsys):
    import json

    from safetensors.torch import load_file

    from idpsgd.cli.main import main

    model = _model_dir(tmp_path / "model", dropout=0.0)  # the ranks' dropout draws differ from one process's
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat"]
    rows = [{"text": " ".join(words[i % 7 : i % 7 + 3 + i % 4]), "epsilon": 1.0 if i % 2 else 8.0} for i in range(32)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["finetune", "--model", str(model), "--data", str(data), "--method", "sample", "--epochs", "2"]
    base += ["--batch-size", "2", "--lr", "1e-2", "--seed", "4"]  # 1 row per rank expected: phantom rows occur
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    assert main([*base, "--fsdp", "--nproc", "2", "--save-every", "10", "--out", str(tmp_path / "two"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 32  # rank 0's report, the only output
    a, b = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("one", "two"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    for name in ("ledger.csv", "epsilons.csv"):
        assert (tmp_path / "one" / "private" / name).read_bytes() == (tmp_path / "two" / "private" / name).read_bytes()
    found = sorted(p.name for p in (tmp_path / "two" / "private").glob("checkpoint-*"))
    assert found == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-32"]
    rc = main([*base, "--fsdp", "--nproc", "2", "--physical-batch-size", "2", "--out", str(tmp_path / "x")])
    assert rc == 2 and "--physical-batch-size" in capsys.readouterr().err
