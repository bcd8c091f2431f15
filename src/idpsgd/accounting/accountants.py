"""Accountants for a list of heterogeneous SGM events, in a registry (``ACCOUNTANTS``).

* ``rdp`` — our exact RDP (:mod:`.rdp`) and the improved conversion at **adaptive orders**: the
  best order of the fine order universe around the grid's best (:mod:`.orders`), so ε is never
  above the fixed grid's and typically 1–15 % below it.  ``refine=False`` gives the grid's ε.
* ``pld`` — privacy loss distributions through dp_accounting (pessimistic connect-the-dots
  discretization, so an upper bound); tighter than RDP.  The grids are sized before they are
  built and refused above :data:`PLD_MAX_POINTS` (a clear error naming the parameter).

:func:`max_steps_within` answers "how many more steps fit in a budget" for either accountant.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from ..names import ACCOUNTANTS as ACCOUNTANT_NAMES
from ..validation import InvalidParameterError, UnreachableTargetError, check_delta, check_positive, shown_value
from .conversion import rdp_to_epsilon
from .events import MIN_NOISE_MULTIPLIER as MIN_NOISE_MULTIPLIER  # re-exported
from .events import SampledGaussianEvent, check_min_sigma
from .orders import CachedRdp, search_orders, sgm_rdp_at
from .prv import prv_epsilon
from .rdp import DEFAULT_ORDERS, compute_rdp

#: PLD discretization of the privacy loss.  dp_accounting defaults to 1e-4; 1e-3 is 10-30x faster
#: and, being a pessimistic estimate too, still an upper bound (looser by ~1e-5 relative here).
PLD_DISCRETIZATION = 1e-3
#: Largest PLD grid (points of one probability mass function, before or after composition) we
#: build: 2^23 points are 64 MiB of float64 (the FFTs need a few times that).
PLD_MAX_POINTS = 2**23
#: Tail mass that dp_accounting truncates per composition (moved to the infinite loss).
_TAIL_MASS = 1e-15


def _event_arrays(events: Sequence[SampledGaussianEvent]):
    ev = [e for e in events if e.count > 0 and e.sample_rate > 0 and np.isfinite(e.noise_multiplier)]
    return ev, (
        np.array([[e.sample_rate for e in ev]]),
        np.array([[e.noise_multiplier for e in ev]]),
        np.array([[e.count for e in ev]], dtype=float),
    )


def rdp_epsilon(
    events: Sequence[SampledGaussianEvent], delta: float, orders=DEFAULT_ORDERS, refine: bool = True
) -> tuple[float, float]:
    """(ε, order) of the composition of ``events`` by RDP.

    By default the order is adaptive: the best of the order universe of ``orders`` (grid,
    integers and a lattice spaced by 2^(1/64) − 1 ≈ 1.1 %, :mod:`.orders`) found by a search started at the
    grid's best order; every value is exact at its order, so ε is a valid bound and never
    above the grid's.  ``refine=False`` returns the grid's (ε, order).
    """
    delta = check_delta(delta)
    ev, (q, s, c) = _event_arrays(events)
    if not ev:
        return 0.0, float(np.min(orders))
    check_min_sigma(s)
    if not refine:
        rdp = np.zeros(np.size(orders))
        for e in ev:
            rdp += compute_rdp(e.sample_rate, e.noise_multiplier, orders, steps=e.count)
        eps, order = rdp_to_epsilon(rdp, orders, delta)
        return float(eps), float(order)
    res = search_orders(sgm_rdp_at(q, s, c, orders), 1, delta, orders)
    return float(res.epsilon[0]), float(res.order[0])


# --- PLD ------------------------------------------------------------------------------------
def single_pmf_points(sample_rate: float, noise_multiplier: float, discretization: float) -> float:
    """Points of dp_accounting's connect-the-dots PMF of one SGM step (both directions), before building it."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    worst = 0.0
    for adj in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD) if sample_rate < 1 else (plm.AdjacencyType.REMOVE,):
        b = plm.GaussianPrivacyLoss(
            noise_multiplier, sampling_prob=sample_rate, adjacency_type=adj, log_mass_truncation_bound=-50
        ).connect_dots_bounds()
        worst = max(worst, (b.epsilon_upper - b.epsilon_lower) / discretization + 2)
    return worst


def _pmfs(pld):
    return [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]


def _composed_points(pld, count: int) -> int:
    """Length of the FFT dp_accounting's ``self_compose(count)`` would use (its own Chernoff bounds)."""
    from dp_accounting.pld import common
    from scipy import fft

    worst = 0
    for pmf in _pmfs(pld):
        probs = pmf.to_dense_pmf()._probs
        if len(probs) * int(count) <= PLD_MAX_POINTS:  # the composition's full extent fits
            worst = max(worst, fft.next_fast_len(len(probs) * int(count)))
            continue
        lo, hi = common.compute_self_convolve_bounds(probs, int(count), _TAIL_MASS)
        worst = max(worst, fft.next_fast_len(max(int(hi) - int(lo) + 1, len(probs))))
    return worst


def sgm_pld(
    sample_rate: float,
    noise_multiplier: float,
    count: int,
    discretization: float | None = None,
    names=("sample_rate", "noise_multiplier", "steps"),
    single=None,
):
    """dp_accounting ``PrivacyLossDistribution`` of ``count`` SGM steps, with its grid sizes checked first.

    Raises :class:`InvalidParameterError` naming ``names[1]`` (one step's grid too large) or
    ``names[2]`` (the composition's) when more than :data:`PLD_MAX_POINTS` points would be needed.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    d = discretization or PLD_DISCRETIZATION
    if single is not None:  # the caller's one-step PLD of the same mechanism (already checked)
        pld = single
    else:
        check_min_sigma(noise_multiplier, names[1])
        one = single_pmf_points(sample_rate, noise_multiplier, d)
        if one > PLD_MAX_POINTS:
            raise InvalidParameterError(
                names[1],
                noise_multiplier,
                f"is too small for PLD accounting at {names[0]}={sample_rate:g}: one step's privacy loss "
                f"distribution would need {one:.3g} grid points (limit {PLD_MAX_POINTS}); use the rdp accountant",
            )
        pld = pld_lib.from_gaussian_mechanism(
            standard_deviation=noise_multiplier, value_discretization_interval=d, sampling_prob=sample_rate
        )
    if count > 1:
        composed = _composed_points(pld, count)
        if composed > PLD_MAX_POINTS:
            raise InvalidParameterError(
                names[2],
                count,
                f"is too many for PLD accounting of this mechanism: the composition would need "
                f"{composed:.3g} grid points (limit {PLD_MAX_POINTS}); use the rdp accountant",
            )
        pld = pld.self_compose(int(count))
    return pld


def _compose_checked(a, b):
    size = max(x.size for x in _pmfs(a)) + max(x.size for x in _pmfs(b))
    if size > PLD_MAX_POINTS:
        raise InvalidParameterError(
            "events",
            f"{size} grid points",
            f"the PLD composition would exceed {PLD_MAX_POINTS} points; use the rdp accountant",
        )
    return a.compose(b)


def pld_epsilon(events: Sequence[SampledGaussianEvent], delta: float, discretization: float | None = None) -> float:
    """ε of the composition of ``events`` by dp_accounting's PLD (the same construction as its
    ``PLDAccountant``: each event's PLD self-composed, then composed in order)."""
    delta = check_delta(delta)
    triples = tuple((float(e.sample_rate), float(e.noise_multiplier), int(e.count)) for e in events)
    return _pld_epsilon_of(triples, float(delta), None if discretization is None else float(discretization))


@functools.lru_cache(maxsize=1024)
def _pld_epsilon_of(triples: tuple[tuple[float, float, int], ...], delta: float, discretization: float | None) -> float:
    """:func:`pld_epsilon` of events given as (q, σ, count): a pure function of its arguments, memoized (a
    run's plan and its engine, and each run of a session at the same settings, ask again)."""
    pld = _events_pld([SampledGaussianEvent(q, sigma, count) for q, sigma, count in triples], discretization)
    if pld is None:
        return 0.0
    return float(max(pld.get_epsilon_for_delta(delta), 0.0))


def _events_pld(events, discretization):
    """The composed PLD (None when no event costs privacy), built as dp_accounting's accountant
    does: the identity composed with each event's self-composed PLD in order."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    parts = [
        sgm_pld(ev.sample_rate, ev.noise_multiplier, int(ev.count), discretization)
        for ev in events
        if ev.count > 0 and ev.sample_rate > 0 and np.isfinite(ev.noise_multiplier)
    ]
    if not parts:
        return None
    pld = pld_lib.identity(value_discretization_interval=discretization or PLD_DISCRETIZATION)
    for part in parts:
        pld = _compose_checked(pld, part)
    return pld


def _rdp(events, delta):
    return rdp_epsilon(events, delta)[0]


#: Each accountant's ε of a list of events, keyed by its name (:data:`idpsgd.names.ACCOUNTANTS`);
#: prv: Gopi et al. 2021 via Opacus's PRV code, its upper bound (:mod:`.prv`).
ACCOUNTANTS: dict[str, Callable[[Sequence[SampledGaussianEvent], float], float]] = dict(
    zip(ACCOUNTANT_NAMES, (_rdp, pld_epsilon, prv_epsilon), strict=True)
)


def get_accountant(name: str) -> Callable[[Sequence[SampledGaussianEvent], float], float]:
    try:
        return ACCOUNTANTS[name]
    except (KeyError, TypeError):
        raise InvalidParameterError("accountant", name, f"must be one of {', '.join(sorted(ACCOUNTANTS))}") from None


def epsilon_sgm(
    sample_rate, noise_multiplier, steps, delta: float, accountant: str = "rdp", refine: bool = True
) -> np.ndarray:
    """ε after ``steps`` SGM steps for arrays of (q, σ, steps), broadcast.

    ``rdp``: vectorized, adaptive orders (``refine=False``: the default grid); ``pld``: one
    dp_accounting PLD per element.
    """
    delta = check_delta(delta)
    get_accountant(accountant)
    st = np.asarray(steps, dtype=float)
    if np.any(~np.isfinite(st)) or np.any(st < 0) or np.any(st != np.round(st)):
        raise InvalidParameterError("steps", steps, "must be integers >= 0")
    q, s, t = np.broadcast_arrays(np.asarray(sample_rate, float), np.asarray(noise_multiplier, float), st)
    from ..validation import check_noise_multiplier, check_sample_rate

    check_sample_rate(q, allow_zero=True)
    check_noise_multiplier(s)
    check_min_sigma(s)
    if accountant == "rdp":
        if not refine:
            return rdp_to_epsilon(compute_rdp(q, s, DEFAULT_ORDERS, steps=t), DEFAULT_ORDERS, delta)[0]
        flat = [a.ravel()[:, None] for a in (q, s, t)]
        res = search_orders(sgm_rdp_at(*flat), flat[0].shape[0], delta)
        return res.epsilon.reshape(q.shape)
    fn = get_accountant(accountant)
    triples, inverse = np.unique(np.stack([q.ravel(), s.ravel(), t.ravel()], axis=1), axis=0, return_inverse=True)
    out = np.array([fn([SampledGaussianEvent(float(a), float(b), int(c))], delta) for a, b, c in triples])
    return out[inverse.ravel()].reshape(q.shape)


# --- how many steps fit in a budget -----------------------------------------------------------
def max_steps_within(
    events_before: Sequence[SampledGaussianEvent],
    step_sample_rate: float,
    step_noise_multiplier: float,
    budget: float,
    delta: float,
    accountant: str = "rdp",
    limit: int = 10**9,
) -> int:
    """Largest integer T ≥ 0 with ε(events_before + T steps of SGM(q, σ)) ≤ ``budget``.

    ε is the accountant's (``rdp``: adaptive orders, exactly :func:`rdp_epsilon`; ``pld``:
    :func:`pld_epsilon`).  Exponential search for the first T over budget, then binary search;
    every answer T is checked: ε(T) ≤ budget and ε(T + 1) > budget.

    Raises:
        UnreachableTargetError: when the events before already exceed the budget (not even 0
            more steps fit), or when more than ``limit`` steps would fit.
        InvalidParameterError: for bad arguments, or a step that costs no privacy (q = 0 or
            σ = inf: every T fits).
    """
    delta = check_delta(delta)
    budget = check_positive(budget, "budget")
    get_accountant(accountant)
    q, sigma = float(step_sample_rate), float(step_noise_multiplier)
    if not 0 <= q <= 1 or math.isnan(q):
        raise InvalidParameterError("sample_rate", q, "must be in [0, 1]")
    if not sigma > 0:
        raise InvalidParameterError("noise_multiplier", sigma, "must be > 0")
    if q == 0 or math.isinf(sigma):
        raise InvalidParameterError(
            "sample_rate" if q == 0 else "noise_multiplier",
            q if q == 0 else sigma,
            "gives a step without privacy cost: every number of steps fits the budget",
        )
    events_before = list(events_before)
    eps_at = _steps_epsilon_fn(events_before, q, sigma, delta, accountant)

    e0 = eps_at(0)
    if e0 > budget:
        raise UnreachableTargetError(
            f"budget={shown_value(budget)} is already exceeded before the next step: the events so far spend "
            f"epsilon={e0:.6g} ({accountant}, delta={delta:g}); not even 0 more steps fit"
        )
    lo, hi = 0, 1
    while True:
        if hi > limit:
            if eps_at(limit) <= budget:
                raise UnreachableTargetError(
                    f"budget={shown_value(budget)} is not exhausted by limit={limit} more steps "
                    f"({accountant}, delta={delta:g}); raise the limit"
                )
            hi = limit
            break
        if eps_at(hi) > budget:
            break
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # invariant: ε(lo) ≤ budget < ε(hi)
        mid = (lo + hi) // 2
        if eps_at(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _steps_epsilon_fn(events_before, q, sigma, delta, accountant):
    """ε(T) for T more steps, memoized; reuses the RDP of the events before at every order."""
    memo: dict[int, float] = {}
    if accountant == "rdp":
        check_min_sigma(sigma)
        for ev in events_before:
            check_min_sigma(ev.noise_multiplier)
        before = CachedRdp(events_before)
        step = CachedRdp([SampledGaussianEvent(q, sigma, 1)])

        def eps_at(t: int) -> float:
            if t not in memo:
                res = search_orders(lambda rows, k: before.value(k) + t * step.value(k), 1, delta)
                memo[t] = float(res.epsilon[0])
            return memo[t]

        return eps_at
    if accountant == "prv":

        def eps_prv(t: int) -> float:
            if t not in memo:
                memo[t] = prv_epsilon([*events_before, SampledGaussianEvent(q, sigma, t)], delta)
            return memo[t]

        return eps_prv

    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    base = _events_pld(events_before, None)
    if base is None:
        base = pld_lib.identity(value_discretization_interval=PLD_DISCRETIZATION)
    one = sgm_pld(q, sigma, 1, None)  # built once; each T self-composes it

    def eps_pld(t: int) -> float:
        if t not in memo:
            pld = base if t == 0 else _compose_checked(base, sgm_pld(q, sigma, t, None, single=one))
            memo[t] = float(max(pld.get_epsilon_for_delta(delta), 0.0))
        return memo[t]

    return eps_pld
