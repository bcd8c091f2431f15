"""Privacy accounting for (individualized) DP-SGD: numpy/scipy only, no torch.

The one model of a DP-SGD step (product guide): example i is sampled with probability q_i and
its clipped gradient of norm s_i ≤ c_i meets noise σ·c, i.e. the SGM with effective noise
multiplier σ·c/s_i.  Everything here is vectorized over examples.

Scalar and group ε by RDP use **adaptive Rényi orders** (:mod:`.orders`): the best order of a
fine universe around the grid's best, so ε is never above the fixed grid's.
"""

from .accountants import (
    ACCOUNTANTS,
    MIN_NOISE_MULTIPLIER,
    PLD_DISCRETIZATION,
    PLD_MAX_POINTS,
    epsilon_sgm,
    get_accountant,
    max_steps_within,
    pld_epsilon,
    rdp_epsilon,
)
from .calibration import calibrate_noise_multiplier, calibrate_sample_rate, solve_monotone
from .conversion import rdp_to_delta, rdp_to_epsilon
from .events import SampledGaussianEvent
from .ledger import RdpLedger
from .orders import chord_refined_epsilon, order_universe, search_orders
from .rdp import DEFAULT_ORDERS, compute_rdp, compute_rdp_pointwise

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_ORDERS",
    "MIN_NOISE_MULTIPLIER",
    "PLD_DISCRETIZATION",
    "PLD_MAX_POINTS",
    "RdpLedger",
    "SampledGaussianEvent",
    "calibrate_noise_multiplier",
    "calibrate_sample_rate",
    "chord_refined_epsilon",
    "compute_rdp",
    "compute_rdp_pointwise",
    "epsilon_sgm",
    "get_accountant",
    "max_steps_within",
    "order_universe",
    "pld_epsilon",
    "rdp_epsilon",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "search_orders",
    "solve_monotone",
]
from .output_specific import (
    ROUNDING,
    IndividualAccountant,
    IndividualEpsilons,
    RdpInterpolator,
    account_from_norms,
    combine_bounds,
    round_sensitivities,
)
from .pld_individual import individual_pld_epsilon

__all__ += [
    "ROUNDING",
    "IndividualAccountant",
    "IndividualEpsilons",
    "RdpInterpolator",
    "account_from_norms",
    "combine_bounds",
    "individual_pld_epsilon",
    "round_sensitivities",
]
