"""Small helpers shared by the experiments: mean ± std over repetitions, their text form, and the
repetitions' seeds (derived from one base seed that stays private)."""

from __future__ import annotations

import numpy as np


def mean_std(values) -> dict:
    """``{"mean", "std", "runs"}`` of the values (population std, as the papers' ± over trials)."""
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std()), "runs": v.tolist()}


def percent(cell: dict, digits: int = 1) -> str:
    """``"97.8 ± 0.1"`` from a :func:`mean_std` of accuracies in [0, 1]."""
    return f"{100 * cell['mean']:.{digits}f} ± {100 * cell['std']:.{digits}f}"


def repetition_seeds(seed: int | None, count: int) -> tuple[int, list[int]]:
    """(base seed, one training seed per repetition): the base is ``seed`` or, when None, a fresh one
    from OS entropy; repetition k trains with ``derive_seed(base, k)``.  Never fixed seeds 0..N-1: a
    public seed lets anyone who knows every record but one replay the runs (the released accuracies
    then carry no guarantee).  The base is recorded privately (:func:`record_seed`)."""
    from ..engine.noise.randomness import derive_seed, resolve_seed

    base = resolve_seed(seed, False)
    return base, [derive_seed(base, k) for k in range(int(count))]


def randomness(secure_mode: bool = False) -> str:
    """The public line about an experiment's randomness (where its seed is, never the seed)."""
    from ..engine.noise.randomness import randomness_note
    from ..runfolder import PRIVATE, SEED_FILE

    return randomness_note(secure_mode, f"{PRIVATE}/{SEED_FILE}")


def record_seed(out, result: dict) -> list[str]:
    """Write the experiment's base seed (``result["private"]["seed"]``) to ``out``'s ``private/seed.json``;
    returns the file's name for the experiment's file list."""
    from ..runfolder import PRIVATE, SEED_FILE

    out.record_seed(
        result["private"]["seed"],
        f"{result['experiment']}'s base seed: repetition k trains with "
        "derive_seed(seed, k) (idpsgd.engine.noise.randomness); --seed with it replays the experiment",
    )
    return [f"{PRIVATE}/{SEED_FILE}"]
