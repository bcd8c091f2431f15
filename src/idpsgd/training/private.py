"""``make_private_individualized``: Opacus's ``make_private`` for per-example q_i and c_i."""
from __future__ import annotations

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator

from ..assignment import Assignment
from ..validation import InvalidParameterError
from .optimizer import IndividualizedDPOptimizer
from .sampler import IndexedLoader, PoissonSampler


def _tensors(data):
    if hasattr(data, "x_train"):                       # idpsgd.data.Dataset
        return data.x_train, data.y_train
    if isinstance(data, torch.utils.data.TensorDataset):
        return data.tensors[0], data.tensors[1]
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return torch.as_tensor(data[0]), torch.as_tensor(data[1])
    raise InvalidParameterError("data", type(data).__name__,
                                "must be an idpsgd Dataset, a TensorDataset (x, y) or a tuple (x, y)")


def steps_per_epoch_for(sample_rate: float) -> int:
    """Batches per epoch for a mean rate q: round(1/q), at least 1 (Opacus's ``len(DPDataLoader)``)."""
    return max(1, int(round(1.0 / float(sample_rate))))


def make_private_individualized(module: torch.nn.Module, optimizer: torch.optim.Optimizer, data,
                                assignment: Assignment, *, seed: int | np.random.Generator = 0,
                                noise_generator: torch.Generator | None = None,
                                steps_per_epoch: int | None = None, secure_mode: bool = False):
    """Wrap a model, optimizer and data for individualized DP-SGD.

    Example i (the i-th row of ``data``) is sampled with ``assignment.sample_rates[i]`` and
    clipped at ``assignment.clip_norms[i]``; every step adds noise N(0, (σ·c)²) with
    σ = ``assignment.noise_multiplier`` and c = ``assignment.clip_norm``, and divides by the
    expected batch size Σ_i q_i.  The model's loss must use ``reduction="mean"`` (as in Opacus).

    Args:
        module: a PyTorch model (or an existing ``GradSampleModule``) that Opacus can handle.
        optimizer: the torch optimizer over ``module``'s parameters.
        data: ``(x, y)`` tensors, a ``TensorDataset`` or an :class:`idpsgd.data.Dataset`.
        assignment: from :func:`idpsgd.assignment.assign`, one entry per row of ``data``.
        seed: seeds the Poisson sampler (or a shared ``numpy.random.Generator``).
        noise_generator: torch generator of the Gaussian noise (default: seeded from ``seed``).
        steps_per_epoch: batches per epoch (default round(1/q)).

    Returns:
        ``(module, optimizer, loader)``: a ``GradSampleModule``, an
        :class:`IndividualizedDPOptimizer` and an :class:`IndexedLoader` yielding ``(x, y, idx)``.
    """
    x, y = _tensors(data)
    n = len(assignment.example_group)
    if len(x) != n:
        raise InvalidParameterError("data", f"{len(x)} examples", f"must match the assignment's {n} examples")
    if not isinstance(module, GradSampleModule):
        errors = ModuleValidator.validate(module, strict=False)
        if errors:
            raise InvalidParameterError("module", type(module).__name__,
                                        f"is not Opacus-compatible: {errors[0]} (see ModuleValidator.fix)")
        module = GradSampleModule(module, batch_first=True, loss_reduction="mean")
    if noise_generator is None:
        noise_generator = torch.Generator().manual_seed(int(seed) if isinstance(seed, (int, np.integer)) else 0)
    dp_optimizer = IndividualizedDPOptimizer(
        optimizer, noise_multiplier=assignment.noise_multiplier, max_grad_norm=assignment.clip_norm,
        clip_norms=assignment.clip_norms, expected_batch_size=assignment.expected_batch_size,
        loss_reduction="mean", generator=noise_generator, secure_mode=secure_mode)
    sampler = PoissonSampler(assignment.sample_rates, steps_per_epoch or steps_per_epoch_for(assignment.sample_rate),
                             seed)
    loader = IndexedLoader(x, y, sampler, on_batch=dp_optimizer.set_batch_indices)
    return module, dp_optimizer, loader
