"""The engine's layout: one record per grad_sample_mode decides its wrapper and optimizers, and a
failed set-up leaves the engine as it was (issue 41).  The package-wide import checks (no circle,
no private name imported across modules) are in test_names.py; the circle finder is tested here.
"""

from __future__ import annotations

from support import import_cycles


def test_the_circle_finder_finds_a_circle_of_three():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_grad_sample_mode_has_one_record_that_builds_its_wrapper_and_optimizer():
    from idpsgd.engine.modes import ENGINE_MODES, MODES
    from idpsgd.engine.noise.optimizer import IndividualizedDPOptimizer

    assert tuple(MODES) == ENGINE_MODES == ("hooks", "functorch", "ew", "ghost", "bk", "no_op")
    for name, record in MODES.items():
        assert record.name == name and issubclass(record.distributed_optimizer, record.optimizer)
    assert MODES["ghost"].returns_criterion and MODES["bk"].book_keeping
    assert MODES["no_op"].optimizer is IndividualizedDPOptimizer and not MODES["no_op"].engine_computes
    # FSDP2 (engine/distributed/fsdp.py): book-keeping and ghost clipping only
    assert [name for name, record in MODES.items() if record.sharded_optimizer is not None] == ["ghost", "bk"]


def test_a_set_up_that_fails_while_building_leaves_the_engine_as_it_was(monkeypatch):
    """The rollback is complete: a first phase whose build fails leaves no ledger, clipping, noise
    source, sampler source or new seeds behind (issue 41: the noise and sampler sources were left
    set), and the next set-up works."""
    import pytest
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import idpsgd.engine.step as step
    from idpsgd.engine import IndividualizedPrivacyEngine

    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    engine = IndividualizedPrivacyEngine(accountant="rdp")  # seed followed from torch: drawn at set-up
    seeds = engine.seeds
    kwargs = dict(data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2)
    built = step.PrivateDataLoader

    def broken(*args, **kwargs):
        raise RuntimeError("the loader could not be built")

    monkeypatch.setattr(step, "PrivateDataLoader", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    state = (engine.accountant, engine.budgets, engine.clipping, engine.noise_source, engine._sampler_rng)
    assert state == (None, None, None, None, None) and engine.seeds is seeds and engine.parameters is None
    monkeypatch.setattr(step, "PrivateDataLoader", built)
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert engine.accountant is not None and len(engine.accountant.phases) == 1 and engine.steps == 0


def test_every_engine_module_is_in_its_sub_package_and_no_import_uses_an_old_path():
    """tools/engine_layout.py (issue 49): the engine's listing is the step, and nothing names a module's old path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "engine_layout.py"
    spec = importlib.util.spec_from_file_location("engine_layout", path)
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    assert layout.problems() == []
    assert layout.rewrite_text("from idpsgd.engine import fsdp, modes") == (
        "from idpsgd.engine.distributed import fsdp\nfrom idpsgd.engine import modes"
    )
