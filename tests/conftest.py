"""Fixtures shared by the test files.

``make test`` runs the suite on pytest-xdist's workers, one per core, a file at a time (``-n auto --dist
loadfile``): a file's module-scoped fixtures (a training run or a spawn of processes read by several tests)
are made once, as in one process, and nothing lists the files.  Each worker's torch takes its share of the
cores (set below, before torch is imported), not all of them."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # n workers on n cores: a thread each, not n threads each
    _share = (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if not os.environ.get("OMP_NUM_THREADS"):  # unset or empty (an empty value means all cores to torch)
        os.environ["OMP_NUM_THREADS"] = str(max(1, _share))

import numpy as np
import pytest


def pytest_collection_finish(session):
    """Everything collection imported (torch, transformers, opacus, ...: millions of objects) moves to the
    collector's permanent generation: a full collection no longer walks it.  Hugging Face's Trainer runs
    ``gc.collect()`` at the start of every training (accelerate's ``free_memory``), about 0.3 s each in a
    process that imported the whole suite's libraries; Python's own full collections cost the same."""
    import gc

    gc.collect()
    gc.freeze()


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
