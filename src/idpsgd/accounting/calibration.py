"""Calibration: the noise multiplier or the sampling rate that spends a target ε.

Both solve ε(x) = target for a monotone ε(x) by bracketed root finding (Illinois regula falsi on
log x and log ε, with bisection as safeguard), vectorized over many targets at once.  The answer
is always the feasible end of the bracket: (1 − rtol)·target ≤ ε(x) ≤ target, so a calibrated
parameter never overshoots its budget (unlike a fixed-tolerance search such as Opacus's
``get_noise_multiplier``, which stops anywhere within 0.01 below the target).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..validation import (UnreachableTargetError, check_delta, check_epsilon, check_noise_multiplier,
                          check_sample_rate, check_steps)
from .accountants import epsilon_sgm, get_accountant

SIGMA_RANGE = (1e-2, 1e6)
SAMPLE_RATE_RANGE = (1e-9, 1.0)
RTOL = 1e-4


def solve_monotone(f: Callable[[np.ndarray, np.ndarray], np.ndarray], target, lo, hi,
                   increasing: bool, rtol: float = RTOL, max_iter: int = 200) -> np.ndarray:
    """x in [lo, hi] with (1 − rtol)·target ≤ f(x) ≤ target for each element of ``target``.

    ``f(x, idx)`` returns ε at parameters ``x`` for the flat target indices ``idx``; it must be
    monotone in x.  The caller has checked that the target lies between f(lo) and f(hi).
    """
    lt = np.log(np.ravel(np.asarray(target, dtype=float)))
    n = lt.size
    every = np.arange(n)

    def g(x, idx):
        return np.log(np.maximum(np.ravel(f(np.exp(x), idx)), 1e-300)) - lt[idx]

    # a: feasible end (g ≤ 0), b: infeasible end, in log x.
    a = np.log(np.broadcast_to(lo if increasing else hi, (n,))).astype(float)
    b = np.log(np.broadcast_to(hi if increasing else lo, (n,))).astype(float)
    ga, gb = g(a, every), g(b, every)
    side = np.zeros(n, dtype=int)
    done = ga >= np.log1p(-rtol)
    for _ in range(max_iter):
        idx = np.flatnonzero(~done)
        if idx.size == 0:
            break
        aa, bb, gaa, gbb = a[idx], b[idx], ga[idx], gb[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            x = bb - gbb * (bb - aa) / (gbb - gaa)
        width = np.abs(bb - aa)
        bad = ~np.isfinite(x) | (np.abs(x - aa) < 1e-3 * width) | (np.abs(x - bb) < 1e-3 * width)
        x = np.where(bad, 0.5 * (aa + bb), x)
        gx = g(x, idx)
        feas = gx <= 0
        # Illinois: halve the g of an end that survives twice in a row.
        gb[idx] = np.where(feas & (side[idx] == 1), gbb / 2, gbb)
        ga[idx] = np.where(~feas & (side[idx] == -1), gaa / 2, gaa)
        a[idx[feas]], ga[idx[feas]] = x[feas], gx[feas]
        b[idx[~feas]], gb[idx[~feas]] = x[~feas], gx[~feas]
        side[idx] = np.where(feas, 1, -1)
        done[idx] = (feas & (gx >= np.log1p(-rtol))) | (np.abs(b[idx] - a[idx]) < 1e-12)
    return np.exp(a)


def calibrate_noise_multiplier(target_epsilon, delta: float, sample_rate, steps: int,
                               accountant: str = "rdp", rtol: float = RTOL):
    """σ such that ``steps`` SGM steps at rate q spend ε in [(1 − rtol)·target, target].

    Vectorized over ``target_epsilon`` and ``sample_rate`` (broadcast).  Raises
    :class:`UnreachableTargetError` when the target needs σ outside ``SIGMA_RANGE``.
    """
    eps_t = check_epsilon(target_epsilon, "target_epsilon")
    q = check_sample_rate(sample_rate)
    eps_t, q = np.broadcast_arrays(eps_t, q)
    qf = q.ravel()
    return _calibrate(lambda acc: lambda x, idx: epsilon_sgm(qf[idx], x, steps, delta, acc),
                      eps_t, delta, steps, accountant, rtol, SIGMA_RANGE, False, "noise_multiplier")


def calibrate_sample_rate(target_epsilon, delta: float, noise_multiplier, steps: int,
                          accountant: str = "rdp", rtol: float = RTOL):
    """q such that ``steps`` SGM steps with noise σ spend ε in [(1 − rtol)·target, target]."""
    eps_t = check_epsilon(target_epsilon, "target_epsilon")
    sig = check_noise_multiplier(noise_multiplier, allow_inf=False)
    eps_t, sig = np.broadcast_arrays(eps_t, sig)
    sf = sig.ravel()
    return _calibrate(lambda acc: lambda x, idx: epsilon_sgm(x, sf[idx], steps, delta, acc),
                      eps_t, delta, steps, accountant, rtol, SAMPLE_RATE_RANGE, True, "sample_rate")


def _calibrate(make_f, eps_t, delta, steps, accountant, rtol, bounds, increasing, name):
    """``make_f(accountant)`` returns f(x, idx): ε at parameters x for flat target indices idx."""
    check_delta(delta)
    check_steps(steps)
    get_accountant(accountant)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol={rtol!r} is invalid: must be in (0, 1)")
    f = make_f(accountant)
    lo, hi = bounds
    if accountant != "rdp":
        # PLD is tighter than RDP, so its answer lies on the generous side of the RDP answer;
        # bracketing there keeps dp_accounting away from huge PLDs at extreme parameters.
        x_rdp = _calibrate(make_f, eps_t, delta, steps, "rdp",
                           rtol, bounds, increasing, name)
        x_rdp = np.ravel(x_rdp)
        lo, hi = (x_rdp, np.minimum(x_rdp * 4, hi)) if increasing else (np.maximum(x_rdp / 4, lo), x_rdp)
    every = np.arange(eps_t.size)
    lo, hi = np.broadcast_to(lo, eps_t.size).astype(float), np.broadcast_to(hi, eps_t.size).astype(float)
    e_lo, e_hi = np.ravel(f(lo, every)), np.ravel(f(hi, every))
    e_min, e_max = (e_lo, e_hi) if increasing else (e_hi, e_lo)
    flat = eps_t.ravel()
    bad = (flat < e_min) | (flat > e_max)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UnreachableTargetError(
            f"target_epsilon={float(flat[i])!r} is unreachable: with {name} in "
            f"[{lo[i]:g}, {hi[i]:g}] the reachable epsilon is [{float(e_min[i]):.6g}, "
            f"{float(e_max[i]):.6g}] for these parameters")
    x = solve_monotone(f, flat, lo, hi, increasing, rtol).reshape(eps_t.shape)
    return float(x) if x.ndim == 0 else x
