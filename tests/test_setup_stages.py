"""The set-up's stages (docs/inside-the-engine.md): the check stage is pure — a check that refuses late
leaves the module, the seeds and the process state as they were — and each check runs once."""

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import InvalidParameterError
from idpsgd.assignment import Budgets
from idpsgd.engine import IndividualizedPrivacyEngine
from support import toy_classification, toy_model

N, DELTA = 48, 1e-5


def _phase(module, optimizer, loader, clip=1.0, **kwargs):
    """make_private_with_parameters' arguments for one phase (uniform rate, clip norms ``clip``)."""
    return dict(
        module=module,
        optimizer=optimizer,
        data_loader=loader,
        budgets=Budgets.from_array(np.full(N, 8.0), DELTA),
        sample_rates=np.full(N, 0.25),
        clip_norms=np.full(N, clip),
        noise_multiplier=1.5,
        max_grad_norm=1.0,
        steps=2,
        **kwargs,
    )


def test_a_late_refusal_leaves_an_earlier_phases_hooks_on_the_module():
    """wrap_model=False: Opacus's hooks stay on the user's module; a later phase refused by a check (here
    clip norms of 0, checked after the mode and the module) keeps them — the earlier phase still trains."""
    x, y = toy_classification(N, 0.3)
    loader = DataLoader(TensorDataset(x, y), batch_size=12)
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    hooks, dp_opt, private = engine.make_private_with_parameters(**_phase(model, opt, loader, wrap_model=False))
    assert hasattr(model, "autograd_grad_sample_hooks")
    with pytest.raises(InvalidParameterError, match="clip_norms"):
        engine.make_private_with_parameters(**_phase(model, opt, loader, clip=0.0, wrap_model=False))
    assert hasattr(model, "autograd_grad_sample_hooks")  # not released by the refused set-up
    assert engine.module is hooks and engine.steps == 0
    xb, yb = next(iter(private))
    dp_opt.zero_grad()
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    dp_opt.step()  # the earlier phase trains on
    assert engine.steps == 1


@pytest.fixture
def one_rank_group():
    """A process group of one rank (gloo) in this process, destroyed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_late_refusal_draws_no_seed_from_torch(one_rank_group):
    """A data-parallel model whose seeds follow torch: the seed every rank shares is drawn from torch's
    global generator at build, not by the checks — a set-up refused by a late check leaves torch's random
    state and the engine's seeds as they were."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    x, y = toy_classification(N, 0.3)
    loader = DataLoader(TensorDataset(x, y), batch_size=12)
    model = DPDDP(toy_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = IndividualizedPrivacyEngine(accountant="rdp")  # no seed: drawn from torch at the first draw
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    with pytest.raises(InvalidParameterError, match="clip_norms"):
        engine.make_private_with_parameters(**_phase(model, opt, loader, clip=0.0))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert engine.seed is None and engine.sampler_seed is None and engine.accountant is None
    engine.make_private_with_parameters(**_phase(model, opt, loader))  # the valid set-up draws it
    assert engine.seed is not None
    assert not torch.equal(torch.random.get_rng_state(), state)


def test_each_check_runs_once_per_set_up():
    """make_private_with_epsilon → make_private → make_private_with_parameters: the units are counted, the
    budgets, σ and the module checked once (before issue 49: 3, 3, 2 and 2 times)."""
    from unittest import mock

    import idpsgd.engine.checks as checks
    import idpsgd.engine.plan as plan
    import idpsgd.engine.privacy_engine as pe
    from idpsgd.engine.noise import optimizer
    from idpsgd.engine.per_example import wrap

    calls = {"count_units": 0, "check_budgets": 0, "check_noise": 0, "check_wrappable": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    sites = [(m, n) for n in calls for m in (checks, plan, pe, optimizer, wrap) if hasattr(m, n)]
    patches = [mock.patch.object(m, n, counted(n, getattr(m, n))) for m, n in sites]
    x, y = toy_classification(N, 0.3)
    model = toy_model()
    for p in patches:
        p.start()
    try:
        IndividualizedPrivacyEngine(accountant="rdp", seed=0).make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=12),
            budgets=np.full(N, 4.0),
            target_delta=DELTA,
            epochs=1,
            max_grad_norm=1.0,
        )
    finally:
        for p in patches:
            p.stop()
    assert calls == {"count_units": 1, "check_budgets": 1, "check_noise": 1, "check_wrappable": 1}
