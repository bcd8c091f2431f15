"""Privacy accounting for (individualized) DP-SGD: numpy/scipy only, no torch.

The one model of a DP-SGD step (product guide): example i is sampled with probability q_i and
its clipped gradient of norm s_i ≤ c_i meets noise σ·c, i.e. the SGM with effective noise
multiplier σ·c/s_i.  Everything here is vectorized over examples.
"""
from .accountants import (ACCOUNTANTS, PLD_DISCRETIZATION, epsilon_sgm, get_accountant, pld_epsilon,
                          rdp_epsilon)
from .calibration import calibrate_noise_multiplier, calibrate_sample_rate, solve_monotone
from .conversion import rdp_to_delta, rdp_to_epsilon
from .events import SampledGaussianEvent
from .ledger import RdpLedger
from .rdp import DEFAULT_ORDERS, compute_rdp

__all__ = [
    "ACCOUNTANTS", "DEFAULT_ORDERS", "PLD_DISCRETIZATION", "RdpLedger", "SampledGaussianEvent",
    "calibrate_noise_multiplier", "calibrate_sample_rate", "compute_rdp", "epsilon_sgm",
    "get_accountant", "pld_epsilon", "rdp_epsilon", "rdp_to_delta", "rdp_to_epsilon",
    "solve_monotone",
]
from .individual import (ROUNDING, IndividualAccountant, RdpInterpolator, account_from_norms,  # noqa: E402
                         round_sensitivities)

__all__ += ["IndividualAccountant", "ROUNDING", "RdpInterpolator", "account_from_norms", "round_sensitivities"]
