"""Atomic, private file writes: results and checkpoints never appear half-written.

Every writer goes to a temporary file in the destination folder and renames it into place
(``os.replace`` is atomic on POSIX).  ``private=True`` creates the file with mode 0600: use it
for per-example budgets and ε, which are personal data.  Reading back runs no code from a file:
:func:`load_torch` (``weights_only=True``) and :func:`load_restricted` (an exact allow-list unpickler).
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

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
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    compressed = _compressed_records(path)
    if compressed:
        raise CheckpointError(
            f"{path} is not a readable idpsgd {what} (its record {compressed[:100]!r} is compressed: torch.save "
            "stores records uncompressed, and a compressed one can expand to any size when read)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a readable idpsgd {what} ({torch_load_problem(exc)})") from None


def _compressed_records(path: Path) -> str | None:
    """The first compressed record of a ``torch.save`` zip archive (None: none, or not a zip archive).  torch
    reads deflated records too, so a 195 KB file expanded to a 200 MB tensor (1000 times, without limit);
    ``torch.save`` never compresses, so a file's tensors can then be no larger than the file."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return next((i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None  # not a zip archive: torch.load says what it is


def torch_load_problem(exc: BaseException) -> str:
    """Why ``torch.load(..., weights_only=True)`` failed, in one line: for a refused file, what it
    named — never torch's advice to retry without ``weights_only``, which would run the file."""
    import re

    text = str(exc).strip()
    if text.startswith("Weights only load failed"):
        named = re.search(
            r"(Unsupported global: GLOBAL \S+|unsupported GLOBAL \S+|Unsupported operand \S+"
            r"|WeightsUnpickler error: [^\n.]+)",
            text,
        )
        why = f": {named.group(1)[:200]}" if named else ""
        return f"it holds more than tensors and plain values, refused without running it{why}"
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:200]


class RefusedPickle(pickle.UnpicklingError):
    """A pickle names something outside its allow-list (:func:`load_restricted`): refused before any
    of it ran.  ``name``: the ``module.name`` it named, or None (an object it tried to modify)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


class _RestrictedUnpickler(pickle._Unpickler):
    """Python's own unpickler (``pickle._Unpickler``, the reference implementation of every opcode)
    with the places a pickle reaches outside its data narrowed to an exact allow-list:

    - ``find_class`` (the GLOBAL, STACK_GLOBAL and INST opcodes) returns the object allowed for
      that exact ``(module, name)`` pair, never imports anything, and refuses a dotted name outright
      (from protocol 4 on, pickle resolves ``name`` attribute by attribute: ``os.system`` reached
      through an allowed module's own ``import os``);
    - ``BUILD`` (an object's state) only fills in an instance of an allowed class; on a class, an
      enum member, a function or anything else it would ``setattr`` on an object the whole process
      shares (rewrite an allowed class for the rest of the run) and is refused;
    - an object's state is set at most once (a pickler writes one BUILD per object): a second BUILD
      rewrites an object that others already use (``ndarray.__setstate__`` frees the memory a view made
      from it still reads);
    - a numpy dtype's state may only restate what the dtype already is: ``dtype.__setstate__`` takes
      its flags from the file, so a structured dtype with an object field could be told it holds no
      objects (numpy then builds it from raw bytes: ``frombuffer``, ``ndarray.__setstate__``) and told
      again that it does (the array then dereferences the file's bytes as object pointers: a crash,
      or worse, while the file is read);
    - extension codes (EXT1/2/4, :mod:`copyreg`'s registry) are refused: the unpickler answers them from
      a process-wide cache that a permissive unpickler may have filled, without asking ``find_class``.

    Persistent ids and out-of-band buffers stay refused (no ``persistent_load``, no ``buffers``)."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, allowed: Mapping[tuple[str, str], Any], encoding: str):
        super().__init__(file, encoding=encoding)
        self._allowed = allowed
        # (not an Enum's: its members are the process's singletons)
        self._buildable = tuple(v for v in allowed.values() if isinstance(v, type) and not issubclass(v, enum.Enum))
        self._built: dict[int, list] = {}

    def find_class(self, module, name):
        if "." in name:
            raise RefusedPickle(
                f"{module}.{name} is a dotted name (an attribute reached through {module}): refused", f"{module}.{name}"
            )
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RefusedPickle(f"{module}.{name} is not allowed", f"{module}.{name}") from None

    def _load_build(self):
        inst, state = self.stack[-2], self.stack[-1]  # the object, under its state
        if isinstance(inst, type) or not isinstance(inst, self._buildable):
            what = f"the class {inst.__qualname__}" if isinstance(inst, type) else f"a {type(inst).__name__}"
            raise RefusedPickle(f"setting the state of {what} is not allowed (only of the allowed classes' objects)")
        if isinstance(inst, np.dtype):  # numpy's dtypes are shared: u1 is one object however often it is named
            if not _restates_dtype(inst, state):
                why = "a file may not set its flags or layout"
                raise RefusedPickle(f"a numpy dtype's state must be its own ({inst}): {why}")
        elif any(built is inst for built in self._built.get(id(inst), ())):
            raise RefusedPickle(f"setting the state of a {type(inst).__name__} twice is not allowed")
        else:
            self._built.setdefault(id(inst), []).append(inst)  # (holding it: its id is not reused)
        pickle._Unpickler.load_build(self)

    def _load_ext(self):
        raise RefusedPickle("an extension code (copyreg) is not allowed: it names an object outside the allow-list")

    dispatch[pickle.BUILD[0]] = _load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _load_ext
    del _op


def _restates_dtype(dtype: np.dtype, state) -> bool:
    """Whether ``state`` is ``dtype``'s own pickled state (byte strings of Python 2 files read as text)."""

    def plain(x):
        if isinstance(x, bytes):
            return x.decode("latin-1")
        if isinstance(x, tuple):
            return tuple(plain(v) for v in x)
        if isinstance(x, dict):
            return {plain(k): plain(v) for k, v in x.items()}
        return x

    try:
        return type(state) is tuple and bool(plain(state) == plain(dtype.__reduce__()[2]))
    except Exception:  # a state holding something that does not compare (an array): not the dtype's own
        return False


def load_restricted(file, allowed: Mapping[tuple[str, str], Any], *, encoding: str = "ASCII"):
    """Unpickle ``file`` (an open binary file) naming only the exact ``(module, name)`` pairs of
    ``allowed`` (each mapped to the object it stands for; no name may contain a dot) — nothing outside
    the list is imported or called, so the file runs no code of its own.  A name outside the list raises
    :class:`RefusedPickle`; a file that is not a whole pickle, ``EOFError`` or ``pickle.UnpicklingError``.
    ``encoding``: for Python 2 byte strings (``"bytes"`` keeps them as bytes)."""
    dotted = sorted(f"{m}.{n}" for m, n in allowed if "." in n)
    if dotted:
        raise ValueError(f"an allow-list of unpickled names holds dotted names {dotted}: list each exact object")
    try:
        return _RestrictedUnpickler(file, allowed, encoding).load()
    except (RefusedPickle, EOFError):
        raise
    except Exception as exc:  # an unknown opcode, an empty stack, an allowed class given bad arguments...
        raise pickle.UnpicklingError(f"not a valid pickle ({type(exc).__name__}: {str(exc)[:200]})") from None


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
