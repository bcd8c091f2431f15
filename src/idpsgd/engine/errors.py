"""The engine's errors in one place: what a step or a set-up raises when it refuses.

Every refusal of an input is an :class:`~idpsgd.validation.InvalidParameterError` (the CLI turns it into
exit 2 with one line); these are the engine's own, each defined next to the code that raises it and
listed here so that a caller catches them from one module.
"""

from ..validation import InvalidParameterError
from .budget.accountant import PrivacyBudgetExceeded
from .distributed import DistributedTrainingError
from .distributed.fsdp import ShardedTrainingError
from .guards.batch_independence import BatchMixingError
from .guards.decomposition import DecompositionError
from .guards.integrity import UnnoisedWriteError
from .opacus_compat import UnsupportedModuleError
from .sampling.sampler import BatchMismatchError

__all__ = [
    "BatchMismatchError",
    "BatchMixingError",
    "DecompositionError",
    "DistributedTrainingError",
    "InvalidParameterError",
    "PrivacyBudgetExceeded",
    "ShardedTrainingError",
    "UnnoisedWriteError",
    "UnsupportedModuleError",
]
