"""Individual Rényi filter (issue 13): Feldman & Zrnic's filter with individual budgets on the engine,
full-batch DP-GD and Poisson-subsampled DP-SGD with individual clipping, against slow references."""

import copy
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dp_accounting.rdp import rdp_privacy_accountant as dpa
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import InvalidParameterError
from idpsgd.accounting import max_steps_within, order_universe, rdp_to_epsilon
from idpsgd.assignment import Budgets
from idpsgd.data import Dataset
from idpsgd.engine import IndividualAccountingOptions, IndividualizedPrivacyEngine, PrivacyBudgetExceeded
from idpsgd.engine.budget.filter import FilterOptions, conversion_cost, rdp_budget, worst_case_orders
from idpsgd.training import TrainConfig
from idpsgd.training.filtered import train_filtered
from support import file_mode, per_example_norms, toy_classification, toy_model

N, DELTA = 48, 1e-5


@pytest.fixture(scope="module")
def data():
    return toy_classification(N, 0.5)


def _raw(module):
    return getattr(module, "_module", module)


def _run(
    data,
    budgets,
    *,
    q,
    sigma,
    steps,
    spe,
    clip=1.0,
    options=None,
    lr=0.5,
    seed=0,
    record=True,
    privacy_filter="individual",
    stop=None,
    **kwargs,
):
    """Train ``stop`` (default: all ``steps``) of the ``steps`` planned with the filter; returns (engine, log of
    every step)."""
    stop = steps if stop is None else stop
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    module, opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=loader,
        budgets=budgets,
        sample_rates=np.full(N, q),
        clip_norms=np.full(N, clip),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        steps=steps,
        steps_per_epoch=spe,
        privacy_filter=privacy_filter,
        filter_options=options,
        **kwargs,
    )
    log = {
        "theta": [copy.deepcopy(_raw(module).state_dict())],
        "batches": [],
        "rdp": [],
        "active": [],
        "bounds": [engine.filter.bounds.copy()] if engine.filter is not None else [],
    }
    f = engine.filter

    def record_step(optimizer):
        log["batches"].append(
            optimizer.last_indices.numpy().copy() if optimizer.last_indices is not None else np.zeros(0, dtype=np.int64)
        )
        log["theta"].append(copy.deepcopy(_raw(module).state_dict()))
        if f is not None:
            log["rdp"].append(f.rdp_spent.copy())
            log["active"].append(f.active.copy())
            log["bounds"].append(f.bounds.copy())

    if record:
        opt.post_step_hooks.append(record_step)  # after the filter's own hook
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)  # torch, ghost clipping
        while engine.steps < stop:
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(module(xb), yb).backward()
                opt.step()
                if engine.steps >= stop:
                    break
    return engine, log


def _norms_at(state, x, y):
    """Per-example gradient norms by plain autograd, one example at a time (the slow reference)."""
    model = toy_model()
    model.load_state_dict(state)
    return per_example_norms(model, x, y)


def _budget_ref(eps, alpha, delta=DELTA):
    """B(ε, α) written out independently: ε − log(1 − 1/α) + (log δ + log α)/(α − 1)."""
    return eps - math.log(1 - 1 / alpha) + (math.log(delta) + math.log(alpha)) / (alpha - 1)


# --- budgets and orders ---------------------------------------------------------------------
def test_rdp_budget_converts_back_to_at_most_the_budget_and_beats_the_classical_conversion():
    for eps in (0.3, 1.0, 3.0, 8.0):
        for alpha in (1.5, 2.0, 8.0, 33.3, 256.0):
            b = float(rdp_budget(eps, alpha, DELTA))
            assert b == pytest.approx(_budget_ref(eps, alpha), abs=1e-11)
            if b > 0:
                back = float(rdp_to_epsilon(np.array([b]), [alpha], DELTA)[0])
                assert back <= eps and back == pytest.approx(eps, abs=1e-10)
            assert b > eps - math.log(1 / DELTA) / (alpha - 1)  # the improved conversion gives more room
    assert float(conversion_cost(8.0, DELTA)) == pytest.approx(_budget_ref(0.0, 8.0) * -1, rel=1e-12)


def test_default_order_for_gd_maximizes_budget_over_order_on_the_universe():
    u, _ = order_universe()
    for eps in (0.3, 1.0, 4.0):
        ref = u[np.argmax([_budget_ref(eps, a) / a for a in u])]  # Gaussian: ρ ∝ α for every sensitivity
        assert worst_case_orders(1.0, 70.0, [eps], DELTA)[0] == ref


def test_budgets_too_small_for_one_step_are_refused(data):
    with pytest.raises(InvalidParameterError, match="too small for even one step"):
        worst_case_orders(0.1, 0.5, [0.05], DELTA)
    b = Budgets.from_groups([0.05, 3.0], [0.5, 0.5], N, DELTA)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model = toy_model()
    with pytest.raises(InvalidParameterError, match="budgets=0.05 is invalid: .*too small for even one step"):
        engine.make_private_with_parameters(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(*data), batch_size=8),
            budgets=b,
            sample_rates=np.full(N, 0.2),
            clip_norms=np.ones(N),
            noise_multiplier=0.5,
            max_grad_norm=1.0,
            steps=5,
            privacy_filter="individual",
        )
    assert engine.accountant is None and engine.filter is None  # refused before any state changed
    # a fixed order whose conversion alone costs more than the budget
    with pytest.raises(InvalidParameterError, match="too small for even one step.*larger --filter-order"):
        _run(
            data,
            Budgets.from_array(np.full(N, 0.5), DELTA),
            q=0.2,
            sigma=5.0,
            steps=2,
            spe=5,
            options=FilterOptions(order=1.5),
            record=False,
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"options": FilterOptions(order=1.0)}, "filter_order=1.0 is invalid"),
        ({"options": FilterOptions(order=0.5)}, "filter_order=0.5 is invalid"),
        ({"options": FilterOptions(extend=0.5)}, "filter_extend=0.5 is invalid"),
        ({"options": FilterOptions(gd=True)}, "full-batch DP-GD .* needs every sampling rate 1"),
        ({"options": "order 8"}, "filter_options='str' is invalid"),
        ({"privacy_filter": "personal"}, "privacy_filter='personal' is invalid"),
    ],
)
def test_bad_filter_options_are_refused(data, kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        _run(data, Budgets.from_array(np.full(N, 2.0), DELTA), q=0.2, sigma=2.0, steps=3, spe=5, record=False, **kwargs)


def test_pld_accountant_workers_individual_accounting_and_second_phase_are_refused(data):
    b = Budgets.from_array(np.full(N, 2.0), DELTA)
    kw = {
        "budgets": b,
        "sample_rates": np.full(N, 0.2),
        "clip_norms": np.ones(N),
        "noise_multiplier": 2.0,
        "max_grad_norm": 1.0,
        "steps": 3,
        "privacy_filter": "individual",
    }

    def make(engine, loader=None):
        model = toy_model()
        return engine.make_private_with_parameters(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader or DataLoader(TensorDataset(*data), batch_size=8),
            **kw,
        )

    with pytest.raises(
        InvalidParameterError, match="accountant='pld' is invalid: is not supported with the individual filter"
    ):
        make(IndividualizedPrivacyEngine(accountant="pld", seed=0))
    with pytest.raises(InvalidParameterError, match="num_workers=2 is invalid: must be 0"):
        make(
            IndividualizedPrivacyEngine(accountant="rdp", seed=0),
            DataLoader(TensorDataset(*data), batch_size=8, num_workers=2),
        )
    e = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    e.enable_individual_accounting(IndividualAccountingOptions(validate_subset=0))
    with pytest.raises(InvalidParameterError, match="individual_accounting=True is invalid: cannot be combined"):
        make(e)
    e = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    make(e)
    with pytest.raises(InvalidParameterError, match="cannot be combined"):
        e.enable_individual_accounting()
    with pytest.raises(InvalidParameterError, match="one-phase runs"):
        make(e)


# --- the filter against slow references -------------------------------------------------------
def test_gd_filter_matches_a_slow_reference(data):
    """Full-batch DP-GD (Feldman & Zrnic Alg. 3): the reference recomputes, from the model at every step,
    each example's norm by plain autograd, its Gaussian RDP α·min(c, ‖g‖)²/(2σ²c²) in closed form and the
    filter decision, example by example."""
    x, y = data
    budgets = Budgets.from_groups([1.0, 1.6], [0.5, 0.5], N, DELTA, seed=3)
    sigma, clip, steps = 8.0, 1.0, 18
    engine, log = _run(data, budgets, q=1.0, sigma=sigma, steps=steps, spe=1, clip=clip, options=FilterOptions(gd=True))
    f = engine.filter
    u, _ = order_universe()
    orders = {e: u[np.argmax([_budget_ref(e, a) / a for a in u])] for e in (1.0, 1.6)}
    alpha = np.array([orders[e] for e in budgets.epsilons])
    np.testing.assert_array_equal(f.order, alpha)
    budget = np.array([_budget_ref(e, a) for e, a in zip(budgets.epsilons, alpha, strict=True)])
    acc, active, dropped = np.zeros(N), np.ones(N, dtype=bool), np.full(N, -1)
    for t in range(steps):
        norms = _norms_at(log["theta"][t], x, y)
        for i in range(N):
            if not active[i]:
                continue
            rho = alpha[i] * min(clip, norms[i]) ** 2 / (2 * sigma**2 * clip**2)
            if acc[i] + rho <= budget[i] - 1e-9:
                acc[i] += rho
            else:
                active[i], dropped[i] = False, t + 1
        # every step uses exactly the active examples
        np.testing.assert_array_equal(np.sort(log["batches"][t]), np.flatnonzero(active))
        np.testing.assert_allclose(log["rdp"][t], acc, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(f.dropped_at, dropped)
    assert 0 < (dropped > 0).sum() < N  # the run really filtered, and not everyone
    assert np.all(f.realized_epsilons() <= budgets.epsilons)


def test_sgd_filter_matches_a_slow_reference(data):
    """Poisson DP-SGD with individual clipping: the reference recomputes each epoch's bounds from plain
    autograd norms (rounded up to multiples of r), charges dp_accounting's SGM RDP at the fixed order
    (not our RDP code) and applies the filter example by example; the batches hold active examples
    only and are clipped at the reference bounds."""
    x, y = data
    budgets = Budgets.from_groups([2.0, 3.0], [0.5, 0.5], N, DELTA, seed=1)
    q, sigma, clip, spe, steps, r, alpha = 0.2, 2.0, 1.0, 5, 30, 0.01, 8.0
    engine, log = _run(
        data,
        budgets,
        q=q,
        sigma=sigma,
        steps=steps,
        spe=spe,
        clip=clip,
        options=FilterOptions(order=alpha, rounding_step=r),
    )
    f = engine.filter
    budget = np.array([_budget_ref(e, alpha) for e in budgets.epsilons])
    acc, active, dropped = np.zeros(N), np.ones(N, dtype=bool), np.full(N, -1)
    bounds = np.full(N, clip)
    for t in range(steps):
        if t % spe == 0:  # a refresh: once per epoch
            norms = _norms_at(log["theta"][t], x, y)
            for i in np.flatnonzero(active):
                bounds[i] = min(clip, math.ceil(norms[i] / r - 1e-12) * r)
            np.testing.assert_allclose(log["bounds"][t][active], bounds[active], rtol=1e-12)
        for i in range(N):
            if not active[i]:
                continue
            rho = float(dpa._compute_rdp_poisson_subsampled_gaussian(q, sigma * clip / bounds[i], [alpha])[0])
            if acc[i] + rho <= budget[i] - 1e-9:
                acc[i] += rho
            else:
                active[i], dropped[i] = False, t + 1
        assert np.all(active[log["batches"][t]])  # a step never includes a dropped example
        np.testing.assert_allclose(log["rdp"][t], acc, rtol=1e-7, atol=1e-12)
    np.testing.assert_array_equal(f.dropped_at, dropped)
    assert 0 < (dropped > 0).sum() < N
    assert (dropped > 0).sum() and np.max(dropped) > spe  # drops happen after the first refresh too


def test_no_example_ever_exceeds_its_rdp_budget(data):
    """(a): after every step each example's RDP at its own order is ≤ its RDP budget, and every reported ε
    is ≤ its budget; three budget groups, default (worst-case optimal) orders."""
    budgets = Budgets.from_groups([1.5, 2.5, 4.0], [0.3, 0.4, 0.3], N, DELTA, seed=2)
    engine, log = _run(data, budgets, q=0.25, sigma=2.5, steps=40, spe=4)
    f = engine.filter
    assert len(np.unique(f.order)) == 3
    for rdp in log["rdp"]:
        assert np.all(rdp <= f.rdp_budget)
    assert np.all(engine.get_individual_epsilons() <= budgets.epsilons)
    assert np.all(f.realized_epsilons() <= budgets.epsilons)
    assert np.all(engine.get_epsilon().per_group <= engine.group_budgets)
    group = budgets.groups()[2]
    assert np.all(f.dropped_at[group == 0] > 0) and np.any(f.dropped_at[group == 1] > 0)  # budgets spent in the run
    # the realized ε is the RDP converted at each example's own order only
    for a in np.unique(f.order):
        m = f.order == a
        np.testing.assert_allclose(f.realized_epsilons()[m], rdp_to_epsilon(f.rdp_spent[m][:, None], [a], DELTA)[0])


def test_dropped_examples_never_enter_a_batch_again(data):
    """(b): once dropped, an example's sampling rate is 0 and it is in no later batch."""
    budgets = Budgets.from_groups([1.5, 3.0], [0.5, 0.5], N, DELTA, seed=4)
    engine, log = _run(data, budgets, q=0.3, sigma=2.5, steps=40, spe=4)
    f = engine.filter
    dropped = f.dropped_at
    assert (dropped > 0).sum() > 0
    seen_before_drop = 0
    for t, batch in enumerate(log["batches"], start=1):
        d = dropped[batch]
        assert np.all((d == -1) | (d > t)), f"step {t} holds a dropped example"
        seen_before_drop += int(np.sum(d > 0))
    assert seen_before_drop > 0  # dropped examples did train before their drop
    assert np.all(engine.data_loader.poisson_sampler.sample_rates[dropped > 0] == 0)
    assert np.all(engine.data_loader.poisson_sampler.sample_rates[dropped == -1] == 0.3)


def test_guard_refuses_a_batch_with_a_dropped_example(data):
    """A batch drawn before the filter's decision (e.g. prefetched) is refused before the noise."""
    budgets = Budgets.from_array(np.full(N, 2.0), DELTA)
    x, y = data
    model = toy_model()
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    module, opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        budgets=budgets,
        sample_rates=np.full(N, 1.0),
        clip_norms=np.ones(N),
        noise_multiplier=8.0,
        max_grad_norm=1.0,
        steps=5,
        steps_per_epoch=1,
        privacy_filter="individual",
        filter_options=FilterOptions(gd=True),
    )
    before = [p.detach().clone() for p in module.parameters()]
    xb, yb = next(iter(loader))  # drawn while everyone is active
    engine.filter.active[5] = False  # the filter drops example 5 afterwards
    opt.zero_grad()
    F.cross_entropy(module(xb), yb).backward()
    with pytest.raises(PrivacyBudgetExceeded, match="holds 1 example"):
        opt.step()
    assert engine.steps == 0 and engine.filter.steps == 0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.parametrize(("q", "spe"), [(1.0, 1), (0.1, 10)])
def test_all_budgets_equal_and_norms_at_the_clip_norm_stop_where_dp_sgd_stops(data, q, spe):
    """(c): every example is charged the worst case every step, so everyone is dropped at the same step:
    right after ordinary DP-SGD's last step — the RDP accountant's (max_steps_within) and the engine's
    group filter's stopping time."""
    eps, sigma, clip = 2.0, (6.0 if q == 1 else 1.2), 1e-3  # every gradient norm is far above 1e-3
    budgets = Budgets.from_array(np.full(N, eps), DELTA)
    t_star = max_steps_within([], q, sigma, eps, DELTA)
    assert 3 <= t_star <= 60
    engine, _ = _run(
        data,
        budgets,
        q=q,
        sigma=sigma,
        steps=t_star + 3,
        spe=spe,
        clip=clip,
        record=False,
        options=FilterOptions(gd=q == 1),
    )
    f = engine.filter
    assert np.all(f.bounds == clip)
    np.testing.assert_array_equal(f.dropped_at, np.full(N, t_star + 1))
    assert [int(c.sum()) for c in f.active_counts()] == [N] * t_star + [0] * 3
    group, _ = _run(
        data, budgets, q=q, sigma=sigma, steps=t_star, spe=spe, clip=clip, record=False, privacy_filter="group"
    )
    assert group.steps == t_star and not group.can_step()  # the group filter refuses step t* + 1


def test_engine_state_round_trip_continues_identically(data):
    budgets = Budgets.from_groups([1.5, 3.0], [0.5, 0.5], N, DELTA, seed=4)
    full, _ = _run(data, budgets, q=0.3, sigma=2.5, steps=16, spe=4, record=False)
    part, _ = _run(data, budgets, q=0.3, sigma=2.5, steps=16, stop=8, spe=4, record=False)
    state = part.state_dict()
    # a fresh engine on the same phase, loaded with the state, takes the remaining steps
    x, y = data
    model = toy_model()
    _raw(part.module)  # the first run's model at step 8
    model.load_state_dict(_raw(part.module).state_dict())
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    module, opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        budgets=budgets,
        sample_rates=np.full(N, 0.3),
        clip_norms=np.ones(N),
        noise_multiplier=2.5,
        max_grad_norm=1.0,
        steps=16,
        steps_per_epoch=4,
        privacy_filter="individual",
    )
    engine.load_state_dict(state)
    while engine.steps < 16:
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(module(xb), yb).backward()
            opt.step()
            if engine.steps >= 16:
                break
    np.testing.assert_array_equal(engine.filter.dropped_at, full.filter.dropped_at)
    np.testing.assert_allclose(engine.filter.rdp_spent, full.filter.rdp_spent, rtol=1e-12)
    np.testing.assert_array_equal(engine.filter.active_counts(), full.filter.active_counts())
    for a, b in zip(_raw(module).parameters(), _raw(full.module).parameters(), strict=True):
        torch.testing.assert_close(a, b)


# --- the training recipe -----------------------------------------------------------------
def _tiny_dataset(n=60):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n + 30, 1, 4, 4, generator=g)
    y = (x.flatten(1)[:, 0] > 0).long()
    return Dataset("tiny", x[:n], y[:n], x[n:], y[n:], 2)


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 2))


@pytest.mark.parametrize(("gd", "method"), [(True, "uniform"), (False, "sample")])
def test_train_filtered_writes_private_active_counts_and_epsilons(tmp_path, gd, method):
    ds = _tiny_dataset()
    budgets = Budgets.from_groups([2.0, 2.2], [0.5, 0.5], 60, DELTA, seed=0)
    cfg = TrainConfig(method=method, epochs=4, batch_size=12, lr=0.5, clip_norm=1.0, seed=0, progress=False)
    report = train_filtered(ds, budgets, cfg, FilterOptions(gd=gd, extend=2.0), tmp_path / "run", model=_tiny_model())
    run = tmp_path / "run"
    steps = report["steps"]
    assert steps == report["filter"]["run_steps"] == 2 * report["filter"]["calibrated_steps"]
    for name in ("active.csv", "active.png", "filter_epsilons.csv", "filter.json", "history.json", "checkpoint.pt"):
        assert file_mode(run / "private" / name) == 0o600, name
    assert file_mode(run / "report.json") == 0o644
    public = (run / "report.json").read_text()
    assert "realized" not in public and "active_per_step" not in public
    table = np.genfromtxt(run / "private" / "filter_epsilons.csv", delimiter=",", names=True)
    assert np.all(table["epsilon"] <= table["budget"]) and np.all(table["rdp_spent"] <= table["rdp_budget"])
    active = np.genfromtxt(run / "private" / "active.csv", delimiter=",", names=True)
    assert active.size == steps
    for t, row in enumerate(np.atleast_1d(active), start=1):  # counts agree with the drop steps
        alive = (table["dropped_at_step"] == -1) | (table["dropped_at_step"] > t)
        assert row["active_total"] == alive.sum()
        assert row["active_budget_2"] == (alive & (table["budget"] == 2.0)).sum()
    for g in report["groups"]:
        assert g["epsilon_spent"] <= g["budget"] and "epsilon_rdp" not in g
    assert report["private"]["filter"]["all_at_or_below_budget"]
    if gd:
        assert report["batch_size"] == 60 and report["phases"][0]["sample_rate"] == 1.0


def test_train_filtered_refuses_what_it_cannot_honour():
    ds = _tiny_dataset()
    b = Budgets.from_array(np.full(60, 2.0), DELTA)
    for cfg, opts, match in [
        (TrainConfig(method="uniform", accountant="pld"), None, "accountant='pld' is invalid: is not supported"),
        (TrainConfig(method="exclude"), None, "method='exclude' is invalid"),
        (TrainConfig(method="sample"), FilterOptions(gd=True), "method='sample' is invalid: cannot be used with --gd"),
        (TrainConfig(method="uniform"), FilterOptions(order=1.0), "filter_order=1.0 is invalid"),
    ]:
        with pytest.raises(InvalidParameterError, match=match):
            train_filtered(ds, b, cfg, opts)


def test_train_filtered_resumes_exactly(tmp_path, crash_after_first_checkpoint):
    ds = _tiny_dataset()
    budgets = Budgets.from_groups([2.0, 2.2], [0.5, 0.5], 60, DELTA, seed=0)
    cfg = TrainConfig(method="uniform", epochs=2, batch_size=12, lr=0.5, seed=3, progress=False)
    opts = FilterOptions(extend=2.0)
    whole = train_filtered(ds, budgets, cfg, opts, tmp_path / "a", model=_tiny_model())
    with crash_after_first_checkpoint():
        train_filtered(ds, budgets, cfg, opts, tmp_path / "b", model=_tiny_model())
    resumed = train_filtered(ds, budgets, cfg, opts, tmp_path / "b", resume=True, model=_tiny_model())
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    a = (tmp_path / "a" / "private" / "filter_epsilons.csv").read_text()
    b = (tmp_path / "b" / "private" / "filter_epsilons.csv").read_text()
    assert a == b
    assert (tmp_path / "a" / "private" / "active.csv").read_text() == (
        tmp_path / "b" / "private" / "active.csv"
    ).read_text()
    with pytest.raises(InvalidParameterError, match="other settings"):
        train_filtered(ds, budgets, cfg, FilterOptions(extend=3.0), tmp_path / "b", resume=True, model=_tiny_model())


# --- command-line options ---------------------------------------------------------------
def test_filter_arguments_parse_and_refuse_bad_values():
    import argparse

    from idpsgd.cli.filter_args import add_filter_arguments, filter_options_from_args

    p = argparse.ArgumentParser()
    p.add_argument("--accountant", default="rdp")
    add_filter_arguments(p.add_argument_group("filter"))
    assert filter_options_from_args(p.parse_args([])) is None
    o = filter_options_from_args(
        p.parse_args(["--filter", "individual", "--filter-order", "8", "--gd", "--filter-extend", "3"])
    )
    assert o == FilterOptions(order=8.0, gd=True, extend=3.0)
    with pytest.raises(InvalidParameterError, match="filter_order=1.0 is invalid"):
        filter_options_from_args(p.parse_args(["--filter", "individual", "--filter-order", "1"]))
    with pytest.raises(InvalidParameterError, match="gd=True is invalid: needs --filter individual"):
        filter_options_from_args(p.parse_args(["--gd"]))
    with pytest.raises(InvalidParameterError, match="accountant='pld' is invalid: is not supported"):
        filter_options_from_args(p.parse_args(["--filter", "individual", "--accountant", "pld"]))


def test_ghost_clipping_takes_the_same_filter_decisions_as_per_sample_gradients(data):
    """The filter's bounds reach the ghost-clipping module too (one PerExampleClipping): same drops, same
    RDP and (to float precision) the same model as with materialised per-sample gradients."""
    budgets = Budgets.from_groups([1.5, 3.0], [0.5, 0.5], N, DELTA, seed=4)
    x, y = data
    out = {}
    for mode in ("hooks", "ghost"):
        model = toy_model()
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
        res = engine.make_private_with_parameters(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            budgets=budgets,
            sample_rates=np.full(N, 0.3),
            clip_norms=np.ones(N),
            noise_multiplier=2.5,
            max_grad_norm=1.0,
            steps=12,
            steps_per_epoch=4,
            grad_sample_mode=mode,
            privacy_filter="individual",
        )
        if mode == "ghost":
            module, opt, crit, loader = res
        else:
            (module, opt, loader), crit = res, nn.CrossEntropyLoss()
        while engine.steps < 12:
            for xb, yb in loader:
                opt.zero_grad()
                crit(module(xb), yb).backward()
                opt.step()
                if engine.steps >= 12:
                    break
        out[mode] = engine, [p.detach().clone() for p in _raw(module).parameters()]
    (a, pa), (b, pb) = out["hooks"], out["ghost"]
    np.testing.assert_array_equal(a.filter.dropped_at, b.filter.dropped_at)
    assert (a.filter.dropped_at > 0).any()
    np.testing.assert_allclose(a.filter.rdp_spent, b.filter.rdp_spent, rtol=1e-6)
    for u, v in zip(pa, pb, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)
