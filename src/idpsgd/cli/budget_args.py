"""Flags that say where per-example budgets come from, shared by every command that takes budgets."""

from __future__ import annotations

from ..names import ACCOUNTANTS
from ..validation import InvalidParameterError, check_delta, check_epsilon
from .registry import TypedStore


def accountant_arg(p):
    p.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default="rdp",
        help="rdp: Rényi DP with the improved conversion; pld: dp_accounting's PLD; prv: Opacus's PRV "
        "accountant (its default; ε is its upper error bound) (default rdp)",
    )


#: the budget flags other than a budget column of the data itself
OTHER_SOURCES = ("budgets", "budgets_per_class", "budgets_file", "budget_distribution")


def budgets_file_of_train_csv(args) -> str | None:
    """``--budgets-file`` as ``train --dataset csv`` reads it: the budgets of train.csv's own
    ``--budget-column`` (default epsilon) when it has that column and no other budget flag is given — as
    ``finetune`` reads its ``--data``'s — are read as ``--budgets-file DATA_DIR/train.csv``; else the flag."""
    import csv
    from pathlib import Path

    if getattr(args, "dataset", None) != "csv" or not args.data_dir:
        return args.budgets_file
    if any(getattr(args, s, None) for s in OTHER_SOURCES):
        return args.budgets_file
    path = Path(args.data_dir) / "train.csv"
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            header = [h.strip() for h in next(csv.reader(fh))]
    except (OSError, StopIteration, csv.Error, UnicodeDecodeError):
        return args.budgets_file  # the dataset loader reports the file
    return str(path) if args.budget_column in header else args.budgets_file


def warn_nproc(nproc: int, device) -> None:
    """A warning (stderr) when ``--nproc`` CPU processes exceed the machine's cores: they share them,
    and every collective waits for the slowest."""
    import os
    import sys

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if str(device).startswith("cpu") and nproc > cores:
        sys.stderr.write(
            f"idpsgd: warning: --nproc {nproc} processes on {cores} CPU core(s): they share the cores (each gets "
            "one torch thread) and run slower than fewer processes would\n"
        )


def budget_source_args(p, required=True, typed_column=False):
    """Flags that describe where per-example budgets come from (shared by assign and train);
    ``typed_column``: ``--budget-column`` records whether it was typed (:class:`~.registry.TypedStore`)."""
    p.add_argument("--budgets", help="comma-separated group budgets, e.g. 1,2,3 (with --fractions)")
    p.add_argument("--fractions", help="comma-separated group fractions summing to 1")
    p.add_argument(
        "--budgets-per-class",
        help="per-class budgets, e.g. 0:1,1:2,2:3 (needs the rows' classes: train, or finetune with --label-column)",
    )
    p.add_argument("--budgets-file", help="CSV file with one row per example")
    p.add_argument(
        "--budget-column",
        action=TypedStore if typed_column else "store",
        default="epsilon",
        help="column of --budgets-file; train with --dataset csv: also of train.csv, read when it has the column "
        "and no other budget flag is given (default: epsilon)",
    )
    p.add_argument(
        "--budget-distribution",
        choices=["exponential"],
        help="Heo et al. App. C.1: 20 budget groups in --range A,B, sizes skewed by --skew K",
    )
    p.add_argument("--skew", type=float, default=0.0, help="exponent k of the exponential distribution (default 0)")
    p.add_argument("--range", help="A,B: budget range of --budget-distribution")
    p.add_argument(
        "--seed",
        type=int,
        help="seed of every random choice (group assignment, sampling, noise, "
        "initialisation); default: a fresh seed. A run keeps it privately in OUT/private/ (mode 0600), "
        "never in a public file or on stdout: it would let anyone replay the run",
    )


def budgets_from_args(
    args, num_examples=None, labels=None, split=None, *, seed: CommandSeed, num_classes=None, class_names=None
):
    """The per-example budgets the flags describe; ``seed``, the command's (group budgets are assigned to
    examples at random, :func:`assignment_seed`).  ``split`` (``Dataset.split``: a csv dataset's
    hidden train/test split) maps a budgets file with one row per data row of train.csv to the rows
    that train; a file with one row per training example is taken in training order.

    ``--budgets-per-class`` needs one budget per class of the *public* class set: the class ids
    0..``num_classes``-1, or the ids of ``class_names`` (whose names are accepted as keys too);
    ``labels`` are the training rows' class ids."""
    from ..assignment import Budgets, parse_class_map, parse_float_list

    delta = check_delta(args.delta)
    if args.budgets_file:
        budgets = Budgets.from_csv(_budgets_file(args.budgets_file, args.budget_column), args.budget_column, delta)
        if split is not None and len(budgets) == split["rows"] != num_examples:
            return Budgets(budgets.epsilons[split["train_rows"]], delta)  # train.csv's rows -> training rows
        if num_examples is not None and len(budgets) != num_examples:
            rows = f" or one per data row of train.csv ({split['rows']})" if split is not None else ""
            raise InvalidParameterError(
                "budgets_file",
                args.budgets_file,
                f"has {len(budgets)} budget rows; it needs one per training example ({num_examples}){rows}",
            )
        return budgets
    if getattr(args, "budget_distribution", None):
        if num_examples is None:
            raise InvalidParameterError("num_examples", None, "is needed with --budget-distribution")
        bounds = parse_float_list(args.range or "", "range")
        if len(bounds) != 2:
            raise InvalidParameterError("range", args.range, "must be A,B (two numbers)")
        return Budgets.from_exponential(
            num_examples, bounds[0], bounds[1], args.skew, delta, seed=assignment_seed(seed)
        )
    if args.budgets_per_class:
        if labels is None:
            raise InvalidParameterError(
                "budgets_per_class", args.budgets_per_class, "needs labels: use it with 'idpsgd train'"
            )
        mapping = parse_class_map(args.budgets_per_class)
        classes = None
        if class_names is not None:
            index = {c: i for i, c in enumerate(class_names)}
            named = {}
            for k, v in mapping.items():
                key = k if isinstance(k, int) else index.get(k, k)
                if key in named:
                    raise InvalidParameterError(
                        "budgets_per_class", args.budgets_per_class, f"gives class {k!r} (id {key}) two budgets"
                    )
                named[key] = v
            mapping, classes = named, range(len(class_names))
        elif num_classes is not None:
            classes = range(int(num_classes))
        try:
            return Budgets.from_class_map(labels, mapping, delta, classes=classes)
        except InvalidParameterError as exc:  # name the flag as typed, with the text the user gave
            detail = "" if exc.name == "budgets_per_class" else f" ({exc.name}={exc.value!r})"
            raise InvalidParameterError("budgets_per_class", args.budgets_per_class, exc.allowed + detail) from None
    if not args.budgets:
        raise InvalidParameterError(
            "budgets",
            None,
            "give --budgets with --fractions, --budgets-per-class, --budgets-file, or --budget-distribution",
        )
    values, fractions = group_spec(args)
    return Budgets.from_groups(values, fractions, num_examples, delta, seed=assignment_seed(seed))


def _budgets_file(path, column):
    """``--budgets-file`` checked before it is read: an existing, non-empty file."""
    from pathlib import Path

    p = Path(path)
    expected = f"(expected a CSV file with a header row and a column {column!r})"
    if not p.exists():
        raise InvalidParameterError("budgets_file", str(path), f"not found {expected}")
    if not p.is_file():
        raise InvalidParameterError("budgets_file", str(path), f"is not a file {expected}")
    if p.stat().st_size == 0:
        raise InvalidParameterError("budgets_file", str(path), f"is empty {expected}")
    return p


def group_spec(args):
    """(budgets, fractions) from --budgets/--fractions, validated."""
    from ..assignment import group_counts, parse_float_list

    values = parse_float_list(args.budgets, "budgets")
    if not values:
        raise InvalidParameterError("budgets", args.budgets, "must be a comma-separated list of budgets, e.g. 1,2,3")
    check_epsilon(values, "budgets")
    if len(set(values)) != len(values):
        raise InvalidParameterError("budgets", values, "must be distinct (a group is a distinct budget)")
    if args.fractions is None and len(values) != 1:
        raise InvalidParameterError("fractions", None, "are required when there is more than one budget")
    fractions = parse_float_list(args.fractions, "fractions") if args.fractions else [1.0]
    group_counts(fractions, 1_000_000, values)  # validates count, positivity and sum
    return values, fractions


class CommandSeed:
    """One command's seed, built once from its flags and passed to every part that draws (never kept on
    argparse's namespace): ``given`` (``--seed``, or what a resumed audit recorded), else a fresh one; None
    in secure mode, which refuses a given seed (:func:`~idpsgd.engine.noise.randomness.resolve_seed`).
    ``recorded``: the seed a resumed run continues with, taken as it is.  Resolved at the first call, so a
    bad ``--seed`` is refused where the command first reads it (after the flags checked before); every
    later call returns the same value, the one a run records privately."""

    def __init__(self, given=None, secure_mode: bool = False, recorded: int | None = None):
        self._given, self._secure_mode = given, secure_mode
        self._value, self._resolved = recorded, recorded is not None

    @classmethod
    def of(cls, args, recorded: int | None = None) -> CommandSeed:
        """From ``--seed`` and ``--secure-mode`` (a command without them: a fresh seed)."""
        return cls(getattr(args, "seed", None), getattr(args, "secure_mode", False), recorded)

    def __call__(self) -> int | None:
        if not self._resolved:
            from ..engine.noise.randomness import resolve_seed

            self._value, self._resolved = resolve_seed(self._given, self._secure_mode), True
        return self._value


def assignment_seed(seed: CommandSeed):
    """Seed of the random assignment of group budgets to examples (OS entropy in secure mode)."""
    import secrets

    value = seed()
    return secrets.randbits(63) if value is None else value
