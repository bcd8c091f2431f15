"""Per-example privacy budgets: one ε per example and one global δ.

Budgets come as (a) an array of ε values, (b) groups given as budgets with fractions, assigned
at random with a seed and exact counts (largest remainder), (c) a per-class mapping applied to
labels, or (d) a column of a CSV file.  Privacy groups are the distinct budget values (Boenisch
et al. 2023, §3.1); they are derived, not stored.  Budgets are personal data: never log them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..validation import InvalidParameterError, check_delta, check_epsilon


@dataclass(frozen=True)
class Budgets:
    """Per-example ε (``epsilons``, float array) and the global δ."""

    epsilons: np.ndarray
    delta: float

    def __post_init__(self):
        eps = np.asarray(self.epsilons, dtype=float)
        if eps.ndim != 1 or eps.size == 0:
            raise InvalidParameterError("budgets", f"array of shape {eps.shape}", "must be a non-empty 1-D array")
        check_epsilon(eps, "budgets")
        object.__setattr__(self, "epsilons", eps)
        object.__setattr__(self, "delta", check_delta(self.delta))

    def __len__(self) -> int:
        return self.epsilons.size

    def __repr__(self) -> str:  # never print the per-example values
        return f"Budgets(n={len(self)}, groups={self.values.size}, delta={self.delta})"

    @property
    def values(self) -> np.ndarray:
        """The distinct budgets (privacy groups), ascending."""
        return np.unique(self.epsilons)

    def groups(self):
        """(values, counts, group index of every example)."""
        values, inverse, counts = np.unique(self.epsilons, return_inverse=True, return_counts=True)
        return values, counts, inverse.ravel()

    # --- constructors -----------------------------------------------------------------------
    @classmethod
    def from_array(cls, epsilons, delta: float) -> Budgets:
        return cls(np.asarray(epsilons, dtype=float), delta)

    @classmethod
    def from_groups(cls, budgets, fractions, num_examples: int, delta: float, seed: int = 0) -> Budgets:
        """Assign ``budgets`` to ``num_examples`` examples in exact proportions, at random (seeded)."""
        counts = group_counts(fractions, num_examples, budgets)
        if np.any(counts == 0):
            empty = [float(b) for b, c in zip(np.atleast_1d(budgets), counts, strict=True) if c == 0]
            raise InvalidParameterError(
                "num_examples",
                num_examples,
                f"leaves no example for budget(s) {', '.join(f'{b:g}' for b in empty)}; "
                "every group needs at least one example",
            )
        eps = np.repeat(np.asarray(budgets, dtype=float), counts)
        np.random.default_rng(seed).shuffle(eps)
        return cls(eps, delta)

    @classmethod
    def from_exponential(
        cls, num_examples: int, low: float, high: float, skew: float, delta: float, seed: int = 0, groups: int = 20
    ) -> Budgets:
        """Heo et al. App. C.1: ``groups`` budgets evenly spaced in [low, high], group sizes ∝
        c1·e^{k·x} + c2 with x the budget mapped onto the paper's range [0.5, 1].

        The paper gives (c1, c2) = (2.098, −1.715) for k = −0.2 and (1.554, −1.715) for k = 0.2;
        k = 0 is uniform; any other k uses the plain shape e^{k·x}.  Sizes by largest remainder,
        assigned to examples at random (seeded).
        """
        low, high = float(low), float(high)
        if not np.isfinite(float(skew)):
            raise InvalidParameterError("skew", skew, "must be a finite number (e.g. -0.2, 0 or 0.2)")
        check_epsilon([low, high], "range")
        if not high > low:
            raise InvalidParameterError("range", f"{low:g},{high:g}", "must be A,B with 0 < A < B")
        if int(groups) < 1:
            raise InvalidParameterError("groups", groups, "must be an integer >= 1")
        values = np.linspace(low, high, int(groups))
        x = 0.5 + 0.5 * (values - low) / (high - low)
        c1, c2 = {-0.2: (2.098, -1.715), 0.2: (1.554, -1.715)}.get(round(float(skew), 12), (1.0, 0.0))
        weights = c1 * np.exp(float(skew) * x) + c2
        if np.any(weights <= 0):
            raise InvalidParameterError("skew", skew, "gives an empty group; use a skew in [-0.2, 0.2]")
        return cls.from_groups(values, weights / weights.sum(), num_examples, delta, seed=seed)

    @classmethod
    def from_class_map(cls, labels, mapping: dict, delta: float, *, classes=None) -> Budgets:
        """Budget of each example from its label: ``mapping[label] = ε``.

        ``classes``: the public class set (e.g. ``range(num_classes)``); ``mapping`` must then give a
        budget to every class of it and to no other, whichever classes the examples happen to have
        (the label set of the data is private).  Without it, the classes of ``labels`` are used."""
        labels = np.asarray(labels)
        present = set(np.unique(labels).tolist())
        if classes is not None:
            public = list(classes)
            outside = sorted(present - set(public), key=str)
            if outside:
                raise InvalidParameterError(
                    "labels", outside[0], f"is not one of the {len(public)} public classes {_shown(public)}"
                )
            present = set(public)
        missing = sorted(present - set(mapping), key=str)
        if missing:
            raise InvalidParameterError(
                "budgets_per_class", mapping, f"has no budget for class(es) {missing}; give one per class"
            )
        unknown = sorted(set(mapping) - present, key=str)
        if unknown:
            raise InvalidParameterError(
                "budgets_per_class",
                mapping,
                f"names class(es) {unknown} outside the public classes {_shown(sorted(present, key=str))}"
                if classes is not None
                else f"names class(es) {unknown} that no training example has",
            )
        lut = {k: float(v) for k, v in mapping.items()}
        return cls(
            np.array([lut[int(y)] if isinstance(y, (int, np.integer)) else lut[y] for y in labels.tolist()]), delta
        )

    def for_subset(self, subset) -> Budgets:
        """The budgets of a subset's examples, in the subset's order: ``subset`` is a
        ``torch.utils.data.Subset`` (what ``random_split`` returns; nested subsets too) of the dataset
        these budgets are for, or an array of its indices.  (Budgets are one per example of the data
        loader's dataset: a loader over ``train`` from ``random_split(full, ...)`` needs
        ``budgets.for_subset(train)``.)"""
        from torch.utils.data import Subset

        idx = None
        while isinstance(subset, Subset):  # down to the dataset these budgets index
            step = np.asarray(subset.indices, dtype=np.int64)
            idx = step if idx is None else step[idx]
            subset = subset.dataset
        if idx is None:
            idx = np.asarray(subset)
            if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
                raise InvalidParameterError(
                    "subset", type(subset).__name__, "must be a torch.utils.data.Subset or a 1-D array of indices"
                )
        if idx.size == 0 or idx.min() < -len(self) or idx.max() >= len(self):
            raise InvalidParameterError(
                "subset",
                f"{idx.size} indices",
                f"must index these budgets' {len(self)} examples (the dataset random_split was given)",
            )
        return Budgets(self.epsilons[idx], self.delta)

    @classmethod
    def from_csv(cls, path, column: str, delta: float) -> Budgets:
        """Budgets from one column of a CSV file with a header row (one row per example)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"budgets file not found: {path} (expected a CSV with a header row and a column {column!r})"
            )
        try:
            with path.open(newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                if reader.fieldnames is None or column not in reader.fieldnames:
                    raise InvalidParameterError(
                        "budget_column", column, f"must be one of the CSV columns {reader.fieldnames}"
                    )
                values = []
                for row_no, row in enumerate(reader, start=2):
                    try:
                        values.append(float(row[column]))
                    except (TypeError, ValueError):
                        raise InvalidParameterError(
                            "budgets_file",
                            str(path),
                            f"row {row_no} has a missing or non-numeric value {row.get(column)!r} in column {column!r}",
                        ) from None
        except UnicodeDecodeError as exc:
            raise InvalidParameterError(
                "budgets_file", str(path), f"is not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        if not values:
            raise InvalidParameterError("budgets_file", str(path), "has no data rows")
        arr = np.array(values)
        bad = ~(np.isfinite(arr) & (arr > 0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidParameterError(
                "budgets_file",
                str(path),
                f"row {i + 2} has budget {arr[i]!r} in column {column!r}; every budget must be > 0 and finite",
            )
        return cls(arr, delta)


def group_counts(fractions, num_examples: int, budgets=None) -> np.ndarray:
    """Exact group sizes for ``fractions`` of ``num_examples`` by the largest-remainder method."""
    fr = np.asarray(fractions, dtype=float)
    if fr.ndim != 1 or fr.size == 0:
        raise InvalidParameterError("fractions", fractions, "must be a non-empty list")
    if budgets is not None and len(np.atleast_1d(budgets)) != fr.size:
        raise InvalidParameterError(
            "fractions",
            fractions,
            f"must have one entry per budget ({len(np.atleast_1d(budgets))} budgets, {fr.size} fractions)",
        )
    if np.any(~(fr > 0)) or np.any(~np.isfinite(fr)):
        raise InvalidParameterError("fractions", fractions, "every fraction must be > 0")
    if abs(fr.sum() - 1) > 1e-6:
        raise InvalidParameterError("fractions", fractions, f"must sum to 1 (within 1e-6); they sum to {fr.sum():.8g}")
    n = int(num_examples)
    if n < 1:
        raise InvalidParameterError("num_examples", num_examples, "must be an integer >= 1")
    raw = fr / fr.sum() * n
    counts = np.floor(raw).astype(int)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: n - counts.sum()]] += 1
    return counts


def parse_float_list(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidParameterError(name, text, "must be a comma-separated list of numbers") from None


def parse_class_map(text: str) -> dict:
    """``"0:1,1:2,2:3"`` → {0: 1.0, 1: 2.0, 2: 3.0} (labels as int where they look like ints)."""
    out = {}
    for part in str(text).split(","):
        if not part.strip():
            continue
        if ":" not in part:
            raise InvalidParameterError("budgets_per_class", text, "must look like 'class:epsilon,class:epsilon,...'")
        k, v = part.split(":", 1)
        k = k.strip()
        try:
            out[int(k) if k.lstrip("-").isdigit() else k] = float(v)
        except ValueError:
            raise InvalidParameterError("budgets_per_class", text, "epsilons must be numbers") from None
    return out


def _shown(classes: list) -> str:
    """A class list for messages (the first 20)."""
    if len(classes) > 20:
        return "[" + ", ".join(map(str, classes[:20])) + ", ...]"
    return "[" + ", ".join(map(str, classes)) + "]"
