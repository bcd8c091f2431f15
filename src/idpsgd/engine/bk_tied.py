"""Cross terms of tied parameters (moved to :mod:`.bk.tied`; this path is kept for existing imports)."""

from .bk.tied import FORMED_CROSS, GHOST_CROSS, INNER_CROSS, PAIR_RULES, cross_term

__all__ = ["FORMED_CROSS", "GHOST_CROSS", "INNER_CROSS", "PAIR_RULES", "cross_term"]
