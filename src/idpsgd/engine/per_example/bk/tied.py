"""Cross terms of tied parameters in book-keeping: one parameter used by two or more covered layers
(an input embedding and an output head — GPT-2's ``wte``/``lm_head``, Llama with
``tie_word_embeddings`` —, encoder and decoder sharing a table).

Example i's squared gradient norm of a tied parameter is ‖Σ_l G_i^(l)‖² = Σ_l ‖G_i^(l)‖² +
2 Σ_{l<m} ⟨G_i^(l), G_i^(m)⟩: each layer's rule (:mod:`.rules`) gives its own norm, and this module
the inner products of each pair of uses, exactly and, where a pairwise ghost rule exists
(:data:`PAIR_RULES`: Linear × Linear, Embedding × Linear, Embedding × Embedding), without forming a
per-example gradient (Li et al. 2022's ghost norm applied to two layers' factors; nothing of size
V×d for a tied vocabulary).  A per-sample side contributes its per-example gradient M_i, and the
other side's rule gives ⟨G_i, M_i⟩ (``Rule.ghost_inner``); any other pair forms both per-example
gradients a chunk of examples at a time (:data:`~.rules.CHUNK_FLOATS`).  The clipped sum needs
nothing more: each layer adds its clipped contribution into the shared parameter.
"""

from __future__ import annotations

import torch

from .rules import CHUNK_FLOATS, EmbeddingRule, LinearRule, acc, chunks

GHOST_CROSS, INNER_CROSS, FORMED_CROSS = "ghost", "ghost × per-sample", "per-sample gradients formed"


def _flat_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """⟨x_i, y_i⟩ for every example of two (B, ...) tensors."""
    n = x.shape[0]
    x, y = acc(x), acc(y)
    if x.dtype != y.dtype:
        x, y = x.to(torch.promote_types(x.dtype, y.dtype)), y.to(torch.promote_types(x.dtype, y.dtype))
    return torch.bmm(x.reshape(n, 1, -1), y.reshape(n, -1, 1)).reshape(n)


def _linear_linear(a_layer, b_layer):
    """Linear × Linear (inputs a / a', output gradients b / b'): ⟨Σ_t b_t a_tᵀ, Σ_s b'_s a'_sᵀ⟩ =
    Σ_{t,s} (a_t·a'_s)(b_t·b'_s) — a T×T' Gram of each, O(T T'(d+p))."""
    a1, b1 = (acc(t) for t in LinearRule().joined_factors(a_layer.uses))  # float32 for half precision (autocast)
    a2, b2 = (acc(t) for t in LinearRule().joined_factors(b_layer.uses))
    n, t1, t2 = a1.shape[0], a1.shape[1], a2.shape[1]
    out = a1.new_zeros(n)
    for s in chunks(n, 2 * t1 * t2):
        out[s] = (torch.matmul(a1[s], a2[s].transpose(1, 2)) * torch.matmul(b1[s], b2[s].transpose(1, 2))).sum((1, 2))
    return out


def _embedding_linear(e_layer, l_layer):
    """Embedding × Linear (ids x, output gradient e of the embedding; input h, output gradient b of
    the head whose weight is the V×d table): G1 = Σ_t onehot(x_t) e_tᵀ, G2 = Σ_s b_s h_sᵀ, so
    ⟨G1, G2⟩ = Σ_{t,s} b_s[x_t] (e_t·h_s) — a T×T' Gram and a gather of b at the token ids,
    O(T T' d), nothing of size V×d."""
    ids, e = EmbeddingRule().token_gradients(e_layer.module, e_layer.uses)
    e = acc(e)
    h, b = (acc(t).to(e.dtype) for t in LinearRule().joined_factors(l_layer.uses))
    n, t1, t2 = ids.shape[0], ids.shape[1], h.shape[1]
    out = e.new_zeros(n)
    for s in chunks(n, 2 * t1 * t2):
        gram = torch.matmul(e[s], h[s].transpose(1, 2))  # (k, T1, T2): e_t·h_s
        picked = torch.gather(b[s], 2, ids[s].unsqueeze(1).expand(-1, t2, t1))  # (k, T2, T1): b_s[x_t]
        out[s] = (gram * picked.transpose(1, 2)).sum((1, 2))
    return out


def _embedding_embedding(a_layer, b_layer):
    """Embedding × Embedding: Σ_{t,s} [x_t = x'_s] (e_t·e'_s)."""
    ids1, e1 = EmbeddingRule().token_gradients(a_layer.module, a_layer.uses)
    ids2, e2 = EmbeddingRule().token_gradients(b_layer.module, b_layer.uses)
    e1 = acc(e1)
    e2 = acc(e2).to(e1.dtype)
    n, t1, t2 = ids1.shape[0], ids1.shape[1], ids2.shape[1]
    out = e1.new_zeros(n)
    for s in chunks(n, 2 * t1 * t2):
        same = (ids1[s].unsqueeze(2) == ids2[s].unsqueeze(1)).to(e1.dtype)
        out[s] = (torch.matmul(e1[s], e2[s].transpose(1, 2)) * same).sum((1, 2))
    return out


#: pairwise ghost rules for the weight of two covered layer types (either order)
PAIR_RULES = {
    (LinearRule, LinearRule): _linear_linear,
    (EmbeddingRule, LinearRule): _embedding_linear,
    (EmbeddingRule, EmbeddingRule): _embedding_embedding,
}


def _pair_rule(x, name_x, y, name_y):
    if name_x != "weight" or name_y != "weight" or not (x.uses and y.uses):
        return None
    key = (type(x.rule), type(y.rule))
    if key in PAIR_RULES:
        return lambda: PAIR_RULES[key](x, y)
    if key[::-1] in PAIR_RULES:
        return lambda: PAIR_RULES[key[::-1]](y, x)
    return None


def _per_example(layer, name, s) -> torch.Tensor:
    """The layer's per-example gradients of parameter ``name`` for the examples of slice ``s``."""
    total = layer.grad_sample.get(name)
    if total is not None:
        return total[s]
    for saved, g in layer.uses:
        part = layer.rule.per_sample(layer.module, tuple(t[s] for t in saved), g[s])[name]
        total = part if total is None else total + part
    return total


def cross_term(x, name_x: str, y, name_y: str, batch: int) -> tuple[torch.Tensor | None, str]:
    """(⟨G_i^(x), G_i^(y)⟩ for every example, how it was computed) for parameter ``name_x`` of layer ``x``
    and ``name_y`` of layer ``y`` (one parameter); both layers' norms settled (:meth:`~.units.Layer.norm_sq`).
    None when either layer recorded nothing for it."""
    has_x = bool(x.uses) or name_x in x.grad_sample
    has_y = bool(y.uses) or name_y in y.grad_sample
    if not (has_x and has_y):
        return None, ""
    mx, my = x.grad_sample.get(name_x), y.grad_sample.get(name_y)
    if mx is not None and my is not None:
        return _flat_dot(mx, my), FORMED_CROSS
    rule = _pair_rule(x, name_x, y, name_y)
    if rule is not None:
        return rule(), GHOST_CROSS
    for ghost, name, explicit in ((x, name_x, my), (y, name_y, mx)):
        if explicit is not None and ghost.uses and hasattr(ghost.rule, "ghost_inner"):
            return ghost.rule.ghost_inner(ghost.module, ghost.uses, name, explicit), INNER_CROSS
    size = int(getattr(x.module, name_x).numel())
    out = None
    for s in chunks(batch, 2 * size):
        part = _flat_dot(_per_example(x, name_x, s), _per_example(y, name_y, s))
        out = part if out is None else torch.cat([out, part])
    return out, FORMED_CROSS


__all__ = ["CHUNK_FLOATS", "PAIR_RULES", "cross_term"]
