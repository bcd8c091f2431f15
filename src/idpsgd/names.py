"""The names the package accepts for a method or an accountant, each spelled once.

Every module that checks, offers (CLI ``choices``) or dispatches on a method or accountant name
imports it from here, so a new method cannot be accepted in one place and refused in another.

Methods: ``uniform`` is plain DP-SGD at the strictest budget; ``sample`` and ``scale`` are the two
IDP-SGD variants of Boenisch et al. 2023 (§3.2–3.3: per-group sampling rate, or per-group clip norm
at one noise multiplier); ``exclude`` and ``sequential`` are the training plans' baselines (§4);
``pdp-sgd``, ``pdp-sampling`` and ``adapdp`` are the (Φ, Δ)-PDP trainers of Heo et al. 2023.
Accountants: RDP (Mironov 2017, with the improved conversion), PLD (Google's ``dp_accounting``)
and PRV (Gopi et al. 2021, Opacus's code). Derived tuples are built from these, never re-listed.
"""

from __future__ import annotations

IDP_METHODS = ("uniform", "sample", "scale")
"""The individualized DP-SGD methods (one phase over all examples): what the engine takes."""

FIXED_SIGMA_METHODS = IDP_METHODS[1:]
"""IDP methods that keep the noise multiplier fixed and solve each group's rate or clip norm."""

BASELINE_METHODS = ("exclude", "sequential")
"""The training plans' baselines (several phases, or some examples left out)."""

PLAN_METHODS = IDP_METHODS + BASELINE_METHODS
"""Methods of :func:`idpsgd.training.build_plan` (the trainer's group-based methods)."""

PDP_METHODS = ("pdp-sgd", "pdp-sampling", "adapdp")
"""The (Φ, Δ)-PDP trainers (Heo et al. 2023): their own round structure."""

PDP_AUDIT_METHODS = PDP_METHODS[:1]
"""PDP trainers the membership-inference audit runs."""

AUDIT_METHODS = IDP_METHODS + PDP_AUDIT_METHODS
"""Methods the membership-inference audit runs (the engine's, and PDP-SGD)."""

ACCOUNTANTS = ("rdp", "pld", "prv")
"""Accountants of a whole run's ε (group / dataset level)."""

INDIVIDUAL_ACCOUNTANTS = ACCOUNTANTS[:2]
"""Accountants that also give each example its own ε (per-example RDP, or PLD as well); the PDP
rounds take these too."""


def one_of(names: tuple[str, ...]) -> str:
    """``"a, b or c"``: the allowed names as an error message or help text lists them."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


__all__ = [
    "ACCOUNTANTS",
    "AUDIT_METHODS",
    "BASELINE_METHODS",
    "FIXED_SIGMA_METHODS",
    "IDP_METHODS",
    "INDIVIDUAL_ACCOUNTANTS",
    "PDP_AUDIT_METHODS",
    "PDP_METHODS",
    "PLAN_METHODS",
    "one_of",
]
