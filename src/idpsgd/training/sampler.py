"""Poisson sampling with per-example rates, and an in-memory loader that yields example indices.

IDP-SGD *Sample* (Boenisch et al. 2023, Alg. 1 and Alg. 3 line 3 with per-point rates): at every
step, example i joins the mini-batch independently with probability q_i.  Batches are therefore
of random size — possibly empty, in which case the step is noise only, exactly as in Opacus's
``DPDataLoader`` — and the privacy analysis of each example is that of a Poisson-subsampled
Gaussian mechanism with its own rate.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from ..validation import InvalidParameterError, check_sample_rate


class PoissonSampler:
    """Yields, ``steps_per_epoch`` times per epoch, the indices of a Poisson sample.

    Args:
        sample_rates: q_i per example, each in [0, 1] (0 excludes an example).
        steps_per_epoch: number of batches per pass (Opacus uses round(1 / mean q)).
        seed: seed of the numpy generator (or a ``numpy.random.Generator`` to share); its state
            is part of :meth:`state_dict`.
    """

    def __init__(self, sample_rates, steps_per_epoch: int, seed: int | np.random.Generator = 0):
        rates = np.asarray(sample_rates, dtype=float).ravel()
        if rates.size == 0:
            raise InvalidParameterError("sample_rates", "[]", "need at least one example")
        check_sample_rate(rates, "sample_rates", allow_zero=True)
        if int(steps_per_epoch) < 1:
            raise InvalidParameterError("steps_per_epoch", steps_per_epoch, "must be an integer >= 1")
        self.sample_rates = rates
        self.steps_per_epoch = int(steps_per_epoch)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def expected_batch_size(self) -> float:
        return float(self.sample_rates.sum())

    def sample(self) -> np.ndarray:
        """One Poisson sample: sorted indices i with U_i < q_i."""
        return np.flatnonzero(self.rng.random(self.sample_rates.size) < self.sample_rates)

    def __iter__(self) -> Iterator[np.ndarray]:
        for _ in range(self.steps_per_epoch):
            yield self.sample()

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]


class IndexedLoader:
    """Batches ``(x[idx], y[idx], idx)`` of in-memory tensors, drawn by a :class:`PoissonSampler`.

    ``idx`` is a LongTensor of positions in ``x``; ``on_batch(idx)`` (if set) is called before
    each batch is yielded — :func:`make_private_individualized` uses it to tell the optimizer
    which examples' clip norms apply.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sampler: PoissonSampler,
                 on_batch: Callable[[torch.Tensor], None] | None = None):
        if len(x) != len(y) or len(x) != sampler.sample_rates.size:
            raise InvalidParameterError("data", f"{len(x)} inputs, {len(y)} labels, "
                                        f"{sampler.sample_rates.size} rates", "must have equal lengths")
        self.x, self.y, self.sampler, self.on_batch = x, y, sampler, on_batch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for idx in self.sampler:
            index = torch.from_numpy(idx)
            if self.on_batch is not None:
                self.on_batch(index)
            yield self.x[index], self.y[index], index
