"""User-level DP-SGD (ULS): a user's rows in a step are clipped as one unit, in every grad_sample_mode.

User-level sampling (Charles et al. 2024, "Fine-Tuning LLMs with User-Level DP", Alg. 2; Chua et al.
2024, "Mind the Privacy Unit!", §3.2), individualized as IDP-SGD (Boenisch et al. 2023, §3).  This
module clips the user as one: sampling is :class:`~..sampling.sampler.PoissonBatchSampler` with ``users`` (user u
joins a step with its rate q_u and brings min(k, n_u) random rows, k public); :class:`UserClipping` (the **sum** of the
user's row gradients clipped as one vector to c_u, its norm with every cross term, never a sum of
per-row norms) and how each mode forms that sum exactly (``index_add`` for hooks/functorch,
:func:`ghost_capture`, and :func:`regroup_records` for book-keeping).  Replacing user u moves the
noisy sum by at most c_u, so its guarantee is the sampled Gaussian's at (q_u, σ·c/c_u) per step —
the example-level accountant indexed by user; a user whose rows reach two clipping calls of one
step is refused.  The user-level norm pass is :mod:`..per_example.user_norms`.

User guide (sum or mean, several ranks, what is refused): ``docs/user-level.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...users import Users
from ..per_example.bk.rules import EmbeddingRule, LinearRule
from ..sampling.sampler import BatchIndexQueue, BatchMismatchError
from .examples import PerExampleClipping

#: the guarantee in words at user level (report.json's "guarantee")
USER_GUARANTEE = (
    "data-independent user-level individual (epsilon_p, delta)-DP for every user of group p: all of the user's "
    "rows together, whatever their number, with the user as the unit of neighbouring (user-level sampling, "
    "each sampled user's summed gradient over up to k of its rows clipped as one unit)"
)


@dataclass(frozen=True)
class Grouping:
    """The rows of a batch (or physical batch) and their users: ``inverse[r]`` is row r's position in
    ``users`` (the global user indices of the batch, ascending)."""

    n_rows: int
    inverse: torch.Tensor
    users: torch.Tensor

    @property
    def num_users(self) -> int:
        return int(self.users.numel())

    def sum(self, rows: torch.Tensor) -> torch.Tensor:
        """(rows, ...) → (users, ...): the sum of each user's rows (a (users × rows) 0/1 matrix product:
        one BLAS call, much faster than ``index_add_`` on the CPU for wide rows)."""
        n = rows.shape[0]
        if n == 0:
            return rows.new_zeros((self.num_users, *rows.shape[1:]))
        onehot = rows.new_zeros((self.num_users, n))
        onehot[self.inverse.to(rows.device), torch.arange(n, device=rows.device)] = 1
        return (onehot @ rows.reshape(n, -1)).reshape(self.num_users, *rows.shape[1:])

    def rank(self) -> tuple[torch.Tensor, int]:
        """Each row's rank among its user's rows in this batch, and the largest count m."""
        inv = self.inverse
        if inv.numel() == 0:
            return inv, 0
        order = torch.argsort(inv, stable=True)
        counts = torch.bincount(inv, minlength=self.num_users)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(inv)
        rank[order] = torch.arange(inv.numel()) - starts[inv[order]]
        return rank, int(counts.max())

    def as_sequences(self, x: torch.Tensor, rank_m=None) -> torch.Tensor:
        """(rows, T, ...) → (users, m·T, ...): a user's rows as one longer sequence, zero-padded to the
        largest count m (padding rows have zero output gradient, so they add nothing to a ghost norm or
        a clipped sum).  Rows already grouped by user with m each (every user of the step brought k
        rows): a reshape, no copy."""
        rank, m = self.rank() if rank_m is None else rank_m
        u, n = self.num_users, x.shape[0]
        pos = self.inverse.to(x.device) * m + rank.to(x.device)
        if u * m == n and bool((pos == torch.arange(n, device=x.device)).all()):
            return x.reshape(u, m * x.shape[1], *x.shape[2:])
        out = x.new_zeros((u * m, *x.shape[1:]))
        out.index_copy_(0, pos, x)
        return out.reshape(u, m * x.shape[1], *x.shape[2:])


class UserClipping(PerExampleClipping):
    """Per-user clip norms c_u; the clip factors are per user, from the norms of the users' summed
    gradients.  :attr:`last_norms`/:attr:`last_indices` are per user (user indices): the per-user
    accounting, filter and individual accounting work on users unchanged.

    A mode first asks :meth:`grouping` for the next ``n`` drawn rows (without consuming them), forms
    the per-user norms, then calls :meth:`factors` with them (one per user of the grouping)."""

    def __init__(self, clip_norms, queue: BatchIndexQueue, users: Users):
        super().__init__(clip_norms, queue)
        if self.clip_norms.numel() != users.num_users:
            raise ValueError(f"clip_norms has {self.clip_norms.numel()} values, need one per user")
        self.users = users
        self._user_of_row = torch.from_numpy(users.unit_of_row)
        self._pending: Grouping | None = None
        self._seen: list[torch.Tensor] = []

    def grouping(self, n_rows: int) -> Grouping:
        """The users of the next ``n_rows`` drawn rows (cached until :meth:`factors` consumes them)."""
        n_rows = int(n_rows)
        if self._pending is not None and self._pending.n_rows == n_rows:
            return self._pending
        if n_rows > len(self.queue):
            raise BatchMismatchError(
                "the step has more rows than drawn rows are waiting (the counts are private: not shown): "
                "every batch drawn from the private data loader must be followed by one backward pass and "
                "optimizer.step() (is batch_first right for your data?)"
            )
        rows = self.queue.peek(n_rows)
        users, inverse = torch.unique(self._user_of_row[rows], return_inverse=True)
        self._pending = Grouping(n_rows, inverse.reshape(-1), users)
        return self._pending

    def factors(self, norms: torch.Tensor) -> torch.Tensor:
        """min(1, c_u / (‖g_u‖ + 1e-6)) for the users of the pending grouping (``norms``: one per user)."""
        if self._pending is None and norms.numel() == 0:  # an empty Poisson batch: no rows, no users
            self.grouping(0)
        g = self._pending
        if g is None or norms.numel() != g.num_users:
            self._pending = None
            raise RuntimeError(
                "user-level clipping needs the norms of the users' summed gradients (one per user of the "
                "batch), formed after grouping(rows); got per-row norms: this mode does not support users"
            )
        self._pending = None
        if self._seen and g.num_users and bool(torch.isin(g.users, torch.cat(self._seen)).any()):
            raise BatchMismatchError(
                "a user's rows reached two clipping calls of one step (BatchMemoryManager split a logical "
                "batch into physical batches): a user's rows must be clipped as one unit; train on whole "
                "batches (no BatchMemoryManager) with user-level privacy; the step was not taken"
            )
        self.queue.pop(g.n_rows)
        self.last_grouping_inverse = g.inverse  # ghost clipping: each row takes its user's factor
        self._seen.append(g.users)
        self._norms.append(norms.detach())
        self._indices.append(g.users)
        if norms.numel() == 0:
            return norms.new_zeros((0,))
        clip = self.clip_norms[g.users].to(device=norms.device, dtype=norms.dtype)
        return torch.where(torch.isfinite(norms), (clip / (norms + 1e-6)).clamp(max=1.0), 0.0)

    def end_step(self) -> None:
        self._pending, self._seen = None, []
        super().end_step()


def check_user_level(engine, users) -> None:
    """Refuse a phase whose users differ from the engine's earlier phases' (another privacy unit); what
    user level does not support is refused where it is checked (the mode, FSDP2, the filters)."""
    from ...validation import InvalidParameterError

    if engine.accountant is not None and engine.users is not users:
        raise InvalidParameterError(
            "users",
            repr(users),
            "differ from this engine's earlier phases (another privacy unit); use a new IndividualizedPrivacyEngine",
        )


def grouping_of(clipping, n_rows: int) -> Grouping | None:
    """The grouping of the next ``n_rows`` rows under user-level clipping, else None (example level)."""
    return clipping.grouping(n_rows) if isinstance(clipping, UserClipping) else None


# --- ghost clipping (Opacus's fast gradient clipping) ------------------------------------------
def ghost_capture(gsm, module, backprops: torch.Tensor, activations) -> None:
    """User-level replacement of the norm part of Opacus's ``capture_backprops_hook``: the layer's
    per-sample gradients (its registered grad sampler, or functorch) summed by user; each parameter's
    ``_norm_sample`` becomes the per-user norm of its summed gradient (a parameter used by several
    layers, or several times, accumulates its per-row gradients first, as Opacus's hooks mode)."""
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
    from opacus.grad_sample.grad_sample_module import create_or_accumulate_grad_sample, promote_current_grad_sample
    from opacus.utils.module_utils import trainable_parameters

    if not gsm.force_functorch and type(module) in gsm.GRAD_SAMPLERS:
        fn = gsm.GRAD_SAMPLERS[type(module)]
    else:
        fn = ft_compute_per_sample_gradient
    grad_samples = fn(module, activations, backprops)
    for param, gs in grad_samples.items():
        create_or_accumulate_grad_sample(param=param, grad_sample=gs, max_batch_len=module.max_batch_len)
    del grad_samples
    for _, p in trainable_parameters(module):
        p._forward_counter -= 1
        if p._forward_counter == 0:
            promote_current_grad_sample(p)
            gs = p.grad_sample
            grouping = gsm.clipping.grouping(gs.shape[0])
            summed = grouping.sum(gs.float() if gs.dtype in (torch.float16, torch.bfloat16) else gs)
            p._norm_sample = summed.reshape(summed.shape[0], -1).norm(2, dim=-1)
            p.grad_sample = None


# --- book-keeping -----------------------------------------------------------------------------
class BookKeepingUsers:
    """The book-keeper's user-level hook (``keeper.user_level``): before the norms, every record of the
    backward pass is regrouped by user (:func:`regroup_records`), so the book-keeper's own per-example
    machinery — ghost norms, per-sample norms, tied parameters' cross terms, the clipped sum — runs
    unchanged with one "example" per user.  ``rows_batch`` is the number of rows (the "mean" loss
    scale is by rows)."""

    def __init__(self, clipping: UserClipping | None = None, grouping: Grouping | None = None):
        self.clipping, self._fixed = clipping, grouping
        self.rows_batch: int | None = None

    def _grouping(self, batch: int) -> Grouping:
        return self._fixed if self._fixed is not None else self.clipping.grouping(batch)

    def users_in(self, rows: int) -> int:
        """The number of users in a batch of ``rows`` rows."""
        return int(self._grouping(rows).num_users)

    def regroup(self, keeper, parts, batch: int):
        grouping = self._grouping(batch)
        if grouping.n_rows != int(batch):
            raise RuntimeError("the batch's rows do not match its users' rows")
        self.rows_batch = int(batch)
        regroup_records(parts, grouping)
        return parts, grouping.num_users


def _full_batch(t, n: int):
    """A record tensor with the batch's n rows (a batch-independent input of batch size 1 expanded)."""
    if torch.is_tensor(t) and t.dim() and t.shape[0] == 1 and n != 1:
        return t.expand(n, *t.shape[1:])
    return t


def _regroup_use(rule, module, saved, g, grouping: Grouping, rank_m):
    """A sequence layer's record (input, output gradient) with each user's rows as one longer sequence
    (zero-padded: padding positions have zero output gradient and add nothing)."""
    n = g.shape[0]
    saved = tuple(_full_batch(t, n) for t in saved)
    if isinstance(rule, EmbeddingRule):
        ids = saved[0].reshape(n, -1)
        b = g.reshape(n, ids.shape[1], g.shape[-1])
        return (grouping.as_sequences(ids, rank_m),), grouping.as_sequences(b, rank_m)
    a, b = rule.flat_factors(saved, g)
    return (grouping.as_sequences(a, rank_m),), grouping.as_sequences(b, rank_m)


@torch.no_grad()
def regroup_records(parts, grouping: Grouping) -> None:
    """Every recorded part at user level, in place (exact: a user's gradient is the sum of its rows'):

    * Linear (nn.Linear, transformers' Conv1D) and Embedding records on the ghost path: a user's rows
      become one longer sequence (:func:`_regroup_use`), so ghost norms, pairwise ghost cross terms
      of tied parameters and the ghost clipped sum apply to users as they are;
    * every other record (deferred and per-sample layers, convolutions, normalisation layers, fallback
      and direct units): per-sample gradients summed by user (:meth:`Grouping.sum`)."""
    rank_m = grouping.rank()
    for part in parts:
        regroup_use = None
        if isinstance(getattr(part, "rule", None), (LinearRule, EmbeddingRule)):  # deferred records too: the
            # layer's norm_sq then takes the ghost norm or forms per-user gradients, by the users' shapes
            rule, module = part.rule, part.module

            def regroup_use(saved, g, rule=rule, module=module):
                return _regroup_use(rule, module, saved, g, grouping, rank_m)

        part.regroup(grouping.sum, grouping.num_users, regroup_use)
