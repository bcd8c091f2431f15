"""The ``audit`` command: membership inference per privacy group and empirical ε lower bounds
(a thin wrapper over :func:`idpsgd.audit.run_audit`)."""

from __future__ import annotations

from .budget_args import budget_source_args, budgets_from_args
from .pdp_args import add_pdp_arguments, pdp_options_from_args
from .registry import arguments, command
from .train_commands import config_from_args, dataset_from_args, hyper_args


def _audit_args(p):
    from ..audit.runner import (
        ATTACKS,
        CANARY_KINDS,
        DEFAULT_CANARIES,
        DEFAULT_SHADOW_MODELS,
        FPRS,
    )
    from ..names import AUDIT_METHODS

    p.add_argument("--method", required=True, help=f"training method to audit: {', '.join(AUDIT_METHODS)}")
    budget_source_args(p)
    hyper_args(p)
    p.add_argument(
        "--out",
        required=True,
        help="audit folder: audit.json (settings, plan, reported epsilon per group); private/ (mode "
        "0600): audit.json and roc_by_group.png (the results), audit_scores.csv (per-example scores), "
        "models/ checkpoints, settings",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted audit in OUT (same settings): finished models are not retrained",
    )
    p.add_argument("--overwrite", action="store_true", help="replace another run's files in OUT")
    a = p.add_argument_group("attack")
    a.add_argument(
        "--attack",
        choices=ATTACKS,
        default="lira",
        help="lira: shadow models (Carlini et al. 2022); loss: loss threshold on the target only (Yeom et "
        "al. 2018); one-run: canaries in one training run (Steinke et al. 2023) (default lira)",
    )
    a.add_argument("--shadow-models", type=int, help=f"M shadow models for lira (default {DEFAULT_SHADOW_MODELS})")
    a.add_argument(
        "--lira-mode",
        choices=["online", "offline"],
        default="online",
        help="the LiRA variant that decides the verdict; both are reported (default online)",
    )
    a.add_argument(
        "--lira-variance",
        choices=["fixed", "per-example"],
        default="fixed",
        help="fixed: one variance for all examples (for few shadow models); per-example (default fixed)",
    )
    a.add_argument("--canaries", type=int, help=f"one-run: canaries per privacy group (default {DEFAULT_CANARIES})")
    a.add_argument(
        "--canary-kind",
        choices=CANARY_KINDS,
        default="mislabeled",
        help="one-run canaries: training examples with a wrong label, or as they are (default mislabeled)",
    )
    a.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="family-wise confidence of the verdict: each of "
        "its bounds is taken at 1 - (1 - confidence)/tests (Bonferroni over the groups, all data and the "
        "two bounds per row) (default 0.95)",
    )
    a.add_argument(
        "--fpr",
        default=",".join(f"{f:g}" for f in FPRS),
        help="comma-separated false positive rates in (0, 1) at which TPR is reported (default "
        f"{','.join(f'{f:g}' for f in FPRS)})",
    )
    add_pdp_arguments(p.add_argument_group("PDP-SGD (Heo et al.; with --method pdp-sgd)"))


@command(
    "audit",
    "membership inference per privacy group (LiRA, loss threshold, one-run canaries) and empirical "
    "epsilon lower bounds beside the reported epsilon",
)
@arguments(_audit_args)
def audit_cmd(args):
    from ..audit import AuditOptions, run_audit
    from ..audit.shadows import check_method

    check_method(args.method)
    options = AuditOptions(
        attack=args.attack,
        shadow_models=args.shadow_models,
        lira_mode=args.lira_mode,
        lira_variance=args.lira_variance,
        canaries=args.canaries,
        canary_kind=args.canary_kind,
        confidence=args.confidence,
        fprs=_fprs(args.fpr),
    ).resolved()
    pdp = pdp_options_from_args(args) if args.method == "pdp-sgd" else None
    if pdp is None:
        _refuse_pdp_flags(args)
    if args.resume and args.seed is None and not args.secure_mode:
        args.seed = _saved_seed(args.out)  # the budgets' assignment and the design of the interrupted audit
    data = dataset_from_args(args)
    budgets = budgets_from_args(args, len(data.y_train), data.y_train.numpy(), num_classes=data.num_classes)
    from ..audit.report import public_audit

    result = run_audit(
        data,
        budgets,
        config_from_args(args, args.method),
        args.out,
        options,
        resume=args.resume,
        overwrite=args.overwrite,
        pdp=pdp,
    )
    # the results are statistics of the training data and the secret membership (not covered by the
    # guarantee): printed only with --show-private, as private/audit.json holds them
    results = {k: v for k, v in result.items() if k != "private"}
    return {**public_audit(result), "private": {**result.get("private", {}), "audit": results}}


def _fprs(text):
    from ..validation import InvalidParameterError

    try:
        return tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise InvalidParameterError("fpr", text, "must be comma-separated numbers in (0, 1), e.g. 0.01,0.001") from None


def _saved_seed(out):
    """The seed recorded by the audit in ``out`` (None if there is none to read)."""
    import json
    from pathlib import Path

    from ..audit.runner import SETTINGS

    try:
        seed = json.loads((Path(out) / "private" / SETTINGS).read_text()).get("seed")
    except (OSError, ValueError, AttributeError):
        return None
    return seed if isinstance(seed, int) else None


def _text(r):
    from ..audit.report import audit_text, public_audit_text

    full = (r.get("private") or {}).get("audit")
    return audit_text(full) if full is not None else public_audit_text(r)


audit_cmd._text = _text


def _refuse_pdp_flags(args):
    """PDP-SGD flags with another method: refused (not silently ignored)."""
    from ..validation import InvalidParameterError

    defaults = {"threshold_loss": "fixed", "w1": None, "rounds": 3, "noise_history": False, "per_round_delta": False}
    for name, default in defaults.items():
        if getattr(args, name, default) != default:
            raise InvalidParameterError(
                name, getattr(args, name), f"only applies to --method pdp-sgd, not {args.method}"
            )
