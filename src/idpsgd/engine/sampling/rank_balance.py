"""Which rank samples which unit (example or user) with data parallelism: equal expected loads.

Every unit i is decided by exactly one rank, at its own rate q_i, so the union over ranks is one
Poisson draw (Boenisch et al. 2023, Alg. 3; docs/distributed.md).  *Which* rank holds i does not
change the mechanism, but it sets the ranks' expected batch sizes Σ_{i on r} q_i, and every step waits
for the slowest rank.  Dealing i ↦ i mod W makes them uneven when the rates follow the row order
(alternating budgets gave one rank every high-rate example: 1.96× the cost instead of 1.17×).

:func:`rank_owners` deals the units in *snake order* of their rates: sorted by q descending (stable:
ties by index), round k of W units goes to ranks 0..W-1 when k is even and W-1..0 when k is odd.
Guarantee: any two ranks' expected loads differ by at most max_i q_i (one unit's rate), and their
numbers of units by at most one.  Proof: pad the last round with zero rates; in an even round rank a < b
gets the larger rate, in an odd round the smaller, so load_a − load_b is an alternating sum of the
rounds' differences d_k ≥ 0, each at most the round's range; the rounds' ranges are disjoint intervals
of [0, max q] (the rates descend), so the sum lies in [−max q, max q].

The assignment is a deterministic function of public inputs only — the rates (from the budgets) and
W, never the data — so every rank computes the same one, and no seed is involved.
"""

from __future__ import annotations

import numpy as np

from ...validation import InvalidParameterError


def rank_owners(rates, world_size: int) -> np.ndarray:
    """The rank (0..W-1) that samples each unit, dealt in snake order of the rates (module docstring)."""
    q = np.asarray(rates, dtype=np.float64).ravel()
    world = int(world_size)
    if world < 1:
        raise InvalidParameterError("world_size", world_size, "must be an integer >= 1")
    order = np.argsort(-q, kind="stable")  # descending rates, ties by index
    pos = np.arange(q.size)
    within, forward = pos % world, (pos // world) % 2 == 0
    owners = np.empty(q.size, dtype=np.int64)
    owners[order] = np.where(forward, within, world - 1 - within)
    return owners


def rank_shard(rates, rank: int, world_size: int) -> np.ndarray:
    """The units rank ``rank`` samples, ascending (:func:`rank_owners`)."""
    if not 0 <= int(rank) < int(world_size):
        raise InvalidParameterError("rank", rank, f"must be in [0, {world_size})")
    return np.flatnonzero(rank_owners(rates, world_size) == int(rank)).astype(np.int64)


def expected_loads(rates, world_size: int) -> np.ndarray:
    """Each rank's expected batch size Σ_{i on r} q_i (float64, length W)."""
    q = np.asarray(rates, dtype=np.float64).ravel()
    return np.bincount(rank_owners(q, world_size), weights=q, minlength=int(world_size))


__all__ = ["expected_loads", "rank_owners", "rank_shard"]
