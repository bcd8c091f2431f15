"""Opacus's fast gradient clipping with each example's own clip norm (``grad_sample_mode="ghost"``).

Li et al. 2022; Bu et al. 2023; Opacus's ``GradSampleModuleFastGradientClipping``: per-example
gradient norms without per-example gradients (ghost norms for Linear layers).  The only change is
the clip factor, min(1, c_i/‖g_i‖) with c_i per example (Boenisch et al. 2023, Alg. 3 line 6),
which Opacus's loss wrapper multiplies into the per-sample losses of a second backward pass.  At
user level the per-user norms of the summed gradients are taken instead (:mod:`..clipping.users`).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from opacus.utils.module_utils import trainable_parameters
from torch import nn

from ..clipping.examples import PerExampleClipping
from ..clipping.users import UserClipping, ghost_capture
from ..sampling.sampler import BatchMismatchError
from .machinery import forward_net, guard
from .output_hooks import OutputHooks


class IndividualizedGhostModule(OutputHooks, GradSampleModuleFastGradientClipping):
    """Ghost-clipping module whose clip factors use each example's own clip norm c_i (Opacus's hooks on the
    layers' outputs, netted: :mod:`.output_hooks`)."""

    mode_name = "ghost"

    clipping: PerExampleClipping | None = None
    #: the phase's :class:`~..guards.decomposition.DecompositionCheck` (each layer's own gradient sum, first pass)
    decomposition = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        owners: dict = {}  # the layers that share a trainable parameter with another (tied embeddings)
        for m in self.iterate_submodules(self._module):
            for _, p in trainable_parameters(m):
                owners.setdefault(id(p), set()).add(id(m))
        self._tied_layers = {m for ms in owners.values() if len(ms) > 1 for m in ms}
        self._reached: set = set()  # the trainable parameters the first backward pass reached (_check_norm_rows)
        for p in self.trainable_parameters:
            self.autograd_grad_sample_hooks.append(p.register_hook(partial(self._reach, id(p))))

    def _reach(self, key, grad):
        if self.hooks_enabled:  # the first backward pass (Opacus's loss wrapper disables hooks for the second)
            self._reached.add(key)

    def _tied(self, module) -> bool:
        return id(module) in self._tied_layers

    @contextlib.contextmanager
    def _per_sample_if_tied(self, module):
        """A layer that shares a parameter with another takes Opacus's per-sample-gradient path (fast gradient
        clipping: each use's per-sample gradients summed over the layers, the norm taken once both are in —
        exact), not the ghost norm of one use, which misses the other's (Opacus refuses it: "Parameter tying
        is not supported with Ghost Clipping")."""
        if not (self.use_ghost_clipping and self._tied(module)):
            yield
            return
        self.use_ghost_clipping = False
        try:
            yield
        finally:
            self.use_ghost_clipping = True

    def use_clipping(self, clipping: PerExampleClipping) -> None:
        """The phase's clipping (each example's c_i); user level (:class:`UserClipping`) takes per-sample
        gradients summed by user, never ghost per-row norms."""
        self.clipping = clipping
        self.use_ghost_clipping = not isinstance(clipping, UserClipping)

    def use_decomposition(self, check) -> None:
        """Add each layer's own gradient sum to ``check`` in the first backward pass
        (:func:`~..guards.decomposition.probe_layers`)."""
        self.decomposition = check

    def capture_activations_hook(self, module, forward_input, _forward_output):
        with self._per_sample_if_tied(module):
            super().capture_activations_hook(module, forward_input, _forward_output)
        check = self.decomposition
        if check is not None and check.due and self.hooks_enabled and module.training and torch.is_grad_enabled():
            check.open_pass(self.trainable_parameters)

    def forward(self, *args, **kwargs):
        return forward_net(self._module, self._plain, self._module, self.mode_name, args, kwargs)

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        activations, backprops = super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )
        # an integer index moved to batch-first (batch_first=False) is a strided view: Opacus's Embedding norm views it
        activations = [a.contiguous() if torch.is_tensor(a) and not a.is_floating_point() else a for a in activations]
        if type(module) is nn.Linear and backprops.dim() > 3:  # (B, H, W, C) rows: Opacus's ghost norm of a Linear
            # covers (B, C) and (B, T, C) only and returns nothing else (ConvNeXt's pointwise layers): positions in one
            a = activations[0]
            activations = [a.reshape(a.shape[0], -1, a.shape[-1]), *activations[1:]]
            backprops = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
        if self.decomposition is not None:  # the layer's own Σ_i a_iᵀ b_i (.decomposition)
            ghost = self.use_ghost_clipping and type(module) in self.NORM_SAMPLERS
            if not self.force_functorch and type(module) in self.GRAD_SAMPLERS:
                sampler = self.GRAD_SAMPLERS[type(module)]
            else:
                sampler = ft_compute_per_sample_gradient
            n = module.max_batch_len if loss_reduction == "mean" else 1
            self.decomposition.add_layer(module, activations, backprops, n, ghost, sampler)
        return activations, backprops

    def _check_norm_rows(self) -> None:  # (not FSDP2's, .fsdp: its norms live on the unsharded tensors)
        """Every parameter's per-example norms have one row per example: a layer whose output is shared by the
        batch (an Embedding looked up with position ids of shape (1, T)) gets one row, its gradient summed over
        the examples (not attributable through its output); refused before the second pass, naming it.  A
        parameter the first backward pass did not reach at all (no gradient: unused by this model's forward, a
        decoder's cross-attention without an encoder) has per-example gradient 0: its norms are zeros (Opacus
        crashed on it); one that got a gradient but no norms (used outside its layer) is refused.  Which
        parameters the pass reached is recorded by a hook on each (``_reach``)."""
        rows: dict = {}
        unreached, missing = [], []
        for name, p in trainable_parameters(self._module):
            norms = getattr(p, "_norm_sample", None)
            if norms is not None:
                rows.setdefault(int(norms.shape[0]), name)
            else:
                (missing if id(p) in self._reached else unreached).append((name, p))
        if missing:
            raise BatchMismatchError(
                f"parameter(s) {', '.join(n for n, _ in missing)} received a gradient but no per-example norms in "
                "the first backward pass (used outside the layer that owns them, or a layer input Opacus's ghost "
                "norm does not cover): ghost clipping cannot bound them; use grad_sample_mode='bk'; the step was "
                "not taken"
            )
        if unreached and len(rows) == 1:
            n = next(iter(rows))
            for _, p in unreached:
                p._norm_sample = torch.zeros(n, dtype=p.dtype, device=p.device)
        if len(rows) > 1:
            names = sorted(rows.values())
            raise BatchMismatchError(
                f"the parameters' per-example norms differ in their number of rows ({', '.join(names)}: the counts "
                "are private, not shown): a layer whose input has no batch dimension (position ids of shape (1, T), "
                "a table looked up by an index of no example) gets the gradient of the whole batch, which ghost "
                "clipping's hooks cannot attribute to the examples; use grad_sample_mode='bk'; the step was not taken"
            )

    def get_clipping_coef(self) -> torch.Tensor:
        per_row = self.output_hooks and not isinstance(self.clipping, UserClipping)
        if per_row:
            self._check_norm_rows()
        with guard("ghost clipping's per-example norms (every parameter's, stacked)", self.mode_name):
            norms = self.get_norm_sample()
        if per_row:  # this pass's norms are used: a parameter the next pass does not reach must not reuse them
            for p in self.trainable_parameters:
                p._norm_sample = None
            self._reached = set()
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
            with self._per_sample_if_tied(module):
                return super().capture_backprops_hook(
                    module, _forward_input, forward_output, loss_reduction, batch_first
                )
        if not self.hooks_enabled:
            return
        # user level (engine/clipping/users.py): per-user norms of the summed gradients, never ghost per-row norms
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction, batch_first=batch_first
        )
        ghost_capture(self, module, backprops, activations)
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len
