"""The ``finetune`` command: a thin wrapper over :func:`idpsgd.integrations.hf.finetune` (needs the
``hf`` extra: ``pip install 'idpsgd[hf]'``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .budget_args import OTHER_SOURCES as _OTHER_SOURCES
from .budget_args import CommandSeed, budget_source_args, budgets_from_args, warn_nproc
from .budget_args import accountant_arg as _accountant
from .registry import Noted, TypedStore, arguments, command, count_label, register_text


def _finetune_args(p):
    from ..names import IDP_METHODS as METHODS

    p.add_argument(
        "--model",
        required=True,
        help="local model folder as save_pretrained writes it (config.json, "
        "weights, tokenizer files); nothing is downloaded",
    )
    p.add_argument("--data", required=True, help="training texts: a JSON Lines (.jsonl) or CSV (.csv) file")
    p.add_argument("--eval-data", help="held-out texts (same columns) for the report's test metrics")
    p.add_argument("--text-column", default="text", help="the column with each row's text (default text)")
    p.add_argument(
        "--label-column",
        help="class labels: fine-tune a sequence classifier (default: none, causal language modelling); "
        "the class set comes from the model's config (when it names its classes), --labels or --num-classes, "
        "never from the data",
    )
    p.add_argument(
        "--labels",
        help="A,B,...: the classes' names, in class-id order (with --label-column; a row's label is a name or "
        "its id); rows with another label are refused",
    )
    p.add_argument(
        "--num-classes",
        type=int,
        help="K: integer labels 0..K-1 (with --label-column); rows with another label are refused",
    )
    p.add_argument("--method", choices=METHODS, required=True, help="uniform, sample or scale (Boenisch et al. §3)")
    # --budget-column (epsilon) is read from --data only without another budget flag, unless typed
    budget_source_args(p, typed_column=True)
    for action in p._actions:
        if action.dest == "budget_column":
            action.help = (
                "column with each row's budget: of --budgets-file if given, else of --data (used when "
                "--data has it and no other budget flag is given; named explicitly, always) (default: epsilon)"
            )
    p.add_argument("--delta", type=float, default=1e-5, help="global δ in (0, 1) (default 1e-5)")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the data (default 3)")
    p.add_argument("--batch-size", type=int, default=16, help="expected (Poisson) batch size B (default 16)")
    p.add_argument(
        "--physical-batch-size",
        type=int,
        help="at most this many examples per forward pass on each process (must divide --batch-size / --nproc; "
        "default: --batch-size / --nproc)",
    )
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate, linear decay (default 5e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument(
        "--clip-norm",
        "--max-grad-norm",
        dest="clip_norm",
        action=TypedStore,
        type=float,
        default=1.0,
        help="every example's clip norm, as train's --clip-norm (default 1); --max-grad-norm is its former "
        "name, kept for one release",
    )
    p.add_argument("--max-length", type=int, default=128, help="tokens per text after truncation (default 128)")
    p.add_argument(
        "--pad-to-length",
        type=int,
        metavar="N",
        help="pad every batch to exactly N tokens (>= --max-length): a public length, so that no example's "
        "length moves another's computation even in a model that pools over pads (default: each batch as long "
        "as its longest row, with per-example positions or right padding)",
    )
    p.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on the frozen model (default 0: full fine-tuning)",
    )
    p.add_argument(
        "--grad-sample-mode",
        choices=["bk", "ghost", "hooks", "functorch"],
        default="bk",
        help="bk: book-keeping (one backward pass); ghost: ghost clipping (two backward passes; no tied "
        "embeddings); hooks / functorch: Opacus's per-sample gradients (default bk)",
    )
    p.add_argument("--secure-mode", action="store_true", help="sampling and noise from OS entropy; refuses --seed")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="default cpu")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="a progress bar on stderr with each group's ε spent so far (default: on when stderr is a terminal)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass (less memory; torch's reentrant checkpointing, bk or hooks)",
    )
    _accountant(p)
    p.add_argument(
        "--out",
        required=True,
        help="run folder: public model/, report.json, report.html; private/ "
        "(mode 0600): per-example ε, ledger, training losses, seed",
    )
    p.add_argument("--overwrite", action="store_true", help="replace another run already in OUT")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes (default 1): rank r trains on its own examples, the noise is added once; "
        "the same run (ε and parameters) as one process; gloo on CPU, one GPU per process with --device cuda",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (each transformer block and the root, fully_shard) over the processes "
        "of torchrun --nproc-per-node N (or --nproc N); bk or ghost, with --lora-r and --user-column (bk) too; "
        "checkpoints are sharded folders "
        "(OUT/private/checkpoint-<step>/)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        metavar="N",
        help="write a private checkpoint every N steps (OUT/private/checkpoint-<step>.pt, mode 0600: model, "
        "optimizer, privacy engine, sampler and noise states); --resume continues from the latest",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUT from its latest checkpoint, exactly as if uninterrupted (the same data, "
        "budgets and options; refused otherwise)",
    )
    p.add_argument(
        "--user-column",
        help="the column of --data with each row's user: user-level privacy (budgets per user, --batch-size "
        "counts users; see the user-level docs)",
    )
    p.add_argument(
        "--max-rows-per-user", type=int, default=4, help="k: the most rows of one user in one step (public; default 4)"
    )


def other_sources(args) -> list[str]:
    return [s for s in _OTHER_SOURCES if getattr(args, s, None)]


def _budget_column_of_data(args) -> str | None:
    """The column of --data to read budgets from: --budget-column (default epsilon), unless the budgets
    come from --budgets-file, or from another flag while --budget-column was not given (typed: TypedStore)."""
    explicit = "budget_column" in getattr(args, "_typed", {})
    if args.budgets_file or (other_sources(args) and not explicit):
        return None
    return args.budget_column


def _resume_note(args) -> tuple[bool, tuple[str, ...]]:
    """Whether to resume, and the note saying which: --resume continues from the latest checkpoint in OUT
    or, when OUT holds none, starts a new run there (as train --resume does); the command says which on
    stderr when it succeeds (:class:`~.registry.Noted`).  Without --resume or --overwrite a folder with
    checkpoints is refused."""
    from ..integrations.hf.checkpoints import checkpoints_in
    from ..validation import InvalidParameterError

    found = checkpoints_in(args.out)
    if args.resume and found:
        step, path = found[-1]
        return True, (f"resumed from {path} (step {step})",)
    if args.resume:
        return False, (f"--resume: {args.out} held no checkpoint (private/checkpoint-<step>.pt); a new run started",)
    if found and not args.overwrite:
        raise InvalidParameterError(
            "out",
            str(args.out),
            f"holds a run with checkpoints (the latest at step {found[-1][0]}): --resume continues it, "
            "--overwrite replaces it; or give a new folder",
        )
    return False, ()


def _budgets(args, data, class_ids, seed, classes=None, users=None):
    """The budgets: the data file's --budget-column when it has one and no other source is given."""
    from ..assignment import Budgets
    from ..validation import InvalidParameterError, check_delta

    others = other_sources(args)
    if data.budgets is not None:
        if others:
            raise InvalidParameterError(
                others[0],
                getattr(args, others[0]),
                f"the data has a budget column "
                f"{args.budget_column!r}: give the budgets one way (drop the flag, or "
                "choose another --budget-column)",
            )
        if users is not None:  # a per-row column, constant within each user
            names = [f"{args.data} data row {i + 1}" for i in range(len(data.budgets))]
            return users.budgets_from_rows(data.budgets, check_delta(args.delta), row_names=names)
        return Budgets.from_array(data.budgets, check_delta(args.delta))
    if users is not None and getattr(args, "budgets_per_class", None):
        raise InvalidParameterError(
            "budgets_per_class", args.budgets_per_class, "is not meaningful at user level; give budgets per user"
        )
    if not others:
        raise InvalidParameterError(
            "budget_column",
            args.budget_column,
            f"is not a column of --data {str(args.data)!r}, and no other budget flag is given: give each row's "
            "budget in that column (or name yours with --budget-column), or give --budgets with --fractions, "
            "--budgets-per-class, --budgets-file or --budget-distribution",
        )
    import numpy as np

    n = len(data) if users is None else users.num_users
    labels = None if class_ids is None else np.asarray(class_ids)
    return budgets_from_args(args, n, labels, seed=seed, class_names=classes)


def _text(r):
    m = r.get("test_metrics") or {}
    shown = ", ".join(
        f"test {k.removeprefix('test_')} {m[k]:.4g}"
        for k in ("test_accuracy", "test_perplexity", "test_loss")
        if m.get(k) is not None
    )
    lines = [
        f"finetune ({r['method']}, {r['task']}) of {r['model']} on {r['dataset']}: {r['steps']} steps"
        + (" (stopped by the privacy filter)" if r["stopped_early"] else "")
        + (f"; {shown}" if shown else ""),
        f"{'budget':>8} {count_label(r):>8} {'sample_rate':>12} {'clip_norm':>10} {'eps_spent':>10}",
    ]
    for g in r["groups"]:
        lines.append(
            f"{g['budget']:>8.4g} {g['count']:>8d} {g['sample_rate']:>12.5f} {g['clip_norm']:>10.4f} "
            f"{g['epsilon_spent']:>10.4f}"
        )
    lines.append(f"model: {r['out']}/model; report: {r['out']}/report.json")
    return "\n".join(lines)


@command("finetune", "fine-tune a local Hugging Face model on a local text file with per-example budgets")
@arguments(_finetune_args)
def finetune_cmd(args):
    from ..integrations.hf.finetune import FinetuneOptions, check_model_folder, finetune, model_label2id
    from ..integrations.hf.text_data import label_ids, load_text_data, public_classes

    resume, notes = _resume_note(args)
    recorded = None
    if resume and args.seed is None and not args.secure_mode:  # continue with the run's own seed
        from ..integrations.hf.checkpoints import checkpoint_seed

        recorded = checkpoint_seed(args.out)
    seed = CommandSeed.of(args, None if recorded is None else int(recorded))
    options = FinetuneOptions(
        method=args.method,
        epochs=args.epochs,
        batch_size=args.batch_size,
        physical_batch_size=args.physical_batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.clip_norm,
        max_length=args.max_length,
        pad_to_length=args.pad_to_length,
        lora_r=args.lora_r,
        grad_sample_mode=args.grad_sample_mode,
        accountant=args.accountant,
        seed=seed(),
        secure_mode=args.secure_mode,
        device=args.device,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
        gradient_checkpointing=args.gradient_checkpointing,
        labels=args.labels,
        num_classes=args.num_classes,
        save_every=args.save_every,
        nproc=args.nproc,
        fsdp=args.fsdp,
    )
    if args.nproc > 1:
        warn_nproc(args.nproc, "cuda" if args.device == "cuda" else "cpu")
    folder = check_model_folder(args.model)
    data = load_text_data(
        args.data,
        args.text_column,
        args.label_column,
        _budget_column_of_data(args),
        user_column=args.user_column,
    )
    users = None
    if args.user_column:
        from ..users import Users

        users = Users(data.users, args.max_rows_per_user)
    eval_data = (
        load_text_data(args.eval_data, args.text_column, args.label_column, flag="eval_data")
        if args.eval_data
        else None
    )
    class_ids = classes = None
    if data.labels is not None:  # the public class set, and every row checked against it
        classes = public_classes(model_label2id(folder), options.labels, options.num_classes)
        class_ids = label_ids(data, classes, "data")
        if eval_data is not None:
            label_ids(eval_data, classes, "eval_data")
    budgets = _budgets(args, data, class_ids, seed, classes, users)
    report = finetune(
        args.model,
        data,
        budgets,
        args.out,
        eval_data=eval_data,
        options=options,
        overwrite=args.overwrite,
        resume=resume,
        users=users,
    )
    if report is None:  # another rank than 0 under torchrun: rank 0 reports
        return Noted(None, notes)
    return Noted({**report, "out": str(Path(args.out))}, notes)


register_text(finetune_cmd, _text)
