"""A table whose rows chose their own privacy budget: a CSV with a ``budget`` column.

``DIR/train.csv`` holds one row per person: feature columns, an integer ``label`` (the class ids
0..K-1 of ``--num-classes K``, a public count: never read from the rows) and the budget each person
chose (here a consent tier: ε = 1, 2 or 4). The budget column is never a model input;
an identifier column (``id``) is left out too. Without a ``test.csv`` the rows are split 80/20
(stratified, seed 0), and the budgets of the rows that train are picked with ``data.split``. The
split is a function of the labels: the run folder keeps it in ``private/data_split.csv``.
Training is IDP-SGD *Scale* (a clip norm per group) with the library's MLP.

    python examples/csv_budget_column.py --data-dir DIR --num-classes 2 --out runs/csv
    python examples/csv_budget_column.py --tiny       # writes a small synthetic table first

``--tiny`` (or ``IDPSGD_EXAMPLE_TINY=1``) writes 300 synthetic rows to ``OUT/table/train.csv``
(unless ``--data-dir`` is given) and trains two short epochs.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import numpy as np

from idpsgd import Budgets, TrainConfig, load_dataset, train


def make_table(folder: Path, rows: int = 300, seed: int = 0) -> Path:
    """Synthetic rows: 6 features, a label from a noisy linear rule, and a consent tier."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6))
    label = (x @ np.array([1.5, -1.0, 0.5, 0, 0, 0.8]) + 0.3 * rng.normal(size=rows) > 0).astype(int)
    tier = rng.choice([1.0, 2.0, 4.0], size=rows, p=[0.3, 0.4, 0.3])
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "train.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", *[f"x{j}" for j in range(6)], "label", "budget"])
        for i in range(rows):
            w.writerow([f"person-{i}", *np.round(x[i], 4), label[i], tier[i]])
    return folder


def main() -> None:
    tiny_default = os.environ.get("IDPSGD_EXAMPLE_TINY") == "1"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, help="folder with train.csv (and optionally test.csv)")
    p.add_argument("--budget-column", default="budget")
    p.add_argument("--label-column", default="label")
    p.add_argument("--num-classes", type=int, default=2, help="K: labels are the class ids 0..K-1 (default 2)")
    p.add_argument("--out", type=Path, default=Path("runs/csv_budget_column"))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--tiny", action="store_true", default=tiny_default, help="a small synthetic table, two epochs")
    args = p.parse_args()
    if args.data_dir is None and not args.tiny:
        p.error("--data-dir is required (or --tiny for a synthetic table)")
    data_dir = args.data_dir or make_table(args.out / "table")

    data = load_dataset(
        "csv",
        data_dir,
        label_column=args.label_column,
        num_classes=args.num_classes,
        budget_column=args.budget_column,
    )
    budgets = Budgets.from_csv(data_dir / "train.csv", args.budget_column, delta=1e-5)  # one per row of train.csv
    if data.split is not None:  # no test.csv: keep the budgets of the rows that train
        budgets = Budgets(budgets.epsilons[data.split["train_rows"]], budgets.delta)
    print("features:", ", ".join(data.source["feature_columns"]))

    config = TrainConfig(
        method="scale",
        epochs=2 if args.tiny else args.epochs,
        batch_size=32,
        lr=0.1,
        seed=0,
        model="mlp",
        progress=not args.tiny,
    )
    run = args.out / "run"
    report = train(data, budgets, config, run, overwrite=True)

    print(f"test accuracy {report['test_accuracy']:.3f} after {report['steps']} steps")
    for g in report["groups"]:
        print(
            f"budget {g['budget']:g}: {g['count']} rows, clip norm {g['clip_norm']:.2f}, "
            f"epsilon spent {g['epsilon_spent']:.3f}"
        )
    print(f"report: {run / 'report.html'}")


if __name__ == "__main__":
    main()
