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

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..accounting import calibrate_noise_multiplier, calibrate_sample_rate, epsilon_sgm, solve_monotone
from ..accounting.calibration import RTOL, SIGMA_RANGE, sample_rates_rdp
from ..names import FIXED_SIGMA_METHODS as FIXED_SIGMA_METHODS  # re-exported
from ..names import IDP_METHODS
from ..validation import InvalidParameterError, UnreachableTargetError, check_positive, check_sample_rate, check_steps
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
        return {
            "budget": self.budget,
            "count": self.count,
            "fraction": self.fraction,
            "sample_rate": self.sample_rate,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "epsilon": self.epsilon,
        }


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
        return {
            "method": self.method,
            "accountant": self.accountant,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "clip_norm": self.clip_norm,
            "steps": self.steps,
            "delta": self.delta,
            "groups": [g.as_dict() for g in self.groups],
        }


@dataclass(frozen=True)
class _Problem:
    values: np.ndarray  # distinct budgets, ascending
    weights: np.ndarray  # |G_p| / N
    counts: np.ndarray
    delta: float
    q: float
    c: float
    steps: int
    accountant: str


def _uniform(p: _Problem):
    sigma = float(calibrate_noise_multiplier(p.values.min(), p.delta, p.q, p.steps, p.accountant, name="budgets"))
    n = p.values.size
    return sigma, np.full(n, p.q), np.full(n, p.c), np.full(n, sigma)


class _SampleRates:
    """q_p(σ) for every group, remembered per σ so that each new σ is bracketed by its neighbours.

    The rates are solved much tighter (RDP 1e-7, PLD 1e-6) than the mean-rate search (1e-5), so
    the mean rate is a smooth function of σ for that search.
    """

    def _rates(self, sigma, bracket, hint, guess):
        p = self.p
        if p.accountant == "rdp":
            return sample_rates_rdp(
                p.values, p.delta, sigma, p.steps, rtol=1e-7, bracket=bracket, hint=hint, verify=False, x_guess=guess
            )
        rates = calibrate_sample_rate(
            p.values, p.delta, sigma, p.steps, p.accountant, rtol=1e-6, name="budgets", bracket=bracket
        )
        return rates, np.full(p.values.size, -1)

    def __init__(self, p: _Problem, anchors: dict[float, float] | None = None):
        self.p = p
        self.sigmas: list[float] = []
        self.rates: list[np.ndarray] = []
        self.index: list[np.ndarray] = []
        self.anchors: dict[float, float] = dict(anchors or {})  # σ → the budget whose rate at σ is exactly q

    def __call__(self, sigma: float) -> np.ndarray:
        p = self.p
        s = np.asarray(self.sigmas)
        below = np.flatnonzero(s <= sigma)
        above = np.flatnonzero(s >= sigma)
        bracket = hint = guess = None
        if below.size and above.size:  # q_p(σ) increases with σ
            i, j = below[np.argmax(s[below])], above[np.argmin(s[above])]
            bracket = (self.rates[i] * (1 - 1e-6), np.minimum(self.rates[j] * (1 + 1e-3), 1.0))
            hint = self.index[i]
        elif sigma in self.anchors:  # ε grows about linearly in q: a first guess
            guess = np.minimum(p.q * p.values / self.anchors[sigma], 1.0)
        elif self.sigmas:
            near = int(np.argmin(np.abs(np.log(s / sigma))))
            hint, guess = self.index[near], self.rates[near]
        try:
            rates, k = self._rates(sigma, bracket, hint, guess)
        except UnreachableTargetError:
            if bracket is None:
                raise
            rates, k = self._rates(sigma, None, hint, guess)
        self.sigmas.append(float(sigma))
        self.rates.append(np.atleast_1d(rates))
        self.index.append(np.atleast_1d(k))
        return self.rates[-1]


def _sample(p: _Problem):
    """One σ, per-group q_p with Σ_p w_p q_p = q (Boenisch et al. Alg. 1; see the module doc).

    The weighted mean rate m(σ) = Σ_p w_p q_p(σ) increases with σ.  Its search bracket: below,
    σ_lo calibrated for the largest budget at q (every q_p ≤ q, so m ≤ q); above, the smaller of
    σ calibrated for the smallest budget at q (every q_p ≥ q) and σ_cap, at which the largest
    budget is spent at q_p = 1 (beyond it that group would need a rate above 1).  "Unreachable"
    only when m(upper end) < q: then no σ gives the mean rate with every q_p ≤ 1.
    """
    n = p.values.size
    if n == 1:
        return _uniform(p)  # one budget: Sample is standard DP-SGD
    lo = float(calibrate_noise_multiplier(p.values.max(), p.delta, p.q, p.steps, p.accountant, name="budgets"))
    hi = float(calibrate_noise_multiplier(p.values.min(), p.delta, p.q, p.steps, p.accountant, name="budgets"))
    if np.isclose(lo, hi, rtol=1e-12):
        return _uniform(p)
    if p.q < 1:
        try:
            # tight (rtol 1e-8 < the rates' 1e-7): at σ ≤ cap the largest budget's rate is ≤ 1
            cap = float(
                calibrate_noise_multiplier(
                    p.values.max(), p.delta, 1.0, p.steps, p.accountant, rtol=1e-8, name="budgets"
                )
            )
        except UnreachableTargetError:
            cap = SIGMA_RANGE[1]  # the largest budget is not spent even at q = 1 within the σ range
        hi = min(hi, cap)
    rates = _SampleRates(p, anchors={lo: float(p.values.max()), hi: float(p.values.min())})

    def mean_rate(s, idx):
        return np.atleast_1d(p.weights @ rates(float(np.ravel(s)[0])))

    top = float(mean_rate(np.array([hi]), None)[0])
    if top < p.q * (1 - RTOL / 10):
        raise UnreachableTargetError(
            f"sample_rate={p.q:g} is unreachable with method sample: even at noise_multiplier={hi:.6g}, where the "
            f"largest budget ({p.values.max():g}) is spent with sampling rate 1, the groups' weighted mean rate is "
            f"only {top:.6g}; use a smaller sample rate or the scale method"
        )
    sigma = float(
        solve_monotone(
            mean_rate,
            np.array([p.q]),
            lo,
            hi,
            increasing=True,
            rtol=RTOL / 10,
            name="sample_rate",
            what="noise_multiplier",
        )[0]
    )
    if p.accountant == "rdp":  # final rates with the full order search (verified)
        near = rates(sigma)
        try:
            q_p = calibrate_sample_rate(
                p.values,
                p.delta,
                sigma,
                p.steps,
                name="budgets",
                bracket=(near * (1 - 1e-3), np.minimum(near * (1 + 1e-3), 1.0)),
            )
        except UnreachableTargetError:
            q_p = calibrate_sample_rate(p.values, p.delta, sigma, p.steps, name="budgets")
        q_p = np.atleast_1d(q_p)
    else:
        q_p = rates(sigma)
    return sigma, q_p, np.full(n, p.c), np.full(n, sigma)


def _scale(p: _Problem):
    sig_p = np.atleast_1d(calibrate_noise_multiplier(p.values, p.delta, p.q, p.steps, p.accountant, name="budgets"))
    sigma_scale = float(1.0 / np.sum(p.weights / sig_p))  # App. C.2, eq. (10)
    c_p = p.c * sigma_scale / sig_p
    return sigma_scale, np.full(p.values.size, p.q), c_p, sig_p


#: Each IDP method's calibration, keyed by its name (:data:`idpsgd.names.IDP_METHODS`).
METHODS: dict[str, Callable[[_Problem], tuple]] = dict(zip(IDP_METHODS, (_uniform, _sample, _scale), strict=True))

#: A group whose examples are expected to be sampled fewer times than FEW_DRAWS over the whole plan
#: (q_p × planned steps) and at a rate below SPARSE_RATIO × the mean rate barely trains while the
#: others do: :func:`assign` warns (Sample with a wide spread of budgets gives the strictest group
#: q_p ≈ 0; Boenisch et al. §3.3).
FEW_DRAWS = 1.0
SPARSE_RATIO = 0.1


class SparseSamplingWarning(UserWarning):
    """Some privacy group's examples are expected to be sampled less than once in the whole run,
    far less often than the average example."""


def sparse_sampling(assignment: Assignment) -> str | None:
    """The warning text when some group's examples are expected to be sampled fewer than
    :data:`FEW_DRAWS` times over the planned steps and at a rate below :data:`SPARSE_RATIO` × the
    mean rate (the expected count q_p × steps of every group is listed), else None.  Public values
    only: budgets, rates and the planned steps."""
    draws = [(g.budget, g.sample_rate * assignment.steps) for g in assignment.groups]
    few = [
        g.budget
        for g in assignment.groups
        if g.sample_rate * assignment.steps < FEW_DRAWS and g.sample_rate < SPARSE_RATIO * assignment.sample_rate
    ]
    if not few:
        return None
    shown = draws if len(draws) <= 10 else [(b, d) for b, d in draws if b in few][:10]
    table = ", ".join(f"budget {b:g}: {d:.3g}" for b, d in shown) + (
        ""
        if len(draws) <= 10
        else f"{', ...' if len(few) > 10 else ''}; the other groups "
        f"{min(d for b, d in draws if b not in few):.3g} to {max(d for _, d in draws):.3g}"
    )
    return (
        f"method {assignment.method}: the examples of budget(s) {', '.join(f'{b:g}' for b in few)} are expected "
        f"to be sampled fewer than {FEW_DRAWS:g} time(s) in the {assignment.steps} planned steps, less than "
        f"{SPARSE_RATIO:g} x as often as the average example, so they barely train (expected times each example "
        f"is sampled, q_p x steps: {table}); use method 'scale' (every group sampled at the mean rate, clip norms "
        "per group) or a narrower spread of budgets"
    )


def assign(
    budgets: Budgets,
    method: str,
    sample_rate: float,
    steps: int,
    clip_norm: float,
    accountant: str = "rdp",
    group_weights=None,
) -> Assignment:
    """Derive an :class:`Assignment` for ``budgets`` with the named method.

    Warns :class:`SparseSamplingWarning` when a group's examples are expected to be sampled less
    than once in the planned steps (:func:`sparse_sampling`).

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
    groups = tuple(
        GroupParams(float(v), int(n), float(w), float(a), float(b), float(s), float(e))
        for v, n, w, a, b, s, e in zip(values, counts, weights, q_p, c_p, sig_eff, eps, strict=True)
    )
    out = Assignment(method, accountant, float(sigma), q, c, steps, budgets.delta, groups, inverse)
    note = sparse_sampling(out)
    if note:
        warnings.warn(note, SparseSamplingWarning, stacklevel=2)
    return out


def assign_for_noise_multiplier(
    budgets: Budgets,
    method: str,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    clip_norm: float,
    accountant: str = "rdp",
) -> Assignment:
    """Per-group parameters for a **given** σ (Opacus's ``make_private(noise_multiplier=...)`` with budgets).

    * ``sample``: each group's sampling rate q_p is solved so that ``steps`` steps at σ spend its
      budget (ε in [(1 − 1e-4)·budget, budget]); the clip norm is ``clip_norm`` for all.  The mean
      rate is then what the budgets give (not ``sample_rate``): σ is fixed, so it cannot also be
      held.  A group whose budget is not spent even at q_p = 1 is sampled at rate 1 and spends less
      (warned, with its ε).
    * ``scale``: every group is sampled at ``sample_rate``; each group's effective noise multiplier
      σ_p is solved for its budget and its clip norm is c_p = c·σ/σ_p (the noise std σ·c is the
      same for all, so group p meets σ·c/c_p = σ_p).

    ``uniform`` (every example at the smallest budget) has nothing to solve per group: calibrate σ
    with ``make_private_with_epsilon`` instead.
    """
    if method not in FIXED_SIGMA_METHODS:
        raise InvalidParameterError(
            "method",
            method,
            f"with noise_multiplier must be one of {', '.join(FIXED_SIGMA_METHODS)} (each group's sampling rate or "
            "clip norm is solved for its budget at that sigma); for uniform, calibrate sigma to the smallest budget "
            "with make_private_with_epsilon(budgets=..., method='uniform', epochs=...)",
        )
    q = float(check_sample_rate(sample_rate))
    steps = check_steps(steps)
    c = check_positive(clip_norm, "max_grad_norm")
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    values, counts, inverse = budgets.groups()
    weights = counts / counts.sum()
    n = values.size
    if method == "sample":
        at_one = np.atleast_1d(epsilon_sgm(np.ones(n), np.full(n, sigma), steps, budgets.delta, accountant))
        full = at_one <= values
        q_p = np.ones(n)
        if np.any(~full):
            q_p[~full] = np.atleast_1d(
                calibrate_sample_rate(values[~full], budgets.delta, sigma, steps, accountant, name="budgets")
            )
        if np.any(full):
            shown = ", ".join(f"budget {v:g}: epsilon {e:.4g}" for v, e in zip(values[full], at_one[full], strict=True))
            warnings.warn(
                f"method sample with noise_multiplier={sigma:g} and {steps} steps: even sampled at rate 1 (every "
                f"example in every batch) these groups spend less than their budgets ({shown}); a smaller "
                "noise_multiplier or more steps would use them",
                UserWarning,
                stacklevel=3,
            )
        c_p, sig_eff = np.full(n, c), np.full(n, sigma)
    else:
        sig_eff = np.atleast_1d(calibrate_noise_multiplier(values, budgets.delta, q, steps, accountant, name="budgets"))
        q_p, c_p = np.full(n, q), c * sigma / sig_eff
    eps = np.atleast_1d(epsilon_sgm(q_p, sig_eff, steps, budgets.delta, accountant))
    groups = tuple(
        GroupParams(float(v), int(k), float(w), float(a), float(b), float(s), float(e))
        for v, k, w, a, b, s, e in zip(values, counts, weights, q_p, c_p, sig_eff, eps, strict=True)
    )
    mean_q = float(weights @ q_p)
    out = Assignment(method, accountant, float(sigma), mean_q, c, steps, budgets.delta, groups, inverse)
    note = sparse_sampling(out)
    if note:
        warnings.warn(note, SparseSamplingWarning, stacklevel=3)
    return out
