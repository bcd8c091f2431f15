"""idpsgd — individualized privacy for DP-SGD.

Assign a privacy budget per example and train to it (IDP-SGD Sample and Scale, and the
exclude / sequential baselines), account for the privacy each example actually received, and
report it.  The accounting core (:mod:`idpsgd.accounting`) and assignment are numpy/scipy only;
the training API (torch, Opacus) is imported lazily on first use.
"""

from .accounting import (
    DEFAULT_ORDERS,
    IndividualAccountant,
    RdpLedger,
    SampledGaussianEvent,
    account_from_norms,
    calibrate_noise_multiplier,
    calibrate_sample_rate,
    compute_rdp,
    epsilon_sgm,
    pld_epsilon,
    rdp_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
)
from .assignment import Assignment, Budgets, assign
from .users import Users, group_privacy
from .validation import InvalidParameterError, UnreachableTargetError

__version__ = "0.2.0"

_LAZY = {  # name -> module (torch-dependent, imported on first access)
    "TrainConfig": "training",
    "Trainer": "training",
    "train": "training",
    "build_plan": "training",
    "IndividualAccountingOptions": "engine",
    "IndividualizedPrivacyEngine": "engine",
    "IndividualizedDPOptimizer": "engine",
    "PoissonBatchSampler": "engine",
    "PrivacyBudgetExceeded": "engine",
    "load_dataset": "data",
    "Dataset": "data",
    "create_model": "models",
    "MODELS": "models",
    "train_pdp": "training.pdp",
    "run_per_instance": "training.per_instance",
    "FilterOptions": "engine",
    "train_filtered": "training.filtered",
    "GroupEpsilons": "engine",
    "run_heo_table1": "experiments.heo",
    "run_boenisch_table2": "experiments.boenisch",
    "run_boenisch_table3": "experiments.boenisch",
    "run_yu_figure": "experiments.yu",
    "run_thudi_figure1": "experiments.thudi",
    "ParallelRuns": "training.per_instance_runs",
    "save_sharded_checkpoint": "engine.distributed.sharded_checkpoint",
    "load_sharded_checkpoint": "engine.distributed.sharded_checkpoint",
    "export_pretrained": "engine.distributed.sharded_checkpoint",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'idpsgd' has no attribute {name!r}")


def __dir__():
    """The module's names, the lazily imported ones included (``dir(idpsgd)``, tab completion)."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = [  # noqa: PLE0604  (*_LAZY: the names imported on first use, strings too)
    "Assignment",
    "Budgets",
    "DEFAULT_ORDERS",
    "IndividualAccountant",
    "account_from_norms",
    "InvalidParameterError",
    "RdpLedger",
    "SampledGaussianEvent",
    "UnreachableTargetError",
    "Users",
    "group_privacy",
    "assign",
    "calibrate_noise_multiplier",
    "calibrate_sample_rate",
    "compute_rdp",
    "epsilon_sgm",
    "pld_epsilon",
    "rdp_epsilon",
    "rdp_to_delta",
    "rdp_to_epsilon",
    *_LAZY,
]
