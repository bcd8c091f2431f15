"""IndividualizedPrivacyEngine: any DataLoader, accounting and filter, ghost/hooks/functorch, BMM,
secure randomness and bad input (issue: an Opacus-style engine)."""

import importlib.util
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from idpsgd import InvalidParameterError
from idpsgd.accounting import epsilon_sgm
from idpsgd.assignment import Budgets
from idpsgd.engine import IndividualizedPrivacyEngine, PrivacyBudgetExceeded
from support import toy_classification, toy_model

N, DELTA = 240, 1e-5


@pytest.fixture(scope="module")
def data():
    return toy_classification(N, 0.3)


@pytest.fixture(scope="module")
def budgets():
    return Budgets.from_groups([1.0, 3.0], [0.5, 0.5], N, DELTA, seed=0)


class DictData(Dataset):
    """Items are dicts with an extra field the model does not use."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i], "id": i}


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_dict_loader_trains_and_spends_each_groups_budget_at_the_plan(data, budgets):
    x, y = data
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    loader = DataLoader(DictData(x, y), batch_size=24)
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, budgets=budgets, method="sample", epochs=3, max_grad_norm=1.0
    )
    seen_ids = []
    for _ in range(3):
        for batch in loader:  # the user's dicts, unchanged (collated by default_collate)
            assert set(batch) == {"features", "label", "id"}
            seen_ids += batch["id"].tolist()
            opt.zero_grad()
            F.cross_entropy(model(batch["features"]), batch["label"]).backward()
            opt.step()
    assert engine.steps == 3 * round(1 / 0.1)
    eps = engine.get_epsilon().per_group
    assert np.all(eps <= engine.group_budgets) and np.all(eps >= 0.999 * engine.group_budgets)
    # per group, independently: the SGM at the group's (q, σ) for the planned steps
    for g in engine.privacy_groups():
        ref = float(epsilon_sgm(g["sample_rate"], g["noise_multiplier"], engine.steps, DELTA))
        assert g["epsilon"] == pytest.approx(ref, rel=1e-9)
    ind = engine.get_individual_epsilons()
    assert np.allclose(ind, eps[np.searchsorted(engine.group_budgets, budgets.epsilons)])
    # Sample: the strict group is sampled less often
    rates = [g["sample_rate"] for g in engine.privacy_groups()]
    assert rates[0] < rates[1]
    counts = np.bincount(seen_ids, minlength=N)
    assert counts[budgets.epsilons == 1].mean() < counts[budgets.epsilons == 3].mean()


def test_filter_refuses_the_step_over_budget_and_warn_mode_continues(data, budgets):
    x, y = data
    for action in ("raise", "warn"):
        model = toy_model()
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
            budgets=budgets,
            method="scale",
            steps=15,
            filter_action=action,
        )
        taken = 0

        def one_step(xb, yb, model=model, opt=opt):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(3):
                    for xb, yb in loader:
                        one_step(xb, yb)
                        taken += 1
            except PrivacyBudgetExceeded as exc:
                refused = str(exc)
            else:
                refused = None
        if action == "raise":
            assert "step 16 would take a privacy group over its budget" in refused
            before = _params(model)
            assert taken == 15 and engine.steps == 15 and not engine.can_step()
            assert np.all(engine.get_epsilon().per_group <= engine.group_budgets)
            with pytest.raises(PrivacyBudgetExceeded):  # refused again, parameters untouched
                one_step(*next(iter(loader)))
            assert torch.equal(before, _params(model))
        else:
            assert taken == 30 and engine.steps == 30
            assert any("filter_action='warn'" in str(w.message) for w in caught)
            assert np.any(engine.get_epsilon().per_group > engine.group_budgets)  # reported honestly


def _run_mode(data, budgets, mode, bmm=None, seed=3, clip=0.05):
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=seed)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        budgets=budgets,
        method="scale",
        epochs=1,
        max_grad_norm=clip,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        model, opt, criterion, loader = out
    else:
        (model, opt, loader), criterion = out, nn.CrossEntropyLoss()
    norms = []

    def train_on(batches):
        for xb, yb in batches:
            opt.zero_grad()
            criterion(model(xb), yb).backward()
            opt.step()
            if opt.last_norms is not None and not opt._is_last_step_skipped:
                norms.append(opt.last_norms.clone())

    if bmm:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=bmm, optimizer=opt) as small:
            train_on(small)
    else:
        train_on(loader)
    return _params(model), torch.cat(norms), engine


def test_ghost_functorch_and_hooks_give_the_same_update(data, budgets):
    hooks, n_hooks, _ = _run_mode(data, budgets, "hooks")
    ghost, n_ghost, _ = _run_mode(data, budgets, "ghost")
    func, _, _ = _run_mode(data, budgets, "functorch")
    assert torch.allclose(hooks, ghost, atol=1e-6) and torch.allclose(hooks, func, atol=1e-6)
    assert torch.allclose(n_hooks, n_ghost, rtol=1e-4)
    assert not torch.allclose(hooks, _run_mode(data, budgets, "hooks", seed=4)[0])  # noise matters


def test_batch_memory_manager_splits_batches_without_changing_the_update(data, budgets):
    full, _, e_full = _run_mode(data, budgets, "hooks")
    split, _, e_split = _run_mode(data, budgets, "hooks", bmm=5)
    assert e_split.steps == e_full.steps == 10
    assert torch.allclose(full, split, atol=1e-5)
    ghost_split, _, _ = _run_mode(data, budgets, "ghost", bmm=5)
    assert torch.allclose(full, ghost_split, atol=1e-5)


def test_clipping_uses_each_examples_norm_and_exposes_norms(data, budgets):
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        budgets=budgets,
        method="scale",
        steps=3,
    )
    xb, yb = next(iter(loader))  # lr 0: the parameters stay those the norms were taken at
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    opt.step()
    raw = model._module
    model.disable_hooks()
    for k, i in enumerate(opt.last_indices.tolist()):  # norms match autograd per example
        grads = torch.autograd.grad(F.cross_entropy(raw(x[i : i + 1]), y[i : i + 1]), list(raw.parameters()))
        ref = torch.sqrt(sum((g**2).sum() for g in grads))
        assert float(opt.last_norms[k]) == pytest.approx(float(ref), rel=1e-4)
    model.enable_hooks()
    c = engine.parameters.clip_norms
    assert c[budgets.epsilons == 1][0] < c[budgets.epsilons == 3][0]  # Scale: per-group clip norms
    norms, losses = engine.per_example_grad_norms(indices=opt.last_indices.numpy())
    assert norms.shape == losses.shape == (len(opt.last_indices),)


class Pairs(Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return {"a": torch.full((2,), float(i)), "b": [torch.tensor(i), torch.tensor(1.0)]}


def test_empty_batches_keep_the_structure_of_a_custom_collate():
    def collate(items):
        return {
            "x": torch.stack([it["a"] for it in items]),
            "pair": [torch.stack([it["b"][0] for it in items]), torch.stack([it["b"][1] for it in items])],
        }

    model = nn.Linear(2, 1)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    b = Budgets.from_array(np.full(30, 8.0), DELTA)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(Pairs(), batch_size=1, collate_fn=collate),
        budgets=b,
        method="uniform",
        steps=30,
    )
    sizes = []
    for batch in loader:  # rate 1/30: many empty batches, the very first ones too
        assert set(batch) == {"x", "pair"} and batch["x"].shape[1:] == (2,) and len(batch["pair"]) == 2
        sizes.append(len(batch["x"]))
        opt.zero_grad()
        model(batch["x"]).sum().backward()
        opt.step()
    assert 0 in sizes and engine.steps == 30


def test_seeds_replay_secure_mode_refuses_them_and_draws_fresh_randomness(data, budgets):
    a, _, ea = _run_mode(data, budgets, "hooks", seed=11)
    b, _, _ = _run_mode(data, budgets, "hooks", seed=11)
    assert torch.equal(a, b) and ea.seed == 11
    assert IndividualizedPrivacyEngine().seed is None  # without a seed: drawn (and recorded) at the first draw
    with pytest.raises(InvalidParameterError, match="seed=3 is invalid: must not be given in secure mode"):
        IndividualizedPrivacyEngine(secure_mode=True, seed=3)
    runs = []
    for _ in range(2):
        x, y = data
        model = toy_model()
        engine = IndividualizedPrivacyEngine(accountant="rdp", secure_mode=True)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
            budgets=budgets,
            method="sample",
            steps=3,
        )
        assert engine.seed is None and opt.secure_mode
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            break
        runs.append(_params(model))
        assert "noise" not in engine.state_dict() and "sampler" not in engine.state_dict()
    assert not torch.equal(runs[0], runs[1])


def test_state_dict_round_trip_continues_identically(data, budgets):
    x, y = data

    def setup():
        model = toy_model()
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=5)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
            budgets=budgets,
            method="sample",
            epochs=2,
        )
        return engine, model, opt, loader

    def epoch(model, opt, loader):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    e1, m1, o1, l1 = setup()
    epoch(m1, o1, l1)
    state, weights = e1.state_dict(), {k: v.clone() for k, v in m1._module.state_dict().items()}
    epoch(m1, o1, l1)
    e2, m2, o2, l2 = setup()
    m2._module.load_state_dict(weights)
    e2.load_state_dict(state)
    assert e2.steps == 10
    epoch(m2, o2, l2)
    assert torch.equal(_params(m1), _params(m2)) and e2.steps == e1.steps == 20


def test_bad_input_is_a_clear_error(data, budgets):
    x, y = data
    loader = DataLoader(TensorDataset(x, y), batch_size=24)
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(x, y, strict=True)

    cases = [
        (dict(data_loader=DataLoader(Stream(), batch_size=4)), "map-style Dataset"),
        (dict(budgets=Budgets.from_array(np.ones(10), DELTA)), "need one per example of the data loader's dataset"),
        (dict(optimizer=torch.optim.SGD(toy_model().parameters(), lr=0.1)), "not the module's"),
        (dict(method="fancy"), "method='fancy' is invalid"),
        (dict(epochs=None, steps=None), "exactly one of epochs and steps"),
        (dict(grad_sample_mode="ghost_fsdp"), "grad_sample_mode='ghost_fsdp' is invalid"),
        (dict(budgets=np.ones(N)), "target_delta"),
    ]
    base = dict(module=model, optimizer=opt, data_loader=loader, budgets=budgets, method="sample", epochs=1)
    for change, message in cases:
        with pytest.raises(InvalidParameterError, match=message):
            engine.make_private(**{**base, **change})
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    with pytest.raises(InvalidParameterError, match="cannot be trained privately by Opacus"):
        engine.make_private(**{**base, "module": bn, "optimizer": torch.optim.SGD(bn.parameters(), lr=0.1)})
    with pytest.raises(InvalidParameterError, match="accountant='gdp' is invalid"):
        IndividualizedPrivacyEngine(accountant="gdp")  # Opacus's GDP is not offered (rdp, pld, prv are)
    assert engine.accountant is None  # nothing was half set up by the refused calls


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, _CUDA])])
def test_trains_on_the_models_device(data, budgets, device):
    """The planned 5 steps of an epoch of 10 batches, on the model's device (the CPU twin runs the same body
    everywhere: the CUDA one had never run, and trained past its plan into the filter's refusal)."""
    x, y = data
    model = toy_model().to(device)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        budgets=budgets,
        method="scale",
        steps=5,
    )
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
        assert opt.last_norms is None or opt.last_norms.device.type == device
        if engine.steps == 5:
            break
    assert engine.steps == 5 and all(p.device.type == device for p in model.parameters())


def _private(data, budgets, **kw):
    x, y = data
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = IndividualizedPrivacyEngine(**{"accountant": "rdp", **kw})
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        budgets=budgets,
        method="scale",
        epochs=2,
        max_grad_norm=1.0,
    )
    return engine, model, opt, loader


def test_a_step_must_train_on_the_batch_just_drawn_whole(data, budgets):
    from idpsgd.engine.sampling.sampler import BatchMismatchError

    engine, model, opt, loader = _private(data, budgets, seed=0)
    it = iter(loader)
    next(it)
    xb, yb = next(it)  # two batches drawn, the second trained: clip norms would be the first's
    before = _params(model)
    F.cross_entropy(model(xb), yb).backward()
    with pytest.raises(BatchMismatchError, match="drawn batch"):
        opt.step()
    assert engine.steps == 0 and torch.equal(before, _params(model))
    opt.zero_grad()
    xb, yb = next(it)  # one batch, one example dropped
    F.cross_entropy(model(xb[1:]), yb[1:]).backward()
    with pytest.raises(BatchMismatchError, match="part of a drawn batch"):
        opt.step()
    assert engine.steps == 0
    opt.zero_grad()
    xb, yb = next(it)  # and the right use still works afterwards
    F.cross_entropy(model(xb), yb).backward()
    opt.step()
    assert engine.steps == 1


def test_the_noise_is_opacus_draw_and_the_noised_gradient_is_written_into_it(data, budgets, monkeypatch):
    """Outside secure mode the noise is exactly Opacus's draw (same generator state, same values); the noisy
    gradient is summed into the drawn noise tensor (no third parameter-sized tensor), bit for bit summed + noise."""
    from opacus.optimizers.optimizer import _generate_noise

    from idpsgd.engine.noise import optimizer as noise_optimizer
    from idpsgd.engine.noise.randomness import gaussian_like

    ref = torch.zeros(3, 5, dtype=torch.float64)
    ours = gaussian_like(0.7, ref, torch.Generator().manual_seed(3), False)
    assert ours.dtype == torch.float64 and torch.equal(
        ours, _generate_noise(0.7, ref, torch.Generator().manual_seed(3))
    )
    drawn = []

    def recorded(*args):
        noise = gaussian_like(*args)
        drawn.append((noise, noise.clone(), args[1].clone()))
        return noise

    monkeypatch.setattr(noise_optimizer, "gaussian_like", recorded)
    engine, model, opt, loader = _private(data, budgets, seed=0)
    monkeypatch.setattr(opt, "scale_grad", lambda: None)  # (the normalisation after the noise: values compared)
    for xb, yb in loader:
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        break
    params = [p for p in model.parameters() if p.requires_grad]
    assert engine.steps == 1 and len(drawn) == len(params)
    for p, (noise, value, summed) in zip(params, drawn, strict=True):
        assert p.grad.data_ptr() == noise.data_ptr()
        assert torch.equal(p.grad, (summed + value).view_as(p))


def test_secure_noise_never_comes_from_a_seeded_torch_generator(data, budgets):
    from idpsgd.engine.noise.randomness import OsEntropyNormal, gaussian_like

    engine, model, opt, loader = _private(data, budgets, secure_mode=True)
    if importlib.util.find_spec("torchcsprng") is None:
        assert isinstance(opt.generator, OsEntropyNormal)
    z = gaussian_like(2.0, torch.zeros(200_000), OsEntropyNormal(), True)
    assert abs(float(z.mean())) < 0.03 and abs(float(z.std()) - 2.0) < 0.03
    w = gaussian_like(2.0, torch.zeros(200_000), OsEntropyNormal(), True)
    assert not torch.equal(z, w)
    for xb, yb in loader:  # a secure step runs and is charged
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        break
    assert engine.steps == 1


def test_a_saved_state_is_refused_by_an_engine_with_other_parameters(data, budgets):
    engine, _model, _opt, _loader = _private(data, budgets, seed=0)
    state = engine.state_dict()
    other, *_ = _private(data, Budgets.from_groups([2.0, 5.0], [0.5, 0.5], N, DELTA, seed=0), seed=0)
    with pytest.raises(ValueError, match="other sampling rates"):
        other.load_state_dict(state)
    same, *_ = _private(data, budgets, seed=0)
    same.load_state_dict(state)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_an_empty_batch_needs_no_backward_pass(data, mode):
    """A model that cannot run on zero rows (Hugging Face transformers) skips the forward and backward
    pass of an empty Poisson batch and calls step(): the same noise-only step, charged the same."""
    x, y = data
    runs = []
    for skip in (False, True):
        model = toy_model()
        engine = IndividualizedPrivacyEngine(seed=5)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=1),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sample_rate=2e-3,
            target_delta=DELTA,
            grad_sample_mode=mode,
        )  # mostly empty batches
        sizes = []
        for step, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            if len(yb) or not skip:
                F.cross_entropy(model(xb), yb).backward()
            opt.step()
            sizes.append(len(yb))
            if step == 40:
                break
        runs.append((_params(model), engine.steps, sizes))
    assert 0 in runs[0][2] and any(runs[0][2]) and runs[0][2] == runs[1][2]
    assert runs[0][1] == runs[1][1] == 41
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)


def test_a_step_without_a_backward_pass_over_a_drawn_batch_is_refused(data):
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(seed=0)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        target_delta=DELTA,
        grad_sample_mode="bk",
    )
    xb, _ = next(iter(loader))
    assert len(xb) > 0
    with pytest.raises(RuntimeError, match="no per-example gradients were recorded"):
        opt.step()
    assert engine.steps == 0
