"""The user's module for ``grad_sample_mode="bk"``: Opacus's wrapper interface over the model's
:class:`~.keeper.BookKeeper`."""

from __future__ import annotations

import contextlib

from opacus.grad_sample import AbstractGradSampleModule
from torch import nn

from ..machinery import forward_net
from .keeper import BookKeeper


class BookKeepingModule(AbstractGradSampleModule):
    """The user's module for ``grad_sample_mode="bk"`` (an Opacus ``AbstractGradSampleModule``, so
    Opacus's utilities and DPDDP see the wrapper they expect).  Its forward is the user's module's;
    the book-keeper records during the backward pass, and the optimizer
    (:class:`~...noise.optimizer.IndividualizedDPOptimizerBookKeeping`) reads the clipped sum from it."""

    def __init__(self, m: nn.Module, *, keeper: BookKeeper, batch_first: bool = True, loss_reduction: str = "mean"):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self.keeper = keeper
        keeper.set_batch_dim(0 if batch_first else 1)  # (T, B, ...) inputs: provenance tags the batch at dim 1
        self.keeper.activate(loss_reduction)

    def forward(self, *args, **kwargs):
        return forward_net(self._module, self._plain, self._module, "bk", args, kwargs)

    @contextlib.contextmanager
    def _plain(self):
        """The model's forward without book-keeping (the net's second run, :func:`~..machinery.forward_net`)."""
        with self.keeper.paused():
            yield

    @property
    def layer_paths(self) -> dict[str, str]:
        """The paths the layers took (private; :attr:`layer_path_rules` for the public rule)."""
        return self.keeper.paths

    @property
    def layer_path_rules(self) -> dict[str, str]:
        return self.keeper.rules

    def forbid_grad_accumulation(self):
        self.keeper.forbid_accumulation_of_batches(True)

    def allow_grad_accumulation(self):
        self.keeper.forbid_accumulation_of_batches(False)

    def disable_hooks(self) -> None:
        self.keeper.deactivate()

    def enable_hooks(self) -> None:
        self.keeper.activate()

    def remove_hooks(self) -> None:
        self.keeper.detach()

    def zero_grad(self, set_to_none: bool = False):
        self.keeper.clear()
        super().zero_grad(set_to_none)
