"""Wrapping a user's module for per-sample gradients (or ghost norms), as Opacus's ``make_private``.

``grad_sample_mode``:

* ``hooks`` — Opacus's ``GradSampleModule``: per-sample gradients from registered per-layer
  samplers (functorch for layers without one);
* ``functorch`` — the same module forced to compute every per-sample gradient with functorch;
* ``ew`` — Opacus's ``GradSampleModuleExpandedWeights``: per-sample gradients from PyTorch's
  ExpandedWeights (``torch.nn.utils._per_sample_grad``), batch-first inputs only; a layer
  ExpandedWeights does not support raises PyTorch's ``RuntimeError`` in the forward pass, as with
  Opacus.  The clipping, noise and accounting are those of ``hooks``;
* ``ghost`` — fast gradient clipping (Li et al. 2022; Bu et al. 2023; Opacus's
  ``GradSampleModuleFastGradientClipping``): per-example gradient *norms* without materialising
  per-example gradients (ghost norms for Linear layers).  :class:`IndividualizedGhostModule`
  returns the clip factors min(1, c_i/‖g_i‖) with each example's own c_i, which Opacus's loss
  wrapper (``DPLossFastGradientClipping``) multiplies into the per-sample losses of a second
  backward pass — the same update as clipping each per-sample gradient at c_i;
* ``bk`` — book-keeping (Bu et al. 2023) with mixed ghost norms (Bu, Mao & Xu 2022) for Linear,
  Conv1d/Conv2d, Embedding, GroupNorm/InstanceNorm/LayerNorm, transformers' Conv1D and RMSNorm forms
  (:mod:`.bookkeeping`, :mod:`.bk_layers`): one backward
  pass, per-example norms without per-example gradients where the ghost norm is cheaper, and the
  clipped sum formed from each layer's kept input and output gradient; other layers take Opacus's
  per-sample gradient (the wrapper's ``layer_paths`` says which).  The user's loop is the hooks
  loop (no criterion wrapper);
* ``no_op`` — Opacus's ``GradSampleModuleNoOp``: per-sample gradients **you** compute (e.g. with
  ``torch.func.vmap`` over ``grad`` of a per-example loss) and assign to ``p.grad_sample`` before
  ``optimizer.step()``; the engine clips them per example at c_i, with the checks of the other
  modes (one row per drawn example, the whole drawn batch) and a check of their shapes.  Each row
  must be the gradient of one example's loss only (the clipping bounds each row's norm; a row that
  mixes examples, e.g. through batch statistics, breaks the per-example guarantee, as in Opacus).
  Only for the engine (``idpsgd train`` and ``idpsgd.train`` compute their own gradients).

``wrap_model=False`` (Opacus 1.6's hooks without a wrapper; ``hooks``, ``functorch`` and ``no_op``):
Opacus's ``GradSampleHooks`` / ``GradSampleHooksNoOp`` attach to your module, which you keep
training; the returned hooks object is for ``remove_hooks()`` only.  The clipping, noise and
accounting are those of the wrapped module.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import (
    AbstractGradSampleModule,
    GradSampleHooks,
    GradSampleHooksNoOp,
    GradSampleModule,
    GradSampleModuleExpandedWeights,
    GradSampleModuleFastGradientClipping,
    GradSampleModuleNoOp,
)
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
from opacus.validators import ModuleValidator

from ..validation import InvalidParameterError
from .batch_independence import BatchIndependence
from .bk.keeper import BookKeeper, BookKeepingModule, plan_layers
from .clipping import PerExampleClipping
from .integrity import check_static_writes
from .opacus_compat import UnsupportedModuleError, refuse_opacus_options
from .units import UnitClipping, ghost_capture

#: the modes in which the engine (or Opacus) computes the per-example gradients or norms
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost", "bk")
#: the engine's modes: those, and Opacus's ``no_op`` (per-sample gradients the user computes)
ENGINE_MODES = (*GRAD_SAMPLE_MODES, "no_op")
#: the modes Opacus 1.6's ``wrap_model=False`` (hooks without a wrapper) is supported in
UNWRAPPED_MODES = ("hooks", "functorch", "no_op")


class IndividualizedGhostModule(GradSampleModuleFastGradientClipping):
    """Ghost-clipping module whose clip factors use each example's own clip norm c_i."""

    clipping: PerExampleClipping | None = None

    def get_clipping_coef(self) -> torch.Tensor:
        norms = self.get_norm_sample()
        if self.clipping is None:
            raise RuntimeError(
                "IndividualizedGhostModule has no per-example clip norms: use it through "
                "IndividualizedPrivacyEngine.make_private"
            )
        if not bool(torch.isfinite(norms).all()):
            # the second backward pass multiplies each example's loss by its factor: 0 · inf is nan, in
            # every parameter (book-keeping leaves such an example out instead)
            raise RuntimeError(
                "an example's gradient overflowed (inf/nan, half precision): "
                "grad_sample_mode='ghost' cannot leave it out of its second backward pass; use "
                "grad_sample_mode='bk', or bfloat16 autocast"
            )
        factors = self.clipping.factors(norms)
        if isinstance(self.clipping, UnitClipping):  # user level: per-user factors, one per row of the user
            factors = factors[self.clipping.last_grouping_inverse.to(factors.device)]
        return factors

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction, batch_first):
        if not isinstance(self.clipping, UnitClipping):
            return super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
        if not self.hooks_enabled:
            return
        # user level (engine/units.py): per-user norms of the summed gradients, never ghost per-row norms
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction, batch_first=batch_first
        )
        ghost_capture(self, module, backprops, activations)
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len


def raw_module(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside Opacus wrappers (GradSampleModule, DPDDP) or under Opacus's hooks
    object (``wrap_model=False``)."""
    while True:
        if isinstance(module, AbstractGradSampleHooks):
            module = module._module
        elif type(module).__name__ in ("DifferentiallyPrivateDistributedDataParallel", "DistributedDataParallel"):
            module = module.module
        else:
            return module


def check_wrappable(
    module: torch.nn.Module,
    grad_sample_mode: str,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    wrap_model: bool = True,
) -> None:
    """Raise :class:`InvalidParameterError` unless :func:`wrap_module` can wrap ``module`` (no side effects)."""
    if grad_sample_mode not in ENGINE_MODES:
        raise InvalidParameterError("grad_sample_mode", grad_sample_mode, f"must be one of {', '.join(ENGINE_MODES)}")
    if not isinstance(module, torch.nn.Module):
        raise InvalidParameterError("module", type(module).__name__, "must be a torch.nn.Module")
    if wrap_model is not True:
        if wrap_model is not False:
            raise InvalidParameterError("wrap_model", wrap_model, "must be True or False")
        if grad_sample_mode not in UNWRAPPED_MODES:
            from .opacus_compat import WRAP

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
    refuse_opacus_options(batch_first=batch_first)  # batch-second inputs, every mode (.opacus_compat.REFUSALS)
    if not isinstance(module, AbstractGradSampleModule) and hasattr(module, "autograd_grad_sample_hooks"):
        raise InvalidParameterError(
            "module",
            type(module).__name__,
            "has Opacus's per-sample-gradient hooks attached already (an earlier make_private wrapped it, or "
            "attached hooks with wrap_model=False): pass the module that call returned, or call remove_hooks() on "
            "it first",
        )
    if isinstance(module, AbstractGradSampleModule):
        if not _reusable(module, grad_sample_mode, batch_first, loss_reduction):
            raise InvalidParameterError(
                "module",
                type(module).__name__,
                f"is already wrapped by Opacus for another mode; pass the plain nn.Module "
                f"for grad_sample_mode={grad_sample_mode!r}",
            )
        return
    errors = ModuleValidator.validate(module, strict=False)
    if errors:
        raise UnsupportedModuleError(
            "module",
            type(module).__name__,
            f"cannot be trained privately by Opacus: {errors[0]} (IndividualizedPrivacyEngine."
            "get_compatible_module, i.e. opacus.validators.ModuleValidator.fix, replaces e.g. "
            "BatchNorm by GroupNorm)",
        )
    if grad_sample_mode == "bk":
        plan_layers(raw_module(module))


def release_hooks(previous, module: torch.nn.Module) -> None:
    """Remove the hooks of an earlier ``wrap_model=False`` phase (``previous``, the engine's own hooks
    object) from ``module`` before a new phase attaches its own."""
    unwrapped = isinstance(previous, AbstractGradSampleHooks) and not isinstance(previous, torch.nn.Module)
    if unwrapped and previous._module is module:
        previous.remove_hooks()


def _reusable(module, grad_sample_mode, batch_first, loss_reduction) -> bool:
    want = {
        "ghost": IndividualizedGhostModule,
        "bk": BookKeepingModule,
        "ew": GradSampleModuleExpandedWeights,
        "no_op": GradSampleModuleNoOp,
    }.get(grad_sample_mode, GradSampleModule)
    return (
        type(module) is want
        and module.batch_first == batch_first
        and module.loss_reduction == loss_reduction
        and (
            grad_sample_mode in ("ghost", "bk", "ew", "no_op")
            or module.force_functorch == (grad_sample_mode == "functorch")
        )
    )


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
    the check that its examples do not mix (:mod:`.batch_independence`) at its first forward pass with
    gradients (not in ``no_op`` mode: the per-sample gradients are the user's own computation)."""
    wrapped = _wrap(module, grad_sample_mode, clipping, batch_first, loss_reduction, wrap_model)
    if grad_sample_mode != "no_op":
        check = BatchIndependence.attach(raw_module(wrapped))
        if isinstance(wrapped, torch.nn.Module):  # the user's hooks on the returned module are part of the forward
            check.wrapped_by(wrapped)
        if grad_sample_mode == "ew":  # ExpandedWeights calls the model with its own parameters: check before
            check.watch_wrapper(wrapped)
    return wrapped


def _wrap(module, grad_sample_mode, clipping, batch_first, loss_reduction, wrap_model) -> AbstractGradSampleHooks:
    check_wrappable(module, grad_sample_mode, batch_first, loss_reduction, wrap_model)
    if not wrap_model:
        if grad_sample_mode == "no_op":
            return GradSampleHooksNoOp(module, batch_first=batch_first, loss_reduction=loss_reduction)
        return GradSampleHooks(
            module,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            force_functorch=grad_sample_mode == "functorch",
        )
    if isinstance(module, AbstractGradSampleModule):
        if grad_sample_mode == "ghost":
            module.clipping = clipping
            module.use_ghost_clipping = not isinstance(clipping, UnitClipping)
        if grad_sample_mode == "bk":
            module.keeper.refresh()  # parameters frozen or unfrozen since: planned anew
            module.keeper.loss_reduction, module.keeper.active = loss_reduction, True
        return module
    if grad_sample_mode == "bk":
        return BookKeepingModule(
            module, keeper=BookKeeper.attach(raw_module(module)), batch_first=batch_first, loss_reduction=loss_reduction
        )
    if grad_sample_mode == "ghost":
        wrapped = IndividualizedGhostModule(  # user level: per-sample gradients summed by user (units.py)
            module,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            use_ghost_clipping=not isinstance(clipping, UnitClipping),
        )
        wrapped.clipping = clipping
        return wrapped
    if grad_sample_mode == "no_op":
        return GradSampleModuleNoOp(module, batch_first=batch_first, loss_reduction=loss_reduction)
    if grad_sample_mode == "ew":
        return GradSampleModuleExpandedWeights(module, batch_first=batch_first, loss_reduction=loss_reduction)
    return GradSampleModule(
        module, batch_first=batch_first, loss_reduction=loss_reduction, force_functorch=grad_sample_mode == "functorch"
    )


def layer_paths(wrapped: torch.nn.Module, grad_sample_mode: str, taken: bool = False) -> dict[str, str]:
    """Layer name → how its per-example norms are computed: the public rule (a function of the model
    and the mode), or with ``taken`` the paths the layers took (private in bk mode: see
    ``IndividualizedPrivacyEngine.layer_paths``)."""
    if grad_sample_mode == "bk":
        return wrapped.layer_paths if taken else wrapped.layer_path_rules
    what = {
        "hooks": "Opacus per-sample gradient (hooks)",
        "functorch": "Opacus per-sample gradient (functorch)",
        "ew": "PyTorch ExpandedWeights per-sample gradient (Opacus's ew mode)",
        "no_op": "your per-sample gradient (p.grad_sample, assigned before optimizer.step(); Opacus's no_op mode)",
        "ghost": "Opacus fast gradient clipping (ghost norm for Linear/Embedding, per-sample gradient otherwise; "
        "two backward passes)",
    }[grad_sample_mode]
    return {
        name or type(m).__name__: what
        for name, m in raw_module(wrapped).named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    }
