"""Datasets from tiny files in each standard format, and the model registry."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator

from idpsgd import InvalidParameterError
from idpsgd.data import DatasetFileError, load_dataset
from idpsgd.models import DEFAULT_MODEL, MODELS, create_model


def _write_idx(path, arr, gz=False):
    arr = np.asarray(arr, np.uint8)
    raw = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape) + arr.tobytes()
    (gzip.open if gz else open)(path, "wb").write(raw)


def _mnist_files(folder, rng, gz, n=12, m=6):
    for prefix, k in (("train", n), ("t10k", m)):
        suffix = ".gz" if gz else ""
        _write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (k, 28, 28)), gz)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(k) % 10, gz)


def test_digits_is_deterministic_and_stratified():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape == (1437, 1, 8, 8) and a.x_test.shape == (360, 1, 8, 8) and a.num_classes == 10
    # default normalization 'none': pixels / 16 only (no statistic of the private training set)
    assert float(a.x_train.min()) == 0.0 and float(a.x_train.max()) == 1.0
    assert torch.equal(a.x_train * 16, torch.round(a.x_train * 16))
    assert a.preprocessing["mode"] == "none" and a.preprocessing["epsilon"] == 0.0
    counts = np.bincount(a.y_test.numpy(), minlength=10)
    assert counts.min() >= 35  # stratified: every class present


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_datasets(tmp_path, rng, name, gz):
    _mnist_files(tmp_path, rng, gz)
    d = load_dataset(name, tmp_path)
    assert d.x_train.shape == (12, 1, 28, 28) and d.x_test.shape == (6, 1, 28, 28)
    assert d.y_train.tolist() == [i % 10 for i in range(12)] and d.name == name


def test_idx_missing_and_corrupt_files_name_what_is_expected(tmp_path, rng):
    with pytest.raises(DatasetFileError, match="needs --data-dir"):
        load_dataset("mnist")
    with pytest.raises(DatasetFileError, match=r"train-images-idx3-ubyte\[.gz\] not found in .*expected files"):
        load_dataset("mnist", tmp_path)
    _mnist_files(tmp_path, rng, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x01\x02garbage")
    with pytest.raises(DatasetFileError, match="t10k-labels-idx1-ubyte is not a valid IDX file"):
        load_dataset("mnist", tmp_path)


def test_cifar10_pickle_batches(tmp_path, rng):
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    raw = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        raw[name] = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        with open(base / name, "wb") as fh:
            pickle.dump({b"data": raw[name], b"labels": [0, 1, 2, 9]}, fh)
    d = load_dataset("cifar10", tmp_path)
    assert d.x_train.shape == (20, 3, 32, 32) and d.x_test.shape == (4, 3, 32, 32)
    # standardized per channel with the published constants, not the training set's statistics
    assert d.preprocessing["mode"] == "public"
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    expect = (raw["test_batch"].reshape(-1, 3, 32, 32) / 255.0 - mean[:, None, None]) / std[:, None, None]
    assert np.allclose(d.x_test.numpy(), expect, atol=1e-5)
    (base / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DatasetFileError, match="data_batch_3 is not a CIFAR-10 python batch"):
        load_dataset("cifar10", tmp_path)
    (base / "test_batch").unlink()
    (base / "data_batch_3").unlink()
    with pytest.raises(DatasetFileError, match="data_batch_3 not found"):
        load_dataset("cifar10", tmp_path)


def test_svhn_mat_files(tmp_path, rng):
    from scipy.io import savemat

    for name, k in (("train_32x32.mat", 5), ("test_32x32.mat", 3)):
        savemat(
            tmp_path / name,
            {
                "X": rng.integers(0, 256, (32, 32, 3, k), dtype=np.uint8),
                "y": np.array([[10], [1], [2], [3], [4]][:k], dtype=np.uint8),
            },
        )
    d = load_dataset("svhn", tmp_path)
    assert d.x_train.shape == (5, 3, 32, 32) and d.y_train.tolist() == [0, 1, 2, 3, 4]  # 10 means 0
    (tmp_path / "test_32x32.mat").unlink()
    with pytest.raises(DatasetFileError, match=r"test_32x32.mat not found .*expected: train_32x32.mat, test_32x32.mat"):
        load_dataset("svhn", tmp_path)


def test_csv_tables(tmp_path):
    rows = ["a,b,target"] + [f"{i},{i % 3},{i % 2}" for i in range(30)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    d = load_dataset("csv", tmp_path, label_column="target", num_classes=2)
    assert d.x_train.shape == (24, 2) and d.x_test.shape == (6, 2) and d.num_classes == 2
    again = load_dataset("csv", tmp_path, label_column="target", num_classes=2)
    assert torch.equal(d.x_test, again.x_test)
    (tmp_path / "test.csv").write_text("a,b,target\n1,2,1\n3,4,0\n")
    assert load_dataset("csv", tmp_path, label_column="target", num_classes=2).x_test.shape == (2, 2)
    with pytest.raises(DatasetFileError, match="no column 'label'"):
        load_dataset("csv", tmp_path, num_classes=2)
    (tmp_path / "train.csv").write_text("a,label\nx,1\n")
    with pytest.raises(DatasetFileError, match="line 2, column 'a': 'x' is not a number"):
        load_dataset("csv", tmp_path, num_classes=2)


def test_unknown_dataset_and_model():
    with pytest.raises(InvalidParameterError, match="dataset='imagenet' is invalid: must be one of"):
        load_dataset("imagenet")
    with pytest.raises(InvalidParameterError, match="model='vgg' is invalid"):
        create_model("vgg", (1, 8, 8), 10)


SHAPES = {
    "digits_cnn": (1, 8, 8),
    "tramer_boneh_mnist": (1, 28, 28),
    "tramer_boneh_cifar10": (3, 32, 32),
    "lenet5": (1, 28, 28),
    "heo_svhn": (3, 32, 32),
    "heo_mnist": (1, 28, 28),
    "resnet20": (3, 32, 32),
    "wrn16_4": (3, 16, 16),
    "mlp": (7,),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_are_opacus_compatible_with_per_sample_gradients(name):
    torch.manual_seed(0)
    model = create_model(name, SHAPES[name], 10)
    assert ModuleValidator.validate(model, strict=False) == []
    gsm = GradSampleModule(model)
    x = torch.randn(3, *SHAPES[name])
    torch.nn.functional.cross_entropy(gsm(x), torch.tensor([0, 1, 2])).backward()
    assert gsm(x).shape == (3, 10)
    for p in gsm.parameters():
        assert p.grad_sample.shape == (3, *p.shape)
    assert set(DEFAULT_MODEL.values()) <= set(MODELS)
