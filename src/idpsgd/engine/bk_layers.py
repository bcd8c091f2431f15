"""Per-layer rules of book-keeping (moved to :mod:`.bk.rules`; this path is kept for existing imports)."""

from .bk.rules import (
    CHUNK_FLOATS,
    RULES,
    Conv1DRule,
    ConvRule,
    EmbeddingRule,
    GroupNormRule,
    LayerNormRule,
    LinearRule,
    Rule,
    ScaleNormRule,
    acc,
    acc_dtype,
    add_into,
    autocast_input,
    chunks,
    rule_for,
)

__all__ = [
    "CHUNK_FLOATS",
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
    "rule_for",
]
