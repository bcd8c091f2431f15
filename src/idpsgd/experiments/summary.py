"""Small helpers shared by the experiments: mean ± std over seeds, and their text form."""
from __future__ import annotations

import numpy as np


def mean_std(values) -> dict:
    """``{"mean", "std", "runs"}`` of the values (population std, as the papers' ± over trials)."""
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std()), "runs": v.tolist()}


def percent(cell: dict, digits: int = 1) -> str:
    """``"97.8 ± 0.1"`` from a :func:`mean_std` of accuracies in [0, 1]."""
    return f"{100 * cell['mean']:.{digits}f} ± {100 * cell['std']:.{digits}f}"
