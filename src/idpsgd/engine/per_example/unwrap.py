"""The user's module inside the wrappers the engine and Opacus put around it.

One helper, kept apart from :mod:`.wrap` so that modules which only need to find the user's
module (norm passes, integrity checks, the training loop) do not import the wrapping machinery.
"""

from __future__ import annotations

import torch
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks

#: data-parallel wrappers unwrapped by name (DPDDP, DDP): no import of torch.distributed needed here
DATA_PARALLEL_WRAPPERS = ("DifferentiallyPrivateDistributedDataParallel", "DistributedDataParallel")


def raw_module(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside Opacus wrappers (GradSampleModule, DPDDP) or under Opacus's hooks
    object (``wrap_model=False``)."""
    while True:
        if isinstance(module, AbstractGradSampleHooks):
            module = module._module
        elif type(module).__name__ in DATA_PARALLEL_WRAPPERS:
            module = module.module
        else:
            return module
