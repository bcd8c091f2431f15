"""Descriptions of the mechanisms composed in DP-SGD (shaped after dp_accounting's dp_event)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_noise_multiplier, check_sample_rate


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
