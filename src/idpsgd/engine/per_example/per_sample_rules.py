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
  (and each norm counted it).  Here the padding row of every per-example gradient is zero; ghost
  clipping's norm of the same layer (``opacus.grad_sample.embedding_norm_sample``) counted the padding
  positions too (the architecture survey: per-example norms up to 33 % high on padded batches of
  Qwen2-Audio, Voxtral and three more, whose text tables have a padding row), so its output gradients at
  those positions are zeroed first.
"""

from __future__ import annotations

import torch
from opacus.grad_sample.conv import compute_conv_grad_sample as _opacus_conv_rule
from opacus.grad_sample.embedding import compute_embedding_grad_sample as _opacus_embedding_rule
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample as _opacus_embedding_norm
from opacus.grad_sample.utils import register_grad_sampler, register_norm_sampler
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


@register_norm_sampler(nn.Embedding)
def compute_embedding_norm_sample(layer: nn.Embedding, activations, backprops: torch.Tensor) -> dict:
    """Per-example gradient norms of an embedding table (ghost clipping): Opacus's, without the padding row
    (the output gradients at the padding positions zeroed, as autograd gives that row none)."""
    if layer.padding_idx is not None:
        ids = activations[0]
        keep = (ids != layer.padding_idx).unsqueeze(-1).to(backprops.dtype)
        backprops = backprops * keep
    return _opacus_embedding_norm(layer, activations, backprops)


__all__ = ["compute_conv_grad_sample", "compute_embedding_grad_sample", "compute_embedding_norm_sample"]
