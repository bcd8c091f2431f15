"""Per-example privacy loss distributions (PLD) for rounded sensitivity levels, vectorized.

Example i took T_il DP-SGD steps at level l — a sampled Gaussian mechanism with rate q_l and
effective noise multiplier σ_l = σ·c/s_l for its rounded sensitivity s_l (Yu et al. 2023, Alg. 2).
Its privacy loss distribution is the convolution of the levels' single-step PLDs, T_il times
each; in Fourier space

    φ_i(k) = exp( Σ_l T_il · log φ_l(k) ),

so with few distinct levels the log characteristic functions are computed **once per level**, and
every example's composition is one row of a (examples × levels) @ (levels × frequencies) product
followed by an inverse real FFT — in chunks of examples with similar support widths.

Each level's PMF is dp_accounting's pessimistic connect-the-dots discretization (Doroshenko et al.
2022), and every error of the composition is bounded and charged to δ, so ε_i stays an upper bound
(:func:`individual_pld_epsilon`).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft

from ..validation import InvalidParameterError, check_delta, check_positive
from .accountants import PLD_MAX_POINTS, single_pmf_points
from .rdp import run_in_threads

#: Default loss discretization of per-example PLDs (coarser than the scalar default 1e-3: per-example
#: PLDs are many; the discretization stays pessimistic — see the bench for the effect on ε).
INDIVIDUAL_PLD_DISCRETIZATION = 2e-3
#: Chernoff bound on the composed mass above (and below) each example's FFT window.
TAIL_MASS = 1e-12
#: Floating-point error allowance factor (see the module doc, item 3).
_FP_FACTOR = 16.0
_U = np.finfo(float).eps
#: Elements (examples × FFT points) processed together; bounds memory to a few × 8 bytes × this.
CHUNK_ELEMENTS = 2_000_000
#: Most distinct levels accepted (each needs one PMF per direction).
MAX_LEVELS = 20_000
#: Frequencies whose composed |φ| is provably below this (through the levels' envelopes) are
#: dropped; their total is charged to δ.
_DROP_MASS = 1e-15
_ENV_STEP = 32


@dataclass(frozen=True)
class _LevelPmfs:
    lower: np.ndarray  # (L,) int: absolute index of each PMF's first point
    probs: list  # L arrays
    inf_mass: np.ndarray  # (L,)


#: One-step PMFs by (q, σ, Δ): levels recur across refreshes, epochs and calls.
_PMF_CACHE: OrderedDict[tuple, dict] = OrderedDict()
_PMF_CACHE_SIZE = 512


def _one_level(q: float, s: float, discretization: float) -> dict:
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    key = (q, s, discretization)
    if key in _PMF_CACHE:
        _PMF_CACHE.move_to_end(key)
        return _PMF_CACHE[key]
    pts = single_pmf_points(q, s, discretization)
    if pts > PLD_MAX_POINTS:
        raise InvalidParameterError(
            "noise_multiplier",
            s,
            f"is too small for PLD accounting at sample "
            f"rate {q:g}: one step would need {pts:.3g} grid points (limit {PLD_MAX_POINTS})",
        )
    pld = pld_lib.from_gaussian_mechanism(
        standard_deviation=s, value_discretization_interval=discretization, sampling_prob=q
    )
    out = {}
    for name, pmf in (("remove", pld._pmf_remove), ("add", pld._pmf_add)):
        dense = pmf.to_dense_pmf()
        out[name] = (int(dense._lower_loss), np.asarray(dense._probs, dtype=float), float(dense._infinity_mass))
    _PMF_CACHE[key] = out
    while len(_PMF_CACHE) > _PMF_CACHE_SIZE:
        _PMF_CACHE.popitem(last=False)
    return out


def _level_pmfs(sample_rates, noise_multipliers, discretization):
    """Per level, the (remove, add) dense PMFs of one step from dp_accounting (cached)."""
    levels = [
        _one_level(float(q), float(s), float(discretization))
        for q, s in zip(sample_rates, noise_multipliers, strict=True)
    ]
    return {
        k: _LevelPmfs(
            np.array([lv[k][0] for lv in levels], dtype=np.int64),
            [lv[k][1] for lv in levels],
            np.array([lv[k][2] for lv in levels]),
        )
        for k in ("remove", "add")
    }


def _log_mgf(pmfs: _LevelPmfs, lambdas: np.ndarray) -> np.ndarray:
    """(L × K) log Σ_j p_lj e^{λ_k (lower_l + j)} of the finite part of each level's PMF."""
    out = np.empty((len(pmfs.probs), lambdas.size))
    for i, (lo, p) in enumerate(zip(pmfs.lower, pmfs.probs, strict=True)):
        x = (lo + np.arange(p.size))[:, None] * lambdas[None, :]
        with np.errstate(divide="ignore"):
            lp = np.log(p)[:, None]
        m = np.max(x + lp, axis=0)
        out[i] = m + np.log(np.sum(np.exp(x + lp - m), axis=0))
    return out


def _windows(counts, pmfs: _LevelPmfs):
    """Per example [t_lo, t_hi] (absolute grid indices) holding all but ``TAIL_MASS`` of each tail,
    and the Chernoff bound of the mass above t_hi."""
    lambdas = 2.0 ** np.arange(-28, 6.5, 0.5)
    pos = counts @ _log_mgf(pmfs, lambdas)  # (n × K) log M_i(λ)
    neg = counts @ _log_mgf(pmfs, -lambdas)
    log_tau = math.log(TAIL_MASS)
    with np.errstate(invalid="ignore", over="ignore"):
        hi = np.min((pos - log_tau) / lambdas[None, :], axis=1)
        lo = np.max((neg - log_tau) / -lambdas[None, :], axis=1)
    # support bounds: never beyond the composition's own extent
    ext_lo = counts @ pmfs.lower.astype(float)
    ext_hi = counts @ (pmfs.lower + np.array([p.size - 1 for p in pmfs.probs])).astype(float)
    t_hi = np.floor(np.minimum(np.nan_to_num(hi, nan=np.inf, posinf=np.inf), ext_hi)).astype(np.int64)
    t_lo = np.ceil(np.maximum(np.nan_to_num(lo, nan=-np.inf, neginf=-np.inf), ext_lo)).astype(np.int64)
    t_lo = np.minimum(t_lo, t_hi)
    # Chernoff bound of the mass strictly above t_hi (0 when t_hi is the support's end)
    with np.errstate(over="ignore", invalid="ignore"):
        tail = np.exp(np.min(pos - lambdas[None, :] * (t_hi[:, None] + 1), axis=1))
    tail = np.where(t_hi >= ext_hi, 0.0, np.minimum(tail, 1.0))
    return t_lo, t_hi, tail


def _level_log_cf(pmfs: _LevelPmfs, n_fft: int):
    """(L × (N/2+1)) complex log of each level's DFT (length N), absolute offsets as phases, and
    its upper envelope env[l, k] = max_{k' ≥ k} log|φ_l(k')| sampled every ``_ENV_STEP`` frequencies."""
    k = np.arange(n_fft // 2 + 1, dtype=np.int64)
    out = np.empty((len(pmfs.probs), k.size), dtype=complex)
    for i, (lo, p) in enumerate(zip(pmfs.lower, pmfs.probs, strict=True)):
        folded = np.zeros(n_fft)
        np.add.at(folded, np.arange(p.size) % n_fft, p)
        spec = sfft.rfft(folded)
        mag = np.abs(spec)
        with np.errstate(divide="ignore"):
            logmag = np.maximum(np.log(mag), -1000.0)
        phase = np.angle(spec) - 2 * np.pi * ((k * (int(lo) % n_fft)) % n_fft) / n_fft
        out[i] = logmag + 1j * phase
    env = np.maximum.accumulate(out.real[:, ::-1], axis=1)[:, ::-1]
    return out, env[:, ::_ENV_STEP]


def _epsilon_from_pmf(pmf, t_lo, inf_mass, delta_left, discretization, block: int = 32):
    """Smallest ε ≥ 0 with inf + Σ_{x>ε} p(x)(1 − e^{ε−x}) ≤ δ_left, per row.

    Row i of ``pmf`` is circular and aligned: column j holds the loss (b_i + j)·Δ, b_i = max(t_lo_i, 1),
    for j < t_lo_i + N − b_i, and the window's non-positive losses after that.  Only positive losses
    matter for ε ≥ 0 (modified in place); δ(ε) is e^ε-linear between grid points: on
    (x_{m−1}, x_m], δ(ε) = A_m − e^ε B_m with A_m = inf + Σ_{m' ≥ m} p, B_m = Σ_{m' ≥ m} p e^{−x}.
    δ(x_m) decreases in m: the first m with δ(x_m) ≤ δ_left is located on block boundaries
    (``block`` points), then inside its block.
    """
    n, width = pmf.shape
    base = np.maximum(t_lo, 1).astype(float)  # loss index of column 0 (rows are aligned)
    span = t_lo + width - np.maximum(t_lo, 1)  # columns holding positive losses
    nb = -(-max(int(span.max()), 1) // block)
    m = nb * block
    if m > width:
        pmf = np.concatenate([pmf, np.zeros((n, m - width))], axis=1)
    p = pmf[:, :m]
    p[np.arange(m)[None, :] >= span[:, None]] = 0.0  # non-positive (wrapped) losses do not count
    step = np.arange(m) * discretization
    w = p * np.exp(-step)[None, :]  # p e^{−x} · e^{bΔ}
    pb = p.reshape(n, nb, block).sum(axis=2)
    wb = w.reshape(n, nb, block).sum(axis=2)
    a_blk = np.cumsum(pb[:, ::-1], axis=1)[:, ::-1] + inf_mass[:, None]  # A at each block start
    b_blk = np.cumsum(wb[:, ::-1], axis=1)[:, ::-1]
    a_after = np.concatenate([a_blk[:, 1:], inf_mass[:, None]], axis=1)  # A after each block
    b_after = np.concatenate([b_blk[:, 1:], np.zeros((n, 1))], axis=1)
    last = (np.arange(nb) + 1) * block - 1  # each block's last point
    with np.errstate(over="ignore", invalid="ignore"):
        d_last = a_after - np.exp(step[last])[None, :] * b_after  # δ at each block's last point
    ok_blk = np.nan_to_num(d_last, nan=np.inf) <= delta_left[:, None]
    has = ok_blk.any(axis=1)
    blk = np.argmax(ok_blk, axis=1)  # the block holding the first ok point
    rows = np.arange(n)
    inside = blk[:, None] * block + np.arange(block)[None, :]
    p_in, w_in = np.take_along_axis(p, inside, axis=1), np.take_along_axis(w, inside, axis=1)
    a_in = np.cumsum(p_in[:, ::-1], axis=1)[:, ::-1] + a_after[rows, blk][:, None]  # A_j inside the block
    b_in = np.cumsum(w_in[:, ::-1], axis=1)[:, ::-1] + b_after[rows, blk][:, None]
    a_next = np.concatenate([a_in[:, 1:], a_after[rows, blk][:, None]], axis=1)
    b_next = np.concatenate([b_in[:, 1:], b_after[rows, blk][:, None]], axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        d_in = a_next - np.exp(step[inside]) * b_next
    ok = np.nan_to_num(d_in, nan=np.inf) <= delta_left[:, None]
    k = np.argmax(ok, axis=1)
    j = blk * block + k
    a_j, b_j = a_in[rows, k], b_in[rows, k]
    d0 = a_blk[:, 0] - np.exp(-base * discretization) * b_blk[:, 0]  # δ(0): every positive loss
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.log(a_j - delta_left) - np.log(b_j) + base * discretization
    x_j = (base + j) * discretization
    lower = np.where(j > 0, x_j - discretization, 0.0)
    eps = np.clip(np.nan_to_num(eps, nan=np.inf), lower, x_j)
    eps = np.where(has, eps, np.inf)
    eps = np.where(d0 <= delta_left, 0.0, eps)
    return np.where(inf_mass > delta_left, np.inf, np.maximum(eps, 0.0))


def individual_pld_epsilon(
    counts,
    sample_rates,
    noise_multipliers,
    delta: float,
    discretization: float = INDIVIDUAL_PLD_DISCRETIZATION,
    workers: int | None = None,
):
    """ε_i by PLD for examples that composed ``counts[i, l]`` steps at level l = (q_l, σ_l).

    Args:
        counts: (examples × levels) non-negative integer step counts.
        sample_rates, noise_multipliers: (levels,) the SGM of each level (σ = inf or q = 0: no cost).
        delta: target δ (per example).
        discretization: loss grid Δ (pessimistic connect-the-dots PMFs of dp_accounting).

    Returns:
        ε per example (inf where δ is not reachable within the window).

    **Discretization (pessimistic).** Each level's single-step PMF is dp_accounting's pessimistic
    connect-the-dots discretization (Doroshenko et al. 2022) of the Poisson-subsampled Gaussian on the
    grid Δ·Z — the same PMF that dp_accounting's ``PLDAccountant`` composes — for the remove and the
    add direction; ε_i is the larger of the two directions' ε, as in dp_accounting.  Composition of
    these PMFs is exact except for three error terms, each bounded and charged to δ (so ε_i stays an
    upper bound):

    1. *Upper tail beyond the FFT window.* The window [t_lo, t_hi] of example i is chosen from
       Chernoff bounds on its composed PMF, P(X > t) ≤ exp(log M_i(λ) − λt) with
       log M_i(λ) = Σ_l T_il log M_l(λ) (exact MGFs of the discretized PMFs); mass above t_hi would
       wrap to low losses and vanish from δ, so its bound (≤ ``TAIL_MASS``) is added to δ.
    2. *Lower tail below the window* wraps to the top: it can only increase δ (pessimistic).
    3. *Floating point.* The composed characteristic function carries a relative error at most
       c·u·(Σ_l T_il + log₂N) (u the unit round-off); its ℓ1 norm over frequencies bounds the error
       of every sum of the PMF, and that bound is added to δ.  Negative PMF values from round-off are
       set to 0 (δ's coefficients are ≥ 0, so this only increases δ).

    The remaining difference to dp_accounting composing the same events one by one is its own tail
    truncation (1e-15 per composition) — both are pessimistic.  dp_accounting's ``PLDAccountant`` with the
    same ``discretization`` is the reference in the tests.
    """
    delta = check_delta(delta)
    d = check_positive(discretization, "discretization")
    counts = np.asarray(counts, dtype=float)
    if counts.ndim != 2:
        raise InvalidParameterError("counts", f"array of shape {counts.shape}", "must be 2-D (examples × levels)")
    q = np.asarray(sample_rates, dtype=float).ravel()
    s = np.asarray(noise_multipliers, dtype=float).ravel()
    if q.size != counts.shape[1] or s.size != counts.shape[1]:
        raise InvalidParameterError("levels", q.size, f"need one (q, σ) per column of counts ({counts.shape[1]})")
    if np.any(counts < 0) or np.any(counts != np.round(counts)) or not np.all(np.isfinite(counts)):
        raise InvalidParameterError("counts", "array", "must be integers >= 0")
    live = (q > 0) & np.isfinite(s) & (counts.sum(axis=0) > 0)
    n = counts.shape[0]
    eps = np.zeros(n)
    if not live.any() or n == 0:
        return eps
    if live.sum() > MAX_LEVELS:
        raise InvalidParameterError(
            "levels",
            int(live.sum()),
            f"too many distinct levels for PLD (limit {MAX_LEVELS}); use a coarser rounding step",
        )
    c = counts[:, live]
    uniq, inverse = np.unique(c, axis=0, return_inverse=True)  # identical histories once
    inverse = inverse.ravel()
    pmfs = _level_pmfs(q[live], s[live], d)
    out = np.zeros(uniq.shape[0])
    for direction in ("remove", "add"):
        out = np.maximum(out, _direction_epsilon(uniq, pmfs[direction], delta, d, workers))
    eps[:] = out[inverse]
    return eps


def _direction_epsilon(counts, pmfs: _LevelPmfs, delta, discretization, workers):
    n = counts.shape[0]
    t_lo, t_hi, tail = _windows(counts, pmfs)
    width = (t_hi - t_lo + 1).astype(np.int64)
    if width.max() > PLD_MAX_POINTS:
        raise InvalidParameterError(
            "steps",
            int(counts.sum(axis=1).max()),
            f"too many for per-example PLD: an "
            f"example's loss distribution needs {int(width.max())} grid points "
            f"(limit {PLD_MAX_POINTS}); use the rdp accountant or a coarser discretization",
        )
    log_fin = counts @ np.log1p(-np.minimum(pmfs.inf_mass, 1.0))
    inf_mass = -np.expm1(log_fin)
    steps_total = counts.sum(axis=1)
    order = np.argsort(width, kind="stable")
    chunks = []
    start = 0
    while start < n:
        n_fft = sfft.next_fast_len(int(width[order[start]]), real=True)
        # grow the chunk while the widest member still fits a modest FFT length
        stop = start
        while stop < n:
            nf = sfft.next_fast_len(int(width[order[stop]]), real=True)
            if (stop - start + 1) * nf > CHUNK_ELEMENTS and stop > start:
                break
            n_fft = nf
            stop += 1
        chunks.append((order[start:stop], n_fft))
        start = stop
    eps = np.empty(n)
    cache: dict[int, np.ndarray] = {}

    def cf_for(n_fft):
        if n_fft not in cache:
            cache[n_fft] = _level_log_cf(pmfs, n_fft)
        return cache[n_fft]

    for _, n_fft in chunks:  # build the level tables serially (shared)
        cf_for(n_fft)

    def run(chunk):
        rows, n_fft = chunk
        logcf, env = cache[n_fft]
        cnt = counts[rows]
        k_all = n_fft // 2 + 1
        # |φ_i(k')| ≤ exp(Σ_l T_il env_l(k)) for every k' ≥ k: keep frequencies below the first
        # sampled k where that bound times the number of frequencies is negligible.
        bound = cnt @ env  # (rows × sampled k)
        small = bound < math.log(_DROP_MASS / (2 * k_all))
        first = np.where(small.any(axis=1), np.argmax(small, axis=1), env.shape[1])
        kc = int(first.max())  # sampled index: k = kc · step
        if kc < env.shape[1] and kc * _ENV_STEP < k_all:
            keep = max(kc * _ENV_STEP, 1)
            dropped = 2 * k_all * np.exp(bound[:, kc])  # ≥ Σ_{k ≥ keep} 2|φ_i(k)|
        else:
            keep, dropped = k_all, np.zeros(rows.size)
        spec = np.empty((rows.size, keep), dtype=complex)
        spec.real = cnt @ logcf.real[:, :keep]
        spec.imag = cnt @ logcf.imag[:, :keep]
        # align each row: column 0 ↔ loss index max(t_lo, 1) (a circular shift = a phase)
        shift = (np.maximum(t_lo[rows], 1) % n_fft)[:, None]
        spec.imag += 2 * np.pi * ((np.arange(keep, dtype=np.int64)[None, :] * shift) % n_fft) / n_fft
        np.exp(spec, out=spec)
        # column j holds the loss index max(t_lo, 1) + j (mod N, within the window [t_lo, t_lo + N)).
        # Mass above t_lo + N − 1 (≤ the charged tail) wraps to low losses, mass below t_lo to
        # high ones (pessimistic).
        pmf = sfft.irfft(spec, n=n_fft, axis=1)
        del spec
        np.maximum(pmf, 0.0, out=pmf)
        # Σ_k |φ_i(k)| ≤ sqrt(N · Σ_k |φ_i(k)|²) = N · sqrt(Σ_x p_x²) (Cauchy–Schwarz, Parseval)
        l1 = n_fft * np.sqrt(np.einsum("ij,ij->i", pmf, pmf))
        fp = _FP_FACTOR * _U * (steps_total[rows] + math.log2(n_fft) + 1) * l1 + dropped
        left = delta - tail[rows] - fp
        eps[rows] = np.where(
            left > 0,
            _epsilon_from_pmf(pmf, t_lo[rows], inf_mass[rows], np.maximum(left, 1e-300), discretization),
            np.inf,
        )

    run_in_threads(run, chunks, workers if workers is not None else min(2, os.cpu_count() or 1))
    return eps
