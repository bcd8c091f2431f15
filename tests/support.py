"""Plain helpers shared by several test files (fixtures live in ``conftest.py``).

* :func:`per_example_grads` / :func:`per_example_norms`: the reference every per-example-gradient test
  checks the engine against: one backward pass per example, nothing batched, nothing clever.
* :func:`toy_classification` and :func:`toy_model`: a seeded 6-feature binary task and a small MLP for it.
* :func:`file_mode`: the permission bits of a file, for the checks that private outputs are 0600 and
  private folders 0700; :func:`mode_problems` checks a whole run folder so, and :func:`public_files`
  lists what anyone may read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

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


PRIVATE = "private"  # a run folder's private sub-folder (idpsgd.runfolder.PRIVATE), spelled out here


def file_mode(path) -> int:
    """The permission bits of ``path`` (``stat.S_IMODE``: 0o600 for a private file, 0o700 for a private folder)."""
    return stat.S_IMODE(os.stat(path).st_mode)


def public_files(folder: Path) -> list[Path]:
    """Files outside any ``private/`` folder, and every file that group or others can read (sorted)."""
    out = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        if PRIVATE not in p.relative_to(folder).parts or file_mode(p) & 0o077:
            out.append(p)
    return out


def mode_problems(folder: Path) -> list[str]:
    """Every ``private/`` folder under ``folder`` not 0700 and every file inside one not 0600 (empty: all good)."""
    problems = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        mode = file_mode(p)
        if p.is_dir() and p.name == PRIVATE and mode != 0o700:
            problems.append(f"{rel}: mode {mode:o}, expected 700")
        elif PRIVATE in rel.parts and p.is_dir() and mode != 0o700:
            problems.append(f"{rel}: private folder with mode {mode:o}, expected 700")
        elif PRIVATE in rel.parts and p.is_file() and mode != 0o600:
            problems.append(f"{rel}: private file with mode {mode:o}, expected 600")
    return problems


def toy_classification(n: int, weight: float):
    """``n`` standard-normal 6-feature points labelled by the sign of x0 + weight·x1 (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + weight * x[:, 1] > 0).long()


def toy_model(seed: int = 1) -> nn.Module:
    """A 6 → 8 → 2 tanh MLP for :func:`toy_classification`, initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
