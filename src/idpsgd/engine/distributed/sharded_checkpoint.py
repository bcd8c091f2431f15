"""Sharded checkpoints of a ``fully_shard`` (FSDP2) run: torch.distributed.checkpoint (DCP) + private state.

One checkpoint is a folder ``checkpoint-<step>/``: DCP's files (``.metadata``, ``__<rank>_0.distcp``:
the model's and the optimizer's shards, each rank writing its own) and ``state.pt``, every rank's
private state gathered by rank 0 — the engine's :meth:`~idpsgd.engine.IndividualizedPrivacyEngine.state_dict`
(accountant ledger, seed, sampler and noise generators), the global RNG states (dropout) and the
caller's extras.  Everything is private: mode 0700/0600.  The folder appears whole or not at all:
written as ``.checkpoint-<step>.tmp``, renamed by rank 0 after every rank has written (a rank that
dies mid-save leaves the previous checkpoint as the latest).  Loading refuses another plan, signature
or world size (unless the saved private state is the same on every rank and ``allow_reshard``: DCP
reshards the tensors); DCP's metadata is unpickled with an exact allow-list of DCP's own classes
(:func:`read_metadata`), tensors and non-tensor values with ``weights_only=True``, so reading a
checkpoint runs no code from it.  :func:`export_pretrained`
writes the model alone (public) as one ``save_pretrained`` folder.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ...io import (
    CheckpointError,
    RefusedPickle,
    fault_point,
    load_restricted,
    load_torch,
    save_torch,
    signature_differences,
)
from ...validation import InvalidParameterError
from .. import distributed
from ..per_example.unwrap import raw_module

FORMAT = "idpsgd.sharded-checkpoint/1"
STATE_FILE = "state.pt"
PATTERN = re.compile(r"^checkpoint-(\d+)$")


def _single_process(dcp_call) -> dict:
    """``no_dist`` for a DCP save or load outside a process group, where this torch's DCP takes it; releases before
    it (torch 2.6) run such a call in a single process anyway (saying so in a warning, filtered by the callers)."""
    if "no_dist" in inspect.signature(dcp_call).parameters:
        return {"no_dist": not distributed.is_distributed()}
    return {}


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{int(step)}"


def sharded_checkpoints(folder) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete sharded checkpoints in ``folder``, oldest first (a folder
    still being written is named ``.checkpoint-<step>.tmp`` and never listed)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := PATTERN.match(p.name)) and p.is_dir() and (p / STATE_FILE).is_file()
    ]
    return sorted(found)


def _complete_checkpoint(path) -> Path:
    """``path`` itself when it is a complete sharded checkpoint, else the latest one inside it."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    latest = latest_sharded_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no complete sharded checkpoint (checkpoint-<step>/{STATE_FILE})")
    return latest


def latest_sharded_checkpoint(folder) -> Path | None:
    """The newest complete checkpoint in ``folder`` (None if there is none)."""
    found = sharded_checkpoints(folder)
    return found[-1][1] if found else None


# --- global RNG states (dropout and anything else the model draws) ----------------------------------
def _rng_state() -> dict:
    np_state = np.random.get_state()  # noqa: NPY002 (the global state the model's code may draw from)
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), *map(float, np_state[2:])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))  # noqa: NPY002
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


# --- what the tensors are -----------------------------------------------------------------------
def _inner_optimizer(optimizer):
    """The user's optimizer inside the engine's DP optimizer (DCP's helpers need the plain one)."""
    return getattr(optimizer, "original_optimizer", optimizer)


def _layout(module: torch.nn.Module) -> dict:
    """The model's public layout: its class and every parameter's name and full shape."""
    cls = next((c for c in type(module).__mro__ if not c.__name__.startswith("FSDP")), type(module))
    return {
        "model": cls.__name__,
        "parameters": [[n, list(p.shape)] for n, p in module.named_parameters()],
    }


def _tensors(module, optimizer):
    raw = raw_module(module)
    if optimizer is None:
        return {"model": get_model_state_dict(raw)}
    model_state, optim_state = get_state_dict(raw, _inner_optimizer(optimizer))
    return {"model": model_state, "optim": optim_state}


# --- saving -------------------------------------------------------------------------------------
def save_sharded_checkpoint(
    folder,
    step: int,
    *,
    module: torch.nn.Module,
    optimizer=None,
    engine=None,
    extra: dict | None = None,
    signature: dict | None = None,
    keep: int | None = 2,
) -> Path:
    """Write ``folder/checkpoint-<step>/`` (collective: every rank calls it) and return its path.

    ``module``: the (``fully_shard``-wrapped, possibly engine-wrapped) model; ``optimizer``: its
    optimizer (the engine's DP optimizer or the plain one); ``engine``: the privacy engine, whose
    :meth:`state_dict` is saved; ``extra``: this rank's further private state (plain types and
    tensors: a learning-rate schedule, a Trainer's logs); ``signature``: public and digested values a
    resuming run must match (compared by :func:`load_sharded_checkpoint`).  ``keep``: how many
    complete checkpoints to keep (the oldest others are removed; None keeps all).  Private: the
    folder is 0700, every file 0600."""
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise InvalidParameterError("step", step, "must be an integer >= 0")
    if keep is not None and (isinstance(keep, bool) or int(keep) != keep or keep < 1):
        raise InvalidParameterError("keep", keep, "must be an integer >= 1 (complete checkpoints kept), or None")
    folder = Path(folder)
    world = distributed.rank_and_world()[1]
    final = folder / checkpoint_name(step)
    tmp = folder / f".{final.name}.tmp"

    def prepare():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if tmp.exists():  # a save killed before its rename
            shutil.rmtree(tmp)
        tmp.mkdir(mode=0o700)

    distributed.main_first(prepare, lambda: None)
    if engine is not None and distributed.is_distributed():  # the ledger every rank holds is the same
        distributed.check_replicated("privacy ledger", [engine.steps, *engine.accountant.grid_epsilon()])
    private = {
        "engine": engine.state_dict() if engine is not None else None,
        "rng": _rng_state(),
        "extra": dict(extra or {}),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(
            _tensors(module, optimizer),
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            **_single_process(dcp.save),
        )
    fault_point(f"{final.name}.tmp")  # tests: a rank dying here, its shards written, leaves no checkpoint
    ranks = _gather(private)

    def publish():
        state = {
            "format": FORMAT,
            "step": int(step),
            "world_size": world,
            "layout": _layout(raw_module(module)),
            "optimizer": type(_inner_optimizer(optimizer)).__name__ if optimizer is not None else None,
            "signature": dict(signature or {}),
            "ranks": ranks,
        }
        save_torch(tmp / STATE_FILE, state, private=True)
        for root, dirs, files in os.walk(tmp):
            for d in dirs:
                os.chmod(Path(root) / d, 0o700)
            for f in files:
                os.chmod(Path(root) / f, 0o600)
        fault_point(final.name)  # tests: a kill here leaves the previous checkpoint the latest
        old = folder / f".{final.name}.old.tmp"
        if final.exists():  # the same step saved again: the new one replaces it
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(folder)
        if keep is not None:
            for _, path in sharded_checkpoints(folder)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
        return final

    return distributed.main_first(publish, lambda: final)


def _gather(obj) -> list:
    """Every rank's ``obj`` in rank order (on every rank)."""
    if not distributed.is_distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- loading ------------------------------------------------------------------------------------
#: What DCP's ``.metadata`` pickle names (listed from checkpoints torch 2.13 writes — fp32, bf16,
#: AdamW and SGD states, a GPT-2 — by unpickling them with a recording ``find_class``): its metadata
#: classes, its file writer's storage record, the layout lookup, ``torch.Size``, dtypes and the
#: checkpoint's path.  Exact (module, name) pairs; nothing else loads.
_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),  # a lookup in a table of torch's layouts
    "torch": ("Size",),
}
#: the checkpoint's path (``StorageMeta.checkpoint_id``): pathlib's classes, which Python 3.13 pickles
#: as ``pathlib._local.*`` (a module other versions lack): both names stand for pathlib's classes
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")


def metadata_globals() -> dict[tuple[str, str], object]:
    """The exact ``(module, name) -> object`` allow-list DCP's metadata is unpickled with
    (:func:`idpsgd.io.load_restricted`): :data:`_METADATA_NAMES`, each dtype (``torch.float32``...)
    and pathlib's path classes."""
    import importlib
    import pathlib

    out = {}
    for module, names in _METADATA_NAMES.items():
        mod = importlib.import_module(module)
        out.update({(module, n): getattr(mod, n) for n in names if hasattr(mod, n)})
    out.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    out.update({(m, n): getattr(pathlib, n) for m in ("pathlib", "pathlib._local") for n in _PATH_CLASSES})
    return out


def read_metadata(path) -> object:
    """DCP's ``.metadata`` of a checkpoint folder, unpickled through :func:`metadata_globals`; a file
    naming anything else, or not DCP metadata of this folder's own shard files, is a CheckpointError."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path) / ".metadata"
    try:
        with open(path, "rb") as fh:
            metadata = load_restricted(fh, metadata_globals())
    except RefusedPickle as exc:
        raise CheckpointError(f"{path} is not DCP metadata, refused without running it: {exc}") from None
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointError(f"{path} is not readable DCP metadata ({str(exc)[:200]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} is not the DCP metadata of a saved checkpoint ({type(metadata).__name__})")
    for info in metadata.storage_data.values():  # the shards it reads: files of this folder
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name not in ("", ".", "..") and not set(name) & set("/\\\0")
        if not (isinstance(info, _StorageInfo) and plain):
            raise CheckpointError(f"{path} names a shard outside its folder ({str(name)[:100]!r})")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_metadata` (an exact allow-list)."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(self.path)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner with non-tensor values (an optimizer's hyper-parameters) loaded ``weights_only``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # the value's place in the nested state dict
            *parents, last = self.mappings[read_item.dest_index.fqn]
            node = self.original_state_dict
            for key in parents:
                node = node[key]
            node[last] = obj
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_sharded_state(path) -> dict:
    """The private ``state.pt`` of a sharded checkpoint (``weights_only=True``), format checked."""
    path = Path(path)
    state = load_torch(path / STATE_FILE, "sharded checkpoint state")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an idpsgd sharded checkpoint (written by save_sharded_checkpoint)")
    return state


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def load_sharded_checkpoint(
    path,
    *,
    module: torch.nn.Module,
    optimizer=None,
    engine=None,
    signature: dict | None = None,
    allow_reshard: bool = False,
) -> dict:
    """Restore a checkpoint written by :func:`save_sharded_checkpoint` (collective: every rank calls
    it, after ``make_private`` set up the run as when it was saved); returns this rank's ``extra``.

    ``path``: a checkpoint folder, or a folder holding them (its latest).  Refused, before anything
    changes, with what differs: another model layout, optimizer, ``signature`` or plan (the engine's
    :meth:`load_state_dict` checks the plan and seed).  Another world size: refused unless
    ``allow_reshard=True`` and the saved private state is the same on every rank (the engine's
    reproducible sampler and noise are); DCP then reshards the model and optimizer, the privacy
    accounting continues exactly, and the parameters follow the uninterrupted run up to the order of
    floating-point sums (bit-exact resumption needs the same world size)."""
    path = _complete_checkpoint(path)
    state = read_sharded_state(path)
    rank, world = distributed.rank_and_world()
    raw = raw_module(module)
    problems = signature_differences({"layout": state["layout"]}, {"layout": _layout(raw)})
    kind = type(_inner_optimizer(optimizer)).__name__ if optimizer is not None else None
    if state["optimizer"] != kind:
        problems.append(f"optimizer: {state['optimizer']!r} -> {kind!r}")
    problems += signature_differences(state["signature"], dict(signature or {}))
    if problems:
        raise InvalidParameterError(
            "checkpoint",
            str(path),
            "was written by a run with another model, optimizer, settings or data ("
            + "; ".join(problems[:4])
            + "): resume with the same ones, or start a new run",
        )
    ranks, saved_world = state["ranks"], int(state["world_size"])
    if saved_world != world:
        uniform = all(_same(ranks[0]["engine"], r["engine"]) for r in ranks[1:])
        if not allow_reshard or not uniform:
            why = (
                "pass allow_reshard=True to continue on this world size (the accounting continues exactly; the "
                "parameters equal the uninterrupted run's up to the order of floating-point sums, and each rank's "
                "dropout draws differ)"
                if uniform
                else "its engine state differs between ranks (it depends on the sharding), so it cannot be resharded"
            )
            raise InvalidParameterError(
                "world_size", world, f"differs from the {saved_world} processes that wrote {path}: {why}"
            )
    mine = ranks[rank] if saved_world == world else ranks[0]
    read_metadata(path)  # readable (through the allow-list) before anything changes
    if engine is not None:
        if mine["engine"] is None:
            raise CheckpointError(f"{path} holds no privacy engine state (saved without engine=)")
        engine.load_state_dict(mine["engine"])  # refuses another plan or seed before changing anything
    elif mine["engine"] is not None:
        raise InvalidParameterError("engine", None, f"{path} holds a privacy engine's state: pass the engine")
    tensors = _tensors(module, optimizer)
    _dcp_load(tensors, path)
    if optimizer is None:
        set_state_dict(raw, [], model_state_dict=tensors["model"], optim_state_dict={})
    else:
        set_state_dict(
            raw, _inner_optimizer(optimizer), model_state_dict=tensors["model"], optim_state_dict=tensors["optim"]
        )
    if saved_world == world:
        _set_rng_state(mine["rng"])
    return dict(mine["extra"])


def _dcp_load(tensors: dict, path: Path) -> None:
    """``dcp.load`` through the safe reader and planner; DCP's wrapped errors become one CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(
                tensors,
                storage_reader=_SafeReader(path),
                planner=_SafeLoadPlanner(),
                **_single_process(dcp.load),
            )
    except CheckpointException as exc:
        first = next((line for line in str(exc).splitlines() if "Error" in line), str(exc))
        raise CheckpointError(f"{path}: the DCP shards cannot be read ({first.strip()[:300]})") from None


# --- export -------------------------------------------------------------------------------------
def full_model_state(module: torch.nn.Module) -> dict:
    """The whole model's state dict on rank 0 (on the CPU; empty on the other ranks): collective."""
    return get_model_state_dict(raw_module(module), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_pretrained(checkpoint, model: torch.nn.Module, out, *, tokenizer=None) -> Path:
    """Write the model of a sharded checkpoint as one ``save_pretrained`` folder ``out`` (one process,
    no process group: DCP reads every rank's shards).  ``model``: a plain (not sharded) instance of the
    checkpoint's model class, e.g. ``AutoModelForCausalLM.from_config(config)``; its weights are
    replaced by the checkpoint's.  The folder holds the model (and ``tokenizer``) only — no optimizer,
    engine, seed or RNG state — and is public; it appears atomically."""
    checkpoint = _complete_checkpoint(checkpoint)
    state = read_sharded_state(checkpoint)
    problems = signature_differences({"layout": state["layout"]}, {"layout": _layout(model)})
    if problems:
        raise InvalidParameterError(
            "model", type(model).__name__, f"is not the checkpoint's model ({'; '.join(problems[:4])})"
        )
    if distributed.is_distributed():
        raise InvalidParameterError(
            "export_pretrained",
            "under torch.distributed",
            "runs in one process (it reads every rank's shards); call it outside torchrun",
        )
    read_metadata(checkpoint)  # readable (through the allow-list) before DCP reads anything
    tensors = {"model": model.state_dict()}
    _dcp_load(tensors, checkpoint)
    model.load_state_dict(tensors["model"])
    return save_pretrained_atomically(model, out, tokenizer=tokenizer)


def save_pretrained_atomically(model, out, *, tokenizer=None, state_dict: dict | None = None) -> Path:
    """``model.save_pretrained`` (and ``tokenizer.save_pretrained``) into a temporary folder beside
    ``out``, renamed into place (public: folders 0755, files 0644)."""
    import tempfile

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for root, dirs, files in os.walk(tmp):
            for d in dirs:
                os.chmod(Path(root) / d, 0o755)
            for f in files:
                os.chmod(Path(root) / f, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old.", suffix=".tmp"))
            os.replace(out, old / "replaced")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = [
    "FORMAT",
    "export_pretrained",
    "full_model_state",
    "latest_sharded_checkpoint",
    "load_sharded_checkpoint",
    "metadata_globals",
    "read_metadata",
    "read_sharded_state",
    "save_pretrained_atomically",
    "save_sharded_checkpoint",
    "sharded_checkpoints",
]
