"""Per-instance Rényi DP of DP-SGD (Thudi et al., "Gradients look alike", §3.1–3.2, §5.4): the maths.

Per-instance DP bounds the distinguishability of training on X and on X' = X ∪ {x*} for one
point x* and one dataset X — the distribution over training runs, not one trajectory.  This module
owns the theorems as numpy functions: the per-step bound of the sum rule (Thm. 3.2,
:func:`sum_rule_step_rdp`, at real orders) and of any rule from sampled mini-batches (Thm. 3.6,
:func:`mean_rule_bound`), their Hölder composition over the steps (Thm. 3.3, Fact 3.4:
:func:`composition_orders`, :func:`composition_bound`), the data-independent comparisons
(:func:`same_composition_rdp`, :func:`best_order`), Hoeffding's run counts and confidence upper
bounds (Fact 3.5), Corollary 3.1 and §5.4's unlearning decisions (:func:`npiu_decisions`).
Values estimated from finitely many runs are **estimates** of the theorems' expectations and are
labelled so.  The runs themselves: :mod:`idpsgd.training.per_instance`; user guide:
``docs/per-instance.md``.
"""

from __future__ import annotations

import math

import numpy as np

from ..validation import InvalidParameterError, check_delta, check_sample_rate
from .rdp import compute_rdp, logsumexp


def _check_int_order(alpha) -> int:
    a = float(alpha)
    if a != int(a) or a < 2:
        raise InvalidParameterError("alpha", alpha, "must be an integer >= 2 (Thm. 3.2/3.6 use integer orders)")
    return int(a)


def _check_order(alpha) -> float:
    a = float(alpha)
    if not (a > 1 and math.isfinite(a)):
        raise InvalidParameterError("alpha", alpha, "must be a Rényi order > 1")
    return a


def sum_rule_step_rdp(sample_rate, sensitivity, noise_std: float, alpha) -> np.ndarray:
    """Thm. 3.2 at order ``alpha`` (any real α > 1) for arrays of (q, ‖g(x*)‖) with noise std
    ``noise_std``: a bound on both per-step divergences D_α(M(X')‖M(X)) and D_α(M(X)‖M(X')) — our
    exact SGM RDP with effective noise multiplier σ/‖g(x*)‖.

    **Real orders.**  The paper states Thm. 3.2 for integer α; the proof's reduction holds at every
    real α > 1.  For the sum rule, M(X') = Σ_B P(B)[(1−q)N(U(B), σ²) + q N(U(B)+g, σ²)] and
    M(X) = Σ_B P(B) N(U(B), σ²) with the same batch distribution (Poisson sampling).  (P, Q) ↦
    ∫P^α Q^{1−α} is jointly convex, so both divergences are at most the largest over B of the
    divergence between (1−q)N(0, σ²) + qN(g, σ²) and N(0, σ²) (translation invariance), which is
    the sampled Gaussian mechanism's RDP with noise multiplier σ/‖g‖ (Mironov et al. 2019 §3.3 at
    real orders; their Thm. 5 for the order of the two mixtures)."""
    a = _check_order(alpha)
    s = np.asarray(sensitivity, dtype=float)
    if np.any(s < 0):
        raise InvalidParameterError("sensitivity", s, "every value must be >= 0")
    with np.errstate(divide="ignore"):
        sigma_eff = np.where(s > 0, noise_std / np.where(s > 0, s, 1.0), np.inf)
    q = np.broadcast_to(np.asarray(sample_rate, dtype=float), s.shape)
    return compute_rdp(q.ravel(), sigma_eff.ravel(), [float(a)])[:, 0].reshape(s.shape)


#: Sensitivity grid of :class:`SumRuleTable`: relative spacing below ``_GRID_SPLIT``·C, absolute above.
_GRID_RELATIVE, _GRID_ABSOLUTE, _GRID_SPLIT, _GRID_LOWEST = 0.005, 5e-4, 0.5, 1e-6


class SumRuleTable:
    """Thm. 3.2 for many measured sensitivities: each ‖g(x*)‖ ∈ [0, C] is rounded **up** to a grid and the
    per-step RDP is evaluated once per (grid point, order) and cached.

    The sampled Gaussian's RDP grows with the sensitivity, so rounding up keeps every value an upper
    bound of Thm. 3.2 at the measured sensitivity (a valid input to Thm. 3.3).  The grid is geometric
    (0.5 % steps) from 10⁻⁶·C to C/2 and linear (5·10⁻⁴·C steps) from C/2 to C: the RDP grows by at
    most about 2 % between grid points (measured at q = 0.002, σ = 0.48, α = 2.4), and a run of
    thousands of steps needs a few thousand evaluations per order instead of one per step.
    Sensitivities below 10⁻⁶·C are rounded up to 10⁻⁶·C; exactly 0 stays 0 (RDP 0).
    """

    def __init__(self, sample_rate: float, noise_std: float, clip: float):
        self.q, self.noise_std, self.clip = float(sample_rate), float(noise_std), float(clip)
        low = np.exp(np.arange(math.log(_GRID_LOWEST), math.log(_GRID_SPLIT), math.log1p(_GRID_RELATIVE)))
        high = np.arange(_GRID_SPLIT, 1.0, _GRID_ABSOLUTE)
        self.grid = np.concatenate([[0.0], low, high, [1.0]]) * self.clip
        self._columns: dict[float, np.ndarray] = {}

    def _values(self, order: float, idx: np.ndarray) -> np.ndarray:
        """RDP at grid points ``idx`` (computed on first use, per order)."""
        col = self._columns.get(order)
        if col is None:
            col = self._columns[order] = np.full(self.grid.size, np.nan)
            col[0] = 0.0
        need = np.unique(idx[np.isnan(col[idx])])
        if need.size:
            col[need] = sum_rule_step_rdp(self.q, self.grid[need], self.noise_std, order)
        return col[idx]

    def _index(self, sensitivity) -> np.ndarray:
        s = np.asarray(sensitivity, dtype=float)
        if np.any(~(s >= 0)) or np.any(s > self.clip * (1 + 1e-9)):
            bad = s[~((s >= 0) & (s <= self.clip * (1 + 1e-9)))].ravel()[0]
            raise InvalidParameterError(
                "sensitivity", float(bad), f"must be in [0, {self.clip:g}] (clipped gradient norms)"
            )
        return np.searchsorted(self.grid, np.minimum(s, self.clip), side="left")  # the first grid point >= s

    def __call__(self, sensitivity, order) -> np.ndarray:
        """Thm. 3.2 at ``order`` for the sensitivities rounded up to the grid."""
        return self._values(float(_check_order(order)), self._index(sensitivity))


def tuple_exponents(gram_tt, gram_tw, norm_w, alpha: int) -> np.ndarray:
    """Δ_{U,α} for tuples from inner products: ``gram_tt`` (..., α, α) among the tuple's updates,
    ``gram_tw`` (..., α) with the second-argument update, ``norm_w`` (...) its squared norm."""
    a = alpha
    sq = np.trace(gram_tt, axis1=-2, axis2=-1)
    total = gram_tt.sum(axis=(-2, -1)) - 2 * (a - 1) * gram_tw.sum(axis=-1) + (a - 1) ** 2 * norm_w
    return sq - (a - 1) * norm_w - total


def mean_rule_bound(mu_outer, mu_tuples, alpha, noise_std: float) -> float:
    """Thm. 3.6 estimate from explicit updates: ``mu_outer`` (m, d) second-argument batch updates,
    ``mu_tuples`` (m, k, α, d) α-tuples of first-argument batch updates for each of them."""
    a = _check_int_order(alpha)
    mu_outer, mu_tuples = np.asarray(mu_outer, float), np.asarray(mu_tuples, float)
    gram_tt = np.einsum("mkid,mkjd->mkij", mu_tuples, mu_tuples)
    gram_tw = np.einsum("mkid,md->mki", mu_tuples, mu_outer)
    norm_w = np.einsum("md,md->m", mu_outer, mu_outer)[:, None]
    delta = tuple_exponents(gram_tt, gram_tw, norm_w, a)
    return exponents_to_bound(delta, a, noise_std)


def exponents_to_bound(delta, alpha: int, noise_std: float) -> float:
    """(1/(α−1)) mean_outer ln mean_inner exp(−Δ/(2σ²)) for Δ of shape (outer, inner) (Thm. 3.6's
    plug-in estimate: the log of a sample mean is biased low; see :func:`exponents_to_upper`)."""
    z = -np.asarray(delta, float) / (2 * noise_std**2)
    inner = logsumexp(z, axis=1) - math.log(z.shape[1])
    return float(max(np.mean(inner), 0.0) / (alpha - 1))


def exponents_to_upper(delta, alpha: int, noise_std: float, outer_norms, clip: float, failure: float) -> float:
    """A confidence upper bound on Thm. 3.6's right-hand side from the same samples (prob. ≥ 1 − ``failure``).

    With every update of norm ≤ ``clip`` (a mean of clipped gradients), for an outer update μ_o
    each inner value f = exp(−Δ/(2σ²)) lies in [0, exp(α(α−1)(c + ‖μ_o‖)²/(2σ²))] (−Δ is
    largest when the α tuple updates all equal −c·μ_o/‖μ_o‖), and each outer value
    Y_o = ln E_inner f/(α−1) in [−αc²/(2σ²(α−1)), α(2c)²/(2σ²)].  Hoeffding on the inner means
    (failure/2 shared over the outer samples) and then on the outer mean (failure/2).
    """
    a = _check_int_order(alpha)
    z = -np.asarray(delta, float) / (2 * noise_std**2)
    outer, inner = z.shape
    norms = np.asarray(outer_norms, float).ravel()
    log_hi = a * (a - 1) * (clip + norms) ** 2 / (2 * noise_std**2)
    r_in = hoeffding_radius(inner, failure / (2 * outer))
    y = np.array([_log_mean_upper(z[o], float(log_hi[o]), None, r_in) for o in range(outer)]) / (a - 1)
    lo = -a * clip**2 / (2 * noise_std**2 * (a - 1))
    hi = a * (2 * clip) ** 2 / (2 * noise_std**2)
    y_upper = float(np.mean(y)) + (hi - lo) * hoeffding_radius(outer, failure / 2)
    return float(max(min(y_upper, hi), 0.0))


def composition_orders(alpha, p: float, n: int) -> np.ndarray:
    """g_p^i(α) for i = 0 … n−1 (g_p^0(α) = α), with g_p(a) = p/(p−1)·a − 1/(p−1) as derived in the
    proof of Thm. 3.3 (the statement prints −1/p); then g_p^i(α) − 1 = (p/(p−1))^i·(α − 1)."""
    if not p > 1:
        raise InvalidParameterError("p", p, "must be > 1")
    out = np.empty(int(n))
    a = float(alpha)
    for i in range(int(n)):
        out[i] = a
        a = p / (p - 1) * a - 1 / (p - 1)
    return out


def hoeffding_radius(samples: int, failure: float) -> float:
    """One-sided Hoeffding radius for a mean of ``samples`` i.i.d. values in an interval of width 1:
    P(E f > mean + width·r) ≤ ``failure`` with r = √(ln(1/failure)/(2·samples))."""
    if int(samples) < 1:
        raise InvalidParameterError("samples", samples, "must be an integer >= 1")
    if not 0 < failure < 1:
        raise InvalidParameterError("failure", failure, "must be in (0, 1)")
    return math.sqrt(math.log(1.0 / failure) / (2.0 * int(samples)))


def _log_mean_upper(log_values, log_hi: float, log_lo: float | None, radius: float) -> float:
    """ln of a Hoeffding upper confidence bound on E f from samples ln f ∈ [log_lo, log_hi] (log_lo
    None: f ≥ 0), capped at the range's top: ln min(hi, mean + (hi − lo)·radius)."""
    z = np.asarray(log_values, dtype=float).ravel()
    log_mean = float(logsumexp(z)) - math.log(z.size)
    if log_lo is None or log_lo == -math.inf:
        log_width = log_hi
    elif log_hi <= log_lo:
        return min(log_mean, log_hi)
    else:  # ln(hi − lo) = ln hi + ln(1 − e^{lo − hi})
        log_width = log_hi + math.log(-math.expm1(log_lo - log_hi))
    if radius <= 0:
        return min(log_mean, log_hi)
    return min(float(np.logaddexp(log_mean, log_width + math.log(radius))), log_hi)


def _log_mean_upper_steps(log_mean, log_hi, radius: float) -> np.ndarray:
    """:func:`_log_mean_upper` for f ∈ [1, hi] (log_lo = 0), vectorized over steps from their log-means."""
    log_mean, log_hi = np.asarray(log_mean, float), np.asarray(log_hi, float)
    out = np.minimum(log_mean, log_hi)
    wide = log_hi > 0
    if radius > 0 and np.any(wide):
        log_width = log_hi[wide] + np.log(-np.expm1(-log_hi[wide]))  # ln(hi − 1)
        out[wide] = np.minimum(np.logaddexp(log_mean[wide], log_width + math.log(radius)), log_hi[wide])
    return out


def composition_bound(step_rdp, alpha, p: float | None = None, worst_step_rdp=None, failure: float = 0.05) -> dict:
    """Thm. 3.3 from per-step divergences of R runs.

    Args:
        step_rdp: (runs, n) array; entry [r, t] is run r's per-step divergence of step t + 1
            (chronological) at an order ≥ g_p^{n−1−t}(α) (:func:`step_orders` rounds it up).
        alpha: the composed order (> 1).
        p: Hölder exponent (default 3n, Fact 3.4).
        worst_step_rdp: optional (n,) data-independent bound on every run's per-step divergence
            at the same orders (e.g. Thm. 3.2 at sensitivity = clip norm).  With it, ``upper`` is a
            confidence upper bound on the theorem's bound that holds with probability ≥
            1 − ``failure`` over the sampled runs: each expectation E f_t, f_t = e^{p(g−1)D} ∈
            [1, e^{p(g−1)·worst}], is replaced by Hoeffding's bound (Fact 3.5's argument), a union
            bound over the n − 1 estimated steps.
        failure: J, the probability that ``upper`` fails.

    Returns ``bound`` (the plug-in estimate: the log of a sample mean is biased low), per-step
    ``contributions`` (n,), and with ``worst_step_rdp`` also ``upper`` and ``contributions_upper``.
    """
    d = np.atleast_2d(np.asarray(step_rdp, dtype=float))
    runs, n = d.shape
    p = float(3 * n if p is None else p)
    if not p > 1:
        raise InvalidParameterError("p", p, "must be > 1")
    g = composition_orders(alpha, p, n)  # g[i] for i = 0 … n−1; step t ↔ i = n−1−t
    worst = None if worst_step_rdp is None else np.broadcast_to(np.asarray(worst_step_rdp, float), (n,))
    radius = hoeffding_radius(runs, failure / max(n - 1, 1)) if worst is not None else 0.0
    i = n - 1 - np.arange(n)  # vectorized over the steps t = 0 … n−1
    gi = g[i]
    z = p * (gi - 1)[None, :] * d  # ln f per run and step
    log_mean = logsumexp(z, axis=0) - math.log(runs)
    log_w = i * math.log((p - 1) / p) - math.log(p)
    contrib = np.exp(log_w) * log_mean
    # the first step: the initial model is fixed, no expectation
    contrib[0] = ((p - 1) / p) ** (n - 1) * (g[n - 1] - 1) * float(np.max(d[:, 0]))
    upper = None
    if worst is not None:
        log_hi = p * (gi - 1) * np.maximum(worst, d.max(axis=0))
        upper = np.exp(log_w) * _log_mean_upper_steps(log_mean, log_hi, radius)
        upper[0] = contrib[0]
    contrib /= float(alpha) - 1
    out = {"bound": float(contrib.sum()), "contributions": contrib, "p": p, "orders": g[::-1].copy()}
    if upper is not None:
        upper /= float(alpha) - 1
        out.update(upper=float(upper.sum()), contributions_upper=upper, failure=float(failure))
    return out


#: Lattice of :func:`step_orders` for real orders: g − 1 rounded up to (α − 1)·2^{k/64} (1.1 % steps).
ORDER_LATTICE_PER_OCTAVE = 64


def step_orders(alpha, n: int, p: float | None = None, integer: bool = True) -> np.ndarray:
    """Order needed for each step (chronological) of Thm. 3.3: g_p^{n−1−t}(α) rounded up.

    ``integer``: to an integer, ⌈g⌉ (Thm. 3.6, and Thm. 3.2 as the paper states it).  Otherwise onto
    the lattice 1 + (α − 1)·2^{k/64} (k ≥ 0): the last step keeps α itself and the growth
    (p/(p−1))^i of g − 1 is rounded up by at most 1.1 % — far tighter than ⌈g⌉ near small α
    (α = 2: every step but the last would need order 3) — with few distinct orders to evaluate.
    """
    p = float(3 * n if p is None else p)
    g = composition_orders(alpha, p, n)[::-1]
    if integer:
        return np.ceil(g - 1e-12).astype(int)
    a = _check_order(alpha)
    k = np.ceil(ORDER_LATTICE_PER_OCTAVE * np.log2(np.maximum((g - 1) / (a - 1), 1.0)) - 1e-9)
    return 1 + (a - 1) * 2.0 ** (np.maximum(k, 0) / ORDER_LATTICE_PER_OCTAVE)


def same_composition_rdp(
    sample_rate: float, noise_multiplier: float, alpha, n: int, p: float | None = None, integer: bool = False
) -> dict:
    """Thm. 3.3 with the data-independent per-step bound at every step (sensitivity = the clip norm C).

    Every run then has the same per-step divergence ρ_{o_t}(C) (the SGM's RDP at step t's order o_t,
    :func:`step_orders`), and Thm. 3.3 gives exactly Σ_t ρ_{o_t}(C) (the weights and orders cancel:
    (g_p^i(α) − 1)·((p−1)/p)^i = α − 1).  This is the composition the per-instance bound uses, fed
    with no data-dependent information: the per-instance RDP over this isolates the effect of the
    measured sensitivities.  It is ≥ the plain data-independent RDP n·ρ_α(C) (higher orders at the
    early steps), and it is not itself a better guarantee than n·ρ_α(C).

    Returns ``rdp`` (the sum), ``contributions`` (n,) and ``orders`` (n,).
    """
    orders = step_orders(alpha, n, p, integer)
    uniq, inv = np.unique(orders, return_inverse=True)
    per_order = np.ravel(compute_rdp(float(sample_rate), float(noise_multiplier), [float(o) for o in uniq]))
    worst = per_order[inv]
    res = composition_bound(worst[None, :], alpha, p)
    return {"rdp": res["bound"], "contributions": res["contributions"], "orders": orders, "per_step": worst}


def best_order(
    sample_rate: float, noise_multiplier: float, steps: int, delta: float, integer: bool = False, max_order: int = 256
) -> float:
    """The order α at which the data-independent ε of ``steps`` SGM steps (q, σ) is smallest.

    ``integer=False``: over the fine order universe of :mod:`.orders` (real orders, the library's
    conversion); ``integer=True``: over the integers 2 … ``max_order`` (the smallest on ties).
    """
    from .conversion import rdp_to_epsilon
    from .orders import search_orders, sgm_rdp_at

    delta = check_delta(delta)
    if not integer:
        res = search_orders(sgm_rdp_at([[float(sample_rate)]], [[float(noise_multiplier)]], [[float(steps)]]), 1, delta)
        return float(res.order[0])
    orders = np.arange(2, int(max_order) + 1, dtype=float)
    rdp = compute_rdp(float(sample_rate), float(noise_multiplier), orders) * float(steps)
    with np.errstate(over="ignore", invalid="ignore"):
        eps = np.array([float(rdp_to_epsilon(rdp[i : i + 1], orders[i : i + 1], delta)[0]) for i in range(orders.size)])
    return float(orders[int(np.argmin(eps))])


def best_composition_order(
    sample_rate: float, noise_multiplier: float, steps: int, delta: float, p: float | None = None, integer: bool = False
) -> float:
    """The order α at which the ε of :func:`same_composition_rdp` — Thm. 3.3 with sensitivity C at every
    step, the data-independent bound of the composition the per-instance analysis uses — is smallest.

    The composition needs per-step orders up to 1 + (α − 1)·e^{n/p} (≈ 1.4·(α − 1) at p = 3n), so the
    plain best order (:func:`best_order`), which for small ε sits just below the sampled Gaussian's phase
    transition, can push the composition far past it: at q ≈ 0.002, ε = 1 (σ ≈ 1.0, 4,790 steps) the
    plain best order 11.6 gives the composition ε ≈ 1,700, its best order (9) 1.26.  Search: integers
    2 … 64 (``integer``), or α − 1 = 2^{k/2} (α from 1.016 to 65), then 2^{k/16} between the best
    point's neighbours, each stage exact over its candidates (a candidate whose plain ε, a lower bound,
    is above the best composition ε found is skipped); every evaluated ε is a valid bound at its order.
    """

    delta = check_delta(delta)

    def eps_at(alpha: float) -> float:
        rdp = same_composition_rdp(sample_rate, noise_multiplier, alpha, int(steps), p, integer)["rdp"]
        return float(epsilon_at_order(rdp, alpha, delta)) if np.isfinite(rdp) else math.inf

    def search(cands) -> tuple[float, float]:
        """min over ``cands`` of the composition's ε, exactly: the plain ε (n·ρ_α(C), one cheap call)
        is a lower bound of it (the composition's orders are ≥ α), so candidates whose plain ε is
        already above the best composition ε found are skipped."""
        plain_rdp = np.ravel(compute_rdp(float(sample_rate), float(noise_multiplier), list(map(float, cands)))) * steps
        with np.errstate(over="ignore", invalid="ignore"):
            plain = np.array(
                [
                    float(epsilon_at_order(r, a, delta)) if np.isfinite(r) else math.inf
                    for r, a in zip(plain_rdp, cands, strict=True)
                ]
            )
        best, best_a = math.inf, float(cands[int(np.argmin(plain))])
        for i in np.argsort(plain, kind="stable"):
            if plain[i] >= best:
                break
            v = eps_at(float(cands[i]))
            if v < best:
                best, best_a = v, float(cands[i])
        return best_a, best

    if integer:
        return search(np.arange(2, 65, dtype=float))[0]
    coarse = 1 + 2.0 ** (np.arange(-12, 13) / 2)
    a, _ = search(coarse)
    i = int(np.argmin(np.abs(coarse - a)))
    lo_k, hi_k = (max(i - 1, 0) - 12) * 8, (min(i + 1, coarse.size - 1) - 12) * 8
    return search(1 + 2.0 ** (np.arange(lo_k, hi_k + 1) / 16))[0]


def epsilon_at_order(rdp, alpha, delta: float) -> np.ndarray:
    """(ε, δ) from RDP ``rdp`` at the single order ``alpha`` (the library's conversion, Balle et al. 2020
    Thm. 21; it holds for any pair of distributions, so for per-instance RDP in each direction)."""
    from .conversion import rdp_to_epsilon

    r = np.asarray(rdp, dtype=float)
    return rdp_to_epsilon(r[..., None], [float(alpha)], delta)[0]


def fact_3_5_samples(
    alpha, step_rdp_alpha: float, step_rdp_2alpha: float, n: int, precision: float = 0.1, failure: float = 0.05
) -> float:
    """log10 of the runs l so that an empirical per-step term is within ``precision``·e^{3(α−1)ε} of its mean with
    probability ≥ 1 − ``failure`` (Fact 3.5 with p = 3n; ε = n·ρ(α), ε' = n·ρ(2α) per-step RDP).

    Hoeffding for f ∈ [0, e^{3(2α−1)ε'}]: l ≥ ln(2/J)/(2c²) · e^{6(2α−1)ε' − 6(α−1)ε}.  (The paper's
    statement has the exponent's sign flipped relative to its own proof and drops the square of
    the range; this is the bound Hoeffding gives.)
    """
    if not 0 < failure < 1 or not precision > 0:
        raise InvalidParameterError("precision/failure", (precision, failure), "need c > 0 and J in (0, 1)")
    eps, eps2 = n * step_rdp_alpha, n * step_rdp_2alpha
    log_l = math.log(math.log(2 / failure) / (2 * precision**2)) + 6 * (2 * alpha - 1) * eps2 - 6 * (alpha - 1) * eps
    return log_l / math.log(10)  # log10 of the number of runs (it can be astronomically large)


def corollary_3_1(
    sample_rate: float, sensitivities, noise_std: float, delta: float, delta_prime: float, p: float
) -> tuple[float, float]:
    """Per-instance (ε', δ'') for one step of the sampled Gaussian mechanism, P(M(X')∈S) ≤ e^ε' P(M(X)∈S) + δ''.

    From Lemma A.1 with a_p = q·(E e^{C Δ p})^{1/p}, C = √(2 ln(1.25/δ))/σ: splitting on whether
    a_p Q^{1−1/p} exceeds δ' gives ε' = ln(a_p^{p/(p−1)} δ'^{−1/(p−1)} + 1 − q), δ'' = qδ + δ'.
    (The printed corollary garbles these exponents; as p → ∞ this tends to the classical
    ln(q e^{C·max Δ} + 1 − q).)
    """
    q = float(check_sample_rate(sample_rate))
    delta, delta_prime = check_delta(delta), check_delta(delta_prime, "delta_prime")
    if not p > 1:
        raise InvalidParameterError("p", p, "must be > 1")
    c = math.sqrt(2 * math.log(1.25 / delta)) / noise_std
    s = np.asarray(sensitivities, dtype=float).ravel()
    log_ap = math.log(q) + (float(logsumexp(c * s * p)) - math.log(s.size)) / p
    log_term = p / (p - 1) * log_ap - math.log(delta_prime) / (p - 1)
    eps = float(np.logaddexp(log_term, math.log1p(-q))) if q < 1 else log_term
    return max(eps, 0.0), q * delta + delta_prime


def npiu_decisions(divergence, alpha: float, beta: float) -> list[dict]:
    """Naive Per-Instance Unlearning (Thudi et al. §5.4) for a sequence of deletion requests.

    Args:
        divergence: list (one per request t, in order) of functions ``order -> D_order(A(D^{t−1}) ‖
            A(D^t))``, the per-instance divergence of the deleted point (may return inf).
        alpha, beta: the unlearning guarantee D_α(R ‖ A(D^t)) ≤ β.

    Keeps the current model when (a − ½)/(a − 1)·K_{t−1}(2a) + D_{2a−1}(t) ≤ β at a = α, where
    K_{t−1} bounds the kept model's divergence from retraining (0 right after a retrain); this is
    the weak triangle inequality the paper's proof uses (its algorithm prints (α−1)/(α−2)).
    """
    if not alpha > 1 or not beta >= 0:
        raise InvalidParameterError("alpha/beta", (alpha, beta), "need alpha > 1 and beta >= 0")
    decisions, kept_since = [], []  # requests since the last retrain (all kept)

    def bound(requests, a):
        if not requests:
            return 0.0
        *earlier, last = requests
        return (a - 0.5) / (a - 1) * bound(earlier, 2 * a) + divergence[last](2 * a - 1)

    for t in range(len(divergence)):
        candidate = bound([*kept_since, t], float(alpha))
        keep = bool(np.isfinite(candidate) and candidate <= beta)
        decisions.append({"request": t, "decision": "keep" if keep else "retrain", "bound": float(candidate)})
        kept_since = [*kept_since, t] if keep else []
    return decisions
