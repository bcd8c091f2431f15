"""Per-example gradient norms (and losses) of training examples at the current model.

Yu et al. 2023, Alg. 2 line 3: the batch gradient norms ‖g_i‖ at θ_t, with the model in eval
mode and no optimizer step.  Computed in batches through Opacus's ``GradSampleModule`` hooks.
Opacus only captures activations of modules in training mode, so the model is put in eval mode
and only the modules that own trainable parameters (Linear, Conv, GroupNorm, …: layers that
behave the same in both modes) are switched back to training mode; dropout and the like stay in
eval mode.  The parameters' ``.grad`` and ``.grad_sample`` are cleared afterwards.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from opacus import GradSampleModule


def _clear(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad_sample = None
        p.grad = None


def per_example_grad_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256):
    """(norms, losses): the L2 norm of each example's cross-entropy gradient, and the loss."""
    wrapped = not isinstance(model, GradSampleModule)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean") if wrapped else model
    module = gsm._module
    modes = {m: m.training for m in module.modules()}
    module.eval()
    for m in module.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            m.training = True
    params = [p for p in gsm.parameters() if p.requires_grad]
    norms, losses = [], []
    try:
        _clear(gsm)
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            out = gsm(xb)
            F.cross_entropy(out, yb).backward()   # mean loss: Opacus rescales to per-example grads
            sq = sum(p.grad_sample.reshape(len(xb), -1).pow(2).sum(1) for p in params)
            norms.append(sq.sqrt().detach())
            losses.append(F.cross_entropy(out.detach(), yb, reduction="none"))
            _clear(gsm)
    finally:
        for m, mode in modes.items():
            m.training = mode
        _clear(gsm)
        if wrapped:
            gsm._close()
    if not norms:
        return np.zeros(0), np.zeros(0)
    return torch.cat(norms).double().numpy(), torch.cat(losses).double().numpy()
