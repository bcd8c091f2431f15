"""(Φ, Δ)-personalized DP bookkeeping (Heo et al., §2.2, §4; Jorgensen et al. 2015).

A mechanism is (Φ, Δ)-PDP if for every user u_i, neighbouring datasets differing in u_i's record
and every output set S, Pr[M(D) ∈ S] ≤ e^{ε_i} Pr[M(D') ∈ S] + δ_i.

* :func:`sampling_probabilities` — eq. (4): π_i = (e^{ε_i} − 1)/(e^τ − 1) if ε_i < τ, else 1.
* :func:`sampling_guarantee` — Thm. 4.2: running a (τ, δ)-DP algorithm on the π-sample is
  (Φ_τ, Δ)-PDP with ε_{i} = min(ε_i, τ) (a user above the threshold is protected at τ) and
  δ_i = π_i δ.  A user with ε_i ≤ 0 is never sampled and spends nothing.
* :func:`compose` — Thm. 4.3 (sequential, adaptive): ε and δ add up per user.
* Post-processing (Thm. 4.4) needs no code: anything computed from a (Φ, Δ)-PDP output keeps it.
* :func:`irdp_to_pdp` — Thm. 4.8: per-user RDP ρ_i(α) gives ε_i = min_α ρ_i(α) + log(1/δ_i)/(α − 1).
* :func:`threshold_losses` / :func:`select_threshold` — eqs. (6) and (7).
"""
from __future__ import annotations

import numpy as np

from ..validation import InvalidParameterError, check_delta, check_orders


def sampling_probabilities(budgets, tau: float) -> np.ndarray:
    """π_i of eq. (4) (0 for an exhausted budget ε_i ≤ 0)."""
    eps = np.asarray(budgets, dtype=float)
    if not tau > 0:
        raise InvalidParameterError("threshold", tau, "must be > 0")
    pi = np.where(eps < tau, np.expm1(np.maximum(eps, 0.0)) / np.expm1(tau), 1.0)
    return np.where(eps > 0, pi, 0.0)


def sampling_guarantee(budgets, tau: float, delta: float):
    """(ε_i, δ_i) of the sampling mechanism with a (τ, δ)-DP algorithm (Heo et al. Thm. 4.2)."""
    eps = np.asarray(budgets, dtype=float)
    pi = sampling_probabilities(eps, tau)
    spent = np.where(eps > 0, np.minimum(np.maximum(eps, 0.0), tau), 0.0)
    return spent, pi * check_delta(delta)


def compose(guarantees) -> tuple[np.ndarray, np.ndarray]:
    """Sequential composition of per-user (ε, δ) lists (Thm. 4.3): sums per user."""
    guarantees = list(guarantees)
    if not guarantees:
        raise InvalidParameterError("guarantees", "[]", "need at least one (epsilon, delta) pair")
    eps = np.sum([np.asarray(e, float) for e, _ in guarantees], axis=0)
    dl = np.sum([np.asarray(d, float) for _, d in guarantees], axis=0)
    return eps, dl


def irdp_to_pdp(rdp, orders, deltas) -> np.ndarray:
    """ε_i from individual RDP curves ρ_i(α) and per-user δ_i (Thm. 4.8, best order per user)."""
    orders = check_orders(orders)
    rdp = np.atleast_2d(np.asarray(rdp, dtype=float))
    d = np.broadcast_to(np.asarray(deltas, dtype=float), (rdp.shape[0],))
    if np.any((d <= 0) | (d >= 1)):
        raise InvalidParameterError("deltas", d, "every value must be in (0, 1)")
    return np.min(rdp + np.log(1.0 / d)[:, None] / (orders - 1.0), axis=1)


def threshold_losses(budgets, taus, w1: float = 0.7, w2: float = 0.3):
    """(waste_u, waste_s, loss_f, loss_a) of eqs. (6)–(7) for every candidate threshold τ."""
    eps = np.asarray(budgets, dtype=float)
    eps = eps[eps > 0]
    taus = np.atleast_1d(np.asarray(taus, dtype=float))
    below = eps[None, :] < taus[:, None]
    pi = np.expm1(eps)[None, :] / np.expm1(taus)[:, None]
    waste_u = np.sum(np.where(below, eps[None, :] * (1 - pi), 0.0), axis=1)
    waste_s = np.sum(np.where(eps[None, :] > taus[:, None], eps[None, :] - taus[:, None], 0.0), axis=1)
    loss_f = w1 * waste_u + w2 * waste_s
    total = waste_u + waste_s
    loss_a = np.where(total > 0, 2 * waste_u * waste_s / np.where(total > 0, total, 1.0), 0.0)
    return waste_u, waste_s, loss_f, loss_a


def select_threshold(budgets, loss: str = "fixed", w1: float = 0.7, w2: float = 0.3, grid: int = 2001) -> float:
    """τ in [min Φ, max Φ] (positive budgets) minimizing loss_f (``fixed``) or loss_a (``adaptive``).

    The minimum is searched exactly over a fine grid plus every distinct budget (where the
    losses change slope); ties go to the smallest τ.
    """
    if loss not in ("fixed", "adaptive"):
        raise InvalidParameterError("threshold_loss", loss, "must be fixed or adaptive")
    eps = np.asarray(budgets, dtype=float)
    eps = eps[eps > 0]
    if eps.size == 0:
        raise InvalidParameterError("budgets", "all exhausted", "need at least one positive remaining budget")
    lo, hi = float(eps.min()), float(eps.max())
    if hi - lo <= 1e-12 * hi:
        return hi
    cand = np.unique(np.concatenate([np.linspace(lo, hi, grid), np.unique(eps)]))
    _, _, lf, la = threshold_losses(eps, cand, w1, w2)
    values = lf if loss == "fixed" else la
    return float(cand[int(np.argmin(values))])
