"""The per-user gradient norms that the individual filter and individual accounting read at user level.

A user's norm is that of its rows' summed gradient, ‖Σ_{i∈S_u} g_i‖, over a fresh random choice S_u
of min(k, n_u) of its rows: what a step would clip (Yu et al. 2023, "Individual Privacy Accounting
for DP-SGD", Alg. 2 line 3, with the user as the unit; Charles et al. 2024, Alg. 2).  It is the
user-level norm pass: it joins :mod:`.units` (the user-level book-keeping hook) and :mod:`.norms`
(the example-level norm pass), so that neither imports the other.
"""

from __future__ import annotations

import numpy as np
import torch

from ..users import Users
from .norms import example_batches, per_example_grad_norms
from .units import BookKeepingUsers, Grouping


def per_user_grad_norms(module, dataset, users: Users, unit_indices, collate_fn, batch_size: int, per_sample_loss, rng):
    """(norms, losses) of the given users at the current parameters: each user's norm is ‖Σ_{i∈S_u} g_i‖
    over a fresh random choice S_u of min(k, n_u) of its rows (what a step would clip), its loss the sum
    of those rows' losses (Yu et al. 2023, Alg. 2 line 3, with the user as the unit).  Batches hold
    whole users (about ``batch_size`` rows); per-user norms by book-keeping (:func:`~.units.regroup_records`)."""
    units = np.asarray(unit_indices, dtype=np.int64)
    if units.size == 0:
        return np.zeros(0), np.zeros(0)
    rows = users.draw_rows(units, rng)  # grouped by the position of the user in ``units``
    sizes = np.minimum(users.k, users.rows_per_user[units])
    owner = np.repeat(np.arange(units.size), sizes)
    chunk_of_user = (np.cumsum(sizes) - sizes) // max(int(batch_size), 1)
    chunk_of_row = chunk_of_user[owner]
    bounds = np.flatnonzero(np.diff(chunk_of_row)) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [rows.size]])
    hooks = []
    for a, b in zip(starts, ends, strict=True):
        own = owner[a:b] - owner[a]
        grouping = Grouping(int(b - a), torch.from_numpy(own), torch.arange(int(own[-1]) + 1))
        hooks.append(BookKeepingUsers(grouping=grouping))

    def batches():
        for a, b in zip(starts, ends, strict=True):
            yield from example_batches(dataset, rows[a:b], collate_fn, int(b - a))

    norms, row_losses = per_example_grad_norms(module, batches(), per_sample_loss, hooks)
    losses = np.bincount(owner, weights=row_losses, minlength=units.size) if row_losses.size else np.zeros(units.size)
    return norms, losses
