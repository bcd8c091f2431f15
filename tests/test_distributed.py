"""Distributed individualized DP-SGD (engine/distributed.py): a 2-process gloo run on CPU is the
single-process run — same Poisson draws (union over ranks), same per-group ε and step count, the
same parameters (so the noise is added once and the sum is divided by Σ q_i) — and a rank that dies
or hangs gives a clear error within the timeout."""

import os
import time

import numpy as np
import pytest
import torch

from idpsgd.engine import distributed
from support import launch, launch_together

EPOCHS, BATCH = 1, 256


def _trial(die_at=None, mark=None):
    """A few Sample steps on digits through the Trainer; returns what the test compares (rank 0)."""
    import torch.distributed as dist

    from idpsgd.cli.train_commands import demo_budgets
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig, Trainer

    torch.set_num_threads(1)
    data = load_dataset("digits")
    budgets = demo_budgets(len(data.y_train), 1e-5, 0)
    trainer = Trainer(
        data, budgets, TrainConfig(method="sample", epochs=EPOCHS, batch_size=BATCH, seed=3, progress=False)
    )
    drawn, noise0 = [], {}

    def record(tr, _model, _step):
        opt = tr.dp_optimizer
        noise0.setdefault("state", opt.generator.get_state().clone())
        if tr.step:
            drawn.append(opt.last_indices.numpy().copy())
        rank = distributed.rank_and_world()[0]
        if die_at is not None and tr.step == die_at and rank == 1:
            with open(mark, "w") as fh:
                fh.write(repr(time.time()))
            os._exit(3)

    trainer.step_hooks.append(record)
    report = trainer.run()
    drawn.append(trainer.dp_optimizer.last_indices.numpy().copy())
    opt = trainer.dp_optimizer
    out = {
        "eps": trainer.engine.get_epsilon().per_group,
        "steps": trainer.engine.steps,
        "report_steps": report["steps"],
        "ledger_sizes": [row[3] for row in trainer.ledger_rows],
        "ebs": opt.expected_batch_size,
        "sum_q": float(trainer.engine.parameters.sample_rates.sum()),
        "q": np.asarray(trainer.engine.parameters.sample_rates),
        "params": {k: v.clone() for k, v in trainer._module().state_dict().items()},
        "noise_drawn": not torch.equal(opt.generator.get_state(), noise0["state"]),
    }
    if distributed.is_distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"drawn": drawn, "noise_drawn": out["noise_drawn"], "ebs": out["ebs"]})
        out["per_rank"] = everyone
        out["drawn"] = [np.sort(np.concatenate([r["drawn"][k] for r in everyone])) for k in range(len(drawn))]
    else:
        out["drawn"] = drawn
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """The scenarios below that end normally, in one spawn of two gloo processes (a spawn imports torch,
    opacus and idpsgd in two fresh processes: most of a scenario's time); the dying and the hanging rank
    keep their own launches."""
    return launch_together(
        2,
        {
            "trial": (_trial, {}),
            "engines": (_engine_trial, {}),
            "every_step": (_engine_trial, {"modes": ("bk",), "every_step": True}),
            "write": (_a_write_on_one_rank, {}),
        },
        timeout_s=60,
    )


def test_two_gloo_processes_match_one_process(two_ranks):
    single = _trial()
    two = two_ranks["trial"]
    assert two_ranks["seconds"]["trial"] < 60
    assert two["steps"] == single["steps"] == two["report_steps"] > 1
    np.testing.assert_array_equal(two["eps"], single["eps"])  # the same per-group ledger
    assert len(two["drawn"]) == len(single["drawn"])
    for a, b in zip(two["drawn"], single["drawn"], strict=True):  # the union is the single-process draw
        np.testing.assert_array_equal(a, b)
    ranks = two["per_rank"]
    from idpsgd.engine.sampling.rank_balance import rank_owners

    owners = rank_owners(single["q"], 2)  # dealt in snake order of the rates (balanced loads)
    for r, rank in enumerate(ranks):  # each rank drew only its own shard
        assert all(np.all(owners[d] == r) for d in rank["drawn"])
        assert rank["ebs"] == pytest.approx(single["sum_q"] / 2)  # per-rank Σq/W, as Opacus
    assert two["ledger_sizes"] == [len(d) for d in single["drawn"]]  # ledger: the global batch size
    assert [r["noise_drawn"] for r in ranks] == [True, False]  # noise on rank 0 only: once
    assert single["noise_drawn"]
    for k, v in single["params"].items():  # the same update: noise once, ÷ Σ q_i
        torch.testing.assert_close(two["params"][k], v, rtol=1e-4, atol=1e-5)


def test_a_dying_rank_gives_a_clear_error(tmp_path):
    mark = tmp_path / "died"
    with pytest.raises(distributed.DistributedTrainingError, match=r"rank 1 of 2 exited with code 3"):
        launch(_trial, 2, kwargs={"die_at": 2, "mark": str(mark)}, timeout_s=30)
    assert time.time() - float(mark.read_text()) < 30  # within the collective timeout of the death


def _hang_on_rank_1(mark):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(300)  # a stuck rank: rank 0's collective must time out
    with open(mark, "w") as fh:
        fh.write(repr(time.time()))
    dist.all_reduce(torch.ones(3))


def test_a_hanging_rank_times_out(tmp_path):
    """In fresh interpreters (``launch``'s default ``spawn``, as ``idpsgd train --nproc`` runs it; the other
    launches of the suite fork from a preloaded server, :func:`support.launch`)."""
    mark = tmp_path / "entered"
    with pytest.raises(distributed.DistributedTrainingError, match=r"(?i)timed? ?out|timeout"):
        distributed.launch(_hang_on_rank_1, 2, args=(str(mark),), timeout_s=3)
    assert 2.5 < time.time() - float(mark.read_text()) < 30  # the 3 s timeout, not a hang


def test_data_parallel_model_needs_a_process_group():
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from idpsgd import InvalidParameterError
    from idpsgd.assignment import Budgets
    from idpsgd.engine import IndividualizedPrivacyEngine

    model = torch.nn.Linear(3, 2)
    wrapped = DPDDP.__new__(DPDDP)  # no process group: constructed without the broadcast
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(8, 3), torch.zeros(8).long()), batch_size=4
    )
    with pytest.raises(InvalidParameterError, match="process group"):
        IndividualizedPrivacyEngine(accountant="rdp", seed=0).make_private_with_parameters(
            module=wrapped,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            budgets=Budgets.from_array(np.ones(8), 1e-5),
            sample_rates=np.full(8, 0.5),
            clip_norms=np.ones(8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            steps=2,
        )
    with pytest.raises(InvalidParameterError, match="nproc"):
        distributed.launch(_trial, 0)
    with pytest.raises(InvalidParameterError, match="start_method='fork' is invalid: must be one of spawn, forkserver"):
        distributed.launch(_trial, 2, start_method="fork")  # a fork of a process that ran torch ops can hang


def _engine_trial(data_parallel=True, modes=("ghost", "bk"), every_step=False):
    """The library path (as under torchrun): make_private on a DPDDP model, individual accounting on
    (norms twice an epoch, or with ``every_step`` every step with ceil rounding); one run per
    grad_sample_mode (ghost clipping, book-keeping)."""
    from idpsgd.assignment import Budgets
    from idpsgd.engine import IndividualAccountingOptions, IndividualizedPrivacyEngine
    from idpsgd.engine.per_example.wrap import raw_module

    results = {}
    for mode in modes:
        torch.manual_seed(0)
        n = 240
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        if data_parallel:
            model = distributed.wrap_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=40)
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=7)
        engine.enable_individual_accounting(
            IndividualAccountingOptions(
                refreshes_per_epoch=6 if every_step else 2,
                validate_subset=0,
                rounding_step=0.1,
                rounding="ceil" if every_step else "nearest",
            )
        )
        out = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            method="sample",
            epochs=2,
            budgets=Budgets.from_groups([1.0, 3.0], [0.5, 0.5], n, 1e-5, seed=0),
            max_grad_norm=1.0,
            grad_sample_mode=mode,
        )
        model, opt, crit, loader = (
            out if mode == "ghost" else (out[0], out[1], torch.nn.functional.cross_entropy, out[2])
        )
        for _ in range(2):
            for xb, yb in loader:
                opt.zero_grad()
                crit(model(xb), yb).backward()
                opt.step()
        results[mode] = {
            "eps": engine.get_epsilon().per_group,
            "steps": engine.steps,
            "individual": engine.individual.epsilons(1e-5),
            "kind": engine.individual.kind,
            "check": engine.individual.sensitivity_check(),
            "bounds": engine.get_individual_epsilons(),
            "params": [p.detach().clone() for p in raw_module(model).parameters()],
        }
    return results


def test_ghost_and_bookkeeping_clipping_and_individual_accounting_match_one_process(two_ranks):
    """Ghost clipping and book-keeping on DPDDP, and individual accounting with norm passes sharded and
    all-gathered: two processes give the single-process run."""
    single = _engine_trial(data_parallel=False)
    two = two_ranks["engines"]
    for mode in ("ghost", "bk"):
        assert two[mode]["steps"] == single[mode]["steps"] == 12
        np.testing.assert_array_equal(two[mode]["eps"], single[mode]["eps"])
        np.testing.assert_allclose(two[mode]["individual"], single[mode]["individual"], rtol=1e-6)
        assert np.any(single[mode]["individual"] < single[mode]["eps"].max() - 1e-3)  # individual accounting works
        assert two[mode]["kind"] == single[mode]["kind"] == "estimate"  # norms twice an epoch, nearest
        np.testing.assert_array_equal(two[mode]["bounds"], single[mode]["bounds"])  # data-independent then
        for a, b in zip(two[mode]["params"], single[mode]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(single["bk"]["params"], single["ghost"]["params"], strict=True):  # the same update either way
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_sensitivity_check_is_reduced_over_ranks(two_ranks):
    """Norms every step (ceil): each rank checks its own sampled examples and the counts are summed over
    the ranks every step, so both ranks agree and the two-process record is the single-process one."""
    single = _engine_trial(data_parallel=False, modes=("bk",), every_step=True)["bk"]
    two = two_ranks["every_step"]["bk"]
    assert two["kind"] == single["kind"] == "guarantee"
    for key in ("steps", "examples", "compared", "exceeded", "mismatched"):
        assert two["check"][key] == single["check"][key], key
    assert single["check"]["examples"] > 0 and single["check"]["compared"] == single["check"]["examples"]
    np.testing.assert_allclose(two["bounds"], single["bounds"], rtol=1e-6)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "pdp-sgd", "--nproc", "2"], "PDP-SGD methods run in one process only"),
        (["--method", "sample", "--nproc", "0"], "must be an integer >= 1"),
    ],
)
def test_cli_refuses_what_nproc_cannot_honour(tmp_path, capsys, argv, message):
    from idpsgd.cli import main

    assert (
        main(
            [
                "train",
                "--budgets",
                "1,2",
                "--fractions",
                ".5,.5",
                "--out",
                str(tmp_path / "run"),
                "--epochs",
                "1",
                "--no-progress",
                *argv,
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err


def test_rank_reports_are_read_without_unpickling_code(tmp_path):
    """The ranks' result and error files load with weights_only: a crafted file runs nothing."""
    import os
    import pickle

    from idpsgd.engine.distributed import _load_error, _rebuild, _save_error
    from idpsgd.validation import InvalidParameterError

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(tmp_path / "error1.pt", "wb") as fh:
        pickle.dump(("error", Evil()), fh)
    record = _load_error(tmp_path / "error1.pt")
    assert not marker.exists() and record["type"] == "CheckpointError"
    _save_error(tmp_path / "error0.pt", InvalidParameterError("lr", -1.0, "must be > 0"))
    err = _rebuild(_load_error(tmp_path / "error0.pt"))
    assert isinstance(err, InvalidParameterError) and str(err) == str(InvalidParameterError("lr", -1.0, "must be > 0"))


def _a_write_on_one_rank(modes=("hooks", "ghost", "bk")):
    """Two steps per grad_sample_mode; in the second, rank 1's forward writes a buffer of its replica from the
    batch.  Returns each rank's record (gathered after the refusal: the ranks are still in step)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from idpsgd.engine import IndividualizedPrivacyEngine
    from idpsgd.engine.guards.integrity import UnnoisedWriteError

    rank, n = dist.get_rank(), 16
    records = {}
    for mode in modes:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        model.register_buffer("seen", torch.zeros(4))
        write = {"on": False}

        def record(module, args, write=write):
            if write["on"] and rank == 1:
                module.seen.add_(args[0].detach().mean(0))

        model.register_forward_pre_hook(record)
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
        out = engine.make_private_with_parameters(
            module=distributed.wrap_model(model),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=n),
            budgets=np.full(n, 1e3),
            target_delta=1e-5,
            sample_rates=np.ones(n),
            clip_norms=np.ones(n),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode=mode,
            privacy_filter=None,
        )
        module, opt, loader = out[0], out[1], out[-1]
        loss = out[2] if mode == "ghost" else F.cross_entropy
        errors, seconds = [], []
        for step in range(3):
            write["on"] = step == 1
            noise, params = engine._noise.get_state().clone(), [p.detach().clone() for p in model.parameters()]
            start = time.perf_counter()
            try:
                for xb, yb in loader:
                    opt.zero_grad()
                    loss(module(xb), yb).backward()
                    opt.step()
            except UnnoisedWriteError as exc:
                errors.append(str(exc))
                seconds.append(time.perf_counter() - start)
                assert torch.equal(engine._noise.get_state(), noise)  # no noise drawn
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
        records[mode] = {"steps": engine.steps, "charged": engine.accountant.steps, "errors": errors, "s": seconds}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    return everyone


def test_a_write_on_one_rank_refuses_the_step_on_every_rank_at_once(two_ranks):
    """Before (issue 35), the rank that found the write raised and the other waited in the gradient
    all-reduce until the collective timeout.  Now the verdict is all-reduced before the noise: both ranks
    refuse the step within seconds, nothing is drawn or charged, and both refuse every later step."""
    ranks = two_ranks["write"]
    for mode in ("hooks", "ghost", "bk"):
        zero, one = ranks[0][mode], ranks[1][mode]
        for r in (zero, one):
            assert r["steps"] == r["charged"] == 1  # the first step only
            assert len(r["errors"]) == 2 and "refused: earlier" in r["errors"][1]
            assert max(r["s"]) < 10  # not the 60 s collective timeout
        assert "persistent buffer 'seen' (module '(root)', Sequential) was written in place" in one["errors"][0]
        assert "rank 1 of 2" in zero["errors"][0] and "persistent buffer 'seen'" in zero["errors"][0]
        assert "no noise was drawn and nothing was charged" in zero["errors"][0]
