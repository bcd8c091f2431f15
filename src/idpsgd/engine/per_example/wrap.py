"""Wrapping a user's module for per-example gradients or norms, as Opacus's ``make_private``.

:func:`check_wrappable` refuses what cannot be wrapped before anything changes; :func:`wrap_module`
builds the mode's wrapper (the record in :mod:`..modes` says which) — or, with ``wrap_model=False``,
Opacus 1.6's hooks attached to the user's module — and attaches the check that examples do not mix
(:mod:`..guards.batch_independence`); :func:`layer_paths` says how each layer's norms are formed.  The
modes and their trade-offs (hooks, functorch, ew, ghost, bk, no_op) are described for users in
docs/opacus.md and docs/performance.md.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import AbstractGradSampleModule
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks

from ...validation import InvalidParameterError
from ..clipping.examples import PerExampleClipping
from ..guards.batch_independence import BatchIndependence
from ..guards.integrity import check_static_writes
from ..guards.layer_inputs import PER_LAYER_MODES
from ..modes import mode
from ..opacus_compat import WRAP, validate_module
from .bk.plan import plan_layers
from .output_hooks import OutputHooks, check_buffers
from .unwrap import raw_module  # re-exported: its home is engine/per_example/unwrap.py


def check_wrappable(
    module: torch.nn.Module,
    grad_sample_mode: str,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    wrap_model: bool = True,
    previous=None,
) -> None:
    """Raise :class:`InvalidParameterError` unless :func:`wrap_module` can wrap ``module`` (no side effects).
    ``previous``: the engine's earlier phase's module, whose own hooks on ``module`` the build releases
    (:func:`release_hooks`)."""
    record = mode(grad_sample_mode)
    if not isinstance(module, torch.nn.Module):
        raise InvalidParameterError("module", type(module).__name__, "must be a torch.nn.Module")
    if wrap_model is not True:
        if wrap_model is not False:
            raise InvalidParameterError("wrap_model", wrap_model, "must be True or False")
        if record.hooks is None:
            raise InvalidParameterError(
                "wrap_model", wrap_model, f"is not supported with grad_sample_mode={grad_sample_mode!r}: {WRAP}"
            )
        if isinstance(module, AbstractGradSampleModule):
            raise InvalidParameterError(
                "module",
                type(module).__name__,
                "is already wrapped by Opacus; with wrap_model=False pass the plain nn.Module",
            )
        if raw_module(module) is not module:  # DPDDP / DDP: the per-rank norm passes find it through the wrapper
            raise InvalidParameterError(
                "wrap_model",
                wrap_model,
                f"is not supported for a {type(module).__name__} module (the engine's data-parallel steps and norm "
                "passes work through the returned module): use the returned module (wrap_model=True)",
            )
    check_static_writes(raw_module(module))  # Embedding(max_norm): an in-place write in forward (.integrity)
    if batch_first is not True and batch_first is not False:
        raise InvalidParameterError("batch_first", batch_first, "must be True or False")
    if not batch_first and record.batch_second is not None:  # batch-second inputs (.opacus_compat.REFUSALS)
        why = f"is not supported with grad_sample_mode={grad_sample_mode!r}: {record.batch_second}"
        raise InvalidParameterError("batch_first", batch_first, why)
    if (
        not isinstance(module, AbstractGradSampleModule)
        and hasattr(module, "autograd_grad_sample_hooks")
        and not own_hooks(previous, module)
    ):
        raise InvalidParameterError(
            "module",
            type(module).__name__,
            "has Opacus's per-sample-gradient hooks attached already (an earlier make_private wrapped it, or "
            "attached hooks with wrap_model=False): pass the module that call returned, or call remove_hooks() on "
            "it first",
        )
    if isinstance(module, AbstractGradSampleModule):
        if not record.reusable(module, batch_first, loss_reduction):
            raise InvalidParameterError(
                "module",
                type(module).__name__,
                f"is already wrapped by Opacus for another mode; pass the plain nn.Module "
                f"for grad_sample_mode={grad_sample_mode!r}",
            )
        return
    validate_module(module, first_with_fix=True)
    if issubclass(record.wrapper, OutputHooks):
        check_buffers(raw_module(module))  # Opacus's NotImplementedError for a trainable layer with buffers
    if record.book_keeping:
        plan_layers(raw_module(module))


def own_hooks(previous, module: torch.nn.Module) -> bool:
    """Whether ``previous`` (the engine's earlier phase's module) is a ``wrap_model=False`` hooks object
    attached to ``module``."""
    unwrapped = isinstance(previous, AbstractGradSampleHooks) and not isinstance(previous, torch.nn.Module)
    return unwrapped and previous._module is module


def release_hooks(previous, module: torch.nn.Module) -> None:
    """Remove the hooks of an earlier ``wrap_model=False`` phase (``previous``, the engine's own hooks
    object) from ``module`` before a new phase attaches its own (the build stage's)."""
    if own_hooks(previous, module):
        previous.remove_hooks()


def wrap_module(
    module: torch.nn.Module,
    grad_sample_mode: str,
    clipping: PerExampleClipping,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    wrap_model: bool = True,
) -> AbstractGradSampleHooks:
    """The module wrapped for ``grad_sample_mode`` (an existing wrapper of the same kind is reused), or
    with ``wrap_model=False`` Opacus's hooks object attached to ``module`` (which the user keeps); with
    the check that its examples do not mix (:mod:`..guards.batch_independence`) at its first forward pass with
    gradients (not in ``no_op`` mode: the per-sample gradients are the user's own computation).
    ``module`` passed :func:`check_wrappable` (the engine's check stage)."""
    record = mode(grad_sample_mode)
    if not wrap_model:
        wrapped = record.hooks_object(module, batch_first, loss_reduction)
    elif isinstance(module, AbstractGradSampleModule):  # an earlier phase's wrapper of this mode
        record.reuse(module, clipping, loss_reduction)
        wrapped = module
    else:
        wrapped = record.build(module, clipping, batch_first, loss_reduction)
    if record.engine_computes:
        check = BatchIndependence.attach(raw_module(wrapped))
        check.declare_layout(
            batch_dim=0 if batch_first else 1,  # where the loader's batch is (also for the norm passes)
            # Opacus's modes with batch-second inputs take every layer's batch at dimension 1: proven at the check
            per_layer_dim=1 if not (batch_first or record.book_keeping) else None,
            # Opacus's per-layer hooks: every layer's input batch-first, every parameter used in its layer
            per_layer_mode=grad_sample_mode if grad_sample_mode in PER_LAYER_MODES else None,
        )
        if isinstance(wrapped, torch.nn.Module):  # the user's hooks on the returned module are part of the forward
            check.wrapped_by(wrapped)
        if record.wrapper_calls_model:  # ExpandedWeights calls the model with its own parameters: check before
            check.watch_wrapper(wrapped)
    return wrapped


def layer_paths(wrapped: torch.nn.Module, grad_sample_mode: str, taken: bool = False) -> dict[str, str]:
    """Layer name → how its per-example norms are computed: the public rule (a function of the model
    and the mode), or with ``taken`` the paths the layers took (private in bk mode: see
    ``IndividualizedPrivacyEngine.layer_paths``)."""
    what = mode(grad_sample_mode).layer_path
    if what is None:  # book-keeping: per layer, from the keeper
        return wrapped.layer_paths if taken else wrapped.layer_path_rules
    return {
        name or type(m).__name__: what
        for name, m in raw_module(wrapped).named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    }


__all__ = ["check_wrappable", "layer_paths", "own_hooks", "raw_module", "release_hooks", "wrap_module"]
