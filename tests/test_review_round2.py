"""Privacy review, round two (attacks on the issue 35 / 38 fixes): each test failed before its fix."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from batch_mixing_models import D, K, N
from idpsgd.engine.guards.batch_independence import BatchMixingError
from sensitivity_harness import MODES, Case, _no_noise, private


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, K)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _build():
    torch.manual_seed(1)
    return _MLP().double()


def _center_input(_module, args):
    return (args[0] - args[0].mean(0),)


def _center_output(_module, _args, out):
    return out - out.mean(0)


_X = torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
_Y = torch.arange(N) % K


def _step(on: str, hook: str, mode: str):
    """One step with a batch-mixing forward (pre-)hook on the user's model or on the module make_private returns."""
    with mock.patch("idpsgd.engine.noise.optimizer.gaussian_like", _no_noise):
        case = Case(_build, _X, _Y, None)
        if on == "model":
            model = _build()
            case = Case(lambda: model, _X, _Y, None)
            (
                model.register_forward_pre_hook(_center_input)
                if hook == "pre"
                else model.register_forward_hook(_center_output)
            )
        _engine, module, optimizer, criterion, loader = private(case, _X, _Y, mode)
        if on == "wrapper":
            (
                module.register_forward_pre_hook(_center_input)
                if hook == "pre"
                else module.register_forward_hook(_center_output)
            )
        xb, yb = next(iter(loader))
        out = module(xb)
        loss = criterion(out, yb) if criterion is not None else nn.functional.cross_entropy(out, yb, reduction="sum")
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("on", ["model", "wrapper"])
@pytest.mark.parametrize("hook", ["pre", "post"])
def test_a_batch_mixing_forward_hook_on_the_root_or_the_wrapper_is_refused(hook, on, mode):
    """The check ran ``model.forward`` alone: a user's forward pre-hook or hook on the model (or on the module
    make_private returns) that centres the batch trained with ‖ΔS‖ = 1.5 at c = 1 in every mode."""
    with pytest.raises(BatchMixingError, match="mixes examples within the batch"):
        _step(on, hook, mode)


def test_a_per_example_root_hook_still_trains():
    model = _build()
    model.register_forward_pre_hook(lambda _m, args: (2 * args[0],))
    model.register_forward_hook(lambda _m, _a, out: out.tanh())
    with mock.patch("idpsgd.engine.noise.optimizer.gaussian_like", _no_noise):
        _engine, module, optimizer, _c, loader = private(Case(lambda: model, _X, _Y, None), _X, _Y, "hooks")
        xb, yb = next(iter(loader))
        nn.functional.cross_entropy(module(xb), yb, reduction="sum").backward()
        optimizer.step()


# --- csv without test.csv: the hidden split is a function of N only --------------------------------------
# the hidden split's warning, asserted by test_the_hidden_split_is_warned_as_not_covered_once_on_one_line
HIDDEN_SPLIT_NOTICE = "ignore:csv without test.csv:UserWarning"


def _write_csv(path, labels):
    rows = ["a,b,label", *(f"{i % 7 / 7:.3f},{(i * 3) % 5 / 5:.3f},{lab}" for i, lab in enumerate(labels))]
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.csv").write_text("\n".join(rows) + "\n")


@pytest.mark.filterwarnings(HIDDEN_SPLIT_NOTICE)
def test_the_hidden_csv_split_does_not_depend_on_the_labels(tmp_path):
    """A split stratified by the labels moved 16 of 90 rows between train and test when one row's label
    changed (24 when a row was added): the neighbours trained on sets differing in many rows."""
    from idpsgd.data import load_dataset

    labels = [i % 3 for i in range(90)]
    other = list(labels)
    other[10] = 2  # one row replaced (zero-out keeps N)
    _write_csv(tmp_path / "D", labels)
    _write_csv(tmp_path / "Dp", other)
    a = load_dataset("csv", tmp_path / "D", num_classes=3).split
    b = load_dataset("csv", tmp_path / "Dp", num_classes=3).split
    assert a["train_rows"].tolist() == b["train_rows"].tolist()
    assert a["test_rows"].tolist() == b["test_rows"].tolist()
    assert len(a["test_rows"]) == 18


@pytest.mark.filterwarnings(HIDDEN_SPLIT_NOTICE)
def test_a_class_with_one_row_is_not_refused_by_the_hidden_split(tmp_path):
    """The stratified split refused a class with a single row: a refusal that depended on one row's label."""
    from idpsgd.data import load_dataset

    _write_csv(tmp_path, [*(i % 2 for i in range(20)), 2])
    data = load_dataset("csv", tmp_path, num_classes=3)
    assert len(data.y_train) + len(data.split["test_rows"]) == 21


# --- a language model's flattened logits (B·T, V) ----------------------------------------------------------
class _FlatLogits(nn.Module):
    def __init__(self, mix: bool = False):
        super().__init__()
        self.emb, self.out, self.mix = nn.Embedding(20, 8), nn.Linear(8, 20), mix

    def forward(self, x):
        h = self.emb(x)
        if self.mix:
            h = h - h.mean(0)
        return self.out(h).view(-1, 20)  # (B·T, V), batch-first rows


def test_flattened_batch_first_logits_are_checked_not_refused():
    """``logits.view(-1, V)`` (the char-LM pattern) was refused as 'no tensor whose leading dimension is
    the batch'; its rows are checked per example now, and a mixing one is still refused."""
    from idpsgd.engine.guards.batch_independence import check_batch_independence

    x = torch.randint(1, 20, (6, 4))
    check_batch_independence(_FlatLogits(), (x,), {})
    with pytest.raises(BatchMixingError, match="mixes examples within the batch"):
        check_batch_independence(_FlatLogits(mix=True), (x,), {})


def test_the_hidden_split_is_warned_as_not_covered_once_on_one_line(tmp_path):
    """The test metrics of a csv run without test.csv come from private held-out rows: a public, data-independent
    warning says so (they were printed and written to report.json as if computed on public test data)."""
    import json

    from idpsgd.data import HIDDEN_SPLIT_WARNING, load_dataset
    from support import cli_process

    _write_csv(tmp_path / "data", [i % 3 for i in range(60)])
    argv = ["train", "--method", "uniform", "--budgets", "2", "--fractions", "1", "--dataset", "csv"]
    argv += ["--data-dir", str(tmp_path / "data"), "--num-classes", "3", "--epochs", "1", "--batch-size", "16"]
    code, _, stderr = cli_process([*argv, "--seed", "0", "--out", str(tmp_path / "out")], tmp_path, show_warnings=True)
    assert code == 0, stderr
    assert stderr.count(f"idpsgd train: warning: {HIDDEN_SPLIT_WARNING}\n") == 1, stderr
    assert "UserWarning" not in stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "not differentially private" in json.dumps(report)
    with pytest.warns(UserWarning, match="csv without test.csv"):
        load_dataset("csv", tmp_path / "data", num_classes=3)


# --- no_op with individual accounting: the user's vmap over the model -------------------------------------
def test_no_op_per_sample_gradients_by_vmap_train_with_individual_accounting():
    """Individual accounting's norm pass attaches the batch-independence check to the user's model; in no_op
    mode the user's own ``vmap(grad(functional_call(model, ...)))`` then ran the check under vmap and failed
    with "vmap: called random operation" (its synthetic batch is drawn from a generator)."""
    import numpy as np
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd import IndividualizedPrivacyEngine
    from idpsgd.assignment import Budgets
    from idpsgd.engine import IndividualAccountingOptions

    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")  # not about the accountant: no PRV calibration
    engine.enable_individual_accounting(IndividualAccountingOptions(refreshes_per_epoch=1, validate_subset=0))
    _hooks, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10),
        budgets=Budgets.from_array(np.full(40, 4.0), 1e-5),
        method="uniform",
        epochs=1,
        max_grad_norm=1.0,
        grad_sample_mode="no_op",
        wrap_model=False,
    )

    def loss(params, xi, yi):
        return F.cross_entropy(functional_call(model, params, (xi[None],)), yi[None])

    for xb, yb in loader:
        opt.zero_grad()
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, xb, yb)
        for k, p in model.named_parameters():
            p.grad_sample = per_sample[k]
        opt.step()
    assert engine.steps == 4


def test_the_norm_pass_still_refuses_a_mixing_model_in_no_op_mode():
    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd import IndividualizedPrivacyEngine
    from idpsgd.assignment import Budgets
    from idpsgd.engine import IndividualAccountingOptions

    model = _build()
    model.register_forward_pre_hook(_center_input)
    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")  # not about the accountant: no PRV calibration
    engine.enable_individual_accounting(IndividualAccountingOptions(refreshes_per_epoch=1, validate_subset=0))
    with pytest.raises(BatchMixingError, match="mixes examples within the batch"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(_X, _Y), batch_size=N),
            budgets=Budgets.from_array(np.full(N, 4.0), 1e-5),
            method="uniform",
            epochs=1,
            max_grad_norm=1.0,
            grad_sample_mode="no_op",
            wrap_model=False,
        )
