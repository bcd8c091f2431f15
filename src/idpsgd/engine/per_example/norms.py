"""Per-example gradient norms (and losses) of training examples at the current model, for any loss.

Yu et al. 2023, Alg. 2 line 3: the batch gradient norms ‖g_i‖ at θ_t, with the model in eval
mode and no optimizer step.  Computed in batches by the model's book-keeper
(:mod:`.bk.keeper`, the machinery of ``grad_sample_mode="bk"``): one backward pass per batch,
ghost norms or per-sample gradients per layer by shape (Bu, Mao & Xu 2022), and no summed
gradient — about the cost of one non-private training epoch over the examples.  Layers no
book-keeping rule covers take Opacus's per-sample gradient (they must own trainable parameters
that behave the same in training mode: Opacus only captures activations of modules in training
mode, so those modules — and only those — are switched back to training mode; dropout and the like
stay in eval mode).  A training wrapper of Opacus around the same model has its hooks disabled
meanwhile; ``.grad`` and Opacus's per-parameter fields are cleared afterwards.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks


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


@contextlib.contextmanager
def _norm_pass(model: torch.nn.Module):
    """(the module to call, its book-keeper, a check of the released tensors) with the keeper recording
    per-example sums ("sum" loss reduction) and any Opacus training wrapper's hooks off.  A layer that
    writes the model in its forward (Embedding(max_norm)) is refused at the entry, and any parameter
    or persistent buffer the pass changes is refused by the check (:mod:`..guards.integrity`): the pass runs
    the forward over every example, those that never train included."""
    from ..guards.batch_independence import BatchIndependence
    from ..guards.integrity import WriteGuard, check_static_writes
    from .bk.keeper import BookKeeper
    from .unwrap import raw_module

    outer = model if isinstance(model, AbstractGradSampleHooks) else None  # a module, or wrap_model=False's hooks
    if not hasattr(outer, "disable_hooks"):  # grad_sample_mode="ew": no hooks (its forward is not called here)
        outer = None
    raw = raw_module(model)
    check_static_writes(raw)
    check = BatchIndependence.attach(raw)  # a model that mixes examples is refused at its first call
    guard = WriteGuard.attach(raw)
    keeper = BookKeeper.attach(raw)
    keeper.set_batch_dim(check.batch_dim)  # batch-second inputs (batch_first=False), as make_private was told
    outer_hooks = getattr(outer, "hooks_enabled", None)
    if outer is not None and not hasattr(outer, "keeper"):
        outer.disable_hooks()
    try:
        with keeper.recording_sums(), guard.watch() as check_writes:  # the pass sets its own user level per batch
            yield raw, keeper, check_writes
    finally:
        if outer is not None and outer_hooks:
            outer.enable_hooks()


def default_per_sample_loss(module: torch.nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of each example for batches ``(inputs, targets, ...)``."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(
            "the default per-sample loss needs batches (inputs, targets, ...); for other batches "
            "give per_sample_loss(module, batch) -> a tensor of one loss per example"
        )
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
        part = idx[start : start + batch_size]
        if sliced:
            t = torch.from_numpy(part)
            yield [x[t] for x in dataset.tensors]
        else:
            yield collate([dataset[int(i)] for i in part])


def per_example_grad_norms(model: torch.nn.Module, batches, per_sample_loss=None, user_levels=None):
    """(norms, losses): the L2 norm of each example's loss gradient at the current parameters, and the
    loss, for every example of ``batches`` (an iterable of collated batches), as float64 numpy arrays.

    ``per_sample_loss(module, batch)`` returns one loss per example (any loss; default: cross-entropy
    of ``(inputs, targets)`` batches).  Batches are moved to the model's device.  A model whose forward
    writes a parameter or persistent buffer is refused (:class:`~..guards.integrity.UnnoisedWriteError`).

    ``user_levels`` (user level, :func:`~.user_norms.per_user_grad_norms`): one book-keeper hook per batch
    (whole users in each); the norms are then one per user of the batch, of the user's summed gradient.
    """
    loss_fn = per_sample_loss or default_per_sample_loss
    norms, losses = [], []
    with _norm_pass(model) as (raw, keeper, check_writes):
        device = next(raw.parameters()).device
        with eval_mode_with_hooks(raw):
            _clear(raw)
            hooks = iter(user_levels) if user_levels is not None else None
            for batch in batches:
                keeper.set_user_level(next(hooks) if hooks is not None else None)
                loss = loss_fn(raw, to_device(batch, device))
                if loss.dim() != 1:
                    raise ValueError(f"per_sample_loss returned shape {tuple(loss.shape)}; need one loss per example")
                if loss.numel():
                    loss.sum().backward()  # "sum": each example's own loss gradient
                    got = keeper.norms().detach().double().cpu()
                    units = "per-example losses"
                    expected = loss.shape[0]
                    if keeper.user_level is not None:  # one norm per user of the batch
                        units, expected = f"users of {loss.shape[0]} rows", keeper.user_level.users_in(loss.shape[0])
                    if got.shape[0] != expected:
                        keeper.clear()
                        raise RuntimeError(
                            f"per_example_grad_norms: the book-keeper gave {got.shape[0]} norms for {expected} "
                            f"{units}: the model's forward batch and per_sample_loss's examples differ"
                        )
                    norms.append(got)
                losses.append(loss.detach().double().cpu())
                keeper.clear()
                _clear(raw)
                check_writes()  # nothing of the released model changed in this batch
        _clear(raw)
    if not norms:
        return np.zeros(0), np.zeros(0)
    return torch.cat(norms).numpy(), torch.cat(losses).numpy()
