"""RDP → (ε, δ) and ε → δ, vectorized over rows (examples).

Improved conversion of Balle et al. 2020 ("Hypothesis testing interpretations and Rényi DP",
Thm. 21) / Canonne, Kamath & Steinke 2020 (Prop. 12): for each order α,

    ε(α) = r(α) + log(1 − 1/α) − (log δ + log α)/(α − 1),

and ε = min_α ε(α).  As in dp_accounting, the KL bound δ ≥ sqrt(1 − e^{−r}) (r ≥ KL since Rényi
divergences grow with α) gives ε = 0 when it applies.  The reverse direction is

    log δ(α) = (α − 1)(r(α) − ε + log(1 − 1/α)) − log α,  δ = min(1, min_α δ(α), sqrt(1 − e^{−r})).
"""

from __future__ import annotations

import numpy as np

from ..validation import check_delta, check_orders, shown_value


def _prepare(rdp, orders):
    alphas = check_orders(orders)
    r = np.asarray(rdp, dtype=float)
    if r.shape[-1] != alphas.size:
        raise ValueError(f"rdp has {r.shape[-1]} orders in its last axis but orders has {alphas.size}")
    if np.any(r < 0) or np.any(np.isnan(r)):
        raise ValueError("rdp values must be >= 0 (and not NaN)")
    return r, alphas


def rdp_to_epsilon(rdp, orders, delta: float):
    """Smallest ε over the orders for each row of ``rdp`` (shape ``(..., len(orders))``).

    Returns ``(epsilon, best_order)``, each of shape ``rdp.shape[:-1]``.
    """
    delta = check_delta(delta)
    r, alphas = _prepare(rdp, orders)
    with np.errstate(over="ignore", invalid="ignore"):
        eps = r + np.log1p(-1.0 / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1)
        eps = np.where(delta**2 + np.expm1(-r) > 0, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = np.argmin(eps, axis=-1)
    eps_min = np.take_along_axis(eps, best[..., None], axis=-1)[..., 0]
    return np.maximum(eps_min, 0.0), alphas[best]


def rdp_to_delta(rdp, orders, epsilon: float):
    """Smallest δ over the orders for each row at a given ε ≥ 0. Returns ``(delta, best_order)``."""
    eps = float(epsilon)
    if not eps >= 0:
        raise ValueError(f"epsilon={shown_value(epsilon)} is invalid: must be >= 0")
    r, alphas = _prepare(rdp, orders)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        log_delta = (alphas - 1) * (r - eps + np.log1p(-1.0 / alphas)) - np.log(alphas)
        kl = np.where(r == 0, -np.inf, 0.5 * np.log1p(-np.exp(-r)))
        log_delta = np.minimum(log_delta, kl)
    log_delta = np.where(np.isnan(log_delta), 0.0, log_delta)
    best = np.argmin(log_delta, axis=-1)
    ld = np.take_along_axis(log_delta, best[..., None], axis=-1)[..., 0]
    return np.minimum(np.exp(ld), 1.0), alphas[best]
