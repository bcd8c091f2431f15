import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's digits (:func:`idpsgd.data.load_dataset`), loaded once per test module."""
    from idpsgd.data import load_dataset

    return load_dataset("digits")


class CheckpointCrash(Exception):
    """Raised right after a run's first checkpoint is written (a simulated crash)."""


@pytest.fixture
def crash_after_first_checkpoint(monkeypatch):
    """Context manager: inside it, a training run raises :class:`CheckpointCrash` after its first checkpoint."""
    import contextlib

    from idpsgd.training import Trainer

    original = Trainer.save_checkpoint

    @contextlib.contextmanager
    def crashing():
        calls = {"n": 0}

        def crash(self):
            original(self)
            calls["n"] += 1
            if calls["n"] == 1:
                raise CheckpointCrash

        monkeypatch.setattr(Trainer, "save_checkpoint", crash)
        try:
            with pytest.raises(CheckpointCrash):
                yield
        finally:
            monkeypatch.setattr(Trainer, "save_checkpoint", original)

    return crashing
