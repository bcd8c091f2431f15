"""The training loop: individualized DP-SGD with a per-group privacy ledger, checkpoints and a report.

:func:`train` runs a :class:`~idpsgd.training.plans.TrainingPlan` (one phase for uniform, Sample
and Scale; one per group for the sequential baseline).  Each step it

1. draws a Poisson batch with the examples' own rates (Boenisch et al. 2023, Alg. 1/3),
2. checks the privacy filter: with the RDP accountant, the ε every group would have *after* the
   step (its composed RDP plus this step's, converted at δ) must stay ≤ its budget, or training
   stops before the step; with the PLD accountant, the step count must stay within the phase's
   calibrated steps (PLD is evaluated on whole compositions; the per-step ledger then shows
   the looser RDP bound),
3. takes the DP-SGD step (per-example clipping at c_i, noise σ·c, division by Σ q_i),
4. composes the step's RDP into the per-group ledger (data-independent: every group in the
   phase is charged for every step, sampled or not).

The guarantee reported is data-independent individual (ε_p, δ)-DP for every example of group
p (Boenisch et al. eq. 3).  Checkpoints (model, optimizer, sampler and noise RNG states, ledger,
history) are written atomically at the end of every epoch; ``resume=True`` continues exactly.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..accounting import DEFAULT_ORDERS, RdpLedger, SampledGaussianEvent, compute_rdp, pld_epsilon, rdp_to_epsilon
from ..assignment import Budgets
from ..data import Dataset
from ..io import atomic_open, write_csv, write_json
from ..models import DEFAULT_MODEL, create_model
from ..validation import InvalidParameterError, check_delta, check_positive
from .plans import Phase, TrainingPlan, build_plan
from .private import make_private_individualized

log = logging.getLogger("idpsgd")

CHECKPOINT = "checkpoint.pt"
GUARANTEE = ("data-independent individual (epsilon_p, delta)-DP for every example of group p "
             "(Boenisch et al. 2023, eq. 3)")


@dataclass
class TrainConfig:
    """Hyperparameters of a run (everything except the data and the budgets)."""

    method: str = "sample"
    epochs: int = 30
    batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    clip_norm: float = 1.0
    accountant: str = "rdp"
    model: str | None = None
    seed: int = 0
    exclude_below: float | None = None
    progress: bool = True
    # individual privacy accounting (Yu et al. 2023)
    individual_accounting: bool = False
    refreshes_per_epoch: float = 1.0
    rounding: str = "nearest"
    rounding_step: float | None = None
    individual_clipping: bool = False
    validate_subset: int = 1000
    # PDP-SGD and its baselines (Heo et al.)
    threshold_loss: str = "fixed"
    w1: float | None = None
    rounds: int = 3
    noise_history: bool = False
    init_seed: int | None = None   # model initialisation seed (default: seed); runs can share it

    def validate(self) -> "TrainConfig":
        from ..accounting import ROUNDING

        check_positive(self.lr, "lr")
        if self.rounding not in ROUNDING:
            raise InvalidParameterError("rounding", self.rounding, f"must be one of {', '.join(ROUNDING)}")
        if self.individual_clipping and not self.individual_accounting:
            raise InvalidParameterError("individual_clipping", True, "needs individual accounting (--individual-accounting)")
        if self.threshold_loss not in ("fixed", "adaptive"):
            raise InvalidParameterError("threshold_loss", self.threshold_loss, "must be fixed or adaptive")
        from .pdp import PDP_METHODS
        if self.individual_accounting and self.method in PDP_METHODS:
            raise InvalidParameterError("method", self.method, "individual accounting supports the IDP-SGD "
                                        "methods (uniform, sample, scale, exclude)")
        if self.individual_accounting and self.method == "sequential":
            raise InvalidParameterError("method", self.method, "individual accounting supports one-phase methods "
                                        "(uniform, sample, scale, exclude)")
        if not 0 <= self.momentum < 1:
            raise InvalidParameterError("momentum", self.momentum, "must be in [0, 1)")
        if self.accountant not in ("rdp", "pld"):
            raise InvalidParameterError("accountant", self.accountant, "must be rdp or pld")
        return self


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch_size: int = 2048) -> dict:
    """Accuracy, per-class accuracy and mean cross-entropy of ``model`` on (x, y)."""
    was_training = model.training
    model.eval()
    preds, loss = [], 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            out = model(x[i:i + batch_size])
            loss += float(F.cross_entropy(out, y[i:i + batch_size], reduction="sum"))
            preds.append(out.argmax(1))
    model.train(was_training)
    pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)
    return {**accuracies(pred, y, num_classes), "loss": loss / max(len(y), 1)}


def accuracies(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict:
    """Accuracy and per-class accuracy (None for a class absent from ``y``) of predictions."""
    correct = (pred == y).numpy()
    labels = y.numpy()
    per_class = [float(correct[labels == k].mean()) if np.any(labels == k) else None for k in range(num_classes)]
    return {"accuracy": float(correct.mean()) if len(y) else float("nan"), "per_class_accuracy": per_class}


class Trainer:
    """State of one run; :meth:`run` trains to the end of the plan (or until the filter stops it)."""

    def __init__(self, dataset: Dataset, budgets: Budgets, config: TrainConfig, out_dir=None):
        self.config = config.validate()
        if len(budgets) != len(dataset.y_train):
            raise InvalidParameterError("budgets", f"{len(budgets)} values",
                                        f"need one per training example ({len(dataset.y_train)})")
        self.dataset, self.budgets = dataset, budgets
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.plan: TrainingPlan = build_plan(budgets, config.method, config.batch_size, config.epochs,
                                             config.clip_norm, config.accountant, config.exclude_below)
        self.model_name = config.model or DEFAULT_MODEL.get(dataset.name, "mlp")
        torch.manual_seed(config.seed if config.init_seed is None else config.init_seed)
        self.model: torch.nn.Module = create_model(self.model_name, dataset.input_shape, dataset.num_classes)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr, momentum=config.momentum)
        self.rng = np.random.default_rng(config.seed)
        self.noise = torch.Generator().manual_seed(config.seed)
        self.group_values, self.group_counts, self.group_of = budgets.groups()
        self.ledger = RdpLedger(self.group_values.size, DEFAULT_ORDERS)
        self.phase_idx, self.phase_epoch, self.step = 0, 0, 0
        self.stopped_early = False
        self.history: list[dict] = []
        self.ledger_rows: list[list] = []
        self.step_hooks: list = []     # fn(trainer, model, phase_step) before every step (θ_t)
        self.tracker = None            # IndividualTracker when config.individual_accounting
        self._tracker_state = None

    # --- privacy bookkeeping -------------------------------------------------------------
    def _phase_groups(self, phase: Phase):
        """Global group rows of ``phase``'s groups and their (q, effective σ)."""
        rows = np.searchsorted(self.group_values, [g.budget for g in phase.assignment.groups])
        q = np.array([g.sample_rate for g in phase.assignment.groups])
        sig = np.array([g.noise_multiplier for g in phase.assignment.groups])
        return rows, q, sig

    def _filter_allows(self, step_rdp: np.ndarray) -> tuple[bool, np.ndarray]:
        eps, _ = rdp_to_epsilon(self.ledger.rdp + step_rdp, self.ledger.orders, self.budgets.delta)
        return bool(np.all(eps <= self.group_values)), eps

    def group_events(self) -> list[list[SampledGaussianEvent]]:
        """The SGM steps each group took, derived from the steps run so far: every phase before
        the current one ran all its steps, the current one the rest of ``self.step``."""
        events: list[list[SampledGaussianEvent]] = [[] for _ in self.group_values]
        done = 0
        for k, phase in enumerate(self.plan.phases[:self.phase_idx + 1]):
            taken = phase.steps if k < self.phase_idx else self.step - done
            done += taken
            if taken > 0:
                for r, q, s in zip(*self._phase_groups(phase)):
                    events[r].append(SampledGaussianEvent(float(q), float(s), int(taken)))
        return events

    def epsilon_spent(self) -> np.ndarray:
        """ε per group (ascending budgets) with the run's accountant."""
        if self.config.accountant == "rdp":
            return self.ledger.epsilon(self.budgets.delta)[0]
        return np.array([pld_epsilon(ev, self.budgets.delta) if ev else 0.0 for ev in self.group_events()])

    # --- checkpoints ---------------------------------------------------------------------
    def _signature(self) -> dict:
        digest = hashlib.sha256(np.ascontiguousarray(self.budgets.epsilons).tobytes()).hexdigest()
        cfg = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "progress"}
        return {"config": cfg, "dataset": self.dataset.name, "n": len(self.budgets),
                "delta": self.budgets.delta, "budgets_sha256": digest}

    def _module(self) -> torch.nn.Module:
        return getattr(self.model, "_module", self.model)

    def save_checkpoint(self) -> None:
        if self.out_dir is None:
            return
        state = {"signature": self._signature(), "phase_idx": self.phase_idx, "phase_epoch": self.phase_epoch,
                 "step": self.step, "stopped_early": self.stopped_early,
                 "model": self._module().state_dict(), "optimizer": self.optimizer.state_dict(),
                 "rng": self.rng.bit_generator.state, "noise": self.noise.get_state(),
                 "ledger": self.ledger.state_dict(),
                 "history": self.history, "ledger_rows": self.ledger_rows,
                 "individual": self.tracker.state_dict() if self.tracker is not None else None}
        with atomic_open(self.out_dir / CHECKPOINT, "wb", private=True) as fh:
            torch.save(state, fh)

    def load_checkpoint(self, path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["signature"] != self._signature():
            raise InvalidParameterError("resume", str(path), "the checkpoint was written by a run with other "
                                        "data, budgets or hyperparameters; use a new --out folder")
        self._module().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.bit_generator.state = state["rng"]
        self.noise.set_state(state["noise"])
        self.ledger.load_state_dict(state["ledger"])
        self.phase_idx, self.phase_epoch, self.step = state["phase_idx"], state["phase_epoch"], state["step"]
        self.stopped_early, self.history = state["stopped_early"], state["history"]
        self.ledger_rows = state["ledger_rows"]
        self._tracker_state = state.get("individual")

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> dict:
        ds = self.dataset
        total = self.plan.steps
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook.*")
            warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
            bar = tqdm(total=total, initial=min(self.step, total), disable=None if self.config.progress else True,
                       desc=f"{self.plan.method}", unit="step", leave=False)
            while self.phase_idx < len(self.plan.phases) and not self.stopped_early:
                self._run_phase(self.plan.phases[self.phase_idx], ds, bar)
            bar.close()
        return self.report()

    def _run_phase(self, phase: Phase, ds: Dataset, bar) -> None:
        rows, q, sig = self._phase_groups(phase)
        step_rdp = np.zeros_like(self.ledger.rdp)
        step_rdp[rows] = compute_rdp(q, sig, self.ledger.orders)
        self.model, optimizer, loader = make_private_individualized(
            self.model, self.optimizer, (ds.x_train[phase.indices], ds.y_train[phase.indices]),
            phase.assignment, seed=self.rng, noise_generator=self.noise,
            steps_per_epoch=phase.steps_per_epoch)
        self.model.train()
        if self.config.individual_accounting and self.tracker is None:
            from .individual import IndividualTracker
            c = self.config
            self.tracker = IndividualTracker(
                phase.assignment, phase.steps_per_epoch, ds.x_train[phase.indices], ds.y_train[phase.indices],
                refreshes_per_epoch=c.refreshes_per_epoch, rounding=c.rounding, rounding_step=c.rounding_step,
                individual_clipping=c.individual_clipping, validate_subset=c.validate_subset, seed=c.seed)
            if self._tracker_state is not None:
                self.tracker.load_state_dict(self._tracker_state)
            self.tracker.apply_clip_norms(optimizer)
        phase_steps = self.phase_epoch * phase.steps_per_epoch
        while self.phase_epoch < phase.epochs:
            losses = []
            for x, y, _idx in loader:
                ok, eps = self._filter_allows(step_rdp)
                if self.config.accountant == "pld":  # calibrated by PLD: the RDP bound is looser
                    ok = phase_steps < phase.steps
                if not ok:
                    self.stopped_early = True
                    log.warning("stopping before step %d: a privacy group would exceed its budget", self.step + 1)
                    break
                if self.tracker is not None:
                    self.tracker.before_step(self.model, optimizer, phase_steps)
                for hook in self.step_hooks:
                    hook(self, self.model, phase_steps)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                optimizer.step()
                if self.tracker is not None:
                    self.tracker.after_step()
                self.ledger.add(step_rdp)
                self.ledger.steps += 1
                self.step += 1
                phase_steps += 1
                if len(y):
                    losses.append(float(loss.detach()))
                self.ledger_rows.append([self.step, self.phase_idx, len(self.history) + 1, len(y), *eps])
                bar.update(1)
            if self.stopped_early:
                break
            self.phase_epoch += 1
            ev = evaluate(self.model, ds.x_test, ds.y_test, ds.num_classes)
            self.history.append({"epoch": len(self.history) + 1, "phase": self.phase_idx, "step": self.step,
                                 "train_loss": float(np.mean(losses)) if losses else None,
                                 "test_accuracy": ev["accuracy"]})
            bar.set_postfix(epoch=len(self.history), test_acc=f"{ev['accuracy']:.3f}")
            log.info("epoch %d (phase %d): test accuracy %.4f", len(self.history), self.phase_idx, ev["accuracy"])
            if self.phase_epoch < phase.epochs:
                self.save_checkpoint()
        if not self.stopped_early:
            self.phase_idx, self.phase_epoch = self.phase_idx + 1, 0
        self.save_checkpoint()

    # --- the report ----------------------------------------------------------------------
    def report(self) -> dict:
        ds, plan = self.dataset, self.plan
        ev = evaluate(self.model, ds.x_test, ds.y_test, ds.num_classes)
        spent = self.epsilon_spent()
        rdp_spent = self.ledger.epsilon(self.budgets.delta)[0]
        params = {}
        for phase in plan.phases:
            rows, _, _ = self._phase_groups(phase)
            for r, g in zip(rows, phase.assignment.groups):
                params[int(r)] = g
        events = self.group_events()
        groups = []
        for r, (v, n) in enumerate(zip(self.group_values, self.group_counts)):
            g = params.get(r)
            groups.append({"budget": float(v), "count": int(n), "trained": g is not None,
                           "sample_rate": g.sample_rate if g else 0.0, "clip_norm": g.clip_norm if g else None,
                           "noise_multiplier": g.noise_multiplier if g else None,
                           "steps": sum(e.count for e in events[r]),
                           "epsilon_spent": float(spent[r]), "epsilon_rdp": float(rdp_spent[r])})
        sigmas = [p.assignment.noise_multiplier for p in plan.phases]
        extra = {}
        if self.tracker is not None:
            phase = plan.phases[0]
            extra["individual_privacy"] = self.tracker.finish(
                self.model, self.budgets.delta, phase.indices, self.budgets.epsilons[phase.indices], self.out_dir,
                ev["per_class_accuracy"], seed=self.config.seed)
        return {
            "method": plan.method, "dataset": ds.name, "model": self.model_name,
            "accountant": self.config.accountant, "guarantee": GUARANTEE, "delta": self.budgets.delta,
            "test_accuracy": ev["accuracy"], "per_class_accuracy": ev["per_class_accuracy"],
            "noise_multiplier": sigmas[0] if len(sigmas) == 1 else sigmas,
            "steps": self.step, "planned_steps": plan.steps, "stopped_early": self.stopped_early,
            "epochs": self.config.epochs, "batch_size": self.config.batch_size, "lr": self.config.lr,
            "clip_norm": self.config.clip_norm, "seed": self.config.seed,
            "phases": [{"name": p.name, "examples": int(p.indices.size), "steps": p.steps,
                        "sample_rate": p.assignment.sample_rate, "noise_multiplier": p.assignment.noise_multiplier}
                       for p in plan.phases],
            "groups": groups, "history": self.history, **extra,
        }

    def write_outputs(self, report: dict) -> None:
        """report.json, ledger.csv (ε per group after every step) and model.pt in the run folder."""
        if self.out_dir is None:
            return
        header = ["step", "phase", "epoch", "batch_size"] + [f"epsilon_rdp_budget_{v:g}" for v in self.group_values]
        cols = list(zip(*self.ledger_rows)) if self.ledger_rows else [[] for _ in header]
        write_csv(self.out_dir / "ledger.csv", header, cols)
        with atomic_open(self.out_dir / "model.pt", "wb", private=True) as fh:
            torch.save(self._module().state_dict(), fh)
        write_json(self.out_dir / "report.json", report)


def train(dataset: Dataset, budgets: Budgets, config: TrainConfig, out_dir=None, resume: bool = False) -> dict:
    """Train with individualized budgets; returns the report (also written to ``out_dir``).

    Args:
        dataset: the data (:func:`idpsgd.data.load_dataset`).
        budgets: one budget per training example and δ.
        config: method and hyperparameters.
        out_dir: run folder for report.json, ledger.csv, model.pt and checkpoint.pt.
        resume: continue from ``out_dir/checkpoint.pt`` if it exists.
    """
    check_delta(budgets.delta)
    from .pdp import PDP_METHODS, train_pdp
    if config.method in PDP_METHODS:  # (Φ, Δ)-PDP methods: their own round structure, no checkpoints
        config.validate()
        if resume:
            raise InvalidParameterError("resume", True, f"{config.method} runs have no checkpoints to resume")
        return train_pdp(dataset, budgets, config, out_dir)
    trainer = Trainer(dataset, budgets, config, out_dir)
    ckpt = trainer.out_dir / CHECKPOINT if trainer.out_dir is not None else None
    if resume and ckpt is not None and ckpt.is_file():
        trainer.load_checkpoint(ckpt)
        log.info("resumed from %s at step %d", ckpt, trainer.step)
    report = trainer.run()
    trainer.write_outputs(report)
    return report
