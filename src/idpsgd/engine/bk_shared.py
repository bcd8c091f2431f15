"""Values shared by the batch in book-keeping (moved to :mod:`.bk.shared`; this path is kept for existing imports)."""

from .bk.shared import BK_HINT, SharedTensor, Source, check_complete, distribute, parameter_use

__all__ = ["BK_HINT", "SharedTensor", "Source", "check_complete", "distribute", "parameter_use"]
