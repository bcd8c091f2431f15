"""Atomic, private file writes: results and checkpoints never appear half-written.

Every writer goes to a temporary file in the destination folder and renames it into place
(``os.replace`` is atomic on POSIX).  ``private=True`` creates the file with mode 0600: use it
for per-example budgets and ε, which are personal data.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", private: bool = False) -> Iterator[io.IOBase]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600 if private else 0o644)
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            fault_point(path.name)  # tests: a kill here leaves only the temporary file
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


_FAULT_COUNTS: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Fault injection for the crash tests: with ``IDPSGD_TEST_KILL=NAME:N`` in the environment, the
    process kills itself (SIGKILL) the N-th time it passes the point ``NAME`` (a file being written
    atomically, or ``step`` in the training loop).  Inert otherwise."""
    spec = os.environ.get("IDPSGD_TEST_KILL")
    if not spec:
        return
    target, _, count = spec.rpartition(":")
    if target != name:
        return
    _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    if str(_FAULT_COUNTS[name]) == count:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def write_json(path, data: Any, private: bool = False) -> Path:
    with atomic_open(path, "w", private=private) as fh:
        json.dump(data, fh, indent=2, sort_keys=False, default=_json_default)
        fh.write("\n")
    return Path(path)


def write_npz(path, private: bool = False, **arrays) -> Path:
    with atomic_open(path, "wb", private=private) as fh:
        np.savez(fh, **arrays)
    return Path(path)


def write_csv(path, header: list[str], columns: list, private: bool = False) -> Path:
    """Write equal-length columns as CSV (floats with full precision)."""
    cols = [np.asarray(c) for c in columns]
    n = len(cols[0]) if cols else 0
    if any(len(c) != n for c in cols):
        raise ValueError("all CSV columns must have the same length")
    with atomic_open(path, "w", private=private) as fh:
        fh.write(",".join(header) + "\n")
        for row in zip(*cols, strict=True):
            fh.write(",".join(_fmt(v) for v in row) + "\n")
    return Path(path)


def _fmt(v) -> str:
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if isinstance(v, (np.integer, np.bool_)):
        return str(v.item())
    if isinstance(v, str) and any(c in v for c in ',"\r\n'):  # a user id with a comma: quoted as CSV does
        return '"' + v.replace('"', '""') + '"'
    return str(v)


def _json_default(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.floating, np.integer, np.bool_)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot serialize {type(o).__name__}")


def to_plain(obj):
    """numpy arrays → tensors and numpy scalars → Python numbers, recursively (for ``torch.save``
    files that load with ``weights_only=True``)."""
    import torch

    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def save_torch(path, state, private: bool = True) -> Path:
    """``torch.save`` of ``state`` (made plain by :func:`to_plain`), atomically, mode 0600 by default."""
    import torch

    with atomic_open(path, "wb", private=private) as fh:
        torch.save(to_plain(state), fh)
    return Path(path)


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, foreign or not loadable without running code."""


def load_torch(path, what: str = "checkpoint"):
    """Load a file written by :func:`save_torch` with ``weights_only=True`` (nothing in the file can
    run code); any failure is one :class:`CheckpointError` line naming the file."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is not a readable idpsgd {what} ({first[:200]})") from None


def signature_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """What differs between a checkpoint's signature and the current run's, as 'key: saved -> current'
    (nested keys dotted).  Digests and seeds by name only: an error message is not a private file."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += signature_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            hidden = "sha256" in key or "seed" in key
            out.append(f"{prefix}{key} differs" if hidden else f"{prefix}{key}: {a!r} -> {b!r}")
    return out
