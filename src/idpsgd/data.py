"""Datasets from local files in their standard formats (no network), as in-memory tensors.

This module owns reading and checking the bundled ``digits`` and the files of ``mnist``,
``fashion-mnist`` (IDX), ``cifar10`` (python pickle batches, through a restricted unpickler that
admits only numpy's array reconstruction, so a crafted file cannot run code), ``svhn`` (.mat) and
``csv`` (a label column and a public class count).  What the model may see is decided here too: a
CSV's budget column and identifier columns are never model inputs, the class count is never read
from the rows (it would publish whether some row holds a rare class), and without a test file the
80/20 split is a function of the row count only.  Every file is checked against its format; a bad
file raises :class:`DatasetFileError` naming the file, what is wrong and what is expected.  Pixels
are scaled to [0, 1]; standardization is a separate choice inside the guarantee
(:mod:`idpsgd.preprocessing`).  The formats, file names and CSV rules: ``docs/api/data.md``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib
import io
import json
import math
import struct
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .io import RefusedPickle, load_restricted
from .preprocessing import normalize
from .validation import InvalidParameterError


class DatasetFileError(FileNotFoundError):
    """A dataset file is missing, unreadable or malformed; the message names the file and what is expected."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    #: how the inputs were normalized (:func:`idpsgd.preprocessing.normalize`): mode, mean, std,
    #: source, and the (epsilon, delta) it cost every training example (0 unless ``private``).
    preprocessing: dict = field(default_factory=dict)
    #: how the files were read (public: file names, feature columns, excluded columns and why).
    source: dict = field(default_factory=dict)
    #: csv without test.csv: the hidden split, ``{"rows": data rows of train.csv, "train_rows",
    #: "test_rows"}`` (0-based data-row indices, ascending).  A function of the labels: private.
    split: dict | None = field(default=None, repr=False)

    @property
    def input_shape(self) -> tuple:
        return tuple(self.x_train.shape[1:])

    def fingerprint(self) -> str:
        """Hex SHA-256 of the name, class count, preprocessing record and the four tensors (dtype, shape, bytes).

        Equal fingerprints mean the same training and test data, transformed the same way (used to
        refuse resuming a run on changed data).  It is a deterministic function of the private
        training data: keep it in private files (mode 0600), never in a public report.
        """
        h = hashlib.sha256(b"idpsgd-dataset-fingerprint-v1\0")
        meta = {"name": self.name, "num_classes": int(self.num_classes), "preprocessing": self.preprocessing}
        h.update(json.dumps(meta, sort_keys=True, default=_json_plain).encode())
        for key in ("x_train", "y_train", "x_test", "y_test"):
            t = getattr(self, key).detach().cpu().contiguous()
            h.update(f"\0{key}:{t.dtype}:{tuple(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()


def _json_plain(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"not JSON-serializable: {type(v).__name__}")


@dataclass
class _Raw:
    """What a reader returns: scaled inputs, integer labels, and how they were scaled."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    scaling: str
    value_range: tuple | None  # public range of the scaled values (None: unknown, e.g. CSV)
    source: dict = field(default_factory=dict)  # how the files were read (public)
    split: dict | None = None  # csv without test.csv: the hidden split (private)


LOADERS: dict[str, Callable[..., _Raw]] = {}


def register(name):
    def deco(fn):
        LOADERS[name] = fn
        return fn

    return deco


def load_dataset(
    name: str,
    data_dir=None,
    *,
    normalization=None,
    normalization_epsilon=None,
    normalization_delta=None,
    feature_range=None,
    label_column: str = "label",
    feature_columns=None,
    drop_columns=None,
    budget_column: str | None = None,
    normalization_rng: np.random.Generator | None = None,
    num_classes: int | None = None,
) -> Dataset:
    """Read a dataset and normalize it inside the privacy guarantee.

    ``normalization``: None (the dataset's default: ``public`` constants for mnist, fashion-mnist,
    cifar10 and svhn, ``none`` for digits and csv), ``"none"``, ``"public"``, ``"private"`` (needs
    ``normalization_epsilon`` and ``normalization_delta``; for csv also ``feature_range``), a
    ``(mean, std)`` pair, or a ``Dataset.preprocessing`` record to re-apply (e.g. on resume).
    ``normalization_rng`` is for tests only: by default private noise comes from OS entropy.
    See :func:`idpsgd.preprocessing.normalize`.

    csv only: ``feature_columns`` (the model's inputs, in this order) or ``drop_columns`` (columns
    that are not inputs), as lists or comma-separated text; ``budget_column``, a column of budgets
    that is never an input (see the module doc).

    ``num_classes``: the public class count K (labels 0..K-1).  Required for csv (there is no public
    default: it is never inferred from the rows); for the named datasets it is their documented
    count (:data:`NUM_CLASSES`, 10 for each) and may be given only as that.
    """
    if name not in LOADERS:
        raise InvalidParameterError("dataset", name, f"must be one of {sorted(LOADERS)}")
    num_classes = check_num_classes(name, num_classes)
    if name != "csv" and label_column != "label":
        raise InvalidParameterError("label_column", label_column, "only used with dataset csv")
    for flag, value in (("feature_columns", feature_columns), ("drop_columns", drop_columns)):
        if name != "csv" and value:
            raise InvalidParameterError(flag, value, "only used with dataset csv")
    if data_dir is not None and data_dir != "":
        data_dir = Path(data_dir)
        if name == "digits":
            raise InvalidParameterError(
                "data_dir", str(data_dir), "not used: dataset 'digits' is bundled with scikit-learn"
            )
    else:
        data_dir = None
    csv_args = {
        "label_column": label_column,
        "feature_columns": _names(feature_columns, "feature_columns"),
        "drop_columns": _names(drop_columns, "drop_columns"),
        "budget_column": budget_column,
        "num_classes": num_classes,
    }
    raw = LOADERS[name](data_dir, **(csv_args if name == "csv" else {}))
    xtr, xte, record = normalize(
        name,
        raw.x_train,
        raw.x_test,
        normalization,
        scaling=raw.scaling,
        value_range=raw.value_range,
        epsilon=normalization_epsilon,
        delta=normalization_delta,
        feature_range=feature_range,
        rng=normalization_rng,
    )
    return Dataset(
        name,
        torch.from_numpy(np.ascontiguousarray(xtr)),
        torch.from_numpy(raw.y_train.astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(xte)),
        torch.from_numpy(raw.y_test.astype(np.int64)),
        int(raw.num_classes),
        record,
        dict(raw.source),
        raw.split,
    )


#: the documented, public class count of each named dataset (csv: none, give ``num_classes``)
NUM_CLASSES = {"digits": 10, "mnist": 10, "fashion-mnist": 10, "cifar10": 10, "svhn": 10}


def check_num_classes(name: str, num_classes) -> int | None:
    """The public class count of dataset ``name``: ``num_classes`` for csv (required: an integer
    2..MAX_CSV_CLASSES), the documented count for the named datasets (``num_classes``, if given,
    must equal it)."""
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2
    ):
        raise InvalidParameterError("num_classes", num_classes, "must be an integer >= 2 (labels 0..K-1)")
    if name == "csv":
        if num_classes is None:
            raise InvalidParameterError(
                "num_classes",
                None,
                "is required for dataset csv: the number of classes K (labels 0..K-1) is public information "
                "you state, never inferred from the rows (max label + 1 would publish whether a row holds a "
                "rare class)",
            )
        if num_classes > MAX_CSV_CLASSES:
            raise InvalidParameterError("num_classes", num_classes, f"must be at most {MAX_CSV_CLASSES}")
        return int(num_classes)
    known = NUM_CLASSES.get(name)
    if num_classes is not None and known is not None and int(num_classes) != known:
        raise InvalidParameterError(
            "num_classes", num_classes, f"dataset {name!r} has {known} classes (its documented, public count)"
        )
    return None if num_classes is None else int(num_classes)


def _names(value, flag: str) -> list[str] | None:
    """Column names from a list or comma-separated text (None: not given)."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    if not names or any(not n for n in names):
        raise InvalidParameterError(flag, value, "must be comma-separated column names, e.g. age,income")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidParameterError(flag, value, f"names column {dupes[0]!r} twice")
    return names


def _to_unit(x: np.ndarray, top: float) -> np.ndarray:
    out = np.array(x, dtype=np.float32)  # a fresh float32 copy, divided in place
    out /= np.float32(top)
    return out


def _check_labels(y: np.ndarray, k: int, where, what: str) -> np.ndarray:
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise DatasetFileError(f"{where}: labels have type {y.dtype}; {what} labels are integers 0..{k - 1}")
    bad = np.flatnonzero((y < 0) | (y >= k))
    if bad.size:
        raise DatasetFileError(
            f"{where}: label {int(y[bad[0]])} (at index {int(bad[0])}) is out of range; {what} labels are 0..{k - 1}"
        )
    return y.astype(np.int64)


def _split(n, labels, where, test_fraction=0.2, seed=0):
    """Stratified train/test indices (public choice: fixed fraction and seed), or a clear error."""
    from sklearn.model_selection import train_test_split

    classes, counts = np.unique(labels, return_counts=True)
    n_test = math.ceil(test_fraction * n)
    if counts.min() < 2:
        raise DatasetFileError(
            f"{where}: class {classes[counts.argmin()]} has only 1 row; the stratified "
            f"{1 - test_fraction:.0%}/{test_fraction:.0%} train/test split needs at least 2 rows "
            "per class (add rows or give a test.csv)"
        )
    if n_test < len(classes) or n - n_test < len(classes):
        raise DatasetFileError(
            f"{where}: {n} rows are too few for a stratified {test_fraction:.0%} test split "
            f"over {len(classes)} classes (each split needs every class; add rows or give a "
            "test.csv)"
        )
    try:
        return train_test_split(np.arange(n), test_size=test_fraction, random_state=seed, stratify=labels)
    except ValueError as exc:
        raise DatasetFileError(f"{where}: the stratified train/test split failed ({exc})") from None


#: warned (a public, data-independent line) whenever a csv folder has no test.csv
HIDDEN_SPLIT_WARNING = (
    "csv without test.csv: the test metrics are computed on held-out rows of train.csv (a hidden 80/20 split) "
    "that no privacy guarantee covers, so they are not differentially private; give a public test.csv before "
    "publishing them"
)


def _position_split(n, test_fraction=0.2, seed=0):
    """Train/test indices of ``n`` rows from their positions alone (a fixed permutation of 0..n-1, seed
    0; the last ``ceil(test_fraction·n)`` test): a function of N only, never of the rows' values.

    A split stratified by the labels is a function of every label: removing or relabelling one row
    moved 16 to 24 of 90 rows between train and test, so neighbouring data sets trained on sets
    differing in many rows and no reported ε held.  Under zero-out neighbouring (N public) this
    split is the same for both neighbours: the training sets differ in the one example at most."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = math.ceil(test_fraction * n)
    return perm[n_test:], perm[:n_test]


@register("digits")
def load_digits(data_dir=None):
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = _to_unit(d.images[:, None, :, :], 16.0)
    tr, te = _split(len(x), d.target, "scikit-learn digits")
    return _Raw(x[tr], d.target[tr], x[te], d.target[te], 10, "pixel values / 16 (to [0, 1])", (0.0, 1.0))


def _need_dir(data_dir, name, files):
    if data_dir is None:
        raise DatasetFileError(f"dataset {name!r} needs --data-dir: a folder with {', '.join(files)}")
    return data_dir


# ---------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)

IDX_MAX_BYTES = 4 << 30  # a header claiming more is refused before anything is read


def _find(data_dir: Path, stem: str, name: str, expected: list[str]) -> Path:
    for cand in (data_dir / stem, data_dir / (stem + ".gz"), data_dir / stem.replace("-idx", ".idx")):
        if cand.is_file():
            return cand
    raise DatasetFileError(
        f"dataset {name!r}: {stem}[.gz] not found in {data_dir} (expected files: {', '.join(expected)})"
    )


def _read_exactly(fh, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        part = fh.read(min(size - got, 1 << 26))
        if not part:
            raise ValueError(f"truncated: {got} of the {size} data bytes its header announces")
        parts.append(part)
        got += len(part)
    if fh.read(1):
        raise ValueError(f"more data than the {size} bytes its header announces")
    return b"".join(parts)


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (LeCun's MNIST format: unsigned bytes), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            head = fh.read(4)
            if len(head) < 4:
                raise ValueError("empty file" if not head else "too short for an IDX header")
            zero, dtype_code, ndim = struct.unpack(">HBB", head)
            if zero != 0 or dtype_code != 0x08 or ndim == 0:
                raise ValueError("bad magic number: expected unsigned-byte IDX data")
            dims_raw = fh.read(4 * ndim)
            if len(dims_raw) < 4 * ndim:
                raise ValueError("truncated header")
            dims = struct.unpack(">" + "I" * ndim, dims_raw)
            size = math.prod(dims)
            if size > IDX_MAX_BYTES:
                raise ValueError(f"its header announces {size} bytes, more than this reader accepts ({IDX_MAX_BYTES})")
            data = _read_exactly(fh, size)
        return np.frombuffer(data, np.uint8).reshape(dims)
    except (OSError, EOFError, ValueError, struct.error, zlib.error) as exc:
        raise DatasetFileError(f"{path} is not a valid IDX file ({exc})") from None


def _idx_dataset(name, data_dir):
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    data_dir = _need_dir(data_dir, name, stems)
    paths = [_find(data_dir, s, name, stems) for s in stems]
    arrays = [read_idx(p) for p in paths]
    for (xp, yp), (x, y) in zip((paths[:2], paths[2:]), (arrays[:2], arrays[2:]), strict=True):
        if x.ndim != 3 or x.shape[1:] != (28, 28):
            raise DatasetFileError(
                f"{xp}: images of shape {x.shape[1:]} (array {x.shape}); {name} images are "
                "28x28 (an IDX array of shape (count, 28, 28))"
            )
        if y.ndim != 1:
            raise DatasetFileError(f"{yp}: labels of shape {y.shape}; expected a 1-D IDX array")
        if len(x) != len(y):
            raise DatasetFileError(f"{xp} holds {len(x)} images but {yp} holds {len(y)} labels")
        if len(x) == 0:
            raise DatasetFileError(f"{xp} holds no images")
        _check_labels(y, 10, yp, name)
    xtr, ytr, xte, yte = arrays
    return _Raw(
        _to_unit(xtr[:, None], 255.0),
        ytr.astype(np.int64),
        _to_unit(xte[:, None], 255.0),
        yte.astype(np.int64),
        10,
        "pixel values / 255 (to [0, 1])",
        (0.0, 1.0),
    )


@register("mnist")
def load_mnist(data_dir=None):
    return _idx_dataset("mnist", data_dir)


@register("fashion-mnist")
def load_fashion_mnist(data_dir=None):
    return _idx_dataset("fashion-mnist", data_dir)


# ---------------------------------------------------------------- CIFAR-10 (restricted unpickling)


def _numpy_attr(name: str, *modules: str):
    for mod in modules:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"numpy has no {name} in {modules}")


# (module, name) -> where numpy keeps it now.  Genuine CIFAR-10 batches (Python 2 cPickle of a dict
# of byte strings, a list of ints and a uint8 array) reference only the first three; files re-saved
# by Python 3 also use _frombuffer (numpy's protocol-5 reduction) or _codecs.encode (bytes below
# protocol 3).  All build plain data; nothing else can be named, so nothing else can run.
_RECONSTRUCT = ("_reconstruct", "numpy._core.multiarray", "numpy.core.multiarray")
_FROMBUFFER = ("_frombuffer", "numpy._core.numeric", "numpy.core.numeric")
CIFAR_PICKLE_GLOBALS: dict[tuple[str, str], tuple] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): ("ndarray", "numpy"),
    ("numpy", "dtype"): ("dtype", "numpy"),
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("_codecs", "encode"): ("encode", "_codecs"),
}


def cifar_pickle_globals() -> dict[tuple[str, str], object]:
    """:data:`CIFAR_PICKLE_GLOBALS` resolved in this numpy: the allow-list CIFAR-10 batches are
    unpickled with (:func:`idpsgd.io.load_restricted`); anything else is refused."""
    return {key: _numpy_attr(*where) for key, where in CIFAR_PICKLE_GLOBALS.items()}


def _get(d: dict, key: str):
    return d[key.encode()] if key.encode() in d else d.get(key)


def read_cifar_batch(p: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: images (n, 3, 32, 32) uint8 and labels (n,) int64."""
    try:
        with p.open("rb") as fh:
            d = load_restricted(fh, cifar_pickle_globals(), encoding="bytes")
    except RefusedPickle as exc:
        what = f"it names {exc.name}, which CIFAR-10 batches never contain" if exc.name else str(exc)
        raise DatasetFileError(f"{p} is not a CIFAR-10 python batch: {what} (refused without running it)") from None
    except EOFError:
        raise DatasetFileError(f"{p} is not a CIFAR-10 python batch (empty or truncated file)") from None
    except Exception as exc:
        raise DatasetFileError(f"{p} is not a CIFAR-10 python batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict):
        raise DatasetFileError(f"{p} is not a CIFAR-10 python batch (holds a {type(d).__name__}, expected a dict)")
    data, labels = _get(d, "data"), _get(d, "labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shown = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DatasetFileError(f"{p}: 'data' is a {shown}; a CIFAR-10 batch holds a uint8 array of shape (n, 3072)")
    if isinstance(labels, list) and all(type(v) is int for v in labels):
        labels = np.array(labels, dtype=np.int64)
    if not isinstance(labels, np.ndarray) or labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DatasetFileError(f"{p}: 'labels' must be a list of integers 0..9")
    if len(labels) != len(data):
        raise DatasetFileError(f"{p}: {len(data)} images but {len(labels)} labels")
    return data.reshape(-1, 3, 32, 32), _check_labels(labels, 10, p, "CIFAR-10")


@register("cifar10")
def load_cifar10(data_dir=None):
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    data_dir = _need_dir(data_dir, "cifar10", files)
    base = data_dir / "cifar-10-batches-py" if (data_dir / "cifar-10-batches-py").is_dir() else data_dir
    for f in files:
        if not (base / f).is_file():
            raise DatasetFileError(f"dataset 'cifar10': {f} not found in {base} (expected: {', '.join(files)})")
    parts = [read_cifar_batch(base / f) for f in files]
    xtr = np.concatenate([p[0] for p in parts[:5]])
    ytr = np.concatenate([p[1] for p in parts[:5]])
    xte, yte = parts[5]
    return _Raw(_to_unit(xtr, 255.0), ytr, _to_unit(xte, 255.0), yte, 10, "pixel values / 255 (to [0, 1])", (0.0, 1.0))


# ---------------------------------------------------------------- SVHN


def _read_svhn(p: Path) -> tuple[np.ndarray, np.ndarray]:
    from scipy.io import loadmat

    try:
        m = loadmat(p)
    except Exception as exc:
        raise DatasetFileError(f"{p} is not an SVHN .mat file ({type(exc).__name__}: {exc})") from None
    x, y = m.get("X"), m.get("y")
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise DatasetFileError(f"{p} is not an SVHN .mat file (expected arrays X and y)")
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.dtype != np.uint8:
        raise DatasetFileError(
            f"{p}: X is a {x.dtype} array of shape {x.shape}; SVHN's X is uint8 of shape (32, 32, 3, n)"
        )
    y = y.ravel()
    if len(y) != x.shape[3]:
        raise DatasetFileError(f"{p}: {x.shape[3]} images but {len(y)} labels")
    if x.shape[3] == 0:
        raise DatasetFileError(f"{p} holds no images")
    if y.dtype.kind not in "iuf":
        raise DatasetFileError(f"{p}: labels have type {y.dtype}; SVHN labels are integers 1..10 (10 means digit 0)")
    yv = y.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(yv) | (yv != np.round(yv)) | (yv < 1) | (yv > 10))
    if bad.size:
        raise DatasetFileError(
            f"{p}: label {yv[bad[0]]:g} (at index {bad[0]}) is out of range; SVHN labels are "
            "integers 1..10 (10 means digit 0)"
        )
    y = yv.astype(np.int64)
    return np.transpose(x, (3, 2, 0, 1)), y.astype(np.int64) % 10


@register("svhn")
def load_svhn(data_dir=None):
    files = ["train_32x32.mat", "test_32x32.mat"]
    data_dir = _need_dir(data_dir, "svhn", files)
    for f in files:
        if not (data_dir / f).is_file():
            raise DatasetFileError(f"dataset 'svhn': {f} not found in {data_dir} (expected: {', '.join(files)})")
    (xtr, ytr), (xte, yte) = (_read_svhn(data_dir / f) for f in files)
    return _Raw(_to_unit(xtr, 255.0), ytr, _to_unit(xte, 255.0), yte, 10, "pixel values / 255 (to [0, 1])", (0.0, 1.0))


# ---------------------------------------------------------------- CSV

MAX_CSV_CLASSES = 10_000  # labels must lie in 0..MAX_CSV_CLASSES-1 (the model has one output per class)


#: Column names (case-insensitive) taken as row identifiers and never used as features unless
#: named in ``feature_columns``; also pandas' written index ("" or "Unnamed: 0").
ID_COLUMNS = frozenset(
    {"", "id", "index", "row", "row_id", "rowid", "row_number", "example_id", "sample_id", "record_id", "uid", "uuid"}
)


def is_id_column(name: str) -> bool:
    """Whether a column name marks a row identifier (pandas' index ``""`` / ``Unnamed: k``, ``id``,
    ``index``, ``row_id``, ...): unique per row by construction, so as a model input it can only
    memorise individual rows (a privacy risk) and never generalise."""
    n = name.strip().lower()
    return n in ID_COLUMNS or n.startswith("unnamed:")


def choose_columns(
    header: list[str],
    label_column: str,
    feature_columns=None,
    drop_columns=None,
    budget_column: str | None = None,
    where="train.csv",
) -> tuple[list[str], dict[str, str]]:
    """(feature columns in order, {excluded column: why}) of a CSV header."""
    others = [h for h in header if h != label_column]
    if feature_columns is not None and drop_columns is not None:
        raise InvalidParameterError(
            "drop_columns", ",".join(drop_columns), "give either feature_columns or drop_columns, not both"
        )
    if feature_columns is not None:
        for c in feature_columns:
            if c == label_column:
                raise InvalidParameterError(
                    "feature_columns", ",".join(feature_columns), f"includes the label column {label_column!r}"
                )
            if budget_column is not None and c == budget_column:
                raise InvalidParameterError(
                    "feature_columns",
                    ",".join(feature_columns),
                    f"includes the budget column {budget_column!r}: budgets are never model inputs",
                )
            if c not in header:
                raise InvalidParameterError(
                    "feature_columns",
                    ",".join(feature_columns),
                    f"names column {c!r}, which {where} lacks (columns: {', '.join(header)})",
                )
        return list(feature_columns), {h: "not in feature_columns" for h in others if h not in feature_columns}
    excluded = {}
    for c in drop_columns or []:
        if c not in header:
            raise InvalidParameterError(
                "drop_columns",
                ",".join(drop_columns),
                f"names column {c!r}, which {where} lacks (columns: {', '.join(header)})",
            )
        if c == label_column:
            raise InvalidParameterError(
                "drop_columns", ",".join(drop_columns), f"includes the label column {label_column!r}"
            )
        excluded[c] = "dropped (drop_columns)"
    for h in others:
        if h in excluded:
            continue
        if budget_column is not None and h == budget_column:
            excluded[h] = "budget column (budgets are never model inputs)"
        elif is_id_column(h):
            excluded[h] = "row identifier (a value unique to its row can only memorise)"
    feats = [h for h in others if h not in excluded]
    if not feats:
        raise DatasetFileError(
            f"{where}: no feature columns besides the label column {label_column!r}"
            + (f" (left out: {', '.join(excluded)})" if excluded else "")
        )
    return feats, excluded


def read_csv_rows(p: Path):
    """(header, rows, file line of each row) of one CSV file, checked for shape and encoding."""
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise DatasetFileError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    if not raw.strip():
        raise DatasetFileError(f"{p} is empty (expected a header line and data rows)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetFileError(f"{p} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows, lines = [], []
    try:
        header = [h.strip() for h in next(reader)]
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # a blank line
            if len(row) != len(header):
                raise DatasetFileError(
                    f"{p}, line {reader.line_num}: {len(row)} fields, but the header has {len(header)}"
                )
            rows.append(row)
            lines.append(reader.line_num)
    except csv.Error as exc:
        raise DatasetFileError(f"{p}, line {reader.line_num}: not valid CSV ({exc})") from None
    dupes = sorted({h for h in header if header.count(h) > 1})
    if dupes:
        raise DatasetFileError(f"{p}: column {dupes[0]!r} appears more than once in the header")
    return header, rows, lines


def _read_table(p: Path, label_column: str, num_classes: int, feats=None, **choose):
    """Header, feature columns, excluded columns, feature matrix (float32, finite) and integer labels
    (class ids 0..``num_classes``-1) of one CSV file; ``feats`` fixes the feature columns (the test
    file takes the training file's), else they are chosen by :func:`choose_columns` with ``choose``."""
    header, rows, lines = read_csv_rows(p)
    if label_column not in header:
        raise DatasetFileError(f"{p}: no column {label_column!r} (columns: {', '.join(header)}; use --label-column)")
    if len(header) < 2:
        raise DatasetFileError(f"{p}: no feature columns besides the label column {label_column!r}")
    if not rows:
        raise DatasetFileError(f"{p} has a header but no data rows")
    excluded = {}
    if feats is None:
        feats, excluded = choose_columns(header, label_column, where=p.name, **choose)
    used = [header.index(label_column)] + [header.index(f) for f in feats]
    cells = np.array([[row[j] for j in used] for row in rows], dtype=str)
    try:
        values = cells.astype(np.float64)
    except ValueError:
        values = None
    if values is None:  # find the first bad cell, for the message
        for i, row in enumerate(rows):
            for j in used:
                c = row[j]
                try:
                    float(c)
                except ValueError:
                    raise DatasetFileError(
                        f"{p}, line {lines[i]}, column {header[j]!r}: {c!r} is not a number"
                        + (" (missing value)" if not c.strip() else "")
                    ) from None
    with np.errstate(over="ignore"):  # beyond float32: inf, refused below
        x = values[:, 1:].astype(np.float32)
    bad = np.argwhere(~np.isfinite(x))
    if bad.size:
        i, j = bad[0]
        raise DatasetFileError(
            f"{p}, line {lines[i]}, column {feats[j]!r}: {rows[i][header.index(feats[j])]!r} is "
            "not a finite number (NaN, inf or beyond the float32 range)"
        )
    y = values[:, 0]
    li = header.index(label_column)
    bad = np.flatnonzero(~np.isfinite(y) | (y != np.floor(y)) | (y < 0) | (y >= num_classes))
    if bad.size:
        i = bad[0]
        raise DatasetFileError(
            f"{p}, line {lines[i]}, column {label_column!r}: {rows[i][li]!r} is not a class "
            f"label (labels are the class ids 0..{num_classes - 1} of --num-classes {num_classes}; a label "
            "outside them is refused, never a new class)"
        )
    return header, feats, excluded, x, y.astype(np.int64)


@register("csv")
def load_csv(
    data_dir=None,
    label_column: str = "label",
    feature_columns=None,
    drop_columns=None,
    budget_column: str | None = None,
    num_classes: int | None = None,
):
    num_classes = check_num_classes("csv", num_classes)
    data_dir = _need_dir(data_dir, "csv", ["train.csv", "test.csv (optional)"])
    train = data_dir / "train.csv"
    if not train.is_file():
        raise DatasetFileError(
            f"dataset 'csv': train.csv not found in {data_dir} (expected train.csv "
            f"and optionally test.csv, with a {label_column!r} column)"
        )
    header, feats, excluded, x, y = _read_table(
        train,
        label_column,
        num_classes,
        feature_columns=feature_columns,
        drop_columns=drop_columns,
        budget_column=budget_column,
    )
    if len(x) < 2:
        raise DatasetFileError(f"{train} has {len(x)} data row; training needs at least 2")
    auto = {k: v for k, v in excluded.items() if not v.startswith(("dropped", "not in"))}
    if auto:
        warnings.warn(
            f"{train.name}: not used as features: "
            + "; ".join(f"{k!r} ({v})" for k, v in auto.items())
            + " (choose the inputs with --feature-columns / --drop-columns)",
            UserWarning,
            stacklevel=3,
        )
    source = {
        "format": "csv",
        "train_file": train.name,
        "label_column": label_column,
        "feature_columns": feats,
        "excluded_columns": excluded,
    }
    test = data_dir / "test.csv"
    split = None
    if test.is_file():
        theader = read_csv_rows(test)[0]
        missing = [f for f in [*feats, label_column] if f not in theader]
        extra = sorted(set(theader) - set(header))
        if missing or extra:
            raise DatasetFileError(
                f"{test}: its columns differ from {train.name}'s"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; extra {', '.join(extra)}" if extra else "")
            )
        _, _, _, xte, yte = _read_table(
            test, label_column, num_classes, feats=feats
        )  # the same columns, in train's order
        xtr, ytr = x, y
        source["test"] = test.name
    else:
        warnings.warn(HIDDEN_SPLIT_WARNING, UserWarning, stacklevel=2)
        tr, te = _position_split(len(x))  # a function of N only (stratifying by label: of every label)
        tr, te = np.sort(tr), np.sort(te)  # both keep train.csv's row order
        xtr, ytr, xte, yte = x[tr], y[tr], x[te], y[te]
        split = {"rows": len(x), "train_rows": tr.astype(np.int64), "test_rows": te.astype(np.int64)}
        source["test"] = (
            "hidden 80/20 split of train.csv's row positions (seed 0; a function of the row count only); "
            "training rows in file order; which rows train: private/data_split.csv; the test rows are private rows no "
            "guarantee covers, so the test metrics are not differentially private (give a public test.csv)"
        )
    source["num_classes"] = num_classes  # public: given, never read from the rows
    return _Raw(xtr, ytr, xte, yte, num_classes, "none (values as in the file)", None, source, split)
