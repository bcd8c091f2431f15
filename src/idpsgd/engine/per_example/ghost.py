"""Opacus's fast gradient clipping with each example's own clip norm (``grad_sample_mode="ghost"``).

Li et al. 2022; Bu et al. 2023; Opacus's ``GradSampleModuleFastGradientClipping``: per-example
gradient norms without per-example gradients (ghost norms for Linear layers).  The only change is
the clip factor, min(1, c_i/‖g_i‖) with c_i per example (Boenisch et al. 2023, Alg. 3 line 6),
which Opacus's loss wrapper multiplies into the per-sample losses of a second backward pass.  At
user level the per-user norms of the summed gradients are taken instead (:mod:`..clipping.users`).
"""

from __future__ import annotations

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient

from ..clipping.examples import PerExampleClipping
from ..clipping.users import UserClipping, ghost_capture


class IndividualizedGhostModule(GradSampleModuleFastGradientClipping):
    """Ghost-clipping module whose clip factors use each example's own clip norm c_i."""

    clipping: PerExampleClipping | None = None
    #: the phase's :class:`~..guards.decomposition.DecompositionCheck` (each layer's own gradient sum, first pass)
    decomposition = None

    def capture_activations_hook(self, module, forward_input, _forward_output):
        super().capture_activations_hook(module, forward_input, _forward_output)
        check = self.decomposition
        if check is not None and check.due and self.hooks_enabled and module.training and torch.is_grad_enabled():
            check.open_pass(self.trainable_parameters)

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        activations, backprops = super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )
        if self.decomposition is not None:  # the layer's own Σ_i a_iᵀ b_i (.decomposition)
            ghost = self.use_ghost_clipping and type(module) in self.NORM_SAMPLERS
            if not self.force_functorch and type(module) in self.GRAD_SAMPLERS:
                sampler = self.GRAD_SAMPLERS[type(module)]
            else:
                sampler = ft_compute_per_sample_gradient
            n = module.max_batch_len if loss_reduction == "mean" else 1
            self.decomposition.add_layer(module, activations, backprops, n, ghost, sampler)
        return activations, backprops

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
        if isinstance(self.clipping, UserClipping):  # user level: per-user factors, one per row of the user
            factors = factors[self.clipping.last_grouping_inverse.to(factors.device)]
        return factors

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction, batch_first):
        if not isinstance(self.clipping, UserClipping):
            return super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
        if not self.hooks_enabled:
            return
        # user level (engine/clipping/users.py): per-user norms of the summed gradients, never ghost per-row norms
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction, batch_first=batch_first
        )
        ghost_capture(self, module, backprops, activations)
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len
