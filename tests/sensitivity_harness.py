"""The privacy review's sensitivity harness (issue 35): ‖S(D ∪ {z}) − S(D)‖ of the engine's clipped sum.

DP-SGD's guarantee rests on one number: adding or removing an example z changes the step's clipped
sum S = Σ_i clip_c(g_i) by at most c.  The harness measures it end to end through the engine, in any
``grad_sample_mode``: the noise is patched to 0, every sampling rate is 1 (the Poisson batch is the
whole data set), the loss is summed (``loss_reduction="sum"``: the optimizer's gradient *is* S),
and one step is taken on D and on D ∪ {z} from the same initial model, for random z.  For a model
whose examples do not interact (an MLP), every z with ‖g_z‖ ≥ c gives exactly c in every mode; any
excess is a real sensitivity violation (the reviewer's figures for models that mix examples within
the batch: 4.8 to 10.3 at c = 1).

Use :func:`sensitivity` (the largest ‖ΔS‖ over ``trials`` draws of z) with a :class:`Case`: how to
build the model (the same initial parameters every call), its data set D, how to draw z, how to
call the model on a batch and the per-example loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import IndividualizedPrivacyEngine

MODES = ("hooks", "functorch", "ghost", "ew", "bk")


def _call(model, x):
    return model(x)


def _cross_entropy(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


@dataclass
class Case:
    """A model and data for the harness.

    Attributes:
        build: a fresh model, the same initial parameters on every call (seed inside).
        x, y: the data set D.
        draw: ``draw(generator) -> (x_z, y_z)``, one extra example (no batch dimension).
        call: ``call(model, x_batch)`` -> the model's output (default ``model(x)``).
        loss: ``loss(output, y_batch)`` -> one loss per example (default cross-entropy).
    """

    build: Callable[[], nn.Module]
    x: torch.Tensor
    y: torch.Tensor
    draw: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    call: Callable = _call
    loss: Callable = _cross_entropy


class _Criterion(nn.Module):
    """The per-example loss as a criterion with ``reduction`` (ghost mode's loss wrapper sets "none")."""

    def __init__(self, loss):
        super().__init__()
        self.loss, self.reduction = loss, "sum"

    def forward(self, out, y):
        per_example = self.loss(out, y)
        return per_example if self.reduction == "none" else per_example.sum()


def _no_noise(std, reference, *args, **kwargs):
    return torch.zeros_like(reference)


def private(case: Case, x, y, mode: str, c: float = 1.0):
    """(engine, module, optimizer, criterion or None, loader) over (x, y) with rate 1 and the noise patched
    to 0 by the caller (:func:`clipped_sum`); ``make_private`` as a user calls it."""
    model = case.build()
    crit = _Criterion(case.loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Secure RNG turned off", UserWarning)
        engine = IndividualizedPrivacyEngine(seed=0)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=1.0,
        max_grad_norm=c,
        sample_rate=1.0,
        loss_reduction="sum",
        grad_sample_mode=mode,
        criterion=crit if mode == "ghost" else None,
    )
    if mode == "ghost":
        module, optimizer, criterion, loader = out
    else:
        (module, optimizer, loader), criterion = out, None
    return engine, module, optimizer, criterion, loader


def clipped_sum(case: Case, x, y, mode: str, c: float = 1.0) -> torch.Tensor:
    """S: the engine's clipped sum of one step over every example of (x, y), without noise (flat)."""
    with mock.patch("idpsgd.engine.noise.optimizer.gaussian_like", _no_noise):
        engine, module, optimizer, criterion, loader = private(case, x, y, mode, c)
        (xb, yb) = next(iter(loader))
        assert len(xb) == len(x), "sampling rate 1: the whole data set"
        optimizer.zero_grad()
        out = case.call(module, xb)
        loss = criterion(out, yb) if criterion is not None else case.loss(out, yb).sum()
        loss.backward()
        optimizer.step()
    assert engine.steps == 1
    return torch.cat([p.grad.detach().reshape(-1) for p in optimizer.params])


def sensitivity(case: Case, mode: str, c: float = 1.0, trials: int = 3, seed: int = 0) -> float:
    """max over ``trials`` random z of ‖S(D ∪ {z}) − S(D)‖ (≤ c for a model whose examples do not interact)."""
    base = clipped_sum(case, case.x, case.y, mode, c)
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(trials):
        xz, yz = case.draw(g)
        x = torch.cat([case.x, xz.unsqueeze(0).to(case.x.dtype)])
        y = torch.cat([case.y, yz.unsqueeze(0).to(case.y.dtype)])
        worst = max(worst, float((clipped_sum(case, x, y, mode, c) - base).norm()))
    return worst
