"""Opacus ``DPOptimizer`` with per-example clip norms (IDP-SGD *Scale* and *Sample*).

Boenisch et al. 2023, Alg. 3 with individualized parameters: the per-example gradient g_i is
clipped to c_i (line 6; *Scale* gives each privacy group its own c_p, §3.4), the clipped
gradients are summed, Gaussian noise of standard deviation σ·c is added (line 8; c is the
reference clip norm, so group p meets effective noise multiplier σ·c/c_p), and the sum is divided
by the expected batch size Σ_i q_i (*Sample* gives each group its own q_p, §3.3).

Only :meth:`clip_and_accumulate` differs from Opacus: the clip factor of example i is
min(1, c_i / (‖g_i‖ + 1e-6)) instead of min(1, c / (‖g_i‖ + 1e-6)).  Noise (``add_noise``, std
``noise_multiplier · max_grad_norm``) and normalisation (``scale_grad``, by
``expected_batch_size``) are Opacus's own, with ``max_grad_norm = c`` and
``expected_batch_size = Σ q_i``.
"""
from __future__ import annotations

import math

import torch
from opacus.optimizers.optimizer import DPOptimizer, _check_processed_flag, _mark_as_processed

from ..validation import InvalidParameterError, check_positive, check_positive_array


class IndividualizedDPOptimizer(DPOptimizer):
    """A ``DPOptimizer`` that clips example i at ``clip_norms[i]``.

    Before each ``step()`` the optimizer must know which examples are in the batch, in the order
    of the batch: :meth:`set_batch_indices` (called for you by the loader returned by
    :func:`~idpsgd.training.make_private_individualized`).  After a step, ``last_norms`` holds
    the batch's per-example gradient norms (before clipping) and ``last_indices`` their indices.

    Args:
        optimizer: the wrapped torch optimizer.
        noise_multiplier: σ; the noise std is σ·``max_grad_norm``.
        max_grad_norm: the reference clip norm c.
        clip_norms: per-example clip norms c_i (1-D, one per training example).
        expected_batch_size: Σ_i q_i (the sum is divided by it when ``loss_reduction="mean"``).
    """

    def __init__(self, optimizer, *, noise_multiplier: float, max_grad_norm: float, clip_norms,
                 expected_batch_size: float, loss_reduction: str = "mean", generator=None,
                 secure_mode: bool = False, **kwargs):
        if not (float(noise_multiplier) >= 0 and math.isfinite(float(noise_multiplier))):
            raise InvalidParameterError("noise_multiplier", noise_multiplier, "must be >= 0 and finite "
                                        "(0 only for tests: no privacy)")
        check_positive(max_grad_norm, "max_grad_norm")
        check_positive(expected_batch_size, "expected_batch_size")
        clip = torch.as_tensor(check_positive_array(clip_norms, "clip_norms"), dtype=torch.float32).flatten()
        super().__init__(optimizer, noise_multiplier=float(noise_multiplier),
                         max_grad_norm=float(max_grad_norm), expected_batch_size=expected_batch_size,
                         loss_reduction=loss_reduction, generator=generator, secure_mode=secure_mode,
                         **kwargs)
        self.clip_norms = clip
        self.batch_indices: torch.Tensor | None = None
        self.last_norms: torch.Tensor | None = None
        self.last_indices: torch.Tensor | None = None

    def set_batch_indices(self, indices) -> None:
        """Declare the (dataset) indices of the examples in the coming batch, in batch order."""
        self.batch_indices = torch.as_tensor(indices, dtype=torch.long).flatten()

    def clip_and_accumulate(self):
        """Clip g_i to c_i and add the clipped gradients into ``p.summed_grad``."""
        if self.batch_indices is None:
            raise RuntimeError("IndividualizedDPOptimizer.step() needs set_batch_indices(indices) "
                               "first (the loader from make_private_individualized calls it)")
        batch = len(self.grad_samples[0])
        if batch != self.batch_indices.numel():
            raise RuntimeError(f"the batch has {batch} per-sample gradients but {self.batch_indices.numel()} "
                               f"indices were set; call set_batch_indices for every batch")
        if batch == 0:  # empty Poisson batch: a noise-only step
            norms = torch.zeros((0,), device=self.grad_samples[0].device)
            factor = norms
        else:
            per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in self.grad_samples]
            device = per_param[0].device
            norms = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
            clip = self.clip_norms[self.batch_indices].to(device=device, dtype=norms.dtype)
            factor = (clip / (norms + 1e-6)).clamp(max=1.0)
        self.last_norms, self.last_indices = norms.detach(), self.batch_indices

        for p in self.params:
            _check_processed_flag(p.grad_sample)
            grad_sample = self._get_flat_grad_sample(p).to(p.dtype)
            grad = torch.einsum("i,i...", factor.to(grad_sample.device).to(p.dtype), grad_sample)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)
        self.batch_indices = None
