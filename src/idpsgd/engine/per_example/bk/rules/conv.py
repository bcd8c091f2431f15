"""``nn.Conv1d`` and ``nn.Conv2d`` (any padding mode, groups, dilation): the ghost norm over unfolded
patches or the per-sample gradient, by the shapes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import (
    CHUNK_FLOATS,
    Rule,
    acc,
    acc_dtype,
    add_into,
    autocast_input,
    chunks,
    gram_norm_sq,
    joined,
    own_forward,
    trainable,
)

# --- Convolutions -------------------------------------------------------------------------------
_CONV_FN = {1: F.conv1d, 2: F.conv2d}


class ConvRule(Rule):
    """``nn.Conv1d`` / ``nn.Conv2d``: any stride, padding (numbers, 'valid', 'same', any padding_mode),
    dilation and groups.  T = output positions, d = C_in/groups · kernel size, p = C_out/groups.

    Padding that is not a symmetric zero padding (``padding_mode`` reflect/replicate/circular, an
    odd total 'same' padding) is applied by :meth:`prepare` outside the book-kept operation, as an
    ordinary differentiable ``F.pad``, exactly as ``nn.ConvNd.forward`` does; the kept input is then
    the padded one."""

    ghost_capable = True

    @staticmethod
    def covers(module):
        return (own_forward(module, nn.Conv1d) or own_forward(module, nn.Conv2d)) and not module.transposed

    @staticmethod
    def _same_total(module):
        return [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]

    def padding(self, module) -> list[int]:
        """The symmetric zero padding of the book-kept convolution (after :meth:`prepare`)."""
        nd = len(module.kernel_size)
        if module.padding_mode != "zeros" or module.padding == "valid":
            return [0] * nd
        if module.padding == "same":
            total = self._same_total(module)
            return [t // 2 for t in total] if all(t % 2 == 0 for t in total) else [0] * nd
        return list(module.padding)

    def prepare(self, module, x):
        nd = len(module.kernel_size)
        if x.dim() != nd + 2:
            raise ValueError(
                f"book-keeping needs batched inputs for {type(module).__name__}; got shape {tuple(x.shape)}"
            )
        x = autocast_input(x, f"conv{nd}d", module.weight)
        if module.padding_mode != "zeros":
            return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        if module.padding == "same":
            total = self._same_total(module)
            if any(t % 2 for t in total):  # as PyTorch: the extra zero on the right/bottom side
                spec = []
                for t in reversed(total):
                    spec += [t // 2, t - t // 2]
                return F.pad(x, spec)
        return x

    def forward(self, module, x):
        out = _CONV_FN[len(module.kernel_size)](
            x, module.weight, module.bias, module.stride, self.padding(module), module.dilation, module.groups
        )
        return out, (x,)

    def _backward(self, module, x, g, weight, groups, mask):
        nd = len(module.kernel_size)
        return torch.ops.aten.convolution_backward(
            g,
            x,
            weight,
            None,
            list(module.stride),
            self.padding(module),
            list(module.dilation),
            False,
            [0] * nd,
            groups,
            mask,
        )

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        return self._backward(module, saved[0], g, module.weight.to(g.dtype), module.groups, [True, False, False])[0]

    def _dims(self, module, g):
        """(groups, T, d, p) of one use."""
        groups = module.groups
        return (
            groups,
            int(math.prod(g.shape[2:])),
            module.in_channels // groups * int(math.prod(module.kernel_size)),
            module.out_channels // groups,
        )

    def prefers_ghost(self, module, uses):
        if not trainable(module, "weight"):
            return False
        _, _, d, p = self._dims(module, uses[0][1])
        t = sum(self._dims(module, g)[1] for _, g in uses)
        return 2 * t * t < d * p

    def per_sample(self, module, saved, g):
        out = {}
        if trainable(module, "weight"):
            out["weight"] = self._per_sample_weight(module, saved[0], g)
        if trainable(module, "bias"):
            out["bias"] = acc(g).sum(tuple(range(2, g.dim())))
        return out

    def _per_sample_weight(self, module, x, g):
        """G_i for every example: the convolution's weight-gradient kernel on a chunk of k examples
        folded into the channel dimension (groups = k·groups), so no unfolded patches are formed."""
        n, w = x.shape[0], module.weight
        out = w.new_empty((n, *tuple(w.shape)))
        per_example = w.numel() + x[0].numel() + g[0].numel()
        step = max(1, min(32, CHUNK_FLOATS // max(1, per_example)))
        for start in range(0, n, step):
            k = min(step, n - start)
            xs = acc(x[start : start + k]).reshape((1, k * x.shape[1], *tuple(x.shape[2:])))
            gs = acc(g[start : start + k]).reshape((1, k * g.shape[1], *tuple(g.shape[2:])))
            wk = w.unsqueeze(0).expand((k, *tuple(w.shape))).reshape((k * w.shape[0], *tuple(w.shape[1:])))
            gw = self._backward(module, xs, gs, wk, k * module.groups, [False, True, False])[1]
            out[start : start + k] = gw.view((k, *tuple(w.shape)))
        return out

    def _unfold(self, module, x):
        """(B, groups, T, d) patches of the (padded) input; a Conv1d as a 1×L image."""
        pad = self.padding(module)
        if len(module.kernel_size) == 1:
            cols = F.unfold(
                x.unsqueeze(2),
                (1, module.kernel_size[0]),
                dilation=(1, module.dilation[0]),
                padding=(0, pad[0]),
                stride=(1, module.stride[0]),
            )
        else:
            cols = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=pad, stride=module.stride)
        b, dk, t = cols.shape
        return cols.view(b, module.groups, dk // module.groups, t).transpose(2, 3)

    def _pixels(self, module, x, g) -> int:
        """U, the padded input's positions of one use, when the patch Gram matrix is cheaper from the pixels'
        Gram matrix (:meth:`_patch_gram`) than from unfolded patches; else 0."""
        _, t, d, _ = self._dims(module, g)
        u = int(math.prod(s + 2 * q for s, q in zip(x.shape[2:], self.padding(module), strict=True)))
        kernel = int(math.prod(module.kernel_size))
        return u if u * u * (d // kernel) + kernel * t * t < t * t * d else 0

    def _patch_gram(self, module, x, out_shape) -> torch.Tensor:
        """(B, groups, T, T): the Gram matrix of each example's unfolded patches, ⟨patch_t, patch_t'⟩, without
        unfolding them.  The patches are windows of the padded input, so ⟨patch_t, patch_t'⟩ = Σ over kernel
        offsets κ of P[t·s + κ·δ, t'·s + κ·δ], with P the Gram matrix of the padded input's pixels (channel
        vectors) and s, δ the stride and dilation: one product of U × U (U padded positions, C channels),
        then the offsets summed one spatial dimension at a time over strided views of P (k_h + k_w sums for
        a k_h × k_w kernel, not k_h·k_w), instead of unfolding T × C·k patches (a copy k times the input) and
        a T × T product over C·k (Rochette et al. 2019 compute per-example convolution gradients from shifted
        windows the same way)."""
        pad = self.padding(module)
        if any(pad):
            x = F.pad(x, [q for q in reversed(pad) for _ in range(2)])
        b, c, groups, nd = x.shape[0], x.shape[1], module.groups, len(out_shape)
        xs = x.reshape(b, groups, c // groups, -1)
        a = torch.matmul(xs.transpose(2, 3), xs).view(b, groups, *x.shape[2:], *x.shape[2:])
        for i, (k, dl, st, n) in enumerate(
            zip(module.kernel_size, module.dilation, module.stride, out_shape, strict=True)
        ):
            summed = None
            for o in range(k):  # positions o·δ, o·δ + s, … along dimension i, in both halves of P
                window = [slice(None)] * a.dim()
                window[2 + i] = window[2 + nd + i] = slice(o * dl, o * dl + st * (n - 1) + 1, st)
                view = a[tuple(window)]
                summed = view.clone() if summed is None else summed.add_(view)
            a = summed
        t = int(math.prod(out_shape))
        return a.reshape(b, groups, t, t)

    def ghost_norm_sq(self, module, uses):
        groups, _, d, p = self._dims(module, uses[0][1])
        n = uses[0][1].shape[0]
        t_all = sum(self._dims(module, g)[1] for _, g in uses)
        out = uses[0][1].new_zeros(n, dtype=acc_dtype(uses[0][1].dtype))
        u = self._pixels(module, uses[0][0][0], uses[0][1]) if len(uses) == 1 else 0
        if u:  # the pixels' Gram matrix, the padded input, the two T × T Gram matrices, the output gradient
            cost = u * u + u * d // int(math.prod(module.kernel_size)) + 2 * t_all * t_all + t_all * p
        else:  # the unfolded patches, the output gradient and the two Gram matrices
            cost = 2 * t_all * t_all + t_all * (d + p)
        x, out_shape = uses[0][0][0], tuple(uses[0][1].shape[2:])  # the one use's input (the pixel path)
        for s in chunks(n, groups * cost):
            b = joined([acc(g[s]).reshape(g[s].shape[0], groups, p, -1).transpose(2, 3) for _, g in uses], 2)
            if u:
                a_gram = self._patch_gram(module, acc(x[s]), out_shape)
                out[s] = (a_gram * torch.matmul(b, b.transpose(-1, -2))).sum((-3, -2, -1))
                continue
            a = joined([self._unfold(module, acc(saved[0][s])) for saved, _ in uses], 2)
            out[s] = gram_norm_sq(a, b).sum(1)
        if trainable(module, "bias"):
            bias = sum(acc(g).sum(tuple(range(2, g.dim()))) for _, g in uses)
            out = out + (bias * bias).sum(1)
        return out

    def ghost_clipped_sum(self, module, uses, w):
        out = {}
        for saved, g in uses:
            # Σ_i w_i G_i: the weights scale the smaller of the input and the output gradient
            x, g, wt = acc(saved[0]), acc(g), w.to(acc_dtype(g.dtype))
            scale_input = x[0].numel() < g[0].numel()
            if scale_input:
                x = x * wt.view((-1,) + (1,) * (x.dim() - 1))
            else:
                g = g * wt.view((-1,) + (1,) * (g.dim() - 1))
            kernel = self._backward(module, x, g, module.weight.to(g.dtype), module.groups, [False, True, False])
            parts = {"weight": kernel[1]}
            if trainable(module, "bias"):
                positions = tuple(range(2, g.dim()))
                parts["bias"] = wt @ g.sum(positions) if scale_input else g.sum((0, *positions))
            add_into(out, parts)
        return out
