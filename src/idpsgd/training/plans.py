"""Training plans: which examples each phase trains on, with which DP-SGD parameters.

* ``uniform``, ``sample``, ``scale`` — one phase over all examples (Boenisch et al. 2023, §3).
* ``exclude`` (App. E.1) — drop every example whose budget is below a threshold (default: the
  second-smallest budget) and train the rest with uniform DP-SGD at their smallest budget.
  Dropped examples are never touched: they spend ε = 0.
* ``sequential`` (App. E.2) — one phase per privacy group, strictest first; phase p is uniform
  DP-SGD on group p's examples only, at budget ε_p, with rate min(1, B/|G_p|) for ``epochs``
  passes over the group.  A group's data is used only in its own phase, so it spends ≤ ε_p
  (parallel composition over disjoint data; earlier phases are pre-processing of later ones).
  Difference from the paper's run of E.2 (App. E.3): there σ is one tuned constant (2.5) and each
  group trains until its budget is spent, so the step count varies per group; here every group
  gets the same number of passes (``epochs``) and σ is calibrated per group to spend exactly its
  budget.  Both spend each group's budget on its own data only; ours needs no σ tuning.

Every phase's :class:`~idpsgd.assignment.Assignment` is calibrated so that each group in it
spends at most its budget after the phase's planned steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..assignment import Assignment, Budgets, assign
from ..engine import steps_per_epoch_for
from ..names import IDP_METHODS, PLAN_METHODS
from ..validation import InvalidParameterError, check_positive


@dataclass(frozen=True)
class Phase:
    """One stretch of DP-SGD on ``indices`` (positions in the training set) with ``assignment``."""

    name: str
    indices: np.ndarray
    assignment: Assignment
    epochs: int
    steps_per_epoch: int

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


@dataclass(frozen=True)
class TrainingPlan:
    method: str
    budgets: Budgets
    phases: tuple[Phase, ...]

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def epochs(self) -> int:
        return sum(p.epochs for p in self.phases)


def _phase(name, budgets: Budgets, indices, method, batch_size, epochs, clip_norm, accountant) -> Phase:
    sub = Budgets.from_array(budgets.epsilons[indices], budgets.delta)
    q = min(1.0, batch_size / len(indices))
    spe = steps_per_epoch_for(q)
    return Phase(
        name,
        np.asarray(indices, dtype=np.int64),
        assign(sub, method, q, epochs * spe, clip_norm, accountant),
        epochs,
        spe,
    )


def build_plan(
    budgets: Budgets,
    method: str,
    batch_size: int,
    epochs: int,
    clip_norm: float,
    accountant: str = "rdp",
    exclude_below: float | None = None,
) -> TrainingPlan:
    """Plan a run of ``epochs`` passes with expected batch size ``batch_size``.

    Args:
        budgets: per-example budgets (one per training example) and δ.
        method: one of :data:`~idpsgd.names.PLAN_METHODS`.
        exclude_below: ``exclude`` only — drop examples with budget < this value.
    """
    if method not in PLAN_METHODS:
        raise InvalidParameterError("method", method, f"must be one of {', '.join(PLAN_METHODS)}")
    if int(batch_size) < 1:
        raise InvalidParameterError("batch_size", batch_size, "must be an integer >= 1")
    if int(epochs) < 1:
        raise InvalidParameterError("epochs", epochs, "must be an integer >= 1")
    check_positive(clip_norm, "clip_norm")
    n, eps = len(budgets), budgets.epsilons
    args = (int(batch_size), int(epochs), float(clip_norm), accountant)
    if int(batch_size) > n:
        raise InvalidParameterError("batch_size", batch_size, f"must be <= the {n} training examples")
    if method in IDP_METHODS:
        return TrainingPlan(method, budgets, (_phase("all", budgets, np.arange(n), method, *args),))
    values = budgets.values
    if method == "exclude":
        if exclude_below is None:
            if values.size < 2:
                raise InvalidParameterError(
                    "budgets", values.tolist(), "exclude needs at least two privacy groups (or --exclude-below)"
                )
            exclude_below = float(values[1])
        if not exclude_below > values.min():
            raise InvalidParameterError(
                "exclude_below",
                exclude_below,
                f"must be above the smallest budget "
                f"{values.min():g} (it would exclude no example; use --method uniform)",
            )
        keep = np.flatnonzero(eps >= exclude_below)
        if keep.size == 0:
            raise InvalidParameterError(
                "exclude_below",
                exclude_below,
                f"must be <= the largest budget {values.max():g} (it would drop every example)",
            )
        return TrainingPlan(method, budgets, (_phase(f"budget>={exclude_below:g}", budgets, keep, "uniform", *args),))
    phases = tuple(_phase(f"group eps={v:g}", budgets, np.flatnonzero(eps == v), "uniform", *args) for v in values)
    return TrainingPlan(method, budgets, phases)
