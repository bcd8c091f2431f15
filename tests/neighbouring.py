"""Neighbouring-data-sets harness (issue 35): run a command on D and on D′ and compare every public output.

The guarantee's neighbouring relation is *zero-out* (docs/guarantees.md, "Neighbouring data sets"):
D′ replaces one row by a null row; N and the budget groups' sizes are public inputs.  The tests
compare D with D′ = D without one row (an outlier: a unique label, extreme features; for text a
unique token and a unique length), same seed, not secure mode, so N, the group sizes and what is
computed from them alone may differ as well.  Everything a run publishes — every file of the run
folder outside ``private/`` or readable by group/others, stdout (default text and ``--json``) and
stderr — is parsed into named fields (JSON keys, CSV cells, HTML sections and table cells, tensors of
``.pt`` / ``.safetensors`` by name with shape, dtype and values, the numbers of a text line) and
compared field by field.  A field that differs must match an :class:`Allow` entry, which carries its
reason; anything else is a leak, reported with the file and the field.

Use::

    d, dp = csv_pair(tmp_path)                     # the two data sets (mnist_pair: IDX files)
    a = run_cli(["train", ..., *d.args], d.root)   # run on each (same argv but the data folder)
    b = run_cli(["train", ..., *dp.args], dp.root)
    assert_same_public_outputs(a, b, [Allow("report.json", "test_accuracy", TEST), ...])

A library integration (e.g. the Hugging Face Trainer) runs in the test and hands its run folder to
:func:`collect`.  Paths are compared with each side's root replaced by ``<ROOT>``.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import html.parser
import io
import json
import re
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

import numpy as np

from support import public_files

PRIVATE = "private"

# --- the allow-list ----------------------------------------------------------------------------
#: reasons, one per kind of difference the guarantee covers
WEIGHTS = "the model's weights: written only by the noisy steps, which the guarantee covers"
TEST = "a metric on the public test data (or a value derived from it): the released model's behaviour"
PUBLIC_N = (
    "N and the budget groups' sizes are public inputs of the guarantee (zero-out neighbouring); "
    "this value is derived only from them (sigma and the rates calibrated from them, the expected "
    "batch size, the steps planned from N, the epsilon those give)"
)
TIME = "a wall-clock timing: the documented exception (docs/guarantees.md, Neighbouring data sets)"


@dataclass(frozen=True)
class Allow:
    """A field that may differ between D and D′: ``file`` is a glob over the output's name (a path of
    the run folder, or ``stdout``, ``stdout --json``, ``stderr``), ``field`` a regular expression that
    must match the whole field name; ``reason`` says why the guarantee covers the difference."""

    file: str
    field: str
    reason: str

    def matches(self, file: str, name: str) -> bool:
        return fnmatch(file, self.file) and re.fullmatch(self.field, name) is not None


# --- the two data sets -------------------------------------------------------------------------
@dataclass
class DataSet:
    """One side of the comparison: ``root`` holds ``data/`` (and the run's ``out/``); ``args`` are the
    command-line arguments that name the data."""

    root: Path
    args: list[str]
    n: int

    @property
    def out(self) -> Path:
        return self.root / "out"


OUTLIER_LABEL = 3  # the ordinary rows have labels 0, 1, 2: the outlier's label is unique


def write_csv_data(
    folder: Path,
    *,
    outlier: bool,
    n: int = 90,
    n_test: int = 30,
    extra: dict | None = None,
    outlier_label: int = OUTLIER_LABEL,
) -> int:
    """``train.csv`` (n ordinary rows, labels 0..2, and with ``outlier`` one more row at the end: label
    3, features far from every other row) and ``test.csv`` (public, labels 0..2).  ``extra`` adds
    columns: name -> function(row index, label) -> value.  Returns the number of training rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    extra = extra or {}
    for name, rows in (("train", n), ("test", n_test)):
        y = list(np.arange(rows) % 3)
        x = [list(rng.normal(size=6) + y[i]) for i in range(rows)]
        if name == "train" and outlier:
            y.append(outlier_label)
            x.append([40.0, -40.0, 40.0, -40.0, 40.0, -40.0])
        header = ["label", *(f"f{i}" for i in range(6)), *extra]
        lines = [",".join(header)]
        for i, (yi, xi) in enumerate(zip(y, x, strict=True)):
            cells = [str(int(yi)), *(f"{v:.4f}" for v in xi), *(str(f(i, int(yi))) for f in extra.values())]
            lines.append(",".join(cells))
        (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return n + int(outlier)


def csv_pair(base: Path, **kw) -> tuple[DataSet, DataSet]:
    """D (with the outlier) and D′ (without it), each in its own root with the same layout."""
    out = []
    for name, outlier in (("D", True), ("Dprime", False)):
        root = base / name
        n = write_csv_data(root / "data", outlier=outlier, **kw)
        out.append(DataSet(root, ["--dataset", "csv", "--data-dir", str(root / "data")], n))
    return out[0], out[1]


# --- running -----------------------------------------------------------------------------------
@dataclass
class Outputs:
    """What one run published: file name -> bytes, and the printed streams (root replaced by ``<ROOT>``)."""

    root: Path
    files: dict[str, bytes] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)


def collect(root: Path, folder: Path | None = None, streams: dict[str, str] | None = None) -> Outputs:
    """The public files under ``folder`` (default ``root/out``) and the given streams."""
    folder = root / "out" if folder is None else folder
    out = Outputs(root)
    if folder.exists():
        for p in public_files(folder):
            rel = str(p.relative_to(folder))
            out.files[rel] = p.read_bytes()
            out.modes[rel] = stat.S_IMODE(p.stat().st_mode)
    out.streams = {k: v.replace(str(root), "<ROOT>") for k, v in (streams or {}).items()}
    return out


def run_cli(argv: list[str], root: Path, *, out: Path | None = None, json_flag: bool = True) -> Outputs:
    """Run ``idpsgd argv --out root/out`` in-process; return its public outputs.

    The printed result is captured in both forms a user can ask for: the default text and ``--json``
    (the command computes one result; :func:`idpsgd.cli.main.main` only chooses how to print it, so
    both are rendered from the one run).  Everything else the command prints (progress, warnings)
    is captured from stdout and stderr."""
    import importlib

    cli_main = importlib.import_module("idpsgd.cli.main")
    out = root / "out" if out is None else out
    rendered: dict[str, str] = {}
    original = cli_main._emit

    def emit(result, as_json, text=None):
        for key, flag in (("stdout", False), ("stdout --json", True)):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                original(result, flag, text)
            rendered[key] = buf.getvalue()

    so, se = io.StringIO(), io.StringIO()
    cli_main._emit = emit
    try:
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            code = cli_main.main([*argv, *(["--out", str(out)] if out is not False else [])])
    finally:
        cli_main._emit = original
    if code != 0:
        raise AssertionError(f"idpsgd {' '.join(argv)} exited with {code}:\n{se.getvalue()[-3000:]}")
    streams = {"stdout (other lines)": so.getvalue(), "stderr": se.getvalue(), **rendered}
    if not json_flag:
        streams.pop("stdout --json", None)
    return collect(root, out if out is not False else root / "out", streams)


# --- parsing public outputs into named fields ----------------------------------------------------
_NUMBER = re.compile(r"(?<![A-Za-z_#\d.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?!\d)")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def text_fields(text: str, prefix: str = "") -> dict[str, object]:
    """One field per line's template (numbers replaced by ``#``; the k-th line with that template gets
    ``[k]``) and one per number in it: ``<template>[k] #j``."""
    fields: dict[str, object] = {}
    seen: dict[str, int] = {}
    for line in text.splitlines():
        template = _NUMBER.sub("#", line).rstrip()
        k = seen.get(template, 0)
        seen[template] = k + 1
        key = f"{prefix}{template!r}[{k}]"
        fields[key] = "line"
        for j, num in enumerate(_NUMBER.findall(line)):
            fields[f"{key} #{j}"] = num
    return fields


def json_fields(obj, prefix: str = "") -> dict[str, object]:
    """``a/b/0/c`` -> value, for every leaf; a list's length is its own field (``a/#len``)."""
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        out[f"{prefix}#keys"] = sorted(obj)
        for k, v in obj.items():
            out.update(json_fields(v, f"{prefix}{k}/"))
    elif isinstance(obj, list):
        out[f"{prefix}#len"] = len(obj)
        for i, v in enumerate(obj):
            out.update(json_fields(v, f"{prefix}{i}/"))
    elif isinstance(obj, str) and "\n" in obj:
        out.update(text_fields(obj, prefix))
    else:
        out[prefix.rstrip("/") or "(value)"] = obj
    return out


def csv_fields(text: str) -> dict[str, object]:
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return {"#rows": 0}
    header, body = rows[0], rows[1:]
    out: dict[str, object] = {"#header": header, "#rows": len(body)}
    for i, r in enumerate(body):
        for j, cell in enumerate(r):
            out[f"row {i}/{header[j] if j < len(header) else j}"] = cell
    return out


def _tensor_fields(name: str, t) -> dict[str, object]:
    import torch

    t = t.detach().cpu()
    out = {f"{name}:shape": tuple(t.shape), f"{name}:dtype": str(t.dtype)}
    kind = "float-values" if t.is_floating_point() or t.is_complex() else "values"
    out[f"{name}:{kind}"] = _digest(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def torch_fields(data: bytes) -> dict[str, object]:
    """A ``torch.save`` file loaded with ``weights_only=True``: each tensor's shape, dtype and values
    (``:float-values`` for floating tensors: weights), every other leaf as itself."""
    import torch

    obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    out: dict[str, object] = {}

    def walk(o, prefix):
        if torch.is_tensor(o):
            out.update(_tensor_fields(prefix or "(tensor)", o))
        elif isinstance(o, dict):
            out[f"{prefix}#keys"] = sorted(map(str, o))
            for k, v in o.items():
                walk(v, f"{prefix}/{k}" if prefix else str(k))
        elif isinstance(o, (list, tuple)):
            out[f"{prefix}#len"] = len(o)
            for i, v in enumerate(o):
                walk(v, f"{prefix}/{i}")
        else:
            out[prefix or "(value)"] = repr(o)

    walk(obj, "")
    return out


def safetensors_fields(data: bytes) -> dict[str, object]:
    """The header's metadata and each tensor's shape, dtype and values."""
    from safetensors.torch import load

    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    out = json_fields(header.get("__metadata__") or {}, "__metadata__/")
    tensors = load(data)
    out["#tensors"] = sorted(tensors)
    for k, t in tensors.items():
        out.update(_tensor_fields(k, t))
    return out


class _HTMLFields(html.parser.HTMLParser):
    """Text and images of an HTML page by section (the last heading) and element: a table cell is
    named by its table, row and column header; other text by its element and its number-masked
    template (:func:`text_fields`); an image by its index and alt text (value: its digest)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.fields: dict[str, object] = {}
        self.section, self.heading = "(top)", None
        self.stack: list[str] = []
        self.table, self.row, self.col, self.header = -1, -1, -1, []
        self.counts: dict[str, int] = {}
        self.cell: list[str] | None = None
        self.block: list[str] | None = None
        self.block_tag = ""

    def _count(self, key):
        self.counts[key] = self.counts.get(key, -1) + 1
        return self.counts[key]

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("h1", "h2", "h3", "title"):
            self.heading = []
        elif tag == "table":
            self.table, self.row, self.header = self._count(f"{self.section}/table"), -1, []
        elif tag == "tr":
            self.row, self.col = self.row + 1, -1
        elif tag in ("td", "th"):
            self.col += 1
            self.cell = []
        elif tag in ("p", "li", "pre", "div") and self.cell is None and self.block is None:
            self.block, self.block_tag = [], tag
        elif tag == "img":
            i = self._count(f"{self.section}/img")
            self.fields[f"{self.section} > image {i} (alt {a.get('alt')!r})"] = _digest((a.get("src") or "").encode())
        for k, v in attrs:  # other attributes (links, classes) are part of the page
            if tag != "img" and k not in ("class", "style") and v:
                self.fields[f"{self.section} > <{tag}> attribute {k} #{self._count(f'{self.section}/{tag}/{k}')}"] = v

    def handle_endtag(self, tag):
        if tag in ("h1", "h2", "h3", "title") and self.heading is not None:
            text = "".join(self.heading).strip()
            if tag == "title":
                self.fields["(title)"] = text
            else:
                self.section = _NUMBER.sub("#", text)
                self.fields.update({f"heading {self.section!r} #{j}": n for j, n in enumerate(_NUMBER.findall(text))})
                self.fields[f"heading {self.section!r}"] = "present"
            self.heading = None
        elif tag in ("td", "th") and self.cell is not None:
            text = " ".join("".join(self.cell).split())
            if self.row == 0 and tag == "th":
                self.header.append(text)
            col = self.header[self.col] if self.col < len(self.header) and self.row > 0 else f"column {self.col}"
            self.fields[f"{self.section} > table {self.table} > row {self.row} > {col}"] = text
            self.cell = None
        elif tag == self.block_tag and self.block is not None:
            text = " ".join("".join(self.block).split())
            if text:
                for k, v in text_fields(text, f"{self.section} > <{tag}> ").items():
                    self.fields[k] = v
            self.block = None

    def handle_data(self, data):
        for buf in (self.heading, self.cell, self.block):
            if buf is not None:
                buf.append(data)
                return


def html_fields(text: str) -> dict[str, object]:
    p = _HTMLFields()
    p.feed(text)
    p.close()
    return p.fields


def fields_of(name: str, data: bytes) -> dict[str, object]:
    """Named fields of one public output (see the module docstring); unknown formats: one digest."""
    suffix = Path(name).suffix.lower()
    try:
        if suffix == ".json" or name.endswith("--json"):
            return json_fields(json.loads(data))
        if suffix == ".csv":
            return csv_fields(data.decode())
        if suffix in (".html", ".htm"):
            return html_fields(data.decode())
        if suffix in (".pt", ".pth"):
            return torch_fields(data)
        if suffix == ".safetensors":
            return safetensors_fields(data)
        if suffix in (".md", ".txt", ".jsonl", ".model", ".vocab", ".merges") or name.startswith(("stdout", "stderr")):
            return text_fields(data.decode())
    except (UnicodeDecodeError, ValueError, RuntimeError) as exc:  # a file that is not what its name says
        return {"(unparsed)": f"{type(exc).__name__}: {_digest(data)}"}
    return {"(bytes)": _digest(data)}


# --- comparing ------------------------------------------------------------------------------------
@dataclass
class Difference:
    file: str
    field: str
    d: object
    dprime: object

    def __str__(self):
        def short(v):
            s = repr(v)
            return s if len(s) < 120 else s[:117] + "..."

        return f"{self.file}: {self.field}: D={short(self.d)}, D'={short(self.dprime)}"


_MISSING = "<absent>"


def differences(a: Outputs, b: Outputs) -> list[Difference]:
    """Every field that differs between two runs' public outputs (a file only one run wrote: its
    ``(file)`` field; a different file mode: its ``(mode)`` field)."""
    out = []
    blobs_a = {**a.files, **{k: v.encode() for k, v in a.streams.items()}}
    blobs_b = {**b.files, **{k: v.encode() for k, v in b.streams.items()}}
    for name in sorted(set(blobs_a) | set(blobs_b)):
        if name not in blobs_a or name not in blobs_b:
            out.append(Difference(name, "(file)", name in blobs_a, name in blobs_b))
            continue
        if a.modes.get(name) != b.modes.get(name):
            out.append(Difference(name, "(mode)", oct(a.modes.get(name, 0)), oct(b.modes.get(name, 0))))
        if blobs_a[name] == blobs_b[name]:
            continue
        fa, fb = _fields(name, blobs_a[name], a.root), _fields(name, blobs_b[name], b.root)
        found = [
            Difference(name, k, fa.get(k, _MISSING), fb.get(k, _MISSING))
            for k in sorted(set(fa) | set(fb))
            if fa.get(k, _MISSING) != fb.get(k, _MISSING)
        ]
        out += found or [Difference(name, "(bytes, same fields)", _digest(blobs_a[name]), _digest(blobs_b[name]))]
    return out


def _fields(name: str, data: bytes, root: Path) -> dict[str, object]:
    fields = fields_of(name, data)
    root_text = str(root)
    return {k: v.replace(root_text, "<ROOT>") if isinstance(v, str) else v for k, v in fields.items()}


def unexplained(a: Outputs, b: Outputs, allow: Iterable[Allow]) -> tuple[list[Difference], dict[str, list[str]]]:
    """(differences no entry allows, {reason: [differences it allowed]})."""
    allow = list(allow)
    bad, used = [], {}
    for d in differences(a, b):
        entry = next((e for e in allow if e.matches(d.file, d.field)), None)
        if entry is None:
            bad.append(d)
        else:
            used.setdefault(entry.reason, []).append(f"{d.file}: {d.field}")
    return bad, used


def assert_same_public_outputs(a: Outputs, b: Outputs, allow: Iterable[Allow], *, what: str = "") -> dict:
    """Fail, naming each file and field, when a public output of the run on D differs from the run on
    D′ outside the allow-list.  Returns what the allow-list allowed (reason -> fields)."""
    bad, used = unexplained(a, b, allow)
    if bad:
        lines = "\n  ".join(map(str, bad[:60])) + (f"\n  ... and {len(bad) - 60} more" if len(bad) > 60 else "")
        raise AssertionError(
            f"{what or 'the command'}: {len(bad)} public field(s) differ between D and D' (D without one "
            f"row) that the guarantee does not cover:\n  {lines}"
        )
    return used


def fields_matching(outputs: Outputs, file: str, pattern: str) -> dict[str, object]:
    """The fields of ``outputs``' file ``file`` whose names match ``pattern`` (for tests that check the
    harness sees what it should)."""
    data = outputs.files.get(file) if file in outputs.files else outputs.streams[file].encode()
    return {k: v for k, v in _fields(file, data, outputs.root).items() if re.fullmatch(pattern, k)}


def _write_idx(path: Path, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array, dtype=np.uint8)
    path.write_bytes(
        struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    )


def write_mnist_data(folder: Path, *, outlier: bool, n: int = 60, n_test: int = 20) -> int:
    """Tiny MNIST-format IDX files: n ordinary 28x28 images of labels 0..8 (a blob whose place
    follows the label) and, with ``outlier``, one more: label 9 (unique), every pixel white.  The
    test images are public and have labels 0..8.  Returns the number of training rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for stem, rows in (("train", n), ("t10k", n_test)):
        y = np.arange(rows) % 9
        x = rng.integers(0, 60, size=(rows, 28, 28))
        for i, label in enumerate(y):
            r, c = 3 * (label // 3) + 4, 3 * (label % 3) + 4
            x[i, r * 2 : r * 2 + 6, c * 2 : c * 2 + 6] = 255
        if stem == "train" and outlier:
            x, y = np.concatenate([x, np.full((1, 28, 28), 255)]), np.append(y, 9)
        _write_idx(folder / f"{stem}-images-idx3-ubyte", x)
        _write_idx(folder / f"{stem}-labels-idx1-ubyte", y)
    return n + int(outlier)


def mnist_pair(base: Path, **kw) -> tuple[DataSet, DataSet]:
    """D (with the outlier image) and D′ (without it) in MNIST's IDX format."""
    out = []
    for name, outlier in (("D", True), ("Dprime", False)):
        root = base / name
        n = write_mnist_data(root / "data", outlier=outlier, **kw)
        out.append(DataSet(root, ["--dataset", "mnist", "--data-dir", str(root / "data")], n))
    return out[0], out[1]


# --- user level: one user's rows replaced by a different number of rows ---------------------------
TARGET_USER = "u-target"


def write_user_csv_data(
    folder: Path, *, target_rows: int, users: int = 30, rows_per_user: int = 3, n_test: int = 30
) -> int:
    """``train.csv`` with a ``user`` column: ``users`` ordinary users of ``rows_per_user`` rows (labels
    0..2) and the user :data:`TARGET_USER` with ``target_rows`` rows of their own (label 3 and features
    far from every other row); ``test.csv`` public (labels 0..2).  The set of users is the same whatever
    ``target_rows``: user-level neighbours.  Returns the number of training rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    header = "label," + ",".join(f"f{i}" for i in range(6)) + ",user"
    lines = [header]
    for u in range(users):
        for _ in range(rows_per_user):
            y = int(rng.integers(0, 3))
            lines.append(",".join([str(y), *(f"{v:.4f}" for v in rng.normal(size=6) + y), f"u{u:02d}"]))
    for j in range(target_rows):
        far = 40.0 + 5 * j
        lines.append(",".join(["3", *(f"{v:.4f}" for v in (far, -far) * 3), TARGET_USER]))
    (folder / "train.csv").write_text("\n".join(lines) + "\n")
    test = ["label," + ",".join(f"f{i}" for i in range(6))]
    for i in range(n_test):
        y = i % 3
        test.append(",".join([str(y), *(f"{v:.4f}" for v in rng.normal(size=6) + y)]))
    (folder / "test.csv").write_text("\n".join(test) + "\n")
    return users * rows_per_user + target_rows


def user_csv_pair(base: Path, *, rows_d: int = 1, rows_dprime: int = 5, **kw) -> tuple[DataSet, DataSet]:
    """D (the target user with ``rows_d`` rows) and D′ (with ``rows_dprime`` other rows): the same users."""
    out = []
    for name, rows in (("D", rows_d), ("Dprime", rows_dprime)):
        root = base / name
        n = write_user_csv_data(root / "data", target_rows=rows, **kw)
        out.append(DataSet(root, ["--dataset", "csv", "--data-dir", str(root / "data")], n))
    return out[0], out[1]
