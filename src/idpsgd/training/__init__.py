"""Individualized DP-SGD training on Opacus: sampler, optimizer, plans (methods and baselines), loop."""
from .engine import GUARANTEE, TrainConfig, Trainer, evaluate, train
from .optimizer import IndividualizedDPOptimizer
from .plans import METHODS, Phase, TrainingPlan, build_plan
from .private import make_private_individualized, steps_per_epoch_for
from .sampler import IndexedLoader, PoissonSampler

__all__ = ["GUARANTEE", "METHODS", "Phase", "TrainConfig", "Trainer", "TrainingPlan", "build_plan", "evaluate",
           "train", "IndexedLoader", "IndividualizedDPOptimizer", "PoissonSampler", "make_private_individualized",
           "steps_per_epoch_for"]
