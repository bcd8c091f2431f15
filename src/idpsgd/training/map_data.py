"""Any map-style torch ``Dataset`` as the data of :func:`idpsgd.train` (the harness with
checkpoints and reports), beside the in-memory :class:`idpsgd.data.Dataset`.

What the harness needs beyond the items, and where it comes from:

* the items: ``(input, label)`` pairs (``dataset[i]``), collated by ``default_collate`` (or the
  given ``collate_fn``) into the batches the model trains on; the test set likewise;
* ``num_classes``: an argument (the report's per-class accuracy and the registry models' output
  width; counting the labels would read every private label, so it is not inferred);
* the input shape: that of the first training item's input (for a registry model);
* the identity of the data for ``resume``: ``fingerprint`` if given (e.g. a dataset version), else
  a SHA-256 over every item of both sets (one pass over the data, once per run; a dataset whose
  items are random — augmentation — must pass its own ``fingerprint``).  Private either way: it
  goes only into the private checkpoint.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data._utils.collate import default_collate

from ..analysis.metrics import accuracies
from ..validation import InvalidParameterError


def _check_map_style(ds, name: str) -> int:
    if not isinstance(ds, TorchDataset) or isinstance(ds, IterableDataset):
        raise InvalidParameterError(
            name,
            type(ds).__name__,
            "must be a map-style torch.utils.data.Dataset (with __len__ and __getitem__) or an idpsgd.data.Dataset",
        )
    try:
        n = len(ds)
    except TypeError:
        raise InvalidParameterError(name, type(ds).__name__, "must have a length (__len__)") from None
    if n < 1:
        raise InvalidParameterError(name, f"an empty {type(ds).__name__}", "needs at least one example")
    return n


def _pair(item, name: str):
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        shown = type(item).__name__ + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
        raise InvalidParameterError(
            name,
            shown,
            "items must be (input, label) pairs for idpsgd.train; for other "
            "items use IndividualizedPrivacyEngine on your own loop",
        )
    x, y = item
    label = torch.as_tensor(y)
    if label.numel() != 1 or label.dtype.is_floating_point or label.dtype == torch.bool:
        raise InvalidParameterError(name, f"label {y!r}", "labels must be integer class indices")
    return torch.as_tensor(x), int(label)


class MapStyleData:
    """Train and test map-style torch Datasets with what :class:`~idpsgd.training.Trainer` needs.

    Args:
        train, test: map-style datasets of ``(input, label)`` items.
        num_classes: the number of classes (labels 0..num_classes-1), >= 2.
        name: the report's dataset name (default: the training set's class name).
        fingerprint: the data's identity for resume (default: a hash over every item).
        collate_fn: collates items into batches (default ``default_collate``).
    """

    def __init__(
        self, train, test, num_classes: int, name: str | None = None, fingerprint: str | None = None, collate_fn=None
    ):
        self.n_train = _check_map_style(train, "dataset")
        if test is None:
            raise InvalidParameterError(
                "test_dataset", None, "is required with a torch Dataset: the report's test metrics are computed on it"
            )
        self.n_test = _check_map_style(test, "test_dataset")
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
            raise InvalidParameterError(
                "num_classes",
                num_classes,
                "is required with a torch Dataset: an integer >= 2 (labels 0..num_classes-1)",
            )
        x0, _ = _pair(train[0], "dataset")
        _pair(test[0], "test_dataset")
        self.train, self.test = train, test
        self.num_classes = int(num_classes)
        self.input_shape = tuple(x0.shape)
        self.name = name or type(train).__name__
        self.preprocessing: dict = {}
        self.source = {
            "format": "torch Dataset",
            "train": type(train).__name__,
            "test": type(test).__name__,
            "train_examples": self.n_train,
            "test_examples": self.n_test,
        }
        self.split = None
        self.collate_fn = collate_fn or default_collate
        self._fingerprint = fingerprint

    def train_loader(self, batch_size: int) -> DataLoader:
        return DataLoader(self.train, batch_size=batch_size, collate_fn=self.collate_fn)

    def fingerprint(self) -> str:
        """The data's identity for resume (private: a function of the training data)."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"idpsgd-map-dataset-fingerprint-v1\0")
            h.update(json.dumps({"name": self.name, "num_classes": self.num_classes}, sort_keys=True).encode())
            for key, ds in (("train", self.train), ("test", self.test)):
                h.update(f"\0{key}:{len(ds)}\0".encode())
                for i in range(len(ds)):
                    x, y = _pair(ds[i], key)
                    t = x.detach().cpu().contiguous()
                    h.update(f"{t.dtype}:{tuple(t.shape)}:{y}\0".encode())
                    h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def evaluate(self, model: torch.nn.Module, batch_size: int = 512) -> dict:
        """Accuracy, per-class accuracy and mean cross-entropy on the test set."""
        device = next(model.parameters()).device
        was = model.training
        model.eval()
        preds, labels, loss = [], [], 0.0
        with torch.no_grad():
            for x, y in DataLoader(self.test, batch_size=batch_size, collate_fn=self.collate_fn):
                out = model(x.to(device))
                y = torch.as_tensor(y).long()
                loss += float(torch.nn.functional.cross_entropy(out, y.to(device), reduction="sum"))
                preds.append(out.argmax(1).cpu())
                labels.append(y.cpu())
        model.train(was)
        y = torch.cat(labels)
        return {**accuracies(torch.cat(preds), y, self.num_classes), "loss": loss / max(len(y), 1)}


def as_training_data(dataset, test_dataset=None, num_classes=None, name=None, fingerprint=None):
    """``dataset`` itself when it is an :class:`idpsgd.data.Dataset` (then the other arguments must be
    left out), else a :class:`MapStyleData` over the torch datasets."""
    from ..data import Dataset

    if isinstance(dataset, (Dataset, MapStyleData)):
        for arg, value in (("test_dataset", test_dataset), ("num_classes", num_classes), ("fingerprint", fingerprint)):
            if value is not None:
                raise InvalidParameterError(
                    arg,
                    value if isinstance(value, (int, str)) else type(value).__name__,
                    "is only for torch Datasets: an idpsgd.data.Dataset carries its test "
                    "split, classes and fingerprint",
                )
        return dataset
    return MapStyleData(dataset, test_dataset, num_classes, name=name, fingerprint=fingerprint)


def num_train(dataset) -> int:
    """Training examples of an idpsgd Dataset or a MapStyleData."""
    return dataset.n_train if isinstance(dataset, MapStyleData) else len(dataset.y_train)
