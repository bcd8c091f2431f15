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

from ...data import DatasetFileError, _read_rows
from ...validation import InvalidParameterError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}


@dataclass
class TextData:
    """The rows of a text file: texts, raw labels (None without a label column), budgets (None
    without a budget column), the file's columns and a public description of the source."""

    texts: list[str]
    labels: list | None
    budgets: np.ndarray | None
    columns: list[str]
    source: dict = field(default_factory=dict)

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
    header, rows, lines = _read_rows(p)
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
) -> TextData:
    """Read ``path`` (``.jsonl``/``.json`` as JSON Lines, ``.csv`` with a header row).

    Args:
        text_column: the column with each row's text (non-empty strings).
        label_column: the class label of each row (any values; ``None``: no labels).
        budget_column: each row's budget ε (numbers); read when the file has it (``budget_required``:
            refused when it does not).
        flag: the argument that named the file (for errors).
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
    needed = [c for c in (text_column, label_column) if c is not None]
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
    return TextData(texts, labels, budgets, list(columns), source)


def label_ids(train_labels: list, eval_labels: list | None, label2id: dict | None = None):
    """(class ids of the training rows, of the evaluation rows, id2label).

    Integer labels (or texts of integers) are the class ids themselves (classes 0..max); other labels
    are mapped by ``label2id`` when the model's config names its classes, else in sorted order."""

    def as_int(v):
        if isinstance(v, bool):
            return None
        if isinstance(v, (int, np.integer)):
            return int(v)
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and v.lstrip("-").isdigit():
            return int(v)
        return None

    every = list(train_labels) + list(eval_labels or [])
    ints = [as_int(v) for v in every]
    if all(i is not None for i in ints):
        if min(ints) < 0:
            raise InvalidParameterError("label_column", min(ints), "integer labels must be class ids >= 0")
        k = max(ints) + 1
        if k < 2:
            raise InvalidParameterError("label_column", "every label is 0", "classification needs at least 2 classes")
        ids = ints[: len(train_labels)], ints[len(train_labels) :]
        return ids[0], ids[1] if eval_labels is not None else None, {i: str(i) for i in range(k)}
    text = [str(v) for v in every]
    named = label2id and not all(str(k).startswith("LABEL_") for k in label2id)
    if named:
        mapping = {str(k): int(v) for k, v in label2id.items()}
        unknown = sorted(set(text) - set(mapping))
        if unknown:
            raise InvalidParameterError(
                "label_column", unknown[0], f"is not a class of the model (its classes: {', '.join(sorted(mapping))})"
            )
    else:
        classes = sorted({str(v) for v in train_labels})
        if len(classes) < 2:
            raise InvalidParameterError("label_column", classes[0], "classification needs at least 2 classes")
        mapping = {c: i for i, c in enumerate(classes)}
        unknown = sorted(set(text[len(train_labels) :]) - set(mapping))
        if unknown:
            raise InvalidParameterError("eval_data", unknown[0], "is a label that the training data does not have")
    ids = [mapping[t] for t in text]
    id2label = {i: c for c, i in mapping.items()}
    return ids[: len(train_labels)], ids[len(train_labels) :] if eval_labels is not None else None, id2label
