"""Local text datasets for fine-tuning: a JSON Lines or CSV file with a text column, an optional label
column (sequence classification; without one: causal language modelling) and an optional budget
column (each row's ε).

Read in memory with the standard library (never through a cache in the home folder: the rows are
personal data); every problem is reported with the file, the line and the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...data import DatasetFileError, read_csv_rows
from ...validation import InvalidParameterError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}


@dataclass
class TextData:
    """The rows of a text file: texts, raw labels (None without a label column), budgets (None
    without a budget column), the file's columns, a public description of the source and each row's
    line in the file (for errors)."""

    texts: list[str]
    labels: list | None
    budgets: np.ndarray | None
    columns: list[str]
    source: dict = field(default_factory=dict)
    lines: list[int] | None = None
    path: str | None = None
    users: list | None = None  # user level: each row's user id (private; ``user_column``)

    def __len__(self) -> int:
        return len(self.texts)


def _jsonl_rows(p: Path):
    """(columns, rows as dicts, line numbers) of a JSON Lines file (one object per line)."""
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise DatasetFileError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise DatasetFileError(f"{p} is not UTF-8 text (offset {exc.start})") from None
    rows, lines, columns = [], [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DatasetFileError(f"{p}, line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetFileError(
                f"{p}, line {number}: a JSON Lines dataset has one object per line, got {type(row).__name__}"
            )
        for k in row:
            if k not in columns:
                columns.append(k)
        rows.append(row)
        lines.append(number)
    if not rows:
        raise DatasetFileError(f"{p} holds no rows (expected one JSON object per line)")
    return columns, rows, lines


def _csv_rows(p: Path):
    header, rows, lines = read_csv_rows(p)
    if not rows:
        raise DatasetFileError(f"{p} has a header but no data rows")
    return header, [dict(zip(header, r, strict=True)) for r in rows], lines


def load_text_data(
    path,
    text_column: str = "text",
    label_column: str | None = None,
    budget_column: str | None = None,
    *,
    budget_required: bool = False,
    flag: str = "data",
    user_column: str | None = None,
) -> TextData:
    """Read ``path`` (``.jsonl``/``.json`` as JSON Lines, ``.csv`` with a header row).

    Args:
        text_column: the column with each row's text (non-empty strings).
        label_column: the class label of each row (any values; ``None``: no labels).
        budget_column: each row's budget ε (numbers); read when the file has it (``budget_required``:
            refused when it does not).
        flag: the argument that named the file (for errors).
        user_column: each row's user (user-level privacy; required when given).
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError(
            flag,
            str(path),
            "not found (expected a .jsonl or .csv file)"
            if not p.exists()
            else "is not a file (expected a .jsonl or .csv file)",
        )
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise InvalidParameterError(flag, str(path), "must be a JSON Lines (.jsonl, .json) or CSV (.csv) file")
    columns, rows, lines = _jsonl_rows(p) if fmt == "jsonl" else _csv_rows(p)
    where = f"{p}"
    needed = [c for c in (text_column, label_column, user_column) if c is not None]
    if budget_required and budget_column is not None:
        needed.append(budget_column)
    for c in needed:
        if c not in columns:
            raise DatasetFileError(f"{where}: no column {c!r} (columns: {', '.join(map(str, columns))})")
    texts = []
    for row, line in zip(rows, lines, strict=True):
        value = row.get(text_column)
        if not isinstance(value, str) or not value.strip():
            raise DatasetFileError(
                f"{where}, line {line}, column {text_column!r}: "
                + ("missing" if value is None else f"{value!r} is not a non-empty text")
            )
        texts.append(value)
    labels = None
    if label_column is not None:
        labels = []
        for row, line in zip(rows, lines, strict=True):
            value = row.get(label_column)
            if value is None or (isinstance(value, str) and not value.strip()) or isinstance(value, (dict, list)):
                raise DatasetFileError(
                    f"{where}, line {line}, column {label_column!r}: "
                    + (
                        "missing label"
                        if value is None or isinstance(value, str)
                        else f"{value!r} is not a class label"
                    )
                )
            labels.append(value.strip() if isinstance(value, str) else value)
    budgets = None
    if budget_column is not None and budget_column in columns:
        values = []
        for row, line in zip(rows, lines, strict=True):
            value = row.get(budget_column)
            try:
                eps = float(value)
            except (TypeError, ValueError):
                eps = float("nan")
            if isinstance(value, bool) or not (np.isfinite(eps) and eps > 0):
                raise DatasetFileError(
                    f"{where}, line {line}, column {budget_column!r}: {value!r} is not a budget (a number > 0)"
                )
            values.append(eps)
        budgets = np.asarray(values, dtype=float)
    source = {
        "format": fmt,
        "file": p.name,
        "rows": len(texts),
        "text_column": text_column,
        "label_column": label_column,
        "budget_column": budget_column if budgets is not None else None,
    }
    users = None
    if user_column is not None:
        users = []
        for row, line in zip(rows, lines, strict=True):
            value = row.get(user_column)
            if value is None or isinstance(value, (dict, list)) or not str(value).strip():
                raise DatasetFileError(f"{where}, line {line}, column {user_column!r}: no user id")
            users.append(str(value))
        source["user_column"] = user_column
    return TextData(texts, labels, budgets, list(columns), source, list(lines), str(p), users)


def _as_int(v):
    """An integer label (int, integral float, or the text of an integer), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    return None


def model_classes(label2id: dict | None) -> list[str] | None:
    """The class names a model's config names, in class-id order; None when it names none (no
    ``label2id``, or only the placeholders ``LABEL_0``, ``LABEL_1``, ... that ``transformers`` writes
    for every config)."""
    if not label2id or all(str(k).startswith("LABEL_") for k in label2id):
        return None
    by_id = {}
    for name, i in label2id.items():
        j = _as_int(i)
        if j is None or j < 0 or j in by_id:
            raise InvalidParameterError(
                "model",
                f"label2id {label2id!r}",
                "its config's label2id must map each class name to a distinct id >= 0",
            )
        by_id[j] = str(name)
    if sorted(by_id) != list(range(len(by_id))):
        raise InvalidParameterError(
            "model", f"label2id {label2id!r}", f"its config's class ids must be 0..{len(by_id) - 1}"
        )
    return [by_id[i] for i in range(len(by_id))]


def parse_labels(value, flag: str = "labels") -> list[str]:
    """Class names from ``a,b,c`` (or a list): their order gives the class ids 0, 1, 2, ..."""
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        names = [str(v).strip() for v in value]
    else:
        raise InvalidParameterError(
            flag, value, "must be class names a,b,c (their order gives the class ids 0, 1, ...)"
        )
    if any(not n for n in names):
        raise InvalidParameterError(flag, value, "must be non-empty class names separated by commas, e.g. neg,pos")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidParameterError(flag, value, f"names class {dupes[0]!r} twice")
    if len(names) < 2:
        raise InvalidParameterError(flag, value, "classification needs at least 2 classes (e.g. neg,pos)")
    return names


def check_num_classes(value, flag: str = "num_classes") -> int:
    """An integer >= 2 (the classes are 0..value-1)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 2:
        raise InvalidParameterError(flag, value, "must be an integer >= 2 (the labels are the class ids 0..K-1)")
    return int(value)


def public_classes(label2id: dict | None, labels=None, num_classes=None) -> list[str]:
    """The class names, in class-id order, from public information only: the model's config when
    it names its classes, ``labels`` (names, ``a,b,c``) or ``num_classes`` K (classes ``"0"``..
    ``"K-1"``).  Never from the data: the label set of the training rows is private (one row with a
    unique label would appear in the released model's config).

    An explicit set must agree with classes the model names (its head already has them); without
    any public source the call is refused."""
    if labels is not None and num_classes is not None:
        raise InvalidParameterError(
            "num_classes", num_classes, "give the classes one way: labels (class names) or num_classes, not both"
        )
    named = model_classes(label2id)
    given = None
    if labels is not None:
        given, flag, value = parse_labels(labels), "labels", labels
    elif num_classes is not None:
        k = check_num_classes(num_classes)
        given, flag, value = [str(i) for i in range(k)], "num_classes", k
    if named is not None:
        if given is not None and given != named and not (flag == "num_classes" and len(named) == value):
            raise InvalidParameterError(
                flag,
                value if isinstance(value, (int, str)) else ",".join(given),
                f"differs from the classes the model's config names ({', '.join(named)}, in class-id order); "
                "leave it out to use those",
            )
        return named
    if given is None:
        raise InvalidParameterError(
            "labels",
            None,
            "the class set must come from public information, never from the training rows: give --labels "
            "a,b,c (class names; their order gives the class ids) or --num-classes K (integer labels "
            "0..K-1), or a model folder whose config names its classes (label2id)",
        )
    return given


def label_ids(data: TextData, classes: list[str], flag: str = "data") -> list[int]:
    """Each row's class id in the public class set ``classes`` (names, in class-id order).

    A label is a class name, or an integer class id 0..K-1 (as a number or its text); anything else
    is refused with the file, its line, the value and the allowed set -- never a new class."""
    index = {c: i for i, c in enumerate(classes)}
    lines = data.lines or list(range(1, len(data) + 1))
    where = data.path or data.source.get("file", flag)
    column = data.source.get("label_column")
    ids = []
    for value, line in zip(data.labels, lines, strict=True):
        key = value if isinstance(value, str) else str(value)
        i = index.get(key)
        if i is None:
            j = _as_int(value)
            if j is not None and 0 <= j < len(classes):
                i = j
        if i is None:
            shown = ", ".join(classes) if len(classes) <= 20 else f"{', '.join(classes[:20])}, ..."
            raise DatasetFileError(
                f"{where}, line {line}, column {column!r}: {value!r} is not one of the {len(classes)} public "
                f"classes ({shown}; or their ids 0..{len(classes) - 1}); a label outside the class set "
                "given by --labels / --num-classes / the model's config is refused, never a new class"
            )
        ids.append(i)
    return ids
