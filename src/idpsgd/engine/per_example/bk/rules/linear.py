"""``nn.Linear`` and transformers' ``Conv1D`` (a Linear with a transposed weight): ghost norm or
per-sample gradient by the input shapes (Bu, Mao & Xu 2022's mixed rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import (
    HALF,
    Rule,
    acc,
    acc_dtype,
    add_into,
    autocast_input,
    chunks,
    gram_norm_sq,
    joined,
    own_forward,
    rows,
    same_code,
    trainable,
)


# --- Linear -------------------------------------------------------------------------------------
class LinearRule(Rule):
    """``nn.Linear`` on (B, d) or (B, *, d) inputs: positions T = product of the middle dimensions."""

    ghost_capable = True
    #: the weight's layout: (out, in) as ``nn.Linear``, or (in, out) as transformers' ``Conv1D``
    transposed = False
    #: the operation autocast sees (:func:`autocast_input`)
    amp_op = "linear"

    @staticmethod
    def covers(module):
        return own_forward(module, nn.Linear)

    def trailing(self, module):
        return 1

    def prepare(self, module, x):
        return autocast_input(x, self.amp_op, module.weight)

    def forward(self, module, x):
        return F.linear(x, module.weight, module.bias), (x,)

    def backward_input(self, module, saved, g, need_input):
        return torch.matmul(g, module.weight) if need_input else None

    @staticmethod
    def flat_factors(saved, g):
        """(a (B, T, d), b (B, T, p)): one record's input and output gradient with the positions in one
        dimension; example i's weight gradient is Σ_t b_it a_itᵀ (Li et al. 2022, the ghost norm's factors)."""
        x = saved[0]
        b = x.shape[0]
        return x.reshape(b, -1, x.shape[-1]), g.reshape(b, -1, g.shape[-1])

    def _weight_of(self, a, b):
        """Σ over the rows of (a (n, d), b (n, p)) of the weight gradient in the weight's layout."""
        return a.t() @ b if self.transposed else b.t() @ a

    def prefers_ghost(self, module, uses):
        if not trainable(module, "weight"):
            return False
        t = sum(s[0].numel() // max(1, s[0].shape[0] * s[0].shape[-1]) for s, _ in uses)  # flat_factors' T, unshaped
        return 2 * t * t < module.weight.numel()

    def per_sample(self, module, saved, g):
        a, b = self.flat_factors(saved, g)
        a, b = acc(a), acc(b)
        out = {}
        if trainable(module, "weight"):
            left, right = (a, b) if self.transposed else (b, a)
            out["weight"] = (
                torch.bmm(left.transpose(1, 2), right) if a.shape[1] > 1 else left[:, 0, :, None] * right[:, 0, None, :]
            )
        if trainable(module, "bias"):
            out["bias"] = b.sum(1)
        return out

    def joined_factors(self, uses):
        """:meth:`flat_factors` of every use of the layer, joined along the positions."""
        pairs = [self.flat_factors(s, g) for s, g in uses]
        if len(pairs) == 1:
            return pairs[0]
        return torch.cat([a for a, _ in pairs], 1), torch.cat([b for _, b in pairs], 1)

    def ghost_norm_sq(self, module, uses):
        """Σ_{t,t'} (a_t·a_t' + 1)(b_t·b_t') per example: the weight's ghost norm with the bias's folded in (the bias
        is a weight on a constant input 1: ‖Σ_t b_t‖² = Σ_{t,t'} b_t·b_t'), one Gram matrix pair, a chunk of
        examples at a time."""
        a, b = self.joined_factors(uses)
        t = a.shape[1]
        bias = 1.0 if trainable(module, "bias") else 0.0
        parts = [
            gram_norm_sq(acc(rows(a, s)), acc(rows(b, s)), bias)
            for s in chunks(a.shape[0], 2 * t * t + t * (a.shape[2] + b.shape[2]))
        ]
        return joined(parts, 0)

    def ghost_inner(self, module, uses, name, m):
        """⟨G_i, M_i⟩ for explicit per-example tensors M (B, *shape) of parameter ``name``: Σ_t b_tᵀ M a_t
        (weight) or Σ_t b_t·M (bias) from the kept factors (for tied parameters, :mod:`.tied`)."""
        a, b = (acc(t) for t in self.joined_factors(uses))
        m = acc(m).to(a.dtype)
        if name == "bias":
            return (b.sum(1) * m).sum(1)
        out = a.new_zeros(a.shape[0])
        for s in chunks(a.shape[0], a.shape[1] * a.shape[2]):
            out[s] = (torch.matmul(b[s], m[s]) * a[s]).sum((1, 2))
        return out

    def ghost_clipped_sum(self, module, uses, w):
        out = {}
        for saved, g in uses:
            a, b = self.flat_factors(saved, g)
            # half precision: float32 copies, a chunk of examples at a time
            n = a.shape[0]
            parts_of = chunks(n, a.shape[1] * (a.shape[2] + b.shape[2])) if a.dtype in HALF else (slice(0, n),)
            for s in parts_of:
                # Σ_i w_i b_iᵀ a_i: the weights scale the narrower factor (GPT-2's head: the 768-wide input, not
                # the 50,257-wide output gradient)
                ai, bi, wi = acc(rows(a, s)), acc(rows(b, s)), rows(w, s).to(acc_dtype(b.dtype))
                scale_input = ai.shape[-1] < bi.shape[-1]
                if scale_input:
                    ai = ai * wi.view(-1, 1, 1)
                else:
                    bi = bi * wi.view(-1, 1, 1)
                parts = {"weight": self._weight_of(ai.reshape(-1, ai.shape[-1]), bi.reshape(-1, bi.shape[-1]))}
                if trainable(module, "bias"):
                    parts["bias"] = wi @ bi.sum(1) if scale_input else bi.sum((0, 1))
                add_into(out, parts)
        return out


# Verbatim copies (compared by compiled code, :func:`same_code`): never reformat or "fix" them.
def _conv1d_forward(self, x):  # verbatim: transformers.pytorch_utils.Conv1D.forward
    size_out = x.size()[:-1] + (self.nf,)  # noqa: RUF005  (verbatim)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x


class Conv1DRule(LinearRule):
    """transformers' ``Conv1D`` (GPT-2, GPT, ...): ``addmm(bias, x, W)`` with W stored (in, out), a
    Linear with a transposed weight; matched by its forward's code (:func:`same_code`), so
    transformers is never imported.  The same ghost norm and clipped sum as :class:`LinearRule`,
    the per-example gradients in the (in, out) layout."""

    transposed = True
    amp_op = "addmm"

    @staticmethod
    def covers(module):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        return (
            isinstance(weight, nn.Parameter)
            and weight.dim() == 2
            and isinstance(bias, nn.Parameter)
            and same_code(type(module).forward, _conv1d_forward)
        )

    def forward(self, module, x):
        size_out = (*x.size()[:-1], module.nf)
        return torch.addmm(module.bias, x.view(-1, x.size(-1)), module.weight).view(size_out), (x,)

    def backward_input(self, module, saved, g, need_input):
        return torch.matmul(g, module.weight.t()) if need_input else None
