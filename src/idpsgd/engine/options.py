"""The set-up's two records: the options of a ``make_private`` call and the phase it plans.

:class:`SetupOptions` holds how the step is built (``grad_sample_mode``, the loss reduction, the
filter, user level, ...) and refuses values the engine cannot honour, once.  :class:`PhaseParameters`
is the plan of a phase (Boenisch et al. 2023, Alg. 1–3): per-example rates q_i and clip norms c_i,
σ, the reference clip norm c, the planned and per-epoch steps and the normaliser Σ q_i; it is
``engine.parameters``, read by the filters, individual accounting and the reports.  Frozen: a
phase's parameters change only by a new ``make_private``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..names import ACCOUNTANTS
from ..validation import InvalidParameterError
from .modes import GradSampleMode, mode

#: the privacy filters: per group (``make_private``'s default), per example (engine/budget/filter.py; Feldman
#: & Zrnic 2021), or none (accounted, not filtered)
FILTERS = ("group", "individual", None)
FILTER_ACTIONS = ("raise", "warn")
LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, eq=False)
class PhaseParameters:
    """The current phase's plan: the public, data-independent parameters of its steps."""

    sample_rates: np.ndarray
    clip_norms: np.ndarray
    noise_multiplier: float
    max_grad_norm: float
    steps: int | None
    steps_per_epoch: int
    expected_batch_size: float
    grad_sample_mode: str
    privacy_unit: str = "example"
    max_rows_per_user: int | None = None

    @classmethod
    def of(cls, q, c, noise_multiplier, max_grad_norm, steps, steps_per_epoch, ebs, grad_sample_mode, users=None):
        """The plan of a phase (``users``: a :class:`~idpsgd.users.Users` at user level)."""
        return cls(
            sample_rates=q,
            clip_norms=c,
            noise_multiplier=float(noise_multiplier),
            max_grad_norm=float(max_grad_norm),
            steps=None if steps is None else int(steps),
            steps_per_epoch=int(steps_per_epoch),
            expected_batch_size=ebs,
            grad_sample_mode=grad_sample_mode,
            privacy_unit="example" if users is None else "user",
            max_rows_per_user=None if users is None else users.k,
        )


@dataclass(frozen=True)
class SetupOptions:
    """How a phase's step is built; :meth:`validate` refuses what the engine cannot honour."""

    grad_sample_mode: str = "hooks"
    criterion: Any = None
    batch_first: bool = True
    loss_reduction: str = "mean"
    privacy_filter: str | None = "group"
    filter_action: str = "raise"
    noise_generator: Any = None
    filter_options: Any = None
    per_sample_loss: Any = None
    wrap_model: bool = True
    users: Any = None
    expected_batch_size: float | None = None

    @property
    def mode(self) -> GradSampleMode:
        """The record of :attr:`grad_sample_mode` (:mod:`.modes`)."""
        return mode(self.grad_sample_mode)

    def validate(self, secure_mode: bool, has_budgets: bool, filter_attached: bool) -> SetupOptions:
        """Self, or an :class:`~idpsgd.validation.InvalidParameterError` naming the value and the fix.
        ``filter_attached``: the engine already runs the individual filter (one-phase runs only)."""
        self.mode  # noqa: B018 - an unknown mode is refused with the known ones
        if self.privacy_filter not in FILTERS:
            raise InvalidParameterError("privacy_filter", self.privacy_filter, "must be 'group', 'individual' or None")
        if not has_budgets and self.privacy_filter is not None:
            raise InvalidParameterError(
                "privacy_filter",
                self.privacy_filter,
                "needs budgets to filter against; give budgets= or privacy_filter=None",
            )
        if filter_attached:
            raise InvalidParameterError(
                "privacy_filter",
                self.privacy_filter,
                "this engine's individual filter supports one-phase runs; use a new IndividualizedPrivacyEngine",
            )
        if self.filter_action not in FILTER_ACTIONS:
            raise InvalidParameterError("filter_action", self.filter_action, "must be 'raise' or 'warn'")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise InvalidParameterError("loss_reduction", self.loss_reduction, "must be mean or sum")
        if self.noise_generator is not None and secure_mode:
            raise InvalidParameterError("noise_generator", "a generator", "must not be given in secure mode")
        return self


__all__ = ["ACCOUNTANTS", "FILTERS", "FILTER_ACTIONS", "PhaseParameters", "SetupOptions"]
