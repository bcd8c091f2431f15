"""The ``train`` and ``demo`` commands: thin wrappers over :func:`idpsgd.training.train`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..names import INDIVIDUAL_ACCOUNTANTS
from .budget_args import (
    CommandSeed,
    accountant_arg,
    assignment_seed,
    budget_source_args,
    budgets_file_of_train_csv,
    budgets_from_args,
    warn_nproc,
)
from .filter_args import add_filter_arguments, filter_options_from_args
from .pdp_args import add_pdp_arguments, pdp_options_from_args
from .registry import Noted, arguments, command, count_label, fills, register_text, with_flags
from .user_args import (
    add_user_arguments,
    check_user_column,
    drop_columns_with_user,
    user_budgets_from_args,
    users_from_args,
)

DEMO_BUDGETS, DEMO_FRACTIONS = "1,2,3", "0.34,0.43,0.23"


def hyper_args(p):
    from ..training import TrainConfig

    d = TrainConfig()
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    p.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"expected batch size B; mean rate q = B/N (default {d.batch_size})",
    )
    p.add_argument("--lr", type=float, default=d.lr, help=f"SGD learning rate (default {d.lr})")
    p.add_argument("--momentum", type=float, default=d.momentum, help=f"SGD momentum (default {d.momentum})")
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help=f"(mean) clip norm c (default {d.clip_norm})")
    p.add_argument("--delta", type=float, default=1e-5, help="global δ in (0, 1) (default 1e-5)")
    p.add_argument("--model", help="model name (default: the dataset's; see idpsgd.models.MODELS)")
    p.add_argument(
        "--dataset",
        default="digits",
        help="digits (bundled), mnist, fashion-mnist, cifar10, svhn or csv (default digits)",
    )
    p.add_argument("--data-dir", help="folder with the dataset's files (all but digits)")
    p.add_argument("--label-column", default="label", help="label column of a csv dataset (default label)")
    p.add_argument(
        "--num-classes",
        type=int,
        help="K: the number of classes of a csv dataset (required for csv: labels are the class ids 0..K-1, "
        "a row with another label is refused; public information, never read from the rows); the named "
        "datasets have their documented count (10)",
    )
    p.add_argument(
        "--feature-columns",
        help="A,B,...: the csv columns that are model inputs (default: every column "
        "but the label, the budget column (--budget-column) and row identifiers such as id; see --drop-columns)",
    )
    p.add_argument(
        "--drop-columns",
        help="A,B,...: csv columns that are not model inputs (default: none beyond the "
        "budget column and row identifiers, which are always left out)",
    )
    n = p.add_argument_group("input normalization (inside the privacy guarantee)")
    n.add_argument(
        "--normalization",
        help="none, public (published constants: mnist, fashion-mnist, cifar10, svhn), "
        "private (a DP estimate charged to every example's budget) or MEAN,STD (default: public where "
        "published constants exist, else none)",
    )
    n.add_argument("--normalization-epsilon", type=float, help="ε of the private mean/std estimate (with private)")
    n.add_argument(
        "--normalization-delta",
        type=float,
        help="δ of the private mean/std estimate (with private; charged on top of the training δ)",
    )
    n.add_argument("--feature-range", help="A,B: public value range of csv features (with private)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="progress on stderr with each group's ε spent so far: a bar on a terminal, else one line per epoch "
        "(default: on; --no-progress: nothing)",
    )
    p.add_argument(
        "--device",
        default=d.device,
        help=f"cpu, cuda, auto (cuda when available) or a torch device such as cuda:1 (default {d.device})",
    )
    p.add_argument(
        "--grad-sample-mode",
        choices=["bk", "hooks", "functorch", "ghost"],
        default=d.grad_sample_mode,
        help="bk: book-keeping (one backward pass; ghost norms or per-sample gradients per layer, "
        "near non-private cost); hooks / functorch: Opacus's per-sample gradients; ghost: Opacus's "
        f"fast gradient clipping (two backward passes) (default {d.grad_sample_mode})",
    )
    p.add_argument(
        "--secure-mode",
        action="store_true",
        help="Opacus's secure mode: sampling and noise from OS entropy, secure noise sampling; refuses --seed",
    )
    accountant_arg(p)


def _train_args(p):
    from ..names import PDP_METHODS, PLAN_METHODS

    p.add_argument("--method", choices=PLAN_METHODS + PDP_METHODS, required=True)
    budget_source_args(p)
    hyper_args(p)
    p.add_argument(
        "--exclude-below",
        type=float,
        help="exclude: drop examples with budget below this (default: the second-smallest budget)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes on this machine (gloo on CPU, "
        "NCCL with one GPU each on cuda); the same privacy accounting as one process (default 1)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="run folder: public report.json, report.html, model.pt; private/ "
        "(mode 0600): checkpoint, ledger, per-example files",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace another run already in OUT")
    add_user_arguments(p)
    p.add_argument(
        "--release-epsilon",
        type=float,
        default=0.5,
        help="ε of the private release of individual-ε "
        "statistics (mean and quantiles), charged to every example (default 0.5)",
    )
    add_pdp_arguments(p.add_argument_group("PDP-SGD and its baselines (Heo et al.)"))
    add_filter_arguments(p.add_argument_group("individual Rényi filter (Feldman & Zrnic 2021; Boenisch et al. §5)"))
    g = p.add_argument_group("individual privacy accounting (Yu et al. 2023)")
    g.add_argument(
        "--individual-accounting",
        action="store_true",
        help="account for the ε every training example actually received",
    )
    g.add_argument(
        "--refreshes-per-epoch", type=float, default=1.0, help="γ: gradient-norm refreshes per epoch (default 1)"
    )
    g.add_argument(
        "--rounding",
        choices=["exact", "ceil", "nearest"],
        default="nearest",
        help="rounding of norms: nearest (the paper's), ceil (never below), exact (default nearest)",
    )
    g.add_argument("--rounding-step", type=float, help="rounding step r (default 0.01 x clip norm)")
    g.add_argument(
        "--individual-clipping",
        action="store_true",
        help="clip each example at its latest norm estimate (Alg. 3): ε becomes a guarantee (without it, "
        "--refreshes-per-epoch = steps per epoch with --rounding exact or ceil clips each example at its "
        "charge every step, also a guarantee; anything else is an estimate)",
    )
    g.add_argument(
        "--validate-subset",
        type=int,
        default=1000,
        help="examples tracked exactly at every step to validate the estimates (default 1000; 0: off)",
    )
    g.add_argument(
        "--individual-accountant",
        choices=INDIVIDUAL_ACCOUNTANTS,
        default="rdp",
        help="per-example bound: rdp, or pld (its PLD as well; needs --rounding ceil or nearest); each "
        "example's ε is the smallest of its bounds and its group's (default rdp)",
    )
    g.add_argument(
        "--save-norms",
        action="store_true",
        help="write OUT/private/norms.npz: every refresh's gradient norms, the file 'idpsgd account --norms' reads",
    )


def config_from_args(args, method, seed: CommandSeed):
    """The :class:`~idpsgd.training.TrainConfig` of the flags; ``seed``, the command's."""
    from ..training import TrainConfig

    return TrainConfig(
        method=method,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        clip_norm=args.clip_norm,
        accountant=args.accountant,
        model=args.model,
        seed=seed(),
        secure_mode=args.secure_mode,
        device=args.device,
        grad_sample_mode=args.grad_sample_mode,
        exclude_below=getattr(args, "exclude_below", None),
        progress=args.progress is not False,
    )


def _individual(args):
    """Individual accounting options from the flags (None without --individual-accounting)."""
    from ..engine import IndividualAccountingOptions
    from ..validation import InvalidParameterError

    if not getattr(args, "individual_accounting", False):
        for flag in ("individual_clipping", "save_norms"):
            if getattr(args, flag, False):
                raise InvalidParameterError(flag, True, "needs --individual-accounting")
        return None
    return IndividualAccountingOptions(
        refreshes_per_epoch=args.refreshes_per_epoch,
        rounding=args.rounding,
        rounding_step=args.rounding_step,
        individual_clipping=args.individual_clipping,
        validate_subset=args.validate_subset,
        record_norms=args.save_norms,
        accountant=args.individual_accountant,
    )


def dataset_from_args(args, saved: dict | None = None):
    """The dataset; a resumed run re-applies the normalization record of its checkpoint's
    signature ``saved`` (the same privately estimated constants, charged once)."""
    from ..data import load_dataset
    from ..preprocessing import parse_feature_range, parse_normalization

    normalization = parse_normalization(args.normalization) if args.normalization else None
    if saved and normalization == "private":
        record = saved.get("preprocessing")
        if isinstance(record, dict):
            normalization = record
    return load_dataset(
        args.dataset,
        args.data_dir,
        label_column=args.label_column,
        num_classes=args.num_classes,
        normalization=normalization,
        normalization_epsilon=args.normalization_epsilon,
        normalization_delta=args.normalization_delta,
        feature_range=parse_feature_range(args.feature_range) if args.feature_range else None,
        feature_columns=args.feature_columns,
        drop_columns=args.drop_columns,
        budget_column=getattr(args, "budget_column", None),
        split_column=getattr(args, "user_column", None) or None,
    )


def saved_signature(folder, notes: list | None = None) -> dict:
    """The settings recorded in a run folder's checkpoint ({} without one).  ``notes`` (shown on stderr
    when the command succeeds) gets which checkpoint and step the run continued from, or that the
    folder held none and a new run started (``--resume`` on a folder without a checkpoint)."""
    from ..io import load_torch
    from ..runfolder import PRIVATE
    from ..training.loop import CHECKPOINT

    ckpt = folder.path / PRIVATE / CHECKPOINT
    if not ckpt.is_file():
        if notes is not None:
            notes.append(f"--resume: {folder.path} held no checkpoint; a new run started")
        return {}
    state = load_torch(ckpt)
    if notes is not None and isinstance(state, dict):
        notes.append(f"resumed from {ckpt} (step {state.get('step')})")
    signature = state.get("signature") if isinstance(state, dict) else None
    return signature if isinstance(signature, dict) else {}


def _pdp_text(r):
    lines = [
        f"{r['method']} on {r['dataset']} ({r['model']}): test accuracy {r['test_accuracy']:.4f} after "
        f"{r['steps']} steps in {len(r['rounds'])} round(s); threshold loss {r['threshold_loss']}",
        f"{'round':>5} {'threshold':>9} {'sigma':>8} {'q':>8} {'E|D_R|':>8}",
    ]
    for x in r["rounds"]:
        lines.append(
            f"{x['round']:>5} {x['threshold']:>9.4f} {x['noise_multiplier']:>8.4f} {x['sample_rate']:>8.5f} "
            f"{x['expected_sample_size']:>8.1f}"
        )
    lines.append(f"{'budget':>8} {count_label(r):>8} {'eps_spent':>10} {'delta':>10}")
    for g in r["groups"]:
        lines.append(f"{g['budget']:>8.4g} {g['count']:>8d} {g['epsilon_spent']:>10.4f} {g['delta']:>10.3g}")
    lines.append(
        f"per-example (epsilon, delta): {r['out']}/private/pdp_guarantees.csv (personal data); "
        f"report: {r['out']}/report.json"
    )
    return "\n".join(lines)


def _train_text(r):
    if "rounds" in r:
        return _pdp_text(r)
    lines = [
        f"{r['method']} on {r['dataset']} ({r['model']}): test accuracy {r['test_accuracy']:.4f} "
        f"after {r['steps']} steps" + (" (stopped by the privacy filter)" if r["stopped_early"] else ""),
        f"{'budget':>8} {count_label(r):>8} {'sample_rate':>12} {'clip_norm':>10} {'eps_spent':>10}",
    ]
    for g in r["groups"]:
        c = f"{g['clip_norm']:>10.4f}" if g["clip_norm"] is not None else f"{'excluded':>10}"
        lines.append(f"{g['budget']:>8.4g} {g['count']:>8d} {g['sample_rate']:>12.5f} {c} {g['epsilon_spent']:>10.4f}")
    ip = r.get("individual_privacy")
    if ip:
        rel = ip["released"]
        qs = ", ".join(f"{k}: {v:.3f}" for k, v in rel["quantiles"]["values"].items())
        lines.append(
            f"individual epsilon ({ip['kind']}), privately released with epsilon {rel['total']['epsilon']:g}: "
            f"mean {rel['mean']['value']:.3f}; quantiles {qs}"
        )
        if ip.get("kind_reason"):
            lines.append(f"  {ip['kind']}: {ip['kind_reason']}")
        exact = (r.get("private") or {}).get("individual_privacy")
        if exact:
            lines.append(
                f"[private] exact: mean {exact['mean']:.4f}, median {exact['quantiles']['0.5']:.4f}, "
                f"max {exact['max']:.4f}; worst case {exact['worst_case_epsilon']:.4f}; "
                f"{100 * exact['share_at_worst_case']:.1f}% at the worst case"
            )
            chk = exact.get("sensitivity_check")
            if chk:
                above = (
                    "gradients above their charged sensitivity, clipped to it (enforced; "
                    if chk.get("enforced")
                    else "clipped norms above their charged sensitivity ("
                )
                lines.append(
                    f"[private] sensitivity check: {chk['examples']} trained examples over {chk['steps']} "
                    f"steps; {chk['exceeded']} {above}largest ratio "
                    f"{chk['max_ratio']:.4g}); {chk['mismatched']} of {chk['compared']} norms compared "
                    f"differed from the norm pass (largest relative difference "
                    f"{chk['max_relative_mismatch']:.3g})"
                )
            if "validation" in exact:
                v = exact["validation"]
                lines.append(
                    f"[private] validation on {v['examples']} examples tracked exactly: Pearson r "
                    f"{v['pearson_r'] if v['pearson_r'] is None else round(v['pearson_r'], 4)}, "
                    f"mean |error| {v['mean_abs_error']:.4f}, max |error| {v['max_abs_error']:.4f}"
                )
        lines.append(f"per-example values: {r['out']}/private/individual_epsilons.csv (personal data)")
    lines.append(f"report: {r['out']}/report.json")
    return "\n".join(lines)


def _train_flags(args):
    """The flags as ``train`` reads them: train.csv's budget column as ``--budgets-file``
    (:func:`budgets_file_of_train_csv`), the user column among ``--drop-columns`` (:func:`drop_columns_with_user`)."""
    return with_flags(args, budgets_file=budgets_file_of_train_csv(args), drop_columns=drop_columns_with_user(args))


@command("train", "train a model with individualized privacy budgets (IDP-SGD) and report ε per group")
@arguments(_train_args)
@fills(_train_flags)
def train_cmd(args):
    from ..names import PDP_METHODS
    from ..runfolder import RunFolder
    from ..training import train
    from ..training.filtered import check_filter_config, train_filtered
    from ..validation import InvalidParameterError

    individual = _individual(args)
    filter_options = filter_options_from_args(args)
    if filter_options is not None and individual is not None:
        raise InvalidParameterError(
            "individual_accounting",
            True,
            "cannot be combined with --filter individual "
            "(the filter does its own per-example accounting; see filter_epsilons.csv)",
        )
    pdp = pdp_options_from_args(args)
    folder = RunFolder(args.out, resume=args.resume, overwrite=args.overwrite)
    notes: list[str] = []
    saved = saved_signature(folder, notes) if args.resume else {}
    recorded = None
    if args.resume and args.seed is None and not args.secure_mode:  # continue with the recorded seed
        recorded = saved.get("config", {}).get("seed")
    seed = CommandSeed.of(args, recorded)
    try:
        config = config_from_args(args, args.method, seed)
        if filter_options is not None:
            check_filter_config(config, filter_options)
        check_user_column(args)
        data = dataset_from_args(args, saved)
        users = users_from_args(args, data)
        budgets = (
            budgets_from_args(
                args,
                len(data.y_train),
                data.y_train.numpy(),
                split=data.split,
                seed=seed,
                num_classes=data.num_classes,
            )
            if users is None
            else user_budgets_from_args(args, users, data, seed)
        )
        if args.nproc != 1:  # the same train() on N ranks (engine/distributed.py); rank 0 writes and reports
            from ..engine.distributed import check_nproc, launch
            from ..training.device import resolve_device

            check_nproc(args.nproc, pdp=args.method in PDP_METHODS, individual_filter=filter_options is not None)
            warn_nproc(args.nproc, resolve_device(config.device))
            report = launch(
                train,
                args.nproc,
                (data, budgets, config, folder),
                dict(resume=args.resume, individual=individual, release_epsilon=args.release_epsilon, users=users),
                device=resolve_device(config.device),
            )
        elif filter_options is not None:
            report = train_filtered(data, budgets, config, filter_options, folder, resume=args.resume, users=users)
        else:
            report = train(
                data,
                budgets,
                config,
                folder,
                resume=args.resume,
                individual=individual,
                release_epsilon=args.release_epsilon,
                pdp=pdp,
                users=users,
            )
    except BaseException:
        folder.discard_if_unused()
        raise
    return Noted({**report, "out": str(Path(args.out))}, tuple(notes))


register_text(train_cmd, _train_text)

# --- demo -----------------------------------------------------------------------------------
DEMO_RUNS = (
    ("uniform eps=1", "uniform", DEMO_BUDGETS, DEMO_FRACTIONS),
    ("sample", "sample", DEMO_BUDGETS, DEMO_FRACTIONS),
    ("scale", "scale", DEMO_BUDGETS, DEMO_FRACTIONS),
    ("uniform eps=3", "uniform", "3", None),
)


def demo_budgets(n: int, delta: float, seed: int):
    """The demo's budgets: 1/2/3 at 34/43/23 % of ``n`` examples, assigned at random (seeded)."""
    from ..assignment import Budgets, parse_float_list

    return Budgets.from_groups(
        parse_float_list(DEMO_BUDGETS, "budgets"), parse_float_list(DEMO_FRACTIONS, "fractions"), n, delta, seed=seed
    )


def _demo_args(p):
    hyper_args(p)
    p.add_argument(
        "--seed",
        type=int,
        help="seed of groups, sampling, noise and init (default: a fresh seed, "
        "recorded privately in OUT/private/seed.json, mode 0600; never in a public file)",
    )
    p.add_argument("--out", default="runs/demo", help="folder of the four runs (default runs/demo)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier demo in --out")


def run_demo(args) -> dict:
    """Budgets 1/2/3 at 34/43/23 %: uniform at ε=1, Sample, Scale, and uniform at ε=3 (upper bound)."""
    from ..accounting.neighbouring import neighbouring
    from ..assignment import Budgets
    from ..engine.noise.randomness import randomness_note
    from ..runfolder import RunFolder
    from ..training import train

    top = RunFolder(args.out, overwrite=args.overwrite)
    data = dataset_from_args(args)
    n = len(data.y_train)
    seed = CommandSeed.of(args)
    grouped = demo_budgets(n, args.delta, assignment_seed(seed))
    rows = []
    for label, method, budgets, fractions in DEMO_RUNS:
        b = grouped if fractions else Budgets.from_array([float(budgets)] * n, args.delta)
        out = Path(args.out) / label.replace(" ", "_").replace("=", "")
        report = train(data, b, config_from_args(args, method, seed), out, overwrite=True)
        # the ε=3 run trains everyone at 3: show it against the demo's groups for comparison
        spent = {g["budget"]: g["epsilon_spent"] for g in report["groups"]}
        rows.append(
            {
                "run": label,
                "method": method,
                "test_accuracy": report["test_accuracy"],
                "noise_multiplier": report["noise_multiplier"],
                "steps": report["steps"],
                "groups": report["groups"] if fractions else None,
                "epsilon_spent": spent,
                "out": str(out),
            }
        )
    if seed() is not None:
        top.record_seed(
            seed(),
            "the demo's seed: the budgets' assignment to examples and every run's sampling, noise "
            "and initialisation; demo --seed with it replays the demo",
        )
    summary = {
        "dataset": data.name,
        "budgets": DEMO_BUDGETS,
        "fractions": DEMO_FRACTIONS,
        "delta": args.delta,
        "accountant": args.accountant,
        "secure_mode": args.secure_mode,
        "randomness": randomness_note(args.secure_mode, "private/seed.json"),
        **neighbouring(),
        "runs": rows,
    }
    top.write_json("summary.json", summary, "public", "the demo's four runs: test accuracy and epsilon per group")
    return {**summary, **({"private": {"seed": seed()}} if seed() is not None else {})}


def _demo_text(s):
    lines = [
        f"idpsgd demo: {s['dataset']}, budgets {s['budgets']} at fractions {s['fractions']}, "
        f"delta={s['delta']:g}, accountant={s['accountant']}",
        f"{'run':<15} {'test acc':>8}  {'eps spent: group 1':>18} {'group 2':>8} {'group 3':>8}",
    ]
    for r in s["runs"]:
        if r["groups"]:
            eps = [f"{g['epsilon_spent']:>8.3f}" for g in r["groups"]]
        else:  # everyone at one budget (the unattainable upper bound)
            eps = [f"{v:>8.3f}" for v in r["epsilon_spent"].values()] * 3
        lines.append(f"{r['run']:<15} {r['test_accuracy']:>8.4f}  {eps[0]:>18} {eps[1]:>8} {eps[2]:>8}")
    lines.append(
        "group budgets: 1, 2, 3.  'uniform eps=3' ignores the budgets of groups 1-2 (an unattainable upper bound)."
    )
    return "\n".join(lines)


@command("demo", "the main job: uniform ε=1 vs Sample vs Scale vs uniform ε=3 on digits (budgets 1/2/3)")
@arguments(_demo_args)
def demo_cmd(args):
    return run_demo(args)


register_text(demo_cmd, _demo_text)
