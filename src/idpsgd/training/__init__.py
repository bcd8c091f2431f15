"""Individualized DP-SGD training on Opacus: sampler, optimizer, plans (methods and baselines), loop."""
from .optimizer import IndividualizedDPOptimizer
from .private import make_private_individualized, steps_per_epoch_for
from .sampler import IndexedLoader, PoissonSampler

__all__ = ["IndexedLoader", "IndividualizedDPOptimizer", "PoissonSampler", "make_private_individualized",
           "steps_per_epoch_for"]
