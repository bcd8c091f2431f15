"""The ``per-instance`` command: per-instance Rényi DP of DP-SGD in both directions (Thudi et al.)."""

from __future__ import annotations

from .registry import arguments, command, register_text
from .train_commands import config_from_args, dataset_from_args, hyper_args


def _defaults() -> dict:
    """The defaults of :func:`~idpsgd.training.per_instance.run_per_instance` (the paper's ε = 10, α = 8, ...):
    the flags and their help texts take them from there."""
    import inspect

    from ..training.per_instance import run_per_instance

    return {k: v.default for k, v in inspect.signature(run_per_instance).parameters.items()}


def _per_instance_args(p):
    d = _defaults()
    hyper_args(p)  # the paper's settings are the training defaults: --clip-norm 1, --batch-size 128
    p.add_argument(
        "--target-set",
        choices=["test", "train"],
        default=d["target_set"],
        help="where the target points x* come from: test (X = the training set, X' = X + {x*}; "
        "Fig. 1a) or train (X' = the training set, X = X' - {x*}; Fig. 1c) (default %(default)s)",
    )
    p.add_argument("--points", help="comma-separated indices of the target points in --target-set")
    p.add_argument("--num-points", type=int, help="or: this many random points of --target-set (seeded)")
    p.add_argument(
        "--runs",
        type=int,
        default=d["runs"],
        help="training runs per chain: on the training set, and on each target's X or X' (default %(default)s)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=d["alpha"],
        help="Rényi order of the guarantee (default: the order at which the data-independent epsilon "
        "of the composition the analysis uses, Thm. 3.3 at sensitivity C, is smallest; an integer "
        "for --update-rule mean; the paper: 8)",
    )
    p.add_argument(
        "--update-rule",
        choices=["sum", "mean"],
        default=d["update_rule"],
        help="the rule the runs are trained with and analysed for: sum (DP-SGD as implemented; "
        "Thm. 3.2) or mean (mean of the realised batch plus noise; Thm. 3.6) (default %(default)s)",
    )
    p.add_argument(
        "--epsilon",
        type=float,
        default=d["epsilon"],
        help="data-independent ε the runs' noise is calibrated to (default %(default)g)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        help="steps between measurements of the targets' gradient norms "
        "(default: one epoch; 1: every step's own value, needed for the *_upper values and the "
        "per-point guarantee to be confidence bounds; otherwise they are estimates and the "
        "data-independent bound)",
    )
    p.add_argument(
        "--samples",
        default=",".join(str(v) for v in d["samples"]),
        help="outer,inner mini-batch samples for Thm. 3.6 (default %(default)s)",
    )
    p.add_argument("--p", type=float, help="Hölder exponent of Thm. 3.3 (default 3n, Fact 3.4)")
    p.add_argument(
        "--failure",
        type=float,
        default=d["failure"],
        help="J: each point's confidence upper bound holds with probability >= 1 - J for that point (no "
        "union bound over the points) (default %(default)s)",
    )
    p.add_argument(
        "--unlearning-beta", type=float, help="NPIU threshold β (default: the data-independent RDP of training at α)"
    )
    p.add_argument(
        "--seed",
        type=int,
        help="seed of the initialisation, runs and point choice (default: a fresh "
        "seed, recorded privately in OUT/private/seed.json, mode 0600)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder: private/ per_instance.csv/.json, per_instance_steps.csv and the plots (all private, mode 0600)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier analysis in --out")


def _per_instance_text(s):
    lines = [
        (
            f"per-instance RDP at alpha={s['alpha']:.4g} ({s['alpha_rule']}; {s['update_rule']} rule, targets from "
            f"the {s['target_set']} set, {s['runs']} runs per chain ({s['runs_trained']} trained), {s['steps']} "
            f"steps, q {s['sample_rate']:.4g}, sigma {s['noise_multiplier']:.4g}; estimates): clip norm "
            f"{s['clip_norm']:g}, training epsilon {s['training_epsilon']:g}, test accuracy {s['test_accuracy']:.4f}; "
            f"data-independent RDP at alpha {s['baseline_rdp']:.4g} (epsilon {s['baseline_epsilon_at_alpha']:.4g}; "
            f"at the best order {s['data_independent_epsilon']:.4g}); the same composition (Thm. 3.3) at "
            f"sensitivity C: {s['same_composition_rdp']:.4g}"
        )
    ]
    p = s.get("private")
    if p:
        lines.append(
            f"[private] ratio of the per-instance RDP max(add, remove) to the data-independent one over "
            f"{len(p['points'])} points: median {p['median_ratio_to_baseline']:.3f}, 10th percentile "
            f"{p['p10_ratio_to_baseline']:.3f}; to the same composition: median "
            f"{p['median_ratio_to_same_composition']:.3f}; "
            + (
                f"confidence upper bound (prob. >= {1 - s['failure']:g} per point, no union bound over the "
                f"points): median {p['median_upper_ratio_to_baseline']:.3f}"
                if s.get("upper_kind") == "confidence upper bound"
                else f"upper value (an estimate: sensitivities measured every {s['checkpoint_every']} steps; "
                f"--checkpoint-every 1 makes it a confidence bound): median "
                f"{p['median_upper_ratio_to_baseline']:.3f}"
            )
        )
        lines.append(
            f"[private] per-step contribution / per-step baseline in the second half of training (median over "
            f"points): add {p['median_late_step_ratio_add']:.3g}, remove "
            f"{p['median_late_step_ratio_remove']:.3g}; {100 * p['share_points_below_baseline_late']:.0f}% "
            f"of the points below 1; guarantee ({s.get('guarantee_rule', '')}) below the "
            f"data-independent epsilon for {100 * p['share_guarantee_below_data_independent']:.0f}% of them"
        )
        unl = p.get("unlearning")
        if unl:
            keep = sum(r["decision"] == "keep" for r in unl["requests"])
            lines.append(
                f"[private] unlearning (beta={unl['beta']:.4g}): {keep} of {len(unl['requests'])} requests "
                "keep the model"
            )
    lines.append(
        f"per point: {s['out']}/private/per_instance.csv (rdp_add, rdp_remove, rdp, *_upper, "
        "same-composition ratio, guarantee, per-step ratio statistics; private, mode 0600); Fig. 1 curves, "
        "summary and plots in the same folder (--show-private prints the summary)"
    )
    return "\n".join(lines)


def _integers(text: str, name: str, allowed: str) -> list[int]:
    """``"0,5,17"`` -> [0, 5, 17]; anything but comma-separated integers is refused (``1.5``, ``nan``)."""
    from ..validation import InvalidParameterError

    try:
        return [int(v.strip()) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise InvalidParameterError(
            name, text, allowed if allowed.startswith("must") else "must be " + allowed
        ) from None


@command(
    "per-instance",
    "per-instance Rényi DP of DP-SGD in both directions for chosen points (Thudi et al.), with NPIU unlearning",
)
@arguments(_per_instance_args)
def per_instance_cmd(args):
    import numpy as np

    from ..runfolder import RunFolder
    from ..training.per_instance import public_summary, run_per_instance
    from ..validation import InvalidParameterError, check_epsilon, check_positive
    from .budget_args import CommandSeed

    check_epsilon(args.epsilon, "epsilon")  # the flags first: nothing is read or written before
    if args.alpha is not None:
        import math

        if not (args.alpha > 1 and math.isfinite(args.alpha)):
            raise InvalidParameterError("alpha", args.alpha, "must be a Rényi order > 1 (e.g. 8)")
        if args.update_rule == "mean" and args.alpha != int(args.alpha):
            raise InvalidParameterError(
                "alpha", args.alpha, "must be an integer >= 2 for --update-rule mean (Thm. 3.6)"
            )
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise InvalidParameterError("checkpoint_every", args.checkpoint_every, "must be an integer >= 1")
    if args.unlearning_beta is not None:
        check_positive(args.unlearning_beta, "unlearning_beta")
    if args.points is not None:
        points = _integers(args.points, "points", "comma-separated indices (integers >= 0), e.g. 0,5,17")
        if not points or min(points) < 0:
            raise InvalidParameterError("points", args.points, "must be comma-separated indices (integers >= 0)")
    elif args.num_points is not None:
        if args.num_points < 1:
            raise InvalidParameterError("num_points", args.num_points, "must be an integer >= 1")
    else:
        raise InvalidParameterError("points", None, "give --points I,J,... or --num-points K")
    samples = _integers(args.samples, "samples", "must be OUTER,INNER: two integers >= 1")
    if len(samples) != 2 or min(samples) < 1:
        raise InvalidParameterError("samples", args.samples, "must be OUTER,INNER: two integers >= 1")
    data = dataset_from_args(args)
    seed = CommandSeed.of(args)
    size = len(data.y_test) if args.target_set == "test" else len(data.y_train)
    if args.points is None:
        if not 1 <= args.num_points <= size:
            raise InvalidParameterError("num_points", args.num_points, f"must be in [1, {size}]")
        choice = np.random.default_rng(seed() if not args.secure_mode else None)
        points = np.sort(choice.choice(size, args.num_points, replace=False))
    elif max(points) >= size:
        raise InvalidParameterError(
            "points", args.points, f"must be indices in [0, {size - 1}] of the {args.target_set} set"
        )
    folder = RunFolder(args.out, overwrite=args.overwrite)
    summary = run_per_instance(
        data,
        points,
        args.runs,
        args.alpha,
        args.update_rule,
        config_from_args(args, "uniform", seed),
        args.epsilon,
        args.delta,
        args.checkpoint_every,
        tuple(samples),
        args.p,
        args.unlearning_beta,
        folder,
        target_set=args.target_set,
        failure=args.failure,
    )
    public = public_summary(summary)
    return {
        **public,
        "out": args.out,
        "private": {k: v for k, v in summary.items() if k not in public and k != "curves"},
    }


register_text(per_instance_cmd, _per_instance_text)
