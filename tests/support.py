"""Plain helpers shared by several test files (fixtures live in ``conftest.py``).

* :func:`per_example_grads` / :func:`per_example_norms`: the reference every per-example-gradient test
  checks the engine against: one backward pass per example, nothing batched, nothing clever.
* :func:`toy_classification`: a seeded, linearly separable 6-feature binary task.
* :func:`file_mode`: the permission bits of a file, for the checks that private outputs are 0600 and
  private folders 0700.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

import numpy as np
import torch
from torch import nn


def _cross_entropy(model: nn.Module, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def per_example_grads(
    model: nn.Module,
    x,
    y,
    loss: Callable[[nn.Module, object, object], torch.Tensor] = _cross_entropy,
    params: list[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Each example's loss gradient by its own backward pass: a ``(len(x), P)`` tensor whose row ``i`` is
    the gradient of ``loss(model, x[i:i+1], y[i:i+1])`` (a scalar; default: the cross-entropy of the
    model's output) with respect to ``params`` (default: the model's trainable parameters, in order),
    flattened and concatenated; zeros for a parameter the example's loss does not reach.

    The model's ``.grad`` fields are not touched (``torch.autograd.grad``)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss(model, x[i : i + 1], y[i : i + 1]), params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
            )
        )
    return torch.stack(rows)


def per_example_norms(model: nn.Module, x, y, loss=_cross_entropy) -> np.ndarray:
    """‖∇ loss_i‖ of each example (float64 numpy), from :func:`per_example_grads`."""
    return per_example_grads(model, x, y, loss).double().norm(dim=1).numpy()


def file_mode(path) -> int:
    """The permission bits of ``path`` (``stat.S_IMODE``: 0o600 for a private file, 0o700 for a private folder)."""
    return stat.S_IMODE(os.stat(path).st_mode)


def toy_classification(n: int, weight: float):
    """``n`` standard-normal 6-feature points labelled by the sign of x0 + weight·x1 (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + weight * x[:, 1] > 0).long()
