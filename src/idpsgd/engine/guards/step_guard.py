"""The guards around one DP-SGD step, run by the optimizer right before the noise is drawn.

Boenisch et al. 2023, Alg. 3: a step releases θ_{t+1} from the noisy clipped sum only.  Before the
noise of each logical step :class:`StepGuard` refuses, in this order, un-noised writes to the
released model or its optimizer state since the step began (:class:`~.integrity.WriteGuard`),
parameters made trainable since ``make_private`` (they would train without clipping), per-example
gradients that do not add up to autograd's gradient (:mod:`.decomposition`, at the steps of its
public schedule), and a step the privacy filter does not admit (:mod:`..budget.group_filter`,
:mod:`..budget.filter`).  A refused step draws no noise and charges nothing; after any refusal in
``optimizer.step()`` the write check re-arms so the next step starts clean.  The ledger is charged
after the noise (Opacus's step hook).
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from ..distributed import data_parallel_wrapper
from ..distributed.fsdp import ShardedDecompositionCheck
from ..modes import mode
from ..per_example.unwrap import raw_module
from .decomposition import DecompositionCheck
from .integrity import WriteGuard, check_no_new_trainable, trainable_names


class StepGuard:
    """One phase's guards, wired into its optimizer (``guard``, ``refusal_hooks``, ``post_step_hooks``).

    ``step_filter``: the privacy filter in use (a :class:`~..budget.group_filter.StepFilter`, or None:
    accounted, not filtered), :meth:`use_filter` once the filter is attached."""

    def __init__(self, wrapped, optimizer, grad_sample_mode: str, charge, before_noise=None):
        raw = raw_module(wrapped)
        self.before_noise = before_noise  # the journal of drawn steps (engine/budget/journal.py): settle, record
        self.module, self.grad_sample_mode, self.step_filter = wrapped, grad_sample_mode, None
        self.writes, self.trainable = WriteGuard.attach(raw), trainable_names(raw)
        # its state is released with the model in checkpoints and feeds later updates; the wrappers' own
        # forward pre-hooks run before the model's: both are watched from the step's first call
        self.writes.watch_too(optimizer.original_optimizer, wrapped)
        self.writes.arm()
        self.decomposition = None
        record = mode(grad_sample_mode)
        probe = record.decomposition
        if probe is not None:
            names = {id(p): n for n, p in raw.named_parameters()}
            if record.sharded_optimizer is not None and isinstance(optimizer, record.sharded_optimizer):
                # FSDP2 (ghost): the layers' sums reduce-scattered into the shards of the first pass's p.grad
                self.decomposition = ShardedDecompositionCheck(names, raw)
            else:
                ddp = isinstance(data_parallel_wrapper(wrapped), DistributedDataParallel)  # p.grad: the ranks' average
                self.decomposition = DecompositionCheck(names, ranks_average=ddp)
            probe(self.decomposition, wrapped, optimizer)
        optimizer.set_guard(self, self.writes)  # DPDDP: a write found on another rank marks this replica too
        optimizer.add_post_step_hook(lambda _opt: self.writes.arm())
        optimizer.add_refusal_hook(self.after_refusal)
        optimizer.attach_step_hook(lambda _opt: charge())  # the ledger, after the noise

    def use_filter(self, step_filter) -> None:
        """Ask ``step_filter`` (a :class:`~..budget.group_filter.StepFilter`, or None) before the noise of each step."""
        self.step_filter = step_filter

    def __call__(self, optimizer) -> None:
        """Before the noise of each logical step: refuse un-noised writes to the released model and
        parameters made trainable since make_private (:mod:`.integrity`), per-example gradients that do
        not add up to autograd's (:mod:`.decomposition`), then the privacy filter; the admitted step is
        then recorded (``before_noise``: appended and fsync'd before any noise)."""
        self.writes.check()
        check_no_new_trainable(raw_module(self.module), self.trainable, self.grad_sample_mode)
        if self.decomposition is not None:
            self.decomposition.guard()
        if self.before_noise is not None:  # a run folder's earlier draws are charged before the filter asks
            self.before_noise("settle")
        if self.step_filter is not None:
            self.step_filter.guard(optimizer)
        if self.before_noise is not None:
            self.before_noise("record")

    def after_refusal(self, _optimizer) -> None:
        """A step refused anywhere in ``optimizer.step()`` (the guard, the book-keeper, Opacus): its
        forward/backward pass is checked for writes (it may have been refused before the guard
        compared), then the next call of the model starts the next step — so writes between steps
        after a refused step are not taken for writes in it."""
        if self.decomposition is not None:
            self.decomposition.reset()
        if self.writes.tainted is None:
            self.writes.check()
            self.writes.arm()


__all__ = ["StepGuard"]
