"""Rényi DP of the Poisson-subsampled Gaussian mechanism, vectorized over (q, σ) pairs.

One step of DP-SGD for an example sampled with probability ``q`` whose clipped gradient has norm
``s`` while the noise has standard deviation ``σ·c`` is the sampled Gaussian mechanism (SGM) with
effective noise multiplier ``σ·c/s`` (see the product guide).  Its RDP at order α is

    ε(α) = log A_α / (α − 1),
    A_α  = E_{u∼N(0,1)} [ (1 + q·(e^{x(u)} − 1))^α ],   x(u) = u/σ − 1/(2σ²)

(Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism",
Thm. 4/§3.3; the order of the two mixtures is the worst case, their Thm. 5).

This module owns the exact evaluation of A_α (three methods, chosen per pair and order, each
summing positive terms so that tiny RDP keeps its relative precision): :func:`compute_rdp`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.polynomial.hermite_e import hermegauss
from scipy.special import gammaln, gammasgn, log_ndtr

from ..validation import InvalidParameterError, check_noise_multiplier, check_orders, check_sample_rate

log = logging.getLogger(__name__)

#: Default Rényi orders: dense near 1 (small ε), every integer to 16, then geometric up to 1024
#: (examples with tiny gradient norms have huge effective σ and need large orders).
DEFAULT_ORDERS = np.array(
    [
        1.01,
        1.02,
        1.05,
        1.1,
        1.15,
        1.2,
        1.25,
        1.3,
        1.4,
        1.5,
        1.6,
        1.75,
        1.9,
        2.0,
        2.25,
        2.5,
        2.75,
        3.0,
        3.25,
        3.5,
        3.75,
        4.0,
        4.5,
        5.0,
        5.5,
        6.0,
        6.5,
        7.0,
        7.5,
        8.0,
        9.0,
        10.0,
        11.0,
        12.0,
        13.0,
        14.0,
        16.0,
        18.0,
        20.0,
        22.0,
        24.0,
        28.0,
        32.0,
        40.0,
        48.0,
        56.0,
        64.0,
        80.0,
        96.0,
        128.0,
        160.0,
        192.0,
        256.0,
        320.0,
        384.0,
        512.0,
        640.0,
        768.0,
        1024.0,
    ]
)

_GH_NODES, _GH_WEIGHTS = hermegauss(32)
_LOG_GH_WEIGHTS = np.log(_GH_WEIGHTS) - 0.5 * math.log(2 * math.pi)
_HALF_GH_NODES_SQ = 0.5 * _GH_NODES**2
_NEGLIGIBLE = 40.0  # terms below e^-40 of the running sum are dropped (chunks proven so)
_SERIES_TOL = 24.0  # Mironov series: stop when terms fall below e^-24 of A − 1
_SERIES_EXTRA_TERMS = 1500  # terms allowed past the last region where terms may grow
_BATCH = 4096  # pairs evaluated together (bounds memory: batch × chunk)
_CHUNK = 64


def compute_rdp(sample_rate, noise_multiplier, orders=DEFAULT_ORDERS, steps=1) -> np.ndarray:
    """RDP of ``steps`` compositions of the SGM, for arrays of (q, σ) against a vector of orders.

    Args:
        sample_rate: q, array-like in [0, 1] (0 means never sampled).
        noise_multiplier: σ, array-like in (0, inf]; broadcast against ``sample_rate``.
        orders: Rényi orders α > 1 (integer or fractional).
        steps: number of identical steps composed (RDP adds up); scalar or array broadcast
            against the pairs.

    Returns:
        Array of shape ``broadcast(q, σ).shape + (len(orders),)``.

    Three exact evaluations are used, chosen per (pair, order):

    * **integer α** — the binomial expansion (their §3.2) written so that every term is positive,
      ``A_α − 1 = Σ_{k≥2} C(α,k) q^k (1−q)^{α−k} (e^{k(k−1)/(2σ²)} − 1)``, summed in log space; chunks
      of terms that a cheap upper bound proves negligible (< e^-40 of the running sum) are skipped.
    * **α ≤ 2σ²** (the integrand is log-concave, so unimodal) — Gauss–Hermite quadrature centred at
      the mode and scaled by the curvature there (Laplace scaling), again of the positive quantity
      ``(1+y)^α − 1 − αy`` (its integral equals ``A_α − 1`` because ``E[y] = 0``).  Used for
      fractional orders, and for integer orders above the number of nodes where it is cheaper.
    * **fractional α > 2σ²** — Mironov et al.'s two-sided series (§3.3) summed with signs (not the
      absolute values that dp_accounting sums, which over-estimate at small α) and stopped only
      past every region where terms can grow again (Opacus's absolute cut-off can stop too early).
      The size of the last terms is added — a valid upper bound of the alternating tails — and a
      debug message is logged when the cap on terms is hit first.

    Writing ``A_α − 1`` as a sum of positive terms keeps full relative precision when the RDP is
    tiny (σ up to 1e6, q down to 1e-9).  ``q = 1`` is the plain Gaussian, ``α/(2σ²)``; ``q = 0`` or
    ``σ = inf`` (a zero gradient) gives 0.

    >>> float(compute_rdp(1.0, 2.0, [3.0])[0])   # plain Gaussian: α/(2σ²)
    0.375
    """
    q = check_sample_rate(sample_rate, allow_zero=True)
    sigma = check_noise_multiplier(noise_multiplier)
    alphas = check_orders(orders)
    q, sigma = np.broadcast_arrays(q, sigma)
    shape = q.shape
    pairs = np.stack([q.ravel(), sigma.ravel()], axis=1)
    unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
    rdp = _rdp_unique_pairs(unique[:, 0], unique[:, 1], alphas)[inverse.ravel()]
    rdp = rdp.reshape((*shape, alphas.size))
    steps_arr = np.asarray(steps, dtype=float)
    return rdp * (steps_arr[..., None] if steps_arr.ndim else steps_arr)


def compute_rdp_pointwise(sample_rate, noise_multiplier, orders) -> np.ndarray:
    """RDP of one SGM step where every element has its own order: arrays (q, σ, α) broadcast.

    The same exact evaluations as :func:`compute_rdp`, vectorized over elements whose orders
    differ (used by the adaptive-order search, :mod:`.orders`).  Distinct triples are evaluated once.

    >>> float(compute_rdp_pointwise(1.0, 2.0, 3.0))   # plain Gaussian: α/(2σ²)
    0.375
    """
    q = check_sample_rate(sample_rate, allow_zero=True)
    sigma = check_noise_multiplier(noise_multiplier)
    alpha = np.asarray(orders, dtype=float)
    if not np.all((alpha > 1) & np.isfinite(alpha)):
        bad = alpha[~((alpha > 1) & np.isfinite(alpha))].ravel()[0]
        raise InvalidParameterError("orders", float(bad), "every order must be > 1 and finite")
    q, sigma, alpha = np.broadcast_arrays(q, sigma, alpha)
    shape = q.shape
    if q.size == 0:
        return np.zeros(shape)
    qf, sf, af = q.ravel(), sigma.ravel(), alpha.ravel()
    order = np.lexsort((af, sf, qf))
    qs, ss, as_ = qf[order], sf[order], af[order]
    new = np.ones(order.size, dtype=bool)
    new[1:] = (qs[1:] != qs[:-1]) | (ss[1:] != ss[:-1]) | (as_[1:] != as_[:-1])
    group = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    values = _rdp_unique_triples(qs[first], ss[first], as_[first])
    out = np.empty(order.size)
    out[order] = values[group]
    return out.reshape(shape)


def _rdp_unique_triples(q: np.ndarray, sigma: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    out = np.zeros(q.size)
    full = (q == 1) & np.isfinite(sigma)
    out[full] = alpha[full] / (2 * sigma[full] ** 2)
    sub = (q > 0) & (q < 1) & np.isfinite(sigma)
    if not sub.any():
        return out
    idx = np.flatnonzero(sub)
    idx = idx[np.lexsort((alpha[idx], q[idx], sigma[idx]))]
    workers = min(os.cpu_count() or 1, 8) if idx.size >= 2000 else 1
    size = min(_BATCH, -(-idx.size // workers))
    batches = [idx[start : start + size] for start in range(0, idx.size, size)]

    def run(b):
        out[b] = _rdp_batch(q[b], sigma[b], alpha[b])

    if len(batches) > 1:
        with ThreadPoolExecutor(min(os.cpu_count() or 1, 8)) as pool:
            list(pool.map(run, batches))
    else:
        for b in batches:
            run(b)
    return out


def _rdp_unique_pairs(q: np.ndarray, sigma: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    out = np.zeros((q.size, alphas.size))
    full = (q == 1) & np.isfinite(sigma)
    out[full] = alphas[None, :] / (2 * sigma[full, None] ** 2)
    sub = (q > 0) & (q < 1) & np.isfinite(sigma)
    if not sub.any():
        return out
    # Sorting makes the pair batches homogeneous, so the negligible-chunk test skips more.
    idx = np.flatnonzero(sub)
    idx = idx[np.lexsort((q[idx], sigma[idx]))]
    tasks = [(j, idx[start : start + _BATCH]) for j in range(alphas.size) for start in range(0, idx.size, _BATCH)]

    def run(task):
        j, b = task
        out[b, j] = _rdp_batch(q[b], sigma[b], float(alphas[j]))

    # numpy releases the GIL inside its loops, so threads use every core for large jobs.
    run_in_threads(run, tasks, min(os.cpu_count() or 1, 8) if idx.size * alphas.size >= 20_000 else 1)
    return out


def run_in_threads(fn, tasks, workers: int) -> None:
    """``fn(task)`` for every task, on ``workers`` threads (numpy releases the GIL in its loops), or
    in this thread when ``workers`` ≤ 1 or there is a single task."""
    tasks = list(tasks)
    if workers > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fn, tasks))
    else:
        for task in tasks:
            fn(task)


class _BatchMemo:
    """The RDP of batches of (q, σ, α) already evaluated in this process, by a 128-bit BLAKE2 digest of their
    exact bytes: the function is pure, and calibrations search the same points again (an assignment's plan
    and the engine's check of it, a resumed run, every run of a session at the same budgets, the same
    individual-accounting table).  Least recently used batches leave first, past ``capacity`` values in all
    (8 bytes each: 32 MB).  A hit returns a copy, bit-identical to evaluating again."""

    def __init__(self, capacity: int = 4_000_000):
        self.capacity, self.size = capacity, 0
        self.batches: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: bytes):
        with self.lock:
            hit = self.batches.get(key)
            if hit is not None:
                self.batches.move_to_end(key)
                return hit.copy()
        return None

    def put(self, key: bytes, values: np.ndarray) -> None:
        if values.size > self.capacity:
            return
        with self.lock:
            if key not in self.batches:
                self.batches[key] = values.copy()
                self.size += values.size
            while self.size > self.capacity:
                self.size -= self.batches.popitem(last=False)[1].size


_MEMO = _BatchMemo()


def _rdp_batch(q: np.ndarray, sigma: np.ndarray, alpha) -> np.ndarray:
    """RDP per element; ``alpha`` a scalar or one order per element (memoized: :class:`_BatchMemo`)."""
    alpha = np.broadcast_to(np.asarray(alpha, dtype=float), q.shape)
    q, sigma = np.asarray(q, dtype=float), np.asarray(sigma, dtype=float)
    digest = hashlib.blake2b(q.size.to_bytes(8, "little"), digest_size=16)
    for part in (q, sigma, alpha):
        digest.update(np.ascontiguousarray(part).tobytes())
    key = digest.digest()
    found = _MEMO.get(key)
    if found is not None:
        return found
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # σ → 0 overflows to inf
        values = _rdp_batch_inner(q, sigma, alpha)
    _MEMO.put(key, values)
    return values


def _rdp_batch_inner(q: np.ndarray, sigma: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    log_am1 = np.empty(q.size)
    integer = alpha == np.round(alpha)
    # the exact sum is as cheap as quadrature for small integer orders
    gh = (alpha <= 2 * sigma**2) & ~(integer & (alpha <= _GH_NODES.size))
    if gh.any():
        log_am1[gh] = _log_am1_quadrature(q[gh], sigma[gh], alpha[gh])
    binom = ~gh & integer
    if binom.any():
        log_am1[binom] = _log_am1_binomial(q[binom], sigma[binom], alpha[binom])
    series = ~gh & ~integer
    if series.any():
        log_am1[series] = _log_am1_series(q[series], sigma[series], alpha[series])
    # log A = log(1 + (A − 1)), precise even when A − 1 is tiny.
    out = np.maximum(np.logaddexp(0.0, log_am1) / (alpha - 1), 0.0)
    return np.where(np.isnan(out), np.inf, out)  # only where the RDP overflows (σ → 0)


def _log_expm1(y: np.ndarray) -> np.ndarray:
    """log(e^y − 1) = y + log(1 − e^−y) for y > 0, stable for tiny and huge y."""
    with np.errstate(divide="ignore"):
        return y + np.log(-np.expm1(-y))


def _log_am1_binomial(q: np.ndarray, sigma: np.ndarray, n) -> np.ndarray:
    """log(A_n − 1) for integer n ≥ 2 (scalar or one per element) by the positive-term binomial sum."""
    nn = np.broadcast_to(np.asarray(n, dtype=float), q.shape)[:, None]
    logq, log1mq = np.log(q)[:, None], np.log1p(-q)[:, None]
    inv2s2 = (0.5 / sigma**2)[:, None]
    lg_n = gammaln(nn + 1)

    def terms(k: np.ndarray, rows=slice(None)) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            nr = nn[rows]
            logc = lg_n[rows] - gammaln(k + 1) - gammaln(np.maximum(nr - k, 0) + 1)
            t = logc + k * logq[rows] + (nr - k) * log1mq[rows] + _log_expm1(k * (k - 1) * inv2s2[rows])
        return np.where(k <= nr, t, -np.inf)

    n_max = int(nn.max())
    if n_max - 1 <= 2 * _CHUNK:
        return logsumexp(terms(np.arange(2, n_max + 1, dtype=float)[None, :]), axis=1)
    # Running sum seeded with the two ends and the binomial mode, then chunk by chunk.
    mode = np.clip(np.round(nn * q[:, None]), 2, nn)
    seed = np.concatenate([np.full_like(nn, 2.0), nn, mode], axis=1)
    valid = np.ones(seed.shape, dtype=bool)
    valid[:, 1] = nn[:, 0] != 2
    valid[:, 2] = (mode[:, 0] != 2) & (mode[:, 0] != nn[:, 0])
    total = logsumexp(np.where(valid, terms(seed), -np.inf), axis=1)
    half = np.floor(nn[:, 0] / 2.0)
    for a in range(2, n_max + 1, _CHUNK):
        b = np.minimum(a + _CHUNK - 1, nn[:, 0])
        live = b >= a
        # Upper bound of every term in [a, b]: each of the three parts at its own maximum.
        kc = np.clip(half, a, np.maximum(b, a))
        with np.errstate(invalid="ignore", over="ignore"):
            bound = (
                lg_n[:, 0]
                - gammaln(kc + 1)
                - gammaln(nn[:, 0] - kc + 1)
                + np.maximum(
                    a * logq[:, 0] + (nn[:, 0] - a) * log1mq[:, 0], b * logq[:, 0] + (nn[:, 0] - b) * log1mq[:, 0]
                )
                + _log_expm1(b * (b - 1) * inv2s2[:, 0])
            )
        need = live & ~(bound + np.log(np.maximum(b - a + 1, 1)) < total - _NEGLIGIBLE)
        rows = np.flatnonzero(need)
        if rows.size == 0:
            continue
        k = np.arange(a, a + _CHUNK, dtype=float)[None, :]
        t = terms(k, rows)
        t = np.where(
            (k == seed[rows, 0:1])
            | ((k == seed[rows, 1:2]) & valid[rows, 1:2])
            | ((k == seed[rows, 2:3]) & valid[rows, 2:3]),
            -np.inf,
            t,
        )
        total[rows] = np.logaddexp(total[rows], logsumexp(t, axis=1))
    return total


def _log_phi2(alpha, y: np.ndarray) -> np.ndarray:
    """log((1+y)^α − 1 − αy) ≥ 0-argument, for y > −1, without cancellation for small |y|.

    ``alpha`` broadcasts against ``y`` (one order per row of quadrature nodes: the series' coefficients are
    computed once per row)."""
    alpha = np.asarray(alpha, dtype=float)
    ay = alpha * y
    small = np.abs(ay) < 0.02
    out = np.empty(y.shape)
    n_small = int(np.count_nonzero(small))
    if n_small:
        # Horner form of Σ_{k=2}^{12} C(α,k) y^{k−2}; |αy| < 0.02 makes the rest < 1e-17.
        whole = 2 * n_small > small.size  # mostly small: on every element, the others masked out
        al = alpha if whole else np.broadcast_to(alpha, y.shape)[small]
        ys = y if whole else y[small]
        coefs = [al * (al - 1) / 2.0]
        for k in range(2, 12):
            coefs.append(coefs[-1] * (al - k) / (k + 1))
        poly = np.broadcast_to(coefs[-1], ys.shape).copy()
        for c in reversed(coefs[:-1]):
            poly *= ys
            poly += c
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.log(poly, out=poly)
            values += 2 * np.log(np.abs(ys))
        out[small] = values[small] if whole else values
    big = ~small
    if n_small < small.size:
        yb, ayb, ab = y[big], ay[big], np.broadcast_to(alpha, y.shape)[big]
        t = ab * np.log1p(yb)
        with np.errstate(over="ignore", invalid="ignore"):
            direct = np.log(np.expm1(np.minimum(t, 50)) - ayb)
            huge = t + np.log1p(-(1 + ayb) * np.exp(-np.maximum(t, 50)))
        out[big] = np.where(t > 50, huge, direct)
    return out


def _log_am1_quadrature(q: np.ndarray, sigma: np.ndarray, alpha) -> np.ndarray:
    """log(A_α − 1) by Laplace-centred Gauss–Hermite quadrature; requires α ≤ 2σ² (α per element)."""
    alpha = np.broadcast_to(np.asarray(alpha, dtype=float), q.shape)
    logit_q = np.log(q) - np.log1p(-q)
    u_max = alpha / sigma
    u = np.minimum(alpha * q / sigma, u_max)
    for _ in range(30):  # Newton on h'(u) = −u + α·s(u)/σ (decreasing: h is log-concave)
        s = _expit(logit_q + u / sigma - 0.5 / sigma**2)
        grad = -u + alpha * s / sigma
        curv = -1 + alpha * s * (1 - s) / sigma**2
        step = grad / curv
        u = np.clip(u - step, 0.0, u_max)
        if np.all(np.abs(step) < 1e-10 * (1 + u)):
            break
    s = _expit(logit_q + u / sigma - 0.5 / sigma**2)
    tau = 1.0 / np.sqrt(1.0 - alpha * s * (1 - s) / sigma**2)
    nodes = u[:, None] + tau[:, None] * _GH_NODES[None, :]
    # Quadrature weights for the measure φ(u)du at the shifted, scaled nodes (in place, in the order of
    # log τ + log w_k − nodes²/2 + x_k²/2).
    log_w = np.log(tau)[:, None] + _LOG_GH_WEIGHTS[None, :]
    log_w -= np.multiply(np.square(nodes), 0.5)
    log_w += _HALF_GH_NODES_SQ[None, :]
    y = nodes  # x = nodes/σ − 1/(2σ²), then y = q·(e^x − 1), in place
    y /= sigma[:, None]
    y -= (0.5 / sigma**2)[:, None]
    np.expm1(y, out=y)
    y *= q[:, None]
    log_w += _log_phi2(alpha[:, None], y)
    return logsumexp(log_w, axis=1)


def logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """log Σ exp(x) along ``axis`` (a lean version of scipy's, which costs more per call)."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m), axis=axis)) + np.squeeze(m, axis=axis)


def _expit(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * z))


def _log_erfc(x: np.ndarray) -> np.ndarray:
    return math.log(2) + log_ndtr(-x * math.sqrt(2))


def _log_am1_series(q: np.ndarray, sigma: np.ndarray, alpha) -> np.ndarray:
    """log(A_α − 1) for fractional α (scalar or per element) by Mironov et al.'s signed series (§3.3)."""
    alpha = np.broadcast_to(np.asarray(alpha, dtype=float), q.shape)
    logq, log1mq = np.log(q)[:, None], np.log1p(-q)[:, None]
    s2 = (sigma**2)[:, None]
    z0 = s2 * (log1mq - logq) + 0.5
    rt2s = math.sqrt(2) * sigma[:, None]
    # Past this index neither half of the series can grow again (erfc cut-offs passed).
    i_safe = np.ceil(np.maximum.reduce([alpha, z0[:, 0], alpha - z0[:, 0]]) + 10 * sigma + 2)
    lg_a = gammaln(alpha + 1)[:, None]
    pos = np.full(q.size, -np.inf)
    neg = np.full(q.size, -np.inf)
    last = np.full(q.size, -np.inf)
    active = np.arange(q.size)
    i0 = 0
    i_cap = int(i_safe.max()) + _SERIES_EXTRA_TERMS
    while active.size and i0 < i_cap:
        # a short first chunk (most series converge there), then 64s; fixed boundaries keep
        # every row's result independent of the batch it is evaluated in
        chunk = _CHUNK if i0 else 32
        i = np.arange(i0, i0 + chunk, dtype=float)[None, :]
        a = active
        j = alpha[a][:, None] - i
        # log|C(α, i)| and its sign: the chunk's first term by log-gamma, the rest by the ratio
        # C(α, i)/C(α, i−1) = (α − i + 1)/i (a cumulative sum: cheaper than log-gamma per term)
        first = lg_a[a] - gammaln(i[:, :1] + 1) - gammaln(j[:, :1] + 1)
        ratio = j[:, :-1] / i[:, 1:]  # (α − i + 1)/i for the chunk's later terms
        logc = np.concatenate([first, first + np.cumsum(np.log(np.abs(ratio)), axis=1)], axis=1)
        flips = np.concatenate([gammasgn(j[:, :1] + 1) < 0, ratio < 0], axis=1)
        sign = np.where(np.cumsum(flips, axis=1) % 2 == 1, -1.0, 1.0)
        log_s0 = (
            logc
            + i * logq[a]
            + j * log1mq[a]
            + (i * i - i) / (2 * s2[a])
            + math.log(0.5)
            + _log_erfc((i - z0[a]) / rt2s[a])
        )
        log_s1 = (
            logc
            + j * logq[a]
            + i * log1mq[a]
            + (j * j - j) / (2 * s2[a])
            + math.log(0.5)
            + _log_erfc((z0[a] - j) / rt2s[a])
        )
        both = np.concatenate([log_s0, log_s1], axis=1)
        sgn2 = np.concatenate([sign, sign], axis=1)
        pos[a] = np.logaddexp(pos[a], logsumexp(np.where(sgn2 > 0, both, -np.inf), axis=1))
        neg[a] = np.logaddexp(neg[a], logsumexp(np.where(sgn2 < 0, both, -np.inf), axis=1))
        last[a] = np.maximum(log_s0[:, -1], log_s1[:, -1])
        with np.errstate(invalid="ignore", divide="ignore"):  # running log(A − 1); NaN while ≤ 0
            total = pos[a] + np.log1p(-np.exp(np.logaddexp(0.0, neg[a]) - pos[a]))
        converged = (
            (i0 + chunk > i_safe[a])
            & (log_s0[:, -1] <= log_s0[:, -2])
            & (log_s1[:, -1] <= log_s1[:, -2])
            & (last[a] < total - _SERIES_TOL)
        )
        active = a[~converged]
        i0 += chunk
    if active.size:
        log.debug(
            "RDP series hit its term cap for %d (q, sigma) pairs at order %g; "
            "the alternating tail is bounded by its last term",
            active.size,
            float(alpha.max()),
        )
    # Past i_safe both halves alternate with decreasing size, so each remainder is at most its
    # last term: adding both keeps the result an upper bound of A.
    pos = np.logaddexp(pos, last + math.log(2))
    # A = pos − neg; A − 1 computed as (pos − 1) − neg in log space.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        a_val = np.exp(pos) - np.exp(neg)  # A ≥ 1, bounded because σ is small here only if RDP big
        log_am1 = np.where(
            pos - np.logaddexp(0.0, neg) > 1e-6,
            pos + np.log1p(-np.exp(np.logaddexp(0.0, neg) - pos)),
            np.log(np.maximum(a_val - 1, 0)),
        )
    bad = ~np.isfinite(log_am1) & (pos > 0)
    if bad.any():  # cancellation left nothing reliable: fall back to the absolute sum (upper bound)
        log_am1[bad] = np.log(np.expm1(np.logaddexp(pos[bad], neg[bad])))
    return log_am1
