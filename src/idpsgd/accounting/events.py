"""Descriptions of the mechanisms composed in DP-SGD (shaped after dp_accounting's dp_event)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validation import InvalidParameterError, check_noise_multiplier, check_sample_rate

#: Smallest noise multiplier accounted by the scalar API: below it one step alone costs ε > 1e5
#: at any useful δ, and the numbers are meaningless.
MIN_NOISE_MULTIPLIER = 1e-3


def check_min_sigma(noise_multiplier, name: str = "noise_multiplier") -> None:
    """Refuse a noise multiplier below :data:`MIN_NOISE_MULTIPLIER` (here, below the accountants that
    share it: :mod:`.accountants`, :mod:`.prv`, :mod:`.calibration`)."""
    s = np.asarray(noise_multiplier, dtype=float)
    small = s < MIN_NOISE_MULTIPLIER
    if np.any(small):
        v = float(s[small].ravel()[0])
        raise InvalidParameterError(
            name,
            v,
            f"must be >= {MIN_NOISE_MULTIPLIER:g}: below it the privacy loss is "
            "astronomically large and no accountant reports a meaningful epsilon",
        )


@dataclass(frozen=True)
class SampledGaussianEvent:
    """``count`` steps of the Poisson-subsampled Gaussian mechanism.

    Each step includes the example with probability ``sample_rate`` and adds Gaussian noise of
    standard deviation ``noise_multiplier`` × (the example's sensitivity).
    """

    sample_rate: float
    noise_multiplier: float
    count: int = 1

    def __post_init__(self):
        check_sample_rate(self.sample_rate, allow_zero=True)
        check_noise_multiplier(self.noise_multiplier)
        if int(self.count) != self.count or self.count < 0:
            raise ValueError(f"count={self.count!r} is invalid: must be an integer >= 0")
