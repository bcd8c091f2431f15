"""The contract an Opacus 1.6 script relies on, a section per part (each failed before its fix; issue 31).

The acceptance test is Opacus's own test suite with the engine swapped in (``make test-opacus``,
``tests/opacus_suite``); these are the fast, default-suite versions of each part."""

from __future__ import annotations

import copy
import io
import json
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import InvalidParameterError
from idpsgd.assignment import Budgets
from idpsgd.engine import IndividualizedPrivacyEngine

DELTA = 1e-5


def _data(n=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return x, (x[:, 0] > 0).long()


def _linear():
    m = nn.Linear(5, 2)
    nn.init.ones_(m.weight)
    nn.init.zeros_(m.bias)
    return m


def _private(engine=None, *, batch_size=30, generator=None, noise_generator=None, mode="hooks", n=100, **kw):
    x, y = _data(n)
    engine = engine if engine is not None else IndividualizedPrivacyEngine()
    model = _linear()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size, generator=generator),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_generator=noise_generator,
        grad_sample_mode=mode,
        **kw,
    )
    return engine, model, opt, loader


def _epoch(model, opt, loader):
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --- Opacus's module checks -----------------------------------------------------------------------
def test_get_compatible_module_is_compatible_and_validate_as_opacus():
    from opacus.validators.errors import UnsupportedModuleError as OpacusError

    from idpsgd.engine.opacus_compat import UnsupportedModuleError

    bn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    engine = IndividualizedPrivacyEngine()
    assert not engine.is_compatible(module=bn, optimizer=None, data_loader=None)
    for caught in (OpacusError, InvalidParameterError, ValueError):
        with pytest.raises(caught, match="BatchNorm cannot support training with differential privacy"):
            engine.validate(module=bn, optimizer=None, data_loader=None)
    fixed = IndividualizedPrivacyEngine.get_compatible_module(bn)  # a classmethod, as Opacus's
    assert isinstance(fixed[1], nn.GroupNorm) and isinstance(bn[1], nn.BatchNorm2d)  # a fixed copy
    assert engine.is_compatible(module=fixed, optimizer=None, data_loader=None)
    plain = nn.Linear(1, 2)
    same = IndividualizedPrivacyEngine.get_compatible_module(plain)
    assert same is not plain and all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), same.state_dict().values(), strict=True)
    )
    assert issubclass(UnsupportedModuleError, OpacusError) and issubclass(UnsupportedModuleError, InvalidParameterError)


# --- Opacus's error types and wording at make_private ----------------------------------------------
def test_make_private_raises_opacus_errors_for_a_bad_module_or_optimizer():
    from opacus.validators.errors import UnsupportedModuleError as OpacusError

    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    bn = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    with pytest.raises(OpacusError, match="module='Sequential' is invalid: cannot be trained privately by Opacus"):
        IndividualizedPrivacyEngine().make_private(
            module=bn,
            optimizer=torch.optim.SGD(bn.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    m1, m2 = _linear(), _linear()
    with pytest.raises(ValueError, match="Module parameters are different than optimizer Parameters"):
        IndividualizedPrivacyEngine().make_private(
            module=m1,
            optimizer=torch.optim.SGD(m2.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


# --- get_epsilon is a float ----------------------------------------------------------------------
def test_get_epsilon_is_a_float_in_every_way_with_one_budget():
    from opacus.accountants import PRVAccountant

    torch.manual_seed(0)
    engine, model, opt, loader = _private()
    _epoch(model, opt, loader)
    eps = engine.get_epsilon(DELTA)
    ref = PRVAccountant()
    ref.history = [(1.0, 0.25, 4)]
    assert isinstance(eps, float) and eps == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    value = float(eps)
    assert round(eps, 2) == round(value, 2) and type(round(eps, 2)) is float
    assert json.loads(json.dumps({"epsilon": eps})) == {"epsilon": value}
    assert (eps < value + 1) is True and eps == value and eps > 0 and max(eps, 0.0) == value
    assert f"{eps}" == str(value) == str(eps) and f"{eps:.2f}" == f"{value:.2f}" and repr(eps) == repr(value)
    assert torch.tensor(eps, dtype=torch.float64).item() == value and np.float64(eps) == value
    assert np.asarray(eps).shape == ()
    assert type(eps + 1) is float and eps * 2 == 2 * value
    for copied in (pickle.loads(pickle.dumps(eps)), copy.deepcopy(eps)):
        assert copied == eps and np.array_equal(copied.per_group, eps.per_group) and copied.delta == DELTA
    assert eps.per_group.shape == (1,) and eps.per_group[0] == value


def test_get_epsilon_with_several_budgets_is_the_loosest_groups_with_the_table():
    x, y = _data(120)
    budgets = Budgets.from_groups([1.0, 3.0], [0.5, 0.5], 120, DELTA, seed=0)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model = _linear()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
        budgets=budgets,
        epochs=1,
    )
    _epoch(model, opt, loader)
    eps = engine.get_epsilon()
    assert eps == eps.per_group.max() == eps.loosest > eps.strictest == eps.per_group.min()
    assert np.all(eps.per_group <= engine.group_budgets) and eps <= 3.0
    assert "as a number the loosest group's" in repr(eps) and json.loads(json.dumps(eps)) == float(eps)
    assert engine.accountant.get_epsilon() == eps  # the accountant's is the same float


# --- randomness follows torch's RNG and the loader's generator ----------------------------------------
def test_torch_manual_seed_reproduces_a_run_without_a_seed():
    """As with Opacus: no seed, torch.manual_seed before training (here after make_private) replays the
    run exactly; the seed drawn from torch is recorded on the engine (never printed)."""
    runs = []
    for _ in range(2):
        engine, model, opt, loader = _private()
        assert engine.seed is None  # drawn at the first draw
        torch.manual_seed(1337)
        runs.append((_epoch(model, opt, loader), engine.seed))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] and isinstance(runs[0][1], int)
    torch.manual_seed(1338)
    engine, model, opt, loader = _private()
    assert not torch.equal(_epoch(model, opt, loader), runs[0][0])


def test_the_loaders_generator_drives_sampling_and_a_noise_generator_the_noise():
    def run(dl_seed, noise_seed, global_seed):
        torch.manual_seed(global_seed)
        engine, model, opt, loader = _private(
            generator=torch.Generator().manual_seed(dl_seed),
            noise_generator=None if noise_seed is None else torch.Generator().manual_seed(noise_seed),
        )
        return _epoch(model, opt, loader), engine

    a, ea = run(96, 17, 1)
    b, eb = run(96, 17, 2)  # torch's global RNG does not matter then
    assert torch.equal(a, b) and ea.sampler_seed == eb.sampler_seed
    c, ec = run(96, None, 1)
    d, ed = run(96, None, 2)  # the noise follows torch's global RNG
    assert not torch.equal(c, d) and ec.sampler_seed == ed.sampler_seed and ec.seed != ed.seed


def test_an_unseeded_torch_generator_is_not_a_source_and_secure_mode_ignores_torch():
    """A never-seeded generator runs torch's public default stream: the seed then comes from OS
    entropy; secure mode never takes randomness from torch."""
    from idpsgd.engine.noise.randomness import UNSEEDED, seed_from_torch

    fresh = torch.Generator()
    assert fresh.initial_seed() == UNSEEDED
    state = fresh.get_state()
    assert seed_from_torch(fresh) != seed_from_torch(fresh) and torch.equal(fresh.get_state(), state)
    seeded = torch.Generator().manual_seed(5)
    assert seed_from_torch(seeded) == seed_from_torch(torch.Generator().manual_seed(5))
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        engine, model, opt, loader = _private(IndividualizedPrivacyEngine(secure_mode=True))
        runs.append(_epoch(model, opt, loader))
        assert engine.seed is None and "seed" not in repr(engine.state_dict()["accountant"])
    assert not torch.equal(runs[0], runs[1])


# --- grad_sample_mode="ew" -------------------------------------------------------------------------
def test_expanded_weights_mode_trains_as_hooks():
    out = {}
    for mode in ("hooks", "ew"):
        engine, model, opt, loader = _private(IndividualizedPrivacyEngine(seed=3), mode=mode)
        out[mode] = _epoch(model, opt, loader)
        assert engine.steps == 4 and ("ExpandedWeights" in "".join(engine.layer_paths.values())) == (mode == "ew")
    assert torch.allclose(out["hooks"], out["ew"], atol=1e-6)
    with pytest.raises(InvalidParameterError, match="batch_first=False is invalid: is not supported with .*'ew'"):
        _private(mode="ew", batch_first=False)


# --- Opacus's accountant interface -------------------------------------------------------------------
def test_engine_accountant_has_opacus_interface_and_loads_into_opacus():
    from opacus.accountants import PRVAccountant

    torch.manual_seed(0)
    engine, model, opt, loader = _private()
    acc = engine.accountant
    assert len(acc) == 0 and acc.mechanism() == "prv" and acc.history == [] and bool(acc)
    _epoch(model, opt, loader)
    assert len(acc) == 1 and acc.history == [(1.0, 0.25, 4)] and engine.steps == 4  # Opacus: history entries
    eps = acc.get_epsilon(DELTA)
    assert isinstance(eps, float) and eps == engine.get_epsilon(DELTA)
    state = acc.state_dict()
    assert state == acc.state_dict() and state["mechanism"] == "prv" and state["history"] == [(1.0, 0.25, 4)]
    theirs = PRVAccountant()
    theirs.load_state_dict(state)  # Opacus reads our state
    assert theirs.get_epsilon(DELTA) == pytest.approx(eps, rel=1e-9)
    other, _m2, _o2, _l2 = _private()
    other.accountant.load_state_dict(state)
    assert other.steps == 4 and other.get_epsilon(DELTA) == eps
    rdp, *_ = _private(IndividualizedPrivacyEngine(accountant="rdp"))
    with pytest.raises(ValueError, match="accountant state is for 'prv', this accountant is 'rdp'"):
        rdp.accountant.load_state_dict(state)


# --- checkpoints -----------------------------------------------------------------------------------
def test_checkpoint_to_a_file_object_returns_what_opacus_returns():
    torch.manual_seed(0)
    engine, model, opt, loader = _private()
    _epoch(model, opt, loader)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=model, optimizer=opt, checkpoint_dict={"foo": "bar"})
    reference = _epoch(model, opt, loader)
    buf.seek(0)
    fresh, m2, o2, l2 = _private()
    out = fresh.load_checkpoint(path=buf, module=m2, optimizer=o2)
    assert set(out) == {"foo", "module_state_dict", "privacy_accountant_state_dict"} and out["foo"] == "bar"
    assert out["privacy_accountant_state_dict"]["history"] == [(1.0, 0.25, 4)] and fresh.steps == 4
    assert torch.equal(_epoch(m2, o2, l2), reference)  # resumed bit-exactly (seed and states)
    with pytest.raises(InvalidParameterError, match="path='int' is invalid: must be a file path or a binary file"):
        engine.save_checkpoint(path=3, module=model)


def test_an_opacus_checkpoint_loads_and_continues_its_accounting(tmp_path):
    from opacus import PrivacyEngine

    x, y = _data()
    torch.manual_seed(0)
    theirs = PrivacyEngine(accountant="prv")
    tm = _linear()
    tm, to, tl = theirs.make_private(
        module=tm,
        optimizer=torch.optim.SGD(tm.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    _epoch(tm, to, tl)
    theirs.save_checkpoint(path=tmp_path / "opacus.pt", module=tm, optimizer=to, checkpoint_dict={"epoch": 1})
    engine, model, opt, loader = _private()
    out = engine.load_checkpoint(path=tmp_path / "opacus.pt", module=model, optimizer=opt)
    assert out["epoch"] == 1 and "privacy_accountant_state_dict" in out and engine.steps == 4
    assert torch.equal(model._module.weight, tm._module.weight)  # Opacus saved the wrapped module
    assert engine.get_epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-9)
    _epoch(model, opt, loader)
    _epoch(tm, to, tl)
    assert engine.accountant.history == [(1.0, 0.25, 8)]
    assert engine.get_epsilon(DELTA) == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-9)
    budgets = Budgets.from_array(np.full(100, 3.0), DELTA)  # with budgets: refused, nothing changed
    b_engine = IndividualizedPrivacyEngine(accountant="prv", seed=0)
    bm = _linear()
    bm, bo, _ = b_engine.make_private(
        module=bm,
        optimizer=torch.optim.SGD(bm.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        budgets=budgets,
        epochs=2,
    )
    with pytest.raises(ValueError, match="one history for all examples; this engine has per-example budgets"):
        b_engine.load_checkpoint(path=tmp_path / "opacus.pt", module=bm, optimizer=bo)
    assert b_engine.steps == 0


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha:UserWarning")  # Opacus's RDP accountant
# --- Opacus's defaults ---------------------------------------------------------------------------------
def test_defaults_match_opacus_prv_and_one_over_len_data_loader():
    """N = 100, B = 30: Opacus takes q = 1/len(data_loader) = 1/4 and 4 steps per epoch (not
    q = B/N = 0.3 and 3 steps), and accounts with PRV; so does the engine by default."""
    from opacus.accountants.utils import get_noise_multiplier

    engine, _model, _opt, loader = _private()
    assert engine.accountant_name == "prv" and len(loader) == 4
    assert engine.parameters.sample_rates[0] == 0.25 and engine.parameters.steps_per_epoch == 4
    x, y = _data()
    cal = IndividualizedPrivacyEngine()
    m = _linear()
    cal.make_private_with_epsilon(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
        target_epsilon=5.0,
        target_delta=DELTA,
        epochs=2,
        max_grad_norm=1.0,
    )
    sigma = cal.parameters.noise_multiplier
    theirs = get_noise_multiplier(target_epsilon=5.0, target_delta=DELTA, sample_rate=0.25, epochs=2, accountant="prv")
    assert cal.parameters.steps == 8 and sigma == pytest.approx(theirs, rel=0.02) and sigma >= theirs * 0.995
    assert 0.9999 * 5.0 <= cal.get_epsilon(steps=8) <= 5.0


# --- the refusal table: every entry is what the engine raises for that option ------------------------------
class _Centered(nn.Module):
    """Mixes the examples of a batch (x - x.mean(0)): refused at its first forward pass."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(x - x.mean(0))


def test_every_refusal_in_the_table_is_what_the_engine_raises(tmp_path):
    """The Opacus-suite harness counts a failure as *refused* only when its error matches
    ``REFUSALS``; each entry must match the engine's own error for that option (no drift), and an
    unrelated error matches none."""
    from idpsgd.engine.noise.randomness import resolve_seed
    from idpsgd.engine.opacus_compat import REFUSALS, refusal_for

    x, y = _data()

    def make(**kw):
        engine = kw.pop("engine", None) or IndividualizedPrivacyEngine()
        model = kw.pop("model", None) or _linear()
        args = dict(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        args.update(kw)
        return engine.make_private(**args)

    engine, model, _opt, _loader = _private()
    triggers = {
        "poisson_sampling=False": lambda: make(poisson_sampling=False),
        'clipping="per_layer" / "adaptive"': lambda: make(clipping="adaptive"),
        'wrap_model=False with grad_sample_mode="ghost"/"bk"/"ew"': lambda: make(
            wrap_model=False, grad_sample_mode="bk"
        ),
        "rand_on_empty=True": lambda: make(rand_on_empty=True),
        "noise_multiplier=0": lambda: make(noise_multiplier=0.0),
        "noise_scheduler= / grad_clip_scheduler=": lambda: engine.save_checkpoint(
            path=tmp_path / "c.pt", module=model, noise_scheduler=object()
        ),
        "torch_save_kwargs= / torch_load_kwargs=": lambda: engine.load_checkpoint(
            path=tmp_path / "c.pt", module=model, torch_load_kwargs={"mmap": True}
        ),
        "secure_mode=True with a seed or noise_generator": lambda: resolve_seed(3, True),
        "a step or plan beyond a budget": lambda: IndividualizedPrivacyEngine().make_private_with_parameters(
            module=(m := _linear()),
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
            budgets=Budgets.from_array(np.full(100, 0.01), DELTA),
            sample_rates=np.full(100, 0.25),
            clip_norms=np.ones(100),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            steps=50,
        ),
        "batch_first=False": lambda: make(batch_first=False, grad_sample_mode="ew"),
        "a model that mixes examples within a batch (or that the check cannot run)": lambda: make(model=_Centered())[0](
            x[:4]
        ),
    }
    batch_option = next(r.option for r in REFUSALS if r.error.__name__ == "BatchMismatchError")
    assert set(triggers) | {batch_option} == {r.option for r in REFUSALS}
    for option, trigger in triggers.items():
        with pytest.raises(Exception) as info:  # noqa: PT011  (each refusal has its own type; refusal_for matches it)
            trigger()
        found = refusal_for(info.value)
        assert found is not None and found.option == option, (option, str(info.value))
    # per-sample gradients that are not one per drawn example (as with batch-second data and batch_first=True)
    e2 = IndividualizedPrivacyEngine(seed=0)
    seq = nn.Sequential(nn.Linear(5, 2))
    seq, o2, l2 = e2.make_private(
        module=seq,
        optimizer=torch.optim.SGD(seq.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=30),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    xb, yb = next(iter(l2))
    o2.zero_grad()
    F.cross_entropy(seq(xb.T.reshape(-1, 5)[: max(1, len(xb) // 2)]), yb[: max(1, len(xb) // 2)]).backward()
    with pytest.raises(Exception) as info:  # noqa: PT011  (refusal_for checks the type below)
        o2.step()
    assert refusal_for(info.value).option == batch_option and "batch_first" in str(info.value)
    assert refusal_for(ValueError("Module parameters are different than optimizer Parameters")) is None
