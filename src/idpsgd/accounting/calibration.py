"""Calibration: the noise multiplier or the sampling rate that spends a target ε.

Both solve ε(x) = target for a monotone ε(x) by bracketed root finding (Illinois regula falsi on
log x and log ε, with bisection as safeguard), vectorized over many targets at once.  The answer
is always the feasible end of the final bracket: (1 − rtol)·target ≤ ε(x) ≤ target, so a
calibrated parameter never overshoots its budget (unlike a fixed-tolerance search such as
Opacus's ``get_noise_multiplier``, which stops anywhere within 0.01 below the target).

**No silent ends.** :func:`solve_monotone` raises :class:`UnreachableTargetError` naming the
target when it is not inside the bracket's range of ε, when ε jumps over the tolerance band
(e.g. to 0 where the total-variation bound δ ≥ TV applies), or when it does not converge; it
never returns the end of its bracket unless that end itself meets the tolerance.

**RDP** uses the adaptive orders of :mod:`.orders` (so σ falls compared with a fixed grid), and
is fast: each target remembers the best order index found at the parameters evaluated so far,
and a new evaluation inside the bracket only evaluates the few orders between them (a minimum
on the window's edge triggers the full search).  The answer is then re-checked with the full
search.  **PLD** is bracketed around the RDP answer (PLD is tighter, so its σ is a little smaller
and its q a little larger) and widened until the bracket holds the target.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..validation import (
    InvalidParameterError,
    UnreachableTargetError,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from .accountants import epsilon_sgm, get_accountant
from .events import check_min_sigma
from .orders import search_orders, sgm_rdp_at

SIGMA_RANGE = (1e-2, 1e6)
SAMPLE_RATE_RANGE = (1e-9, 1.0)
RTOL = 1e-4


def solve_monotone(
    f: Callable[[np.ndarray, np.ndarray], np.ndarray],
    target,
    lo,
    hi,
    increasing: bool,
    rtol: float = RTOL,
    max_iter: int = 200,
    name: str = "target",
    what: str = "x",
) -> np.ndarray:
    """x in [lo, hi] with (1 − rtol)·target ≤ f(x) ≤ target for each element of ``target``.

    ``f(x, idx)`` returns the monotone quantity at parameters ``x`` for the flat target indices
    ``idx``.  ``name`` (the target's name) and ``what`` (the parameter's) appear in errors.

    Raises:
        UnreachableTargetError: a target outside [f(lo), f(hi)] (the message gives the reachable
            range), a jump of f across the band [(1 − rtol)·target, target], or no convergence
            within ``max_iter`` iterations.  An end of the bracket is returned only when it meets
            the tolerance itself.
    """
    t = np.ravel(np.asarray(target, dtype=float))
    n = t.size
    every = np.arange(n)
    # Aim at the middle of the band [(1 − rtol)·t, t] (in log): the root is then interior, and
    # regula falsi converges fast; any x whose value lies in the band is accepted.
    aim = np.log(t) + 0.5 * np.log1p(-rtol)
    lo_band, hi_band = 0.5 * np.log1p(-rtol), -0.5 * np.log1p(-rtol)

    def g_at(x_values, idx):  # at parameter values
        return np.log(np.maximum(np.ravel(f(x_values, idx)), 1e-300)) - aim[idx]

    def g(x, idx):  # at log parameter values
        return g_at(np.exp(x), idx)

    def in_band(v):
        return (v >= lo_band) & (v <= hi_band)

    # a: the end below the aim (g ≤ 0, feasible), b: the end above it; in log x.
    xa = np.broadcast_to(np.asarray(lo if increasing else hi, dtype=float), (n,)).astype(float)
    xb = np.broadcast_to(np.asarray(hi if increasing else lo, dtype=float), (n,)).astype(float)
    a, b = np.log(xa), np.log(xb)
    a0, b0 = a.copy(), b.copy()
    ga, gb = g_at(xa, every), g_at(xb, every)  # the ends exactly as given
    answer = np.full(n, np.nan)
    for end, gend in ((xa, ga), (xb, gb)):  # an end that meets the tolerance is an answer
        ok = in_band(gend) & np.isnan(answer)
        answer[ok] = end[ok]
    bad = np.isnan(answer) & ((ga > 0) | (gb <= 0))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        _unreachable(
            name, t[i], what, np.exp(a0[i]), np.exp(b0[i]), np.exp(ga[i] + aim[i]), np.exp(gb[i] + aim[i]), increasing
        )
    done = ~np.isnan(answer)
    side = np.zeros(n, dtype=int)
    collapsed = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        idx = np.flatnonzero(~done)
        if idx.size == 0:
            break
        aa, bb, gaa, gbb = a[idx], b[idx], ga[idx], gb[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            x = bb - gbb * (bb - aa) / (gbb - gaa)
        lo_x, hi_x = np.minimum(aa, bb), np.maximum(aa, bb)
        bad = ~np.isfinite(x) | (x <= lo_x) | (x >= hi_x)
        x = np.where(bad, 0.5 * (aa + bb), x)
        gx = g(x, idx)
        below = gx <= 0
        # Illinois: halve the g of an end that survives twice in a row.
        gb[idx] = np.where(below & (side[idx] == 1), gbb / 2, gbb)
        ga[idx] = np.where(~below & (side[idx] == -1), gaa / 2, gaa)
        a[idx[below]], ga[idx[below]] = x[below], gx[below]
        b[idx[~below]], gb[idx[~below]] = x[~below], gx[~below]
        side[idx] = np.where(below, 1, -1)
        hit = in_band(gx)
        answer[idx[hit]] = np.exp(x[hit])
        stuck = ~hit & (np.abs(b[idx] - a[idx]) < 1e-13 * np.maximum(1.0, np.abs(a[idx])))
        collapsed[idx[stuck]] = True
        done[idx] = hit | stuck
    if np.any(collapsed):
        i = int(np.flatnonzero(collapsed)[0])
        fa = float(np.ravel(f(np.exp(a[i : i + 1]), np.array([i])))[0])
        fb = float(np.ravel(f(np.exp(b[i : i + 1]), np.array([i])))[0])
        raise UnreachableTargetError(
            f"{name}={t[i]:.6g} cannot be met within rtol={rtol:g}: the value jumps from {fb:.6g} to {fa:.6g} "
            f"at {what}={np.exp(a[i]):.10g}, so no {what} gives one in [{t[i] * (1 - rtol):.6g}, {t[i]:.6g}]"
        )
    if not np.all(done):
        i = int(np.flatnonzero(~done)[0])
        raise UnreachableTargetError(
            f"{name}={t[i]:.6g}: the search for {what} did not converge in {max_iter} iterations "
            f"(bracket [{np.exp(min(a[i], b[i])):.10g}, {np.exp(max(a[i], b[i])):.10g}])"
        )
    return answer


def _unreachable(name, target, what, x_feasible_end, x_other_end, f_a, f_b, increasing):
    lo_x, hi_x = sorted([float(x_feasible_end), float(x_other_end)])
    lo_f, hi_f = sorted([float(f_a), float(f_b)])
    if lo_x == hi_x:  # the search narrowed to one end of its range
        raise UnreachableTargetError(
            f"{name}={float(target):.6g} is unreachable: the reachable epsilon ends at "
            f"{lo_f:.6g}, at {what}={lo_x:g}, for these parameters"
        )
    raise UnreachableTargetError(
        f"{name}={float(target):.6g} is unreachable: with {what} in [{lo_x:g}, {hi_x:g}] the reachable "
        f"epsilon is [{lo_f:.6g}, {hi_f:.6g}] for these parameters"
    )


class _RdpEvaluator:
    """Refined-RDP ε of SGM targets along one free parameter, remembering the best order per target.

    ``free`` is ``"sigma"`` (fixed q per target) or ``"q"`` (fixed σ per target).
    """

    def __init__(
        self,
        fixed: np.ndarray,
        steps: int,
        delta: float,
        free: str,
        windowed: bool = True,
        hint: np.ndarray | None = None,
    ):
        self.fixed, self.steps, self.delta, self.free = fixed, float(steps), delta, free
        n = fixed.size
        self.windowed = windowed
        self.lx = np.full((n, 16), np.nan)
        self.k = np.zeros((n, 16), dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)
        self.hint = hint

    def _window(self, idx, lx):
        """Per row a window of order indices predicted from the nearest evaluated parameters.

        A wrong prediction costs only a wasted window: a minimum on its edge falls back to the
        full search (:func:`~idpsgd.accounting.orders.search_orders`)."""
        lo = np.full(idx.size, -1, dtype=np.int64)
        hi = np.full(idx.size, -1, dtype=np.int64)
        if not self.windowed:
            return lo, hi
        half = 6
        LX, K = self.lx[idx], self.k[idx]
        below = np.where(lx[:, None] >= LX, LX, -np.inf)
        above = np.where(lx[:, None] <= LX, LX, np.inf)
        ib, ia = np.argmax(below, axis=1), np.argmin(above, axis=1)
        r = np.arange(idx.size)
        xb, xa = below[r, ib], above[r, ia]
        has_b, has_a = np.isfinite(xb), np.isfinite(xa)
        kb, ka = K[r, ib], K[r, ia]
        both = has_b & has_a
        with np.errstate(invalid="ignore", divide="ignore"):
            w = np.where(xa > xb, (lx - xb) / (xa - xb), 0.5)
        pred = np.where(both, np.round(kb + w * (ka - kb)), np.where(has_b, kb, ka)).astype(np.int64)
        close = both & (np.abs(ka - kb) + 5 <= 2 * half)
        lo = np.where(close, np.minimum(ka, kb) - 2, pred - half)
        hi = np.where(close, np.maximum(ka, kb) + 2, pred + half)
        none = ~(has_b | has_a)
        if self.hint is not None:
            h = np.asarray(self.hint)[idx]
            use = none & (h >= 0)
            lo[use], hi[use] = h[use] - half, h[use] + half
            none &= ~use
        lo[none], hi[none] = -1, -1
        return lo, hi

    def _record(self, idx, lx, k):
        full = self.count[idx] >= self.lx.shape[1]
        if full.any():
            self.lx = np.concatenate([self.lx, np.full_like(self.lx, np.nan)], axis=1)
            self.k = np.concatenate([self.k, np.zeros_like(self.k)], axis=1)
        self.lx[idx, self.count[idx]] = lx
        self.k[idx, self.count[idx]] = k
        self.count[idx] += 1

    def evaluate(self, x, idx, window: bool = True):
        x = np.ravel(np.asarray(x, dtype=float))
        idx = np.asarray(idx, dtype=np.int64)
        lx = np.log(x)
        lo, hi = self._window(idx, lx) if window else (np.full(idx.size, -1), np.full(idx.size, -1))
        q, s = (x, self.fixed[idx]) if self.free == "q" else (self.fixed[idx], x)
        res = search_orders(sgm_rdp_at(q[:, None], s[:, None], self.steps), idx.size, self.delta, window=(lo, hi))
        self._record(idx, lx, res.index)
        return res.epsilon, res.index

    def __call__(self, x, idx):
        return self.evaluate(x, idx)[0]


def calibrate_noise_multiplier(
    target_epsilon,
    delta: float,
    sample_rate,
    steps: int,
    accountant: str = "rdp",
    rtol: float = RTOL,
    name: str = "target_epsilon",
):
    """σ such that ``steps`` SGM steps at rate q spend ε in [(1 − rtol)·target, target].

    Vectorized over ``target_epsilon`` and ``sample_rate`` (broadcast).  ε is the accountant's
    (``rdp``: adaptive orders).  Raises :class:`UnreachableTargetError` (naming ``name``) when no
    σ in ``SIGMA_RANGE`` gives such an ε.
    """
    eps_t = check_epsilon(target_epsilon, name)
    q = check_sample_rate(sample_rate)
    eps_t, q = np.broadcast_arrays(eps_t, q)
    x = _calibrate(
        q.ravel().astype(float), eps_t, delta, steps, accountant, rtol, SIGMA_RANGE, False, "noise_multiplier", name
    )
    return float(x) if x.ndim == 0 else x


def calibrate_sample_rate(
    target_epsilon,
    delta: float,
    noise_multiplier,
    steps: int,
    accountant: str = "rdp",
    rtol: float = RTOL,
    name: str = "target_epsilon",
    bracket=None,
    hint=None,
):
    """q such that ``steps`` SGM steps with noise σ spend ε in [(1 − rtol)·target, target].

    ``bracket=(lo, hi)`` (arrays per target, inside ``SAMPLE_RATE_RANGE``) narrows the search
    where the caller knows it; ``hint`` (order indices per target) is internal.
    """
    eps_t = check_epsilon(target_epsilon, name)
    sig = check_noise_multiplier(noise_multiplier, allow_inf=False)
    check_min_sigma(sig)
    eps_t, sig = np.broadcast_arrays(eps_t, sig)
    x = _calibrate(
        sig.ravel().astype(float),
        eps_t,
        delta,
        steps,
        accountant,
        rtol,
        SAMPLE_RATE_RANGE,
        True,
        "sample_rate",
        name,
        bracket=bracket,
        hint=hint,
    )
    return float(x) if x.ndim == 0 else x


def _calibrate(
    fixed,
    eps_t,
    delta,
    steps,
    accountant,
    rtol,
    bounds,
    increasing,
    what,
    name,
    bracket=None,
    hint=None,
    return_index=False,
    verify=True,
    x_guess=None,
):
    delta = check_delta(delta)
    steps = check_steps(steps)
    get_accountant(accountant)
    if not 0 < rtol < 1:
        raise InvalidParameterError("rtol", rtol, "must be in (0, 1)")
    flat = eps_t.ravel()
    n = flat.size
    lo = np.full(n, float(bounds[0]))
    hi = np.full(n, float(bounds[1]))
    if bracket is not None:
        lo = np.maximum(lo, np.broadcast_to(np.asarray(bracket[0], dtype=float), (n,)))
        hi = np.minimum(hi, np.broadcast_to(np.asarray(bracket[1], dtype=float), (n,)))
    if accountant == "rdp":
        x, k = _calibrate_rdp(
            fixed,
            flat,
            delta,
            steps,
            rtol,
            lo,
            hi,
            increasing,
            what,
            name,
            hint,
            verify,
            guess=bracket is None,
            x_guess=x_guess,
        )
        out = x.reshape(eps_t.shape)
        return (out, k) if return_index else out
    free = "q" if what == "sample_rate" else "sigma"
    memo: dict = {}  # (target, x) → ε: PLD evaluations are expensive; the bracket's ends are reused

    def f(x, idx):
        x = np.ravel(np.asarray(x, dtype=float))
        idx = np.ravel(np.asarray(idx))
        out = np.empty(x.size)
        for j, (xi, i) in enumerate(zip(x.tolist(), idx.tolist(), strict=True)):
            key = (i, xi)
            if key not in memo:
                q, s = (xi, fixed[i]) if free == "q" else (fixed[i], xi)
                memo[key] = float(epsilon_sgm(q, s, steps, delta, accountant))
            out[j] = memo[key]
        return out

    if bracket is not None:  # the caller's bracket holds the answer: solve in it directly
        x = solve_monotone(f, flat, lo, hi, increasing, rtol, name=name, what=what)
        return x.reshape(eps_t.shape)
    try:
        x_rdp = _calibrate(fixed, eps_t, delta, steps, "rdp", rtol, bounds, increasing, what, name, hint=hint).ravel()
    except UnreachableTargetError as exc:
        raise UnreachableTargetError(
            f"{exc} [rdp; the {accountant} calibration starts from the rdp one, so it is refused too]"
        ) from None
    lo, hi = _pld_bracket(f, flat, x_rdp, lo, hi, increasing)
    x = solve_monotone(f, flat, lo, hi, increasing, rtol, name=name, what=what)
    return x.reshape(eps_t.shape)


def _calibrate_rdp(
    fixed, flat, delta, steps, rtol, lo, hi, increasing, what, name, hint, verify=True, guess=True, x_guess=None
):
    free = "q" if what == "sample_rate" else "sigma"
    ev = _RdpEvaluator(fixed, steps, delta, free, hint=hint)
    lo0, hi0 = lo, hi
    if guess:
        lo, hi = _guess_bracket(ev, flat, fixed, steps, delta, lo, hi, free, x_guess)
    x = solve_monotone(ev, flat, lo, hi, increasing, rtol, name=name, what=what)
    if not verify:  # internal use inside an outer search; the final answer is verified there
        last = ev.count - 1
        return x, ev.k[np.arange(flat.size), np.maximum(last, 0)]
    # The windowed search equals the full one when ε(α) is unimodal; check with the full search.
    every = np.arange(flat.size)
    eps, k = ev.evaluate(x, every, window=False)
    bad = ~((eps <= flat) & (eps >= flat * (1 - rtol)))
    if bad.any():
        rows = np.flatnonzero(bad)
        lo, hi = lo0, hi0
        full = _RdpEvaluator(fixed[rows], steps, delta, free, windowed=False)
        x[rows] = solve_monotone(full, flat[rows], lo[rows], hi[rows], increasing, rtol, name=name, what=what)
        _, k_r = full.evaluate(x[rows], np.arange(rows.size), window=False)
        k[rows] = k_r
    return x, k


def _pld_bracket(f, target, x_rdp, lo, hi, increasing, factor: float = 1.5, tries: int = 12, first: float = 1.2):
    """Ends around the RDP answer that hold each target for the (tighter) PLD accountant.

    The first step away from the RDP answer is ×``first`` (PLD's σ is typically 5–15 % smaller,
    its q larger), later ones ×``factor``."""
    n = target.size
    feas_end = x_rdp.copy()  # PLD ε ≤ RDP ε, so the RDP answer is usually feasible
    other = x_rdp.copy()
    toward_feasible = (1 / factor) if increasing else factor
    for i in range(n):
        idx = np.array([i])
        for _ in range(tries):  # make the feasible end feasible
            if f(feas_end[i : i + 1], idx)[0] <= target[i]:
                break
            nxt = feas_end[i] * toward_feasible
            feas_end[i] = min(max(nxt, lo[i]), hi[i])
            if feas_end[i] in (lo[i], hi[i]):
                break
        other[i] = feas_end[i]
        step = (1 / first) if toward_feasible > 1 else first
        for _ in range(tries):  # and the other end infeasible
            nxt = other[i] * step
            step = 1 / toward_feasible
            other[i] = min(max(nxt, lo[i]), hi[i])
            if other[i] in (lo[i], hi[i]) or f(other[i : i + 1], idx)[0] > target[i]:
                break
    return (feas_end, other) if increasing else (other, feas_end)


def sample_rates_rdp(
    epsilons,
    delta: float,
    noise_multiplier: float,
    steps: int,
    rtol: float = RTOL,
    bracket=None,
    hint=None,
    verify: bool = True,
    name: str = "budgets",
    x_guess=None,
):
    """Internal (assignment's Sample search): RDP sample rates per target and their best order indices."""
    eps_t = check_epsilon(epsilons, name).ravel()
    fixed = np.full(eps_t.size, float(noise_multiplier))
    return _calibrate(
        fixed,
        eps_t,
        delta,
        steps,
        "rdp",
        rtol,
        SAMPLE_RATE_RANGE,
        True,
        "sample_rate",
        name,
        bracket=bracket,
        hint=hint,
        return_index=True,
        verify=verify,
        x_guess=x_guess,
    )


def _gdp_mu(epsilon, delta, iterations: int = 80):
    """μ of the μ-GDP mechanism that is (ε, δ)-DP (Dong, Roth & Su 2019, Cor. 2.13), by bisection."""
    from scipy.special import ndtr

    eps = np.asarray(epsilon, dtype=float)
    lo, hi = np.full(eps.shape, 1e-8), np.full(eps.shape, 50.0)
    for _ in range(iterations):
        mu = np.sqrt(lo * hi)
        with np.errstate(over="ignore", invalid="ignore"):
            d = ndtr(-eps / mu + mu / 2) - np.exp(eps) * ndtr(-eps / mu - mu / 2)
        big = d > delta
        hi, lo = np.where(big, mu, hi), np.where(big, lo, mu)
    return np.sqrt(lo * hi)


def _guess_bracket(ev, target, fixed, steps, delta, lo, hi, free, x_guess=None, factor: float = 1.5, tries: int = 16):
    """A narrow starting bracket around the CLT (Gaussian DP) estimate of the answer.

    The sampled Gaussian composed T times is close to μ-GDP with μ = q·sqrt(T(e^{1/σ²} − 1))
    (Bu et al. 2020); the guess only saves iterations: both ends are evaluated exactly and
    widened (×``factor``) until they hold the target, up to the caller's ``lo``/``hi``.
    """
    if x_guess is not None:
        guess = np.broadcast_to(np.asarray(x_guess, dtype=float), target.shape).copy()
    else:
        mu = _gdp_mu(target, delta)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            if free == "sigma":
                guess = 1.0 / np.sqrt(np.log1p(mu**2 / (fixed**2 * steps)))
            else:
                guess = mu / np.sqrt(steps * np.expm1(1.0 / fixed**2))
    guess = np.where(np.isfinite(guess) & (guess > 0), guess, np.sqrt(lo * hi))
    a = np.clip(guess / factor, lo, hi)  # small end
    b = np.clip(guess * factor, lo, hi)  # large end
    every = np.arange(target.size)
    # ε decreases with σ and increases with q: the small end must be above the target for σ
    # (infeasible) and below it for q (feasible), the large end the opposite.
    small_ok = (lambda e, t: e > t) if free == "sigma" else (lambda e, t: e <= t)
    large_ok = (lambda e, t: e <= t) if free == "sigma" else (lambda e, t: e > t)
    for end, ok, toward, limit in ((a, small_ok, 1 / factor**2, lo), (b, large_ok, factor**2, hi)):
        need = every
        for _ in range(tries):
            e = ev(end[need], need)
            movable = end[need] != limit[need]
            bad_rows = need[~ok(e, target[need]) & movable]
            if bad_rows.size == 0:
                break
            end[bad_rows] = np.clip(end[bad_rows] * toward, lo[bad_rows], hi[bad_rows])
            need = bad_rows
    return a, b
