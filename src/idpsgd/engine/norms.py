"""Per-example gradient norms (and losses) of training examples at the current model, for any loss.

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
from opacus.grad_sample import AbstractGradSampleModule


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
    outer = model if isinstance(model, AbstractGradSampleModule) else None
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


def default_per_sample_loss(module: torch.nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of each example for batches ``(inputs, targets, ...)``."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError("the default per-sample loss needs batches (inputs, targets, ...); for other batches "
                        "give per_sample_loss(module, batch) -> a tensor of one loss per example")
    return F.cross_entropy(module(batch[0]), batch[1], reduction="none")


def to_device(batch, device):
    """Move every tensor of a (nested) batch to ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def example_batches(dataset, indices, collate_fn=None, batch_size: int = 256):
    """Batches of ``dataset[indices]`` in order, collated exactly as the training loader collates
    them: ``collate_fn`` (the loader's; default ``default_collate``) over the dataset's items, so a
    collate that normalises, transforms or builds dicts gives the norm passes the inputs the model
    trains on.  Only a ``TensorDataset`` with the default collate is sliced directly (the same
    tensors ``default_collate`` would stack, as the same list)."""
    from torch.utils.data import TensorDataset
    from torch.utils.data._utils.collate import default_collate

    collate = default_collate if collate_fn is None else collate_fn
    sliced = isinstance(dataset, TensorDataset) and collate is default_collate
    idx = np.asarray(indices, dtype=np.int64)
    for start in range(0, idx.size, batch_size):
        part = idx[start:start + batch_size]
        if sliced:
            t = torch.from_numpy(part)
            yield [x[t] for x in dataset.tensors]
        else:
            yield collate([dataset[int(i)] for i in part])


def per_example_grad_norms(model: torch.nn.Module, batches, per_sample_loss=None):
    """(norms, losses): the L2 norm of each example's loss gradient at the current parameters, and the
    loss, for every example of ``batches`` (an iterable of collated batches), as float64 numpy arrays.

    ``per_sample_loss(module, batch)`` returns one loss per example (any loss; default: cross-entropy
    of ``(inputs, targets)`` batches).  Batches are moved to the model's device.
    """
    loss_fn = per_sample_loss or default_per_sample_loss
    outer, raw, fast = _norm_module(model)
    device = next(raw.parameters()).device
    norms, losses = [], []
    if outer is not None:
        outer.disable_hooks()
    fast.enable_hooks()
    try:
        with eval_mode_with_hooks(raw):
            _clear(raw)
            for batch in batches:
                loss = loss_fn(fast, to_device(batch, device))
                if loss.dim() != 1:
                    raise ValueError(f"per_sample_loss returned shape {tuple(loss.shape)}; need one loss per example")
                loss.mean().backward()   # mean loss: Opacus rescales to per-example norms
                norms.append(fast.get_norm_sample().detach().double().cpu())
                losses.append(loss.detach().double().cpu())
                _clear(raw)
    finally:
        fast.disable_hooks()
        if outer is not None:
            outer.enable_hooks()
        _clear(raw)
    if not norms:
        return np.zeros(0), np.zeros(0)
    return torch.cat(norms).numpy(), torch.cat(losses).numpy()
