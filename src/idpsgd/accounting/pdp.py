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
* :func:`threshold_losses` / :func:`select_threshold` — eqs. (6) and (7); :func:`adaptive_threshold`
  is our reading of eq. (7) (the AM–GM equality point waste_u = waste_s).
* :func:`calibrate_round_noise` / :func:`history_guarantee` — Alg. 4 (σ on the composed accountant
  history, within the cumulative thresholds) and the per-user guarantee that reading gives.
"""

from __future__ import annotations

import numpy as np

from ..validation import InvalidParameterError, check_delta, check_orders

THRESHOLD_LOSSES = ("fixed", "adaptive")


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
    """(waste_u, waste_s, loss_f, loss_a) of eqs. (6)–(7) for every candidate threshold τ.

    ``loss_a`` is eq. (7) as printed, 2·waste_u·waste_s/(waste_u + waste_s): the AM–GM lower bound
    of the adaptively weighted loss (see :func:`adaptive_threshold`), not the loss itself.
    """
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


def adaptive_weighted_loss(budgets, taus) -> np.ndarray:
    """w1·waste_u + w2·waste_s with the adaptive weights of eq. (7), w1 = waste_u/(waste_u + waste_s),
    w2 = waste_s/(waste_u + waste_s): (waste_u² + waste_s²)/(waste_u + waste_s)."""
    wu, ws, _, _ = threshold_losses(budgets, taus)
    total = wu + ws
    return np.where(total > 0, (wu**2 + ws**2) / np.where(total > 0, total, 1.0), 0.0)


def adaptive_threshold(budgets) -> float:
    """τ of the adaptive loss (Heo et al. eq. 7): the AM–GM equality point waste_u(τ) = waste_s(τ).

    Our reading.  With the adaptive weights w1 = waste_u/(waste_u + waste_s) and w2 = waste_s/(...),
    the weighted loss is L_a = w1·waste_u + w2·waste_s, and AM–GM gives
    L_a ≥ 2·√(w1·w2·waste_u·waste_s) = 2·waste_u·waste_s/(waste_u + waste_s), eq. (7)'s expression,
    with equality iff w1·waste_u = w2·waste_s, i.e. iff waste_u = waste_s.  The paper picks τ "based
    on the AM–GM equality condition between the two types of wastes" and says the result is only
    an approximate minimum (of L_a) "because the lower bound is not a constant" — so τ_a is the
    point where the bound is attained: waste_u = waste_s.  (Minimising eq. (7)'s expression
    literally is degenerate: it is 0 at both ends of [min Φ, max Φ], where one waste vanishes, so
    every round would train everyone at the smallest remaining budget.)

    waste_u is continuous and increasing in τ from 0 at min Φ, waste_s continuous and decreasing to
    0 at max Φ, so the crossing is unique and strictly inside (min Φ, max Φ) whenever the budgets
    are not all equal.  On App. C.1's distributions (range [0.5, 1]) it lies within 0.006 of
    L_a's own minimiser.
    """
    from scipy.optimize import brentq

    eps = np.asarray(budgets, dtype=float)
    eps = eps[eps > 0]
    if eps.size == 0:
        raise InvalidParameterError("budgets", "all exhausted", "need at least one positive remaining budget")
    lo, hi = float(eps.min()), float(eps.max())
    if hi - lo <= 1e-12 * hi:
        return hi

    def gap(t):
        wu, ws, _, _ = threshold_losses(eps, [t])
        return float(wu[0] - ws[0])

    return float(brentq(gap, lo, hi, xtol=1e-12 * hi, rtol=1e-12))


def select_threshold(budgets, loss: str = "fixed", w1: float = 0.7, w2: float = 0.3, grid: int = 2001) -> float:
    """τ in [min Φ, max Φ] (positive budgets): the minimiser of loss_f (``fixed``, eq. 6) or the
    adaptive threshold (``adaptive``, eq. 7; :func:`adaptive_threshold`).

    loss_f is searched exactly over a fine grid plus every distinct budget (where the losses
    change slope); ties go to the smallest τ.
    """
    if loss not in THRESHOLD_LOSSES:
        raise InvalidParameterError("threshold_loss", loss, "must be fixed or adaptive")
    if not 0 <= float(w1) <= 1 or not 0 <= float(w2) <= 1:
        raise InvalidParameterError("w1", w1, "must be in [0, 1] (w2 = 1 - w1)")
    eps = np.asarray(budgets, dtype=float)
    eps = eps[eps > 0]
    if eps.size == 0:
        raise InvalidParameterError("budgets", "all exhausted", "need at least one positive remaining budget")
    if loss == "adaptive":
        return adaptive_threshold(eps)
    lo, hi = float(eps.min()), float(eps.max())
    if hi - lo <= 1e-12 * hi:
        return hi
    cand = np.unique(np.concatenate([np.linspace(lo, hi, grid), np.unique(eps)]))
    _, _, lf, _ = threshold_losses(eps, cand, w1, w2)
    return float(cand[int(np.argmin(lf))])


# --- Alg. 4 (noise history) -------------------------------------------------------------------
def composed_epsilon(events, delta: float, accountant: str = "rdp") -> float:
    """ε at ``delta`` of the composition of ``events`` (a list of SampledGaussianEvent)."""
    from .accountants import get_accountant

    return float(get_accountant(accountant)(list(events), delta)) if events else 0.0


def calibrate_round_noise(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp", history=()
) -> float:
    """σ of one PDP round: ``steps`` SGM steps at rate q, composed after ``history``, spend ε ≤ target.

    Without history this is :func:`~idpsgd.accounting.calibrate_noise_multiplier`.  With history
    (Heo et al. Alg. 4, our reading, see :func:`history_guarantee`) the target is for the
    composition of the earlier rounds' events and this round's.  The target must lie above what
    the history alone already spends (σ → ∞ adds nothing): otherwise
    :class:`~idpsgd.validation.UnreachableTargetError` names the target and what is reachable;
    the bracket's end is never returned.
    """
    from ..validation import UnreachableTargetError, check_epsilon
    from .calibration import SIGMA_RANGE, calibrate_noise_multiplier, solve_monotone
    from .events import SampledGaussianEvent

    history = list(history or ())
    if not history:
        return float(calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant))
    target = float(check_epsilon(target_epsilon, "target_epsilon"))
    check_delta(delta)
    q = float(sample_rate)

    def eps(s):
        return composed_epsilon([*history, SampledGaussianEvent(q, float(s), int(steps))], delta, accountant)

    lo, hi = SIGMA_RANGE
    if accountant != "rdp":  # PLD is tighter than RDP: its σ lies below RDP's; bracket there (PLD grids stay small)
        hi = calibrate_round_noise(target, delta, q, steps, "rdp", history)
        lo = max(hi / 4, lo)
    e_hi, e_lo = eps(lo), eps(hi)
    if not e_lo <= target <= e_hi:
        spent = composed_epsilon(history, delta, accountant)
        raise UnreachableTargetError(
            f"target_epsilon={target!r} is unreachable for the composed history: the earlier rounds already "
            f"spend {spent:.6g} and with noise_multiplier in [{lo:g}, {hi:g}] the reachable epsilon is "
            f"[{e_lo:.6g}, {e_hi:.6g}]"
        )
    sigma = solve_monotone(
        lambda x, idx: np.array([eps(v) for v in np.ravel(x)]),
        np.array([target]),
        lo,
        hi,
        increasing=False,
        name="target_epsilon",
        what="noise_multiplier",
    )
    return float(np.ravel(sigma)[0])


def history_guarantee(pi_rounds, composed_epsilons, delta: float):
    """Per-user (ε_i, δ_i) of R rounds calibrated on the composed history (Alg. 4, our reading).

    Round R's DP-SGD is calibrated so that the composition of rounds 1..R is (E_R, δ)-DP, with
    E_R ≤ τ_1 + … + τ_R (the cumulative thresholds); a round alone need not be (τ_R, δ)-DP, so
    Thm. 4.2 does not apply per round.  Instead, for user i let S be the (secret, independent)
    set of rounds whose sample contains i, Pr[R ∈ S] = π_{i,R}.  Given S the transcript differs
    from the one without i only in the rounds of S, and the composition over S is dominated by the
    composition over 1..max S, so it is (E_{max S}, δ)-DP in both directions.  Mixing over S as in
    the proof of Thm. 4.2 (D.1 i and ii, with Jensen for the reverse direction) gives

        ε_i = ln Σ_m P_i(max S = m) e^{E_m},   δ_i = P_i(S ≠ ∅) δ ≤ δ,

    with E_0 = 0 and P_i(max S = m) = π_{i,m} Π_{r>m} (1 − π_{i,r}).  With the eq. (4) rates on the
    remaining budgets, a user is sampled surely until the round that exhausts it, so with
    E_m = τ_1 + … + τ_m this is exactly Σ_R min(b_{i,R}, τ_R) ≤ ε_i; the accountant's E_m are
    smaller, so the guarantee stays within every budget.

    Args:
        pi_rounds: (rounds, users) sampling probabilities π_{i,R}.
        composed_epsilons: (rounds,) E_R, ε of the composition of rounds 1..R at ``delta``.
        delta: the δ every composed history was calibrated at.
    """
    pi = np.atleast_2d(np.asarray(pi_rounds, dtype=float))
    e = np.asarray(composed_epsilons, dtype=float).ravel()
    if e.size != pi.shape[0]:
        raise InvalidParameterError("composed_epsilons", e.size, f"need one per round ({pi.shape[0]})")
    if np.any(np.diff(e) < -1e-12) or np.any(e < 0):
        raise InvalidParameterError("composed_epsilons", e.tolist(), "must be >= 0 and non-decreasing")
    check_delta(delta)
    rounds = pi.shape[0]
    log_none_after = np.zeros_like(pi)  # ln Π_{r>m} (1 − π_r)
    with np.errstate(divide="ignore"):
        log_miss = np.log1p(-np.minimum(pi, 1.0))
    for m in range(rounds - 2, -1, -1):
        log_none_after[m] = log_none_after[m + 1] + log_miss[m + 1]
    with np.errstate(divide="ignore"):
        log_last = np.log(pi) + log_none_after  # ln P(max S = m)
        log_never = log_none_after[0] + log_miss[0]  # ln P(S = ∅)
    terms = np.vstack([log_never[None, :], log_last + e[:, None]])
    eps_i = np.logaddexp.reduce(terms, axis=0)
    eps_i = np.maximum(eps_i, 0.0)
    delta_i = -np.expm1(log_never) * delta
    return eps_i, delta_i
