"""Poisson sampling with per-example rates for any map-style ``Dataset`` and ``DataLoader``.

IDP-SGD *Sample* (Boenisch et al. 2023, Alg. 1, Alg. 3 line 3 with per-point rates): at every
step example i joins the batch independently with probability q_i; batches have random size,
possibly zero (a noise-only step, as Opacus's ``DPDataLoader``).  :class:`PoissonBatchSampler`
replaces the user's batch sampler and keeps everything else, so the loader yields the user's
batches unchanged; every batch's indices also go into a :class:`BatchIndexQueue`, the FIFO the
clipping reads to find each example's c_i.  Ordering and worker prefetching: docs/inside-the-engine.md.
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

from ..validation import InvalidParameterError, check_sample_rate


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

    def __len__(self) -> int:
        return self._size

    def push(self, indices: np.ndarray) -> None:
        idx = np.asarray(indices, dtype=np.int64).ravel()
        self._parts.append(idx)
        self._size += idx.size

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
    """Batch sampler drawing ``steps_per_epoch`` Poisson batches per pass, example i with rate q_i.

    A subclass of Opacus's ``UniformWithReplacementSampler`` (so ``BatchMemoryManager`` knows the
    expected batch size); ``sample_rate`` is the mean rate over the examples.

    Args:
        sample_rates: q_i for every example of the dataset, each in [0, 1] (0: never sampled).
        steps_per_epoch: batches per pass over the data.
        rng: source of uniforms (``numpy.random.Generator`` or the secure-mode source).
        queue: where the indices of every drawn batch are pushed (read by the clipping code).
    """

    def __init__(self, sample_rates, steps_per_epoch: int, rng, queue: BatchIndexQueue | None = None):
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

    @property
    def steps_per_epoch(self) -> int:
        return self.steps

    def follow_rates(self, rates: np.ndarray) -> None:
        """Sample at ``rates`` from now on, the array itself (the individual filter sets a rate to 0 in
        place when an example's budget is spent); one rate per unit, as before."""
        if rates.shape != self.sample_rates.shape:
            raise ValueError(f"need {self.sample_rates.size} rates, got {rates.size}")
        self.sample_rates = rates

    @property
    def expected_batch_size(self) -> float:
        return float(self.sample_rates.sum())

    def sample(self) -> np.ndarray:
        """One Poisson sample: the sorted indices i with U_i < q_i."""
        return np.flatnonzero(self.rng.random(self.sample_rates.size) < self.sample_rates)

    def __iter__(self):
        self.queue.clear()  # batches drawn ahead in an abandoned pass are never trained on
        for _ in range(self.steps):
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
            if self._template is None:
                self._template = self._empty(out)
            return out
        if self._template is None:
            self._template = self._empty(self.collate_fn([self.dataset[0]]))
        return copy.deepcopy(self._template)

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

    def __init__(self, data_loader: DataLoader, sampler: PoissonBatchSampler, batch_first: bool = True):
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
            collate_fn=EmptyBatchCollate(collate, data_loader.dataset, batch_first),
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
        self.distributed = hasattr(sampler, "shard")  # one shard per rank

    @classmethod
    def from_data_loader(cls, data_loader, **kwargs):
        raise TypeError(
            "PrivateDataLoader is built by IndividualizedPrivacyEngine.make_private (per-example rates); for "
            "Opacus's own loader use opacus.data_loader.DPDataLoader.from_data_loader"
        )
