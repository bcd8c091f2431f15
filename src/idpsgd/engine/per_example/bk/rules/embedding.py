"""``nn.Embedding``: the ghost norm by a scatter-add of the output gradients over each example's distinct
tokens; the clipped sum by one weighted ``index_add``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Rule, acc, joined, own_forward


# --- Embedding ----------------------------------------------------------------------------------
class EmbeddingRule(Rule):
    """``nn.Embedding`` (any index shape (B, *)): example i's gradient has one row per distinct token
    v, Σ_{t: id_t = v} b_t, so ‖G_i‖² = Σ_v ‖Σ_{t: id_t = v} b_t‖² — formed by a scatter-add over the
    (example, token) pairs, cost ∝ T·p; positions at ``padding_idx`` contribute nothing, as in
    PyTorch's embedding backward.  The clipped sum is the same scatter-add with b_i scaled by w_i.
    ``scale_grad_by_freq`` (a gradient that couples the examples of a batch) and ``sparse`` are not
    covered; ``max_norm`` is not covered either, and the engine refuses it in every mode
    (:func:`~...guards.integrity.check_static_writes`: PyTorch renormalises the looked-up rows in place during
    the forward, an un-noised write to the released model)."""

    ghost_capable = True
    always_ghost = True
    parameters = ("weight",)

    @staticmethod
    def covers(module):
        return own_forward(module, nn.Embedding) and EmbeddingRule.semantics(module)

    @staticmethod
    def semantics(module):
        return not module.scale_grad_by_freq and not module.sparse and module.max_norm is None

    def trailing(self, module):
        return 0

    def forward(self, module, ids):
        return F.embedding(ids, module.weight, module.padding_idx), (ids,)

    def backward_input(self, module, saved, g, need_input):
        return None

    def prefers_ghost(self, module, uses):
        return True

    def token_gradients(self, module, uses):
        """(ids (B, T), b (B, T, p)) over all uses, padding positions zeroed."""
        ids = joined([s[0].reshape(s[0].shape[0], -1) for s, _ in uses], 1)
        b = joined([acc(g).reshape(g.shape[0], -1, g.shape[-1]) for _, g in uses], 1)
        if module.padding_idx is not None:
            b = b * (ids != module.padding_idx).unsqueeze(-1).to(b.dtype)
        return ids, b

    def ghost_norm_sq(self, module, uses):
        ids, b = self.token_gradients(module, uses)
        n, _t = ids.shape
        key = torch.arange(n, device=ids.device).unsqueeze(1) * module.num_embeddings + ids
        uniq, inv = torch.unique(key.reshape(-1), return_inverse=True)
        rows = b.new_zeros((uniq.numel(), b.shape[-1])).index_add_(0, inv, b.reshape(-1, b.shape[-1]))
        return b.new_zeros(n).index_add_(
            0, torch.div(uniq, module.num_embeddings, rounding_mode="floor"), (rows * rows).sum(1)
        )

    def per_sample(self, module, saved, g):
        """G_i (B, V, d): row v of example i is the sum of its output gradients at token v (used where a
        tied parameter's cross term has no ghost rule, a chunk of examples at a time)."""
        ids, b = self.token_gradients(module, [(saved, g)])
        n, v = ids.shape[0], module.num_embeddings
        key = (torch.arange(n, device=ids.device).unsqueeze(1) * v + ids).reshape(-1)
        rows = b.new_zeros((n * v, b.shape[-1])).index_add_(0, key, b.reshape(-1, b.shape[-1]))
        return {"weight": rows.view(n, v, -1)}

    def ghost_inner(self, module, uses, name, m):
        """⟨G_i, M_i⟩ = Σ_t e_t·M_i[x_t] for explicit per-example tensors M (B, V, d) (tied parameters)."""
        ids, b = self.token_gradients(module, uses)
        b = acc(b)
        m = acc(m).to(b.dtype)
        picked = torch.gather(m, 1, ids.unsqueeze(-1).expand(-1, -1, m.shape[-1]))
        return (picked * b).sum((1, 2))

    def ghost_clipped_sum(self, module, uses, w):
        ids, b = self.token_gradients(module, uses)
        bw = (b * w.to(b.dtype).view(-1, 1, 1)).reshape(-1, b.shape[-1])
        return {"weight": torch.zeros_like(module.weight, dtype=bw.dtype).index_add_(0, ids.reshape(-1), bw)}
