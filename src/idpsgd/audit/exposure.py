"""Exposure of secret canaries (Carlini et al. 2019, "The Secret Sharer", §4; numpy/scipy only).

A canary is a secret s drawn uniformly from a candidate space R of |R| sequences of one format
("my code is ⟨k random digits⟩").  The model orders R by its likelihood; the canary's **rank** is
its position in that order (1: the most likely) and its **exposure** is

    exposure(s) = log₂|R| − log₂ rank(s)                                         (Def. 4.2)

between 0 (the least likely candidate) and log₂|R| (the most likely): a model that learnt nothing of
s ranks it in the middle (exposure ≈ 1); a model that memorised it ranks it first.  Ties share the
mean of the positions they occupy (midrank), so a model that cannot tell candidates apart gives
every one exposure ≈ 1, never the maximum.

* :func:`exact_exposure` — the rank by brute force over every candidate of R (small spaces).
* :func:`estimated_exposure` — an **estimate** from candidates sampled uniformly from R (§4.3): the
  fraction p̂ of sampled candidates more likely than s (ties half) gives rank ≈ ½ + |R|·p̂, whose
  expectation is the exact midrank.  Where no sampled candidate is more likely than s the sample
  cannot resolve the rank; there the paper's **extrapolation** applies: a skew-normal distribution
  fitted to the sampled candidates' log-likelihoods gives the tail probability (§4.3, "Exposure by
  extrapolation"), and the row is flagged ``extrapolated``.

Scores are log-likelihoods (higher: more likely), one per candidate, shared by every canary of the
format: the model is scored on R (or the sample) once.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from ..validation import InvalidParameterError


def _space(space_size) -> float:
    if isinstance(space_size, bool) or not float(space_size) >= 2 or float(space_size) != math.floor(space_size):
        raise InvalidParameterError("space_size", space_size, "must be an integer >= 2 (the candidate space |R|)")
    return float(space_size)


def _scores(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    if a.size == 0 or not np.all(np.isfinite(a)):
        raise InvalidParameterError(name, f"{a.size} values", "must be a non-empty array of finite log-likelihoods")
    return a


def _greater_and_ties(canary_ll: np.ndarray, candidate_ll: np.ndarray) -> np.ndarray:
    """#{candidates more likely} + ½·#{candidates as likely}, for every canary (sorted, vectorized)."""
    ranked = np.sort(candidate_ll)
    below = np.searchsorted(ranked, canary_ll, side="left")  # strictly less likely
    not_above = np.searchsorted(ranked, canary_ll, side="right")  # less or as likely
    return (ranked.size - not_above) + 0.5 * (not_above - below)


def exact_exposure(canary_ll, candidate_ll) -> dict:
    """Exposure by brute force: ``candidate_ll`` holds the log-likelihood of every candidate of R
    (the canaries among them).  rank = 1 + #{r ≠ s more likely} + ½·#{r ≠ s as likely} (midrank).

    Returns ``exposure`` and ``rank`` (arrays, one per canary) and ``space_size`` |R|."""
    s, c = _scores(canary_ll, "canary_ll"), _scores(candidate_ll, "candidate_ll")
    if c.size < 2:
        raise InvalidParameterError("candidate_ll", c.size, "the candidate space needs at least 2 candidates")
    count = _greater_and_ties(s, c)
    rank = 0.5 + count  # the canary ties with itself: ½ of that tie is its own position
    if np.any(rank < 1 - 1e-9):
        raise InvalidParameterError(
            "candidate_ll", "the canaries' scores", "every canary must be one of the candidates (its own score in R)"
        )
    rank = np.maximum(rank, 1.0)
    return {
        "exposure": math.log2(c.size) - np.log2(rank),
        "rank": rank,
        "space_size": int(c.size),
        "method": "exact",
    }


def estimated_exposure(canary_ll, sample_ll, space_size, *, extrapolate: bool = True) -> dict:
    """An **estimate** of exposure from log-likelihoods of candidates drawn uniformly from R
    (Carlini et al. §4.3): rank ≈ max(1, ½ + |R|·p̂), p̂ the fraction of the sample more likely than the
    canary (ties ½); unbiased for the midrank before the clamp.  Where no sampled candidate is more
    likely (or as likely) the rank is below the sample's resolution |R|/n: with ``extrapolate``,
    p̂ is replaced by the tail probability of a skew-normal fitted to the sample's log-likelihoods
    (the paper's extrapolation), and ``extrapolated`` is True for that canary.

    Returns ``exposure``, ``rank`` (estimates), ``extrapolated`` (bool per canary), ``space_size``,
    ``samples`` and ``method`` ("sampled estimate")."""
    s, c = _scores(canary_ll, "canary_ll"), _scores(sample_ll, "sample_ll")
    size = _space(space_size)
    if c.size < 2:
        raise InvalidParameterError("sample_ll", c.size, "need at least 2 sampled candidates")
    p = _greater_and_ties(s, c) / c.size
    unresolved = p == 0
    if extrapolate and unresolved.any():
        p = p.copy()
        p[unresolved] = skewnormal_tail(s[unresolved], c)
    rank = np.maximum(1.0, 0.5 + size * p)
    return {
        "exposure": math.log2(size) - np.log2(rank),
        "rank": rank,
        "extrapolated": unresolved & bool(extrapolate),
        "space_size": int(size) if size < 2**63 else size,
        "samples": int(c.size),
        "method": "sampled estimate",
    }


def skewnormal_tail(canary_ll, sample_ll) -> np.ndarray:
    """P[ℓ(r) > ℓ(s)] under a skew-normal distribution fitted (maximum likelihood) to the sampled
    candidates' log-likelihoods ℓ (Carlini et al. §4.3 fit the skew-normal to log-perplexity −ℓ)."""
    a, loc, scale = stats.skewnorm.fit(np.asarray(sample_ll, float))
    return stats.skewnorm.sf(np.asarray(canary_ll, float), a, loc, scale)


def summarize(values) -> dict:
    """Mean, median, quartiles, min and max of a group's exposures (None for an empty group)."""
    v = np.asarray(values, float)
    if v.size == 0:
        return {"count": 0, "mean": None, "median": None, "q25": None, "q75": None, "min": None, "max": None}
    q25, med, q75 = np.quantile(v, [0.25, 0.5, 0.75])
    return {
        "count": int(v.size),
        "mean": float(v.mean()),
        "median": float(med),
        "q25": float(q25),
        "q75": float(q75),
        "min": float(v.min()),
        "max": float(v.max()),
    }
