"""The CLI's commands, each a thin wrapper over the library (registered into :mod:`idpsgd.cli`)."""
from __future__ import annotations

from .accounting import (DEFAULT_ORDERS, calibrate_noise_multiplier, compute_rdp, epsilon_sgm,
                         rdp_to_epsilon)
from .cli import arguments, command
from .validation import check_delta, check_epsilon, check_noise_multiplier, check_sample_rate, check_steps


def _accountant(p):
    p.add_argument("--accountant", choices=["rdp", "pld"], default="rdp",
                   help="rdp: Rényi DP with the improved conversion; pld: dp_accounting's PLD")


def _sgm_args(p, with_sigma=True):
    p.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q in (0, 1]")
    if with_sigma:
        p.add_argument("--noise-multiplier", type=float, required=True, help="noise multiplier σ > 0")
    p.add_argument("--steps", type=int, required=True, help="number of steps (>= 1)")
    p.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    _accountant(p)


@command("epsilon", "ε spent by DP-SGD (Poisson-subsampled Gaussian) after a number of steps")
@arguments(_sgm_args)
def epsilon_cmd(args):
    q = float(check_sample_rate(args.sample_rate))
    s = float(check_noise_multiplier(args.noise_multiplier))
    steps = check_steps(args.steps)
    delta = check_delta(args.delta)
    out = {"accountant": args.accountant, "delta": delta}
    if args.accountant == "rdp":
        eps, order = rdp_to_epsilon(compute_rdp(q, s, DEFAULT_ORDERS, steps=steps), DEFAULT_ORDERS, delta)
        out.update(epsilon=float(eps), order=float(order))
    else:
        out.update(epsilon=float(epsilon_sgm(q, s, steps, delta, "pld")))
    return {"epsilon": out.pop("epsilon"), **out}


def _nm_args(p):
    p.add_argument("--epsilon", type=float, required=True, help="target ε > 0")
    _sgm_args(p, with_sigma=False)


@command("noise-multiplier", "noise multiplier σ that spends a target ε (never above it)")
@arguments(_nm_args)
def noise_multiplier_cmd(args):
    q = float(check_sample_rate(args.sample_rate))
    steps = check_steps(args.steps)
    delta = check_delta(args.delta)
    check_epsilon(args.epsilon, "epsilon")
    sigma = calibrate_noise_multiplier(args.epsilon, delta, q, steps, args.accountant)
    achieved = float(epsilon_sgm(q, sigma, steps, delta, args.accountant))
    return {"noise_multiplier": float(sigma), "epsilon": achieved, "accountant": args.accountant}
