"""The individualized privacy engine (torch + Opacus): :class:`IndividualizedPrivacyEngine` owns the
module, optimizer, data loader and accountant of individualized DP-SGD (Boenisch et al. 2023) for
any model, data and device; individual accounting (Yu et al. 2023) runs on it."""

from .budget.accountant import GroupAccountant, GroupEpsilons, PrivacyBudgetExceeded
from .budget.filter import FilterOptions, IndividualFilter
from .budget.individual import IndividualAccountingOptions, IndividualTracker
from .noise.optimizer import (
    IndividualizedDPOptimizer,
    IndividualizedDPOptimizerBookKeeping,
    IndividualizedDPOptimizerFastGradientClipping,
)
from .per_example.bk.keeper import BookKeeper
from .per_example.bk.module import BookKeepingModule
from .privacy_engine import GUARANTEE, IndividualizedPrivacyEngine, steps_per_epoch_for
from .sampling.sampler import BatchIndexQueue, PoissonBatchSampler, PrivateDataLoader

__all__ = [
    "GUARANTEE",
    "BatchIndexQueue",
    "BookKeeper",
    "BookKeepingModule",
    "FilterOptions",
    "GroupAccountant",
    "GroupEpsilons",
    "IndividualAccountingOptions",
    "IndividualFilter",
    "IndividualTracker",
    "IndividualizedDPOptimizer",
    "IndividualizedDPOptimizerBookKeeping",
    "IndividualizedDPOptimizerFastGradientClipping",
    "IndividualizedPrivacyEngine",
    "PoissonBatchSampler",
    "PrivacyBudgetExceeded",
    "PrivateDataLoader",
    "steps_per_epoch_for",
]
