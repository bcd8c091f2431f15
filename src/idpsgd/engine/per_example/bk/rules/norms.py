"""Affine normalisation layers (``nn.LayerNorm``, ``nn.GroupNorm``, the instance norms): per-sample
gradients of γ and β, always formed (C numbers per example)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Rule, acc, autocast_input, own_forward, trainable


# --- Normalisation layers -----------------------------------------------------------------------
class _AffineNormRule(Rule):
    """Affine normalisation layers: y = x̂ ⊙ γ + β.  Example i's gradients are γ_i = Σ x̂ ⊙ b and
    β_i = Σ b over its positions — per-sample gradients of the size of γ (C numbers), always formed
    directly.  The forward and the input gradient are PyTorch's native kernels (their mean and
    inverse standard deviation are kept for x̂)."""

    def per_sample(self, module, saved, g):
        x, mean, rstd = (acc(t) for t in saved)
        g = acc(g)
        xhat = self._xhat(module, x, mean, rstd)
        out = {}
        if trainable(module, "weight"):
            out["weight"] = self._reduce(module, xhat * g)
        if trainable(module, "bias"):
            out["bias"] = self._reduce(module, g)
        return out


class GroupNormRule(_AffineNormRule):
    """``nn.GroupNorm`` with ``affine=True``, and ``nn.InstanceNorm{1,2,3}d`` with ``affine=True`` and
    ``track_running_stats=False`` (instance normalisation is group normalisation with one group per
    channel: the same statistics per example and channel)."""

    @staticmethod
    def covers(module):
        if own_forward(module, nn.GroupNorm):
            return module.affine
        for cls in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
            if own_forward(module, cls):
                return module.affine and not module.track_running_stats
        return False

    @staticmethod
    def _groups(module):
        return module.num_groups if isinstance(module, nn.GroupNorm) else module.num_features

    def prepare(self, module, x):
        return autocast_input(x, "group_norm" if isinstance(module, nn.GroupNorm) else "instance_norm", module.weight)

    def forward(self, module, x):
        if x.dim() < 2 or (not isinstance(module, nn.GroupNorm) and x.dim() != module._get_no_batch_dim() + 1):
            raise ValueError(
                f"book-keeping needs batched inputs for {type(module).__name__}; got shape {tuple(x.shape)}"
            )
        n, c = x.shape[0], x.shape[1]
        out, mean, rstd = torch.ops.aten.native_group_norm(
            x.contiguous(),
            module.weight,
            module.bias,
            n,
            c,
            int(math.prod(x.shape[2:])),
            self._groups(module),
            module.eps,
        )
        return out, (x, mean, rstd)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        x, mean, rstd = saved
        n, c = x.shape[0], x.shape[1]
        return torch.ops.aten.native_group_norm_backward(
            g.contiguous(),
            x.contiguous(),
            mean,
            rstd,
            module.weight,
            n,
            c,
            int(math.prod(x.shape[2:])),
            self._groups(module),
            [True, False, False],
        )[0]

    def _xhat(self, module, x, mean, rstd):
        n = x.shape[0]
        grouped = x.reshape(n, self._groups(module), -1)
        return ((grouped - mean.reshape(n, -1, 1)) * rstd.reshape(n, -1, 1)).reshape(x.shape)

    @staticmethod
    def _reduce(module, t):
        return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)


class LayerNormRule(_AffineNormRule):
    """``nn.LayerNorm`` with ``elementwise_affine=True`` on (B, *, normalized_shape) inputs."""

    @staticmethod
    def covers(module):
        return own_forward(module, nn.LayerNorm) and module.elementwise_affine

    def trailing(self, module):
        return len(module.normalized_shape)

    def prepare(self, module, x):
        return autocast_input(x, "layer_norm", module.weight)

    def forward(self, module, x):
        if x.dim() <= len(module.normalized_shape):
            raise ValueError(f"book-keeping needs batched inputs for LayerNorm; got shape {tuple(x.shape)}")
        out, mean, rstd = torch.ops.aten.native_layer_norm(
            x, list(module.normalized_shape), module.weight, module.bias, module.eps
        )
        return out, (x, mean, rstd)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        x, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(
            g.contiguous(),
            x,
            list(module.normalized_shape),
            mean,
            rstd,
            module.weight,
            module.bias,
            [True, False, False],
        )[0]

    def _xhat(self, module, x, mean, rstd):
        return (x - mean) * rstd

    @staticmethod
    def _reduce(module, t):
        k = len(module.normalized_shape)
        middle = tuple(range(1, t.dim() - k))
        return t.sum(middle) if middle else t
