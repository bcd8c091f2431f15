"""The group privacy filter: refuse a step that would take any privacy group over its budget.

Boenisch et al. 2023 calibrate each group to spend its budget exactly at the planned length; the
filter makes that a guarantee whatever the loop does: before the noise of each step it asks the
group accountant (:mod:`.accountant`) whether one more step keeps every group's ε within its
budget, and refuses it (:class:`~.accountant.PrivacyBudgetExceeded`) or warns
(``filter_action="warn"``).  A phase's plan is checked once at set-up (:meth:`GroupFilter.check_plan`),
so the admitted steps are then cheap.  :class:`StepFilter` is the interface it shares with the
individual filter (:class:`~.filter.IndividualFilter`; Feldman & Zrnic 2021): the engine's guard
calls ``guard`` before the noise and ``can_step`` answers the loop.  User guidance: docs/guarantees.md.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np

from .accountant import GroupAccountant, PrivacyBudgetExceeded


class StepFilter(Protocol):
    """What the engine asks of a privacy filter."""

    def guard(self, optimizer) -> None:
        """Before the noise of a step: raise to refuse it (nothing is released or charged then)."""

    def can_step(self) -> bool:
        """Whether one more step would be admitted."""


class GroupFilter:
    """Every privacy group within its budget, by the group accountant (``privacy_filter="group"``)."""

    def __init__(self, accountant: GroupAccountant, action: str = "raise"):
        self.accountant, self.action, self.warned = accountant, action, False

    def can_step(self) -> bool:
        return self.accountant.can_step()

    def check_plan(self, steps: int | None) -> None:
        """Refuse (or warn about) a phase whose plan — ``steps``, or one step without a plan — would
        take a group over its budget given what the earlier phases spent; the admitted steps are then
        cached, so the filter passes them cheaply."""
        accountant = self.accountant
        planned = 1 if steps is None else int(steps)
        if accountant.prime(planned):
            return
        fits = accountant.max_admissible_steps(planned)
        before = accountant.group_epsilons(extra_steps=0)
        what = f"the plan of {planned} steps" if steps is not None else "a step"
        msg = (
            f"{what} would take a privacy group over its budget (budgets {accountant.values.tolist()}, spent "
            f"before this phase {np.round(before, 4).tolist()}); at most {fits} steps of this phase fit"
        )
        if self.action == "raise":
            raise PrivacyBudgetExceeded(
                msg + ": plan at most that many steps (steps=/epochs=), add noise, or use "
                "a new IndividualizedPrivacyEngine for a new run"
            )
        warnings.warn(
            msg + "; continuing because filter_action='warn' (the reported epsilon will exceed the budget)",
            RuntimeWarning,
            stacklevel=4,
        )

    def guard(self, _optimizer) -> None:
        if self.accountant.can_step():
            return
        eps_now = self.accountant.group_epsilons()
        msg = (
            f"privacy filter: step {self.accountant.steps + 1} would take a privacy group over its budget "
            f"(budgets {self.accountant.values.tolist()}, spent so far {np.round(eps_now, 4).tolist()})"
        )
        if self.action == "raise":
            raise PrivacyBudgetExceeded(msg + "; the step was not taken")
        if not self.warned:
            warnings.warn(
                msg + "; continuing because filter_action='warn' (the reported ε will exceed the budget)",
                RuntimeWarning,
                stacklevel=3,
            )
            self.warned = True


__all__ = ["GroupFilter", "StepFilter"]
