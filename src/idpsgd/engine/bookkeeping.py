"""The book-keeper (moved to :mod:`.bk.keeper`; this path is kept for existing imports)."""

from .bk.keeper import (
    ACCUMULATION_ERROR,
    BY_SHAPES,
    DIRECT,
    DIRECT_UNIT,
    FALLBACK,
    GHOST,
    PER_SAMPLE,
    BookKeeper,
    BookKeepingModule,
    plan_layers,
    summarize_paths,
)

__all__ = [
    "ACCUMULATION_ERROR",
    "BY_SHAPES",
    "DIRECT",
    "DIRECT_UNIT",
    "FALLBACK",
    "GHOST",
    "PER_SAMPLE",
    "BookKeeper",
    "BookKeepingModule",
    "plan_layers",
    "summarize_paths",
]
