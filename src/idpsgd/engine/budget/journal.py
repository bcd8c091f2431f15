"""The private journal of drawn steps: every noise draw made under a run folder is charged.

A DP-SGD step's output (θ_{t+1}, and whatever is computed from it: a logged evaluation, a
checkpoint, a published model) is one Poisson-subsampled Gaussian mechanism (Boenisch et al. 2023,
Alg. 3).  A run that crashes and resumes from an older checkpoint draws the steps after it again;
in secure mode with fresh noise, so the abandoned draws — which may have left the process — are
further mechanisms on the same data and must be composed with the kept steps.  This module keeps the
evidence: before the noise of each step (after the guards admitted it) one JSON line is appended to
``private/drawn_steps.jsonl`` (mode 0600 in the 0700 ``private/``) and fsync'd, naming the step
index, the attempt (a random id per process that trains), the accountant's phase and its classes of
examples — ``(group, q, σ_eff)``, the step's accounting event as the accountant sees it — and, in
reproducible mode, the SHA-256 of the noise generator's state before the draw.

On resume (:meth:`DrawJournal.reconcile`, run by the engine when its state is loaded, and when a
run starts in a folder that already holds draws) every recorded draw that the checkpoint does not
cover (the kept steps and the draws it already charged: :meth:`state_dict`) is charged to the
accountant (:meth:`~.accountant.GroupAccountant.charge_drawn`):

* **secure mode**: as a released step (it composes with the kept steps);
* **reproducible mode**: the same seed and generator state at the same step index give the same
  draw, so an attempt whose draw of the first step after the checkpoint had the state the resumed
  run now has is replayed by the resumed run: its draws are *pending* — the kept step that replays
  one is the same output, charged once (so a reproducible resume stays bit-equal to the uninterrupted
  run, its ledger included); each replay is checked at its draw (a different generator state at a
  pending step refuses the step), and pending draws the run ends without reaching are charged when it
  reports (:func:`step_counts`).  Any other draw is released.

A torn last line (a process killed while appending) is no record: the noise is drawn only after the
line is whole on disk.  Multi-process runs: rank 0 writes; it reads the earlier records at set-up
and broadcasts them, and every rank decides alike (the same records, the same generator state at
load), so every rank's ledger is the same.  User guide: docs/guarantees.md (The seed and secure mode).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

import torch

from ...validation import InvalidParameterError
from .. import distributed
from ..noise.randomness import Deferred

JOURNAL = "drawn_steps.jsonl"
FORMAT = "idpsgd.drawn-steps/1"


def noise_state_sha256(generator) -> str | None:
    """SHA-256 of a seeded noise generator's state (a ``torch.Generator``, built or deferred and
    built); None for OS entropy (secure mode), which has no state that could be replayed."""
    if isinstance(generator, Deferred):
        if generator._built is None:  # not drawn from yet: its seed is not known
            return None
        generator = generator._built
    if not isinstance(generator, torch.Generator):
        return None
    return hashlib.sha256(generator.get_state().cpu().numpy().tobytes()).hexdigest()


def _ranges(steps) -> list[list[int]]:
    """Sorted step indices as ``[[first, last], ...]`` runs (compact, plain data)."""
    out: list[list[int]] = []
    for s in sorted({int(x) for x in steps}):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _steps(ranges) -> set[int]:
    return {s for lo, hi in ranges for s in range(int(lo), int(hi) + 1)}


def read_records(path) -> list[dict]:
    """The journal's whole records, in order (a torn last line is no record; a malformed whole line
    is refused: the file is the run's privacy evidence)."""
    p = Path(path)
    if not p.is_file():
        return []
    raw = p.read_bytes()
    lines = raw.split(b"\n")
    whole = lines[:-1]  # the part after the last newline is torn (or empty)
    out = []
    for n, line in enumerate(whole, start=1):
        try:
            rec = json.loads(line)
            if rec.get("format") != FORMAT:
                raise ValueError("format")
            out.append(rec)
        except (ValueError, AttributeError):
            raise InvalidParameterError(
                "resume",
                f"{p}:{n}",
                "is not a record of idpsgd's journal of drawn steps: the file is the evidence of every noise "
                "draw of the run and cannot be read; restore it, or start a new run",
            ) from None
    return out


class DrawJournal:
    """The append-only journal of one run folder's noise draws, attached to one engine.

    Args:
        path: the journal file (``<run>/private/drawn_steps.jsonl``).
        writer: whether this process appends (rank 0 of a multi-process run; default: the main process).
    """

    def __init__(self, path, writer: bool | None = None):
        self.path = Path(path)
        self.writer = distributed.is_main_process() if writer is None else bool(writer)
        self.attempt = secrets.token_hex(8)
        self.covered: dict[str, set[int]] = {}  # (attempt → steps) kept or charged by this engine's ledger
        self.drawn: set[int] = set()  # this attempt's draws
        self.pending: dict[int, set[str]] = {}  # step → digests of the draws a replay must match
        self.charged = {"released": 0, "pending": 0}
        self.reconciled = False
        self.records: list[dict] | None = None  # the earlier attempts' records (read at set-up)

    def load_records(self) -> list[dict]:
        """Read the earlier attempts' records once, at the engine's set-up (a collective point of a
        multi-process run: rank 0 reads, every rank gets the same list — or the same refusal)."""
        if self.records is not None:
            return self.records
        found = None
        if self.writer:
            try:
                found = ("ok", read_records(self.path), self.attempt)
            except InvalidParameterError as exc:
                found = ("refused", (exc.name, exc.value, exc.allowed), self.attempt)
        if distributed.is_distributed():  # rank 0's records and attempt id: every rank's checkpoint names it
            found = distributed.broadcast_object(found)
        if found[0] != "ok":
            raise InvalidParameterError(*found[1])
        self.attempt = found[2]
        self.records = [r for r in found[1] if r.get("attempt") != self.attempt]
        return self.records

    # --- writing -----------------------------------------------------------------------------
    def record(self, engine) -> None:
        """Before the noise of the next step (the guards admitted it): check a pending replay, then
        append and fsync the step's record (rank 0)."""
        acc = engine.accountant
        step = acc.steps + 1
        digest = noise_state_sha256(engine.noise_source)
        expected = self.pending.get(step) if self.writer else None  # rank 0 draws the noise
        if expected and digest not in expected:
            raise RuntimeError(
                f"step {step} does not replay the noise an earlier attempt of this run drew at that step (the noise "
                "generator's state differs from the journal's record), so the replay would be a second release "
                "that the ledger does not charge; the step was not taken. Resume from the checkpoint the run was "
                "resumed from with the same seed, or in secure mode"
            )
        self.drawn.add(step)
        if not self.writer:
            return
        ph = acc.phases[-1]
        rec = {
            "format": FORMAT,
            "step": step,
            "attempt": self.attempt,
            "phase": len(acc.phases) - 1,
            "phase_sha256": ph["sha256"],
            # the step's accounting event per class of examples: (privacy group, q, effective σ)
            "events": [[int(g), float(q), float(s)] for g, q, s in zip(ph["group"], ph["q"], ph["sigma"], strict=True)],
            "secure_mode": bool(engine.secure_mode),
            "noise_state_sha256": digest,
        }
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- resume ------------------------------------------------------------------------------
    def reconcile(self, engine, saved: dict | None, *, checkpoint: bool) -> dict:
        """Charge every recorded draw the loaded state does not cover (see the module docstring).

        ``saved``: the journal state a checkpoint holds (None: a fresh start, or a checkpoint from
        before the journal, whose kept steps are taken to be the records at indices up to its step
        count).  Returns ``{"released": n, "pending": m}`` (the draws charged now)."""
        acc = engine.accountant
        kept = acc.steps
        covered = {a: _steps(r) for a, r in (saved or {}).get("covered", {}).items()}
        records = self.load_records()  # (every rank: the same records, the same generator state here)
        if saved is None and checkpoint:
            for r in records:
                if int(r["step"]) <= kept:
                    covered.setdefault(r["attempt"], set()).add(int(r["step"]))
        now = None if engine.secure_mode else noise_state_sha256(engine.noise_source)
        first = {r["attempt"]: r.get("noise_state_sha256") for r in records if int(r["step"]) == kept + 1}
        decisions, seen = [], set()
        for r in records:
            a, s = r["attempt"], int(r["step"])
            if s in covered.get(a, ()) or (a, s) in seen:  # (a step refused after its record is recorded again)
                continue
            seen.add((a, s))
            replay = now is not None and s > kept and first.get(a) == now
            decisions.append((r, replay))
        if decisions and getattr(engine, "filter", None) is not None:
            raise InvalidParameterError(
                "resume",
                f"{len(decisions)} earlier noise draws",
                "are not covered by the checkpoint and the individual filter cannot charge them (its per-example "
                "ledger holds the kept steps only); resume from the latest checkpoint, or start a new run",
            )
        acc.charge_drawn(
            [
                {
                    "phase": int(r["phase"]),
                    "sha256": r["phase_sha256"],
                    "events": r["events"],
                    "at": int(r["step"]) if replay else None,
                }
                for r, replay in decisions
            ]
        )
        self.covered = covered
        self.pending = {}
        counts = {"released": 0, "pending": 0}
        for r, replay in decisions:
            self.covered.setdefault(r["attempt"], set()).add(int(r["step"]))
            counts["pending" if replay else "released"] += 1
            if replay:
                self.pending.setdefault(int(r["step"]), set()).add(r.get("noise_state_sha256"))
        self.charged = counts
        self.reconciled = True
        return counts

    def state_dict(self) -> dict:
        """What a checkpoint must know: every draw its ledger covers, kept or charged (plain data)."""
        covered = {a: set(s) for a, s in self.covered.items()}
        covered.setdefault(self.attempt, set()).update(self.drawn)
        return {"format": FORMAT, "covered": {a: _ranges(s) for a, s in sorted(covered.items()) if s}}


def step_counts(engine) -> dict:
    """The report's step counts (public hyper-parameters), once the run ended (its unreached pending
    replays charged: :meth:`~.accountant.GroupAccountant.settle`; call before the report's ε):
    ``steps_kept`` (the steps the model descends from), ``steps_charged`` (every step ε covers) and,
    after a resume that charged draws, ``steps_released`` (draws of abandoned attempts)."""
    acc = engine.accountant
    if acc is None:
        return {"steps_kept": 0, "steps_charged": 0}
    engine.finish_journal()
    out = {"steps_kept": acc.steps, "steps_charged": acc.charged_steps}
    if acc.released_steps:
        out["steps_released"] = acc.released_steps
    return out


def register_journal(folder) -> None:
    """List the journal in a run folder's manifest (rank 0, when the outputs are written)."""
    if (folder.path / "private" / JOURNAL).is_file():
        folder.file(
            JOURNAL,
            "private",
            "every noise draw of the run (step, attempt, its accounting event; in reproducible mode the noise "
            "generator's state digest): the draws a resume did not keep are charged (never delete it)",
        )


__all__ = ["JOURNAL", "DrawJournal", "noise_state_sha256", "read_records", "register_journal", "step_counts"]
