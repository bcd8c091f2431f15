"""Datasets from local files in their standard formats (no network), as in-memory tensors.

* ``digits`` — scikit-learn's bundled 8×8 digits (the default); a deterministic, stratified
  80/20 train/test split (seed 0).
* ``mnist``, ``fashion-mnist`` — IDX files (``train-images-idx3-ubyte`` etc., gzipped or not).
* ``cifar10`` — the python pickle batches (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``).
* ``svhn`` — ``train_32x32.mat`` / ``test_32x32.mat`` (scipy.io.loadmat; label 10 means 0).
* ``csv`` — ``train.csv`` (and optional ``test.csv``) with a label column (``--label-column``);
  without a test file, a deterministic 80/20 split.

A missing or corrupt file raises an error that names the files expected and where.  Images are
scaled to [0, 1] and standardized with the training set's per-channel mean and std.
"""
from __future__ import annotations

import csv
import gzip
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .validation import InvalidParameterError


class DatasetFileError(FileNotFoundError):
    """A dataset file is missing or unreadable; the message names what is expected and where."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple:
        return tuple(self.x_train.shape[1:])


LOADERS: dict[str, Callable[..., Dataset]] = {}


def register(name):
    def deco(fn):
        LOADERS[name] = fn
        return fn
    return deco


def load_dataset(name: str, data_dir=None, **kwargs) -> Dataset:
    if name not in LOADERS:
        raise InvalidParameterError("dataset", name, f"must be one of {sorted(LOADERS)}")
    return LOADERS[name](Path(data_dir) if data_dir else None, **kwargs)


def _finish(name, xtr, ytr, xte, yte, num_classes=None) -> Dataset:
    xtr, xte = np.asarray(xtr, np.float32), np.asarray(xte, np.float32)
    axes = tuple(i for i in range(xtr.ndim) if i != 1) if xtr.ndim == 4 else (0,)
    mean, std = xtr.mean(axis=axes, keepdims=True), xtr.std(axis=axes, keepdims=True) + 1e-6
    ytr, yte = np.asarray(ytr, np.int64), np.asarray(yte, np.int64)
    k = int(num_classes or max(ytr.max(), yte.max() if yte.size else 0) + 1)
    return Dataset(name, torch.from_numpy((xtr - mean) / std), torch.from_numpy(ytr),
                   torch.from_numpy((xte - mean) / std), torch.from_numpy(yte), k)


def _split(n, labels, test_fraction=0.2, seed=0):
    from sklearn.model_selection import train_test_split
    return train_test_split(np.arange(n), test_size=test_fraction, random_state=seed, stratify=labels)


@register("digits")
def load_digits(data_dir=None, **_):
    from sklearn.datasets import load_digits as sk_digits
    d = sk_digits()
    x = (d.images / 16.0)[:, None, :, :]
    tr, te = _split(len(x), d.target)
    return _finish("digits", x[tr], d.target[tr], x[te], d.target[te], 10)


def _need_dir(data_dir, name, files):
    if data_dir is None:
        raise DatasetFileError(f"dataset {name!r} needs --data-dir: a folder with {', '.join(files)}")
    return data_dir


def _find(data_dir: Path, stem: str, name: str, expected: list[str]) -> Path:
    for cand in (data_dir / stem, data_dir / (stem + ".gz"), data_dir / stem.replace("-idx", ".idx")):
        if cand.is_file():
            return cand
    raise DatasetFileError(f"dataset {name!r}: {stem}[.gz] not found in {data_dir} "
                           f"(expected files: {', '.join(expected)})")


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (LeCun's MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError("bad magic number")
        dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
        data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
        return data.reshape(dims)
    except (OSError, ValueError, struct.error) as exc:
        raise DatasetFileError(f"{path} is not a valid IDX file ({exc})") from None


def _idx_dataset(name, data_dir):
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte"]
    data_dir = _need_dir(data_dir, name, stems)
    xtr, ytr, xte, yte = (read_idx(_find(data_dir, s, name, stems)) for s in stems)
    if len(xtr) != len(ytr) or len(xte) != len(yte):
        raise DatasetFileError(f"dataset {name!r} in {data_dir}: image and label counts differ")
    return _finish(name, xtr[:, None] / 255.0, ytr, xte[:, None] / 255.0, yte, 10)


@register("mnist")
def load_mnist(data_dir=None, **_):
    return _idx_dataset("mnist", data_dir)


@register("fashion-mnist")
def load_fashion_mnist(data_dir=None, **_):
    return _idx_dataset("fashion-mnist", data_dir)


@register("cifar10")
def load_cifar10(data_dir=None, **_):
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    data_dir = _need_dir(data_dir, "cifar10", files)
    base = data_dir / "cifar-10-batches-py" if (data_dir / "cifar-10-batches-py").is_dir() else data_dir

    def read(f):
        p = base / f
        if not p.is_file():
            raise DatasetFileError(f"dataset 'cifar10': {f} not found in {base} (expected: {', '.join(files)})")
        try:
            with p.open("rb") as fh:
                d = pickle.load(fh, encoding="bytes")
            return np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"labels"])
        except Exception as exc:  # noqa: BLE001  (any unpickling failure means a corrupt file)
            raise DatasetFileError(f"{p} is not a CIFAR-10 python batch ({exc})") from None

    parts = [read(f) for f in files[:5]]
    xte, yte = read("test_batch")
    xtr = np.concatenate([p[0] for p in parts]) / 255.0
    ytr = np.concatenate([p[1] for p in parts])
    return _finish("cifar10", xtr, ytr, xte / 255.0, yte, 10)


@register("svhn")
def load_svhn(data_dir=None, **_):
    from scipy.io import loadmat
    files = ["train_32x32.mat", "test_32x32.mat"]
    data_dir = _need_dir(data_dir, "svhn", files)
    out = []
    for f in files:
        p = data_dir / f
        if not p.is_file():
            raise DatasetFileError(f"dataset 'svhn': {f} not found in {data_dir} (expected: {', '.join(files)})")
        try:
            m = loadmat(p)
            x = np.transpose(m["X"], (3, 2, 0, 1)) / 255.0
            y = m["y"].ravel().astype(np.int64) % 10
        except Exception as exc:  # noqa: BLE001
            raise DatasetFileError(f"{p} is not an SVHN .mat file with X and y ({exc})") from None
        out += [x, y]
    return _finish("svhn", *out, 10)


@register("csv")
def load_csv(data_dir=None, label_column: str = "label", **_):
    data_dir = _need_dir(data_dir, "csv", ["train.csv", "test.csv (optional)"])

    def read(p):
        with p.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        if not rows or label_column not in rows[0]:
            raise DatasetFileError(f"{p}: no column {label_column!r} (use --label-column)")
        feats = [k for k in rows[0] if k != label_column]
        try:
            x = np.array([[float(r[k]) for k in feats] for r in rows], np.float32)
            y = np.array([int(float(r[label_column])) for r in rows])
        except ValueError as exc:
            raise DatasetFileError(f"{p}: non-numeric value ({exc})") from None
        return x, y

    train = data_dir / "train.csv"
    if not train.is_file():
        raise DatasetFileError(f"dataset 'csv': train.csv not found in {data_dir} (expected train.csv "
                               f"and optionally test.csv, with a {label_column!r} column)")
    x, y = read(train)
    if (data_dir / "test.csv").is_file():
        xte, yte = read(data_dir / "test.csv")
        return _finish("csv", x, y, xte, yte)
    tr, te = _split(len(x), y)
    return _finish("csv", x[tr], y[tr], x[te], y[te])
