"""One set-up phase as one record, handed to the parts that run on it instead of the engine.

``make_private`` checks, plans and builds a phase (:mod:`.checks`, :mod:`.plan`, :mod:`.step`); what then
runs on the phase — the individual Rényi filter (:mod:`.budget.filter`) and individual accounting (Yu et al.
2023, :mod:`.budget.individual`) — reads its plan, clipping, ledger, module, optimizer and loader, the users at
user level, and asks two things of the rest of the run: whether the filter admits one more step
(:attr:`Phase.can_step`) and each example's (or user's) gradient norm at the current parameters
(:meth:`Phase.grad_norms`).  This record is all they get: no part holds the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Phase:
    """The current phase's parts (``engine.phase``): read, never rebound, by the parts it is handed to."""

    parameters: Any  # PhaseParameters: q_i, c_i, σ, c, the plan
    clipping: Any  # PerExampleClipping (UserClipping at user level)
    accountant: Any  # the GroupAccountant: the ledger of every phase
    module: Any  # the wrapped module
    optimizer: Any  # the noisy optimizer
    data_loader: Any  # the PrivateDataLoader
    users: Any  # Users at user level, else None
    sampler_rng: Any  # the Poisson sampler's source (the user-level norm passes draw each user's rows from it)
    can_step: Callable[[], bool]  # whether the engine's filter admits one more step

    @property
    def steps(self) -> int:
        """Logical steps taken so far (all phases)."""
        return self.accountant.steps

    @property
    def privacy_units(self) -> int:
        """The privacy units: the dataset's examples, or the users at user level."""
        return len(self.data_loader.dataset) if self.users is None else self.users.num_users

    def grad_norms(self, per_sample_loss=None, indices=None, batch_size: int = 256):
        """(norms, losses) of each unit's loss gradient at the current parameters (private values): the
        examples' (:func:`~.distributed.sharded_grad_norms`), or at user level each user's summed gradient
        over a fresh choice of up to k of its rows (:func:`~.per_example.user_norms.per_user_grad_norms`)."""
        from .distributed import sharded_grad_norms

        loader = self.data_loader
        idx = np.arange(self.privacy_units) if indices is None else np.asarray(indices, dtype=np.int64)
        collate = getattr(loader.collate_fn, "collate_fn", loader.collate_fn)
        if self.users is not None:
            return self.user_grad_norms(idx, collate, batch_size, per_sample_loss)
        return sharded_grad_norms(self.module, loader.dataset, idx, collate, batch_size, per_sample_loss)

    def user_grad_norms(self, units, collate, batch_size: int, per_sample_loss=None):
        """User level: (norms, losses) of ``units`` (user indices), each over a random choice of up to k of
        the user's rows drawn from the sampler's source (seeded, or secure)."""
        from .per_example.user_norms import per_user_grad_norms

        return per_user_grad_norms(
            self.module, self.data_loader.dataset, self.users, units, collate, batch_size, per_sample_loss,
            self.sampler_rng,
        )  # fmt: skip


__all__ = ["Phase"]
