"""The ``train`` harness: a training recipe on :class:`~idpsgd.engine.IndividualizedPrivacyEngine`.

:func:`train` runs a :class:`~idpsgd.training.plans.TrainingPlan` (one phase for uniform, Sample
and Scale; one per group for the sequential baseline) on one engine.  Each phase is one
``make_private_with_parameters`` call with the phase's per-example rates and clip norms (0 rate
outside the phase); each step

1. asks the engine's privacy filter whether one more step keeps every group within its budget
   (with the run's accountant, RDP or PLD), and stops the run otherwise,
2. draws a Poisson batch with the examples' own rates (Boenisch et al. 2023, Alg. 1/3) and takes
   the DP-SGD step (per-example clipping at c_i, noise σ·c, division by Σ q_i),
3. is charged by the engine's accountant to every example of the phase, sampled or not.

The guarantee reported is data-independent individual (ε_p, δ)-DP for every example of group p
(Boenisch et al. eq. 3).  Checkpoints (model, optimizer, engine state: accountant, sampler and
noise generators, individual accounting) are written atomically at the end of every epoch and
load with ``weights_only=True``; ``resume=True`` continues exactly.

The model may be a registry name (``config.model``) or any ``nn.Module``; the loss any criterion
with a ``reduction`` attribute (default ``nn.CrossEntropyLoss``); the optimizer any
``optimizer_factory(params)`` (default SGD with ``lr`` and ``momentum``).
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
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from ..analysis.metrics import accuracies, evaluate  # noqa: F401  (re-exported)
from ..assignment import Budgets
from ..data import Dataset
from ..engine import GUARANTEE, IndividualizedPrivacyEngine
from ..engine.individual import IndividualAccountingOptions
from ..engine.randomness import resolve_seed
from ..io import load_torch, save_torch, write_csv, write_json
from ..models import DEFAULT_MODEL, create_model
from ..validation import InvalidParameterError, check_delta, check_positive
from .plans import Phase, TrainingPlan, build_plan

log = logging.getLogger("idpsgd")

CHECKPOINT = "checkpoint.pt"
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` (refused when no GPU is visible), ``auto`` (cuda if available), or a torch
    device string such as ``cuda:1``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidParameterError("device", device, f"must be one of {', '.join(DEVICES)} or a torch device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", device, "no CUDA device is available here; use cpu or auto")
    return dev


@dataclass
class TrainConfig:
    """Hyperparameters of a run shared by every method (method-specific options live with the
    method: :class:`~idpsgd.engine.individual.IndividualAccountingOptions`, PDP options, ...)."""

    method: str = "sample"
    epochs: int = 30
    batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    clip_norm: float = 1.0
    accountant: str = "rdp"
    model: str | None = None
    seed: int | None = None          # None: a fresh seed, recorded in the report
    secure_mode: bool = False
    device: str = "cpu"
    grad_sample_mode: str = "hooks"
    exclude_below: float | None = None
    progress: bool = True
    init_seed: int | None = None     # model initialisation seed (default: seed); runs can share it
    # PDP-SGD and its baselines (Heo et al.); read by training.pdp
    threshold_loss: str = "fixed"
    w1: float | None = None
    rounds: int = 3
    noise_history: bool = False

    def validate(self) -> "TrainConfig":
        check_positive(self.lr, "lr")
        if not 0 <= self.momentum < 1:
            raise InvalidParameterError("momentum", self.momentum, "must be in [0, 1)")
        if self.accountant not in ("rdp", "pld"):
            raise InvalidParameterError("accountant", self.accountant, "must be rdp or pld")
        if self.grad_sample_mode not in ("hooks", "functorch", "ghost"):
            raise InvalidParameterError("grad_sample_mode", self.grad_sample_mode, "must be hooks, functorch or ghost")
        resolve_device(self.device)
        return self


class Trainer:
    """State of one run; :meth:`run` trains to the end of the plan (or until the filter stops it).

    Args:
        dataset: the data (:func:`idpsgd.data.load_dataset`).
        budgets: one budget per training example and δ.
        config: shared hyperparameters.
        out_dir: run folder (checkpoints, report), or None.
        model: an ``nn.Module`` to train instead of the registry model ``config.model``.
        criterion: the loss, an ``nn.Module`` with a ``reduction`` attribute (default cross-entropy).
        optimizer_factory: ``fn(parameters) -> torch.optim.Optimizer`` (default SGD(lr, momentum)).
        individual: individual accounting options (Yu et al. 2023), or None.
    """

    def __init__(self, dataset: Dataset, budgets: Budgets, config: TrainConfig, out_dir=None, *,
                 model: torch.nn.Module | None = None, criterion=None, optimizer_factory=None,
                 individual: IndividualAccountingOptions | None = None):
        self.config = config.validate()
        if len(budgets) != len(dataset.y_train):
            raise InvalidParameterError("budgets", f"{len(budgets)} values",
                                        f"need one per training example ({len(dataset.y_train)})")
        if individual is not None and config.method == "sequential":
            raise InvalidParameterError("method", config.method, "individual accounting supports one-phase methods "
                                        "(uniform, sample, scale, exclude)")
        self.dataset, self.budgets = dataset, budgets
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.seed = resolve_seed(config.seed, config.secure_mode)
        self.device = resolve_device(config.device)
        self.plan: TrainingPlan = build_plan(budgets, config.method, config.batch_size, config.epochs,
                                             config.clip_norm, config.accountant, config.exclude_below)
        init = config.init_seed if config.init_seed is not None else self.seed
        torch.manual_seed(init if init is not None else torch.seed())
        if model is None:
            self.model_name = config.model or DEFAULT_MODEL.get(dataset.name, "mlp")
            model = create_model(self.model_name, dataset.input_shape, dataset.num_classes)
        else:
            if not isinstance(model, torch.nn.Module):
                raise InvalidParameterError("model", type(model).__name__, "must be a torch.nn.Module")
            self.model_name = type(model).__name__
        self.model: torch.nn.Module = model.to(self.device)
        self.criterion = criterion if criterion is not None else torch.nn.CrossEntropyLoss()
        if not hasattr(self.criterion, "reduction"):
            raise InvalidParameterError("criterion", type(self.criterion).__name__,
                                        "must be a loss module with a reduction attribute (e.g. nn.CrossEntropyLoss())")
        make_opt = optimizer_factory or (lambda params: torch.optim.SGD(params, lr=config.lr, momentum=config.momentum))
        self.optimizer = make_opt(self.model.parameters())
        self.engine = IndividualizedPrivacyEngine(accountant=config.accountant, secure_mode=config.secure_mode,
                                                  seed=self.seed)
        if individual is not None:
            self.engine.enable_individual_accounting(individual, per_sample_loss=self._per_sample_loss)
        self.loader = DataLoader(TensorDataset(dataset.x_train, dataset.y_train), batch_size=config.batch_size)
        self.group_values, self.group_counts, self.group_of = budgets.groups()
        self.phase_idx, self.phase_epoch, self.step = 0, 0, 0
        self.stopped_early = False
        self.history: list[dict] = []
        self.ledger_rows: list[list] = []
        self.step_hooks: list = []     # fn(trainer, model, phase_step) before every step (θ_t)
        self._engine_state = None
        self._phase_ready = -1

    @property
    def tracker(self):
        return self.engine.individual

    def per_example_loss(self, outputs, targets) -> torch.Tensor:
        """The criterion with ``reduction="none"``: one loss per example."""
        crit, old = self.criterion, self.criterion.reduction
        crit.reduction = "none"
        try:
            return crit(outputs, targets)
        finally:
            crit.reduction = old

    def _per_sample_loss(self, module, batch):
        return self.per_example_loss(module(batch[0]), batch[1])

    # --- privacy bookkeeping -------------------------------------------------------------
    def _phase_arrays(self, phase: Phase):
        """Full-length per-example rates and clip norms of ``phase`` (rate 0 outside it)."""
        n = len(self.budgets)
        a = phase.assignment
        q = np.zeros(n)
        c = np.full(n, a.clip_norm)
        q[phase.indices] = a.sample_rates
        c[phase.indices] = a.clip_norms
        return q, c

    def _start_phase(self, phase: Phase):
        q, c = self._phase_arrays(phase)
        a = phase.assignment
        out = self.engine.make_private_with_parameters(
            module=self.model, optimizer=self.optimizer, data_loader=self.loader, budgets=self.budgets,
            sample_rates=q, clip_norms=c, noise_multiplier=a.noise_multiplier, max_grad_norm=a.clip_norm,
            steps=phase.steps, steps_per_epoch=phase.steps_per_epoch,
            grad_sample_mode=self.config.grad_sample_mode, criterion=self.criterion)
        if self.config.grad_sample_mode == "ghost":
            self.model, self.dp_optimizer, self.loss_fn, self.private_loader = out
        else:
            self.model, self.dp_optimizer, self.private_loader = out
            self.loss_fn = self.criterion
        if self._engine_state is not None:
            self.engine.load_state_dict(self._engine_state)
            self._engine_state = None
        self._phase_ready = self.phase_idx

    def epsilon_spent(self) -> np.ndarray:
        """ε per group (ascending budgets) with the run's accountant."""
        if self.engine.accountant is None:
            return np.zeros(self.group_values.size)
        return self.engine.get_epsilon()

    # --- checkpoints ---------------------------------------------------------------------
    def _signature(self) -> dict:
        digest = hashlib.sha256(np.ascontiguousarray(self.budgets.epsilons).tobytes()).hexdigest()
        cfg = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in ("progress", "device")}
        cfg["seed"] = self.seed
        return {"config": cfg, "dataset": self.dataset.name, "n": len(self.budgets),
                "delta": self.budgets.delta, "budgets_sha256": digest, "model": self.model_name,
                "individual": dataclasses.asdict(self.tracker.options) if self.tracker is not None else None}

    def _module(self) -> torch.nn.Module:
        return getattr(self.model, "_module", self.model)

    def save_checkpoint(self) -> None:
        if self.out_dir is None:
            return
        state = {"signature": self._signature(), "phase_idx": self.phase_idx, "phase_epoch": self.phase_epoch,
                 "step": self.step, "stopped_early": self.stopped_early,
                 "model": self._module().state_dict(), "optimizer": self.optimizer.state_dict(),
                 "engine": self.engine.state_dict() if self.engine.accountant is not None else None,
                 "history": self.history, "ledger_rows": self.ledger_rows}
        save_torch(self.out_dir / CHECKPOINT, state)

    def load_checkpoint(self, path) -> None:
        state = load_torch(path)
        if not isinstance(state, dict) or "signature" not in state:
            raise InvalidParameterError("resume", str(path), "is not an idpsgd training checkpoint")
        differences = signature_differences(state["signature"], self._signature())
        if differences:
            raise InvalidParameterError("resume", str(path), "the checkpoint was written by a run with other settings ("
                                        + "; ".join(differences[:4]) + "); use a new --out folder or the same settings")
        self._module().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.phase_idx, self.phase_epoch, self.step = state["phase_idx"], state["phase_epoch"], state["step"]
        self.stopped_early, self.history = state["stopped_early"], state["history"]
        self.ledger_rows = state["ledger_rows"]
        self._engine_state = state["engine"]

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> dict:
        total = self.plan.steps
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook.*")
            warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
            bar = tqdm(total=total, initial=min(self.step, total), disable=None if self.config.progress else True,
                       desc=f"{self.plan.method}", unit="step", leave=False)
            while self.phase_idx < len(self.plan.phases) and not self.stopped_early:
                self._run_phase(self.plan.phases[self.phase_idx], bar)
            bar.close()
            if self._phase_ready < 0 and self._engine_state is not None:   # resumed after the last phase
                self._start_phase(self.plan.phases[-1])
        return self.report()

    def _run_phase(self, phase: Phase, bar) -> None:
        ds, dev = self.dataset, self.device
        self._start_phase(phase)
        self.model.train()
        phase_steps = self.phase_epoch * phase.steps_per_epoch
        while self.phase_epoch < phase.epochs:
            losses = []
            for x, y in self.private_loader:
                if not self.engine.can_step():
                    self.stopped_early = True
                    log.warning("stopping before step %d: a privacy group would exceed its budget", self.step + 1)
                    break
                for hook in self.step_hooks:
                    hook(self, self.model, phase_steps)
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                self.dp_optimizer.zero_grad(set_to_none=True)
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                self.dp_optimizer.step()
                self.step += 1
                phase_steps += 1
                if len(y):
                    losses.append(float(loss.detach()))
                self.ledger_rows.append([self.step, self.phase_idx, len(self.history) + 1, len(y),
                                         *self.engine.accountant.grid_epsilon()])
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
        rdp_spent = self.engine.accountant.grid_epsilon() if self.engine.accountant is not None else spent
        params, steps = {}, np.zeros(self.group_values.size, dtype=np.int64)
        done = 0
        for k, phase in enumerate(plan.phases):
            rows = np.searchsorted(self.group_values, [g.budget for g in phase.assignment.groups])
            for r, g in zip(rows, phase.assignment.groups):
                params[int(r)] = g
            taken = phase.steps if k < self.phase_idx else max(self.step - done, 0) if k == self.phase_idx else 0
            steps[rows] += taken
            done += phase.steps
        groups = []
        for r, (v, n) in enumerate(zip(self.group_values, self.group_counts)):
            g = params.get(r)
            groups.append({"budget": float(v), "count": int(n), "trained": g is not None,
                           "sample_rate": g.sample_rate if g else 0.0, "clip_norm": g.clip_norm if g else None,
                           "noise_multiplier": g.noise_multiplier if g else None, "steps": int(steps[r]),
                           "epsilon_spent": float(spent[r]), "epsilon_rdp": float(rdp_spent[r])})
        sigmas = [p.assignment.noise_multiplier for p in plan.phases]
        extra = {}
        if self.tracker is not None:
            from .individual import individual_report
            extra["individual_privacy"] = individual_report(self, ev["per_class_accuracy"])
        return {
            "method": plan.method, "dataset": ds.name, "model": self.model_name,
            "accountant": self.config.accountant, "guarantee": GUARANTEE, "delta": self.budgets.delta,
            "test_accuracy": ev["accuracy"], "per_class_accuracy": ev["per_class_accuracy"],
            "noise_multiplier": sigmas[0] if len(sigmas) == 1 else sigmas,
            "steps": self.step, "planned_steps": plan.steps, "stopped_early": self.stopped_early,
            "epochs": self.config.epochs, "batch_size": self.config.batch_size, "lr": self.config.lr,
            "clip_norm": self.config.clip_norm, "seed": self.seed, "secure_mode": self.config.secure_mode,
            "device": str(self.device), "grad_sample_mode": self.config.grad_sample_mode,
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
        save_torch(self.out_dir / "model.pt", self._module().state_dict())
        write_json(self.out_dir / "report.json", report)


def signature_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """What differs between two run signatures, as 'key: saved -> current' (the budgets only by hash)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += signature_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}" if "sha256" not in key else f"{prefix}{key} differs")
    return out


def train(dataset: Dataset, budgets: Budgets, config: TrainConfig, out_dir=None, resume: bool = False, *,
          model: torch.nn.Module | None = None, criterion=None, optimizer_factory=None,
          individual: IndividualAccountingOptions | None = None) -> dict:
    """Train with individualized budgets; returns the report (also written to ``out_dir``).

    Args:
        dataset: the data (:func:`idpsgd.data.load_dataset`).
        budgets: one budget per training example and δ.
        config: method and hyperparameters.
        out_dir: run folder for report.json, ledger.csv, model.pt and checkpoint.pt.
        resume: continue from ``out_dir/checkpoint.pt`` if it exists.
        model, criterion, optimizer_factory: see :class:`Trainer`.
        individual: individual accounting options (Yu et al. 2023), or None.
    """
    check_delta(budgets.delta)
    from .pdp import PDP_METHODS, train_pdp
    if config.method in PDP_METHODS:  # (Φ, Δ)-PDP methods: their own round structure, no checkpoints
        config.validate()
        if resume:
            raise InvalidParameterError("resume", True, f"{config.method} runs have no checkpoints to resume")
        if individual is not None:
            raise InvalidParameterError("method", config.method, "individual accounting supports the IDP-SGD "
                                        "methods (uniform, sample, scale, exclude)")
        return train_pdp(dataset, budgets, config, out_dir)
    ckpt = Path(out_dir) / CHECKPOINT if out_dir is not None else None
    if resume and ckpt is not None and ckpt.is_file() and config.seed is None and not config.secure_mode:
        state = load_torch(ckpt)     # a run without --seed continues with the seed it recorded
        saved = state.get("signature", {}).get("config", {}).get("seed") if isinstance(state, dict) else None
        config = dataclasses.replace(config, seed=saved)
    trainer = Trainer(dataset, budgets, config, out_dir, model=model, criterion=criterion,
                      optimizer_factory=optimizer_factory, individual=individual)
    if resume and ckpt is not None and ckpt.is_file():
        trainer.load_checkpoint(ckpt)
        log.info("resumed from %s at step %d", ckpt, trainer.step)
    report = trainer.run()
    trainer.write_outputs(report)
    return report
