"""Opacus's examples and tutorials as clients: a fast test of each thing they use (each failed before; issue 38).

``grad_sample_mode="no_op"`` (per-sample gradients the user computes), ``wrap_model=False`` (Opacus
1.6's hooks without a wrapper), budgets with ``make_private(noise_multiplier=...)``, and the small
contract differences (expected batch size, sample rate, ``DPDataLoader``, ``len(accountant)``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import InvalidParameterError
from idpsgd.engine import IndividualizedPrivacyEngine

DELTA = 1e-5


def _data(n=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return x, (x[:, 0] > 0).long()


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))


def _setup(mode="hooks", seed=3, n=100, batch_size=20, **kw):
    x, y = _data(n)
    model = _model()
    engine = IndividualizedPrivacyEngine(seed=seed)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=kw.pop("noise_multiplier", 1.0),
        max_grad_norm=kw.pop("max_grad_norm", 0.5),
        grad_sample_mode=mode,
        **kw,
    )
    return engine, model, *out


def _per_sample_grads(model, xb, yb):
    """Each example's loss gradient with torch.func (the functorch path of Opacus's cifar10 example)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x1, y1):
        return F.cross_entropy(functional_call(model, p, (x1.unsqueeze(0),)), y1.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, xb, yb)


def _train_no_op(model, opt, loader, rows=None):
    for xb, yb in loader:
        opt.zero_grad()
        gs = _per_sample_grads(model, xb, yb)
        for k, p in model.named_parameters():
            p.grad_sample = gs[k] if rows is None else gs[k][:rows]
        opt.step()


def _train(model, opt, loader):
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb, reduction="mean").backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --- grad_sample_mode="no_op" --------------------------------------------------------------------------
def test_no_op_clips_the_users_per_sample_gradients_as_hooks_mode():
    """The user's per-sample gradients (vmap over grad), clipped at c_i, noised and accounted: the same
    update as hooks mode with the same seed (hooks' "mean" reduction gives the same per-example rows)."""
    e1, m1, _w1, o1, l1 = _setup("hooks")
    _train(m1, o1, l1)
    e2, m2, w2, o2, l2 = _setup("no_op")
    assert type(w2).__name__ == "GradSampleModuleNoOp"
    _train_no_op(m2, o2, l2)
    assert e2.steps == e1.steps == 5 and float(e2.get_epsilon(DELTA)) == float(e1.get_epsilon(DELTA))
    assert torch.allclose(_flat(m1), _flat(m2), atol=1e-5)
    assert "your per-sample gradient" in next(iter(e2.layer_paths.values()))


def test_no_op_refuses_gradients_that_are_not_one_row_per_drawn_example():
    from idpsgd.engine.sampling.sampler import BatchMismatchError

    engine, model, _w, opt, loader = _setup("no_op", batch_size=10)
    with pytest.raises(BatchMismatchError, match="only part of a drawn batch"):
        _train_no_op(model, opt, loader, rows=1)  # a partial batch
    assert engine.steps == 0
    xb, yb = next(iter(loader))
    opt.zero_grad()
    gs = _per_sample_grads(model, xb, yb)
    for k, p in model.named_parameters():
        p.grad_sample = gs[k].sum(0, keepdim=True).expand(len(xb), *p.shape).reshape(len(xb), -1)
    with pytest.raises(BatchMismatchError, match=r"per-sample gradient has shape .* one gradient of the parameter"):
        opt.step()
    xb, yb = next(iter(loader))
    opt.zero_grad()
    (p0, *_rest) = list(model.parameters())
    p0.grad_sample = _per_sample_grads(model, xb, yb)["0.weight"]
    with pytest.raises(ValueError, match="no p.grad_sample was assigned"):
        opt.step()  # the other parameters have none
    assert engine.steps == 0
    with pytest.raises(InvalidParameterError, match="batch_first=False is invalid: is not supported with .*'no_op'"):
        _setup("no_op", batch_first=False)


# --- wrap_model=False -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["hooks", "functorch", "no_op"])
def test_wrap_model_false_trains_the_users_module_as_the_wrapped_one(mode):
    e1, m1, w1, o1, l1 = _setup(mode)
    _train_no_op(m1, o1, l1) if mode == "no_op" else _train(w1, o1, l1)
    e2, m2, hooks, o2, l2 = _setup(mode, wrap_model=False)
    assert not isinstance(hooks, nn.Module) and hooks._module is m2  # Opacus's hooks object, for cleanup
    (_train_no_op if mode == "no_op" else _train)(m2, o2, l2)  # the user's own module
    assert e2.steps == e1.steps == 5 and float(e2.get_epsilon(DELTA)) == float(e1.get_epsilon(DELTA))
    assert torch.allclose(_flat(m1), _flat(m2), atol=1e-5)
    assert e2.layer_paths == e1.layer_paths


def test_wrap_model_false_a_second_phase_replaces_the_engines_hooks_and_refuses_elsewhere():
    engine, model, *_ = _setup("hooks", wrap_model=False)
    x, y = _data()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=20),
        noise_multiplier=1.0,
        max_grad_norm=0.5,
        wrap_model=False,
    )
    _train(model, out[1], out[2])
    assert engine.steps == 5
    with pytest.raises(InvalidParameterError, match="hooks attached already .*remove_hooks"):
        IndividualizedPrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=20),
            noise_multiplier=1.0,
            max_grad_norm=0.5,
            wrap_model=False,
        )
    for mode in ("ghost", "bk", "ew"):
        with pytest.raises(InvalidParameterError, match=f"wrap_model=False is invalid: is not supported with .*{mode}"):
            _setup(mode, wrap_model=False)
    from idpsgd.engine.per_example.wrap import check_wrappable

    class DistributedDataParallel(nn.Module):  # the name raw_module unwraps (no process group needed here)
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(InvalidParameterError, match="wrap_model=False is invalid: is not supported for a Distributed"):
        check_wrappable(DistributedDataParallel(_model()), "hooks", wrap_model=False)


# --- budgets with make_private(noise_multiplier=...) ------------------------------------------------------
def _budgeted(sigma, method=None, accountant="rdp", **kw):
    from idpsgd.assignment import Budgets

    x, y = _data(300)
    model = _model()
    engine = IndividualizedPrivacyEngine(seed=0, accountant=accountant)
    budgets = Budgets.from_groups([1.0, 2.0, 3.0], [0.3, 0.4, 0.3], 300, DELTA)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        budgets=budgets,
        method=method,
        **kw,
    )
    return engine, out


@pytest.mark.parametrize("sigma", [1.0, 3.0])
def test_budgets_with_a_noise_multiplier_solve_each_groups_rate_for_its_budget(sigma):
    """Before: sigma = 1 was refused at make_private ("at most 0 steps"), sigma = 3 gave every group the
    same epsilon (0.88): the budgets only capped.  Now each group spends its own budget (Sample)."""
    engine, (_m, _o, loader) = _budgeted(sigma, epochs=3)
    assert engine.parameters.noise_multiplier == sigma and engine.parameters.steps == 30
    eps = engine.get_epsilon(DELTA, steps=30).per_group
    assert np.all(eps <= [1.0, 2.0, 3.0]) and np.all(eps >= 0.999 * np.array([1.0, 2.0, 3.0]))
    rates = [g["sample_rate"] for g in engine.privacy_groups()]
    assert rates[0] < rates[1] < rates[2] and len(loader) == 10
    _train(*_budgeted(sigma, epochs=3)[1])  # trains its plan, the filter admits every step


def test_budgets_with_a_noise_multiplier_scale_solves_clip_norms_and_needs_a_plan():
    engine, _out = _budgeted(3.0, method="scale", steps=30)
    groups = engine.privacy_groups()
    assert [g["sample_rate"] for g in groups] == [0.1, 0.1, 0.1]
    assert groups[0]["clip_norm"] < groups[1]["clip_norm"] < groups[2]["clip_norm"]
    eps = engine.get_epsilon(DELTA, steps=30).per_group
    assert np.all(eps <= [1.0, 2.0, 3.0]) and np.all(eps >= 0.999 * np.array([1.0, 2.0, 3.0]))
    with pytest.raises(InvalidParameterError, match=r"epochs=None is invalid: give epochs= or steps= with budgets"):
        _budgeted(3.0)
    with pytest.raises(InvalidParameterError, match=r"method='uniform' is invalid: with noise_multiplier must be"):
        _budgeted(3.0, method="uniform", epochs=1)


# --- small contract differences --------------------------------------------------------------------------
def test_expected_batch_size_sample_rate_loader_type_and_accountant_length_as_opacus():
    from opacus.data_loader import DPDataLoader

    engine, _model, wrapped, opt, loader = _setup("hooks", batch_size=10)  # N = 100: q = 0.1, 10 per batch
    assert opt.expected_batch_size == 10 and isinstance(opt.expected_batch_size, int)  # Opacus: int(N q)
    assert loader.sample_rate == 0.1 and engine.parameters.expected_batch_size == 10
    assert isinstance(loader, DPDataLoader) and loader.distributed is False
    _train(wrapped, opt, loader)
    assert len(engine.accountant) == 1 and engine.steps == 10  # Opacus: len = history entries, not steps
    with pytest.raises(TypeError, match="built by IndividualizedPrivacyEngine.make_private"):
        type(loader).from_data_loader(loader)


# --- budgets for a random_split subset -----------------------------------------------------------------------
def test_budgets_for_a_random_split_subset():
    from torch.utils.data import Subset, random_split

    from idpsgd.assignment import Budgets

    x, y = _data(100)
    full = TensorDataset(x, y)
    budgets = Budgets.from_class_map(y.numpy(), {0: 1.0, 1: 3.0}, DELTA)
    train, _test = random_split(full, [80, 20], generator=torch.Generator().manual_seed(0))
    sub = budgets.for_subset(train)
    assert len(sub) == 80 and np.array_equal(sub.epsilons, np.where(y.numpy()[train.indices] == 1, 3.0, 1.0))
    inner = Subset(train, [3, 1])  # nested
    assert np.array_equal(budgets.for_subset(inner).epsilons, budgets.epsilons[[train.indices[3], train.indices[1]]])
    with pytest.raises(InvalidParameterError, match="must index these budgets' 100 examples"):
        budgets.for_subset(np.array([100]))
