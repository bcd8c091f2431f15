"""Per-example clip norms c_i, looked up by dataset index at the moment gradients are clipped.

Boenisch et al. 2023, Alg. 3 line 6 with individualized parameters: example i's gradient is
clipped to c_i (IDP-SGD *Scale* gives each privacy group its own c_p, §3.4; individual clipping,
Yu et al. 2023 Alg. 3, clips at a per-example bound refreshed during training).  The clip factor
is min(1, c_i / (‖g_i‖ + 1e-6)), Opacus's formula with c_i for c.

One object serves both ways Opacus clips: the optimizer's ``clip_and_accumulate`` (per-sample
gradients: ``grad_sample_mode`` "hooks"/"functorch") and the ghost-clipping module's
``get_clipping_coef`` (``grad_sample_mode="ghost"``: norms without per-sample gradients, the clip
factors rescale the per-sample losses of a second backward pass).
"""

from __future__ import annotations

import numpy as np
import torch

from ...validation import check_positive_array
from ..sampling.sampler import BatchIndexQueue


class PerExampleClipping:
    """Clip norms of all examples and the queue of drawn batch indices.

    After each logical step, :attr:`last_norms` and :attr:`last_indices` hold the step's
    per-example gradient norms (before clipping) and dataset indices — private values, for
    individual accounting, never to be logged.
    """

    def __init__(self, clip_norms, queue: BatchIndexQueue):
        self.clip_norms = torch.as_tensor(check_positive_array(clip_norms, "clip_norms"), dtype=torch.float64).flatten()
        self.queue = queue
        self._norms: list[torch.Tensor] = []
        self._indices: list[torch.Tensor] = []
        self.last_norms: torch.Tensor | None = None
        self.last_indices: torch.Tensor | None = None
        self._phantom_mark = False  # the coming pass is a phantom row's (FSDP2: .distributed.fsdp.mark_phantom_pass)

    def mark_phantom_pass(self) -> None:
        """The coming backward pass runs on a phantom row (FSDP2, :func:`~..distributed.fsdp.mark_phantom_pass`)."""
        self._phantom_mark = True

    def phantom_marked(self, consume: bool = False) -> bool:
        """Whether :meth:`mark_phantom_pass` marked the current pass (``consume``: the mark is forgotten)."""
        marked = self._phantom_mark
        if consume:
            self._phantom_mark = False
        return marked

    def set_clip_norms(self, clip_norms) -> None:
        """Replace the per-example clip norms (individual clipping refreshes them)."""
        arr = np.asarray(clip_norms, dtype=float).ravel()
        if not np.all(np.isfinite(arr) & (arr >= 0)):
            raise ValueError("clip norms must be >= 0 and finite")
        new = torch.from_numpy(arr.copy())
        if new.numel() != self.clip_norms.numel():
            raise ValueError(f"clip_norms has {new.numel()} values, need {self.clip_norms.numel()}")
        self.clip_norms = new

    def factors(self, norms: torch.Tensor) -> torch.Tensor:
        """min(1, c_i / (‖g_i‖ + 1e-6)) for the next ``len(norms)`` drawn examples; 0 for an example
        whose gradient overflowed (a non-finite norm, half precision): it contributes nothing."""
        idx = self.queue.pop(norms.numel())
        self._norms.append(norms.detach())
        self._indices.append(idx)
        if norms.numel() == 0:
            return norms.new_zeros((0,))
        clip = self.clip_norms[idx].to(device=norms.device, dtype=norms.dtype)
        return torch.where(torch.isfinite(norms), (clip / (norms + 1e-6)).clamp(max=1.0), 0.0)

    @property
    def pending_indices(self) -> list[torch.Tensor]:
        """Indices of the examples clipped so far in the current logical step, in clipping order."""
        return list(self._indices)

    def end_step(self) -> None:
        """Close the logical step: its norms and indices become ``last_norms``/``last_indices``."""
        if self._norms:
            self.last_norms = torch.cat([n.reshape(-1) for n in self._norms])
            self.last_indices = torch.cat(self._indices)
        else:
            self.last_norms = self.last_indices = None
        self._norms, self._indices = [], []
