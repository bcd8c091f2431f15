"""Differentially private release of aggregates of individual ε (Yu et al. 2023, §3.4).

The per-example ε_i depend on private data.  Two aggregates can be released with their own
privacy cost, each over values clipped to [0, U] (U = the worst-case ε, a public quantity):

* the **mean** by the Gaussian mechanism, calibrated exactly (the analytic Gaussian mechanism,
  Balle & Wang 2018, Thm. 8) for sensitivity U/n (replacing one example changes one value);
* **quantiles** by the exponential mechanism over the sorted values (Smith 2011), pure ε-DP per
  quantile; k quantiles share their budget by basic composition.  (The paper uses the
  gradient-descent method of Andrew et al. 2021; the exponential mechanism is the standard exact
  alternative with a closed-form guarantee.)

As in the paper, the sensitivity argument holds given the released training trajectory: the
other examples' ε_j are post-processing of the trajectory and their own data.  Released numbers
are labelled as released statistics, never mixed with the exact ones.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

from ..validation import InvalidParameterError, check_delta, check_epsilon, check_positive


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Smallest σ with which N(0, σ²) noise gives (ε, δ)-DP for an L2 sensitivity (Balle & Wang 2018)."""
    epsilon, delta = float(check_epsilon(epsilon, "epsilon")), check_delta(delta)
    d = check_positive(sensitivity, "sensitivity")

    def excess(log_sigma):
        s = math.exp(log_sigma)
        return (norm.cdf(d / (2 * s) - epsilon * s / d)
                - math.exp(epsilon) * norm.cdf(-d / (2 * s) - epsilon * s / d)) - delta

    lo, hi = math.log(d) - 20, math.log(d) + 20
    return math.exp(brentq(excess, lo, hi, xtol=1e-12)) * (1 + 1e-9)   # round up: never below


def release_mean(values, upper: float, epsilon: float, delta: float, rng: np.random.Generator) -> dict:
    v = np.clip(np.asarray(values, dtype=float), 0.0, check_positive(upper, "upper"))
    if v.size == 0:
        raise InvalidParameterError("values", "[]", "need at least one value")
    sigma = analytic_gaussian_sigma(epsilon, delta, upper / v.size)
    return {"value": float(v.mean() + rng.normal(0.0, sigma)), "epsilon": float(epsilon), "delta": float(delta),
            "mechanism": "analytic Gaussian (Balle & Wang 2018)", "noise_std": sigma}


def release_quantile(values, upper: float, quantile: float, epsilon: float, rng: np.random.Generator) -> float:
    """One quantile by the exponential mechanism over [0, upper] (Smith 2011): ε-DP."""
    if not 0 <= quantile <= 1:
        raise InvalidParameterError("quantile", quantile, "must be in [0, 1]")
    z = np.concatenate([[0.0], np.sort(np.clip(np.asarray(values, dtype=float), 0.0, upper)), [upper]])
    n = z.size - 2
    widths = np.diff(z)
    with np.errstate(divide="ignore"):
        logw = np.log(widths) - 0.5 * epsilon * np.abs(np.arange(n + 1) - quantile * n)
    if not np.any(np.isfinite(logw)):                     # every value equal to 0 or to upper
        return float(z[int(round(quantile * n))])
    p = np.exp(logw - logw.max())
    i = rng.choice(n + 1, p=p / p.sum())
    return float(rng.uniform(z[i], z[i + 1]))


def release_statistics(values, upper: float, epsilon: float = 0.1, delta: float = 1e-5,
                       quantiles=(0.1, 0.3, 0.5, 0.7, 0.9), seed: int = 0) -> dict:
    """Mean (half of ε, with δ) and quantiles (the other half, split evenly), privately released."""
    check_epsilon(epsilon, "epsilon")
    rng = np.random.default_rng(seed)
    mean = release_mean(values, upper, epsilon / 2, delta, rng)
    each = epsilon / 2 / max(len(quantiles), 1)
    qs = {f"{q:g}": release_quantile(values, upper, q, each, rng) for q in quantiles}
    return {"label": "differentially private released statistics (Yu et al. 2023, sec. 3.4)",
            "clip_range": [0.0, float(upper)], "mean": mean,
            "quantiles": {"values": qs, "epsilon": epsilon / 2, "delta": 0.0,
                          "epsilon_per_quantile": each, "mechanism": "exponential mechanism (Smith 2011)"},
            "total": {"epsilon": float(epsilon), "delta": float(delta)}}
