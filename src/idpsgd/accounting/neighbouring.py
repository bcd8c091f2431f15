"""The neighbouring relation every reported guarantee is stated for: *zero-out*.

Two data sets are neighbours when one is the other with one example replaced by a *null* example:
still sampled with its rate, it adds nothing to the sum of clipped gradients (Kairouz et al. 2021,
"Practical and private (deep) learning without sampling or shuffling", §4; Ponomareva et al. 2023,
"How to DP-fy ML", §5.1).  The number of examples N and each budget group's size are the same on
both sides: they are public inputs of the guarantee, and so are the values calibrated from them
(σ, the sampling rates, the expected batch size, the planned steps).

For the Poisson-subsampled Gaussian mechanism the pair of output distributions of a zero-out pair
(D with example i, D with i's null) is exactly the pair of an add/remove pair (D with i, D without
i): a null example changes no batch sum.  So the add/remove RDP/PLD analysis of the accountants
(:mod:`idpsgd.accounting.rdp`, :mod:`idpsgd.accounting.pld_individual`) bounds the zero-out
privacy loss unchanged, and every reported ε holds for this relation.  See docs/guarantees.md,
"Neighbouring data sets".
"""

from __future__ import annotations

NEIGHBOURING = "zero-out"
PUBLIC_INPUTS = (
    "N: the number of training examples",
    "the size of each budget group",
    "what is calibrated from them: the noise multiplier, the sampling rates and clip norms, the "
    "expected batch size and the planned steps",
)
NEIGHBOURING_SENTENCE = (
    "Neighbouring data sets: zero-out — one example replaced by a null example that is still sampled "
    "but adds nothing to the gradient sum (Kairouz et al. 2021); the number of examples N and each "
    "budget group's size are public inputs of the guarantee."
)


#: user level: the unit of neighbouring is a user, all of its rows at once
USER_NEIGHBOURING = "zero-out of one user (all of the user's rows)"
USER_PUBLIC_INPUTS = (
    "U: the number of users",
    "the number of users in each budget group",
    "k: the most rows of one user in one step",
    "what is calibrated from them: the noise multiplier, the per-user sampling rates and clip norms, the "
    "expected number of users per step and the planned steps",
)


def neighbouring(privacy_unit: str = "example") -> dict:
    """The fields every public report that states a guarantee carries: ``neighbouring`` and
    ``public_inputs`` (``privacy_unit="user"``: a user — all of its rows — is the unit; the number of
    rows and each user's row count are not inputs of the guarantee and are never released)."""
    if privacy_unit == "user":
        return {"privacy_unit": "user", "neighbouring": USER_NEIGHBOURING, "public_inputs": list(USER_PUBLIC_INPUTS)}
    return {"privacy_unit": "example", "neighbouring": NEIGHBOURING, "public_inputs": list(PUBLIC_INPUTS)}


__all__ = [
    "NEIGHBOURING",
    "NEIGHBOURING_SENTENCE",
    "PUBLIC_INPUTS",
    "USER_NEIGHBOURING",
    "USER_PUBLIC_INPUTS",
    "neighbouring",
]
