"""One record per ``grad_sample_mode``: the one place that decides each mode's wrapper and optimizer.

A mode is how the per-example gradient norms of a step are formed (Boenisch et al. 2023, Alg. 3
line 6 needs only the norms and the clipped sum): Opacus's per-sample gradients (``hooks``,
``functorch``, ``ew``), the user's own (``no_op``), Opacus's two-pass ghost clipping (``ghost``;
Li et al. 2022) or one-pass book-keeping (``bk``; Bu et al. 2023).  Each :class:`GradSampleMode`
names its module wrapper, its optimizer for one process, for data parallelism and for FSDP2
sharding (:mod:`.distributed.fsdp`; None where the mode cannot train a ``fully_shard`` model), what it supports
and what it returns; :mod:`.per_example.wrap` builds the wrapper, ``make_private`` the optimizer, both from
:data:`MODES`.  Which mode to pick: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from opacus.grad_sample import GradSampleHooksNoOp, GradSampleModuleExpandedWeights, GradSampleModuleNoOp

from ..validation import InvalidParameterError
from .clipping.users import UserClipping
from .distributed import (
    DistributedIndividualizedDPOptimizer,
    DistributedIndividualizedDPOptimizerBookKeeping,
    DistributedIndividualizedDPOptimizerFastGradientClipping,
)
from .distributed.fsdp import ShardedBookKeepingOptimizer, ShardedGhostOptimizer
from .guards.decomposition import probe_expanded_weights, probe_layers, probe_per_sample, probe_user_rows
from .noise.optimizer import (
    IndividualizedDPOptimizer,
    IndividualizedDPOptimizerBookKeeping,
    IndividualizedDPOptimizerFastGradientClipping,
)
from .per_example import per_sample_rules  # noqa: F401  (registers the corrected convolution and embedding rules)
from .per_example.bk.keeper import BookKeeper
from .per_example.bk.module import BookKeepingModule
from .per_example.ghost import IndividualizedGhostModule
from .per_example.output_hooks import IndividualizedGradSampleHooks, IndividualizedGradSampleModule
from .per_example.unwrap import raw_module


@dataclass(frozen=True)
class GradSampleMode:
    """What one ``grad_sample_mode`` uses and supports.

    ``build(module, clipping, batch_first, loss_reduction)`` wraps a plain module; ``reuse(wrapped,
    clipping, loss_reduction)`` readies a wrapper of this mode made by an earlier phase.  ``hooks``:
    Opacus 1.6's class for ``wrap_model=False`` (None: not supported).  ``layer_path``: how each
    layer's norms are formed (None: per layer, from the book-keeper)."""

    name: str
    wrapper: type
    optimizer: type
    distributed_optimizer: type
    build: Callable
    #: the optimizer of a ``fully_shard`` (FSDP2) model (:mod:`.distributed.fsdp`); None: such a model is refused
    sharded_optimizer: type | None = None
    reuse: Callable = lambda wrapped, clipping, loss_reduction: None
    hooks: type | None = None
    force_functorch: bool = False
    #: False for no_op: the per-sample gradients are the user's (no batch-independence check of them)
    engine_computes: bool = True
    #: ew: the wrapper calls the model with its own parameters (the batch-independence check watches it)
    wrapper_calls_model: bool = False
    #: False for ghost/bk: autograd's summed gradient is not the update (plain DDP cannot all-reduce it)
    autograd_sum: bool = True
    #: ghost: make_private also returns Opacus's loss wrapper (two backward passes)
    returns_criterion: bool = False
    #: bk: the optimizer takes the clipped sum from the model's book-keeper
    book_keeping: bool = False
    layer_path: str | None = None
    #: how the check that the per-example gradients add up to autograd's attaches (:mod:`.guards.decomposition`);
    #: None for bk, whose provenance refuses any use of a parameter it cannot attribute to rows
    decomposition: Callable | None = probe_per_sample
    #: why ``batch_first=False`` is refused in this mode (None: batch-second inputs are supported, the batch
    #: dimension of every trainable layer's input proven by provenance, :mod:`.guards.batch_independence`)
    batch_second: str | None = None

    def hooks_object(self, module: torch.nn.Module, batch_first: bool, loss_reduction: str):
        """Opacus's hooks attached to ``module`` itself (``wrap_model=False``)."""
        kwargs = {} if self.hooks is GradSampleHooksNoOp else {"force_functorch": self.force_functorch}
        return self.hooks(module, batch_first=batch_first, loss_reduction=loss_reduction, **kwargs)

    def reusable(self, module: torch.nn.Module, batch_first: bool, loss_reduction: str) -> bool:
        """Whether an existing Opacus wrapper ``module`` is this mode's, with these options."""
        return (
            type(module) is self.wrapper
            and module.batch_first == batch_first
            and module.loss_reduction == loss_reduction
            and (self.wrapper is not IndividualizedGradSampleModule or module.force_functorch == self.force_functorch)
        )


def _sampled(force_functorch: bool):
    def build(module, clipping, batch_first, loss_reduction):
        return IndividualizedGradSampleModule(  # Opacus's, with output hooks and the net (.output_hooks)
            module, batch_first=batch_first, loss_reduction=loss_reduction, force_functorch=force_functorch
        )

    return build


def _plain(cls):
    def build(module, clipping, batch_first, loss_reduction):
        return cls(module, batch_first=batch_first, loss_reduction=loss_reduction)

    return build


def _build_ghost(module, clipping, batch_first, loss_reduction):
    wrapped = IndividualizedGhostModule(  # user level: per-sample gradients summed by user (units.py)
        module,
        batch_first=batch_first,
        loss_reduction=loss_reduction,
        use_ghost_clipping=not isinstance(clipping, UserClipping),
    )
    wrapped.use_clipping(clipping)
    return wrapped


def _reuse_ghost(wrapped, clipping, loss_reduction):
    wrapped.use_clipping(clipping)


def _build_bk(module, clipping, batch_first, loss_reduction):
    keeper = BookKeeper.attach(raw_module(module))
    return BookKeepingModule(module, keeper=keeper, batch_first=batch_first, loss_reduction=loss_reduction)


def _reuse_bk(wrapped, clipping, loss_reduction):
    wrapped.keeper.refresh()  # parameters frozen or unfrozen since: planned anew
    wrapped.keeper.activate(loss_reduction)


_PER_SAMPLE = dict(
    wrapper=IndividualizedGradSampleModule,
    optimizer=IndividualizedDPOptimizer,
    distributed_optimizer=DistributedIndividualizedDPOptimizer,
    hooks=IndividualizedGradSampleHooks,
)

MODES: dict[str, GradSampleMode] = {
    m.name: m
    for m in (
        GradSampleMode("hooks", build=_sampled(False), layer_path="Opacus per-sample gradient (hooks)", **_PER_SAMPLE),
        GradSampleMode(
            "functorch",
            build=_sampled(True),
            force_functorch=True,
            layer_path="Opacus per-sample gradient (functorch)",
            **_PER_SAMPLE,
        ),
        GradSampleMode(
            "ew",
            wrapper=GradSampleModuleExpandedWeights,
            optimizer=IndividualizedDPOptimizer,
            distributed_optimizer=DistributedIndividualizedDPOptimizer,
            build=_plain(GradSampleModuleExpandedWeights),
            wrapper_calls_model=True,
            decomposition=probe_expanded_weights,
            batch_second="PyTorch's ExpandedWeights takes the batch size from the first dimension of every layer's "
            "input",
            layer_path="PyTorch ExpandedWeights per-sample gradient (Opacus's ew mode)",
        ),
        GradSampleMode(
            "ghost",
            wrapper=IndividualizedGhostModule,
            optimizer=IndividualizedDPOptimizerFastGradientClipping,
            distributed_optimizer=DistributedIndividualizedDPOptimizerFastGradientClipping,
            sharded_optimizer=ShardedGhostOptimizer,
            build=_build_ghost,
            reuse=_reuse_ghost,
            autograd_sum=False,
            returns_criterion=True,
            decomposition=probe_layers,
            layer_path="Opacus fast gradient clipping (ghost norm for Linear/Embedding, per-sample gradient "
            "otherwise; two backward passes)",
        ),
        GradSampleMode(
            "bk",
            wrapper=BookKeepingModule,
            optimizer=IndividualizedDPOptimizerBookKeeping,
            distributed_optimizer=DistributedIndividualizedDPOptimizerBookKeeping,
            sharded_optimizer=ShardedBookKeepingOptimizer,
            build=_build_bk,
            reuse=_reuse_bk,
            autograd_sum=False,
            book_keeping=True,
            decomposition=None,
        ),
        GradSampleMode(  # the user's p.grad_sample, clipped as the hooks mode's
            "no_op",
            wrapper=GradSampleModuleNoOp,
            optimizer=IndividualizedDPOptimizer,
            distributed_optimizer=DistributedIndividualizedDPOptimizer,
            build=_plain(GradSampleModuleNoOp),
            hooks=GradSampleHooksNoOp,
            engine_computes=False,
            decomposition=probe_user_rows,
            batch_second="the per-sample gradients are your own computation, whose layer inputs the engine never sees, "
            "so it cannot prove where their batch dimension is (grad_sample_mode='hooks' or 'bk' can)",
            layer_path="your per-sample gradient (p.grad_sample, assigned before optimizer.step(); "
            "Opacus's no_op mode)",
        ),
    )
}

#: the modes in which the engine (or Opacus) computes the per-example gradients or norms
GRAD_SAMPLE_MODES = tuple(name for name, m in MODES.items() if m.engine_computes)
#: the engine's modes: those, and Opacus's ``no_op`` (per-sample gradients the user computes)
ENGINE_MODES = tuple(MODES)
#: the modes Opacus 1.6's ``wrap_model=False`` (hooks without a wrapper) is supported in
UNWRAPPED_MODES = tuple(name for name, m in MODES.items() if m.hooks is not None)


def mode(name) -> GradSampleMode:
    """The record of ``grad_sample_mode=name``; an unknown name is refused with the known ones."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise InvalidParameterError("grad_sample_mode", name, f"must be one of {', '.join(MODES)}") from None


__all__ = ["ENGINE_MODES", "GRAD_SAMPLE_MODES", "MODES", "UNWRAPPED_MODES", "GradSampleMode", "mode"]
