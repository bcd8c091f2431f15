"""One DP-SGD step, built in the order it runs: sample rows → per-example norms → clip → noise.

Boenisch et al. 2023, Alg. 3 with per-example parameters: Poisson sampling at rates q_i
(:mod:`.sampling.sampler`; users whole at user level, :mod:`.clipping.users`; a shard per rank with data
parallelism, :mod:`.distributed`), per-example gradient norms by the mode's wrapper
(:mod:`.modes`, :mod:`.per_example.wrap`), clipping at c_i (:mod:`.clipping.examples`), Gaussian noise of std σ·c and
division by Σ q_i (:mod:`.noise.optimizer`; per rank Σ q_i / W, as Opacus).  The ledger and the guards
around the step are wired by the engine (:mod:`.guards.step_guard`); the plan comes from
:class:`~.options.PhaseParameters`, the wrapping options from :class:`~.options.SetupOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .clipping.examples import PerExampleClipping
from .clipping.users import BookKeepingUsers, UserClipping
from .distributed import fsdp
from .options import PhaseParameters, SetupOptions
from .per_example.wrap import wrap_module
from .sampling.sampler import BatchIndexQueue, PoissonBatchSampler, PrivateDataLoader


@dataclass(frozen=True)
class BuiltStep:
    """The phase's clipping, wrapped module, noisy optimizer and private data loader."""

    clipping: PerExampleClipping
    module: object
    optimizer: object
    data_loader: PrivateDataLoader


def build_step(
    module,
    optimizer,
    data_loader,
    plan: PhaseParameters,
    opts: SetupOptions,
    ranks,
    sampler_rng,
    noise,
    secure_mode,
    sharded: bool = False,
) -> BuiltStep:
    """The step of a phase (``ranks``: (rank, world size) with data parallelism, else None; ``sharded``:
    a ``fully_shard`` model, :mod:`.distributed.fsdp`)."""
    q, c, spe, users = plan.sample_rates, plan.clip_norms, plan.steps_per_epoch, opts.users
    queue = BatchIndexQueue(strict=getattr(data_loader, "num_workers", 0) == 0)  # workers prefetch batches
    # sample rows: Poisson at q_i (user level: users with their rows; several ranks: this rank's shard)
    sampler = PoissonBatchSampler(q, spe, sampler_rng, queue, users=users, ranks=ranks)
    # per-example norms and clipping at c_i: the mode's wrapper, reading the clip norms of the drawn rows
    clipping = PerExampleClipping(c, queue) if users is None else UserClipping(c, queue, users)
    wrapped = wrap_module(
        module, opts.grad_sample_mode, clipping, opts.batch_first, opts.loss_reduction, opts.wrap_model
    )
    try:
        wrapped.forbid_grad_accumulation()
        if sharded:  # bk: every unit book-kept; ghost: the sharded ghost wrapper (engine/distributed/fsdp.py)
            wrapped = fsdp.check_wrapped(wrapped, opts.grad_sample_mode)
        # sharded: every rank runs forward/backward (FSDP2's collectives): a phantom row for an empty draw
        phantom = fsdp.phantom_collate(opts.batch_first) if sharded else None
        loader = PrivateDataLoader(data_loader, sampler, opts.batch_first, phantom)
        # noise σ·c and the division by Σ q_i: the mode's noisy optimizer
        base = optimizer.original_optimizer if hasattr(optimizer, "original_optimizer") else optimizer
        mode = opts.mode
        dp_opt = (
            mode.optimizer if ranks is None else mode.sharded_optimizer if sharded else mode.distributed_optimizer
        )(
            base,
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=plan.max_grad_norm,
            clipping=clipping,
            expected_batch_size=plan.expected_batch_size if ranks is None else plan.expected_batch_size / ranks[1],
            loss_reduction=opts.loss_reduction,
            generator=noise,
            secure_mode=secure_mode,
            checked=True,  # σ, c and the normaliser: by the check stage (engine/checks.py)
        )
        if mode.book_keeping:  # the clipped sum comes from the model's keeper; at user level, per user
            dp_opt.use_keeper(wrapped.keeper)
            wrapped.keeper.set_user_level(BookKeepingUsers(clipping) if users is not None else None)
    except BaseException:  # a wrapper made here leaves no hooks on the user's module (a complete rollback)
        if wrapped is not module:
            wrapped.remove_hooks()
        raise
    return BuiltStep(clipping, wrapped, dp_opt, loader)


__all__ = ["BuiltStep", "build_step"]
