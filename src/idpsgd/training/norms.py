"""Per-example gradient norms (and losses) of training examples at the current model.

Yu et al. 2023, Alg. 2 line 3: the batch gradient norms ‖g_i‖ at θ_t, with the model in eval
mode and no optimizer step.  Computed in batches with Opacus's
``GradSampleModuleFastGradientClipping`` (ghost norms: for Linear layers ‖a_i‖·‖b_i‖ without
materialising per-example gradients; per-example gradients for the other layers), about twice
as fast as materialising every per-example gradient.  The norm module is attached once to the
model and its hooks are enabled only here; a training ``GradSampleModule`` around the same model
has its hooks disabled meanwhile.  Opacus only captures activations of modules in training mode,
so the model is put in eval mode and only the modules that own trainable parameters (Linear,
Conv, GroupNorm, …: layers that behave the same in both modes) are switched back to training
mode; dropout and the like stay in eval mode.  ``.grad`` and Opacus's per-parameter fields are
cleared afterwards.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping


def _clear(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad_sample = None
        p.grad = None
        if hasattr(p, "_norm_sample"):
            p._norm_sample = None


@contextlib.contextmanager
def eval_mode_with_hooks(module: torch.nn.Module):
    """Eval mode, except for modules that own trainable parameters (which Opacus hooks need)."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    for m in module.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            m.training = True
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _norm_module(model: torch.nn.Module):
    """(outer GradSampleModule or None, the cached ghost-norm module around the raw model)."""
    outer = model if isinstance(model, GradSampleModule) else None
    raw = outer._module if outer is not None else model
    fast = getattr(raw, "_idpsgd_norm_module", None)
    if fast is None:
        # Opacus refuses a second hook set on one model through this marker attribute; the norm
        # module keeps its own hook list, and the marker is restored for the training wrapper.
        marker = raw.__dict__.pop("autograd_grad_sample_hooks", None)
        try:
            fast = GradSampleModuleFastGradientClipping(raw, batch_first=True, loss_reduction="mean",
                                                        use_ghost_clipping=True)
        finally:
            raw.__dict__.pop("autograd_grad_sample_hooks", None)
            if marker is not None:
                raw.autograd_grad_sample_hooks = marker
        fast.disable_hooks()
        object.__setattr__(raw, "_idpsgd_norm_module", fast)   # not a registered submodule
    return outer, raw, fast


def per_example_grad_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256):
    """(norms, losses): the L2 norm of each example's cross-entropy gradient, and the loss."""
    outer, raw, fast = _norm_module(model)
    norms, losses = [], []
    if outer is not None:
        outer.disable_hooks()
    fast.enable_hooks()
    try:
        with eval_mode_with_hooks(raw):
            _clear(raw)
            for i in range(0, len(x), batch_size):
                xb, yb = x[i:i + batch_size], y[i:i + batch_size]
                out = fast(xb)
                F.cross_entropy(out, yb).backward()   # mean loss: Opacus rescales to per-example norms
                norms.append(fast.get_norm_sample().detach())
                losses.append(F.cross_entropy(out.detach(), yb, reduction="none"))
                _clear(raw)
    finally:
        fast.disable_hooks()
        if outer is not None:
            outer.enable_hooks()
        _clear(raw)
    if not norms:
        return np.zeros(0), np.zeros(0)
    return torch.cat(norms).double().numpy(), torch.cat(losses).double().numpy()
