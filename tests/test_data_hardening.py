"""No code runs from a data file and every bad data file is one clean line (issue 17); normalization
stays inside the guarantee (issue 16); the models' shape checks and Dataset.fingerprint."""

import gzip
import io
import math
import os
import pickle
import struct

import numpy as np
import pytest
import torch
from scipy.io import savemat

from idpsgd import InvalidParameterError
from idpsgd.accounting.release import analytic_gaussian_sigma
from idpsgd.data import DatasetFileError, load_dataset
from idpsgd.models import create_model
from idpsgd.preprocessing import (
    PUBLIC_CONSTANTS,
    add_remove_sensitivity,
    moment_sums,
    parse_feature_range,
    parse_normalization,
    private_mean_std,
)

# ----------------------------------------------------------------------------- file builders


def idx(arr, magic=b"\x00\x00\x08", dims=None) -> bytes:
    arr = np.asarray(arr, np.uint8)
    dims = arr.shape if dims is None else dims
    return magic + bytes([len(dims)]) + struct.pack(">" + "I" * len(dims), *dims) + arr.tobytes()


def mnist(n=12, m=6, labels=None, images=None, **override) -> dict:
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": idx(rng.integers(0, 256, (n, 28, 28)) if images is None else images),
        "train-labels-idx1-ubyte": idx(np.arange(n) % 10 if labels is None else labels),
        "t10k-images-idx3-ubyte": idx(rng.integers(0, 256, (m, 28, 28))),
        "t10k-labels-idx1-ubyte": idx(np.arange(m) % 10),
    }
    files.update(override)
    return files


def cifar_batch(n=4, data=None, labels=None, **extra) -> bytes:
    d = {
        b"batch_label": b"training batch",
        b"filenames": [b"x.png"] * n,
        b"data": np.random.default_rng(1).integers(0, 256, (n, 3072), dtype=np.uint8) if data is None else data,
        b"labels": [0, 1, 2, 9][:n] if labels is None else labels,
        **extra,
    }
    return pickle.dumps(d)


def cifar(**override) -> dict:
    files = {f"data_batch_{i}": cifar_batch() for i in range(1, 6)}
    files["test_batch"] = cifar_batch()
    files.update(override)
    return files


def mat(x=None, y=None, n=5, drop=()) -> bytes:
    d = {
        "X": np.random.default_rng(2).integers(0, 256, (32, 32, 3, n), dtype=np.uint8) if x is None else x,
        "y": (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8) if y is None else y,
    }
    buf = io.BytesIO()
    savemat(buf, {k: v for k, v in d.items() if k not in drop})
    return buf.getvalue()


def svhn(**override) -> dict:
    files = {"train_32x32.mat": mat(), "test_32x32.mat": mat(n=3)}
    files.update(override)
    return files


CSV_OK = "a,b,label\n" + "".join(f"{i},{i % 7},{i % 3}\n" for i in range(30))


def csv_with(*lines, header="a,b,label", base=True) -> str:
    return header + "\n" + (CSV_OK.split("\n", 1)[1] if base else "") + "".join(line + "\n" for line in lines)


def write(folder, files: dict):
    for name, content in files.items():
        path = folder / name
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)


# ----------------------------------------------------------------------------- the table
# (id, dataset, files, load_dataset kwargs, expected message regex): every case is DatasetFileError,
# one line naming the file.

BAD_FILES = [
    # --- csv
    (
        "csv ragged row",
        "csv",
        {"train.csv": csv_with("1,2,3,0")},
        {},
        r"train.csv, line 32: 4 fields, but the header has 3",
    ),
    ("csv short row", "csv", {"train.csv": csv_with("1,0")}, {}, r"train.csv, line 32: 2 fields, but the header has 3"),
    (
        "csv missing value",
        "csv",
        {"train.csv": csv_with("1,,0")},
        {},
        r"line 32, column 'b': '' is not a number \(missing value\)",
    ),
    ("csv non-numeric", "csv", {"train.csv": csv_with("1,x,0")}, {}, r"line 32, column 'b': 'x' is not a number"),
    (
        "csv non-utf8",
        "csv",
        {"train.csv": CSV_OK.encode() + b"1,\xff\xfe,0\n"},
        {},
        r"train.csv is not UTF-8 text \(byte 0xff",
    ),
    (
        "csv one row",
        "csv",
        {"train.csv": csv_with("1,2,0", base=False)},
        {},
        r"has 1 data row; training needs at least 2",
    ),
    ("csv nan feature", "csv", {"train.csv": csv_with("nan,2,0")}, {}, r"column 'a': 'nan' is not a finite number"),
    ("csv inf feature", "csv", {"train.csv": csv_with("1,-inf,0")}, {}, r"column 'b': '-inf' is not a finite number"),
    ("csv float32 overflow", "csv", {"train.csv": csv_with("1e39,2,0")}, {}, r"'1e39' is not a finite number"),
    (
        "csv fractional label",
        "csv",
        {"train.csv": csv_with("1,2,1.5")},
        {},
        r"column 'label': '1.5' is not a class label",
    ),
    ("csv negative label", "csv", {"train.csv": csv_with("1,2,-1")}, {}, r"'-1' is not a class label"),
    ("csv text label", "csv", {"train.csv": csv_with("1,2,cat")}, {}, r"column 'label': 'cat' is not a number"),
    ("csv nan label", "csv", {"train.csv": csv_with("1,2,nan")}, {}, r"'nan' is not a class label"),
    (
        "csv huge label",
        "csv",
        {"train.csv": csv_with("1,2,1e9")},
        {},
        r"'1e9' is not a class label \(labels are the class ids 0..9 of --num-classes 10",
    ),
    (
        "csv label beyond num_classes",
        "csv",
        {"train.csv": csv_with("1,2,3")},
        {"num_classes": 3},
        r"train.csv, line 32, column 'label': '3' is not a class label \(labels are the class ids 0..2 of "
        r"--num-classes 3; a label outside them is refused, never a new class\)",
    ),
    (
        "csv test label beyond num_classes",
        "csv",
        {"train.csv": CSV_OK, "test.csv": "a,b,label\n1,2,0\n3,4,5\n"},
        {"num_classes": 3},
        r"test.csv, line 3, column 'label': '5' is not a class label",
    ),
    ("csv empty", "csv", {"train.csv": ""}, {}, r"train.csv is empty"),
    ("csv whitespace only", "csv", {"train.csv": "\n  \n"}, {}, r"train.csv is empty"),
    ("csv header only", "csv", {"train.csv": "a,b,label\n"}, {}, r"has a header but no data rows"),
    (
        "csv no label column",
        "csv",
        {"train.csv": CSV_OK.replace("label", "target")},
        {},
        r"no column 'label' \(columns: a, b, target",
    ),
    ("csv label only", "csv", {"train.csv": "label\n0\n1\n"}, {}, r"no feature columns"),
    (
        "csv duplicate column",
        "csv",
        {"train.csv": CSV_OK.replace("a,b,", "a,a,")},
        {},
        r"column 'a' appears more than once",
    ),
    (
        "csv test other columns",
        "csv",
        {"train.csv": CSV_OK, "test.csv": "a,c,label\n1,2,0\n"},
        {},
        r"test.csv: its columns differ from train.csv's; missing b; extra c",
    ),
    (
        "csv test nan",
        "csv",
        {"train.csv": CSV_OK, "test.csv": "a,b,label\n1,nan,0\n"},
        {},
        r"test.csv, line 2, column 'b'",
    ),
    ("csv test empty", "csv", {"train.csv": CSV_OK, "test.csv": ""}, {}, r"test.csv is empty"),
    ("csv missing train", "csv", {"test.csv": CSV_OK}, {}, r"train.csv not found in"),
    # --- mnist / fashion-mnist (IDX)
    (
        "mnist label 10",
        "mnist",
        mnist(labels=[0] * 11 + [10]),
        {},
        r"train-labels-idx1-ubyte: label 10 \(at index 11\) is out of range; mnist labels are 0..9",
    ),
    (
        "fashion label 255",
        "fashion-mnist",
        mnist(labels=[255] * 12),
        {},
        r"label 255 \(at index 0\) is out of range; fashion-mnist",
    ),
    (
        "mnist count mismatch",
        "mnist",
        mnist(labels=np.arange(11) % 10),
        {},
        r"holds 12 images but .*train-labels-idx1-ubyte holds 11 labels",
    ),
    (
        "mnist wrong dims",
        "mnist",
        mnist(images=np.zeros((12, 27, 28))),
        {},
        r"images of shape \(27, 28\).*mnist images are 28x28",
    ),
    ("mnist flat images", "mnist", mnist(images=np.zeros((12, 784))), {}, r"images of shape \(784,\)"),
    ("mnist 2-d labels", "mnist", mnist(labels=np.zeros((12, 1))), {}, r"labels of shape \(12, 1\); expected a 1-D"),
    ("mnist no images", "mnist", mnist(n=0, labels=np.zeros(0)), {}, r"holds no images"),
    (
        "mnist empty file",
        "mnist",
        mnist(**{"t10k-labels-idx1-ubyte": b""}),
        {},
        r"t10k-labels-idx1-ubyte is not a valid IDX file \(empty file\)",
    ),
    (
        "mnist truncated",
        "mnist",
        mnist(**{"t10k-images-idx3-ubyte": idx(np.zeros((6, 28, 28)))[:-5]}),
        {},
        r"truncated: 4699 of the 4704",
    ),
    (
        "mnist trailing bytes",
        "mnist",
        mnist(**{"t10k-labels-idx1-ubyte": idx(np.arange(6)) + b"x"}),
        {},
        r"more data than the 6 bytes",
    ),
    (
        "mnist bad magic",
        "mnist",
        mnist(**{"t10k-labels-idx1-ubyte": idx(np.arange(6), magic=b"\x00\x00\x0d")}),
        {},
        r"bad magic number",
    ),
    (
        "mnist huge header",
        "mnist",
        mnist(**{"t10k-labels-idx1-ubyte": idx([], dims=(4_000_000_000, 4))}),
        {},
        r"more than this reader accepts",
    ),
    (
        "mnist corrupt gzip",
        "mnist",
        {
            **{k + ".gz": gzip.compress(v) for k, v in mnist().items()},
            "train-images-idx3-ubyte.gz": b"\x1f\x8b\x08garbage",
        },
        {},
        r"train-images-idx3-ubyte.gz is not a valid IDX file",
    ),
    (
        "mnist missing file",
        "mnist",
        {k: v for k, v in mnist().items() if "t10k-images" not in k},
        {},
        r"t10k-images-idx3-ubyte\[.gz\] not found",
    ),
    # --- cifar10
    (
        "cifar wrong shape",
        "cifar10",
        cifar(data_batch_2=cifar_batch(data=np.zeros((4, 3000), np.uint8))),
        {},
        r"data_batch_2: 'data' is a uint8 array of shape \(4, 3000\)",
    ),
    (
        "cifar float data",
        "cifar10",
        cifar(test_batch=cifar_batch(data=np.zeros((4, 3072)))),
        {},
        r"test_batch: 'data' is a float64 array",
    ),
    (
        "cifar label count",
        "cifar10",
        cifar(data_batch_1=cifar_batch(labels=[0, 1, 2])),
        {},
        r"data_batch_1: 4 images but 3 labels",
    ),
    (
        "cifar label 10",
        "cifar10",
        cifar(data_batch_5=cifar_batch(labels=[0, 1, 10, 2])),
        {},
        r"data_batch_5: label 10 \(at index 2\) is out of range",
    ),
    (
        "cifar float labels",
        "cifar10",
        cifar(data_batch_1=cifar_batch(labels=[0.5, 1, 2, 3])),
        {},
        r"'labels' must be a list of integers 0..9",
    ),
    ("cifar not a dict", "cifar10", cifar(data_batch_1=pickle.dumps([1, 2, 3])), {}, r"holds a list, expected a dict"),
    ("cifar no data key", "cifar10", cifar(data_batch_1=pickle.dumps({b"labels": [1]})), {}, r"'data' is a NoneType"),
    (
        "cifar empty file",
        "cifar10",
        cifar(data_batch_3=b""),
        {},
        r"data_batch_3 is not a CIFAR-10 python batch \(empty or truncated",
    ),
    (
        "cifar truncated",
        "cifar10",
        cifar(data_batch_3=cifar_batch()[:-100]),
        {},
        r"data_batch_3 is not a CIFAR-10 python batch",
    ),
    (
        "cifar garbage",
        "cifar10",
        cifar(data_batch_3=b"not a pickle"),
        {},
        r"data_batch_3 is not a CIFAR-10 python batch",
    ),
    (
        "cifar foreign class",
        "cifar10",
        cifar(data_batch_4=pickle.dumps({b"data": io.BytesIO()})),
        {},
        r"data_batch_4 is not a CIFAR-10 python batch: it names _io.BytesIO, which CIFAR-10 batches never contain",
    ),
    (
        "cifar missing batch",
        "cifar10",
        {k: v for k, v in cifar().items() if k != "data_batch_2"},
        {},
        r"data_batch_2 not found",
    ),
    # --- svhn
    (
        "svhn label 11",
        "svhn",
        svhn(**{"train_32x32.mat": mat(y=np.array([[1], [2], [11], [3], [4]], np.uint8))}),
        {},
        r"train_32x32.mat: label 11 \(at index 2\) is out of range; SVHN labels are integers 1..10",
    ),
    (
        "svhn label 0",
        "svhn",
        svhn(**{"test_32x32.mat": mat(n=3, y=np.zeros((3, 1), np.uint8))}),
        {},
        r"test_32x32.mat: label 0 \(at index 0\) is out of range",
    ),
    (
        "svhn fractional label",
        "svhn",
        svhn(**{"test_32x32.mat": mat(n=3, y=np.full((3, 1), 1.5))}),
        {},
        r"label 1.5 \(at index 0\) is out of range",
    ),
    (
        "svhn wrong shape",
        "svhn",
        svhn(**{"train_32x32.mat": mat(x=np.zeros((32, 32, 1, 5), np.uint8))}),
        {},
        r"X is a uint8 array of shape \(32, 32, 1, 5\); SVHN's X is uint8 of shape \(32, 32, 3, n\)",
    ),
    (
        "svhn count mismatch",
        "svhn",
        svhn(**{"train_32x32.mat": mat(y=np.ones((4, 1), np.uint8))}),
        {},
        r"5 images but 4 labels",
    ),
    ("svhn missing y", "svhn", svhn(**{"train_32x32.mat": mat(drop=("y",))}), {}, r"expected arrays X and y"),
    ("svhn empty file", "svhn", svhn(**{"train_32x32.mat": b""}), {}, r"train_32x32.mat is not an SVHN .mat file"),
    (
        "svhn garbage",
        "svhn",
        svhn(**{"test_32x32.mat": b"MATLAB 5.0 garbage" * 10}),
        {},
        r"test_32x32.mat is not an SVHN .mat file",
    ),
    # --- folders
    ("no data dir", "mnist", None, {}, r"dataset 'mnist' needs --data-dir"),
    ("data dir is a file", "csv", "FILE", {}, r"dataset 'csv': train.csv not found in .*/f \(expected train.csv"),
    ("data dir missing", "mnist", "MISSING", {}, r"train-images-idx3-ubyte\[.gz\] not found in .*/nowhere"),
]


@pytest.mark.parametrize("case", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_every_bad_data_file_is_one_clean_line(tmp_path, case):
    _id, name, files, kwargs, pattern = case
    if files == "FILE":
        (tmp_path / "f").write_text("x")
        folder = tmp_path / "f"
    elif files == "MISSING":
        folder = tmp_path / "nowhere"
    elif files is None:
        folder = None
    else:
        write(tmp_path, files)
        folder = tmp_path
    if name == "csv":  # the public class count (labels 0..9 here)
        kwargs = {"num_classes": 10, **kwargs}
    with pytest.raises(DatasetFileError, match=pattern) as err:
        load_dataset(name, folder, **kwargs)
    assert "\n" not in str(err.value)


def test_the_table_builders_make_valid_files(tmp_path):
    """The bad cases differ from valid files only in what they break."""
    for name, files in (("mnist", mnist()), ("cifar10", cifar()), ("svhn", svhn()), ("csv", {"train.csv": CSV_OK})):
        folder = tmp_path / name
        folder.mkdir()
        write(folder, files)
        assert len(load_dataset(name, folder, num_classes=3 if name == "csv" else None).x_train) > 0
    folder = tmp_path / "test-reordered"
    folder.mkdir()
    write(folder, {"train.csv": CSV_OK, "test.csv": "b,label,a\n5,1,7\n"})
    d = load_dataset("csv", folder, num_classes=3)
    assert d.x_test.tolist() == [[7.0, 5.0]] and d.y_test.tolist() == [1]  # columns matched by name


BAD_PARAMETERS = [
    ("unknown dataset", "imagenet", {}, r"dataset='imagenet' is invalid: must be one of"),
    (
        "unknown mode",
        "digits",
        {"normalization": "zscore"},
        r"normalization='zscore' is invalid: must be 'none', 'public'",
    ),
    ("mode number", "digits", {"normalization": 3}, r"normalization=3 is invalid"),
    (
        "public digits",
        "digits",
        {"normalization": "public"},
        r"normalization='public' is invalid: dataset 'digits' has no published",
    ),
    (
        "private no epsilon",
        "digits",
        {"normalization": "private", "normalization_delta": 1e-6},
        r"normalization_epsilon=None is invalid: required with normalization='private'",
    ),
    (
        "private no delta",
        "digits",
        {"normalization": "private", "normalization_epsilon": 1.0},
        r"normalization_delta=None is invalid: required",
    ),
    (
        "private epsilon 0",
        "digits",
        {"normalization": "private", "normalization_epsilon": 0, "normalization_delta": 1e-6},
        r"normalization_epsilon=0.0 is invalid: must be > 0 and finite",
    ),
    (
        "private epsilon nan",
        "digits",
        {"normalization": "private", "normalization_epsilon": math.nan, "normalization_delta": 1e-6},
        r"normalization_epsilon=nan is invalid",
    ),
    (
        "private epsilon huge",
        "digits",
        {"normalization": "private", "normalization_epsilon": 1e300, "normalization_delta": 1e-6},
        r"normalization_epsilon=1e\+300 is invalid: cannot be calibrated",
    ),
    (
        "private delta 1",
        "digits",
        {"normalization": "private", "normalization_epsilon": 1, "normalization_delta": 1},
        r"normalization_delta=1 is invalid: must be in \(0, 1\)",
    ),
    (
        "epsilon without private",
        "digits",
        {"normalization_epsilon": 1.0},
        r"normalization_epsilon=1.0 is invalid: only used with normalization='private'",
    ),
    ("range without private", "digits", {"feature_range": (0, 1)}, r"feature_range=0,1 is invalid: only used with"),
    (
        "range on images",
        "digits",
        {"normalization": "private", "normalization_epsilon": 1, "normalization_delta": 1e-6, "feature_range": (0, 2)},
        r"feature_range=0,2 is invalid: not used for 'digits'",
    ),
    ("user std 0", "digits", {"normalization": (0.5, 0.0)}, r"normalization=0.5,0.0 is invalid: std must be > 0"),
    (
        "user nan mean",
        "digits",
        {"normalization": (math.nan, 1.0)},
        r"normalization=nan,1.0 is invalid: mean needs 1 or 1 finite",
    ),
    (
        "user per-channel mismatch",
        "digits",
        {"normalization": ((0.1, 0.2), (1, 1))},
        r"mean needs 1 or 1 finite values",
    ),
    ("user text", "digits", {"normalization": ("a", "b")}, r"mean must be numbers"),
    (
        "bad record",
        "digits",
        {"normalization": {"mode": "magic"}},
        r"normalization=\"dict\(mode='magic'\)\" is invalid",
    ),
    (
        "record without cost",
        "digits",
        {"normalization": {"mode": "user", "mean": [0.1], "std": [1.0]}},
        r"needs its recorded epsilon >= 0",
    ),
    (
        "csv without num_classes",
        "csv",
        {"data_dir": "/tmp"},
        r"num_classes=None is invalid: is required for dataset csv: the number of classes K",
    ),
    ("num_classes of digits", "digits", {"num_classes": 2}, r"num_classes=2 is invalid: dataset 'digits' has 10"),
    ("num_classes not an integer", "digits", {"num_classes": 2.5}, r"num_classes=2.5 is invalid: must be an integer"),
    (
        "label column on mnist",
        "mnist",
        {"label_column": "y"},
        r"label_column='y' is invalid: only used with dataset csv",
    ),
    (
        "data dir for digits",
        "digits",
        {"data_dir": "/tmp"},
        r"data_dir='/tmp' is invalid: not used: dataset 'digits' is bundled",
    ),
]


@pytest.mark.parametrize("case", BAD_PARAMETERS, ids=[c[0] for c in BAD_PARAMETERS])
def test_bad_parameters_name_the_argument(case):
    _id, name, kwargs, pattern = case
    kwargs = dict(kwargs)
    data_dir = kwargs.pop("data_dir", None)
    with pytest.raises(InvalidParameterError, match=pattern) as err:
        load_dataset(name, data_dir, **kwargs)
    assert "\n" not in str(err.value)


def test_csv_private_normalization_needs_a_public_range(tmp_path):
    (tmp_path / "train.csv").write_text(CSV_OK)
    with pytest.raises(
        InvalidParameterError,
        match=r"feature_range=None is invalid: required with "
        r"normalization='private' on csv data: a public range",
    ):
        load_dataset(
            "csv", tmp_path, num_classes=3, normalization="private", normalization_epsilon=1, normalization_delta=1e-6
        )
    for bad, msg in (
        ((1, 0), "needs low < high"),
        ((0, math.inf), "high needs 1 or 2 finite"),
        ("01", "must be a pair"),
    ):
        with pytest.raises(InvalidParameterError, match=msg):
            load_dataset(
                "csv",
                tmp_path,
                num_classes=3,
                normalization="private",
                normalization_epsilon=1,
                normalization_delta=1e-6,
                feature_range=bad,
            )
    d = load_dataset(
        "csv",
        tmp_path,
        num_classes=3,
        normalization="private",
        normalization_epsilon=1,
        normalization_delta=1e-6,
        feature_range=(0, 30),
        normalization_rng=np.random.default_rng(0),
    )
    assert d.preprocessing["per"] == "feature" and len(d.preprocessing["mean"]) == 2
    assert d.preprocessing["clip_range"] == [[0.0, 0.0], [30.0, 30.0]]


# ----------------------------------------------------------------------------- nothing executes


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _protocol0_inst(marker) -> bytes:
    """Protocol 0's INST opcode: instantiate a named callable (no __reduce__ needed)."""
    return b"(S'touch " + str(marker).encode() + b"'\nios\nsystem\n."


@pytest.mark.parametrize("how", ["reduce-p0", "reduce-p2", "reduce-p5", "inst-p0", "nested-in-labels"])
def test_a_crafted_cifar_batch_runs_no_code(tmp_path, how):
    marker = tmp_path / "pwned"
    evil = {
        "reduce-p0": lambda: pickle.dumps({b"data": _RunsCode(marker)}, protocol=0),
        "reduce-p2": lambda: pickle.dumps({b"data": _RunsCode(marker)}, protocol=2),
        "reduce-p5": lambda: pickle.dumps({b"data": _RunsCode(marker)}, protocol=5),
        "inst-p0": lambda: _protocol0_inst(marker),
        "nested-in-labels": lambda: pickle.dumps(
            {b"data": np.zeros((1, 3072), np.uint8), b"labels": [_RunsCode(marker)]}
        ),
    }[how]()
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, cifar(data_batch_1=evil))
    with pytest.raises(
        DatasetFileError,
        match=r"data_batch_1 is not a CIFAR-10 python batch: it names "
        r"(posix|os|nt)\.system, which CIFAR-10 batches never contain",
    ) as err:
        load_dataset("cifar10", folder)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    # and the same bytes through plain pickle would have run it (the test's premise)
    if how == "reduce-p2":
        pickle.loads(evil)
        assert marker.exists()


def _py2_cifar_pickle(data: np.ndarray, labels: list) -> bytes:
    """A batch laid out as the genuine CIFAR-10 files are: Python 2 cPickle (protocol 2) of a dict of
    py2 byte strings (BINSTRING), a list of ints and a uint8 array pickled by numpy 1.x
    (numpy.core.multiarray._reconstruct, numpy.ndarray, numpy.dtype)."""
    P, out = pickle, bytearray(b"\x80\x02")

    def s(b):
        out.extend(
            P.SHORT_BINSTRING + bytes([len(b)]) + b if len(b) < 256 else P.BINSTRING + struct.pack("<i", len(b)) + b
        )

    def i(v):
        out.extend(P.BININT + struct.pack("<i", v))

    out.extend(P.EMPTY_DICT + P.MARK)
    s(b"batch_label")
    s(b"training batch 1 of 5")
    s(b"labels")
    out.extend(P.EMPTY_LIST + P.MARK)
    for v in labels:
        i(v)
    out.extend(P.APPENDS)
    s(b"data")
    out.extend(P.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n" + P.GLOBAL + b"numpy\nndarray\n")
    i(0)
    out.extend(P.TUPLE1)
    s(b"b")
    out.extend(P.TUPLE3 + P.REDUCE + P.MARK)
    i(1)
    i(data.shape[0])
    i(data.shape[1])
    out.extend(P.TUPLE2 + P.GLOBAL + b"numpy\ndtype\n")
    s(b"u1")
    i(0)
    i(1)
    out.extend(P.TUPLE3 + P.REDUCE + P.MARK)
    i(3)
    s(b"|")
    out.extend(P.NONE * 3)
    i(-1)
    i(-1)
    i(0)
    out.extend(P.TUPLE + P.BUILD + P.NEWFALSE)
    s(data.tobytes())
    out.extend(P.TUPLE + P.BUILD)
    s(b"filenames")
    out.extend(P.EMPTY_LIST + P.MARK)
    for k in range(len(labels)):
        s(b"img_%d.png" % k)
    out.extend(P.APPENDS + P.SETITEMS + P.STOP)
    return bytes(out)


@pytest.mark.parametrize("layout", ["python2-genuine", "protocol-0", "protocol-2", "protocol-4", "protocol-5"])
def test_genuine_and_resaved_cifar_batches_still_load(tmp_path, layout):
    import warnings

    rng = np.random.default_rng(3)
    batches = {
        f: rng.integers(0, 256, (3, 3072), dtype=np.uint8)
        for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    }
    labels = [3, 0, 9]
    for f, data in batches.items():
        if layout == "python2-genuine":
            content = _py2_cifar_pickle(data, labels)
        else:
            content = pickle.dumps(
                {b"batch_label": b"b", b"labels": labels, b"data": data, b"filenames": [b"a.png"] * 3},
                protocol=int(layout[-1]),
            )
        (tmp_path / f).write_bytes(content)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. numpy.core deprecation: the mapping avoids it
        d = load_dataset("cifar10", tmp_path, normalization="none")
    assert d.y_train.tolist() == labels * 5
    expect = np.concatenate([batches[f"data_batch_{i}"] for i in range(1, 6)]).reshape(-1, 3, 32, 32) / 255.0
    assert np.allclose(d.x_train.numpy(), expect, atol=1e-7)


# ----------------------------------------------------------------------------- normalization


def test_public_constants_are_applied_to_both_splits_per_channel(tmp_path):
    write(tmp_path, mnist())
    rawtr = np.frombuffer(mnist()["train-images-idx3-ubyte"][16:], np.uint8).reshape(12, 1, 28, 28) / 255.0
    rawte = np.frombuffer(mnist()["t10k-images-idx3-ubyte"][16:], np.uint8).reshape(6, 1, 28, 28) / 255.0
    d = load_dataset("mnist", tmp_path)  # the default for mnist: public
    assert d.preprocessing["mode"] == "public" and d.preprocessing["mean"] == [0.1307]
    assert d.preprocessing["std"] == [0.3081] and "pytorch/examples" in d.preprocessing["source"]
    assert np.allclose(d.x_train.numpy(), (rawtr - 0.1307) / 0.3081, atol=1e-5)
    assert np.allclose(d.x_test.numpy(), (rawte - 0.1307) / 0.3081, atol=1e-5)
    assert d.preprocessing["epsilon"] == 0.0 and d.preprocessing["delta"] == 0.0
    none = load_dataset("mnist", tmp_path, normalization="none")
    assert np.allclose(none.x_test.numpy(), rawte, atol=1e-7) and none.preprocessing["mode"] == "none"
    assert set(PUBLIC_CONSTANTS) == {"mnist", "fashion-mnist", "cifar10", "svhn"}
    assert PUBLIC_CONSTANTS["fashion-mnist"]["mean"] == (0.2860,) and PUBLIC_CONSTANTS["svhn"]["std"] == (
        0.1980,
        0.2010,
        0.1970,
    )


def test_user_constants_and_records_apply_exactly():
    base = load_dataset("digits")
    d = load_dataset("digits", normalization=(0.3, 0.4))
    assert d.preprocessing["mode"] == "user" and d.preprocessing["mean"] == [0.3] and d.preprocessing["std"] == [0.4]
    assert torch.allclose(d.x_train, (base.x_train - 0.3) / 0.4) and torch.allclose(d.x_test, (base.x_test - 0.3) / 0.4)
    again = load_dataset("digits", normalization=d.preprocessing)  # a record given back: identical data
    assert torch.equal(again.x_train, d.x_train) and again.fingerprint() == d.fingerprint()


def test_private_estimate_is_charged_and_applied_to_both_splits():
    base = load_dataset("digits")  # pixels / 16
    eps, delta = 0.5, 1e-6
    d = load_dataset(
        "digits",
        normalization="private",
        normalization_epsilon=eps,
        normalization_delta=delta,
        normalization_rng=np.random.default_rng(7),
    )
    rec = d.preprocessing
    assert rec["mode"] == "private" and rec["epsilon"] == eps and rec["delta"] == delta
    assert rec["clip_range"] == [[0.0], [1.0]]
    assert rec["sensitivity"] == pytest.approx(math.sqrt(0.25 + 1 / 64 + 0.25))
    assert rec["noise_std"] == analytic_gaussian_sigma(eps, delta, rec["sensitivity"])
    true_mean, true_std = float(base.x_train.double().mean()), float(base.x_train.double().std(unbiased=False))
    assert abs(rec["mean"][0] - true_mean) < 0.05 and abs(rec["std"][0] - true_std) < 0.05
    m, s = rec["mean"][0], rec["std"][0]
    assert torch.allclose(d.x_train, (base.x_train - m) / s, atol=1e-6)
    assert torch.allclose(d.x_test, (base.x_test - m) / s, atol=1e-6)
    replay = load_dataset("digits", normalization=rec)  # resume: the released constants re-applied, cost kept
    assert replay.fingerprint() == d.fingerprint() and replay.preprocessing["epsilon"] == eps
    fresh = load_dataset("digits", normalization="private", normalization_epsilon=eps, normalization_delta=delta)
    assert fresh.preprocessing["mean"] != rec["mean"]  # default noise: OS entropy, not a fixed seed


class _NoNoise:
    def normal(self, loc, scale, size):
        return np.zeros(size)


def test_private_estimate_without_noise_is_the_exact_clipped_statistic(rng):
    x = rng.normal([2.0, -1.0, 0.0], [1.0, 0.5, 3.0], size=(5000, 3)).astype(np.float32)
    low, high = np.array([-2.0, -3.0, -5.0]), np.array([6.0, 1.0, 5.0])
    rec = private_mean_std(x, low, high, 1.0, 1e-6, rng=_NoNoise())
    clipped = np.clip(x.astype(np.float64), low, high)
    assert np.allclose(rec["mean"], clipped.mean(axis=0), atol=1e-9)
    assert np.allclose(rec["std"], clipped.std(axis=0), atol=1e-9)
    img = rng.random((50, 3, 4, 4)).astype(np.float32)  # images: pooled over pixels, per channel
    rec = private_mean_std(img, 0.0, 1.0, 1.0, 1e-6, rng=_NoNoise())
    assert np.allclose(rec["mean"], img.mean(axis=(0, 2, 3)), atol=1e-6)
    assert np.allclose(rec["std"], img.std(axis=(0, 2, 3)), atol=1e-6)


def test_private_estimate_is_close_at_reasonable_epsilon_and_its_noise_matches_the_recorded_cost(rng):
    n, width = 20000, 10.0
    x = rng.normal([3.0, 5.0], [1.0, 2.0], size=(n, 2)).astype(np.float32)
    released = np.array(
        [private_mean_std(x, 0.0, width, 1.0, 1e-6, rng=np.random.default_rng(s))["mean"] for s in range(300)]
    )
    assert np.all(np.abs(released - x.mean(axis=0)) < 0.05)  # ε = 1: close to the truth
    rec = private_mean_std(x, 0.0, width, 1.0, 1e-6, rng=np.random.default_rng(0))
    # the spread of the released means is the recorded noise scale (σ in u units, × width / n)
    expected = rec["noise_std"] * width / n
    assert released.std(axis=0) == pytest.approx([expected, expected], rel=0.15)
    assert rec["noise_std"] == analytic_gaussian_sigma(1.0, 1e-6, add_remove_sensitivity(2))


def test_sensitivity_bounds_adding_or_removing_any_example(rng):
    k, low, high = 3, 0.0, 1.0
    x = rng.random((40, k, 2, 2)).astype(np.float32)
    s1, s2 = moment_sums(x, low, high)
    worst = 0.0
    for extra in (np.zeros((1, k, 2, 2)), np.ones((1, k, 2, 2)), rng.random((1, k, 2, 2)), np.full((1, k, 2, 2), 7.0)):
        t1, t2 = moment_sums(np.concatenate([x, extra.astype(np.float32)]), low, high)
        worst = max(worst, math.sqrt(np.sum((t1 - s1) ** 2) + np.sum((t2 - s2) ** 2) + 0.5**2))
    assert worst <= add_remove_sensitivity(k) + 1e-12
    assert worst == pytest.approx(add_remove_sensitivity(k))  # reached at u = ±1/2


def test_cli_parsers():
    assert parse_normalization("none") == "none" and parse_normalization("private") == "private"
    assert parse_normalization("0.5,0.25") == (0.5, 0.25)
    for bad in ("zscore", "1,0", "1,nan", "1", "a,b"):
        with pytest.raises(InvalidParameterError, match="normalization=.* is invalid: must be none, public"):
            parse_normalization(bad)
    assert parse_feature_range("-1,2.5") == (-1.0, 2.5)
    for bad in ("1,1", "2,1", "0,inf", "x,1", "1"):
        with pytest.raises(InvalidParameterError, match="feature_range=.* is invalid: must be A,B with A < B"):
            parse_feature_range(bad)


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_identifies_data_and_preprocessing():
    a, b = load_dataset("digits"), load_dataset("digits")
    fp = a.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0 and fp == b.fingerprint()
    b.x_train[5, 0, 3, 3] += 1 / 16  # one pixel of one example
    assert b.fingerprint() != fp
    c = load_dataset("digits")
    c.y_test[0] = (c.y_test[0] + 1) % 10  # one test label
    assert c.fingerprint() != fp
    assert load_dataset("digits", normalization=(0.0, 1.0)).fingerprint() != fp  # same tensors, other record
    d = load_dataset("digits")
    d.x_train = d.x_train.double()  # same values, other dtype
    assert d.fingerprint() != fp


# ----------------------------------------------------------------------------- models


def test_tramer_boneh_mnist_layer_shapes():
    """Tramèr & Boneh 2021, MNIST CNN: Conv(16, 8x8, s2, p2) -> MaxPool(2, 1) -> Conv(32, 4x4, s2) -> MaxPool(2, 1)
    -> FC 32 -> FC 10, tanh."""
    model = create_model("tramer_boneh_mnist", (1, 28, 28), 10)
    conv1, conv2 = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    assert (conv1.out_channels, conv1.kernel_size, conv1.stride, conv1.padding) == (16, (8, 8), (2, 2), (2, 2))
    assert (conv2.out_channels, conv2.kernel_size, conv2.stride, conv2.padding) == (32, (4, 4), (2, 2), (0, 0))
    shapes, x = [], torch.zeros(1, 1, 28, 28)
    for layer in model:
        x = layer(x)
        shapes.append(tuple(x.shape[1:]))
    assert shapes == [
        (16, 13, 13),
        (16, 13, 13),
        (16, 12, 12),
        (32, 5, 5),
        (32, 5, 5),
        (32, 4, 4),
        (512,),
        (32,),
        (32,),
        (10,),
    ]
    assert sum(isinstance(m, torch.nn.Tanh) for m in model) == 3


MODEL_MISFITS = [
    (
        "tramer_boneh_mnist",
        (1, 8, 8),
        (
            r"model='tramer_boneh_mnist' is invalid: needs images of at least 16x16 "
            r"pixels; the dataset's input shape is \(1, 8, 8\)"
        ),
    ),
    ("lenet5", (1, 8, 8), r"model='lenet5' is invalid: needs images of at least 12x12 pixels"),
    ("heo_svhn", (3, 8, 8), r"model='heo_svhn' is invalid: needs images of at least 16x16"),
    ("heo_mnist", (1, 8, 8), r"model='heo_mnist' is invalid: needs images of at least"),
    ("digits_cnn", (1, 1, 1), r"model='digits_cnn' is invalid: needs images of at least 4x4"),
    (
        "digits_cnn",
        (7,),
        (
            r"model='digits_cnn' is invalid: takes images \(channels, height, width\); the "
            r"dataset's inputs have shape \(7,\)"
        ),
    ),
    ("resnet20", (20,), r"model='resnet20' is invalid: takes images"),
    ("mlp", (7,), None),
    ("tramer_boneh_cifar10", (1, 8, 8), None),  # 8 -> 4 -> 2 -> 1: small, but it fits
]


@pytest.mark.parametrize(("name", "shape", "pattern"), MODEL_MISFITS, ids=[f"{c[0]}-{c[1]}" for c in MODEL_MISFITS])
def test_models_refuse_shapes_they_cannot_take(name, shape, pattern):
    if pattern is None:
        model = create_model(name, shape, 10)
        assert model(torch.zeros(2, *shape)).shape == (2, 10)
        return
    with pytest.raises(InvalidParameterError, match=pattern) as err:
        create_model(name, shape, 10)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("shape", "classes", "pattern"),
    [
        ((1, 0, 8), 10, r"input_shape=.* is invalid"),
        (("a",), 10, r"input_shape=.* is invalid"),
        ((7,), 1, r"num_classes=1 is invalid: must be an integer >= 2"),
        ((7,), 2.5, r"num_classes=2.5 is invalid"),
    ],
)
def test_model_arguments(shape, classes, pattern):
    with pytest.raises(InvalidParameterError, match=pattern):
        create_model("mlp", shape, classes)
