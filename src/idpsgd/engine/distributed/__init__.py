"""Distributed individualized DP-SGD on ``torch.distributed`` (data parallelism, Opacus's DPDDP path).

Boenisch et al. 2023, Alg. 1/3 run by W processes ("ranks") with exactly the mechanism, and so the
accounting, of one process: each rank Poisson-samples its shard
(:class:`~..sampling.sampler.PoissonBatchSampler`, :mod:`..sampling.rank_balance`) from the same seeded
stream, so the union is the single-process draw; each rank
clips its examples at c_i, the noise N(0, σ²c²) is added once on rank 0 and one all-reduce averages the
per-rank sums divided by Σ q_i / W; every rank keeps the same ledger; refusals are shared before any
noise.  :func:`check` checks a data-parallel module, :func:`shared_seeds` gives every rank rank 0's
seeds; :func:`launch` spawns the ranks with a timeout on every collective.  The mechanism in full and
how to run it: docs/distributed.md.
"""

from __future__ import annotations

import builtins
import datetime
import logging
import os
import socket
import tempfile
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.grad_sample import AbstractGradSampleModule
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.nn.parallel import DistributedDataParallel as DDP

from ...io import CheckpointError, load_torch, save_torch
from ...validation import InvalidParameterError, UnreachableTargetError, shown_value
from ..budget.accountant import PrivacyBudgetExceeded
from ..guards.integrity import UnnoisedWriteError
from ..noise.optimizer import (
    IndividualizedDPOptimizer,
    IndividualizedDPOptimizerBookKeeping,
    IndividualizedDPOptimizerFastGradientClipping,
)
from ..sampling.sampler import BatchMismatchError

DEFAULT_TIMEOUT_S = 600.0


class DistributedTrainingError(RuntimeError):
    """A rank of a distributed run failed (crashed, was killed, or timed out in a collective)."""


# --- the process group ------------------------------------------------------------------------
def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def is_main_process() -> bool:
    """True on rank 0 (and without a process group): the rank that writes files."""
    return rank_and_world()[0] == 0


def default_backend(device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """``torch.distributed.init_process_group`` from the ``env://`` variables (``torchrun`` sets them;
    :func:`launch` too) with a timeout on every collective: a rank that dies or hangs makes the
    others fail after at most ``timeout_s`` seconds instead of waiting forever."""
    if not timeout_s > 0:
        raise InvalidParameterError("timeout_s", timeout_s, "must be > 0 seconds")
    if is_distributed():
        return
    if backend == "nccl":  # NCCL collectives honour the timeout only with asynchronous error handling
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(local_device("cuda"))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=float(timeout_s)))


def local_device(device) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` for a CUDA device (one GPU per rank), else ``device``."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    local = int(os.environ.get("LOCAL_RANK", rank_and_world()[0]))
    if local >= torch.cuda.device_count():
        raise InvalidParameterError(
            "nproc", local + 1, f"needs one GPU per process; {torch.cuda.device_count()} visible here"
        )
    return torch.device("cuda", local)


# --- the model ------------------------------------------------------------------------------
def data_parallel_wrapper(module: torch.nn.Module):
    """The ``DPDDP`` / ``DistributedDataParallel`` inside Opacus's grad-sample wrappers, or None."""
    while isinstance(module, AbstractGradSampleModule):
        module = module._module
    return module if isinstance(module, (DPDDP, DDP)) else None


def wrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """``DPDDP(model)`` (rank 0's parameters broadcast to all ranks) when a process group is
    initialised, the model itself otherwise."""
    if not is_distributed() or data_parallel_wrapper(model) is not None:
        return model
    return DPDDP(model)


def check(engine, module: torch.nn.Module, record, privacy_filter) -> tuple[int, int] | None:
    """Checks of a data-parallel ``module`` for ``make_private``: ``(rank, W)``, or None for a plain
    module.  ``record``: the mode's :class:`~..modes.GradSampleMode`.  Reads the engine, writes nothing
    (the seeds every rank uses are :func:`shared_seeds`, in the build stage)."""
    wrapper = data_parallel_wrapper(module)
    if wrapper is None:
        return None
    name = type(wrapper).__name__
    if not is_distributed():
        raise InvalidParameterError(
            "module",
            name,
            "needs an initialised torch.distributed process group "
            "(torchrun, or idpsgd.engine.distributed.init_process_group / launch)",
        )
    if isinstance(wrapper, DDP):
        if not record.autograd_sum:
            raise InvalidParameterError(
                "module",
                name,
                f"with grad_sample_mode={record.name!r} is not supported "
                "(DDP all-reduces autograd's summed gradients, which ghost clipping forms twice "
                "and book-keeping never forms); wrap the model in "
                "opacus.distributed.DifferentiallyPrivateDistributedDataParallel instead",
            )
        if privacy_filter == "individual" or engine.individual is not None:
            raise InvalidParameterError(
                "module",
                name,
                "individual accounting and the individual filter need "
                "per-example norm passes without DDP's gradient all-reduce; wrap the model "
                "in opacus.distributed.DifferentiallyPrivateDistributedDataParallel",
            )
    return rank_and_world()


def shared_seeds(seeds):
    """Rank 0's seeds on every rank (a :class:`~..noise.randomness.RunSeeds` copy; one collective): a seed that
    follows torch is drawn now, from torch's global generator (and the data loader's), on every rank."""
    return seeds.with_values(*broadcast_object((seeds.draw(), seeds.draw_sampler())))


# --- the optimizer --------------------------------------------------------------------------
def refusal_code(refusal: Exception | None) -> int:
    """A rank's verdict as one integer for the all-reduce: 0 step, 1 un-noised write, 2 other refusal."""
    return 0 if refusal is None else (1 if isinstance(refusal, UnnoisedWriteError) else 2)


def raise_shared_refusal(optimizer, codes: list, refusal: Exception | None, holder: str, error) -> None:
    """After the ranks all-reduced their verdicts ``codes`` (:func:`refusal_code`, at least one not 0):
    gather the refusing ranks' messages, then raise on every rank — the own refusal where this rank
    refused, else ``error`` naming the refusing rank, or an :class:`UnnoisedWriteError` (marking the
    write guard) for a write found on another rank, whose copy of the parameters (``holder``) holds it."""
    rank_, world = optimizer.rank, optimizer.world_size
    reasons: list = [None] * world
    dist.all_gather_object(reasons, None if refusal is None else f"{type(refusal).__name__}: {refusal}")
    if refusal is not None:
        raise refusal
    optimizer.refuse_step()
    writes = [r for r, c in enumerate(codes) if c == 1]
    rank = writes[0] if writes else next(r for r, c in enumerate(codes) if c)
    where = f"rank {rank} of {world}"
    outcome = (
        "every rank refuses the step together: no noise was drawn and nothing was charged on any rank "
        f"(this is rank {rank_})"
    )
    if not writes:
        raise error(f"the step was refused on {where} ({reasons[rank]}); {outcome}")
    found = (
        f"an un-noised write was found on {where}: {holder}, so this run's model must not be released and "
        f"every later step is refused on every rank; train a fresh model ({reasons[rank]})"
    )
    if optimizer.write_guard is not None:
        optimizer.write_guard.mark(found)
    raise UnnoisedWriteError(f"{found}. {outcome}")


class _RankZeroNoise:
    """Noise on rank 0 only; one all-reduce of the flattened gradients (and the batch size) per step."""

    last_global_batch_size: int | None = None

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self._init_distributed()

    def _init_distributed(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def add_noise(self):
        refusal = None
        try:  # this rank's share of the drawn batch is whole, and the guard admits the step here
            self._admit_step()
        except Exception as exc:
            refusal = exc
        self._share_verdict(refusal)  # every rank refuses together, or none does
        if self.rank == 0:
            return self._draw_noise()  # N(0, σ²c²) once for the whole step
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            p.grad = p.summed_grad.view_as(p).clone()
            _mark_as_processed(p.summed_grad)
        self._noised = True

    def _share_verdict(self, refusal: Exception | None) -> None:
        """One all-reduce of each rank's verdict before the noise and the gradient all-reduce: if any
        rank refused the step (an un-noised write to its replica, the filter, a batch mismatch), every
        rank raises now, before any noise is drawn or anything charged.  Without it a refusal raised on
        one rank only, and the others waited in the gradient all-reduce until the collective timeout.
        The refusing ranks' messages are gathered (only then) so that every rank names the cause."""
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=comm_device())
        flags[self.rank] = refusal_code(refusal)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        codes = flags.tolist()
        if not any(codes):
            return
        raise_shared_refusal(
            self, codes, refusal, "its replica holds it and the replicas now differ", DistributedTrainingError
        )

    def pre_step(self, closure=None):
        ok = super().pre_step(closure)
        if ok:
            self.reduce_gradients()
        return ok

    def reduce_gradients(self) -> None:
        """Sum the ranks' gradients (÷ W with ``loss_reduction="mean"``: each rank divided by Σq/W)."""
        params = [p for p in self.params if p.requires_grad and p.grad is not None]
        local = sum(int(t.numel()) for t in self.clipping.pending_indices)
        ref = params[0].grad if params else torch.zeros(0)
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [ref.new_tensor([float(local)])])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        self.last_global_batch_size = int(round(float(flat[-1])))
        if self.loss_reduction == "mean":
            flat = flat[:-1] / self.world_size
        offset = 0
        for p in params:
            k = p.grad.numel()
            p.grad.copy_(flat[offset : offset + k].view_as(p.grad))
            offset += k


class DistributedIndividualizedDPOptimizer(_RankZeroNoise, IndividualizedDPOptimizer):
    """:class:`~idpsgd.engine.noise.optimizer.IndividualizedDPOptimizer` for data parallelism (as Opacus's
    ``DistributedDPOptimizer``): ``expected_batch_size`` is the per-rank Σ_i q_i / W."""


class DistributedIndividualizedDPOptimizerFastGradientClipping(
    _RankZeroNoise, IndividualizedDPOptimizerFastGradientClipping
):
    """Ghost clipping for data parallelism (as Opacus's ``DistributedDPOptimizerFastGradientClipping``)."""


class DistributedIndividualizedDPOptimizerBookKeeping(_RankZeroNoise, IndividualizedDPOptimizerBookKeeping):
    """Book-keeping clipping (``grad_sample_mode="bk"``) for data parallelism: each rank forms its
    examples' clipped sum from its own backward pass; noise on rank 0; one all-reduce."""


# --- collectives ----------------------------------------------------------------------------
def comm_device() -> torch.device:
    """The device collectives run on: the current CUDA device with NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (identity without a process group)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=comm_device())
    return box[0]


def sum_over_ranks(value: int) -> int:
    """Σ over the ranks of an integer every rank calls this with (``value`` itself without a process
    group): e.g. the rows of a user-level step, of which the optimizer counts the users."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t)


def all_gather_arrays(local: np.ndarray, sizes) -> np.ndarray:
    """Concatenation, in rank order, of every rank's 1-D float array (rank r holds ``sizes[r]`` values)."""
    local = np.asarray(local, dtype=np.float64).ravel()
    if not is_distributed():
        return local
    rank, world = rank_and_world()
    if local.size != sizes[rank]:
        raise RuntimeError(f"rank {rank} holds {local.size} values, expected {sizes[rank]}")
    width = max([1, *(int(s) for s in sizes)])
    dev = comm_device()
    buf = torch.zeros(width, dtype=torch.float64, device=dev)
    buf[: local.size] = torch.from_numpy(local).to(dev)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return np.concatenate([o[: int(s)].cpu().numpy() for o, s in zip(out, sizes, strict=True)])


def sharded_grad_norms(module, dataset, indices, collate_fn, batch_size: int, per_sample_loss=None):
    """(norms, losses) of ``indices`` (Yu et al. 2023, Alg. 2 line 3): each rank computes a contiguous
    share and the shares are all-gathered, so every rank returns every example's values in order."""
    from ..per_example.norms import example_batches, per_example_grad_norms

    idx = np.asarray(indices, dtype=np.int64)
    if not is_distributed() or data_parallel_wrapper(module) is None:
        return per_example_grad_norms(module, example_batches(dataset, idx, collate_fn, batch_size), per_sample_loss)
    if isinstance(data_parallel_wrapper(module), DDP):
        raise InvalidParameterError(
            "module",
            "DistributedDataParallel",
            "per-example norm passes need opacus.distributed.DifferentiallyPrivateDistributedDataParallel",
        )
    rank, world = rank_and_world()
    parts = np.array_split(idx, world)
    norms, losses = per_example_grad_norms(
        module, example_batches(dataset, parts[rank], collate_fn, batch_size), per_sample_loss
    )
    sizes = [p.size for p in parts]
    return all_gather_arrays(norms, sizes), all_gather_arrays(losses, sizes)


def main_first(on_main, on_others):
    """``on_main()`` on rank 0 (e.g. create a run folder), then ``on_others()`` on the other ranks; an
    error on rank 0 is raised on every rank.  Without a process group: ``on_main()``."""
    if not is_distributed():
        return on_main()
    if dist.get_rank() == 0:
        try:
            out = on_main()
        except Exception as exc:
            broadcast_object(exc)
            raise
        broadcast_object(None)
        return out
    err = broadcast_object(None)
    if err is not None:
        raise err
    return on_others()


def check_replicated(name: str, values) -> None:
    """Raise unless ``values`` (numbers) are bit-identical on every rank (the replicated ledger)."""
    if not is_distributed():
        return
    arr = np.ascontiguousarray(np.asarray(values, dtype=np.float64).ravel())
    digest = int.from_bytes(__import__("hashlib").sha256(arr.tobytes()).digest()[:7], "little")
    dev = comm_device()
    mine = torch.tensor([digest, -digest], dtype=torch.int64, device=dev)
    both = mine.clone()
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # max of h and of -h: equal on all ranks iff min == max
    if int(both[0]) != digest or int(both[1]) != -digest:
        raise DistributedTrainingError(
            f"the {name} differs between ranks (rank {dist.get_rank()}); the run's "
            "privacy bookkeeping would not be that of one process"
        )


# --- launching --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, args, kwargs, nproc, port, backend, timeout_s, folder):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    if rank:  # rank 0 speaks for the run
        logging.getLogger("idpsgd").setLevel(logging.ERROR)
    try:
        init_process_group(backend, timeout_s)
        with warnings.catch_warnings(record=True) as caught:  # rank 0's go to the launching process
            warnings.simplefilter("default")
            out = fn(*args, **kwargs)
        if rank == 0:
            shown = [(w.category.__name__, str(w.message)) for w in caught]
            save_torch(Path(folder) / "result.pt", {"result": _tag_arrays(out), "warnings": shown})
    except BaseException as exc:
        _save_error(Path(folder) / f"error{rank}.pt", exc)
        raise
    finally:
        if is_distributed():
            dist.destroy_process_group()


def _tag_arrays(obj):
    """numpy arrays marked so that :func:`_untag_arrays` gives them back as arrays (not tensors)
    after a ``weights_only`` round trip through :func:`~idpsgd.io.save_torch`."""
    if isinstance(obj, dict):
        return {k: _tag_arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tag_arrays(v) for v in obj)
    return {"__ndarray__": obj} if isinstance(obj, np.ndarray) else obj


def _untag_arrays(obj):
    if isinstance(obj, dict):
        if set(obj) == {"__ndarray__"}:
            return obj["__ndarray__"].numpy()
        return {k: _untag_arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_untag_arrays(v) for v in obj)
    return obj


#: Errors a rank reports that are rebuilt as themselves in the launching process; any other
#: becomes a :class:`DistributedTrainingError` carrying its type and message.
_REBUILT = {
    c.__name__: c
    for c in (
        UnreachableTargetError,
        PrivacyBudgetExceeded,
        UnnoisedWriteError,
        BatchMismatchError,
        CheckpointError,
        FileNotFoundError,
        ValueError,
        RuntimeError,
        MemoryError,
        KeyboardInterrupt,
    )
}


def _save_error(path: Path, exc: BaseException) -> None:
    """A rank's error as plain text (type name, message, the fields of an InvalidParameterError, the
    value as the message shows it), in a file that loads with ``weights_only=True``: nothing read back
    from the run's files can run code, and any error — whatever object its value is — is readable."""
    record = {
        "type": type(exc).__name__,
        "message": str(exc),
        "communication": bool(_communication_error(exc)),
        "traceback": traceback.format_exc(),
    }
    if isinstance(exc, InvalidParameterError):
        record.update(name=str(exc.name), value=shown_value(exc.value), allowed=str(exc.allowed))
    save_torch(path, record)


def _load_error(path: Path) -> dict:
    try:
        record = load_torch(path, "distributed error report")
    except CheckpointError as exc:
        record = {"type": "CheckpointError", "message": str(exc), "communication": False}
    return record if isinstance(record, dict) else {"type": "?", "message": repr(record), "communication": False}


def _rebuild(record: dict) -> BaseException:
    if "allowed" in record:  # the value as text; the message as the rank wrote it
        err = InvalidParameterError(record["name"], record["value"], record["allowed"])
        err.args = (record["message"],)
        return err
    cls = _REBUILT.get(record["type"])
    return (
        cls(record["message"])
        if cls is not None
        else DistributedTrainingError(f"{record['type']}: {record['message']}")
    )


def _communication_error(exc: BaseException) -> bool:
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    text = str(exc).lower()
    return isinstance(exc, kinds) or any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout"))


def check_nproc(nproc, *, pdp: bool = False, individual_filter: bool = False) -> int:
    """Refuse what a distributed ``idpsgd train --nproc N`` cannot honour (clear error)."""
    if isinstance(nproc, bool) or not isinstance(nproc, (int, np.integer)) or nproc < 1:
        raise InvalidParameterError("nproc", nproc, "must be an integer >= 1")
    if nproc > 1 and pdp:
        raise InvalidParameterError("nproc", nproc, "PDP-SGD methods run in one process only (use --nproc 1)")
    if nproc > 1 and individual_filter:
        raise InvalidParameterError(
            "nproc",
            nproc,
            "--filter individual runs in one process only (use --nproc 1): the command's filter harness is not "
            "launched on several ranks (the engine's privacy_filter='individual' runs on DPDDP ranks, at example "
            "or user level, from the library)",
        )
    return int(nproc)


START_METHODS = ("spawn", "forkserver")


def launch(
    fn,
    nproc: int,
    args=(),
    kwargs=None,
    *,
    device="cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: str = "spawn",
):
    """Run ``fn(*args, **kwargs)`` on ``nproc`` spawned processes with a process group (gloo for CPU,
    NCCL for CUDA: one GPU per rank) and return rank 0's result.

    ``fn`` must be importable (a module-level function).  If a rank raises, its exception is
    re-raised here (an :class:`~idpsgd.validation.InvalidParameterError` stays one, for the CLI);
    if a rank dies without one (killed, ``os._exit``) or a collective times out, a
    :class:`DistributedTrainingError` names the rank; the other ranks are stopped.

    ``start_method="forkserver"`` forks the ranks from Python's fork server instead of starting fresh
    interpreters: with modules preloaded there (``multiprocessing.get_context("forkserver")
    .set_forkserver_preload``), repeated launches from one process skip the imports (most of a small
    run's start).  The server is started once, by the first such launch, and its children see the
    environment of that moment, not later changes to ``os.environ``.
    """
    check_nproc(nproc)
    if start_method not in START_METHODS:
        raise InvalidParameterError("start_method", start_method, f"must be one of {', '.join(START_METHODS)}")
    backend = default_backend(device)
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise InvalidParameterError("nproc", nproc, f"needs one GPU per process; {torch.cuda.device_count()} visible")
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException, start_processes

    with tempfile.TemporaryDirectory(prefix="idpsgd-dist-") as folder:
        ctx = start_processes(
            _worker,
            args=(fn, tuple(args), dict(kwargs or {}), int(nproc), _free_port(), backend, float(timeout_s), folder),
            nprocs=int(nproc),
            join=False,
            start_method=start_method,
        )
        try:
            while not ctx.join():
                pass
        except (ProcessExitedException, ProcessRaisedException):
            raise _failure(ctx, folder, nproc, timeout_s) from None
        done = load_torch(Path(folder) / "result.pt", "distributed result")
        for category, message in done.get("warnings", ()):  # rank 0's, once, where the caller shows them
            kind = getattr(builtins, category, None)
            warnings.warn(message, kind if isinstance(kind, type) and issubclass(kind, Warning) else UserWarning, 2)
        return _untag_arrays(done["result"])


def _failure(ctx, folder, nproc: int, timeout_s: float) -> BaseException:
    """The error to raise for a failed run: a rank's own (non-communication) exception, else a
    :class:`DistributedTrainingError` naming the rank that died and what the others reported."""
    errors = {int(path.stem[5:]): _load_error(path) for path in sorted(Path(folder).glob("error*.pt"))}
    root = [(r, e) for r, e in sorted(errors.items()) if not e["communication"]]
    if root:
        rank, record = root[0]
        err = _rebuild(record)
        err.add_note(f"(raised on rank {rank} of {nproc})")
        return err
    codes = {r: p.exitcode for r, p in enumerate(ctx.processes)}
    dead = [r for r, c in codes.items() if r not in errors and c not in (None, 0, -15)]  # -15: stopped by us
    reported = "; ".join(
        f"rank {r}: {e['type']}: {(e['message'].splitlines() or [''])[0][:300]}" for r, e in sorted(errors.items())
    )
    what = (
        ", ".join(
            f"rank {r} of {nproc} exited with code {codes[r]} without a Python error (killed or crashed)" for r in dead
        )
        if dead
        else f"a rank of {nproc} failed in a collective"
    )
    return DistributedTrainingError(
        f"distributed run failed: {what}"
        + (f"; {reported}" if reported else "")
        + f"; the other ranks were stopped (collective timeout {timeout_s:g} s)"
    )


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "START_METHODS",
    "DistributedIndividualizedDPOptimizer",
    "DistributedIndividualizedDPOptimizerBookKeeping",
    "DistributedIndividualizedDPOptimizerFastGradientClipping",
    "DistributedTrainingError",
    "all_gather_arrays",
    "broadcast_object",
    "check_nproc",
    "check_replicated",
    "data_parallel_wrapper",
    "init_process_group",
    "is_distributed",
    "is_main_process",
    "launch",
    "local_device",
    "main_first",
    "raise_shared_refusal",
    "rank_and_world",
    "refusal_code",
    "sharded_grad_norms",
    "shared_seeds",
    "sum_over_ranks",
    "wrap_model",
]
