"""Training recipes on the engine: the ``train`` harness (plans: uniform/sample/scale and the
exclude/sequential baselines), individual accounting reports, PDP-SGD rounds, per-instance runs."""

from ..engine import GUARANTEE, IndividualAccountingOptions
from .device import resolve_device
from .loop import TrainConfig, Trainer, evaluate, train
from .plans import Phase, TrainingPlan, build_plan

__all__ = [
    "GUARANTEE",
    "IndividualAccountingOptions",
    "Phase",
    "TrainConfig",
    "Trainer",
    "TrainingPlan",
    "build_plan",
    "evaluate",
    "resolve_device",
    "train",
]
