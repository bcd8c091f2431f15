"""Private, resumable checkpoints of an :class:`~.trainer.IndividualizedTrainer` run.

A checkpoint is one file, ``private/checkpoint-<step>.pt`` (mode 0600, written atomically: a run
killed while writing leaves the previous one whole), holding everything a resumed run needs to
continue exactly as the uninterrupted one would — model, optimizer, schedule, GradScaler, the
privacy engine's state (accountant history, so each step is charged once; filter; seed; the Poisson
sampler's state before the first untrained batch and the noise generator's), the Trainer's public
and private values and the global RNG states — and a signature (the public configuration, digests
of the budgets and data: compared, never shown) so that a checkpoint of another run is refused
with what differs.  Nothing of it is public but its name; secure mode saves no generator state
and a resumed secure run draws fresh OS entropy (and says so).

User guide: ``docs/huggingface.md`` (Checkpoints and resume).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import numpy as np
import torch

from ...io import CheckpointError, load_torch
from ...runfolder import PRIVATE
from ...validation import InvalidParameterError

FORMAT = "idpsgd.hf-trainer-checkpoint/1"
PATTERN = re.compile(r"^checkpoint-(\d+)\.pt$")
#: a sharded (fsdp) checkpoint folder (engine/distributed/sharded_checkpoint.py)
SHARDED = re.compile(r"^checkpoint-(\d+)$")

#: TrainingArguments that shape the run (a resumed run must be set up with the same values; not ``seed``:
#: the model's initialisation it seeds is replaced by the checkpoint's weights, the RNG states by its states)
RUN_ARGUMENTS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "max_steps",
    "num_train_epochs",
    "max_grad_norm",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "label_names",
)


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{int(step)}.pt"


def checkpoints_in(folder) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoints in a run folder's ``private/``, oldest first: files
    ``checkpoint-<step>.pt`` and complete sharded folders ``checkpoint-<step>/`` (fsdp runs)."""
    from ...engine.distributed.sharded_checkpoint import sharded_checkpoints

    private = Path(folder) / PRIVATE
    if not private.is_dir():
        return []
    found = []
    for p in private.iterdir():
        m = PATTERN.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found + sharded_checkpoints(private))


def _plain(v):
    v = getattr(v, "value", v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def data_digest(dataset) -> str:
    """SHA-256 of the training examples' content, in order (a ``datasets.Dataset`` by its columns in
    batches; another map-style dataset item by item).  Private: it identifies the data."""
    h = hashlib.sha256()

    def default(o):
        if torch.is_tensor(o):
            return o.tolist()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, np.generic):
            return o.item()
        return repr(o)

    iterate = getattr(dataset, "iter", None)
    if callable(iterate) and hasattr(dataset, "column_names"):
        h.update(json.dumps(sorted(dataset.column_names)).encode())
        for batch in dataset.iter(batch_size=1024):
            h.update(json.dumps(batch, sort_keys=True, default=default).encode())
    else:
        for i in range(len(dataset)):
            h.update(json.dumps(dataset[i], sort_keys=True, default=default).encode())
    return h.hexdigest()


def signature(trainer) -> dict:
    """What a checkpoint must have been written by: the public configuration and (by digest, private)
    the budgets and the data."""
    args, privacy = trainer.user_args, trainer.privacy
    return {
        "training_arguments": {name: _plain(getattr(args, name, None)) for name in RUN_ARGUMENTS},
        "privacy": {
            "method": privacy.method,
            "accountant": privacy.accountant,
            "grad_sample_mode": privacy.grad_sample_mode,
            "secure_mode": privacy.secure_mode,
            "delta": trainer.budgets.delta,
            # the batches' fixed length (a run without one keeps the signature earlier versions wrote)
            **({"pad_to_length": privacy.pad_to_length} if getattr(privacy, "pad_to_length", None) else {}),
        },
        "model": next(c for c in type(trainer.model).__mro__ if not c.__name__.startswith("FSDP")).__name__,
        "model_config_sha256": trainer.model_config_digest,
        "n": len(trainer.budgets),
        "budgets_sha256": hashlib.sha256(np.ascontiguousarray(trainer.budgets.epsilons).tobytes()).hexdigest(),
        "data_sha256": trainer.data_digest(),
        # user level: k (public) and the row → user assignment (private, by digest); the data digest is of
        # the rows without the user column, so another grouping of the same rows would resume silently
        **(
            {"users_k": int(trainer.users.k), "users_sha256": trainer.users.digest()}
            if getattr(trainer, "users", None) is not None
            else {}
        ),
    }


def model_config_digest(model) -> str:
    """SHA-256 of the model's configuration as given to the Trainer (before the Trainer aligns its
    special tokens with the tokenizer's)."""
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else type(model).__name__
    return hashlib.sha256(text.encode()).hexdigest()


def rng_state() -> dict:
    """The global RNG states (torch, CUDA, numpy, Python): dropout and anything else the model draws."""
    np_state = np.random.get_state()  # noqa: NPY002 (the global state the model's code may draw from)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(  # noqa: NPY002
        (n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def find_checkpoint(folder, resume_from_checkpoint) -> Path:
    """The checkpoint to resume from: ``True`` — the latest in the run folder; a path — that file
    (or the latest in that run folder)."""
    if resume_from_checkpoint is True:
        found = checkpoints_in(folder)
        if not found:
            raise InvalidParameterError(
                "resume_from_checkpoint",
                True,
                f"the run folder {str(folder)!r} holds no checkpoint (private/checkpoint-<step>.pt): train with "
                "save_strategy='steps' or 'epoch' to write them",
            )
        return found[-1][1]
    p = Path(resume_from_checkpoint)
    if p.is_dir() and SHARDED.match(p.name):
        return p
    if p.is_dir():
        found = checkpoints_in(p)
        if not found:
            raise InvalidParameterError("resume_from_checkpoint", str(p), "holds no private/checkpoint-<step>.pt")
        return found[-1][1]
    if not p.is_file():
        raise InvalidParameterError("resume_from_checkpoint", str(p), "not found")
    return p


def checkpoint_seed(folder) -> int | None:
    """The privacy seed of the latest checkpoint in a run folder (None if it has none or was secure):
    a resumed command without ``--seed`` continues with it (its random budget assignment included)."""
    found = checkpoints_in(folder)
    if not found:
        return None
    path = found[-1][1]
    if path.is_dir():  # sharded: every rank saved the same seed (rank 0's, broadcast)
        from ...engine.distributed.sharded_checkpoint import read_sharded_state

        return read_sharded_state(path)["ranks"][0]["extra"]["engine"].get("seed")
    return read_checkpoint(path)["engine"].get("seed")


def read_checkpoint(path) -> dict:
    """Load (``weights_only=True``: nothing in the file can run code) and check the format."""
    state = load_torch(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an idpsgd Trainer checkpoint (written by IndividualizedTrainer)")
    return state
