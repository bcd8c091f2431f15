"""idpsgd — individualized privacy for DP-SGD.

Assign a privacy budget per example and train to it (IDP-SGD Sample and Scale), account for the
privacy each example actually received, and report it.  The accounting core
(:mod:`idpsgd.accounting`) is numpy/scipy only; training needs torch and Opacus.
"""
from .accounting import (DEFAULT_ORDERS, RdpLedger, SampledGaussianEvent, calibrate_noise_multiplier,
                         calibrate_sample_rate, compute_rdp, epsilon_sgm, pld_epsilon, rdp_epsilon,
                         rdp_to_delta, rdp_to_epsilon)
from .validation import InvalidParameterError, UnreachableTargetError

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ORDERS", "InvalidParameterError", "RdpLedger", "SampledGaussianEvent",
    "UnreachableTargetError", "calibrate_noise_multiplier", "calibrate_sample_rate", "compute_rdp",
    "epsilon_sgm", "pld_epsilon", "rdp_epsilon", "rdp_to_delta", "rdp_to_epsilon",
]
