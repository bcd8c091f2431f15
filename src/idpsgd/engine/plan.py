"""The plan of a ``make_private`` call: from its arguments to a phase's per-example parameters.

Boenisch et al. 2023, §3: from per-example budgets, a method (``uniform``, ``sample``, ``scale``),
the mean sampling rate and the planned steps, :func:`idpsgd.assignment.assign` calibrates the
per-example rates q_i, clip norms c_i and one σ so that each privacy group spends its budget exactly
at the plan; with σ given (``make_private(noise_multiplier=, budgets=)``) each group's rate or clip
norm is solved instead (:func:`~idpsgd.assignment.methods.assign_for_noise_multiplier`); without
budgets (Opacus's ``make_private``) every example gets the one σ, rate and clip norm, accounted but
not filtered.  :func:`plan_phase` returns what ``make_private_with_parameters`` takes;
:func:`epsilon_budgets` turns ``make_private_with_epsilon``'s target into budgets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..assignment import Budgets, assign
from ..names import IDP_METHODS
from ..validation import InvalidParameterError, check_epsilon
from .checks import Counted, check_budgets, count_units, mean_sample_rate, planned_steps, steps_per_epoch_for
from .noise.optimizer import check_noise


@dataclass(frozen=True)
class PlannedPhase:
    """``make_private_with_parameters``'s per-example arguments, and the assignment they came from."""

    arguments: dict[str, Any]
    counted: Counted  # the units counted, the budgets and σ checked: not checked again at set-up
    assignment: Any = None  # idpsgd.assignment's result (None without budgets)
    filtered: bool = True  # False: one σ without budgets, accounted but not filtered


def plan_phase(
    accountant: str,
    *,
    data_loader,
    users,
    budgets,
    method,
    target_delta,
    epochs,
    steps,
    max_grad_norm,
    sample_rate,
    noise_multiplier,
    privacy_filter,
    counted: Counted | None = None,
) -> PlannedPhase:
    """The phase ``make_private`` sets up (see its docstring for the three cases).  ``counted``: the
    units and budgets ``make_private_with_epsilon`` checked already (each check runs once)."""
    n = count_units(data_loader, users) if counted is None else counted.units
    checked = counted is not None  # the budgets too
    q = mean_sample_rate(data_loader, n, sample_rate)
    spe = steps_per_epoch_for(q)
    if noise_multiplier is not None and budgets is not None:  # σ given: each group's q_p or c_p solved
        from ..assignment.methods import assign_for_noise_multiplier

        budgets = budgets if checked else check_budgets(budgets, target_delta, n)
        if epochs is None and steps is None:
            raise InvalidParameterError(
                "epochs",
                None,
                "give epochs= or steps= with budgets and noise_multiplier: each privacy group's sampling rate "
                "(method 'sample') or clip norm ('scale') is solved so that it spends its budget in that many "
                "steps at this noise_multiplier; or calibrate the noise multiplier too with "
                "make_private_with_epsilon(budgets=..., epochs=...)",
            )
        planned = planned_steps(epochs, steps, spe)
        check_noise(noise_multiplier, max_grad_norm, 1.0)
        method = "sample" if method is None else method
        a = assign_for_noise_multiplier(
            budgets, method, float(noise_multiplier), q, planned, float(max_grad_norm), accountant
        )
        return _assigned(a, budgets, planned, spe, Counted(n, budgets, noise=True))
    if noise_multiplier is not None:  # Opacus's make_private: one σ for everyone, no budget
        if method is not None:
            raise InvalidParameterError(
                "method",
                method,
                "is calibrated from budgets; with noise_multiplier and no budgets "
                "every example has the one σ, rate and clip norm (leave method out)",
            )
        planned = None if epochs is None and steps is None else planned_steps(epochs, steps, spe)
        if privacy_filter is not None:
            raise InvalidParameterError(
                "privacy_filter",
                privacy_filter,
                "needs budgets to filter against; give budgets= (or leave privacy_filter out)",
            )
        check_noise(noise_multiplier, max_grad_norm, 1.0)
        arguments = dict(
            budgets=None,
            target_delta=target_delta,
            sample_rates=np.full(n, q),
            clip_norms=np.full(n, float(max_grad_norm)),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            steps=planned,
            steps_per_epoch=spe,
        )
        return PlannedPhase(arguments, Counted(n, None, noise=True), filtered=False)
    method = "sample" if method is None else method
    if method not in IDP_METHODS:
        raise InvalidParameterError("method", method, f"must be one of {', '.join(IDP_METHODS)}")
    if budgets is None:
        raise InvalidParameterError(
            "budgets",
            None,
            "give per-example budgets (a Budgets or an array with "
            "target_delta), or noise_multiplier= for one σ (Opacus's make_private), or "
            "use make_private_with_epsilon for one target epsilon",
        )
    budgets = budgets if checked else check_budgets(budgets, target_delta, n)
    planned = planned_steps(epochs, steps, spe)
    a = assign(budgets, method, q, planned, max_grad_norm, accountant)
    return _assigned(a, budgets, planned, spe, Counted(n, budgets))


def _assigned(a, budgets: Budgets, planned: int, spe: int, counted: Counted) -> PlannedPhase:
    arguments = dict(
        budgets=budgets,
        sample_rates=a.sample_rates,
        clip_norms=a.clip_norms,
        noise_multiplier=a.noise_multiplier,
        max_grad_norm=a.clip_norm,
        steps=planned,
        steps_per_epoch=spe,
    )
    return PlannedPhase(arguments, counted, assignment=a)


def epsilon_budgets(
    n: int, budgets, target_epsilon, target_delta, method, epsilon_tolerance
) -> tuple[Budgets, str | None]:
    """``make_private_with_epsilon``'s budgets and method: one budget ``target_epsilon`` for every
    unit (method ``uniform``), or the given per-example ``budgets`` (each at most ``target_epsilon``)."""
    if budgets is None:
        if target_epsilon is None:
            raise InvalidParameterError("target_epsilon", None, "is required (or give per-example budgets=)")
        if target_delta is None:
            raise InvalidParameterError("target_delta", None, "is required with target_epsilon")
        eps = check_epsilon(target_epsilon, "target_epsilon")
        budgets = Budgets.from_array(np.full(n, float(eps)), target_delta)
        method = "uniform" if method is None else method
    else:
        budgets = check_budgets(budgets, target_delta, n)
        if target_epsilon is not None and float(target_epsilon) < float(budgets.epsilons.max()) * (1 - 1e-12):
            raise InvalidParameterError(
                "target_epsilon",
                target_epsilon,
                f"is below the largest budget "
                f"{budgets.epsilons.max():g}: with budgets= every example spends its own "
                "budget, so target_epsilon (if given) must be >= every budget",
            )
    if epsilon_tolerance is not None:
        tol = float(epsilon_tolerance)
        if not tol >= 1e-4 * float(budgets.epsilons.max()):
            raise InvalidParameterError(
                "epsilon_tolerance",
                epsilon_tolerance,
                "must be >= 1e-4 x the target (the calibration lands within [(1 - 1e-4) target, target])",
            )
    return budgets, method


__all__ = ["PlannedPhase", "epsilon_budgets", "plan_phase"]
