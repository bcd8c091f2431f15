"""A run folder: two kinds of output, by construction.

Everything a run writes is either

* **public** — covered by the reported guarantees: the model, the guarantee per group, privately
  released statistics, test-set metrics, hyper-parameters, plots of those (mode 0644, at the top
  of the folder); or
* **private** — not covered: per-example budgets and ε, exact statistics of them, real batch
  sizes, training losses, gradient norms, checkpoints, membership scores, the seed (mode 0600, in
  the ``private/`` subfolder; the seed in ``private/seed.json``, :meth:`RunFolder.record_seed`).

Writers name the kind; :class:`RunFolder` places and protects the file, and records it in the
folder's manifest ``outputs.json`` (public: it lists names, kinds and descriptions only).  The
folder is checked before any work: it must be creatable and writable and must not be a file; a
folder that holds another run needs ``resume`` or ``overwrite`` (which first removes the old run's
files).  Leftover temporary files of an interrupted atomic write are removed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .io import atomic_open, save_torch, write_csv, write_json, write_npz
from .validation import InvalidParameterError

MANIFEST = "outputs.json"
PRIVATE = "private"
KINDS = ("public", "private")
SEED_FILE = "seed.json"


class RunFolder:
    """Output folder of one run.

    Args:
        path: the folder (created if needed).
        flag: the command-line flag that named it (for error messages), e.g. ``out``.
        resume: continue a run already in the folder.
        overwrite: remove a previous run's files first.
    """

    def __init__(self, path, *, flag: str = "out", resume: bool = False, overwrite: bool = False):
        if path is None or str(path).strip() == "":
            raise InvalidParameterError(flag, "" if path is None else str(path), "must name a folder for the run")
        self.path = Path(path)
        self.flag = flag
        self.created = not self.path.exists()
        self._check(resume, overwrite)
        self.manifest: dict[str, dict] = self._read_manifest() if resume else {}

    # --- checks ----------------------------------------------------------------------------
    def _check(self, resume: bool, overwrite: bool) -> None:
        p = self.path
        for parent in [p, *p.parents]:
            if parent.exists() and not parent.is_dir():
                what = "is a file" if parent == p else f"is under the file {parent}"
                raise InvalidParameterError(self.flag, str(p), f"{what}; give a folder")
        try:
            p.mkdir(parents=True, exist_ok=True)
            (p / PRIVATE).mkdir(exist_ok=True)
            os.chmod(p / PRIVATE, 0o700)
        except OSError as exc:
            raise InvalidParameterError(self.flag, str(p), f"cannot be created ({exc.strerror})") from None
        if not os.access(p, os.W_OK | os.X_OK) or not os.access(p / PRIVATE, os.W_OK | os.X_OK):
            raise InvalidParameterError(self.flag, str(p), "is not writable")
        self.clean_temporary()
        holds_run = (
            (p / MANIFEST).exists() or any(q.name != PRIVATE for q in p.iterdir()) or any((p / PRIVATE).iterdir())
        )
        if holds_run and not resume:
            if not overwrite:
                raise InvalidParameterError(
                    self.flag,
                    str(p),
                    "already holds files of another run; use --resume to "
                    "continue it, --overwrite to replace it, or a new folder",
                )
            self.clear()

    def discard_if_unused(self) -> None:
        """Remove the folder again if this run created it and wrote nothing into it (a refused run
        leaves no empty folder behind)."""
        if (
            self.created
            and not self.manifest
            and self.path.is_dir()
            and not any((self.path / PRIVATE).iterdir())
            and all(q.name == PRIVATE for q in self.path.iterdir())
        ):
            shutil.rmtree(self.path, ignore_errors=True)

    def clean_temporary(self) -> None:
        """Remove temporary files left by atomic writes that were killed."""
        for folder in (self.path, self.path / PRIVATE):
            if folder.is_dir():
                for tmp in folder.glob(".*.tmp"):
                    if tmp.is_dir() and not tmp.is_symlink():  # an interrupted save_directory
                        shutil.rmtree(tmp, ignore_errors=True)
                    else:
                        tmp.unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove the previous run's files (what its manifest lists, the private folder, known outputs)."""
        listed = set(self._read_manifest())
        for name in listed:
            target = self.path / name
            if target.is_dir() and not target.is_symlink():  # a folder of files (save_directory)
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        shutil.rmtree(self.path / PRIVATE, ignore_errors=True)
        (self.path / PRIVATE).mkdir(mode=0o700)
        for q in self.path.iterdir():  # files of runs from before manifests existed
            if q.is_file() and q.suffix in (".json", ".csv", ".png", ".pt", ".npz", ".html", ".txt"):
                q.unlink()
        (self.path / MANIFEST).unlink(missing_ok=True)

    def _read_manifest(self) -> dict:
        try:
            data = json.loads((self.path / MANIFEST).read_text())
            return {k: v for k, v in data.get("files", {}).items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError):
            return {}

    # --- writing ---------------------------------------------------------------------------
    def file(self, name: str, kind: str, description: str) -> Path:
        """Where a ``kind`` file called ``name`` goes (recorded in the manifest)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        rel = f"{PRIVATE}/{name}" if kind == "private" else name
        self.manifest[rel] = {"kind": kind, "description": description}
        self._write_manifest()
        path = self.path / rel
        if kind == "private" and path.parent != self.path / PRIVATE:  # sub-folders of private/: 0700 too
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path.parent, 0o700)
        return path

    def _write_manifest(self) -> None:
        write_json(
            self.path / MANIFEST,
            {
                "about": "Files of this run. public: covered by the reported privacy guarantees (mode 0644). private: "
                "not covered (per-example values, exact statistics, batch sizes, losses, norms, checkpoints; "
                "mode 0600, in private/); never publish them.",
                "files": dict(sorted(self.manifest.items())),
            },
        )

    def write_json(self, name: str, data, kind: str, description: str) -> Path:
        return write_json(self.file(name, kind, description), data, private=kind == "private")

    def write_csv(self, name: str, header, columns, kind: str, description: str) -> Path:
        return write_csv(self.file(name, kind, description), header, columns, private=kind == "private")

    def write_npz(self, name: str, kind: str, description: str, **arrays) -> Path:
        return write_npz(self.file(name, kind, description), private=kind == "private", **arrays)

    def save_torch(self, name: str, state, kind: str, description: str) -> Path:
        return save_torch(self.file(name, kind, description), state, private=kind == "private")

    def record_seed(self, seed: int, about: str, name: str = SEED_FILE, **extra) -> Path:
        """Write the run's seed to ``private/<name>`` (mode 0600): it replays the sampling and the noise,
        so it is as secret as the data and never goes into a public file."""
        return self.write_json(
            name,
            {"seed": int(seed), **extra, "about": about},
            "private",
            "the seed (it replays the run's sampling and noise: never publish it)",
        )

    def save_figure(self, name: str, fig, kind: str, description: str) -> Path:
        import matplotlib.pyplot as plt

        path = self.file(name, kind, description)
        with atomic_open(path, "wb", private=kind == "private") as fh:
            fig.savefig(fh, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        return path

    def save_directory(self, name: str, kind: str, description: str, write) -> Path:
        """A folder of files that ``write(path)`` creates (e.g. a Hugging Face ``save_pretrained``),
        placed atomically: written into a temporary folder beside it, then renamed into place (an
        earlier folder of that name is replaced).  Public folders get mode 0755 and files 0644;
        private ones 0700 and 0600.  The folder is one manifest entry."""
        import tempfile

        target = self.file(name, kind, description)
        private = kind == "private"
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
        try:
            write(tmp)
            for root, dirs, files in os.walk(tmp):
                for d in dirs:
                    os.chmod(Path(root) / d, 0o700 if private else 0o755)
                for f in files:
                    os.chmod(Path(root) / f, 0o600 if private else 0o644)
            os.chmod(tmp, 0o700 if private else 0o755)
            old = None
            if target.exists():
                old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old.", suffix=".tmp"))
                os.replace(target, old / "replaced")
            os.replace(tmp, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def remove(self, name: str, kind: str) -> None:
        """Remove a file this run wrote (e.g. an old checkpoint) and its manifest entry."""
        rel = f"{PRIVATE}/{name}" if kind == "private" else name
        (self.path / rel).unlink(missing_ok=True)
        if self.manifest.pop(rel, None) is not None:
            self._write_manifest()

    def files(self, kind: str | None = None) -> dict[str, dict]:
        return {k: v for k, v in self.manifest.items() if kind is None or v["kind"] == kind}
