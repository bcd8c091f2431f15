"""The ``audit`` command: membership inference per privacy group and empirical ε lower bounds
(a thin wrapper over :func:`idpsgd.audit.run_audit`)."""

from __future__ import annotations

import sys

from .budget_args import CommandSeed, budget_source_args, budgets_from_args
from .pdp_args import add_pdp_arguments, pdp_options_from_args
from .registry import arguments, command, fills, register_text, with_flags
from .train_commands import config_from_args, dataset_from_args, hyper_args

#: the training defaults of the language-model audit (--data): FinetuneOptions' own (tested)
LM_DEFAULTS = {"epochs": 3, "batch_size": 16, "lr": 5e-4, "clip_norm": 1.0}
LM_CANARIES = 32
CLASSIC_DEFAULTS: dict = {}  # the classifier audit's defaults of the same flags (filled with the parser)


def _audit_args(p):
    from ..audit.runner import (
        ATTACKS,
        CANARY_KINDS,
        DEFAULT_CANARIES,
        DEFAULT_SHADOW_MODELS,
        FPRS,
        AuditOptions,
    )
    from ..names import AUDIT_METHODS

    p.add_argument("--method", required=True, help=f"training method to audit: {', '.join(AUDIT_METHODS)}")
    budget_source_args(p)
    hyper_args(p)
    for action in p._actions:  # their defaults depend on what is audited (a classifier or a language model)
        if action.dest in LM_DEFAULTS:
            action.help = action.help.replace(
                "(default", "(language model: default " + str(LM_DEFAULTS[action.dest]) + "; else"
            )
            CLASSIC_DEFAULTS[action.dest] = action.default
            action.default = None
        if action.dest == "model":
            action.help += "; with --data: a local Hugging Face model folder (save_pretrained) to fine-tune and audit"
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
    CLASSIC_DEFAULTS["attack"] = AuditOptions.attack  # None in the parser: --data does not take it
    a.add_argument(
        "--attack",
        choices=ATTACKS,
        help="lira: shadow models (Carlini et al. 2022); loss: loss threshold on the target only (Yeom et "
        "al. 2018); one-run: canaries in one training run (Steinke et al. 2023) (default lira; not with --data)",
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
    a.add_argument(
        "--canaries",
        type=int,
        help=f"one-run: canaries per privacy group (default {DEFAULT_CANARIES}; with --data {LM_CANARIES})",
    )
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
    _lm_args(p.add_argument_group("language models (--model DIR --data FILE): secret canaries per group"))


def _lm_args(g):
    from ..audit.canaries import DEFAULT_DIGITS, DEFAULT_PREFIX, USER_MODES
    from ..audit.lm import DEFAULT_CANDIDATES, EXACT_LIMIT

    g.add_argument(
        "--data",
        help="training texts, a JSON Lines (.jsonl) or CSV (.csv) file: fine-tune the Hugging Face model folder "
        "--model on them with secret canaries in every budget group (Carlini et al. 2019), then audit it: "
        "exposure and the one-run empirical epsilon per group",
    )
    g.add_argument("--text-column", default="text", help="the column with each row's text (default text)")
    g.add_argument("--user-column", help="the column with each row's user: user-level privacy")
    g.add_argument("--max-rows-per-user", type=int, default=4, help="k: a user's most rows in one step (default 4)")
    g.add_argument("--max-length", type=int, default=128, help="tokens per text after truncation (default 128)")
    g.add_argument(
        "--canary-digits",
        type=int,
        default=DEFAULT_DIGITS,
        help=f"random digits per secret: |R| = 10^digits candidates (default {DEFAULT_DIGITS})",
    )
    g.add_argument("--canary-prefix", help=f"the secrets' prefix (if not given: {DEFAULT_PREFIX!r})")
    g.add_argument(
        "--canary-contexts",
        action="store_true",
        help="every canary opens with a public context word of its own (xbaa, xbab, ...) and is ranked among "
        "the candidates under its context, so the canaries do not share one prefix whose next digits the model "
        "would learn as their mixture; the tokenizer must tell the context words apart",
    )
    g.add_argument(
        "--canary-repeats",
        type=int,
        default=1,
        help="rows per canary, all of its user's (Carlini et al. insert a canary several times); above 1 only "
        "at user level (--user-column), whose per-user epsilon covers all of a canary's rows (default 1)",
    )
    g.add_argument(
        "--canary-users",
        choices=USER_MODES,
        default="new",
        help="user level: a canary is the row of a new user of its own, or of a random existing user of its "
        "group (default new)",
    )
    g.add_argument(
        "--exact-limit",
        type=int,
        default=EXACT_LIMIT,
        help=f"exposure is exact (every candidate scored) up to this |R|, else estimated (default {EXACT_LIMIT})",
    )
    g.add_argument(
        "--candidates",
        type=int,
        default=DEFAULT_CANDIDATES,
        help=f"candidates sampled for the exposure estimate above --exact-limit (default {DEFAULT_CANDIDATES})",
    )


def _audit_flags(args):
    """The flags as ``audit`` reads them: without ``--data`` (the classifier audit), the flags whose
    default differs from the language model audit's get the classifier's (:data:`CLASSIC_DEFAULTS`)."""
    if args.data is not None:
        return args
    return with_flags(args, **{k: v for k, v in CLASSIC_DEFAULTS.items() if getattr(args, k) is None})


@command(
    "audit",
    "membership inference per privacy group (LiRA, loss threshold, one-run canaries) and empirical "
    "epsilon lower bounds beside the reported epsilon",
)
@arguments(_audit_args)
@fills(_audit_flags)
def audit_cmd(args):
    from ..audit import AuditOptions, run_audit
    from ..audit.shadows import check_method

    if args.data is not None:
        return _lm_audit(args)
    _refuse_lm_flags(args)
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
    given = args.seed
    if args.resume and args.seed is None and not args.secure_mode:
        given = _saved_seed(args.out)  # the budgets' assignment and the design of the interrupted audit
    seed = CommandSeed(given, args.secure_mode)
    data = dataset_from_args(args)
    budgets = budgets_from_args(args, len(data.y_train), data.y_train.numpy(), seed=seed, num_classes=data.num_classes)
    from ..audit.report import public_audit

    result = run_audit(
        data,
        budgets,
        config_from_args(args, args.method, seed),
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


def _refuse_lm_flags(args):
    """Flags of the language-model audit without --data: refused (not silently ignored)."""
    from ..validation import InvalidParameterError

    for name in ("user_column", "canary_prefix"):
        if getattr(args, name) is not None:
            raise InvalidParameterError(name, getattr(args, name), "is for the language-model audit: give --data FILE")
    for name, default in (("canary_contexts", False), ("canary_repeats", 1)):
        if getattr(args, name) != default:
            raise InvalidParameterError(name, getattr(args, name), "is for the language-model audit: give --data FILE")


def _lm_budgets(args, data, users, seed):
    """The budgets of a text file: its budget column (when it has one and no other source is given) or
    the budget flags (per row, or per user at user level)."""
    from ..assignment import Budgets
    from ..validation import InvalidParameterError, check_delta

    others = [s for s in ("budgets", "budgets_per_class", "budgets_file", "budget_distribution") if getattr(args, s)]
    if args.budgets_per_class:
        raise InvalidParameterError(
            "budgets_per_class", args.budgets_per_class, "a language model's rows have no classes"
        )
    delta = check_delta(args.delta)
    if data.budgets is not None:
        if others:
            raise InvalidParameterError(
                others[0],
                getattr(args, others[0]),
                f"the data has a budget column {args.budget_column!r}: give the budgets one way",
            )
        return (
            users.budgets_from_rows(data.budgets, delta)
            if users is not None
            else Budgets.from_array(data.budgets, delta)
        )
    if not others:
        raise InvalidParameterError(
            "budget_column",
            args.budget_column,
            f"is not a column of --data {str(args.data)!r} and no other budget flag is given: give each row's "
            "budget in that column, or --budgets with --fractions",
        )
    return budgets_from_args(args, len(data) if users is None else users.num_users, seed=seed)


def _lm_audit(args):
    """``idpsgd audit --model DIR --data FILE``: fine-tune with canaries per group, then audit
    (:func:`idpsgd.audit.lm_training.audit_finetune`)."""
    from ..audit.canaries import DEFAULT_PREFIX
    from ..audit.lm import LMAuditOptions
    from ..audit.lm_training import audit_finetune
    from ..integrations.hf.finetune import FinetuneOptions, check_model_folder
    from ..integrations.hf.text_data import load_text_data
    from ..names import IDP_METHODS
    from ..validation import InvalidParameterError

    if args.method not in IDP_METHODS:
        raise InvalidParameterError("method", args.method, f"with --data must be one of {', '.join(IDP_METHODS)}")
    if args.attack is not None or args.shadow_models is not None or args.resume:
        flag = "attack" if args.attack is not None else "shadow_models" if args.shadow_models is not None else "resume"
        raise InvalidParameterError(
            flag,
            getattr(args, flag),
            "is not used by the language-model audit (--data): it trains one model with canaries",
        )
    _refuse_pdp_flags(args)
    if args.model is None:
        raise InvalidParameterError("model", None, "with --data: give a local Hugging Face model folder")
    check_model_folder(args.model)
    audit = LMAuditOptions(
        canaries=args.canaries if args.canaries is not None else LM_CANARIES,
        digits=args.canary_digits,
        prefix=args.canary_prefix if args.canary_prefix is not None else DEFAULT_PREFIX,
        exact_limit=args.exact_limit,
        candidates=args.candidates,
        contexts=args.canary_contexts,
        repeats=args.canary_repeats,
        users=args.canary_users,
        confidence=args.confidence,
    )
    seed = CommandSeed.of(args)
    options = FinetuneOptions(
        method=args.method,
        epochs=float(args.epochs if args.epochs is not None else LM_DEFAULTS["epochs"]),
        batch_size=args.batch_size if args.batch_size is not None else LM_DEFAULTS["batch_size"],
        lr=args.lr if args.lr is not None else LM_DEFAULTS["lr"],
        max_grad_norm=args.clip_norm if args.clip_norm is not None else LM_DEFAULTS["clip_norm"],
        max_length=args.max_length,
        grad_sample_mode=args.grad_sample_mode,
        accountant=args.accountant,
        seed=seed(),
        secure_mode=args.secure_mode,
        device=args.device,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    data = load_text_data(
        args.data,
        args.text_column,
        None,
        None if args.budgets_file else args.budget_column,
        user_column=args.user_column,
    )
    users = None
    if args.user_column:
        from ..users import Users

        users = Users(data.users, args.max_rows_per_user)
    budgets = _lm_budgets(args, data, users, seed)
    r = audit_finetune(
        args.model, data, budgets, args.out, options=options, audit=audit, users=users, overwrite=args.overwrite
    )
    return {**r, "out": str(args.out)}


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

    if "lm_audit" in r:
        from ..audit.lm_report import lm_audit_text

        groups = ", ".join(f"{g['budget']:g}: {g['epsilon_spent']:.3f}" for g in r["groups"])
        return "\n".join(
            [
                f"idpsgd audit: {r['method']} fine-tuning of {r['model']} on {r['dataset']} with canaries, "
                f"{r['steps']} steps; reported epsilon per group {groups}",
                lm_audit_text(r["lm_audit"]),
                f"run folder: {r['out']} (report.html; canaries and their scores: private/canaries.csv, mode 0600)",
            ]
        )

    full = (r.get("private") or {}).get("audit")
    return audit_text(full) if full is not None else public_audit_text(r)


register_text(audit_cmd, _text)


def _refuse_pdp_flags(args):
    """PDP-SGD flags with another method: refused (not silently ignored)."""
    from ..validation import InvalidParameterError

    defaults = {"threshold_loss": "fixed", "w1": None, "rounds": 3, "noise_history": False, "per_round_delta": False}
    for name, default in defaults.items():
        if getattr(args, name, default) != default:
            raise InvalidParameterError(
                name, getattr(args, name), f"only applies to --method pdp-sgd, not {args.method}"
            )
