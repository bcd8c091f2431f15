"""Sharded IDP-SGD on PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, DTensor parameters).

Boenisch et al. 2023, Alg. 3 with the book-keeping clipped sum (Bu et al. 2023, Alg. 1), run by W
ranks that each hold 1/W of every parameter (its ``Shard(0)`` chunk), with the mechanism — and so
the accounting — of one process.  API: :func:`is_sharded` (a ``fully_shard`` model?); :func:`check`
(``make_private``'s refusals, no change), :func:`prepare` (the build stage's changes to the model);
:func:`phantom_collate` (an empty draw becomes a zero-weight row: every rank runs FSDP2's collectives);
:class:`ShardedBookKeepingOptimizer` (bk's ``sharded_optimizer`` in :mod:`..modes`); :func:`reduce_scatter_sums`,
:func:`noise_shard`, :func:`shard_rows`; :func:`local_shard` (a DTensor's local tensor: what the write guard
watches on each rank).

Ghost clipping (``grad_sample_mode="ghost"``, Opacus's two backward passes) is served too:
:func:`check_wrapped` makes the engine's ghost wrapper a :class:`ShardedGhostModule` (full norms of
each rank's own examples in the first pass, the verdict shared before the second), :func:`sum_reduction`
sets FSDP2's own reduce-scatter of the second pass's clipped sums to a SUM, and
:class:`ShardedGhostOptimizer` (ghost's ``sharded_optimizer``) takes those shards and adds the same noise,
verdicts and normalisation as the book-keeping optimizer.  What follows describes bk.

* **norms** — FSDP2 is data parallel: each rank runs forward/backward on its own examples with the
  all-gathered (unsharded) parameters, so the book-keeper sees whole activations and output
  gradients and forms each of its examples' *full* norm ‖g_i‖ locally: no partial-norm all-reduce.
* **clipped sum** — Σ_{i on rank r} w_i g_i (full shape, w_i = min(1, c_i/‖g_i‖)) is reduce-scattered
  (SUM, bucketed) into the Shard(0) chunks: our collective, not FSDP2's (bk leaves the unsharded
  parameters without autograd gradients, so FSDP2 reduces nothing; a gradient it does reduce — a
  parameter used outside the book-kept layers — refuses the step), so nothing is reduced twice.
* **noise** — exactly one N(0, σ²c²I) over the full vector, see :func:`noise_shard` (proof there).
* **normalisation** — (Σ_i clipped g_i + noise) / Σ_i q_i, as in one process; refusals are shared
  before the step's collectives (every rank refuses together).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from ...validation import InvalidParameterError
from .. import distributed
from ..guards.decomposition import DecompositionCheck, rtol
from ..guards.integrity import local_tensor
from ..noise.optimizer import IndividualizedDPOptimizerBookKeeping, IndividualizedDPOptimizerFastGradientClipping
from ..noise.randomness import OsEntropyNormal, gaussian_like
from ..per_example.ghost import IndividualizedGhostModule
from . import DistributedTrainingError


class ShardedTrainingError(DistributedTrainingError):
    """A rank of a sharded (FSDP2) run refused a step; every rank refuses it together."""


# --- the model --------------------------------------------------------------------------------
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_dtensor(t) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


#: this rank's local tensor of a DTensor (the tensor object itself), ``t`` otherwise
local_shard = local_tensor


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or a module inside it) was wrapped with ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _check_parameters(module: torch.nn.Module) -> None:
    from torch.distributed.tensor import Shard

    for name, p in module.named_parameters():
        if not is_dtensor(p):
            raise InvalidParameterError(
                "module",
                f"parameter {name!r}",
                "is not sharded by fully_shard while other parameters are: a model only partly wrapped is "
                "refused (its replicated parameters would be summed over the ranks without a reduction); call "
                "fully_shard on the root module too (after the blocks), as FSDP2's examples do",
            )
        mesh = p.device_mesh
        if mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise InvalidParameterError(
                "module",
                f"parameter {name!r} placed {tuple(p.placements)} on a {mesh.ndim}-D mesh",
                "sharded training supports a 1-D device mesh with Shard(0) placements (fully_shard's default); "
                "HSDP (2-D meshes) and shard_placement_fn are not supported",
            )
        if mesh.size() != dist.get_world_size():
            raise InvalidParameterError(
                "module",
                f"a device mesh of {mesh.size()} ranks",
                f"must span the whole process group ({dist.get_world_size()} ranks): the Poisson sampling "
                "shards the data over every rank",
            )


def _check_cpu_streams(module: torch.nn.Module) -> None:
    """FSDP2 on a CPU device mesh records events on ``torch.cpu.Stream`` (``record_event``), which early torch
    releases lack (torch 2.6: FSDP2's first all-gather fails with an AttributeError): refused here, naming it."""
    if hasattr(torch.cpu.Stream, "record_event"):
        return
    if any(is_dtensor(p) and p.device_mesh.device_type == "cpu" for p in module.parameters()):
        raise InvalidParameterError(
            "module",
            "a fully_shard model on a CPU device mesh",
            f"needs torch.cpu.Stream.record_event, which torch {torch.__version__} lacks (FSDP2 on CPUs came in "
            "a later release): shard it on CUDA devices, use DPDDP (idpsgd.engine.distributed.wrap_model), or "
            "upgrade torch",
        )


def _check_ghost_layers(module: torch.nn.Module) -> None:
    """Ghost mode: refuse ``fully_shard`` on a module with trainable parameters of its own (a ``Linear``).
    FSDP2 makes its class a subclass (``FSDPLinear``) that Opacus's ghost hooks do not know by type; they
    would take it for an unknown layer and deep-copy it for functorch, which FSDP2 cannot do (``FSDP does
    not support deepcopy``).  Refused here, before the engine changes anything."""
    from torch.distributed.fsdp import FSDPModule

    own = [
        (name or "(root)", type(m).__mro__[2].__name__ if len(type(m).__mro__) > 2 else type(m).__name__)
        for name, m in module.named_modules()
        if isinstance(m, FSDPModule) and any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    if own:
        raise InvalidParameterError(
            "module",
            ", ".join(f"{n!r} ({kind})" for n, kind in own[:5]),
            "fully_shard on a layer with trainable parameters of its own is not supported with "
            "grad_sample_mode='ghost' (Opacus's ghost hooks cannot serve FSDP2's layer classes); call fully_shard "
            "on the blocks that contain such layers and on the root, or use grad_sample_mode='bk'",
        )


def check(engine, module: torch.nn.Module, record, privacy_filter, users=None) -> tuple[int, int]:
    """Checks of a ``fully_shard`` model for ``make_private``: ``(rank, W)``.  ``record``: the mode's
    :class:`~..modes.GradSampleMode`.  Reads the engine and the module, writes nothing: what changes the
    module (FSDP2's reduction settings, its lazy re-padding) is :func:`prepare`, in the build stage."""
    if not distributed.is_distributed():
        raise InvalidParameterError(
            "module",
            "a fully_shard model",
            "needs an initialised torch.distributed process group "
            "(torchrun, or idpsgd.engine.distributed.init_process_group / launch)",
        )
    if record.sharded_optimizer is None:
        raise InvalidParameterError(
            "grad_sample_mode",
            record.name,
            "a fully_shard (FSDP2) model trains with grad_sample_mode='bk' or 'ghost' only: hooks/functorch/ew/"
            "no_op materialise per-sample gradients of the unsharded parameters, which FSDP2 frees after each "
            "module's forward and backward",
        )
    if users is not None and record.name != "bk":
        raise InvalidParameterError(
            "users",
            repr(users),
            f"user-level privacy with a fully_shard model needs grad_sample_mode='bk' (not {record.name!r}): "
            "the sharded ghost wrapper forms per-row norms; a user's summed-gradient norm would need the "
            "user-level ghost capture on FSDP2's unsharded parameters",
        )
    if privacy_filter == "individual" or engine.individual is not None:
        raise InvalidParameterError(
            "privacy_filter" if privacy_filter == "individual" else "individual accounting",
            privacy_filter,
            "the individual filter and individual accounting are not supported with a fully_shard model yet: "
            "their per-example norm passes would need the same number of forward passes on every rank (FSDP2's "
            "all-gathers) and the norms all-gathered; use privacy_filter='group', or DPDDP "
            "(idpsgd.engine.distributed.wrap_model), where both run on several ranks",
        )
    _check_parameters(module)
    _check_cpu_streams(module)
    if record.name == "ghost":
        _check_ghost_layers(module)
        _check_sum_reduction(module)
    return distributed.rank_and_world()


def prepare(module: torch.nn.Module, record) -> None:
    """The build stage's changes to a checked ``fully_shard`` model (:func:`check`): ghost mode's SUM
    reduction (:func:`sum_reduction`), then the shards settled (:func:`settle_shards`)."""
    if record.name == "ghost":
        sum_reduction(module)
    settle_shards(module)


def _check_sum_reduction(module: torch.nn.Module) -> None:
    """Ghost mode needs FSDP2's two setters of :func:`sum_reduction` (torch >= 2.8) on every FSDP module."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule) and not (
            hasattr(m, "set_gradient_divide_factor") and hasattr(m, "set_force_sum_reduction_for_comms")
        ):
            raise InvalidParameterError(
                "grad_sample_mode",
                "ghost",
                "with fully_shard needs FSDPModule.set_gradient_divide_factor and "
                "set_force_sum_reduction_for_comms (torch >= 2.8) to reduce the clipped sums by SUM; "
                "use grad_sample_mode='bk'",
            )


def sum_reduction(module: torch.nn.Module) -> None:
    """Ghost mode: FSDP2 reduce-scatters the second backward pass's gradients (the clipped sums); it
    averages over the ranks by default (ReduceOp.AVG, or a SUM then a division by W).  Set here to a plain
    SUM (divide factor 1, sum-type collectives), so that each rank's shard holds Σ_ranks Σ_i w_i g_i
    exactly, as in one process; the optimizer divides by Σ_i q_i.  (Checked by :func:`check` first.)"""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def settle_shards(module: torch.nn.Module) -> None:
    """FSDP2 re-pads unevenly sharded parameters, replacing their local tensors, at its lazy
    initialisation (the first forward, otherwise): done here, by one public ``unshard()`` /
    ``reshard()`` of each FSDP module (the same order on every rank), so that the write guard's
    snapshot of the local shards (:mod:`..guards.integrity`) is taken of the tensors the training writes."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.unshard()
            m.reshard()


class PhantomCollate:
    """A rank whose share of the Poisson draw is empty must still run the forward and backward pass:
    FSDP2 all-gathers each block's parameters in them, and the other ranks wait for every rank.
    Many models cannot run on zero rows (Hugging Face transformers reshape by ``-1``), so an empty
    batch becomes one *phantom* row of zeros (the structure and trailing shapes of the empty batch,
    which :class:`~..sampling.sampler.EmptyBatchCollate` gives; no example's values).  The optimizer gives it
    no weight: a step whose drawn batch is empty on this rank adds a zero clipped sum, as a
    noise-only step (:meth:`ShardedBookKeepingOptimizer.accumulate`); nothing of the phantom row
    reaches the update, and the accounting counts the drawn examples only."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, batch):
        out = self.collate_fn(batch)
        return out if len(batch) else _phantom(out)


def _phantom(sample):
    from torch.utils._pytree import tree_map

    def one(t):
        if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == 0:
            return t.new_zeros((1, *tuple(t.shape[1:])))
        return t

    return tree_map(one, sample)


def mark_phantom_pass(clipping) -> None:
    """The coming backward pass runs on a phantom row although this rank's share of the step is not
    empty (one of the equal number of passes every rank runs, e.g. the Trainer's
    ``gradient_accumulation_steps`` parts of a share smaller than their number): it gets no weight and
    consumes no drawn example, as a pass of an empty share (:func:`phantom_pass`)."""
    clipping.mark_phantom_pass()


def phantom_pass(clipping, consume: bool = False) -> bool:
    """Whether the current pass is a phantom row's: this rank's drawn share is empty, or
    :func:`mark_phantom_pass` marked it (``consume``: the mark is forgotten, at the pass's clipping)."""
    return clipping.phantom_marked(consume) or clipping.queue.empty_batch_pending


def phantom_collate(batch_first: bool) -> type[PhantomCollate]:
    """The private loader's collate wrapper with a fully_shard model: a phantom row for an empty draw
    (:class:`PhantomCollate`); batch-first inputs only."""
    if not batch_first:
        raise InvalidParameterError(
            "batch_first", batch_first, "a fully_shard model needs batch-first inputs (batch_first=True)"
        )
    return PhantomCollate


def check_wrapped(wrapped, grad_sample_mode: str):
    """The engine's wrapper of a ``fully_shard`` model, checked (bk: :func:`check_keeper`) or made
    sharded (ghost: :class:`ShardedGhostModule`)."""
    if grad_sample_mode == "bk":
        check_keeper(wrapped.keeper)
    elif grad_sample_mode == "ghost":
        if type(wrapped) not in (IndividualizedGhostModule, ShardedGhostModule):
            raise InvalidParameterError(
                "module", type(wrapped).__name__, "a fully_shard model in ghost mode needs the engine's ghost wrapper"
            )
        if wrapped.clipping is not None and not wrapped.use_ghost_clipping:  # user level (UserClipping)
            raise InvalidParameterError("users", "given", "user-level privacy is not supported with fully_shard")
        if type(wrapped) is not ShardedGhostModule:  # (adds methods only: no state of its own to initialise)
            wrapped.remove_hooks()  # Opacus's hooks are bound methods: re-registered as the sharded module's
            wrapped.__class__ = ShardedGhostModule
            wrapped.add_hooks(
                loss_reduction=wrapped.loss_reduction,
                batch_first=wrapped.batch_first,
                force_functorch=wrapped.force_functorch,
            )
    return wrapped


def check_keeper(keeper) -> None:
    """Refuse the book-keeper's units that FSDP2 cannot serve (they read the registered — sharded —
    parameters in their own per-sample passes)."""
    units = [*keeper.units, *keeper.direct]
    if units:
        raise InvalidParameterError(
            "module",
            ", ".join(f"{u.name!r} ({type(u.module).__name__})" for u in units[:5]),
            "layers no book-keeping rule covers (fallback or direct units) are not supported with fully_shard: "
            "their per-sample gradients are formed from the registered parameters, which are sharded",
        )


# --- shards ------------------------------------------------------------------------------------
def shard_rows(p: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of this rank's Shard(0) chunk of ``p``: ``torch.chunk`` of dim 0 into W
    chunks of ⌈n/W⌉ rows (the last ones shorter or empty), FSDP2's and DTensor's layout."""
    rank, world = p.device_mesh.get_local_rank(), p.device_mesh.size()
    n = int(p.shape[0])
    size = -(-n // world)
    start = min(rank * size, n)
    return start, min(size, n - start)


#: the number of gradient entries per reduce-scatter (a bucket, 2²⁴: 64 MiB of float32; a larger parameter alone)
BUCKET_ENTRIES = 1 << 24


def reduce_scatter_sum(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's Shard(0) chunk of Σ_ranks ``full`` (every rank passes a tensor of ``p``'s full shape)."""
    return reduce_scatter_sums([(p, full)])[0]


def reduce_scatter_sums(pairs) -> list[torch.Tensor]:
    """This rank's Shard(0) chunk of Σ_ranks ``full`` for each (p, full) of ``pairs`` (the same
    parameters, in the same order, on every rank): a SUM ``reduce_scatter_tensor`` per bucket of
    parameters of one dtype, each parameter's rows padded to W·⌈n/W⌉ (FSDP2's padded layout), so
    rank r receives the rows of its chunk of every parameter of the bucket in one collective.
    ``pairs`` (a list) is consumed: each ``full`` in it is released (replaced by None) once copied into
    its bucket, so the transient memory is the full-size sums not yet sent plus one bucket."""
    out: list = [None] * len(pairs)
    bucket: list[int] = []
    size = 0
    for i, (_p, full) in enumerate(pairs):
        if bucket and (size + full.numel() > BUCKET_ENTRIES or full.dtype != pairs[bucket[0]][1].dtype):
            _flush(pairs, bucket, out)
            bucket, size = [], 0
        bucket.append(i)
        size += full.numel()
    if bucket:
        _flush(pairs, bucket, out)
    return out


def _flush(pairs: list, bucket: list[int], out: list) -> None:
    first, ref = pairs[bucket[0]]
    world, group = first.device_mesh.size(), first.device_mesh.get_group()
    layout = []  # (index, rows per chunk, entries per row)
    for i in bucket:
        p, full = pairs[i]
        row = full[0].numel() if full.dim() else 1
        layout.append((i, -(-int(full.shape[0] if full.dim() else 1) // world), row))
    width = sum(rows * row for _, rows, row in layout)
    send = ref.new_zeros((world, width))
    at = 0
    for i, rows, row in layout:
        p, full = pairs[i]
        flat, span = full.reshape(-1), rows * row
        piece = send[:, at : at + span]  # row r: rank r's chunk of this parameter (zeros past its end)
        whole = flat.numel() // span
        piece[:whole] = flat[: whole * span].view(whole, span)
        if flat.numel() > whole * span:
            piece[whole, : flat.numel() - whole * span] = flat[whole * span :]
        pairs[i] = (p, None)  # the full-size sum is released here
        at += span
    recv = ref.new_empty(width)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (torch < 2.13)
    reduce_scatter(recv, send.reshape(-1), op=dist.ReduceOp.SUM, group=group)
    del send
    at = 0
    for i, rows, row in layout:
        p = pairs[i][0]
        _start, mine = shard_rows(p)
        out[i] = recv[at : at + mine * row].view((mine, *tuple(p.shape[1:])))
        at += rows * row


def noise_shard(std: float, p: torch.Tensor, local: torch.Tensor, generator, secure_mode: bool) -> torch.Tensor:
    """This rank's Shard(0) chunk of the step's noise for parameter ``p`` (``local``: its chunk's shape).

    Exactly one N(0, σ²c²I) over the full vector, each entry noised once:

    * reproducible mode — every rank holds the same seeded generator (rank 0's seed, broadcast) and
      draws, parameter by parameter in the optimizer's order, the *full-shape* noise the
      one-process optimizer draws (same generator state, shape, dtype and device: the same values),
      then keeps rows [start, start + rows) of its chunk.  The chunks of the W ranks partition the
      rows 0..n−1 (:func:`shard_rows`: disjoint, covering), so the union of the kept noise is the
      one full draw N_full — identical to the one-process noise, whatever W, and no entry is kept
      twice or left out.  All ranks advance their generators identically, so this holds at every
      step.  Cost: each rank generates the full noise of each parameter, transiently (one
      parameter at a time; W× the noise generation of a sharded draw, none of it communicated).
    * secure mode — each rank draws its own chunk from OS entropy (:class:`~..noise.randomness.OsEntropyNormal`):
      independent Gaussian entries on disjoint chunks that cover the vector, so again one
      N(0, σ²c²I) over the full vector (not reproducible, by design)."""
    if secure_mode or isinstance(generator, OsEntropyNormal):
        return gaussian_like(std, local, generator, secure_mode)
    reference = torch.empty(tuple(p.shape), dtype=local.dtype, device=local.device)
    start, rows = shard_rows(p)
    return gaussian_like(std, reference, generator, secure_mode)[start : start + rows]


def as_sharded(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's chunk) as a DTensor laid out as ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


# --- the book-keeper after the backward pass ----------------------------------------------------
class UnshardedParameters:
    """The covered layers' unsharded parameter tensors, recorded in their forwards (FSDP2 swaps them
    in while a module runs, and frees their storage — keeping the tensor objects — when it reshards).

    The book-keeper forms norms and clipped sums after the backward pass, when the modules hold their
    sharded DTensor parameters again; its rules read a weight's shape, dtype and device there
    (``zeros_like(module.weight)``).  :meth:`swapped` puts the recorded unsharded tensors back for that
    time: the full shapes and the dtype FSDP2's ``MixedPrecisionPolicy`` computed in, no memory
    (their storage stays freed), and a rule that would read a weight's *values* there fails loudly
    instead of reading a shard."""

    def __init__(self, keeper):
        self.seen: dict = {}
        self.handles = [layer.module.register_forward_hook(self._record) for layer in keeper.layers]

    def _record(self, module, _args, _out):  # at every forward: FSDP2 may make new ones (load_state_dict)
        params = {n: p for n, p in module._parameters.items() if p is not None and not is_dtensor(p)}
        if params:
            self.seen[module] = params

    @contextlib.contextmanager
    def swapped(self):
        saved = []
        try:
            for module, params in self.seen.items():
                saved.append((module, {n: module._parameters[n] for n in params}))
                module._parameters.update(params)
            yield
        finally:
            for module, params in saved:
                module._parameters.update(params)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# --- ghost clipping ------------------------------------------------------------------------------
class ShardedGhostModule(IndividualizedGhostModule):
    """Opacus's ghost clipping (two backward passes, ``DPLossFastGradientClipping``) on a ``fully_shard`` model.

    * **norms** — the first backward pass's hooks run while FSDP2 has a block's unsharded parameters
      swapped in: each rank forms the *full* norms of its own examples, stored on the unsharded
      parameter tensors (FSDP2 keeps those objects; only their storage is freed when it reshards).
      The parameters whose hooks ran in this pass are recorded; :meth:`get_norm_sample` reads their
      norms and refuses unless every trainable parameter was seen (a stale norm of an earlier pass is
      never read).
    * **first pass's gradients** — FSDP2 reduce-scatters them (un-clipped) into ``p.grad``;
      ``DPTensorFastGradientClipping.backward`` then calls the optimizer's ``zero_grad`` before the
      second pass, which discards them exactly (the second pass's sums are written to zeroed or fresh
      gradients).  On the decomposition check's steps they are first compared with the layers' own
      sums (:class:`ShardedDecompositionCheck`).
    * **clip factors** — min(1, c_i/‖g_i‖) with each example's own c_i
      (:class:`~..clipping.examples.PerExampleClipping`);
      a phantom row (an empty draw, :class:`PhantomCollate`) gets factor 0 and the step pops no index,
      as an empty batch in one process.  The verdict (factors formed, or refused) is shared by one
      all-reduce before the second pass, so that a refusal on one rank stops every rank (FSDP2's
      second-pass collectives would otherwise wait for it).
    * **clipped sum** — the second pass of Σ_i w_i·loss_i: FSDP2 reduce-scatters Σ_ranks Σ_i w_i g_i
      into the Shard(0) gradients with a SUM (:func:`sum_reduction`)."""

    output_hooks = False  # Opacus's full backward hooks: they run while FSDP2 has the unsharded parameters in

    def capture_activations_hook(self, module, forward_input, _forward_output):
        from opacus.utils.module_utils import trainable_parameters

        for _, p in trainable_parameters(module):  # FSDP2's unsharded tensors: Opacus set the counter on the shards
            if not hasattr(p, "_forward_counter"):  # (as GradSampleModule's __init__ does)
                p._forward_counter, p.grad_sample = 0, None
        return super().capture_activations_hook(module, forward_input, _forward_output)

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction, batch_first):
        if self.hooks_enabled:
            from opacus.utils.module_utils import trainable_parameters

            seen = self.__dict__.setdefault("_sharded_seen", {})
            for _, p in trainable_parameters(module):  # FSDP2's unsharded tensors (swapped in for the backward)
                seen[id(p)] = p
        return super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)

    def get_norm_sample(self) -> torch.Tensor:
        seen = list(self.__dict__.pop("_sharded_seen", {}).values())
        if len(seen) != len(self.trainable_parameters) or any(getattr(p, "_norm_sample", None) is None for p in seen):
            raise RuntimeError(
                f"the ghost-norm hooks saw {len(seen)} of the {len(self.trainable_parameters)} trainable parameters in "
                "the first backward pass (a parameter unused by this batch, used outside its module's forward, or "
                "shared by two modules): the per-example norms would miss its gradient; the step was not taken"
            )
        norms = [p._norm_sample.to(seen[0]._norm_sample.device) for p in seen]
        for p in seen:
            p._norm_sample = None
        norm = torch.stack(norms, dim=0).norm(2, dim=0)
        self.per_sample_gradient_norms = norm
        return norm

    def _check_reduced(self) -> None:
        """The first pass's gradients must have been reduce-scattered (and so discarded by the optimizer's
        ``zero_grad``): with ``set_requires_gradient_sync(False)`` FSDP2 keeps them, un-clipped, on the
        unsharded parameters and would add them to the second pass's clipped sums."""
        from torch.distributed.fsdp import FSDPModule

        for m in self._module.modules():
            if not isinstance(m, FSDPModule):
                continue
            for group in _param_groups(m, "to check that the first pass was reduced"):
                kept = [
                    fp
                    for fp in group.fsdp_params
                    if getattr(fp, "unsharded_accumulated_grad", None) is not None
                    or (hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None)
                ]
                if not group.reduce_grads or kept:
                    raise RuntimeError(
                        "FSDP2 kept the first backward pass's un-clipped gradients (set_requires_gradient_sync(False), "
                        "or gradients accumulated across passes): ghost clipping would add them to the clipped sums; "
                        "keep gradient sync on with grad_sample_mode='ghost'; the step was not taken"
                    )

    def get_clipping_coef(self) -> torch.Tensor:
        refusal, coef = None, None
        try:
            self._check_reduced()
            if self.clipping is not None and phantom_pass(self.clipping):
                norms = self.get_norm_sample()  # the phantom row's: read (and forgotten), no weight
                self.clipping.factors(norms.new_zeros((0,)))  # the empty draw: no example, as in one process
                coef = torch.zeros_like(norms)
            else:
                coef = super().get_clipping_coef()
        except Exception as exc:
            refusal = exc
        share_verdict(refusal, self.trainable_parameters)
        return coef


def share_verdict(refusal: Exception | None, params) -> None:
    """One all-reduce of every rank's verdict; raises on every rank if any rank refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = local_shard(params[0]).device if params and dist.get_backend() == "nccl" else torch.device("cpu")
    flags = torch.zeros(world, dtype=torch.int64, device=dev)
    flags[rank] = 0 if refusal is None else 1
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    codes = flags.tolist()
    if not any(codes):
        return
    reasons: list = [None] * world
    dist.all_gather_object(reasons, None if refusal is None else f"{type(refusal).__name__}: {refusal}")
    if refusal is not None:
        raise refusal
    where = next(r for r, c in enumerate(codes) if c)
    raise ShardedTrainingError(
        f"the step was refused on rank {where} of {world} ({reasons[where]}); every rank refuses it together "
        f"(this is rank {rank})"
    )


# --- ghost: the decomposition check on shards ---------------------------------------------------
def _param_groups(module: torch.nn.Module, why: str) -> list:
    """The FSDP2 parameter groups of one ``fully_shard``-ed module: ``_fsdp_param_groups`` (torch ≥ 2.12, a
    list) or ``_fsdp_param_group`` (earlier releases, one group or None). Any other layout is refused with
    ``why`` (what the groups are read for), never read as "no groups"."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if isinstance(groups, list):
        return groups
    if "_fsdp_param_group" in vars(state):
        group = vars(state)["_fsdp_param_group"]
        return [] if group is None else [group]
    raise RuntimeError(f"torch {torch.__version__}: cannot read FSDP2's parameter groups {why}")


def unsharded_parameters(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """id(registered, sharded parameter) → FSDP2's unsharded tensor of it (the one its modules hold while
    they run, and Opacus's ghost hooks see: their layer sums and ``_norm_sample`` are keyed by it)."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, torch.Tensor] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in _param_groups(m, "to find the unsharded parameters"):
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        found[id(fp.sharded_param)] = unsharded
    return found


class ShardedDecompositionCheck(DecompositionCheck):
    """The ghost decomposition check (:mod:`..guards.decomposition`) on a ``fully_shard`` model.

    In the first backward pass each rank forms, per parameter, its own examples' layer sum Σ_{i on r} a_iᵀ b_i
    (full size: FSDP2's unsharded parameters) and their norms; FSDP2 reduce-scatters autograd's gradient of the
    pass by SUM (:func:`sum_reduction` sets divide factor 1 for every reduce-scatter, the first pass's too), so
    ``p.grad``'s local shard holds rows :func:`shard_rows` of G = Σ_ranks Σ_{i on r} g_i.  At the
    ``zero_grad`` between the passes (every rank, same order) the layer sums are reduce-scattered by SUM into
    the same Shard(0) chunks (:func:`reduce_scatter_sums`), each rank takes ‖chunk − shard‖² per parameter,
    and one all-reduce sums those and the ranks' Σ_i ‖g_i‖: every rank then holds ‖Σ_i g_i − G‖ over the
    whole vector and the scale over every rank's examples (a phantom row's on both sides, so it cancels),
    and compares them with the tolerance of one process — the same verdict on every rank, raised by each
    rank's step guard before the noise (and shared by the optimizer's verdict all-reduce in any case).
    ``module``: the ``fully_shard`` model (FSDP2's parameter groups map shards to unsharded tensors)."""

    def __init__(self, names: dict[int, str], module: torch.nn.Module, every_step: bool = False):
        super().__init__(names, every_step)
        self.module = module

    def close_pass(self, params) -> None:
        if not self._open:
            return
        if not self._sums:  # zero_grad between the forward and the backward pass (on every rank alike)
            self._before = {}
            return
        self._open, n = False, self._n
        sums, before = self._sums, self._before
        self._sums, self._before = {}, {}
        device = next(iter(sums.values()))[0].device  # the compute device (FSDP2 may offload the shards)
        unsharded = unsharded_parameters(self.module)
        pairs, dtypes, per_example = [], [], []
        for p in params:  # the same parameters, in the same order, on every rank (collectives below)
            full = unsharded.get(id(p))
            s, dtype = sums.get(full, (None, p.dtype)) if full is not None else (None, p.dtype)
            acc = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype  # every rank alike
            s = torch.zeros(tuple(p.shape), dtype=acc, device=device) if s is None else s.detach().to(acc)
            pairs.append((p, s))
            dtypes.append(dtype)
            norms = getattr(full, "_norm_sample", None)
            if norms is not None and norms.numel():
                per_example.append(norms.float().to(device) / n)
        chunks = reduce_scatter_sums(pairs)  # this rank's rows of Σ_ranks of the layer sums
        squares, tols = [], []
        for p, chunk, dtype in zip(params, chunks, dtypes, strict=True):
            grad = torch.zeros_like(chunk) if p.grad is None else local_shard(p.grad).detach().to(device)
            if p in before:
                grad = grad - before[p].to(device)
            diff = (chunk.double() - grad.double().reshape(chunk.shape)).square().sum()
            squares.append(diff)
            tols.append((rtol(dtype, p.dtype if p.grad is None else p.grad.dtype), chunk.dtype))
        if per_example and len({len(x) for x in per_example}) == 1:
            total = torch.stack(per_example).norm(dim=0).sum()
        else:  # (rows differ between parameters: the sum of the parameters' sums, an upper bound)
            total = torch.stack([x.sum() for x in per_example]).sum() if per_example else torch.zeros((), device=device)
        reduced = torch.stack([total.double(), *squares])
        on = reduced.device if dist.get_backend() == "nccl" else torch.device("cpu")
        reduced = reduced.to(on)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        scale, *squares = reduced.tolist()
        if self.mismatch is None:
            self.verdict(list(params), [math.sqrt(x) for x in squares], tols, scale)  # (nan stays nan: refused)


# --- the optimizer ----------------------------------------------------------------------------
def refuse_physical_batches(optimizer) -> None:
    """Refuse BatchMemoryManager's physical batches on a ``fully_shard`` model (the step is dropped first),
    unless the caller runs the same number of passes on every rank (``optimizer.declare_equal_passes()``: the
    Trainer's ``gradient_accumulation_steps`` parts, an empty part a phantom row, :func:`mark_phantom_pass`)."""
    if getattr(optimizer, "equal_passes", False):
        return
    optimizer.clipping.queue.clear()
    optimizer.refuse_step()
    raise InvalidParameterError(
        "optimizer",
        "BatchMemoryManager (physical batches)",
        "is not supported with a fully_shard model: the ranks' Poisson shares differ in size, so they would "
        "run different numbers of physical batches while FSDP2's collectives need every rank in each "
        "forward and backward pass; give each rank a batch that fits (fewer examples per step, more ranks), "
        "or run the same number of passes on every rank (an empty part as a phantom row, "
        "idpsgd.engine.distributed.fsdp.mark_phantom_pass) and call optimizer.declare_equal_passes(), as the Trainer's "
        "gradient_accumulation_steps do",
    )


class _EqualPasses:
    """Whether the caller runs the same number of forward and backward passes per step on every rank (an empty
    part as a phantom row, :func:`mark_phantom_pass`; the Trainer's ``gradient_accumulation_steps``), so that
    physical batches are allowed (:func:`refuse_physical_batches`)."""

    equal_passes = False

    def declare_equal_passes(self) -> None:
        self.equal_passes = True


class ShardedBookKeepingOptimizer(_EqualPasses, IndividualizedDPOptimizerBookKeeping):
    """Book-keeping clipping for a ``fully_shard`` model.  ``expected_batch_size`` is the per-rank
    Σ_i q_i / W (as for DPDDP); the update is (Σ_i w_i g_i + noise) / Σ_i q_i, as in one process.

    ``p.summed_grad`` holds this rank's chunk (a plain tensor); ``p.grad`` is set to a DTensor
    laid out as ``p`` (the wrapped optimizer steps on the shards)."""

    last_global_batch_size: int | None = None
    unsharded: UnshardedParameters | None = None

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def use_keeper(self, keeper) -> None:
        """As the book-keeping optimizer's, with the keeper's rules reading FSDP2's unsharded parameters
        after the backward pass (:class:`UnshardedParameters`)."""
        if self.unsharded is not None:
            self.unsharded.remove()
        super().use_keeper(keeper)
        self.unsharded = UnshardedParameters(keeper) if keeper is not None else None
        if keeper is not None:
            keeper.view_parameters_with(self.unsharded.swapped)

    def signal_skip_step(self, do_skip=True):
        if do_skip:  # BatchMemoryManager splits a drawn batch into physical ones
            refuse_physical_batches(self)
        return super().signal_skip_step(do_skip)

    def accumulate(self):
        keeper = self.keeper
        refusal, sums = None, {}
        try:
            # bk leaves the unsharded parameters without autograd gradients, so FSDP2 reduce-scatters none; a
            # non-zero one is a parameter used outside the book-kept layers (the keeper's own leak hook watches
            # the registered, sharded, parameter, which FSDP2's forward does not use).  (A zero .grad is the
            # keeper's GradScaler marker, or nothing: discarded as in one process.)
            leaked = [p for p in self.params if p.grad is not None and bool(local_shard(p.grad).any())]
            if leaked:
                names = {id(p): n for n, p in keeper.model.named_parameters()}
                shown = ", ".join(repr(names.get(id(p), "?")) for p in leaked[:5])
                raise RuntimeError(
                    f"parameter(s) {shown} received an autograd gradient through FSDP2 "
                    "(used outside the book-kept layers' forwards: a functional call on a layer's weight, "
                    "or a layer no rule covers): it would not be clipped per example; the step was not taken"
                )
            if not phantom_pass(self.clipping, consume=True):
                norms = keeper.norms(self._loss_scale)
                sums = keeper.clipped_sum(self.clipping.factors(norms), self._loss_scale)
            # else: this rank's draw is empty: its backward pass (if any) ran on a phantom row
            # (PhantomCollate), which gets no weight: a zero clipped sum, as a noise-only step
        except Exception as exc:
            refusal = exc
        finally:
            keeper.clear()
        self._share_verdict(refusal)
        pairs = []
        for p in self.params:  # the same order on every rank
            local = local_shard(p)
            g = sums.pop(p, None)
            g = torch.zeros(tuple(p.shape), dtype=local.dtype, device=local.device) if g is None else g
            pairs.append((p, g.to(local.dtype)))
            del g
        del sums
        chunks = reduce_scatter_sums(pairs)  # (empties pairs: each full-size sum freed once sent)
        for p, chunk in zip(self.params, chunks, strict=True):
            p.grad = None
            if p.summed_grad is not None:
                p.summed_grad.add_(chunk)
            else:
                p.summed_grad = chunk

    def add_noise(self):
        refusal = None
        try:
            self._admit_step()
        except Exception as exc:
            refusal = exc
        self._share_verdict(refusal, count=True)
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            local = p.summed_grad
            p.grad = as_sharded(local + noise_shard(std, p, local, self.generator, self.secure_mode), p)
            _mark_as_processed(p.summed_grad)
        self._noised = True

    def scale_grad(self):
        if self.loss_reduction == "mean":  # Σq/W per rank, times W: Σ q_i
            for p in self.params:
                p.grad /= self.expected_batch_size * self.world_size * self.accumulated_iterations

    def _share_verdict(self, refusal: Exception | None, count: bool = False) -> None:
        """One all-reduce of every rank's verdict (and, with ``count``, its batch size) before any
        collective of the step's gradients or noise: a step refused on one rank is refused on all."""
        dev = local_shard(self.params[0]).device if self.params else torch.device("cpu")
        dev = dev if dist.get_backend() == "nccl" else torch.device("cpu")
        flags = torch.zeros(self.world_size + 1, dtype=torch.int64, device=dev)
        flags[self.rank] = distributed.refusal_code(refusal)
        if count and refusal is None:
            flags[-1] = sum(int(t.numel()) for t in self.clipping.pending_indices)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        codes = flags[:-1].tolist()
        if not any(codes):
            if count:
                self.last_global_batch_size = int(flags[-1])
            return
        distributed.raise_shared_refusal(self, codes, refusal, "its shard holds it", ShardedTrainingError)


class ShardedGhostOptimizer(_EqualPasses, IndividualizedDPOptimizerFastGradientClipping):
    """Ghost clipping for a ``fully_shard`` model (:class:`ShardedGhostModule`): after the second backward
    pass ``p.grad`` holds this rank's Shard(0) chunk of Σ_ranks Σ_i w_i g_i (FSDP2's SUM reduce-scatter,
    :func:`sum_reduction`); it becomes ``p.summed_grad`` (a plain tensor), and the noise, the shared
    verdicts and the division by Σ_i q_i are the book-keeping optimizer's (:class:`ShardedBookKeepingOptimizer`):
    one N(0, σ²c²I) over the full vector, each rank keeping its chunk of the one-process draw."""

    last_global_batch_size: int | None = None

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def signal_skip_step(self, do_skip=True):
        if do_skip:  # BatchMemoryManager splits a drawn batch into physical ones
            refuse_physical_batches(self)
        return super().signal_skip_step(do_skip)

    def accumulate(self):
        phantom_pass(self.clipping, consume=True)  # (the module gave a phantom pass factor 0: its sum is zero)
        for p in self.params:  # the same order on every rank; no collective (FSDP2 reduced the clipped sums)
            local = local_shard(p)
            g = local_shard(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(local)
            p.grad = None
            if p.summed_grad is not None:
                p.summed_grad.add_(g.to(p.summed_grad.dtype))
            else:
                p.summed_grad = g.to(local.dtype)

    add_noise = ShardedBookKeepingOptimizer.add_noise
    scale_grad = ShardedBookKeepingOptimizer.scale_grad
    _share_verdict = ShardedBookKeepingOptimizer._share_verdict


__all__ = [
    "ShardedBookKeepingOptimizer",
    "ShardedDecompositionCheck",
    "ShardedGhostModule",
    "ShardedGhostOptimizer",
    "ShardedTrainingError",
    "as_sharded",
    "check_keeper",
    "check_wrapped",
    "is_dtensor",
    "is_sharded",
    "local_shard",
    "noise_shard",
    "reduce_scatter_sum",
    "refuse_physical_batches",
    "shard_rows",
    "unsharded_parameters",
]
