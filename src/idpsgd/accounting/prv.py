"""The PRV accountant: ε of a composition of sampled Gaussian events by numerical composition of
privacy random variables (Gopi, Lee & Wutschitz 2021, "Numerical composition of differential
privacy"), Opacus 1.6's default accountant.

Each event's privacy loss random variable (the Poisson-subsampled Gaussian PRV, Gopi et al.
Prop. B.1/B.4) is truncated to a safe domain [−L, L] (Remark 5.6), discretized on one grid of
mesh ``eps_error / sqrt(T·log(12/δ_err)/2)`` and the events are composed by FFT; the paper's error
bounds give an interval [eps_lower, eps_upper] around the estimate.  :func:`prv_epsilon` returns
**eps_upper** (the ε at δ − δ_err plus ``eps_error``), the upper bound, exactly as Opacus's
``PRVAccountant.get_epsilon`` does: it is the valid ε for δ; the estimate is never reported.

The discretization, truncation, composition and the ε search are Opacus's own code
(``opacus.accountants.analysis.prv``; imported on first use, so this module stays numpy-only at
import).  Only the safe domain size L differs in *how* it is computed: Opacus computes RDP ε at
its default orders with a scalar loop per order; here the same orders, the same RDP values
(:func:`~.rdp.compute_rdp`, exact) and the same conversion (Balle et al. 2020, Thm. 21, as
Opacus's ``get_privacy_spent``) are vectorized — the same L to rounding, about 50× faster.  The
result agrees with Opacus's ``PRVAccountant`` to floating-point rounding (tests/test_opacus_port.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ..validation import InvalidParameterError, check_delta
from .events import SampledGaussianEvent, check_min_sigma
from .rdp import compute_rdp

#: Opacus's default error bounds: ε within ±EPS_ERROR, δ within ±δ/1000.
EPS_ERROR = 0.01
DELTA_ERROR_FRACTION = 1e-3
#: Opacus's RDPAccountant.DEFAULT_ALPHAS (the safe domain size is an RDP ε at these orders).
OPACUS_ALPHAS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)
#: Largest grid (points) we discretize on: 2^24 float64 points are 128 MiB (the FFT needs a few times that).
PRV_MAX_POINTS = 2**24


def _opacus_conversion(rdp: np.ndarray, delta: float) -> float:
    """ε from RDP at Opacus's orders by its conversion (``get_privacy_spent``: Balle et al. 2020, Thm. 21)."""
    a = OPACUS_ALPHAS
    with np.errstate(invalid="ignore", over="ignore"):
        eps = rdp - (np.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    if np.isnan(eps).all():
        return math.inf
    return float(np.nanmin(eps))


def safe_domain_size(events: Sequence[SampledGaussianEvent], eps_error: float, delta_error: float) -> float:
    """L of the truncation [−L, L] (Gopi et al. Remark 5.6, as Opacus's ``compute_safe_domain_size``:
    the RDP ε of the composition at δ_err/4 and of each single step at δ_err/(8T))."""
    total = sum(int(ev.count) for ev in events)
    one_step = [compute_rdp(ev.sample_rate, ev.noise_multiplier, OPACUS_ALPHAS) for ev in events]
    L = _opacus_conversion(sum(int(ev.count) * r for ev, r in zip(events, one_step, strict=True)), delta_error / 4)
    for r in one_step:
        L = max(L, _opacus_conversion(r, delta_error / (8 * total)))
    return max(L, eps_error) + 3


def prv_epsilons(
    events: Sequence[SampledGaussianEvent], delta: float, eps_error: float = EPS_ERROR, delta_error: float | None = None
) -> tuple[float, float, float]:
    """(eps_lower, eps_estimate, eps_upper) of the composition of ``events`` at ``delta`` (Gopi et al.
    Thm. 5.5 with the truncation of Remark 5.6); ``delta_error`` defaults to δ/1000 (as Opacus)."""
    delta = check_delta(delta)
    if not 0 < float(eps_error) < 1:
        raise InvalidParameterError("eps_error", eps_error, "must be in (0, 1)")
    delta_error = delta * DELTA_ERROR_FRACTION if delta_error is None else float(delta_error)
    if not 0 < delta_error < delta:
        raise InvalidParameterError("delta_error", delta_error, f"must be in (0, delta={delta:g})")
    ev = [e for e in events if e.count > 0 and e.sample_rate > 0 and np.isfinite(e.noise_multiplier)]
    if not ev:
        return 0.0, 0.0, 0.0
    check_min_sigma([e.noise_multiplier for e in ev])
    triples = tuple((float(e.sample_rate), float(e.noise_multiplier), int(e.count)) for e in ev)
    return _prv_epsilons_of(triples, float(delta), float(eps_error), float(delta_error))


@functools.lru_cache(maxsize=1024)
def _prv_epsilons_of(
    triples: tuple[tuple[float, float, int], ...], delta: float, eps_error: float, delta_error: float
) -> tuple[float, float, float]:
    """:func:`prv_epsilons` of checked events given as (q, σ, count): a pure function of its arguments,
    memoized (a run's plan and its engine, and each run of a session at the same settings, ask again)."""
    ev = [SampledGaussianEvent(q, sigma, count) for q, sigma, count in triples]
    from opacus.accountants.analysis.prv import (
        Domain,
        PoissonSubsampledGaussianPRV,
        TruncatedPrivacyRandomVariable,
        compose_heterogeneous,
        discretize,
    )

    counts = [int(e.count) for e in ev]
    total = sum(counts)
    L = safe_domain_size(ev, eps_error, delta_error)
    mesh = eps_error / math.sqrt(total * math.log(12 / delta_error) / 2)
    points = 2 * L / mesh
    if not math.isfinite(points) or points > PRV_MAX_POINTS:
        raise InvalidParameterError(
            "accountant",
            "prv",
            f"would discretize on {points:.3g} grid points (limit "
            f"{PRV_MAX_POINTS}) for these events; use the rdp or pld accountant",
        )
    domain = Domain.create_aligned(-L, L, mesh)
    prvs = [PoissonSubsampledGaussianPRV(e.sample_rate, e.noise_multiplier) for e in ev]
    try:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # log(0) below t = log(1 − q): masked
            dprvs = [discretize(TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max), domain) for p in prvs]
            composed = compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
            lower, estimate, upper = composed.compute_epsilon(delta, delta_error, eps_error)
    except (RuntimeError, ValueError) as exc:
        raise InvalidParameterError(
            "accountant",
            "prv",
            f"cannot bound epsilon at delta={delta:g} for these events ({exc}); use the rdp or pld accountant",
        ) from None
    if not np.isfinite(upper):
        raise InvalidParameterError(
            "accountant",
            "prv",
            f"gives no finite epsilon at delta={delta:g} for these events; use the rdp or pld accountant",
        )
    return float(lower), float(estimate), float(upper)


def prv_epsilon(
    events: Sequence[SampledGaussianEvent], delta: float, eps_error: float = EPS_ERROR, delta_error: float | None = None
) -> float:
    """ε of the composition of ``events`` by the PRV accountant: its upper bound eps_upper (≥ 0)."""
    return max(prv_epsilons(events, delta, eps_error, delta_error)[2], 0.0)
