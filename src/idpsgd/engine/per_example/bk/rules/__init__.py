"""Per-layer rules of book-keeping clipping: per-example gradient norms and clipped sums from a layer's
input and output gradient, without the per-example gradient tensor where a ghost norm is cheaper.

For a layer with weight W applied at T positions, example i's weight gradient is
G_i = Σ_t b_{i,t} a_{i,t}ᵀ (a the layer's input at position t, b the loss gradient w.r.t. its
output there).  Its norm is either the **ghost norm** ‖G_i‖²_F = Σ_{t,t'} (a_{i,t}·a_{i,t'})
(b_{i,t}·b_{i,t'}) (Li et al. 2022; cost ∝ T²·(d + p), nothing of size d·p) or that of the
**per-sample gradient** G_i (cost ∝ T·d·p); Bu, Mao & Xu 2022's mixed rule takes the ghost norm when
2T² < d·p, per layer and per backward pass (:meth:`Rule.prefers_ghost`).  The clipped sum
Σ_i min(1, c_i/‖g_i‖) G_i is then formed directly (Bu, Wang, Zha & Karypis 2023, Alg. 1): a ghost
layer's ordinary weight gradient with b_i scaled, or Σ_i w_i G_i — no second backward pass.

This package owns one :class:`Rule` per layer family (``covers``, ``forward``, ``backward_input``,
``per_sample``, ``ghost_norm_sq``, ``ghost_clipped_sum``), one module each: :mod:`.linear` (Linear,
transformers' Conv1D), :mod:`.conv`, :mod:`.embedding`, :mod:`.norms` (LayerNorm, GroupNorm),
:mod:`.scale_norms` (RMSNorm forms); what they share is :mod:`.base`.  This module holds the registry
(:data:`RULES`, :func:`rule_for`) and the routed subclasses (:data:`ROUTED`, :func:`routed_rule`).
Transformers' layers are matched by what their forward computes (:func:`~.base.same_code`), never by
name; norms and sums accumulate in float32 (:func:`~.base.acc`), half-precision inputs cast as autocast
would (:func:`~.base.autocast_input`).  The covered
layers and the mixed-precision rules: ``docs/performance.md``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import CHUNK_FLOATS, Rule, acc, acc_dtype, add_into, autocast_input, chunks, same_code
from .conv import ConvRule
from .embedding import EmbeddingRule
from .linear import Conv1DRule, LinearRule
from .norms import GroupNormRule, LayerNormRule
from .scale_norms import ScaleNormRule

__all__ = [
    "CHUNK_FLOATS",
    "ROUTED",
    "RULES",
    "Conv1DRule",
    "ConvRule",
    "EmbeddingRule",
    "GroupNormRule",
    "LayerNormRule",
    "LinearRule",
    "Rule",
    "ScaleNormRule",
    "acc",
    "acc_dtype",
    "add_into",
    "autocast_input",
    "chunks",
    "routed_rule",
    "rule_for",
    "same_code",
]

#: the rules in the order they are tried
RULES: tuple[Rule, ...] = (
    LinearRule(),
    ConvRule(),
    EmbeddingRule(),
    GroupNormRule(),
    LayerNormRule(),
    Conv1DRule(),
    ScaleNormRule(),
)


def rule_for(module: nn.Module) -> Rule | None:
    """The rule covering ``module`` (None: not covered; Opacus's per-sample gradient then)."""
    for rule in RULES:
        if rule.covers(module):
            return rule
    return None


def _calls_super(fn, base: type) -> bool:
    """``fn`` calls the base class's forward: ``super().forward(x)``, or ``Base.forward(self, x)`` by name
    (``nn.LayerNorm.forward(self, x)``)."""
    code = getattr(fn, "__code__", None)
    names = code.co_names if code is not None else ()
    return "forward" in names and ("super" in names or base.__name__ in names)


#: (rule, base class, the functional operation its forward calls, the position of the weight in it)
ROUTED = (
    (LinearRule(), nn.Linear, F.linear, 1),
    (EmbeddingRule(), nn.Embedding, F.embedding, 1),
    (LayerNormRule(), nn.LayerNorm, F.layer_norm, 2),
)


def routed_rule(module: nn.Module):
    """(rule, functional operation, weight position) for a subclass of a covered layer with a forward
    of its own that calls the base class's (``super().forward(ids) * scale``: Gemma's and BART's scaled
    word embeddings, OPT's learned positions; ``nn.LayerNorm.forward(self, x)``): the rule applies where the base
    forward's operation meets the module's own weight (:mod:`.provenance` routes it); None otherwise."""
    if rule_for(module) is not None:
        return None
    for rule, base, fn, pos in ROUTED:
        if (
            isinstance(module, base)
            and type(module).forward is not base.forward
            and _calls_super(type(module).forward, base)
            and (base is not nn.Embedding or EmbeddingRule.semantics(module))
            and (base is not nn.LayerNorm or module.elementwise_affine)
        ):
            return rule, fn, pos
    return None
