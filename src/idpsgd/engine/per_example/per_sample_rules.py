"""Opacus's per-sample gradient rules, corrected where they disagree with autograd.

Each rule here wraps Opacus's own and is registered in Opacus's registry for its layer types, so the
``hooks`` and ``ghost`` modes, user level and book-keeping's per-sample fallback all use it.  The
decomposition check (:mod:`..guards.decomposition`) found both: a rule's rows must add up to autograd's
gradient of the summed loss.

* ``nn.Conv1d/2d/3d``: Opacus's rule (``opacus.grad_sample.conv.compute_conv_grad_sample``) unfolds the
  layer input with ``as_strided`` strides computed for a contiguous NC(D)HW tensor
  (``opacus.utils.tensor_utils.unfold2d`` / ``unfold3d``).  A channels-last input —
  ``x.to(memory_format=torch.channels_last)``, or the view a vision transformer hands its convolutions
  (``tokens.permute(0, 2, 1).reshape(B, C, H, W)``, as in SegFormer) — then reads the wrong elements:
  wrong per-example gradients (issue 46: norms off by 14 %, clipped sums by up to 140 %), silently.
  Here the input and output gradient are made contiguous first (no copy when they already are).
* ``nn.Embedding(padding_idx=...)``: autograd never gives the padding row a gradient; Opacus's rule
  scatters the padding positions' output gradients into it, so the clipped update trained that row
  (and each norm counted it).  Here the padding row of every per-example gradient is zero.
"""

from __future__ import annotations

import torch
from opacus.grad_sample.conv import compute_conv_grad_sample as _opacus_conv_rule
from opacus.grad_sample.embedding import compute_embedding_grad_sample as _opacus_embedding_rule
from opacus.grad_sample.utils import register_grad_sampler
from torch import nn


@register_grad_sampler([nn.Conv1d, nn.Conv2d, nn.Conv3d])
def compute_conv_grad_sample(layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """Per-example gradients of a convolution's weight and bias: Opacus's rule on contiguous tensors."""
    return _opacus_conv_rule(layer, [activations[0].contiguous(), *activations[1:]], backprops.contiguous())


@register_grad_sampler(nn.Embedding)
def compute_embedding_grad_sample(layer: nn.Embedding, activations, backprops: torch.Tensor) -> dict:
    """Per-example gradients of an embedding table: Opacus's rule, the padding row zero (as autograd's)."""
    out = _opacus_embedding_rule(layer, activations, backprops)
    if layer.padding_idx is not None and layer.weight in out:
        out[layer.weight][:, layer.padding_idx] = 0
    return out


__all__ = ["compute_conv_grad_sample", "compute_embedding_grad_sample"]
