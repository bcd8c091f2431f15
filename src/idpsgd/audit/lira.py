"""The Likelihood Ratio Attack (LiRA; Carlini et al. 2022, "Membership inference attacks from first
principles", §IV and Alg. 1) and the loss-threshold attack (Yeom et al. 2018), on score matrices
(numpy only; the models are trained by :mod:`idpsgd.audit.shadows`).

Every model k is summarised by its logit-scaled confidence φ_k(x) = log(p/(1 − p)) of the true
class, p = softmax(f_k(x))_y (Carlini et al. §IV: "logit scaling"; computed stably from the
logits as z_y − logsumexp_{y' ≠ y} z_{y'}), and by its cross-entropy loss.  With ``shadow_phi``
of shape (M, N) and ``shadow_in`` (M, N) saying which shadow trained on which example:

* **online LiRA** (Alg. 1): per example, Gaussians N(μ_in, σ²_in) over the shadows that trained
  on it and N(μ_out, σ²_out) over those that did not; the score of the target's φ is the log
  likelihood ratio log N(φ; μ_in, σ²_in) − log N(φ; μ_out, σ²_out);
* **offline LiRA** (the one-sided test without in-models): Λ = 1 − P[Z > φ] = P[Z ≤ φ] with
  Z ~ N(μ_out, σ²_out); the score is log Λ;
* **variance** — ``per-example`` (each example's own σ²_in, σ²_out, unbiased) or ``fixed``
  (Carlini et al.'s global variance for few shadow models: σ²_in and σ²_out pooled over all
  examples from the within-example residuals);
* **loss** — the loss-threshold baseline (Yeom et al.): score = −loss on the target.

Higher scores mean "more likely a member" for every attack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from ..validation import InvalidParameterError

MODES = ("online", "offline")
VARIANCES = ("fixed", "per-example")
ATTACKS = ("lira-online", "lira-offline", "loss")


def min_shadow_models(variance: str) -> int:
    """Fewest shadow models a LiRA audit runs with: every example must be in ≥ 2 and out of ≥ 2
    shadows (≥ 3 each for per-example variances) so that the leave-one-out fits, which choose the
    thresholds without the target and leave two shadows out per example
    (:func:`leave_one_out_partners`), still have an in- and an out-estimate (two of each for a
    per-example variance) for every example."""
    return 4 if variance == "fixed" else 6


def check_lira(mode: str, variance: str, shadow_models: int) -> None:
    if mode not in MODES:
        raise InvalidParameterError("lira_mode", mode, f"must be one of {', '.join(MODES)}")
    if variance not in VARIANCES:
        raise InvalidParameterError("lira_variance", variance, f"must be one of {', '.join(VARIANCES)}")
    need = min_shadow_models(variance)
    if isinstance(shadow_models, bool) or int(shadow_models) != shadow_models or shadow_models < need:
        raise InvalidParameterError(
            "shadow_models",
            shadow_models,
            f"must be an integer >= {need} for LiRA with "
            f"{variance} variance (every example in and out of at least {need // 2} shadow "
            "models, so that the leave-one-out fits that choose the thresholds keep "
            f"{'two' if variance == 'per-example' else 'an'} in- and out-model(s) for every "
            "example)",
        )


def shadow_design(num_models: int, num_examples: int, rng: np.random.Generator) -> np.ndarray:
    """Which shadow trains on which example, (M, N) bool: every example in exactly ⌊M/2⌋ shadows,
    chosen at random (Carlini et al.'s design: each model gets about half the data)."""
    keys = rng.random((num_models, num_examples))
    return keys.argsort(0).argsort(0) < num_models // 2


def logit_confidence(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """φ = log(p_y/(1 − p_y)) = z_y − logsumexp_{y'≠y} z_{y'} (no cancellation for p_y near 1)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    rows = np.arange(z.shape[0])
    zy = z[rows, y]
    others = z.copy()
    others[rows, y] = -np.inf
    return zy - _logsumexp(others)


def _logsumexp(z):
    top = z.max(axis=1)
    return top + np.log(np.exp(z - top[:, None]).sum(axis=1))


@dataclass(frozen=True)
class GaussianFits:
    """Per-example in/out means and standard deviations, (..., N)."""

    mu_in: np.ndarray
    sd_in: np.ndarray
    mu_out: np.ndarray
    sd_out: np.ndarray


def _moments(phi, mask):
    """Sum, sum of squares and count over the models (axis 0) where ``mask``."""
    w = mask.astype(np.float64)
    return (w * phi).sum(0), (w * phi * phi).sum(0), w.sum(0)


def _fit(s, q, n, variance: str, axis_examples: int = -1):
    """Mean and sd from sums (s), sums of squares (q) and counts (n), arrays (..., N)."""
    mu = s / n
    ss = np.maximum(q - n * mu * mu, 0.0)  # within-example sum of squared residuals
    if variance == "per-example":
        sd = np.sqrt(ss / (n - 1))
    else:  # pooled over the examples: Σ_i SS_i / Σ_i (n_i − 1)
        dof = (n - 1).sum(axis=axis_examples, keepdims=True)
        sd = np.broadcast_to(np.sqrt(ss.sum(axis=axis_examples, keepdims=True) / dof), mu.shape)
    return mu, np.maximum(sd, 1e-6)


def fit_gaussians(shadow_phi: np.ndarray, shadow_in: np.ndarray, variance: str = "fixed") -> GaussianFits:
    """In/out Gaussians of every example over all the shadow models."""
    phi, inn = np.asarray(shadow_phi, np.float64), np.asarray(shadow_in, bool)
    s_in, q_in, n_in = _moments(phi, inn)
    s_out, q_out, n_out = _moments(phi, ~inn)
    _need(n_in, n_out, variance)
    mu_in, sd_in = _fit(s_in, q_in, n_in, variance)
    mu_out, sd_out = _fit(s_out, q_out, n_out, variance)
    return GaussianFits(mu_in, sd_in, mu_out, sd_out)


def leave_one_out_partners(shadow_in: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For every shadow j and example i, a second shadow to leave out with j, (M, N): a random
    out-model of i when j trained on i, a random in-model otherwise.

    Then every leave-one-out fit of shadow j rests on ⌊M/2⌋ − 1 in- and ⌈M/2⌉ − 1 out-models for
    members and non-members of j alike, the same imbalance as the target's fits (⌊M/2⌋ in,
    ⌈M/2⌉ out).  Without it, j's members would have one in-model fewer than its non-members, and
    the noisier in-mean lowers the members' online scores by (1/(n−1) − 1/n)·σ²/(2σ²) on average:
    a bias against membership in the thresholds' selection data.
    """
    inn = np.asarray(shadow_in, bool)
    m, n = inn.shape
    per = inn.sum(0)
    if per.min() != per.max():
        raise InvalidParameterError(
            "shadow_in",
            f"{per.min()}..{per.max()} in-models per example",
            "leave-one-out needs a balanced design (every example in the same number of "
            "shadow models; lira.shadow_design)",
        )
    a = int(per[0])
    order = np.argsort(~inn, axis=0, kind="stable")  # rows: the in-models of each example, then the out
    in_idx, out_idx = order[:a], order[a:]  # (a, N), (M − a, N)
    cols = np.arange(n)
    pick_in = in_idx[rng.integers(0, a, size=(m, n)), cols]
    pick_out = out_idx[rng.integers(0, m - a, size=(m, n)), cols]
    return np.where(inn, pick_out, pick_in)


def fit_gaussians_leave_one_out(
    shadow_phi: np.ndarray, shadow_in: np.ndarray, variance: str = "fixed", partners: np.ndarray | None = None
) -> GaussianFits:
    """For every shadow j, the fits over the other shadows (without ``partners[j, i]`` as well, if
    given: :func:`leave_one_out_partners`): arrays (M, N), vectorized.  With ``fixed`` variance the
    means are left-out, the two global variances those of all the shadows (they pool every example
    of every shadow: one model's share in them is negligible, and none of it is the target's)."""
    phi, inn = np.asarray(shadow_phi, np.float64), np.asarray(shadow_in, bool)
    s_in, q_in, n_in = _moments(phi, inn)
    s_out, q_out, n_out = _moments(phi, ~inn)
    cols = np.arange(phi.shape[1])
    drops = [(phi, inn)]
    if partners is not None:
        drops.append((phi[partners, cols], inn[partners, cols]))
    full = phi.shape
    ls_in, lq_in, ln_in = (np.broadcast_to(x, full).copy() for x in (s_in, q_in, n_in))
    ls_out, lq_out, ln_out = (np.broadcast_to(x, full).copy() for x in (s_out, q_out, n_out))
    for p, i in drops:
        w_in, w_out = i.astype(np.float64), (~i).astype(np.float64)
        ls_in, lq_in, ln_in = ls_in - w_in * p, lq_in - w_in * p * p, ln_in - w_in
        ls_out, lq_out, ln_out = ls_out - w_out * p, lq_out - w_out * p * p, ln_out - w_out
    _need(ln_in, ln_out, "per-example" if variance == "per-example" else "means")
    if variance == "per-example":
        mu_in, sd_in = _fit(ls_in, lq_in, ln_in, variance)
        mu_out, sd_out = _fit(ls_out, lq_out, ln_out, variance)
        return GaussianFits(mu_in, sd_in, mu_out, sd_out)
    full = fit_gaussians(phi, inn, "fixed")  # the global variances of all the shadows
    return GaussianFits(
        ls_in / ln_in, np.broadcast_to(full.sd_in, phi.shape), ls_out / ln_out, np.broadcast_to(full.sd_out, phi.shape)
    )


def _need(n_in, n_out, variance):
    least = 2 if variance == "per-example" else 1  # "fixed" (pooled variances) or "means" (means only)
    if n_in.min() < least or n_out.min() < least:
        raise InvalidParameterError(
            "shadow_models",
            f"{int(n_in.min())} in / {int(n_out.min())} out for some example",
            f"LiRA needs at least {least} in- and out-model(s) per example here (use more shadow models)",
        )
    if variance == "fixed" and ((n_in - 1).sum() < 1 or (n_out - 1).sum() < 1):
        raise InvalidParameterError(
            "shadow_models", "too few", "the pooled variance needs an example with two in- and two out-models"
        )


def lira_scores(phi: np.ndarray, fits: GaussianFits, mode: str = "online") -> np.ndarray:
    """LiRA membership scores of observed φ (same shape as the fits' arrays)."""
    phi = np.asarray(phi, np.float64)
    if mode == "online":
        return stats.norm.logpdf(phi, fits.mu_in, fits.sd_in) - stats.norm.logpdf(phi, fits.mu_out, fits.sd_out)
    if mode == "offline":
        return stats.norm.logcdf((phi - fits.mu_out) / fits.sd_out)
    raise InvalidParameterError("lira_mode", mode, f"must be one of {', '.join(MODES)}")


def attack_scores(target_phi, target_loss, shadow_phi, shadow_in, variance: str = "fixed") -> dict:
    """Scores of every attack on the target (N,), fitted on all the shadows."""
    fits = fit_gaussians(shadow_phi, shadow_in, variance)
    return {
        "lira-online": lira_scores(target_phi, fits, "online"),
        "lira-offline": lira_scores(target_phi, fits, "offline"),
        "loss": -np.asarray(target_loss, np.float64),
    }


def leave_one_out_scores(
    shadow_phi, shadow_loss, shadow_in, variance: str = "fixed", rng: np.random.Generator | None = None
) -> dict:
    """Scores of every attack on every shadow j (M, N), with the fits of the other shadows (less one
    partner per example, :func:`leave_one_out_partners`): data independent of the target's
    membership, distributed like the target's scores, for choosing thresholds."""
    rng = rng if rng is not None else np.random.default_rng(0)
    fits = fit_gaussians_leave_one_out(shadow_phi, shadow_in, variance, leave_one_out_partners(shadow_in, rng))
    return {
        "lira-online": lira_scores(shadow_phi, fits, "online"),
        "lira-offline": lira_scores(shadow_phi, fits, "offline"),
        "loss": -np.asarray(shadow_loss, np.float64),
    }
