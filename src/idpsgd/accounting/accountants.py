"""Accountants for a list of heterogeneous SGM events, in a registry (``ACCOUNTANTS``).

* ``rdp`` — our vectorized RDP (:mod:`.rdp`) and the improved conversion; an upper bound on ε.
* ``pld`` — privacy loss distributions through dp_accounting's ``PLDAccountant`` (pessimistic
  estimate, so also an upper bound up to its discretization); tighter than RDP, slower, for
  group-level use.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..validation import InvalidParameterError, check_delta
from .conversion import rdp_to_epsilon
from .events import SampledGaussianEvent
from .rdp import DEFAULT_ORDERS, compute_rdp

#: PLD discretization of the privacy loss.  dp_accounting defaults to 1e-4; 1e-3 is 10-30x faster
#: and, being a pessimistic estimate too, still an upper bound (looser by ~1e-5 relative here).
PLD_DISCRETIZATION = 1e-3


def rdp_epsilon(events: Sequence[SampledGaussianEvent], delta: float, orders=DEFAULT_ORDERS):
    """(ε, best order) of the composition of ``events`` by RDP."""
    delta = check_delta(delta)
    rdp = np.zeros(np.size(orders))
    for ev in events:
        rdp += compute_rdp(ev.sample_rate, ev.noise_multiplier, orders, steps=ev.count)
    eps, order = rdp_to_epsilon(rdp, orders, delta)
    return float(eps), float(order)


def pld_epsilon(events: Sequence[SampledGaussianEvent], delta: float,
                discretization: float | None = None) -> float:
    """ε of the composition of ``events`` by dp_accounting's PLD accountant."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    delta = check_delta(delta)
    parts = [dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(ev.sample_rate, dp_event.GaussianDpEvent(ev.noise_multiplier)),
        int(ev.count)) for ev in events
        if ev.count > 0 and ev.sample_rate > 0 and np.isfinite(ev.noise_multiplier)]
    if not parts:
        return 0.0
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization or PLD_DISCRETIZATION)
    acc.compose(dp_event.ComposedDpEvent(parts))
    return float(max(acc.get_epsilon(delta), 0.0))


def _rdp(events, delta):
    return rdp_epsilon(events, delta)[0]


ACCOUNTANTS: dict[str, Callable[[Sequence[SampledGaussianEvent], float], float]] = {
    "rdp": _rdp,
    "pld": pld_epsilon,
}


def get_accountant(name: str) -> Callable[[Sequence[SampledGaussianEvent], float], float]:
    try:
        return ACCOUNTANTS[name]
    except KeyError:
        raise ValueError(f"accountant={name!r} is invalid: must be one of {sorted(ACCOUNTANTS)}") from None


def epsilon_sgm(sample_rate, noise_multiplier, steps, delta: float, accountant: str = "rdp") -> np.ndarray:
    """ε after ``steps`` SGM steps for arrays of (q, σ) (vectorized for rdp, a loop for pld)."""
    delta = check_delta(delta)
    if np.any(np.asarray(steps) < 0) or np.any(np.asarray(steps) != np.round(steps)):
        raise InvalidParameterError("steps", steps, "must be integers >= 0")
    q, s, t = np.broadcast_arrays(np.asarray(sample_rate, float), np.asarray(noise_multiplier, float),
                                  np.asarray(steps, float))
    if accountant == "rdp":
        return rdp_to_epsilon(compute_rdp(q, s, DEFAULT_ORDERS, steps=t), DEFAULT_ORDERS, delta)[0]
    fn = get_accountant(accountant)
    out = np.array([fn([SampledGaussianEvent(float(a), float(b), int(c))], delta)
                    for a, b, c in zip(q.ravel(), s.ravel(), t.ravel())])
    return out.reshape(q.shape)
