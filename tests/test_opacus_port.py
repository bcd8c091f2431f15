"""An Opacus 1.6 user ports in two lines (the engine's Opacus-compatible API), and the friction a
port hits: norm passes through the loader's collate_fn, CSV budget columns, set-up refusals (issue 24)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from idpsgd import InvalidParameterError
from idpsgd.assignment import Budgets
from idpsgd.engine import FilterOptions, IndividualizedPrivacyEngine, PrivacyBudgetExceeded
from support import file_mode, per_example_norms, toy_classification, toy_model

N, DELTA = 240, 1e-5


@pytest.fixture(scope="module")
def data():
    return toy_classification(N, 0.3)


# --- every norm pass goes through the loader's own collate_fn -------------------------------------
MEAN, SCALE = 0.5, 3.0


def scaling_collate(items):
    """A collate that transforms: the model sees (x − MEAN)·SCALE, never the raw tensors."""
    x = torch.stack([it[0] for it in items])
    y = torch.stack([it[1] for it in items])
    return (x - MEAN) * SCALE, y


def dict_collate(items):
    return {
        "features": (torch.stack([it[0] for it in items]) - MEAN) * SCALE,
        "label": torch.stack([it[1] for it in items]),
    }


def dict_loss(module, batch):
    return F.cross_entropy(module(batch["features"]), batch["label"], reduction="none")


@pytest.mark.parametrize(
    ("collate", "loss"), [(scaling_collate, None), (dict_collate, dict_loss)], ids=["transforming", "dict"]
)
def test_norm_passes_use_the_loaders_collate_on_a_tensor_dataset(data, collate, loss):
    """engine.per_example_grad_norms, individual accounting and the individual filter compute the
    norms of the inputs the model trains on: the loader's collate_fn applied to the dataset's items
    (bug 1: a TensorDataset was sliced directly, skipping the collate)."""
    x, y = data
    budgets = Budgets.from_groups([2.0, 4.0], [0.5, 0.5], N, DELTA, seed=0)
    model = toy_model()
    ref = per_example_norms(model, (x - MEAN) * SCALE, y)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    tracker = engine.enable_individual_accounting(per_sample_loss=loss)
    model, _opt, _loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24, collate_fn=collate),
        budgets=budgets,
        method="sample",
        steps=3,
    )
    norms, _ = engine.per_example_grad_norms(loss)
    assert np.allclose(norms, ref, rtol=1e-4)
    first, _ = tracker.grad_norms(np.arange(10))  # the individual accountant's refresh pass
    assert np.allclose(first, ref[:10], rtol=1e-4)

    filt = IndividualizedPrivacyEngine(accountant="rdp", seed=0)  # the individual filter's norm pass
    m2 = toy_model()
    filt.make_private_with_parameters(
        module=m2,
        optimizer=torch.optim.SGD(m2.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24, collate_fn=collate),
        budgets=budgets,
        sample_rates=np.full(N, 0.1),
        clip_norms=np.full(N, 100.0),
        noise_multiplier=5.0,
        max_grad_norm=100.0,
        steps=3,
        privacy_filter="individual",
        per_sample_loss=loss,
        filter_options=FilterOptions(rounding_step=1e-4),
    )
    assert np.all(filt.filter.bounds >= ref * (1 - 1e-4)) and np.all(filt.filter.bounds <= ref + 2e-4)
    assert np.allclose(filt.per_example_grad_norms(loss)[0], ref, rtol=1e-4)


# --- plans beyond a spent budget and σ = 0 are refused at set-up ----------------------------------
def _two_groups(n=N):
    return Budgets.from_groups([1.0, 3.0], [0.5, 0.5], n, DELTA, seed=0)


def _train_steps(model, opt, loader, steps):
    done = 0
    while done < steps:
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def test_a_plan_beyond_a_partly_spent_budget_is_refused_at_set_up(data):
    """Bug 3: a new phase whose plan would take a group over its budget (given what earlier phases
    spent) is refused by make_private, not at its first step; the engine is left as it was."""
    x, y = data
    budgets = _two_groups()
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=24)
    model, opt, private = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        budgets=budgets,
        method="uniform",
        steps=6,
    )
    _train_steps(model, opt, private, 6)  # group ε=1 has spent its budget, group ε=3 has not
    p = engine.parameters
    again = dict(
        module=model,
        optimizer=opt,
        data_loader=loader,
        budgets=budgets,
        clip_norms=p.clip_norms,
        noise_multiplier=p.noise_multiplier,
        max_grad_norm=p.max_grad_norm,
    )
    with pytest.raises(
        PrivacyBudgetExceeded,
        match=r"the plan of 5 steps would take a privacy group over its "
        r"budget .* at most 0 steps of this phase fit",
    ):
        engine.make_private_with_parameters(sample_rates=p.sample_rates, steps=5, **again)
    with pytest.raises(PrivacyBudgetExceeded, match="a step would take a privacy group over its budget"):
        engine.make_private_with_parameters(sample_rates=p.sample_rates, **again)  # no plan: one step
    assert engine.steps == 6 and len(engine.accountant.phases) == 1  # nothing changed
    rest = np.where(budgets.epsilons == 3.0, p.sample_rates, 0.0)  # only group ε=3 trains
    with pytest.raises(PrivacyBudgetExceeded, match=r"at most (\d+) steps of this phase fit") as info:
        engine.make_private_with_parameters(sample_rates=rest, steps=10_000, **again)
    fits = int(re.search(r"at most (\d+) steps", str(info.value)).group(1))
    assert fits > 6
    model, opt, private = engine.make_private_with_parameters(sample_rates=rest, steps=fits, **again)
    assert engine.get_epsilon(steps=6 + fits).per_group[1] <= 3.0 < engine.get_epsilon(steps=7 + fits).per_group[1]
    m = toy_model()
    with pytest.warns(RuntimeWarning, match="filter_action='warn'"):  # warn mode warns at set-up and goes on
        IndividualizedPrivacyEngine(accountant="rdp", seed=0).make_private_with_parameters(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=loader,
            budgets=budgets,
            sample_rates=np.full(N, 0.5),
            clip_norms=np.ones(N),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            steps=10_000,
            filter_action="warn",
        )


def test_a_set_up_that_fails_after_the_phase_began_leaves_no_phase(data, monkeypatch):
    """A make_private that fails after the accountant began its phase (here: wrapping the module) leaves
    no 0-step phase in the ledger, and a fresh engine no accountant; the next set-up works."""
    import idpsgd.engine.step as pe

    x, y = data
    budgets = _two_groups()
    loader = DataLoader(TensorDataset(x, y), batch_size=24)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    real = pe.wrap_module

    def failing(*args, **kwargs):
        raise RuntimeError("wrapping failed")

    monkeypatch.setattr(pe, "wrap_module", failing)
    m = toy_model()
    with pytest.raises(RuntimeError, match="wrapping failed"):
        engine.make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=loader,
            budgets=budgets,
            method="uniform",
            steps=6,
        )
    assert engine.accountant is None and engine.budgets is None
    monkeypatch.setattr(pe, "wrap_module", real)
    model, opt, private = engine.make_private(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=loader,
        budgets=budgets,
        method="uniform",
        steps=6,
    )
    _train_steps(model, opt, private, 2)
    p = engine.parameters
    monkeypatch.setattr(pe, "wrap_module", failing)
    with pytest.raises(RuntimeError, match="wrapping failed"):
        engine.make_private_with_parameters(
            module=model,
            optimizer=opt,
            data_loader=loader,
            budgets=budgets,
            sample_rates=p.sample_rates,
            clip_norms=p.clip_norms,
            noise_multiplier=p.noise_multiplier,
            max_grad_norm=p.max_grad_norm,
            steps=2,
        )
    assert len(engine.accountant.phases) == 1 and engine.steps == 2


def test_noise_multiplier_zero_is_refused_at_once(data):
    """Bug 3: σ = 0 (no privacy) is refused by every entry point, before anything is set up."""
    from idpsgd.engine import IndividualizedDPOptimizer
    from idpsgd.engine.clipping.examples import PerExampleClipping
    from idpsgd.engine.sampling.sampler import BatchIndexQueue

    x, y = data
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=24)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    with pytest.raises(InvalidParameterError, match=r"noise_multiplier=0(\.0)? is invalid: must be > 0"):
        engine.make_private_with_parameters(
            module=model,
            optimizer=opt,
            data_loader=loader,
            budgets=_two_groups(),
            sample_rates=np.full(N, 0.1),
            clip_norms=np.ones(N),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            steps=2,
        )
    with pytest.raises(InvalidParameterError, match=r"noise_multiplier=0(\.0)? is invalid"):
        engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=0, max_grad_norm=1.0)
    with pytest.raises(InvalidParameterError, match=r"noise_multiplier=0(\.0)? is invalid"):
        IndividualizedDPOptimizer(
            opt,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping=PerExampleClipping(np.ones(N), BatchIndexQueue()),
            expected_batch_size=1.0,
        )
    assert engine.accountant is None


# --- Opacus's make_private_with_epsilon / make_private on the same engine -------------------------
OPACUS_METHODS = ("make_private", "make_private_with_epsilon", "get_epsilon", "save_checkpoint", "load_checkpoint")


@pytest.mark.parametrize("name", OPACUS_METHODS)
def test_every_opacus_keyword_is_accepted(name):
    """Every keyword of Opacus 1.6's PrivacyEngine methods exists on ours (honoured or refused
    with a reason), so a port changes no call."""
    import inspect

    from opacus import PrivacyEngine

    theirs = inspect.signature(getattr(PrivacyEngine, name)).parameters
    ours = inspect.signature(getattr(IndividualizedPrivacyEngine, name)).parameters
    missing = [k for k, v in theirs.items() if k != "self" and v.kind != v.VAR_KEYWORD and k not in ours]
    assert not missing, f"{name} lacks Opacus's keyword(s) {missing}"
    assert (
        inspect.signature(PrivacyEngine.__init__).parameters.keys() - {"self"}
        <= inspect.signature(IndividualizedPrivacyEngine.__init__).parameters.keys()
    )


def test_make_private_with_epsilon_one_budget_and_per_example_budgets(data):
    from idpsgd.accounting import calibrate_noise_multiplier

    x, y = data
    loader = DataLoader(TensorDataset(x, y), batch_size=24)
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model, opt, private = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        target_epsilon=2.0,
        target_delta=DELTA,
        epochs=2,
        max_grad_norm=1.0,
    )
    assert engine.parameters.noise_multiplier == pytest.approx(
        calibrate_noise_multiplier(2.0, DELTA, 0.1, 20), rel=1e-12
    )  # Opacus's σ for q = B/N, 20 steps
    _train_steps(model, opt, private, 20)
    eps = engine.get_epsilon(DELTA)
    assert eps.per_group.shape == (1,) and 0.999 * 2.0 <= eps <= 2.0
    # per-example budgets: one extra argument; target_epsilon bounds every budget
    m2 = toy_model()
    two = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    per_example = torch.where(y == 1, 1.0, 3.0).numpy()
    m2, o2, l2 = two.make_private_with_epsilon(
        module=m2,
        optimizer=torch.optim.SGD(m2.parameters(), lr=0.1),
        data_loader=loader,
        target_epsilon=3.0,
        target_delta=DELTA,
        epochs=2,
        max_grad_norm=1.0,
        budgets=per_example,
    )
    _train_steps(m2, o2, l2, 20)
    eps = two.get_epsilon().per_group
    assert (
        np.allclose(two.group_budgets, [1.0, 3.0])
        and np.all(eps <= two.group_budgets)
        and np.all(eps >= 0.999 * two.group_budgets)
    )
    rates = [g["sample_rate"] for g in two.privacy_groups()]
    assert rates[0] < 0.1 < rates[1]  # Sample: the default with budgets
    m3 = toy_model()
    with pytest.raises(InvalidParameterError, match=r"target_epsilon=2.0 is invalid: is below the largest budget 3"):
        IndividualizedPrivacyEngine(accountant="rdp", seed=0).make_private_with_epsilon(
            module=m3,
            optimizer=torch.optim.SGD(m3.parameters(), lr=0.1),
            data_loader=loader,
            target_epsilon=2.0,
            target_delta=DELTA,
            epochs=2,
            max_grad_norm=1.0,
            budgets=per_example,
        )


def test_make_private_with_one_noise_multiplier_accounts_without_budgets(data):
    from opacus.accountants import RDPAccountant

    from idpsgd.accounting import epsilon_sgm

    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model, opt, private = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        noise_multiplier=1.1,
        max_grad_norm=0.7,
    )
    _train_steps(model, opt, private, 25)  # no budget: no filter, any number of steps
    assert engine.steps == 25 and engine.parameters.noise_multiplier == 1.1
    assert np.all(engine.parameters.clip_norms == 0.7)
    eps = engine.get_epsilon(DELTA)
    assert float(eps) == pytest.approx(float(epsilon_sgm(0.1, 1.1, 25, DELTA)), rel=1e-12)
    acc = RDPAccountant()
    acc.history = [(1.1, 0.1, 25)]
    assert float(eps) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-3)  # Opacus's RDP (at its own orders)
    with pytest.raises(InvalidParameterError, match="delta=None is invalid: is required"):
        engine.get_epsilon()
    bad = [
        (dict(poisson_sampling=False), "poisson_sampling=False is invalid: only True"),
        (dict(clipping="per_layer"), "clipping='per_layer' is invalid: only 'flat'"),
        (dict(wrap_model=False, grad_sample_mode="ghost"), "wrap_model=False is invalid"),
        (dict(rand_on_empty=True), "rand_on_empty=True is invalid"),
        (dict(method="sample"), "method='sample' is invalid"),
        (dict(privacy_filter="group"), "privacy_filter='group' is invalid: needs budgets"),
    ]
    for change, message in bad:
        m = toy_model()
        with pytest.raises(InvalidParameterError, match=message):
            IndividualizedPrivacyEngine(accountant="rdp", seed=0).make_private(
                module=m,
                optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                **change,
            )


def test_budgets_of_the_wrong_length_point_to_from_groups(data):
    x, y = data
    model = toy_model()
    with pytest.raises(
        InvalidParameterError,
        match=r"need one per example of the data loader's dataset \(240\); "
        r"for one budget per privacy group use "
        r"Budgets.from_groups\(\[1, 3, 8\], fractions, 240, delta\)",
    ):
        IndividualizedPrivacyEngine(accountant="rdp", seed=0).make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
            target_delta=DELTA,
            epochs=1,
            max_grad_norm=1.0,
            budgets=[1, 3, 8],
        )


# --- ε formats as a float, per-group table, planned ε, history ------------------------------------
def test_get_epsilon_formats_as_the_loosest_group_and_projects_a_plan(data):
    x, y = data
    budgets = _two_groups()
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model, opt, private = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        budgets=budgets,
        method="sample",
        epochs=2,
    )
    planned = engine.get_epsilon(steps=20)  # before any step: what the plan will spend
    _train_steps(model, opt, private, 8)
    at_12 = engine.get_epsilon(steps=12)
    _train_steps(model, opt, private, 4)
    eps = engine.get_epsilon()
    assert np.array_equal(at_12.per_group, eps.per_group) and at_12 == eps  # the projection is the spend
    assert np.all(planned.per_group <= engine.group_budgets) and np.all(
        planned.per_group >= 0.999 * engine.group_budgets
    )
    loosest = eps.per_group.max()
    assert f"{eps:.3f}" == f"{loosest:.3f}" and float(eps) == eps.loosest == loosest > eps.strictest
    assert "%.2f" % eps == f"{loosest:.2f}"  # noqa: UP031  (old-style formatting must work too) and round(eps, 2) == round(float(loosest), 2) and eps <= 3.0
    text = repr(eps)
    assert "as a number" in text and "budget" in text and "examples" in text and f"{eps.per_group[0]:.4f}" in text
    assert type(eps + 0) is float and type(eps.per_group) is np.ndarray and eps.per_group.shape == (2,)
    # per-group history in Opacus's form reproduces each group's ε (here with our RDP)
    from idpsgd.accounting import SampledGaussianEvent, rdp_epsilon

    for g, events in enumerate(engine.history):
        assert len(events) == 1 and events[0][2] == 12
        ev = [SampledGaussianEvent(q, s, t) for s, q, t in events]
        assert rdp_epsilon(ev, DELTA)[0] == pytest.approx(eps.per_group[g], rel=1e-12)
    with pytest.raises(InvalidParameterError, match="steps=3 is invalid"):
        engine.get_epsilon(steps=3)


# --- the PRV accountant, against Opacus's ----------------------------------------------------------
def test_prv_accountant_matches_opacus_per_group(data):
    from opacus.accountants import PRVAccountant

    from idpsgd.accounting import SampledGaussianEvent
    from idpsgd.accounting.prv import prv_epsilon, prv_epsilons

    events = [SampledGaussianEvent(0.05, 1.3, 30), SampledGaussianEvent(0.2, 2.5, 7)]
    acc = PRVAccountant()
    acc.history = [(e.noise_multiplier, e.sample_rate, e.count) for e in events]
    theirs = acc.get_epsilon(DELTA)
    lower, estimate, upper = prv_epsilons(events, DELTA)
    assert upper == pytest.approx(theirs, rel=1e-9) and lower < estimate < upper  # the upper bound is reported
    assert prv_epsilon(events, DELTA) == upper
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="prv", seed=0)
    model, opt, private = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        budgets=_two_groups(),
        sample_rates=np.where(_two_groups().epsilons == 1.0, 0.05, 0.15),
        clip_norms=np.ones(N),
        noise_multiplier=1.5,
        max_grad_norm=1.0,
        steps=6,
    )
    _train_steps(model, opt, private, 6)
    eps = engine.get_epsilon()
    for g, history in enumerate(engine.history):
        acc = PRVAccountant()
        acc.history = list(history)
        assert eps.per_group[g] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.slow
def test_prv_calibration_spends_each_budget_with_sample():
    """Calibration with prv (Sample: one σ, per-group rates) lands every group in [(1 − 1e-4)·ε, ε]."""
    from idpsgd.assignment import assign

    b = Budgets.from_groups([1.0, 2.0, 3.0], [0.34, 0.43, 0.23], 600, DELTA, seed=0)
    a = assign(b, "sample", 64 / 600, 19, 1.0, "prv")
    for g in a.groups:
        assert 0.9999 * g.budget <= g.epsilon <= g.budget


# --- checkpoints with Opacus's names, resumable from the file alone -------------------------------
def _ckpt_setup(data, seed, epochs=2, **kw):
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=seed)
    model, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
        target_epsilon=3.0,
        target_delta=DELTA,
        epochs=epochs,
        max_grad_norm=1.0,
        **kw,
    )
    return engine, model, opt, loader


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_checkpoint_resumes_bit_exactly_in_a_fresh_engine_without_a_seed(data, tmp_path):
    path = tmp_path / "ckpt.pt"
    engine, model, opt, loader = _ckpt_setup(data, seed=None)
    _train_steps(model, opt, loader, 10)
    engine.save_checkpoint(path=path, module=model, optimizer=opt, checkpoint_dict={"epoch": 1})
    assert file_mode(path) == 0o600
    torch.load(path, weights_only=True)  # plain data: loads without unpickling code
    _train_steps(model, opt, loader, 10)
    reference = _params(model)

    fresh, m2, o2, l2 = _ckpt_setup(data, seed=None)  # its seed is drawn at its first draw, or loaded
    assert fresh.seed is None and isinstance(engine.seed, int)
    extra = fresh.load_checkpoint(path=path, module=m2, optimizer=o2)
    assert set(extra) == {"epoch", "module_state_dict", "privacy_accountant_state_dict"} and extra["epoch"] == 1
    assert fresh.seed == engine.seed and fresh.sampler_seed == engine.sampler_seed and fresh.steps == 10
    _train_steps(m2, o2, l2, 10)
    assert torch.equal(_params(m2), reference) and fresh.steps == engine.steps == 20
    np.testing.assert_array_equal(fresh.get_epsilon().per_group, engine.get_epsilon().per_group)

    other, m3, o3, _ = _ckpt_setup(data, seed=7)  # an explicit other seed: refused, says what to do
    with pytest.raises(
        ValueError,
        match=r"another seed than the one this engine was created with: create it with "
        r"the run's seed, or with seed=None",
    ) as refused:
        other.load_checkpoint(path=path, module=m3, optimizer=o3)
    assert str(engine.seed) not in str(refused.value) and "7" not in str(refused.value)  # seeds are private
    longer, m4, o4, _ = _ckpt_setup(data, seed=None, epochs=4)  # changed epochs: refused, says what to do
    before = _params(m4)
    with pytest.raises(ValueError, match=r"saved: 20 planned steps .* now: 40 planned steps .* keep its epochs"):
        longer.load_checkpoint(path=path, module=m4, optimizer=o4)
    assert longer.steps == 0 and torch.equal(before, _params(m4))  # nothing loaded
    from idpsgd.io import CheckpointError

    torch.save({"not": "ours"}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="is not a privacy engine checkpoint"):
        fresh.load_checkpoint(path=tmp_path / "foreign.pt", module=m2)
    with pytest.raises(InvalidParameterError, match="noise_scheduler='object' is invalid: is not supported"):
        fresh.save_checkpoint(path=path, module=m2, noise_scheduler=object())


@pytest.mark.slow  # the exactly tracked validation subset's RDP table takes ~1.5 min on 2 cores
def test_checkpoint_with_individual_accounting_resumes_without_a_seed(data, tmp_path):
    from idpsgd.engine import IndividualAccountingOptions

    opts = IndividualAccountingOptions(validate_subset=8)
    path = tmp_path / "ckpt.pt"

    def setup():
        x, y = data
        model = toy_model()
        engine = IndividualizedPrivacyEngine(accountant="rdp")
        engine.enable_individual_accounting(opts)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=24),
            budgets=_two_groups(),
            method="sample",
            epochs=1,
        )
        return engine, model, opt, loader

    engine, model, opt, loader = setup()
    _train_steps(model, opt, loader, 5)
    engine.save_checkpoint(path=path, module=model, optimizer=opt)
    _train_steps(model, opt, loader, 5)
    fresh, m2, o2, l2 = setup()
    fresh.load_checkpoint(path=path, module=m2, optimizer=o2)
    assert np.array_equal(fresh.individual.subset, engine.individual.subset)  # drawn from the checkpoint's seed
    _train_steps(m2, o2, l2, 5)
    assert torch.equal(_params(m2), _params(model))
    assert np.array_equal(fresh.get_individual_epsilons(), engine.get_individual_epsilons())
    assert np.array_equal(fresh.individual.epsilons(DELTA), engine.individual.epsilons(DELTA))  # the estimates


# --- Sample with a wide spread says its strict group barely trains --------------------------------
def test_sample_with_a_wide_spread_warns_with_expected_draws():
    from idpsgd.assignment import SparseSamplingWarning, assign

    b = Budgets.from_groups([1.0, 8.0], [0.5, 0.5], 1000, DELTA, seed=0)
    with pytest.warns(
        SparseSamplingWarning,
        match=r"budget\(s\) 1 are expected to be sampled fewer than 1 time\(s\) "
        r"in the 100 planned steps, .*budget 1: 0\.00\d+, budget 8: 3\.99.*"
        r"use method 'scale'",
    ):
        assign(b, "sample", 0.02, 100, 1.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assign(b, "scale", 0.02, 100, 1.0)  # Scale samples every group at the mean rate


def test_the_report_states_the_sparse_sampling_warning(data):
    from idpsgd.assignment import SparseSamplingWarning
    from idpsgd.data import Dataset as IdpDataset
    from idpsgd.training import TrainConfig, Trainer

    x, y = data
    wide = Budgets.from_groups([1.0, 8.0], [0.5, 0.5], N, DELTA, seed=0)
    with pytest.warns(SparseSamplingWarning):
        trainer = Trainer(
            IdpDataset("toy", x, y, x[:20], y[:20], 2),
            wide,
            TrainConfig(method="sample", epochs=2, batch_size=5, seed=0, progress=False),
        )
    report = trainer.report()
    assert (
        len(report["warnings"]) == 1 and "budget(s) 1 are expected to be sampled fewer than 1" in report["warnings"][0]
    )


# --- the package lists its lazy names ------------------------------------------------------------------
def test_dir_lists_the_lazy_names():
    import idpsgd

    names = dir(idpsgd)
    assert {"IndividualizedPrivacyEngine", "train", "TrainConfig", "load_dataset", "Budgets", "GroupEpsilons"} <= set(
        names
    )
    assert all(hasattr(idpsgd, n) for n in idpsgd._LAZY)


# --- CSV budget and id columns are never features; the hidden split is recorded ---------------------
def _csv_with_budgets(folder, n=150, test=False):
    rng = np.random.default_rng(0)
    folder.mkdir()
    y = np.arange(n) % 2
    x = rng.normal(size=(n, 8)) + y[:, None]
    eps = np.where(np.arange(n) % 3 == 0, 1.0, 3.0)
    rows = ["id,label," + ",".join(f"f{i}" for i in range(8)) + ",epsilon"]
    rows += [f"{1000 + i},{y[i]}," + ",".join(f"{v:.4f}" for v in x[i]) + f",{eps[i]:g}" for i in range(n)]
    (folder / "train.csv").write_text("\n".join(rows) + "\n")
    if test:
        (folder / "test.csv").write_text(
            "\n".join(
                [",".join(["label", *(f"f{i}" for i in range(8))])]
                + [f"{y[i]}," + ",".join(f"{v:.4f}" for v in x[i]) for i in range(20)]
            )
            + "\n"
        )
    return eps


def _run_cli(argv):
    import contextlib
    import io

    from idpsgd.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


def test_csv_budget_and_id_columns_are_not_features_and_per_row_budgets_map_to_training_rows(tmp_path):
    """Bug 2: with budgets in a column of train.csv, the model's inputs are the 8 feature columns
    (not 10), the report lists them, the hidden split is recorded privately and the per-row budgets
    of train.csv go to the rows that train."""
    import json
    import warnings

    from idpsgd.runfolder import MANIFEST, PRIVATE

    data = tmp_path / "data"
    eps = _csv_with_budgets(data)
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _ = _run_cli(
            [
                "train",
                "--method",
                "sample",
                "--dataset",
                "csv",
                "--num-classes",
                "2",
                "--data-dir",
                str(data),
                "--budgets-file",
                str(data / "train.csv"),
                "--budget-column",
                "epsilon",
                "--epochs",
                "1",
                "--batch-size",
                "30",
                "--no-progress",
                "--seed",
                "0",
                "--out",
                str(out),
            ]
        )
    assert code == 0
    assert any(
        "not used as features: 'id' (row identifier" in str(w.message) and "'epsilon' (budget column" in str(w.message)
        for w in caught
    )
    state = torch.load(out / "model.pt", weights_only=True)
    first = next(v for k, v in state.items() if k.endswith("weight"))
    assert first.shape[1] == 8  # the 8 features, not id and epsilon
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["feature_columns"] == [f"f{i}" for i in range(8)]
    assert set(report["data"]["excluded_columns"]) == {"id", "epsilon"}
    split_file = out / PRIVATE / "data_split.csv"
    assert file_mode(split_file) == 0o600
    assert json.loads((out / MANIFEST).read_text())["files"][f"{PRIVATE}/data_split.csv"]["kind"] == "private"
    lines = split_file.read_text().splitlines()
    assert lines[0] == "row,split,index" and len(lines) == 151
    train_rows = [int(r.split(",")[0]) for r in lines[1:] if r.split(",")[1] == "train"]
    assert len(train_rows) == 120 and train_rows == sorted(train_rows)
    counts = {g["budget"]: g["count"] for g in report["groups"]}
    expected = {b: int(np.sum(eps[train_rows] == b)) for b in (1.0, 3.0)}
    assert counts == expected  # each training row got its own row's budget


def test_csv_columns_from_the_library(tmp_path):
    from idpsgd.data import load_dataset

    data = tmp_path / "data"
    _csv_with_budgets(data, test=True)
    with pytest.warns(UserWarning, match="train.csv: not used as features: 'id' .*'epsilon'"):
        d = load_dataset("csv", data, num_classes=2, drop_columns="f7", budget_column="epsilon")
    assert d.x_train.shape == (150, 7) and d.x_test.shape == (20, 7) and d.split is None
    assert d.source["excluded_columns"] == {
        "f7": "dropped (drop_columns)",
        "id": "row identifier (a value unique to its row can only memorise)",
        "epsilon": "budget column (budgets are never model inputs)",
    }
    for kw, message in (
        (dict(feature_columns="f0,epsilon", budget_column="epsilon"), "includes the budget column"),
        (dict(feature_columns="f0,zz"), "names column 'zz', which train.csv lacks"),
        (dict(drop_columns="label"), "includes the label column"),
        (dict(feature_columns="f0", drop_columns="f1"), "not both"),
    ):
        with pytest.raises(InvalidParameterError, match=message):
            load_dataset("csv", data, num_classes=2, **kw)


# --- idpsgd.train on any map-style torch Dataset -------------------------------------------------
class Pairs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def test_train_takes_a_torch_dataset_and_matches_the_tensor_dataset(data, tmp_path):
    from idpsgd.data import Dataset as IdpDataset
    from idpsgd.training import TrainConfig, train

    x, y = data
    budgets = _two_groups(200)
    cfg = TrainConfig(method="sample", epochs=1, batch_size=20, seed=3, progress=False)
    ours = train(IdpDataset("toy", x[:200], y[:200], x[200:], y[200:], 2), budgets, cfg, tmp_path / "a")
    theirs = train(
        Pairs(x[:200], y[:200]), budgets, cfg, tmp_path / "b", test_dataset=Pairs(x[200:], y[200:]), num_classes=2
    )
    assert theirs["test_accuracy"] == ours["test_accuracy"] and theirs["steps"] == ours["steps"] == 10
    assert [g["epsilon_spent"] for g in theirs["groups"]] == [g["epsilon_spent"] for g in ours["groups"]]
    assert theirs["data"]["format"] == "torch Dataset" and theirs["dataset"] == "Pairs"
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = train(
        Pairs(x[:200], y[:200]),
        budgets,
        cfg,
        tmp_path / "b",
        resume=True,
        test_dataset=Pairs(x[200:], y[200:]),
        num_classes=2,
    )  # resume: same data fingerprint
    assert again["steps"] == 10
    with pytest.raises(InvalidParameterError, match="resume"):
        train(
            Pairs(x[:200] + 1, y[:200]),
            budgets,
            cfg,
            tmp_path / "b",
            resume=True,
            test_dataset=Pairs(x[200:], y[200:]),
            num_classes=2,
        )
    for kw, message in (
        (dict(num_classes=2), "test_dataset=None is invalid: is required with a torch Dataset"),
        (dict(test_dataset=Pairs(x[200:], y[200:])), "num_classes=None is invalid"),
    ):
        with pytest.raises(InvalidParameterError, match=message):
            train(Pairs(x[:200], y[:200]), budgets, cfg, **kw)


# --- done when: the docs' Opacus 1.6 script (docs/opacus.md) runs as written ----------------------
OPACUS_IMPORT = ("from idpsgd import IndividualizedPrivacyEngine", "from opacus import PrivacyEngine")
BUDGETS_ARG = ("max_grad_norm=1.0,\n", "max_grad_norm=1.0,\n        budgets=torch.where(y == 1, 1.0, 3.0).numpy(),\n")


def _run_block(code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "docs/opacus.md:opacus-port", "exec"), ns)
    return ns, capsys.readouterr().out


def test_readme_opacus_script_runs_as_written(tmp_path, monkeypatch, capsys):
    from doc_blocks import doc_block

    code = doc_block("opacus-port")
    assert code.count(OPACUS_IMPORT[0]) == 1 and code.count("IndividualizedPrivacyEngine(") == 1
    ns, out = _run_block(code, tmp_path, monkeypatch, capsys)
    engine = ns["engine"]
    lines = out.strip().splitlines()
    assert [ln.split(" = ")[0] for ln in lines] == ["epoch 0: epsilon", "epoch 1: epsilon", "resumed: epsilon"]
    assert lines[1].split(" = ")[1] == lines[2].split(" = ")[1] == f"{float(engine.get_epsilon()):.2f}"
    eps = engine.get_epsilon()
    assert engine.accountant_name == "prv" and engine.steps == 16 and 0.9999 * 3.0 <= float(eps) <= 3.0


@pytest.mark.slow
def test_readme_opacus_script_runs_on_opacus_and_with_per_example_budgets(tmp_path, monkeypatch, capsys):
    """The same block on Opacus 1.6 (the import and the class name changed back), and on idpsgd
    with per-example budgets (one argument added)."""
    from doc_blocks import doc_block

    code = doc_block("opacus-port")
    on_opacus = code.replace(*OPACUS_IMPORT).replace("IndividualizedPrivacyEngine(", "PrivacyEngine(")
    (tmp_path / "opacus").mkdir()
    ns, out = _run_block(on_opacus, tmp_path / "opacus", monkeypatch, capsys)
    assert type(ns["engine"]).__module__.startswith("opacus") and out.count("epsilon = ") == 3
    budgets_code = code.replace(*BUDGETS_ARG)
    assert budgets_code.count("budgets=") == 1
    (tmp_path / "budgets").mkdir()
    ns, out = _run_block(budgets_code, tmp_path / "budgets", monkeypatch, capsys)
    eps = ns["engine"].get_epsilon()
    assert (
        np.allclose(eps.budgets, [1.0, 3.0])
        and np.all(eps.per_group <= eps.budgets)
        and np.all(eps.per_group >= 0.999 * eps.budgets)
    )
    assert out.strip().splitlines()[-1] == f"resumed: epsilon = {float(eps):.2f}"
