"""``--user-column`` and ``--max-rows-per-user``: user-level individualized DP from the command line.

The user column of a csv dataset's train.csv names the person each row belongs to; it is never a
model input (it is dropped from the features), and the set of users, their row counts and their
budgets stay private (nothing of them is printed or written outside ``private/``).  Budgets are
per user: from groups (``--budgets``/``--fractions``: fractions of the users), from a budgets column
(every row of a user must carry the same value) or from a distribution; per class is refused.
"""

from __future__ import annotations

import csv

from ..validation import InvalidParameterError


def add_user_arguments(p) -> None:
    g = p.add_argument_group("user-level privacy (a budget per person, whatever their number of rows)")
    g.add_argument(
        "--user-column",
        help="csv: the column of train.csv naming each row's user; the privacy unit becomes the user (all of "
        "their rows), budgets are per user and --batch-size is the expected number of users per step "
        "(user-level sampling: each sampled user's summed gradient over up to k rows, clipped as one unit)",
    )
    g.add_argument(
        "--max-rows-per-user",
        type=int,
        default=4,
        help="k: the most rows of one sampled user in one step, chosen at random every step (public; default 4)",
    )


def drop_columns_with_user(args) -> str | None:
    """``--drop-columns`` as ``train`` reads it: the user column is never a model input, so without
    ``--feature-columns`` it is one of the dropped columns (:func:`check_user_column` refuses the rest)."""
    col = getattr(args, "user_column", None)
    if not col or args.feature_columns is not None:
        return args.drop_columns
    dropped = [c.strip() for c in (args.drop_columns or "").split(",") if c.strip()]
    return args.drop_columns if col in dropped else ",".join([*dropped, col])


def check_user_column(args) -> None:
    """The user column: a column of a csv dataset's train.csv, never among --feature-columns (it is added
    to --drop-columns: :func:`drop_columns_with_user`)."""
    col = getattr(args, "user_column", None)
    if not col:
        return
    if args.dataset != "csv":
        raise InvalidParameterError("user_column", col, "is read from a csv dataset's train.csv (--dataset csv)")
    header = _train_csv_header(args)
    if header is not None and col not in header:  # named here, not as a --drop-columns the user never gave
        raise InvalidParameterError("user_column", col, f"must be one of train.csv's columns {header}")
    if args.feature_columns and col in [c.strip() for c in args.feature_columns.split(",")]:
        raise InvalidParameterError(
            "feature_columns", args.feature_columns, f"includes the user column {col!r}: user ids are never inputs"
        )


def _train_csv_header(args) -> list[str] | None:
    """The column names of DATA_DIR/train.csv (None when it cannot be read: the loader reports that)."""
    from pathlib import Path

    try:
        with (Path(args.data_dir) / "train.csv").open(newline="", encoding="utf-8-sig") as fh:
            return [h.strip() for h in next(csv.reader(fh))]
    except (OSError, TypeError, StopIteration, csv.Error, UnicodeDecodeError):
        return None


def users_from_args(args, data):
    """The :class:`~idpsgd.users.Users` of the training rows (None without --user-column)."""
    col = getattr(args, "user_column", None)
    if not col:
        return None
    from pathlib import Path

    from ..users import Users

    path = Path(args.data_dir) / "train.csv"
    with path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or col not in reader.fieldnames:
            raise InvalidParameterError("user_column", col, f"must be one of {path.name}'s columns {reader.fieldnames}")
        ids = [row[col] for row in reader]
    for i, v in enumerate(ids):
        if v is None or not str(v).strip():
            raise InvalidParameterError("user_column", col, f"row {i + 2} of {path.name} has no user id")
    if data.split is not None:  # the hidden split: train.csv's rows -> training rows
        import numpy as np

        ids = list(np.asarray(ids, dtype=object)[data.split["train_rows"]])
    if len(ids) != len(data.y_train):
        raise InvalidParameterError(
            "user_column", col, f"gives {len(ids)} ids; need one per training row ({len(data.y_train)})"
        )
    return Users(ids, args.max_rows_per_user)


def user_budgets_from_args(args, users, data, seed):
    """Budgets per user (``users.ids`` order); ``seed``, the command's :class:`~.budget_args.CommandSeed`."""
    from .budget_args import budgets_from_args

    if getattr(args, "budgets_per_class", None):
        raise InvalidParameterError(
            "budgets_per_class",
            args.budgets_per_class,
            "is not meaningful at user level (a user's rows may have different labels); give budgets per user",
        )
    if getattr(args, "budgets_file", None):
        import numpy as np

        rows = budgets_from_args(args, len(data.y_train), data.y_train.numpy(), split=data.split, seed=seed)
        data_rows = data.split["train_rows"] if data.split is not None else np.arange(len(data.y_train))
        names = [f"data row {r + 1} of {args.budgets_file}" for r in data_rows]  # the operator's own file
        return users.budgets_from_rows(rows.epsilons, rows.delta, row_names=names)
    return budgets_from_args(args, users.num_users, None, seed=seed, num_classes=data.num_classes)
