"""The CLI's commands, each a thin wrapper over the library (registered into :mod:`idpsgd.cli`)."""
from __future__ import annotations

from .accounting import (DEFAULT_ORDERS, calibrate_noise_multiplier, compute_rdp, epsilon_sgm,
                         rdp_to_epsilon)
import numpy as np

from .cli import arguments, command
from .validation import (InvalidParameterError, check_delta, check_epsilon, check_noise_multiplier,
                         check_sample_rate, check_steps)


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


def budget_source_args(p, required=True):
    """Flags that describe where per-example budgets come from (shared by assign and train)."""
    p.add_argument("--budgets", help="comma-separated group budgets, e.g. 1,2,3 (with --fractions)")
    p.add_argument("--fractions", help="comma-separated group fractions summing to 1")
    p.add_argument("--budgets-per-class", help="per-class budgets, e.g. 0:1,1:2,2:3 (train only)")
    p.add_argument("--budgets-file", help="CSV file with one row per example")
    p.add_argument("--budget-column", default="epsilon", help="column of --budgets-file (default: epsilon)")
    p.add_argument("--budget-distribution", choices=["exponential"],
                   help="Heo et al. App. C.1: 20 budget groups in --range A,B, sizes skewed by --skew K")
    p.add_argument("--skew", type=float, default=0.0, help="exponent k of the exponential distribution (default 0)")
    p.add_argument("--range", help="A,B: budget range of --budget-distribution")
    p.add_argument("--seed", type=int, default=0, help="seed of the random group assignment")


def budgets_from_args(args, num_examples=None, labels=None):
    from .assignment import Budgets, parse_class_map, parse_float_list

    delta = check_delta(args.delta)
    if args.budgets_file:
        return Budgets.from_csv(args.budgets_file, args.budget_column, delta)
    if getattr(args, "budget_distribution", None):
        if num_examples is None:
            raise InvalidParameterError("num_examples", None, "is needed with --budget-distribution")
        bounds = parse_float_list(args.range or "", "range")
        if len(bounds) != 2:
            raise InvalidParameterError("range", args.range, "must be A,B (two numbers)")
        return Budgets.from_exponential(num_examples, bounds[0], bounds[1], args.skew, delta, seed=args.seed)
    if args.budgets_per_class:
        if labels is None:
            raise InvalidParameterError("budgets_per_class", args.budgets_per_class,
                                        "needs labels: use it with 'idpsgd train'")
        return Budgets.from_class_map(labels, parse_class_map(args.budgets_per_class), delta)
    if not args.budgets:
        raise InvalidParameterError("budgets", None, "give --budgets with --fractions, "
                                    "--budgets-per-class, --budgets-file, or --budget-distribution")
    values, fractions = group_spec(args)
    return Budgets.from_groups(values, fractions, num_examples, delta, seed=args.seed)


def group_spec(args):
    """(budgets, fractions) from --budgets/--fractions, validated."""
    from .assignment import group_counts, parse_float_list

    values = parse_float_list(args.budgets, "budgets")
    check_epsilon(values, "budgets")
    if len(set(values)) != len(values):
        raise InvalidParameterError("budgets", values, "must be distinct (a group is a distinct budget)")
    if args.fractions is None and len(values) != 1:
        raise InvalidParameterError("fractions", None, "are required when there is more than one budget")
    fractions = parse_float_list(args.fractions, "fractions") if args.fractions else [1.0]
    group_counts(fractions, 1_000_000, values)  # validates count, positivity and sum
    return values, fractions


def _assign_args(p):
    p.add_argument("--method", choices=["uniform", "sample", "scale"], required=True)
    budget_source_args(p)
    p.add_argument("--delta", type=float, required=True, help="global δ in (0, 1)")
    p.add_argument("--sample-rate", type=float, required=True, help="requested (mean) sampling rate q")
    p.add_argument("--steps", type=int, required=True, help="planned number of steps")
    p.add_argument("--clip-norm", type=float, required=True, help="requested (mean) clip norm c")
    p.add_argument("--num-examples", type=int,
                   help="dataset size: group sizes by largest remainder (default: exact fractions)")
    _accountant(p)


def _assign_text(r):
    lines = [f"method={r['method']} accountant={r['accountant']} noise_multiplier={r['noise_multiplier']:.6g} "
             f"sample_rate={r['sample_rate']:.6g} clip_norm={r['clip_norm']:.6g}",
             f"{'budget':>8} {'fraction':>9} {'sample_rate':>12} {'clip_norm':>10} {'sigma_eff':>10} {'epsilon':>9}"]
    for g in r["groups"]:
        lines.append(f"{g['budget']:>8.4g} {g['fraction']:>9.4f} {g['sample_rate']:>12.6f} "
                     f"{g['clip_norm']:>10.5f} {g['noise_multiplier']:>10.5f} {g['epsilon']:>9.5f}")
    return "\n".join(lines)


@command("assign", "per-group DP-SGD parameters for individualized budgets (IDP-SGD Sample/Scale)")
@arguments(_assign_args)
def assign_cmd(args):
    from .assignment import Budgets, assign

    if args.budgets_per_class:
        raise InvalidParameterError("budgets_per_class", args.budgets_per_class,
                                    "needs labels: use it with 'idpsgd train'")
    weights = None
    if args.budgets_file or args.num_examples or args.budget_distribution:
        budgets = budgets_from_args(args, args.num_examples)
    else:  # no dataset size: the groups are weighted by their exact fractions
        values, fractions = group_spec(args)
        order = np.argsort(values)
        budgets = Budgets.from_array(values, check_delta(args.delta))
        weights = np.asarray(fractions)[order]
    result = assign(budgets, args.method, args.sample_rate, args.steps, args.clip_norm,
                    args.accountant, group_weights=weights).summary()
    if weights is not None:  # no dataset size: groups are fractions, not counts
        for g in result["groups"]:
            g.pop("count")
    return result


assign_cmd._text = _assign_text


def _account_args(p):
    p.add_argument("--norms", required=True,
                   help="npz with 'norms' (refreshes x examples) and 'steps' (steps covered by each refresh)")
    p.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q in (0, 1]")
    p.add_argument("--noise-multiplier", type=float, required=True, help="noise multiplier σ > 0")
    p.add_argument("--clip-norm", type=float, required=True, help="clip norm C > 0")
    p.add_argument("--delta", type=float, required=True, help="δ in (0, 1)")
    p.add_argument("--rounding", choices=["exact", "ceil", "nearest"], default="nearest",
                   help="rounding of norms (default nearest, step 0.01 C)")
    p.add_argument("--rounding-step", type=float, help="rounding step r (default 0.01 x clip norm)")
    p.add_argument("--out", help="folder for individual_epsilons.csv (default: the folder of --norms)")


@command("account", "offline individual privacy accounting (Yu et al.) from recorded gradient norms")
@arguments(_account_args)
def account_cmd(args):
    from pathlib import Path

    from .accounting import account_from_norms
    from .io import write_csv

    path = Path(args.norms)
    if not path.is_file():
        raise FileNotFoundError(f"norms file not found: {path} (expected an npz with arrays 'norms' and 'steps')")
    try:
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InvalidParameterError("norms", str(path), f"is not a readable npz file ({exc})") from None
    missing = [k for k in ("norms", "steps") if k not in arrays]
    if missing:
        raise InvalidParameterError("norms", str(path), f"the npz lacks {missing} (has {sorted(arrays)})")
    norms, steps = arrays["norms"], arrays["steps"]
    q = float(check_sample_rate(args.sample_rate))
    sigma = float(check_noise_multiplier(args.noise_multiplier, allow_inf=False))
    delta = check_delta(args.delta)
    norms = np.atleast_2d(norms)
    if np.size(steps) not in (1, norms.shape[0]):
        raise InvalidParameterError("steps", f"{np.size(steps)} values", f"need 1 or one per refresh ({norms.shape[0]})")
    eps, worst = account_from_norms(norms, steps, q, sigma, args.clip_norm, delta, args.rounding, args.rounding_step)
    out = Path(args.out) if args.out else path.parent
    csv_path = write_csv(out / "individual_epsilons.csv", ["index", "epsilon", "worst_case_epsilon"],
                         [np.arange(eps.size), eps, worst], private=True)
    return {"epsilons": str(csv_path), "mean": float(eps.mean()), "max": float(eps.max()),
            "quantiles": {f"{p:g}": float(np.quantile(eps, p)) for p in (0.1, 0.25, 0.5, 0.75, 0.9)},
            "worst_case_epsilon": float(worst.max()), "examples": int(eps.size),
            "steps": int(np.sum(np.broadcast_to(steps, (norms.shape[0],)))), "rounding": args.rounding,
            "kind": "estimate" if args.rounding == "nearest" or np.any(np.asarray(steps) > 1) else "guarantee"}
