"""From budgets to DP-SGD parameters: per-example q_i and c_i, and one noise multiplier σ.

Methods (Boenisch et al. 2023, "Have it your way", §3.2–3.4, Alg. 1–2, App. C):

* ``uniform`` — standard DP-SGD at the smallest budget: every group spends ≤ min ε.
* ``sample`` — one shared σ and per-group sampling rates q_p (Alg. 1).  Each q_p is the largest
  rate that keeps group p within ε_p after the planned steps at σ; σ is found by bracketed root
  finding so that the count-weighted mean Σ_p (|G_p|/N)·q_p equals the requested q (the expected
  batch size is unchanged).  The paper shrinks σ by a fixed factor 0.99 per iteration instead.
* ``scale`` — per-group σ_p (each group's own DP-SGD calibration at rate q), noise multiplier
  σ_scale = (Σ_p (|G_p|/N)/σ_p)^−1 (App. C.2, eq. 10), so that the count-weighted mean clip
  norm equals the requested c, and clip norms c_p = c·σ_scale/σ_p.  Group p then meets noise
  σ_scale·c = σ_p·c_p, i.e. effective noise multiplier σ_p.  In the paper's Table 6 the σ_scale
  column does not follow from eq. 10 while the c_p column does; we follow the formula.

Every group is calibrated to spend its budget by the planned number of steps, never beyond it:
its ε lies in [(1 − 1e-4)·budget, budget] (``uniform``: the smallest budget for all).  The
guarantee is data-independent individual (ε_p, δ)-DP (Boenisch et al. eq. 3), proved per group
as a sampled Gaussian mechanism with that group's (q_p, σ_p).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..accounting import calibrate_noise_multiplier, calibrate_sample_rate, epsilon_sgm, solve_monotone
from ..accounting.calibration import RTOL
from ..validation import (InvalidParameterError, check_positive, check_sample_rate, check_steps)
from .budgets import Budgets


@dataclass(frozen=True)
class GroupParams:
    """One privacy group's parameters and the ε the accountant gives it after the planned steps."""

    budget: float
    count: int
    fraction: float
    sample_rate: float
    clip_norm: float
    noise_multiplier: float  # effective: σ for sample/uniform, σ·c/c_p for scale
    epsilon: float

    def as_dict(self) -> dict:
        return {"budget": self.budget, "count": self.count, "fraction": self.fraction,
                "sample_rate": self.sample_rate, "clip_norm": self.clip_norm,
                "noise_multiplier": self.noise_multiplier, "epsilon": self.epsilon}


@dataclass(frozen=True)
class Assignment:
    """DP-SGD parameters for individualized budgets.

    ``noise_multiplier`` σ and the reference ``clip_norm`` c set the noise std σ·c of every step;
    example i is sampled with ``sample_rates[i]`` and clipped at ``clip_norms[i]``.
    """

    method: str
    accountant: str
    noise_multiplier: float
    sample_rate: float
    clip_norm: float
    steps: int
    delta: float
    groups: tuple[GroupParams, ...]
    example_group: np.ndarray = field(repr=False)

    @property
    def sample_rates(self) -> np.ndarray:
        return np.array([g.sample_rate for g in self.groups])[self.example_group]

    @property
    def clip_norms(self) -> np.ndarray:
        return np.array([g.clip_norm for g in self.groups])[self.example_group]

    @property
    def expected_batch_size(self) -> float:
        return float(sum(g.count * g.sample_rate for g in self.groups))

    def summary(self) -> dict:
        """The public JSON contract of ``idpsgd assign``."""
        return {"method": self.method, "accountant": self.accountant,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "clip_norm": self.clip_norm, "steps": self.steps, "delta": self.delta,
                "groups": [g.as_dict() for g in self.groups]}


@dataclass(frozen=True)
class _Problem:
    values: np.ndarray     # distinct budgets, ascending
    weights: np.ndarray    # |G_p| / N
    counts: np.ndarray
    delta: float
    q: float
    c: float
    steps: int
    accountant: str


def _uniform(p: _Problem):
    sigma = float(calibrate_noise_multiplier(p.values.min(), p.delta, p.q, p.steps, p.accountant))
    n = p.values.size
    return sigma, np.full(n, p.q), np.full(n, p.c), np.full(n, sigma)


def _sample(p: _Problem):
    def rates(sigma):
        return np.atleast_1d(calibrate_sample_rate(p.values, p.delta, sigma, p.steps, p.accountant))

    # σ between the uniform calibrations for the largest budget (all q_p ≤ q) and the smallest
    # (all q_p ≥ q); the weighted mean rate increases with σ.
    lo = float(calibrate_noise_multiplier(p.values.max(), p.delta, p.q, p.steps, p.accountant))
    hi = float(calibrate_noise_multiplier(p.values.min(), p.delta, p.q, p.steps, p.accountant))
    if p.values.size == 1 or np.isclose(lo, hi, rtol=1e-12):
        return _uniform(p)  # one budget: Sample is standard DP-SGD
    sigma = float(solve_monotone(lambda s, idx: np.atleast_1d(p.weights @ rates(float(s[0]))),
                                     np.array([p.q]), lo, hi, increasing=True, rtol=RTOL / 10)[0])
    q_p = rates(sigma)
    n = p.values.size
    return sigma, q_p, np.full(n, p.c), np.full(n, sigma)


def _scale(p: _Problem):
    sig_p = np.atleast_1d(calibrate_noise_multiplier(p.values, p.delta, p.q, p.steps, p.accountant))
    sigma_scale = float(1.0 / np.sum(p.weights / sig_p))   # App. C.2, eq. (10)
    c_p = p.c * sigma_scale / sig_p
    return sigma_scale, np.full(p.values.size, p.q), c_p, sig_p


METHODS: dict[str, Callable[[_Problem], tuple]] = {"uniform": _uniform, "sample": _sample, "scale": _scale}


def assign(budgets: Budgets, method: str, sample_rate: float, steps: int, clip_norm: float,
           accountant: str = "rdp", group_weights=None) -> Assignment:
    """Derive an :class:`Assignment` for ``budgets`` with the named method.

    Args:
        budgets: per-example budgets and δ.
        method: ``uniform``, ``sample`` or ``scale``.
        sample_rate: requested (mean) sampling rate q = B/N.
        steps: planned number of DP-SGD steps.
        clip_norm: requested (mean) clip norm c.
        accountant: ``rdp`` or ``pld``.
        group_weights: optional |G_p|/N per distinct budget (defaults to the actual counts).
    """
    if method not in METHODS:
        raise InvalidParameterError("method", method, f"must be one of {sorted(METHODS)}")
    q = float(check_sample_rate(sample_rate))
    steps = check_steps(steps)
    c = check_positive(clip_norm, "clip_norm")
    values, counts, inverse = budgets.groups()
    weights = counts / counts.sum() if group_weights is None else np.asarray(group_weights, float)
    problem = _Problem(values, weights, counts, budgets.delta, q, c, steps, accountant)
    sigma, q_p, c_p, sig_eff = METHODS[method](problem)
    eps = np.atleast_1d(epsilon_sgm(q_p, sig_eff, steps, budgets.delta, accountant))
    groups = tuple(GroupParams(float(v), int(n), float(w), float(a), float(b), float(s), float(e))
                   for v, n, w, a, b, s, e in zip(values, counts, weights, q_p, c_p, sig_eff, eps))
    return Assignment(method, accountant, float(sigma), q, c, steps, budgets.delta, groups, inverse)
