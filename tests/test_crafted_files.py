"""Crafted files (issue 53): no file idpsgd reads through pickle runs code from it.

Checkpoint folders are what users copy between machines and download, data folders what they fetch.
Every file the library unpickles — a sharded checkpoint's DCP ``.metadata``, its shard files and
``state.pt``, the ``.pt`` checkpoints (engine and Trainer), a distributed run's error reports, CIFAR-10
batches — is given payloads whose code would create a marker file: ``__reduce__`` objects, ``os.system``,
``subprocess``, ``builtins`` (``eval``, ``exec``, ``open``, ``getattr`` + ``__import__``), dotted names
through an allowed module (protocol 4 resolves them attribute by attribute), ``torch`` internals
(``torch.load`` with a pickle module), ``copyreg``, extension codes, the INST and OBJ opcodes, each in
protocols 0-5 with GLOBAL or STACK_GLOBAL.  Each load must be refused with the loader's error and the
marker must not exist.  The payloads are written opcode by opcode; the first test checks that each one
does run its code through plain ``pickle`` (so a refusal here is the loader's doing).
"""

import contextlib
import copyreg
import io
import json
import os
import pathlib
import pickle
import shlex
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from idpsgd.data import DatasetFileError, read_cifar_batch
from idpsgd.engine import distributed
from idpsgd.engine.distributed import sharded_checkpoint as sc
from idpsgd.io import CheckpointError, RefusedPickle, load_restricted, load_torch
from idpsgd.validation import InvalidParameterError

PROTOCOLS = range(6)
EXT_CODE = 0x7A3F1  # an extension code the tests register for os.system (EXT4)


# --- payloads, opcode by opcode -------------------------------------------------------------------
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _text(s: str, proto: int) -> bytes:
    if proto == 0:
        return b"V" + s.encode("raw_unicode_escape") + b"\n"
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _global(module: str, name: str, proto: int, opcode: str | None = None) -> bytes:
    """GLOBAL (``c module\\nname\\n``, every protocol) or STACK_GLOBAL (two strings, protocol 4 on)."""
    if (opcode or ("STACK_GLOBAL" if proto >= 4 else "GLOBAL")) == "GLOBAL":
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return _text(module, proto) + _text(name, proto) + b"\x93"


def _call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _list(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"l"


def _pickle(body: bytes, proto: int) -> bytes:
    return (bytes([0x80, proto]) if proto >= 2 else b"") + body + b"."


def _system(module, name, opcode=None):
    """``module.name("touch marker")``."""
    return lambda m, p: _pickle(_call(_global(module, name, p, opcode), _text(_touch(m), p)), p)


def _touch(marker) -> str:
    return f"touch {shlex.quote(str(marker))}"


def _stage2(marker) -> Path:
    """A second file (a plain torch.save of a ``__reduce__`` payload) for the ``torch.load`` gadget."""
    path = marker.parent / "stage2.pt"
    torch.save(_RunsCode(marker), path)
    return path


def _torch_load_gadget(load: tuple, pickle_module: tuple):
    """``torch.load(stage2, None, pickle)``: with a pickle module given, torch.load defaults to
    ``weights_only=False`` and runs the second file."""
    return lambda m, p: _pickle(
        _call(_global(*load, p), _text(str(_stage2(m)), p), b"N", _global(*pickle_module, p)), p
    )


PAYLOADS = {
    "__reduce__ object (pickle.dumps)": lambda m, p: pickle.dumps(_RunsCode(m), protocol=p),
    "__reduce__ object nested in plain data": lambda m, p: pickle.dumps(
        {"model": {"w": [1.0, 2.0]}, "extra": [("x", _RunsCode(m))]}, protocol=p
    ),
    "os.system": _system("os", "system"),
    "subprocess.call": lambda m, p: _pickle(
        _call(_global("subprocess", "call", p), _list(_text("touch", p), _text(str(m), p))), p
    ),
    "builtins.eval": lambda m, p: _pickle(
        _call(_global("builtins", "eval", p), _text(f"__import__('os').system({_touch(m)!r})", p)), p
    ),
    "builtins.exec": lambda m, p: _pickle(
        _call(_global("builtins", "exec", p), _text(f"import os; os.system({_touch(m)!r})", p)), p
    ),
    "builtins.open": lambda m, p: _pickle(_call(_global("builtins", "open", p), _text(str(m), p), _text("w", p)), p),
    "builtins.getattr(__import__('os'), 'system')": lambda m, p: _pickle(
        _call(
            _call(
                _global("builtins", "getattr", p),
                _call(_global("builtins", "__import__", p), _text("os", p)),
                _text("system", p),
            ),
            _text(_touch(m), p),
        ),
        p,
    ),
    "dotted through DCP metadata (STACK_GLOBAL)": _system(
        "torch.distributed.checkpoint.metadata", "os.system", "STACK_GLOBAL"
    ),
    "dotted through DCP metadata (GLOBAL)": _system("torch.distributed.checkpoint.metadata", "os.system", "GLOBAL"),
    "nested dotted through DCP metadata": _system(
        "torch.distributed.checkpoint.metadata", "torch.serialization.os.system"
    ),
    "dotted through the DCP file reader": _system("torch.distributed.checkpoint.filesystem", "os.system"),
    "dotted through torch": _system("torch", "serialization.os.system"),
    "dotted through torch.serialization": _system("torch.serialization", "os.system"),
    "dotted through pathlib": _system("pathlib", "os.system"),
    "dotted through numpy": _system("numpy", "f2py.os.system"),
    "torch.load with a pickle module": _torch_load_gadget(("torch", "load"), ("torch.serialization", "pickle")),
    "torch.serialization.load, dotted": _torch_load_gadget(
        ("torch", "serialization.load"), ("torch", "serialization.pickle")
    ),
    "copyreg._reconstructor(Popen)": lambda m, p: _pickle(
        _call(
            _global("copyreg", "_reconstructor", p),
            _global("subprocess", "Popen", p),
            _global("subprocess", "Popen", p),
            _list(_text("touch", p), _text(str(m), p)),
        ),
        p,
    ),
    "extension code (EXT4)": lambda m, p: _pickle(_call(b"\x84" + struct.pack("<i", EXT_CODE), _text(_touch(m), p)), p),
    "INST opcode": lambda m, p: _pickle(b"(" + _text(_touch(m), p) + b"ios\nsystem\n", p),
    "OBJ opcode": lambda m, p: _pickle(b"(" + _global("os", "system", p) + _text(_touch(m), p) + b"o", p),
}


def _runs_through_plain_pickle(name: str, proto: int) -> bool:
    """Whether plain pickle runs the payload (dotted names resolve from protocol 4 on)."""
    return "dotted" not in name or proto >= 4


@pytest.fixture(autouse=True)
def _extension_registered():
    """os.system registered as extension EXT_CODE, as a program's copyreg.add_extension would."""
    copyreg.add_extension("os", "system", EXT_CODE)
    yield
    copyreg.remove_extension("os", "system", EXT_CODE)


@pytest.mark.parametrize("name", PAYLOADS)
def test_the_payloads_run_code_through_plain_pickle(tmp_path, name):
    """The premise: each payload, loaded by plain pickle, does create its marker."""
    for proto in PROTOCOLS:
        if not _runs_through_plain_pickle(name, proto):
            continue
        marker = tmp_path / f"pwned-{proto}"
        out = pickle.loads(PAYLOADS[name](marker, proto))
        if hasattr(out, "wait"):  # Popen
            out.wait()
        if hasattr(out, "close"):  # open()
            out.close()
        assert marker.exists(), (name, proto)


# --- every loader, every payload ------------------------------------------------------------------
def _as_torch_zip(payload: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is ``payload``."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for n in src.namelist():
            dst.writestr(n, payload if n.endswith("/data.pkl") else src.read(n))
    return out.getvalue()


def _dcp_metadata(folder: Path, payload: bytes):
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match=r"\.metadata is not (readable )?DCP metadata") as err:
        sc.read_metadata(folder)
    return err


def _torch_file(folder: Path, payload: bytes, zip_archive: bool):
    path = folder / "checkpoint-1.pt"
    path.write_bytes(_as_torch_zip(payload) if zip_archive else payload)
    with pytest.raises(CheckpointError, match=r"checkpoint-1\.pt is not a readable idpsgd checkpoint") as err:
        load_torch(path)
    assert "more than tensors and plain values, refused without running it" in str(err.value)
    assert "weights_only" not in str(err.value)  # not torch's advice to load it with weights_only=False
    return err


def _error_report(folder: Path, payload: bytes):
    path = folder / "error1.pt"
    path.write_bytes(_as_torch_zip(payload))
    record = distributed._load_error(path)
    assert (
        record["type"] == "CheckpointError" and "is not a readable idpsgd distributed error report" in record["message"]
    ), record


def _cifar_batch(folder: Path, payload: bytes):
    path = folder / "data_batch_1"
    path.write_bytes(payload)
    with pytest.raises(DatasetFileError, match=r"data_batch_1 is not a CIFAR-10 python batch") as err:
        read_cifar_batch(path)
    return err


LOADERS = {
    "sharded checkpoint .metadata (read_metadata)": _dcp_metadata,
    ".pt checkpoint, raw pickle (load_torch)": lambda f, p: _torch_file(f, p, zip_archive=False),
    ".pt checkpoint, zip archive (load_torch)": lambda f, p: _torch_file(f, p, zip_archive=True),
    "distributed error report": _error_report,
    "CIFAR-10 batch": _cifar_batch,
}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("name", PAYLOADS)
def test_no_crafted_file_runs_code(tmp_path, loader, name):
    for proto in PROTOCOLS:
        folder = tmp_path / f"p{proto}"
        folder.mkdir()
        LOADERS[loader](folder, PAYLOADS[name](folder / "pwned", proto))
        assert not (folder / "pwned").exists(), (loader, name, proto)


def test_a_refused_name_is_named_in_one_line(tmp_path):
    payload = PAYLOADS["dotted through DCP metadata (STACK_GLOBAL)"](tmp_path / "pwned", 4)
    err = _dcp_metadata(tmp_path, payload)
    assert "torch.distributed.checkpoint.metadata.os.system is a dotted name" in str(err.value)
    assert "refused without running it" in str(err.value) and "\n" not in str(err.value)
    err = _cifar_batch(tmp_path, payload)
    assert "it names torch.distributed.checkpoint.metadata.os.system, which CIFAR-10 batches never contain" in str(
        err.value
    )


def test_an_extension_code_is_refused_even_once_cached(tmp_path):
    """copyreg's extension cache answers EXT opcodes without find_class: a payload that plain pickle has
    loaded once (the cache holds os.system) must still be refused."""
    payload = PAYLOADS["extension code (EXT4)"](tmp_path / "first", 4)
    pickle.loads(payload)
    assert (tmp_path / "first").exists() and copyreg._extension_cache.get(EXT_CODE) is os.system
    _dcp_metadata(tmp_path, PAYLOADS["extension code (EXT4)"](tmp_path / "pwned", 4))
    _cifar_batch(tmp_path, PAYLOADS["extension code (EXT4)"](tmp_path / "pwned", 2))
    assert not (tmp_path / "pwned").exists()


def test_npz_files_refuse_object_arrays(tmp_path):
    """The accounting's npz files (an RDP ledger, ``idpsgd account --norms``) load arrays only: an object
    array, which numpy stores as a pickle, is refused."""
    import numpy as np

    from idpsgd.accounting.ledger import RdpLedger
    from idpsgd.cli.accounting_commands import read_norms_file

    evil = np.array([_RunsCode(tmp_path / "pwned")], dtype=object)
    np.savez(tmp_path / "ledger.npz", rdp=evil, orders=np.arange(2.0, 4.0), steps=np.asarray(1))
    with pytest.raises(ValueError, match="allow_pickle=False"):
        RdpLedger.load(tmp_path / "ledger.npz")
    np.savez(tmp_path / "norms.npz", norms=evil, steps=np.arange(1))
    with pytest.raises(InvalidParameterError, match="is not a readable npz file .*allow_pickle=False"):
        read_norms_file(tmp_path / "norms.npz")
    assert not (tmp_path / "pwned").exists()


# --- objects the allow-list admits cannot be turned into something else ----------------------------
def _set_class_attribute(module, name, proto):
    """BUILD with a slot state on an allowed *class*: ``setattr(cls, "idpsgd_pwned", True)``."""
    state = b"(N}" + _text("idpsgd_pwned", proto) + b"\x88st"  # (None, {"idpsgd_pwned": True})
    return _pickle(_global(module, name, proto) + state + b"b", proto)


@pytest.mark.parametrize(
    ("module", "name"),
    [("pathlib", "PosixPath"), ("torch.distributed.checkpoint.metadata", "Metadata")],
)
def test_an_allowed_class_cannot_be_modified(tmp_path, module, name):
    cls = getattr(__import__(module, fromlist=[name]), name)
    for proto in (2, 4, 5):
        err = _dcp_metadata(tmp_path, _set_class_attribute(module, name, proto))
        assert f"setting the state of the class {name} is not allowed" in str(err.value)
        assert "idpsgd_pwned" not in vars(cls), proto


def test_an_allowed_enum_member_cannot_be_modified(tmp_path):
    """``_MEM_FORMAT_ENCODING(1)`` is the process's one member: its state is not the file's to set."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", 4) + b"(K\x01tR"
    err = _dcp_metadata(tmp_path, _pickle(member + b"(N}" + _text("idpsgd_pwned", 4) + b"\x88stb", 4))
    assert "setting the state of a _MEM_FORMAT_ENCODING is not allowed" in str(err.value)
    assert not hasattr(_MEM_FORMAT_ENCODING(1), "idpsgd_pwned")


# --- numpy's own __setstate__ methods, reached through BUILD on objects the CIFAR list admits -------
_NP = ("numpy", "numpy._core.multiarray", "numpy._core.numeric")


def _value(x) -> bytes:
    """Opcodes that push ``x`` (plain values, numpy dtypes: numpy's own pickling) in protocol 2."""
    return pickle.dumps(x, protocol=2)[2:-1]


def _object_field_dtype(flags: int) -> bytes:
    """``numpy.dtype([("a", "O")])`` (a structured dtype holding an object pointer) whose BUILD says ``flags``."""
    import numpy as np

    state = (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, flags)
    return _call(_global(_NP[0], "dtype", 2), _value([("a", "O")])) + _value(state) + b"b"


def test_a_dtype_cannot_be_told_it_holds_no_objects(tmp_path):
    """With its flags set to 0 by the file, a dtype with an object field lets ``frombuffer`` build it
    from the file's bytes (pointers); a second BUILD setting the flags back made the array dereference
    them when freed: a 477-byte data_batch_1 crashed the process (SIGSEGV) before this check."""
    pointers = _value(b"A" * 8) + _object_field_dtype(0) + _value((1,)) + _value("C")
    frombuffer = _call(_global(_NP[2], "_frombuffer", 2), pointers)
    err = _cifar_batch(tmp_path, _pickle(b"}" + _value(b"data") + frombuffer + b"s", 2))
    assert "a numpy dtype's state must be its own" in str(err.value)


def test_an_array_cannot_be_rebuilt_under_its_views(tmp_path):
    """``ndarray.__setstate__`` twice on one array (its memory replaced under a view made from it)."""
    import numpy as np

    array = _call(_global(_NP[1], "_reconstruct", 2), _global(_NP[0], "ndarray", 2) + _value((0,)) + _value(b"b"))
    state = b"(" + _value(1) + _value((1, 3072)) + _value(np.dtype("u1")) + _value(False) + _value(b"A" * 3072) + b"tb"
    again = b"h\xfe(" + _value(1) + _value((4,)) + _value(np.dtype("u1")) + _value(False) + _value(b"BBBB") + b"tb0"
    body = b"}" + _value(b"data") + array + b"q\xfe" + state + again + b"s"
    err = _cifar_batch(tmp_path, _pickle(body, 2))
    assert "setting the state of a ndarray twice is not allowed" in str(err.value)


def test_a_python_2_cifar_batch_still_reads(tmp_path):
    """cPickle protocol 0 as CIFAR-10 ships it: the dtype's state holds byte strings (read as bytes)."""
    data = bytes(range(256)) * 12 * 2
    body = (
        b"(dp0\nS'data'\np1\ncnumpy.core.multiarray\n_reconstruct\np2\n(cnumpy\nndarray\np3\n(I0\ntp4\nS'b'\np5\ntp6\n"
        b"Rp7\n(I1\n(I2\nI3072\ntp8\ncnumpy\ndtype\np9\n(S'u1'\np10\nI0\nI1\ntp11\nRp12\n"
        b"(I3\nS'|'\np13\nNNNI-1\nI-1\nI0\ntp14\nbI00\nS'" + "".join(f"\\x{b:02x}" for b in data).encode() + b"'\np15\n"
        b"tp16\nbsS'labels'\np17\n(lp18\nI3\naI7\nas."
    )
    (tmp_path / "data_batch_1").write_bytes(body)
    images, labels = read_cifar_batch(tmp_path / "data_batch_1")
    assert images.shape == (2, 3, 32, 32) and images.tobytes() == data and labels.tolist() == [3, 7]


def test_a_compressed_torch_record_is_refused(tmp_path):
    """torch reads deflated records of a zip archive: 195 KB expanded to a 200 MB tensor (any ratio); torch.save
    never compresses, so load_torch refuses a compressed record before reading it."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(64, dtype=torch.uint8)}, buf)
    original = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "checkpoint-1.pt"
    with zipfile.ZipFile(path, "w") as archive:
        for info in original.infolist():
            how = zipfile.ZIP_DEFLATED if info.filename.endswith("/data/0") else zipfile.ZIP_STORED
            archive.writestr(info.filename, original.read(info), how)
    with pytest.raises(CheckpointError, match=r"its record '.*data/0' is compressed"):
        load_torch(path)
    (tmp_path / "plain.pt").write_bytes(buf.getvalue())
    assert torch.equal(load_torch(tmp_path / "plain.pt")["w"], torch.arange(64, dtype=torch.uint8))


def test_the_allow_lists_are_exact_undotted_names():
    names = sc.metadata_globals()
    assert all("." not in n for _, n in names)
    assert ("torch.distributed.checkpoint.metadata", "os") not in names
    assert {m for m, _ in names} <= {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.serialization",
        "torch",
        "pathlib",
        "pathlib._local",
    }
    assert names[("torch", "float32")] is torch.float32 and names[("torch", "Size")] is torch.Size
    with pytest.raises(ValueError, match="dotted names"):
        load_restricted(io.BytesIO(b"N."), {("os", "path.join"): os.path.join})
    with pytest.raises(RefusedPickle, match=r"(os|posix)\.system is not allowed"):
        load_restricted(io.BytesIO(pickle.dumps(os.system)), {("builtins", "len"): len})


# --- end to end: a real checkpoint folder with one file replaced ----------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x)


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    """A sharded checkpoint written by one process (DCP's own files and state.pt)."""
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    return sc.save_sharded_checkpoint(tmp_path_factory.mktemp("real"), 1, module=net, optimizer=opt)


def _copy(ck: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run" / ck.name
    shutil.copytree(ck, out)
    return out


def _fresh():
    torch.manual_seed(1)
    net = _Net()
    return net, torch.optim.AdamW(net.parameters(), lr=0.05), {k: v.clone() for k, v in net.state_dict().items()}


def _real_metadata(ck: Path):
    with open(ck / ".metadata", "rb") as fh:
        return pickle.load(fh)  # the test's own file, trusted


METADATA_ATTACKS = {
    "dotted, protocol 4": lambda m: PAYLOADS["dotted through DCP metadata (STACK_GLOBAL)"](m, 4),
    "dotted, protocol 5, GLOBAL": lambda m: PAYLOADS["dotted through DCP metadata (GLOBAL)"](m, 5),
    "nested dotted, protocol 4": lambda m: PAYLOADS["nested dotted through DCP metadata"](m, 4),
    "__reduce__, protocol 2": lambda m: PAYLOADS["__reduce__ object (pickle.dumps)"](m, 2),
    "torch.load gadget, protocol 4": lambda m: PAYLOADS["torch.serialization.load, dotted"](m, 4),
}


@pytest.mark.parametrize("attack", METADATA_ATTACKS)
def test_load_sharded_checkpoint_refuses_crafted_metadata(real_checkpoint, tmp_path, attack):
    ck = _copy(real_checkpoint, tmp_path)
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(METADATA_ATTACKS[attack](marker))
    net, opt, before = _fresh()
    with pytest.raises(CheckpointError, match=r"\.metadata is not DCP metadata, refused without running it"):
        sc.load_sharded_checkpoint(ck, module=net, optimizer=opt)
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # nothing changed


def test_real_metadata_with_a_payload_inside_is_refused(real_checkpoint, tmp_path):
    ck = _copy(real_checkpoint, tmp_path)
    metadata = _real_metadata(ck)
    for proto in (2, 3, 4, 5):
        metadata.planner_data = {"model.a.weight": ("model", _RunsCode(tmp_path / "pwned"))}
        (ck / ".metadata").write_bytes(pickle.dumps(metadata, protocol=proto))
        net, opt, _ = _fresh()
        with pytest.raises(CheckpointError, match=r"posix\.system is not allowed|os\.system is not allowed"):
            sc.load_sharded_checkpoint(ck, module=net, optimizer=opt)
        assert not (tmp_path / "pwned").exists()


def test_a_real_checkpoint_still_loads(real_checkpoint, tmp_path):
    net, opt, _ = _fresh()
    assert sc.load_sharded_checkpoint(_copy(real_checkpoint, tmp_path), module=net, optimizer=opt) == {}
    assert not torch.equal(net.a.bias, _fresh()[0].a.bias)


def test_a_crafted_state_file_is_refused(real_checkpoint, tmp_path):
    ck = _copy(real_checkpoint, tmp_path)
    for proto in (2, 4, 5):
        torch.save({"format": sc.FORMAT, "x": _RunsCode(tmp_path / "pwned")}, ck / "state.pt", pickle_protocol=proto)
        net, opt, _ = _fresh()
        with pytest.raises(CheckpointError, match=r"state\.pt is not a readable idpsgd sharded checkpoint state"):
            sc.load_sharded_checkpoint(ck, module=net, optimizer=opt)
    assert not (tmp_path / "pwned").exists()


def test_crafted_shards_are_refused(real_checkpoint, tmp_path):
    """Every tensor and byte item of the shard file replaced by a torch.save of a payload."""
    ck = _copy(real_checkpoint, tmp_path)
    blob = _as_torch_zip(pickle.dumps(_RunsCode(tmp_path / "pwned"), protocol=4))
    metadata = _real_metadata(ck)
    for info in metadata.storage_data.values():
        info.offset, info.length = 0, len(blob)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    for shard in ck.glob("*.distcp"):
        shard.write_bytes(blob)
    net, opt, _ = _fresh()
    with pytest.raises(CheckpointError, match="the DCP shards cannot be read"):
        sc.load_sharded_checkpoint(ck, module=net, optimizer=opt)
    assert not (tmp_path / "pwned").exists()


def test_a_shard_outside_the_checkpoint_folder_is_refused(real_checkpoint, tmp_path):
    ck = _copy(real_checkpoint, tmp_path)
    (shard,) = ck.glob("*.distcp")
    shutil.copy(shard, tmp_path / "elsewhere.distcp")
    metadata = _real_metadata(ck)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    net, opt, _ = _fresh()
    with pytest.raises(CheckpointError, match=r"names a shard outside its folder \('\.\./\.\./elsewhere\.distcp'\)"):
        sc.load_sharded_checkpoint(ck, module=net, optimizer=opt)


def test_export_pretrained_refuses_crafted_metadata(real_checkpoint, tmp_path):
    ck = _copy(real_checkpoint, tmp_path)
    (ck / ".metadata").write_bytes(METADATA_ATTACKS["dotted, protocol 4"](tmp_path / "pwned"))
    with pytest.raises(CheckpointError, match=r"\.metadata is not DCP metadata, refused without running it"):
        sc.export_pretrained(ck, _Net(), tmp_path / "model")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "model").exists()


def test_hf_export_checkpoint_refuses_crafted_metadata(tmp_path):
    """A Trainer's sharded checkpoint (its model's configuration saved with it) exported by
    ``idpsgd.integrations.hf.export_checkpoint``, its ``.metadata`` replaced."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd.integrations.hf import export_checkpoint

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=16))
    ck = sc.save_sharded_checkpoint(
        tmp_path / "run" / "private", 2, module=model, extra={"model_config": model.config.to_dict()}
    )
    assert export_checkpoint(ck, tmp_path / "good").is_dir()  # the real one exports
    for attack in ("dotted, protocol 4", "dotted, protocol 5, GLOBAL"):
        (ck / ".metadata").write_bytes(METADATA_ATTACKS[attack](tmp_path / "pwned"))
        with pytest.raises(CheckpointError, match=r"\.metadata is not DCP metadata, refused without running it"):
            export_checkpoint(tmp_path / "run", tmp_path / "model")
        assert not (tmp_path / "pwned").exists() and not (tmp_path / "model").exists()


def test_engine_and_trainer_checkpoints_refuse_crafted_files(tmp_path):
    """``.pt`` checkpoints through their public readers: the engine's ``load_checkpoint`` and the
    Trainer's checkpoint reader (``checkpoint_seed`` of a run folder, as ``finetune --resume`` calls it)."""
    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd.engine import IndividualizedPrivacyEngine
    from support import toy_classification, toy_model

    x, y = toy_classification(40, 0.5)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model = toy_model()
    model, _, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10),
        budgets=np.full(40, 2.0),
        method="sample",
        target_delta=1e-5,
        epochs=1,
    )
    before = [p.detach().clone() for p in model.parameters()]
    path = tmp_path / "checkpoint-2.pt"
    for proto in (2, 4, 5):
        torch.save({"module_state_dict": {}, "x": _RunsCode(tmp_path / "pwned")}, path, pickle_protocol=proto)
        with pytest.raises(CheckpointError, match="is not a readable idpsgd checkpoint"):
            engine.load_checkpoint(path=path, module=model)
        with pytest.raises(
            CheckpointError, match=r"the BytesIO does not hold a readable checkpoint \(it holds more than tensors"
        ):
            engine.load_checkpoint(path=io.BytesIO(path.read_bytes()), module=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    pytest.importorskip("transformers")
    from idpsgd.integrations.hf.checkpoints import checkpoint_seed

    (tmp_path / "run" / "private").mkdir(parents=True)
    shutil.copy(path, tmp_path / "run" / "private" / "checkpoint-2.pt")
    with pytest.raises(CheckpointError, match="is not a readable idpsgd checkpoint"):
        checkpoint_seed(tmp_path / "run")
    assert not (tmp_path / "pwned").exists()


def test_metadata_written_by_python_3_13_reads(real_checkpoint, tmp_path, monkeypatch):
    """Python 3.13 pickles the checkpoint's path as ``pathlib._local.PosixPath`` (a module this Python,
    like 3.14, lacks)."""
    import sys

    ck = _copy(real_checkpoint, tmp_path)
    metadata = _real_metadata(ck)
    with monkeypatch.context() as m:  # pickle it as 3.13 does
        m.setitem(sys.modules, "pathlib._local", pathlib)
        m.setattr(pathlib.PosixPath, "__module__", "pathlib._local")
        data = pickle.dumps(metadata, protocol=4)
    assert b"pathlib._local" in data and "pathlib._local" not in sys.modules
    (ck / ".metadata").write_bytes(data)
    assert sc.read_metadata(ck).storage_meta.checkpoint_id == metadata.storage_meta.checkpoint_id


def test_read_metadata_reads_what_dcp_writes_in_every_dtype(tmp_path):
    """A module of bfloat16, float16, float64 and int64 tensors (and an SGD optimizer's momentum)
    round-trips through the allow-list."""

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.nn.Linear(2, 2).to(torch.bfloat16)
            self.f = torch.nn.Linear(2, 2).to(torch.float16)
            self.d = torch.nn.Linear(2, 2).to(torch.float64)
            self.register_buffer("count", torch.arange(3))

    net = Mixed()
    ck = sc.save_sharded_checkpoint(tmp_path, 1, module=net)
    metadata = sc.read_metadata(ck)
    dtypes = {md.properties.dtype for md in metadata.state_dict_metadata.values() if hasattr(md, "properties")}
    assert {torch.bfloat16, torch.float16, torch.float64, torch.int64} <= dtypes
    other = Mixed()
    sc.load_sharded_checkpoint(ck, module=other)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), other.state_dict().values(), strict=True))
    assert isinstance(metadata.storage_meta.checkpoint_id, (pathlib.PurePath, str, type(None)))


# --- the Trainer's resume reads its own private checkpoint, never transformers' files ---------------
#: what transformers' Trainer writes (save_model, its own checkpoints) and would read on its own resume
TRANSFORMERS_FILES = ("training_args.bin", "rng_state.pth", "optimizer.pt", "scheduler.pt", "scaler.pt")


def test_a_trainer_resume_never_reads_transformers_files(tmp_path):
    """A run stopped after its checkpoint at step 2, then crafted ``training_args.bin`` (and the other
    pickled files of transformers' own checkpoints) put into the run folder, ``private/`` and ``model/``:
    ``train(resume_from_checkpoint=True)`` finishes without reading any of them (it restores from
    ``private/checkpoint-2.pt`` only, loaded ``weights_only``)."""
    pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from transformers import (
        DataCollatorForLanguageModeling,
        GPT2Config,
        GPT2LMHeadModel,
        TrainerCallback,
        TrainingArguments,
    )

    from hf_text import word_tokenizer
    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    lines = [" ".join(["the", "cat", "sat", "on", "a", "mat"][: 2 + i % 5]) for i in range(16)]
    tok = word_tokenizer(lines)
    enc = tok(lines, truncation=True, max_length=8)
    train = datasets.Dataset.from_dict({**enc, "epsilon": [1.0, 8.0] * 8})

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt("stopped at step 3")

    def trainer(callbacks=None):
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=tok.vocab_size, n_embd=8, n_layer=1, n_head=2, n_positions=8)
        return IndividualizedTrainer(
            model=GPT2LMHeadModel(cfg),
            args=TrainingArguments(
                output_dir=str(tmp_path / "run"),
                per_device_train_batch_size=4,
                max_steps=4,
                save_strategy="steps",
                save_steps=2,
                use_cpu=True,
                report_to=[],
                disable_tqdm=True,
            ),
            train_dataset=train,
            processing_class=tok,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=3),
            callbacks=callbacks,
        )

    with pytest.raises(KeyboardInterrupt):
        trainer([Stop()]).train()
    run = tmp_path / "run"
    assert (run / "private" / "checkpoint-2.pt").is_file()
    marker = tmp_path / "pwned"
    for folder in (run, run / "private", run / "model"):
        folder.mkdir(exist_ok=True)
        for name in TRANSFORMERS_FILES:
            (folder / name).write_bytes(PAYLOADS["__reduce__ object (pickle.dumps)"](marker, 4))
    resumed = trainer()
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert not marker.exists()


# --- a model folder's own Python code never runs ---------------------------------------------------
def test_a_model_folder_with_code_runs_none_even_if_stdin_says_yes(tmp_path, monkeypatch):
    """A config.json with an ``auto_map`` names Python files of the folder; transformers asks on stdin
    whether to run them unless ``trust_remote_code`` is given.  finetune and the LM audit read a folder
    with ``trust_remote_code=False``: a "y" on stdin runs nothing, and the folder is refused or read as
    the plain architecture its ``model_type`` names."""
    pytest.importorskip("transformers")
    import sys

    from transformers import GPT2Config

    from idpsgd.integrations.hf.finetune import load_model, load_tokenizer, model_label2id

    marker = tmp_path / "ran"
    folder = tmp_path / "model"
    GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil-gpt2"  # no architecture of transformers': only the folder's code reads it
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (folder / "config.json").write_text(json.dumps(config))
    code = f"open({str(marker)!r}, 'w').close()\n"
    code += "from transformers import GPT2Config as EvilConfig, GPT2LMHeadModel as Evil\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    for read in (
        lambda: model_label2id(folder),
        lambda: load_tokenizer(folder),
        lambda: load_model(folder, "causal_lm", None, 0),
    ):
        with contextlib.suppress(InvalidParameterError, OSError, ValueError):
            read()  # refused: fine, as long as nothing ran
    assert not marker.exists()
