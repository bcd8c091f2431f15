"""Opacus ``DPOptimizer`` with per-example clip norms (IDP-SGD *Scale* and *Sample*).

Boenisch et al. 2023, Alg. 3 with individualized parameters: g_i is clipped to c_i (line 6), the
clipped gradients are summed, Gaussian noise of std σ·c is added (line 8) and the sum is divided by
Σ_i q_i; only the clip factor differs from Opacus (:class:`~..clipping.examples.PerExampleClipping`).  Hooks
make it privacy-aware: ``guard`` before the noise (:mod:`..guards.step_guard`; a refusal releases
nothing), Opacus's step hook after it (the ledger), ``post_step_hooks`` after the update and
``refusal_hooks`` when ``step()`` raises.  Mixed precision: float32 accumulation, an overflowed
example gets factor 0, ``GradScaler`` in bk mode only.  :func:`check_noise` refuses σ = 0.  Which
optimizer each ``grad_sample_mode`` uses: :mod:`..modes`; details: docs/inside-the-engine.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from ...validation import InvalidParameterError, check_positive
from ..clipping.examples import PerExampleClipping
from ..clipping.users import grouping_of
from ..per_example.bk.rules import acc_dtype
from ..per_example.machinery import guard
from ..sampling.sampler import BatchMismatchError
from .randomness import gaussian_like


def _in_place(summed: torch.Tensor, noise: torch.Tensor) -> bool:
    """Whether summed + noise can be written into the freshly drawn noise tensor: both plain tensors of one dtype,
    shape and device (no third parameter-sized tensor per step: one allocation and one pass less; IEEE addition is
    commutative, so the values are the same bit for bit); else a new tensor (mixed dtypes promote, DTensors)."""
    return (
        type(noise) is torch.Tensor
        and type(summed) is torch.Tensor
        and noise.dtype == summed.dtype
        and noise.shape == summed.shape
        and noise.device == summed.device
    )


class _PrivacyHooks:
    """Guard before the noise, hooks after the update; shared by the plain and ghost optimizers."""

    clipping: PerExampleClipping
    #: ``GradScaler.step(optimizer)`` calls :meth:`step` itself, with ``grad_scale``/``found_inf`` set
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        clipping: PerExampleClipping,
        expected_batch_size: float,
        loss_reduction: str = "mean",
        generator=None,
        secure_mode: bool = False,
        checked: bool = False,
        **kwargs,
    ):
        if not checked:  # the engine's set-up checked them (engine/checks.py); a direct construction here
            check_noise(noise_multiplier, max_grad_norm, expected_batch_size)
        super().__init__(
            optimizer,
            noise_multiplier=float(noise_multiplier),
            max_grad_norm=float(max_grad_norm),
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )
        self._init_privacy_hooks(clipping)

    def _init_privacy_hooks(self, clipping: PerExampleClipping) -> None:
        self.clipping = clipping
        self.guard: Callable[[_PrivacyHooks], None] | None = None
        self.write_guard = None  # the model's WriteGuard (set by make_private; DPDDP marks it)
        self.post_step_hooks: list[Callable[[_PrivacyHooks], None]] = []
        self.refusal_hooks: list[Callable[[_PrivacyHooks], None]] = []
        #: the phase's :class:`~..guards.decomposition.DecompositionCheck` where the mode's probe uses the optimizer
        self.decomposition = None
        self._noised = False
        self._loss_scale = 1.0

    def set_guard(self, guard: Callable[[_PrivacyHooks], None], write_guard=None) -> None:
        """The phase's step guard, run before the noise (:class:`~..guards.step_guard.StepGuard`), and the model's
        write guard (data parallelism: a write found on another rank marks this replica too)."""
        self.guard, self.write_guard = guard, write_guard

    def add_post_step_hook(self, hook: Callable[[_PrivacyHooks], None]) -> None:
        """Run ``hook(optimizer)`` after every parameter update (θ_{t+1})."""
        self.post_step_hooks.append(hook)

    def remove_post_step_hook(self, hook: Callable[[_PrivacyHooks], None]) -> None:
        """Stop running ``hook`` (added by :meth:`add_post_step_hook`; nothing if it is not there)."""
        if hook in self.post_step_hooks:
            self.post_step_hooks.remove(hook)

    def use_decomposition(self, check) -> None:
        """Compare the per-example gradients' sum with autograd's gradient at the steps of ``check``'s
        schedule (a :class:`~..guards.decomposition.DecompositionCheck`; the mode's probe attaches it)."""
        self.decomposition = check

    def add_refusal_hook(self, hook: Callable[[_PrivacyHooks], None]) -> None:
        """Run ``hook(optimizer)`` when ``step()`` raises (a refused step), before the error propagates."""
        self.refusal_hooks.append(hook)

    @property
    def clip_norms(self) -> torch.Tensor:
        return self.clipping.clip_norms

    @property
    def last_norms(self) -> torch.Tensor | None:
        """Per-example gradient norms (before clipping) of the last step's examples (private)."""
        return self.clipping.last_norms

    @property
    def last_indices(self) -> torch.Tensor | None:
        """Dataset indices of the last step's examples, in the order of :attr:`last_norms` (private)."""
        return self.clipping.last_indices

    def _recorded_any(self) -> bool:
        """Whether a backward pass of this step left per-example gradients (or norms) to clip."""
        raise NotImplementedError

    def _noise_only(self) -> bool:
        """An empty Poisson batch was drawn and no backward pass ran on it: the step is noise only.

        A model that cannot run on zero rows (Hugging Face transformers reshape by ``-1``) skips the
        forward and backward pass of an empty batch and calls ``step()``: the step is then the one a
        backward pass over zero rows gives — a zero clipped sum plus the noise, charged as every step.
        (Skipping the step instead would reveal that the batch was empty.)"""
        return self.clipping.queue.empty_batch_pending and not self._recorded_any()

    def add_noise(self):
        self._admit_step()
        self._draw_noise()

    def _admit_step(self) -> None:
        """The step's batch is whole and the guard admits the step; on a refusal the step's examples
        are dropped and its raw (unclipped, un-noised) gradients cleared."""
        try:
            self.clipping.queue.finish_step()  # exactly the drawn batch(es), whole
            if self.guard is not None:
                self.guard(self)
        except BaseException:
            self.refuse_step()
            raise

    def refuse_step(self) -> None:
        """Drop the step's examples and clear its raw gradients (the step is not taken)."""
        self.clipping.end_step()
        self.zero_grad(set_to_none=True)

    def _draw_noise(self) -> None:
        std = self.noise_multiplier * self.max_grad_norm
        noises, sums = [], []  # the pairs added in place, by one foreach call (one launch, not one per parameter)
        for p in self.params:  # Opacus's add_noise, with the noise source of our mode, in its order of draws
            _check_processed_flag(p.summed_grad)
            summed = p.summed_grad
            noise = gaussian_like(std, summed, self.generator, self.secure_mode)
            if _in_place(summed, noise):
                noises.append(noise)
                sums.append(summed)
                p.grad = noise.view_as(p)  # holds summed + noise once the foreach add below ran
            else:
                p.grad = (summed + noise).view_as(p)
            _mark_as_processed(p.summed_grad)
        if noises:
            torch._foreach_add_(noises, sums)
        self._noised = True

    def scale_grad(self):
        """Opacus's ``loss_reduction="mean"`` scaling of ``p.grad``, the same division in one foreach call for all
        the parameters (Opacus divides parameter by parameter: a kernel launch, some microseconds of host work,
        each; issue 50's host work per step)."""
        if self.loss_reduction == "mean" and self.params:
            torch._foreach_div_([p.grad for p in self.params], self.expected_batch_size * self.accumulated_iterations)

    def loss_scale(self) -> float:
        """The factor the loss was multiplied by: 1, or the scale ``GradScaler.step(optimizer)`` hands
        over (the amp-scaling optimizer protocol sets ``grad_scale`` and ``found_inf`` for the call).

        The scaler's own overflow check sees no private gradient in book-keeping mode (covered
        parameters have no autograd gradient; :meth:`~..per_example.bk.keeper.BookKeeper.mark_for_grad_scaler`),
        so its scale depends on the step count only; overflowed examples are left out of the
        clipped sum instead of skipping the step (:meth:`~..per_example.bk.keeper.BookKeeper.norms`)."""
        if getattr(self, "found_inf", None) is None:  # not called by a GradScaler
            return 1.0
        error = self._grad_scaler_refusal()
        if error is None and getattr(self, "grad_scale", None) is None:
            error = (
                "scaler.unscale_(optimizer) was called before scaler.step(optimizer): the private optimizer "
                "divides the per-example gradients by the scale itself and cannot learn it afterwards; do not "
                "call unscale_ (per-example clipping replaces clip_grad_norm_)"
            )
        if error is not None:
            self.clipping.end_step()
            self.zero_grad(set_to_none=True)
            raise RuntimeError(error)
        return float(self.grad_scale)

    def _grad_scaler_refusal(self) -> str | None:
        return (
            "a torch.amp.GradScaler is supported with grad_sample_mode='bk' only: in this mode the scaler checks "
            "the summed, un-clipped gradient for overflow and adapts its scale to it, so the scale (which decides "
            "which examples overflow) would depend on the private data; use grad_sample_mode='bk', or bfloat16 "
            "autocast without a GradScaler"
        )

    def step(self, closure=None):
        try:
            self._loss_scale = self.loss_scale()
            out = super().step(closure)
        except BaseException:
            self._noised = False
            for hook in self.refusal_hooks:
                hook(self)
            raise
        finally:
            self._loss_scale = 1.0
        if self._noised:
            self._noised = False
            self.clipping.end_step()
            for hook in self.post_step_hooks:
                hook(self)
        return out


def check_noise(noise_multiplier, max_grad_norm, expected_batch_size) -> None:
    """σ > 0 and finite, c > 0, the normaliser > 0 (σ = 0 is no privacy: refused)."""
    if not (float(noise_multiplier) > 0 and math.isfinite(float(noise_multiplier))):
        raise InvalidParameterError(
            "noise_multiplier", noise_multiplier, "must be > 0 and finite (0 adds no noise: no privacy)"
        )
    check_positive(max_grad_norm, "max_grad_norm")
    check_positive(expected_batch_size, "expected_batch_size")


class IndividualizedDPOptimizer(_PrivacyHooks, DPOptimizer):
    """A ``DPOptimizer`` that clips example i at its own c_i (per-sample gradients materialised).

    Args:
        optimizer: the wrapped torch optimizer.
        noise_multiplier: σ; the noise std is σ·``max_grad_norm``.
        max_grad_norm: the reference clip norm c.
        clipping: per-example clip norms and the queue of drawn indices.
        expected_batch_size: Σ_i q_i (the noisy sum is divided by it).
    """

    def _recorded_any(self) -> bool:
        return any(getattr(p, "grad_sample", None) is not None for p in self.params)

    def zero_grad(self, set_to_none: bool = False):
        check = self.decomposition
        if check is not None:
            check.grads_zeroed()
        super().zero_grad(set_to_none)

    def pre_step(self, closure=None):
        if self._noise_only():  # an empty batch without a backward pass: zero rows
            for p in self.params:
                p.grad_sample = p.new_zeros((0, *p.shape))
        if self.params:
            self._check_grad_samples()
            check = self.decomposition  # Σ_i g_i against autograd's p.grad (refused by the guard)
            if check is not None and check.due:
                check.check_per_sample(self.params, self.loss_reduction)
        return super().pre_step(closure)

    def _check_grad_samples(self) -> None:
        """Before clipping, every parameter's per-sample gradients, checked: one ``(rows, *p.shape)``
        tensor per parameter, the same number of rows for all (one per example; the counts are
        private and not shown).  A step that fails the check is refused before anything is clipped:
        its drawn batch and gradients are dropped."""
        problem, error, rows = None, BatchMismatchError, None
        for i, p in enumerate(self.params):
            if getattr(p, "grad_sample", None) is None:
                problem, error = (
                    f"Per sample gradient is not initialized for parameter {i} (shape {tuple(p.shape)}): no "
                    "backward pass reached it, or (grad_sample_mode='no_op') no p.grad_sample was assigned to it "
                    "before optimizer.step()",
                    ValueError,
                )
                break
            g = self._get_flat_grad_sample(p)
            if g.dim() != p.dim() + 1 or tuple(g.shape[1:]) != tuple(p.shape):
                problem = (
                    f"parameter {i}'s per-sample gradient has shape (rows, {', '.join(map(str, g.shape[1:]))}), "
                    f"not (rows, {', '.join(map(str, p.shape))}): p.grad_sample must hold one gradient of the "
                    "parameter's shape per example"
                )
                break
            if rows is not None and g.shape[0] != rows:
                problem = (
                    "the parameters' per-sample gradients differ in their number of rows (the counts are "
                    "private: not shown): p.grad_sample must hold one row per example of the drawn batch, "
                    "for every parameter"
                )
                break
            rows = g.shape[0]
        if problem is not None:
            self.clipping.queue.clear()
            self.refuse_step()
            raise error(problem + "; the step was not taken")

    def clip_and_accumulate(self):
        """Clip g_i to c_i and add the clipped gradients into ``p.summed_grad``."""
        samples = self.grad_samples
        grouping = grouping_of(self.clipping, len(samples[0]))
        if grouping is not None:  # user level: a user's rows summed, clipped as one unit (engine/clipping/users.py)
            samples = [grouping.sum(g) for g in samples]
        if len(samples[0]) == 0:  # empty Poisson batch: a noise-only step
            norms = torch.zeros((0,), device=samples[0].device)
        else:  # (half-precision per-sample gradients: norms in float32)
            per_param = [
                torch.linalg.vector_norm(g.reshape(len(g), -1), dim=-1, dtype=acc_dtype(g.dtype)) for g in samples
            ]
            device = per_param[0].device
            norms = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
        overflowed = ~torch.isfinite(norms)  # (half precision) norm inf, factor 0, rows zeroed: 0 · inf is nan
        overflowed = overflowed if bool(overflowed.any()) else None
        if overflowed is not None:
            norms = norms.masked_fill(overflowed, float("inf"))
        factor = self.clipping.factors(norms)
        for p, grad_sample in zip(self.params, samples, strict=True):
            _check_processed_flag(p.grad_sample)
            grad_sample = grad_sample.to(p.dtype)
            if overflowed is not None:
                grad_sample = grad_sample.masked_fill(
                    overflowed.to(grad_sample.device).view((-1,) + (1,) * (grad_sample.dim() - 1)), 0
                )
            grad = torch.einsum("i,i...", factor.to(device=grad_sample.device, dtype=p.dtype), grad_sample)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)


class IndividualizedDPOptimizerFastGradientClipping(_PrivacyHooks, DPOptimizerFastGradientClipping):
    """Ghost clipping (``grad_sample_mode="ghost"``): the module's per-example clip factors
    min(1, c_i/‖g_i‖) rescale the per-sample losses of the second backward pass, so ``p.grad``
    arrives clipped and summed; this optimizer adds the noise and divides by Σ q_i."""

    def zero_grad(self, set_to_none: bool = False):
        if self.decomposition is not None:  # between the two passes: the first pass's p.grad, compared
            self.decomposition.close_pass(self.params)
        super().zero_grad(set_to_none)

    def accumulate(self):
        for p in self.params:  # an empty batch leaves p.grad None: it contributes zero
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        super().accumulate()


class IndividualizedDPOptimizerBookKeeping(_PrivacyHooks, DPOptimizerFastGradientClipping):
    """Book-keeping clipping (``grad_sample_mode="bk"``, :mod:`..per_example.bk.keeper`): after the one backward
    pass, the per-example norms come from the model's book-keeper, the clip factors
    min(1, c_i/‖g_i‖) from :class:`~..clipping.examples.PerExampleClipping`, and the clipped sum Σ_i w_i g_i
    from the kept layer inputs and output gradients; this optimizer adds it to ``p.summed_grad``
    (several physical batches accumulate under ``BatchMemoryManager``), then adds the noise and
    divides by Σ q_i as the other modes do."""

    keeper = None  # the model's BookKeeper (:meth:`use_keeper`)

    def use_keeper(self, keeper) -> None:
        """Form the norms and the clipped sum from ``keeper``, the wrapped model's book-keeper; an empty Poisson
        batch gives the GradScaler marker its zero ``.grad`` when drawn (:meth:`zero_grad`)."""
        self.keeper = keeper
        self.clipping.queue.when_empty(None if keeper is None else keeper.mark_for_grad_scaler)

    def _grad_scaler_refusal(self) -> str | None:
        if not self.keeper.units:
            return None
        return (
            f"a torch.amp.GradScaler needs every trainable layer on a book-keeping rule: the fallback layers "
            f"({', '.join(u.name for u in self.keeper.units)}) get autograd gradients, which the scaler would "
            "check for overflow (a scale that depends on the private data); see the module's layer_paths"
        )

    def zero_grad(self, set_to_none: bool = False):
        self.keeper.clear()  # a backward pass that no step consumed is forgotten, as Opacus's grad_sample
        super().zero_grad(set_to_none)
        if self.clipping.queue.empty_batch_pending:
            # a noise-only step is coming (no backward pass): a GradScaler's step checks the optimizer's
            # .grad tensors and refuses to update() with none; the marker's zeros are data-independent
            self.keeper.mark_for_grad_scaler()

    def _recorded_any(self) -> bool:
        return any(part.recorded for part in self.keeper.parts)

    def accumulate(self):
        keeper = self.keeper
        try:
            if self._noise_only():  # an empty batch without a backward pass: no norms, zero sum
                ref = self.params[0]
                norms = torch.zeros(0, dtype=ref.dtype, device=ref.device)
            else:
                with guard("book-keeping's per-example norm pass", "bk"):
                    norms = keeper.norms(self._loss_scale)
            factors = self.clipping.factors(norms)
            with guard("book-keeping's clipped sum", "bk"):
                sums = keeper.clipped_sum(factors, self._loss_scale)
        except BaseException:
            keeper.clear()
            raise
        keeper.clear()
        for p in self.params:
            g = sums.get(p)
            if g is None:
                g = torch.zeros_like(p)
            p.grad = None  # a fallback layer's un-clipped autograd sum is discarded
            if p.summed_grad is not None:
                p.summed_grad.add_(g.to(p.summed_grad.dtype))
            else:
                p.summed_grad = g.to(p.dtype)
