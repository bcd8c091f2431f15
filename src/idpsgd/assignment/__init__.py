"""Individualized privacy assignment: budgets → per-example (q_i, c_i) and σ (Boenisch et al.)."""

from .budgets import Budgets, group_counts, parse_class_map, parse_float_list
from .methods import METHODS, Assignment, GroupParams, SparseSamplingWarning, assign, sparse_sampling

__all__ = [
    "METHODS",
    "Assignment",
    "Budgets",
    "GroupParams",
    "SparseSamplingWarning",
    "assign",
    "group_counts",
    "parse_class_map",
    "parse_float_list",
    "sparse_sampling",
]
