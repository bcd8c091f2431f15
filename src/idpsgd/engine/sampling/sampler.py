"""Poisson sampling with per-example rates for any map-style ``Dataset`` and ``DataLoader``.

IDP-SGD *Sample* (Boenisch et al. 2023, Alg. 1, Alg. 3 line 3 with per-point rates): at every
step example i (or user, at user level) joins the batch independently with probability q_i;
batches have random size, possibly zero (a noise-only step, as Opacus's ``DPDataLoader``).
:class:`PoissonBatchSampler` — one sampler, with user level and a shard per rank as its parameters —
replaces the user's batch sampler and keeps everything else, so the loader yields the user's batches
unchanged; every batch's indices also go into a :class:`BatchIndexQueue`, the FIFO the clipping reads
to find each example's c_i.  Ordering and worker prefetching: docs/inside-the-engine.md.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from opacus.data_loader import DPDataLoader
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from ...validation import InvalidParameterError, check_sample_rate
from ..noise.randomness import SecureUniform
from .rank_balance import rank_owners


class BatchMismatchError(RuntimeError):
    """The examples clipped in a step are not exactly one whole drawn batch (their clip norms and
    accounting would belong to other examples): the step is refused before any noise."""


class BatchIndexQueue:
    """FIFO of the dataset indices of the batches drawn and not yet clipped.

    ``strict`` (a loader without worker processes, which draws one batch per ``next``): every
    optimizer step must consume exactly the one batch drawn since the previous step, whole.
    Otherwise (workers prefetch batches): every step must consume whole batches.
    """

    def __init__(self, strict: bool = True):
        self._parts: collections.deque[np.ndarray] = collections.deque()
        self._size = 0
        self._partial = False  # the head batch was partly consumed by this step
        self._consumed = 0  # indices consumed by this step
        self.strict = strict
        self._on_empty_batch = None  # called when an empty batch is drawn (:meth:`when_empty`)

    def __len__(self) -> int:
        return self._size

    def push(self, indices: np.ndarray) -> None:
        idx = np.asarray(indices, dtype=np.int64).ravel()
        self._parts.append(idx)
        self._size += idx.size
        if idx.size == 0 and self._on_empty_batch is not None:
            self._on_empty_batch()

    def when_empty(self, callback) -> None:
        """Call ``callback()`` (or nothing: None) whenever an empty batch is drawn: book-keeping's GradScaler
        marker, since a noise-only step has no backward pass to leave the ``.grad`` the scaler checks."""
        self._on_empty_batch = callback

    def pop(self, n: int) -> torch.Tensor:
        """The next ``n`` indices (a batch, or a physical part of one under BatchMemoryManager)."""
        n = int(n)
        if n > self._size:
            raise BatchMismatchError(
                "the optimizer clipped more per-sample gradients than drawn examples are waiting (the "
                "counts are private: not shown): every batch drawn from the private data loader must be "
                "followed by one backward pass and optimizer.step(), with one per-sample "
                "gradient per example (is batch_first right for your data?)"
            )
        out, need = [], n
        while need:
            head = self._parts[0]
            take = head[:need]
            out.append(take)
            if take.size == head.size:
                self._parts.popleft()
                self._partial = False
            else:
                self._parts[0] = head[need:]
                self._partial = True
            need -= take.size
        self._size -= n
        self._consumed += n
        return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, dtype=np.int64))

    def peek(self, n: int) -> torch.Tensor:
        """The next ``n`` indices, not consumed (user-level clipping groups them by user first)."""
        out, need = [], int(n)
        for part in self._parts:
            if need <= 0:
                break
            out.append(part[:need])
            need -= min(need, part.size)
        return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, dtype=np.int64))

    @property
    def empty_batch_pending(self) -> bool:
        """The next drawn batch is empty and this step clipped nothing yet (a noise-only step)."""
        return self._consumed == 0 and bool(self._parts) and self._parts[0].size == 0

    def finish_step(self) -> None:
        """Before the noise of a step: check it consumed whole drawn batches (exactly the one drawn
        batch when ``strict``); raise :class:`BatchMismatchError` (and forget the pending
        batches) otherwise."""
        consumed, partial = self._consumed, self._partial
        self._consumed, self._partial = 0, False
        if consumed == 0 and self._parts and self._parts[0].size == 0:
            self._parts.popleft()  # an empty Poisson batch: a noise-only step
        waiting = len(self._parts)
        if partial or (self.strict and waiting):
            self.clear()
            what = "only part of a drawn batch" if partial else f"a batch while {waiting} drawn batch(es) wait"
            raise BatchMismatchError(
                f"this step trained on {what}: train on every batch the private data loader "
                "yields, whole and in order, with one optimizer.step() per batch (its "
                "examples' clip norms and privacy accounting depend on it), with one per-sample "
                "gradient per example (is batch_first right for your data?); the step was not "
                "taken"
            )

    def clear(self) -> None:
        self._parts.clear()
        self._size = 0
        self._consumed, self._partial = 0, False


class PoissonBatchSampler(UniformWithReplacementSampler):
    """Batch sampler drawing ``steps_per_epoch`` Poisson batches per pass, privacy unit i with rate q_i.

    One sampler for the four set-ups, with the grouping and the sharding as parameters:

    * ``users`` (user level, docs/user-level.md): the units are users (one rate each, ``users.ids``
      order); a sampled user brings min(k, n_u) random rows (Charles et al. 2024, Alg. 2), and the batch
      holds those rows.  Without it the units are the dataset's examples.
    * ``ranks`` = (rank, W) (data parallelism, docs/distributed.md): this rank keeps the units dealt to
      it in snake order of their rates (:func:`~.rank_balance.rank_owners`: every rank's expected batch
      equal to within one unit's rate) — at user level all of a user's rows, so a user is clipped as one
      unit on one rank.  In reproducible mode every rank draws the whole step (n uniforms, then the
      users' rows) from the same stream and keeps its share, so the union over ranks is the
      single-process draw and the streams stay in step; in secure mode each rank draws its own units'
      uniforms from OS entropy.  Adding or removing a unit changes one rank's clipped sum by at most its
      clip norm: the sensitivity, and so the accounting, of one process.

    A subclass of Opacus's ``UniformWithReplacementSampler`` (so ``BatchMemoryManager`` knows the
    expected batch size); ``sample_rate`` is the mean rate over the units.

    Args:
        sample_rates: q_i for every unit (example, or user with ``users``), each in [0, 1] (0: never sampled).
        steps_per_epoch: batches per pass over the data.
        rng: source of uniforms (``numpy.random.Generator`` or the secure-mode source).
        queue: where the indices of every drawn batch are pushed (read by the clipping code).
        users: a :class:`~idpsgd.users.Users`: sample users, each with its rows.
        ranks: (rank, world size): sample this rank's shard.
    """

    def __init__(
        self,
        sample_rates,
        steps_per_epoch: int,
        rng,
        queue: BatchIndexQueue | None = None,
        *,
        users=None,
        ranks: tuple[int, int] | None = None,
    ):
        rates = np.asarray(sample_rates, dtype=float).ravel()
        if rates.size == 0:
            raise InvalidParameterError("sample_rates", "[]", "need at least one example")
        check_sample_rate(rates, "sample_rates", allow_zero=True)
        if int(steps_per_epoch) < 1:
            raise InvalidParameterError("steps_per_epoch", steps_per_epoch, "must be an integer >= 1")
        # the mean rate; one rate for all is kept exactly (the mean of 10 times 0.1 is 0.09999999999999998)
        mean = float(rates[0]) if np.all(rates == rates[0]) else float(rates.mean())
        super().__init__(num_samples=rates.size, sample_rate=mean, steps=int(steps_per_epoch))
        self.sample_rates = rates
        self.rng = rng
        self.queue = queue if queue is not None else BatchIndexQueue()
        self.users = users
        if users is not None:
            if rates.size != users.num_users:
                raise ValueError(f"sample_rates has {rates.size} values, need one per user")
            self.num_samples = users.num_rows
        self.rank, self.world_size, self.owners, self.shard = 0, 1, None, None
        if ranks is not None:
            rank, world = ranks
            if not 0 <= int(rank) < int(world):
                raise InvalidParameterError("rank", rank, f"must be in [0, {world})")
            self.rank, self.world_size = int(rank), int(world)
            self.owners = rank_owners(rates, self.world_size)
            self.shard = np.flatnonzero(self.owners == self.rank).astype(np.int64)
        self._draw_hooks: list = []

    @property
    def steps_per_epoch(self) -> int:
        return self.steps

    @property
    def expected_batch_size(self) -> float:
        """Σ q_i over this rank's units (all units without ``ranks``): the expected number of examples,
        or of users at user level."""
        q = self.sample_rates
        return float((q if self.shard is None else q[self.shard]).sum())

    def follow_rates(self, rates: np.ndarray) -> None:
        """Sample at ``rates`` from now on, the array itself (the individual filter sets a rate to 0 in
        place when an example's budget is spent); one rate per unit, as before."""
        if rates.shape != self.sample_rates.shape:
            raise ValueError(f"need {self.sample_rates.size} rates, got {rates.size}")
        self.sample_rates = rates

    def before_each_draw(self, hook) -> None:
        """Call ``hook()`` right before each batch is drawn (the Trainer keeps the source's state there)."""
        self._draw_hooks.append(hook)

    def sample(self) -> np.ndarray:
        """One Poisson draw: the sorted indices i with U_i < q_i of this rank's units (examples), or the rows
        the drawn users bring (user level)."""
        q = self.sample_rates
        if self.shard is not None and isinstance(self.rng, SecureUniform):  # this rank's uniforms only
            chosen = self.shard[self.rng.random(self.shard.size) < q[self.shard]]
            return chosen if self.users is None else self.users.draw_rows(chosen, self.rng)
        chosen = np.flatnonzero(self.rng.random(q.size) < q)  # the single-process draw
        if self.users is None:
            return chosen if self.shard is None else chosen[self.owners[chosen] == self.rank]
        rows = self.users.draw_rows(chosen, self.rng)
        return rows if self.shard is None else rows[self.owners[self.users.unit_of_row[rows]] == self.rank]

    def __iter__(self):
        self.queue.clear()  # batches drawn ahead in an abandoned pass are never trained on
        for _ in range(self.steps):
            for hook in self._draw_hooks:
                hook()
            idx = self.sample()
            self.queue.push(idx)
            yield idx.tolist()

    def state_dict(self) -> dict:
        state = getattr(getattr(self.rng, "bit_generator", None), "state", None)
        return {"bit_generator": state}

    def load_state_dict(self, state: dict) -> None:
        if state.get("bit_generator") is not None and hasattr(self.rng, "bit_generator"):
            self.rng.bit_generator.state = state["bit_generator"]


class EmptyBatchCollate:
    """Wraps a ``collate_fn`` so that an empty Poisson batch has the structure of a real one.

    Tensors get a zero-length batch dimension; dicts, lists and tuples keep their keys and order
    (as Opacus's ``CollateFnWithEmpty``).  The structure is learned from the first non-empty
    batch; if the very first batch is empty, one item of the dataset is collated only to learn
    the structure (its values are discarded, nothing of it reaches the model).
    """

    def __init__(self, collate_fn, dataset, batch_first: bool = True):
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.dataset = dataset
        self.batch_first = batch_first
        self._template = None

    def __call__(self, batch):
        if len(batch):
            out = self.collate_fn(batch)
            if not self.batch_first and len(batch) > 1:
                self._check_batch_second(batch, out)
            if self._template is None:
                self._template = self._empty(out)
            return out
        if self._template is None:
            self._template = self._empty(self.collate_fn([self.dataset[0]]))
        return copy.deepcopy(self._template)

    def _check_batch_second(self, batch, out) -> None:
        """``batch_first=False``: the collated tensors of two or more dimensions hold the examples along their
        second dimension, as declared — each has one entry per drawn example there, and (at the first batch)
        the first and last examples collated alone have one entry there and are the batch's first and last
        entries wherever the shapes allow the comparison (a collate that pads to the batch's longest example
        does not).  What
        book-keeping's provenance and Opacus take as the examples is then the loader's, even when the batch
        size equals the sequence length."""
        from torch.utils._pytree import tree_flatten

        leaves = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.dim() >= 2]
        wrong = [tuple(t.shape) for t in leaves if int(t.shape[1]) != len(batch)]
        if not wrong and self._template is None:
            for k in (0, len(batch) - 1):
                alone = [t for t in tree_flatten(self.collate_fn([batch[k]]))[0] if torch.is_tensor(t) and t.dim() >= 2]
                for a, t in zip(alone, leaves, strict=False):
                    row = t.narrow(1, k, 1)
                    if int(a.shape[1]) != 1 or (a.shape == row.shape and not torch.equal(a, row)):
                        wrong.append(tuple(t.shape))
        if wrong:
            raise InvalidParameterError(
                "batch_first",
                False,
                f"does not match the loader's batches: a collated tensor of shape {wrong[0]} does not hold the "
                f"{len(batch)} drawn examples along its second dimension (dimension 1), one per example in the "
                "order drawn; give (T, B, ...) batches (e.g. torch.stack(items, 1) in the collate_fn) or use "
                "batch_first=True",
            )

    def _empty(self, sample: Any):
        if torch.is_tensor(sample):
            if sample.dim() == 0:
                return sample.new_empty((0,))
            shape = list(sample.shape)
            shape[0 if self.batch_first or sample.dim() < 2 else 1] = 0
            return sample.new_empty(shape)
        if isinstance(sample, Mapping):
            return (
                type(sample)({k: self._empty(v) for k, v in sample.items()})
                if type(sample) is not dict
                else {k: self._empty(v) for k, v in sample.items()}
            )
        if isinstance(sample, tuple) and hasattr(sample, "_fields"):  # namedtuple
            return type(sample)(*(self._empty(v) for v in sample))
        if isinstance(sample, (list, tuple)):
            return type(sample)(self._empty(v) for v in sample)
        if isinstance(sample, np.ndarray):
            shape = list(sample.shape)
            if shape:
                shape[0] = 0
            return np.empty(shape, dtype=sample.dtype)
        raise TypeError(
            f"a batch holds a {type(sample).__name__}; empty Poisson batches can only be built for "
            "tensors, numpy arrays, dicts, lists and tuples of them (return those from collate_fn)"
        )


class PrivateDataLoader(DPDataLoader):
    """The user's ``DataLoader`` with Poisson sampling at per-example rates (same dataset, collate,
    workers, pinning, timeouts).  ``poisson_sampler`` is the :class:`PoissonBatchSampler`.

    An instance of Opacus's ``DPDataLoader`` (as what Opacus's ``make_private`` returns), with its
    attributes ``sample_rate`` (the mean rate) and ``distributed``; it is built from the user's loader
    by the engine, not by ``DPDataLoader``'s constructor (one rate, Opacus's sampler)."""

    def __init__(
        self, data_loader: DataLoader, sampler: PoissonBatchSampler, batch_first: bool = True, wrap_collate=None
    ):
        """``wrap_collate``: a wrapper of the collate function, where the step needs one (FSDP2's phantom row
        for an empty draw: ``PhantomCollate`` of engine/distributed/fsdp.py)."""
        collate = data_loader.collate_fn
        if isinstance(collate, EmptyBatchCollate):
            collate = collate.collate_fn
        kwargs = {}
        if data_loader.num_workers > 0:
            kwargs = {
                "prefetch_factor": data_loader.prefetch_factor,
                "persistent_workers": data_loader.persistent_workers,
            }
        DataLoader.__init__(  # not DPDataLoader's constructor: the batch sampler is the engine's
            self,
            data_loader.dataset,
            batch_sampler=sampler,
            collate_fn=EmptyBatchCollate(collate, data_loader.dataset, batch_first)
            if wrap_collate is None
            else wrap_collate(EmptyBatchCollate(collate, data_loader.dataset, batch_first)),
            num_workers=data_loader.num_workers,
            pin_memory=data_loader.pin_memory,
            timeout=data_loader.timeout,
            worker_init_fn=data_loader.worker_init_fn,
            multiprocessing_context=data_loader.multiprocessing_context,
            generator=data_loader.generator,
            **kwargs,
        )
        self.poisson_sampler = sampler
        self.sample_rate = sampler.sample_rate
        self.distributed = sampler.shard is not None  # one shard per rank

    @classmethod
    def from_data_loader(cls, data_loader, **kwargs):
        raise TypeError(
            "PrivateDataLoader is built by IndividualizedPrivacyEngine.make_private (per-example rates); for "
            "Opacus's own loader use opacus.data_loader.DPDataLoader.from_data_loader"
        )
