"""The per-user gradient norms that the individual filter and individual accounting read at user level.

A user's norm is that of its rows' summed gradient, ‖Σ_{i∈S_u} g_i‖, over a fresh random choice S_u
of min(k, n_u) of its rows: what a step would clip (Yu et al. 2023, "Individual Privacy Accounting
for DP-SGD", Alg. 2 line 3, with the user as the unit; Charles et al. 2024, Alg. 2).  It is the
user-level norm pass: it joins :mod:`..clipping.users` (the user-level book-keeping hook) and :mod:`.norms`
(the example-level norm pass), so that neither imports the other.
"""

from __future__ import annotations

import numpy as np
import torch

from ...users import Users
from ...validation import InvalidParameterError
from ..clipping.users import BookKeepingUsers, Grouping
from .norms import example_batches, per_example_grad_norms


def per_user_grad_norms(module, dataset, users: Users, unit_indices, collate_fn, batch_size: int, per_sample_loss, rng):
    """(norms, losses) of the given users at the current parameters: each user's norm is ‖Σ_{i∈S_u} g_i‖
    over a fresh random choice S_u of min(k, n_u) of its rows (what a step would clip), its loss the sum
    of those rows' losses (Yu et al. 2023, Alg. 2 line 3, with the user as the unit).  Batches hold
    whole users (about ``batch_size`` rows); per-user norms by book-keeping (:func:`~..clipping.users.regroup_records`).

    On several ranks (a DPDDP module): every rank draws every user's rows from the same stream (so the
    choices are the one-process ones and the sampler's stream stays in step on every rank), computes a
    contiguous share of the users, and the shares are all-gathered: every rank returns every user's values."""
    from .. import distributed

    units = np.asarray(unit_indices, dtype=np.int64)
    if units.size == 0:
        return np.zeros(0), np.zeros(0)
    rows = users.draw_rows(units, rng)  # grouped by the position of the user in ``units``
    sizes = np.minimum(users.k, users.rows_per_user[units])
    if not distributed.is_distributed() or distributed.data_parallel_wrapper(module) is None:
        return _user_norms(module, dataset, rows, sizes, collate_fn, batch_size, per_sample_loss)
    if isinstance(distributed.data_parallel_wrapper(module), torch.nn.parallel.DistributedDataParallel):
        raise InvalidParameterError(
            "module",
            "DistributedDataParallel",
            "per-user norm passes need opacus.distributed.DifferentiallyPrivateDistributedDataParallel",
        )
    rank, world = distributed.rank_and_world()
    parts = np.array_split(np.arange(units.size), world)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    mine = parts[rank]
    lo, hi = (int(starts[mine[0]]), int(starts[mine[-1] + 1])) if mine.size else (0, 0)
    norms, losses = _user_norms(module, dataset, rows[lo:hi], sizes[mine], collate_fn, batch_size, per_sample_loss)
    counts = [p.size for p in parts]
    return distributed.all_gather_arrays(norms, counts), distributed.all_gather_arrays(losses, counts)


def _user_norms(module, dataset, rows, sizes, collate_fn, batch_size: int, per_sample_loss):
    """(norms, losses) of the users whose chosen ``rows`` are given consecutively, ``sizes[j]`` of user j."""
    if sizes.size == 0:
        return np.zeros(0), np.zeros(0)
    owner = np.repeat(np.arange(sizes.size), sizes)
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
    losses = np.bincount(owner, weights=row_losses, minlength=sizes.size) if row_losses.size else np.zeros(sizes.size)
    return norms, losses
