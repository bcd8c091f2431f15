"""The ``train`` harness: a training recipe on :class:`~idpsgd.engine.IndividualizedPrivacyEngine`.

:func:`train` runs a :class:`~idpsgd.training.plans.TrainingPlan` (one phase for uniform, Sample
and Scale; one per group for the sequential baseline) on one engine.  Each phase is one
``make_private_with_parameters`` call with the phase's per-example rates and clip norms (0 rate
outside the phase); each step asks the engine's privacy filter whether every group stays within its
budget (and stops the run otherwise), draws a Poisson batch with the examples' own rates (Boenisch
et al. 2023, Alg. 1/3), takes the DP-SGD step, and is charged to every example of the phase,
sampled or not.  The guarantee reported is data-independent individual (ε_p, δ)-DP for every
example of group p (Boenisch et al. eq. 3).  Checkpoints are written atomically every epoch and
``resume=True`` continues exactly.  Model, loss and optimizer may be the user's own
(:class:`TrainConfig`, :class:`Trainer`); user guide: ``docs/quickstart.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from ..accounting.neighbouring import neighbouring
from ..analysis.metrics import accuracies as accuracies  # re-exported
from ..analysis.metrics import evaluate
from ..assignment import Budgets
from ..data import Dataset
from ..engine import GUARANTEE, IndividualizedPrivacyEngine, distributed
from ..engine.budget.individual import IndividualAccountingOptions
from ..engine.budget.journal import JOURNAL, register_journal, step_counts
from ..engine.noise.randomness import randomness_note, resolve_seed
from ..engine.per_example.unwrap import raw_module
from ..io import fault_point, load_torch, signature_differences
from ..models import DEFAULT_MODEL, create_model
from ..names import ACCOUNTANTS, IDP_METHODS, PDP_METHODS, one_of
from ..runfolder import PRIVATE, SEED_FILE, RunFolder
from ..validation import InvalidParameterError, check_delta, check_positive
from .device import DEVICES as DEVICES  # re-exported
from .device import resolve_device
from .map_data import MapStyleData, as_training_data, num_train
from .plans import Phase, TrainingPlan, build_plan

log = logging.getLogger("idpsgd")

CHECKPOINT = "checkpoint.pt"


#: Largest learning rate accepted (larger ones overflow float32 updates or diverge at once).
MAX_LR = 1e4


@dataclass
class TrainConfig:
    """Hyperparameters of a run shared by every method (method-specific options live with the
    method: :class:`~idpsgd.engine.budget.individual.IndividualAccountingOptions`, PDP options, ...)."""

    method: str = "sample"
    epochs: int = 20  # uniform DP-SGD's best on digits (bench/bench_comparison.py)
    batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    clip_norm: float = 1.0
    accountant: str = "rdp"
    model: str | None = None
    seed: int | None = None  # None: a fresh seed, recorded privately (private/seed.json)
    secure_mode: bool = False
    device: str = "cpu"
    grad_sample_mode: str = "bk"  # book-keeping: near non-private cost (engine/bookkeeping.py)
    exclude_below: float | None = None
    progress: bool = True
    init_seed: int | None = None  # model initialisation seed (default: seed); runs can share it

    def validate(self) -> TrainConfig:
        check_positive(self.lr, "lr")
        if not self.lr <= MAX_LR:
            raise InvalidParameterError(
                "lr", self.lr, f"must be at most {MAX_LR:g} (a larger step overflows the parameters' float type)"
            )
        if not 0 <= self.momentum < 1:
            raise InvalidParameterError("momentum", self.momentum, "must be in [0, 1)")
        if self.accountant not in ACCOUNTANTS:
            raise InvalidParameterError("accountant", self.accountant, f"must be {one_of(ACCOUNTANTS)}")
        from ..engine.modes import GRAD_SAMPLE_MODES

        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise InvalidParameterError(
                "grad_sample_mode", self.grad_sample_mode, f"must be one of {', '.join(GRAD_SAMPLE_MODES)}"
            )
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
        plan: a :class:`~idpsgd.training.plans.TrainingPlan` for this run's method and training
            budgets, made by the caller (e.g. the audit's one plan for every model); default: the
            plan calibrated for this data (:func:`~idpsgd.training.plans.build_plan`).  Either
            way the engine checks the planned steps against the budgets before the first step.
    """

    def __init__(
        self,
        dataset: Dataset,
        budgets: Budgets,
        config: TrainConfig,
        out_dir=None,
        *,
        model: torch.nn.Module | None = None,
        criterion=None,
        optimizer_factory=None,
        individual: IndividualAccountingOptions | None = None,
        release_epsilon: float = 0.5,
        expected_batch_size: float | None = None,
        plan: TrainingPlan | None = None,
        users=None,
    ):
        self.config = config.validate()
        self.expected_batch_size = expected_batch_size  # the noisy sum's public normaliser (default Σ q_i)
        self.release_epsilon = check_positive(release_epsilon, "release_epsilon")
        dataset = as_training_data(dataset)  # an idpsgd Dataset, or a MapStyleData over torch Datasets
        n_train = num_train(dataset)
        self.users = check_users(users, n_train, budgets, config)
        if users is not None:
            n_train = users.num_users  # user level: one budget, rate and clip norm per user
        if len(budgets) != n_train:
            hint = (
                f"; for one budget per privacy group use Budgets.from_groups(budgets, fractions, {n_train}, delta)"
                if len(budgets) < n_train and budgets.values.size == len(budgets)
                else ""
            )
            raise InvalidParameterError(
                "budgets", f"{len(budgets)} values", f"need one per training example ({n_train}){hint}"
            )
        if individual is not None and config.method == "sequential":
            raise InvalidParameterError(
                "method",
                config.method,
                "individual accounting supports one-phase methods (uniform, sample, scale, exclude)",
            )
        self.dataset, self.budgets = dataset, budgets
        self.run_folder = out_dir if isinstance(out_dir, RunFolder) or out_dir is None else RunFolder(out_dir)
        self.out_dir = self.run_folder.path if self.run_folder is not None else None
        pre = getattr(dataset, "preprocessing", None) or {}
        self.preprocessing_cost = (float(pre.get("epsilon", 0.0)), float(pre.get("delta", 0.0)))
        self.train_budgets = training_budgets(budgets, *self.preprocessing_cost)
        self.seed = resolve_seed(config.seed, config.secure_mode)
        self.device = resolve_device(config.device)
        if plan is not None and (
            plan.method != config.method
            or len(plan.budgets) != len(self.train_budgets)
            or not np.array_equal(plan.budgets.epsilons, self.train_budgets.epsilons)
        ):
            raise InvalidParameterError(
                "plan",
                plan.method,
                f"must be a {config.method} plan for this run's {len(self.train_budgets)} training budgets",
            )
        self.plan: TrainingPlan = (
            plan
            if plan is not None
            else build_plan(
                self.train_budgets,
                config.method,
                config.batch_size,
                config.epochs,
                config.clip_norm,
                config.accountant,
                config.exclude_below,
            )
        )
        if individual is not None and individual.rounding != "exact" and individual.rounding_step is not None:
            from ..accounting.output_specific import check_rounding_step  # refused before any work

            check_rounding_step(
                individual.rounding_step, max(float(np.max(ph.assignment.clip_norms)) for ph in self.plan.phases)
            )
        init = config.init_seed if config.init_seed is not None else self.seed
        torch.manual_seed(init if init is not None else torch.seed())
        if model is None:
            self.model_name = config.model or DEFAULT_MODEL.get(dataset.name, "mlp")
            model = create_model(self.model_name, dataset.input_shape, dataset.num_classes)
        else:
            if not isinstance(model, torch.nn.Module):
                raise InvalidParameterError("model", type(model).__name__, "must be a torch.nn.Module")
            self.model_name = type(model).__name__
        self.model: torch.nn.Module = distributed.wrap_model(model.to(self.device))  # DPDDP under torch.distributed
        self.criterion = criterion if criterion is not None else torch.nn.CrossEntropyLoss()
        if not hasattr(self.criterion, "reduction"):
            raise InvalidParameterError(
                "criterion",
                type(self.criterion).__name__,
                "must be a loss module with a reduction attribute (e.g. nn.CrossEntropyLoss())",
            )
        make_opt = optimizer_factory or (lambda params: torch.optim.SGD(params, lr=config.lr, momentum=config.momentum))
        self.optimizer = make_opt(self.model.parameters())
        self.engine = IndividualizedPrivacyEngine(
            accountant=config.accountant, secure_mode=config.secure_mode, seed=self.seed
        )
        if self.run_folder is not None:  # every noise draw under the run folder is recorded, and charged on resume
            self.engine.attach_journal(self.run_folder.path / PRIVATE / JOURNAL)
        if individual is not None:
            self.engine.enable_individual_accounting(individual, per_sample_loss=self._per_sample_loss)
        self.loader = (
            dataset.train_loader(config.batch_size)
            if isinstance(dataset, MapStyleData)
            else DataLoader(TensorDataset(dataset.x_train, dataset.y_train), batch_size=config.batch_size)
        )
        self.group_values, self.group_counts, self.group_of = self.train_budgets.groups()
        self.budget_values = budgets.values
        self.phase_idx, self.phase_epoch, self.step = 0, 0, 0
        self.stopped_early = False
        self.history: list[dict] = []
        self.ledger_rows: list[list] = []
        self.step_hooks: list = []  # fn(trainer, model, phase_step) before every step (θ_t)
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

    def _phase_kwargs(self) -> dict:
        """Extra arguments of ``make_private_with_parameters`` for every phase (a subclass's hook,
        e.g. the individual filter)."""
        return {}

    def _start_phase(self, phase: Phase):
        q, c = self._phase_arrays(phase)
        a = phase.assignment
        kwargs = self._phase_kwargs()
        # the engine refuses a plan beyond the budgets at set-up: a run extended on resume plans its
        # calibrated steps, and the group filter admits the extra ones only while every budget holds
        planned = phase.steps if kwargs.get("privacy_filter", "group") != "group" else min(phase.steps, a.steps)
        out = self.engine.make_private_with_parameters(
            module=self.model,
            optimizer=self.optimizer,
            data_loader=self.loader,
            budgets=self.train_budgets,
            sample_rates=q,
            clip_norms=c,
            noise_multiplier=a.noise_multiplier,
            max_grad_norm=a.clip_norm,
            steps=planned,
            steps_per_epoch=phase.steps_per_epoch,
            expected_batch_size=self.expected_batch_size,
            grad_sample_mode=self.config.grad_sample_mode,
            criterion=self.criterion,
            **({"users": self.users} if self.users is not None else {}),
            **kwargs,
        )
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
        return self.engine.get_epsilon().per_group

    # --- checkpoints ---------------------------------------------------------------------
    def _signature(self) -> dict:
        digest = hashlib.sha256(np.ascontiguousarray(self.budgets.epsilons).tobytes()).hexdigest()
        cfg = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in ("progress", "device", "epochs")}
        cfg["seed"] = self.seed
        fingerprint = self.dataset.fingerprint() if hasattr(self.dataset, "fingerprint") else None
        return {
            "config": cfg,
            "dataset": self.dataset.name,
            "n": len(self.budgets),
            "delta": self.budgets.delta,
            "budgets_sha256": digest,
            "data_sha256": fingerprint,
            "model": self.model_name,
            "planned_epochs": int(self.config.epochs),
            "preprocessing": getattr(self.dataset, "preprocessing", None),
            "individual": dataclasses.asdict(self.tracker.options) if self.tracker is not None else None,
            **({"users_k": self.users.k, "users_sha256": self.users.digest()} if self.users is not None else {}),
        }

    def _module(self) -> torch.nn.Module:
        return raw_module(self.model)

    def save_checkpoint(self) -> None:
        if distributed.is_distributed() and self.engine.accountant is not None:  # every rank: the same ledger
            distributed.check_replicated(
                "privacy ledger", [self.step, self.engine.steps, *self.engine.accountant.grid_epsilon()]
            )
        if self.out_dir is None or not distributed.is_main_process():
            return
        state = {
            "signature": self._signature(),
            "phase_idx": self.phase_idx,
            "phase_epoch": self.phase_epoch,
            "step": self.step,
            "stopped_early": self.stopped_early,
            "model": self._module().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "engine": self.engine.state_dict() if self.engine.accountant is not None else None,
            "history": self.history,
            "ledger_rows": self.ledger_rows,
        }
        self.run_folder.save_torch(
            CHECKPOINT,
            state,
            "private",
            "checkpoint: model, optimizer, engine (accountant, "
            "sampler and noise states), history; resumable with --resume",
        )

    def load_checkpoint(self, state, path="checkpoint") -> None:
        """Continue from a checkpoint's state (or a path to one)."""
        if not isinstance(state, dict):
            state = load_torch(state)
        if not isinstance(state, dict) or "signature" not in state:
            raise InvalidParameterError("resume", str(path), "is not an idpsgd training checkpoint")
        differences = signature_differences(state["signature"], self._signature())
        if differences:
            raise InvalidParameterError(
                "resume",
                str(path),
                "the checkpoint was written by a run with other settings ("
                + "; ".join(differences[:4])
                + "); use a new --out folder or the same settings",
            )
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
            show = self.config.progress and distributed.is_main_process()
            bar = tqdm(
                total=total,
                initial=min(self.step, total),
                disable=None if show else True,
                desc=f"{self.plan.method}",
                unit="step",
                leave=False,
            )
            while self.phase_idx < len(self.plan.phases) and not self.stopped_early:
                self._run_phase(self.plan.phases[self.phase_idx], bar)
            bar.close()
            if self._phase_ready < 0 and self._engine_state is not None:  # resumed after the last phase
                self._start_phase(self.plan.phases[-1])
        return self.report()

    def _epsilon_text(self) -> str:
        """``ε 0.41/1, 1.2/3``: each group's ε after the last step (the ledger's RDP bound) / its budget."""
        spent = self.ledger_rows[-1][4:] if self.ledger_rows else [0.0] * len(self.group_values)
        return "ε " + ", ".join(f"{e:.3g}/{b:g}" for e, b in zip(spent, self.group_values, strict=True))

    def _run_phase(self, phase: Phase, bar) -> None:
        dev = self.device
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
                fault_point("step")
                self.step += 1
                phase_steps += 1
                if len(y):
                    losses.append(float(loss.detach()))
                real = (  # the real batch in rows (the optimizer counts the users at user level)
                    distributed.sum_over_ranks(len(y))
                    if self.users is not None
                    else self.dp_optimizer.last_global_batch_size
                    if distributed.is_distributed()
                    else len(y)
                )
                self.ledger_rows.append(
                    [self.step, self.phase_idx, len(self.history) + 1, real, *self.engine.accountant.grid_epsilon()]
                )
                bar.update(1)
                if not bar.disable:  # each group's ε spent so far (public, per group) against its budget
                    bar.set_postfix_str(self._epsilon_text(), refresh=False)
            if self.stopped_early:
                break
            self.phase_epoch += 1
            ev = self.evaluate()
            self.history.append(
                {
                    "epoch": len(self.history) + 1,
                    "phase": self.phase_idx,
                    "step": self.step,
                    "train_loss": float(np.mean(losses)) if losses else None,
                    "test_accuracy": ev["accuracy"],
                }
            )
            bar.set_postfix(epoch=len(self.history), test_acc=f"{ev['accuracy']:.3f}")
            if self.config.progress and not sys.stderr.isatty() and distributed.is_main_process():  # one line per epoch
                print(
                    f"idpsgd {self.plan.method}: epoch {len(self.history)}/{self.plan.epochs} (step {self.step}/"
                    f"{self.plan.steps}): test accuracy {ev['accuracy']:.4f}; {self._epsilon_text()}",
                    file=sys.stderr,
                    flush=True,
                )
            log.info("epoch %d (phase %d): test accuracy %.4f", len(self.history), self.phase_idx, ev["accuracy"])
            if self.phase_epoch < phase.epochs:
                self.save_checkpoint()
        if not self.stopped_early:
            self.phase_idx, self.phase_epoch = self.phase_idx + 1, 0
        self.save_checkpoint()

    # --- the report ----------------------------------------------------------------------
    def report(self) -> dict:
        ds, plan = self.dataset, self.plan
        if self.engine.accountant is not None:  # draws of earlier attempts it did not reach: charged now
            self.engine.finish_journal()
        ev = self.evaluate()
        spent = self.epsilon_spent()
        rdp_spent = self.engine.accountant.grid_epsilon() if self.engine.accountant is not None else spent
        params, steps = {}, np.zeros(self.group_values.size, dtype=np.int64)
        done = 0
        for k, phase in enumerate(plan.phases):
            rows = np.searchsorted(self.group_values, [g.budget for g in phase.assignment.groups])
            for r, g in zip(rows, phase.assignment.groups, strict=True):
                params[int(r)] = g
            taken = phase.steps if k < self.phase_idx else max(self.step - done, 0) if k == self.phase_idx else 0
            steps[rows] += taken
            done += phase.steps
        groups = []
        eps_pre, delta_pre = self.preprocessing_cost
        for r, (v, n) in enumerate(zip(self.budget_values, self.group_counts, strict=True)):
            g = params.get(r)
            groups.append(
                {
                    "budget": float(v),
                    "count": int(n),
                    "trained": g is not None,
                    "sample_rate": g.sample_rate if g else 0.0,
                    "clip_norm": g.clip_norm if g else None,
                    "noise_multiplier": g.noise_multiplier if g else None,
                    "steps": int(steps[r]),
                    "epsilon_spent": float(spent[r]) + eps_pre,
                    "epsilon_training": float(spent[r]),
                    "epsilon_rdp": float(rdp_spent[r]) + eps_pre,
                    "delta": self.train_budgets.delta + delta_pre,
                }
            )
        sigmas = [p.assignment.noise_multiplier for p in plan.phases]
        extra, private = {}, {}
        if self.tracker is not None:
            from .individual_outputs import individual_report

            released, exact = individual_report(self, ev["per_class_accuracy"], self.release_epsilon)
            extra["individual_privacy"], private["individual_privacy"] = released, exact
        return {
            "method": plan.method,
            "dataset": ds.name,
            "model": self.model_name,
            "accountant": self.config.accountant,
            "guarantee": self.guarantee_text(extra),
            **neighbouring("example" if self.users is None else "user"),
            **({"max_rows_per_user": self.users.k} if self.users is not None else {}),
            "delta": self.budgets.delta,
            "test_accuracy": ev["accuracy"],
            "per_class_accuracy": ev["per_class_accuracy"],
            "noise_multiplier": sigmas[0] if len(sigmas) == 1 else sigmas,
            "steps": self.step,
            **step_counts(self.engine),
            "planned_steps": plan.steps,
            "stopped_early": self.stopped_early,
            "epochs": self.config.epochs,
            "batch_size": self.config.batch_size,
            "lr": self.config.lr,
            "clip_norm": self.config.clip_norm,
            "secure_mode": self.config.secure_mode,
            "randomness": randomness_note(
                self.config.secure_mode, f"{PRIVATE}/{SEED_FILE}" if self.run_folder else None
            ),
            "device": str(self.device),
            "nproc": distributed.rank_and_world()[1],  # data-parallel processes (--nproc); 1 without
            "grad_sample_mode": self.config.grad_sample_mode,
            "layer_paths": self.engine.layer_paths if self.engine.accountant is not None else {},  # the rule
            "phases": [
                {
                    "name": p.name,
                    "examples": int(p.indices.size),  # the key is stable; "unit" says what it counts
                    "unit": "example" if self.users is None else "user",
                    "steps": p.steps,
                    "sample_rate": p.assignment.sample_rate,
                    "noise_multiplier": p.assignment.noise_multiplier,
                }
                for p in plan.phases
            ],
            "groups": groups,
            "history": [{k: v for k, v in h.items() if k != "train_loss"} for h in self.history],
            "preprocessing": getattr(self.dataset, "preprocessing", None),
            **({"data": ds.source} if getattr(ds, "source", None) else {}),
            **({"warnings": notes} if (notes := self.notes()) else {}),
            "files": None,
            **extra,
            "private": {
                "history": self.history,
                **self.seeds(),
                **private,  # paths taken: batch shapes
                "layer_paths_taken": (self.engine.layer_paths_taken if self.engine.accountant is not None else {}),
            },
        }

    def seeds(self) -> dict:
        """The run's seed (and the initialisation's when it differs): private, never in a public file
        (with it anyone who knows every record but one can replay the run); {} in secure mode."""
        if self.seed is None:
            return {}
        init = self.config.init_seed
        return {"seed": self.seed, **({"init_seed": init} if init is not None and init != self.seed else {})}

    def evaluate(self) -> dict:
        """Test metrics of the current model (accuracy, per-class accuracy, loss)."""
        ds = self.dataset
        if isinstance(ds, MapStyleData):
            return ds.evaluate(self.model)
        return evaluate(self.model, ds.x_test, ds.y_test, ds.num_classes)

    def notes(self) -> list[str]:
        """Public warnings about the plan (also on stderr when the plan was made): groups whose
        examples are expected to be sampled less than once (Sample with a wide spread of budgets)."""
        from ..assignment import sparse_sampling

        return [
            f"phase {p.name}: {n}" if len(self.plan.phases) > 1 else n
            for p in self.plan.phases
            if (n := sparse_sampling(p.assignment))
        ]

    def set_epochs(self, epochs: int) -> None:
        """Run a one-phase plan for ``epochs`` passes while keeping its calibration (σ, rates for the
        planned epochs): extra steps happen only while the filter admits them."""
        epochs = int(epochs)
        if all(p.epochs == epochs for p in self.plan.phases):
            return
        if len(self.plan.phases) != 1:
            raise InvalidParameterError(
                "epochs", epochs, f"can change on resume for one-phase methods only, not {self.plan.method}"
            )
        if epochs < 1:
            raise InvalidParameterError("epochs", epochs, "must be an integer >= 1")
        done = self.plan.phases[0].epochs if self.phase_idx >= 1 else self.phase_epoch
        self.plan = dataclasses.replace(self.plan, phases=(dataclasses.replace(self.plan.phases[0], epochs=epochs),))
        if self.phase_idx >= 1 and epochs > done:  # a finished plan continues
            self.phase_idx, self.phase_epoch = 0, done

    def guarantee_text(self, extra: dict) -> str:
        """The run's guarantee in words: the model's per group, plus what the preprocessing and the
        released statistics add for every example."""
        eps_pre, delta_pre = self.preprocessing_cost
        from ..engine.clipping.users import USER_GUARANTEE

        what = GUARANTEE if self.users is None else USER_GUARANTEE
        text = (
            f"model: {what}, with epsilon_p = the group's epsilon_spent and delta = "
            f"{self.train_budgets.delta + delta_pre:g}"
        )
        if eps_pre:
            text += (
                f" (including ({eps_pre:g}, {delta_pre:g}) spent by the private estimate of the "
                "normalization constants)"
            )
        rel = (extra.get("individual_privacy") or {}).get("released")
        if rel:
            text += (
                f"; released statistics: an additional ({rel['total']['epsilon']:g}, "
                f"{rel['total']['delta']:g})-DP for every example"
            )
        return text

    def write_outputs(self, report: dict) -> None:
        """Public: report.json, model.pt; private: ledger.csv (batch sizes, ε per group after every step)
        and history.json (training losses)."""
        if self.run_folder is None or not distributed.is_main_process():
            return
        rf = self.run_folder
        header = ["step", "phase", "epoch", "batch_size"] + [f"epsilon_rdp_budget_{v:g}" for v in self.group_values]
        cols = list(zip(*self.ledger_rows, strict=True)) if self.ledger_rows else [[] for _ in header]
        rf.write_csv(
            "ledger.csv",
            header,
            cols,
            "private",
            "every step's real Poisson batch size and each group's epsilon (RDP bound at the order grid) after it",
        )
        self.write_model_and_report(report, "test metrics, hyper-parameters, privately released statistics")

    def write_model_and_report(self, report: dict, contents: str) -> None:
        """Every run's last outputs: private history.json; public model.pt, report.json (``contents``
        says what it holds beside the guarantee per group) and report.html."""
        from ..analysis.report import write_report

        rf = self.run_folder
        register_journal(rf)
        rf.write_json(
            "history.json",
            self.history,
            "private",
            "per epoch: training loss (on private batches, without noise) and test accuracy",
        )
        if self.seeds():
            rf.record_seed(
                about="the run's seed: the Poisson sampling, the noise and (unless init_seed is given) the "
                "initialisation; --seed with it replays the run",
                **self.seeds(),
            )
        split = getattr(self.dataset, "split", None)
        if split:  # csv without test.csv: which rows of train.csv train (a function of the labels: private)
            rows = np.concatenate([split["train_rows"], split["test_rows"]])
            kind = ["train"] * len(split["train_rows"]) + ["test"] * len(split["test_rows"])
            index = np.concatenate([np.arange(len(split["train_rows"])), np.arange(len(split["test_rows"]))])
            order = np.argsort(rows, kind="stable")
            rf.write_csv(
                "data_split.csv",
                ["row", "split", "index"],
                [rows[order], [kind[i] for i in order], index[order]],
                "private",
                "the hidden split of train.csv (80/20 by row position; by user at user level): for each data row "
                "(0-based, header excluded) whether it trains or tests and its index there (training index = "
                "budget order)",
            )
        if self.users is not None:
            write_users_summary(rf, self.users)
        rf.save_torch(
            "model.pt",
            self._module().state_dict(),
            "public",
            "the trained model's state_dict (load with torch.load(..., weights_only=True))",
        )
        about = f"the run's report: guarantee per group, {contents}"
        rf.file("report.json", "public", about)
        rf.file("report.html", "public", "the run's readable report")
        report["files"] = {k: v["kind"] for k, v in rf.files().items()}
        rf.write_json("report.json", public_report(report), "public", about)
        write_report(rf)


def write_users_summary(rf, users) -> None:
    """User level: ``private/users.json`` — the numbers of users and rows and how many rows lay beyond k
    (statistics of the private row counts: for the operator choosing k, never public)."""
    rf.write_json(
        "users.json",
        users.rows_beyond_k(),
        "private",
        "user level: the users, their rows, and how many rows lay beyond max_rows_per_user (k): the users with "
        "more than k rows and their rows beyond the first k (a step takes k of a user's rows at random)",
    )


def check_users(users, n_rows: int, budgets: Budgets, config):
    """User level: ``users`` must cover the training rows; the methods that support it."""
    if users is None:
        return None
    from ..users import Users

    if not isinstance(users, Users):
        raise InvalidParameterError("users", type(users).__name__, "must be an idpsgd.Users")
    if users.num_rows != n_rows:
        raise InvalidParameterError("users", repr(users), f"must give a user for each of the {n_rows} training rows")
    if config.method not in IDP_METHODS:
        raise InvalidParameterError("method", config.method, f"at user level must be {one_of(IDP_METHODS)} (ULS)")
    return users


def training_budgets(budgets: Budgets, epsilon_pre: float, delta_pre: float) -> Budgets:
    """The budgets left for training after a private preprocessing step spent (ε_pre, δ_pre) of every
    example (basic composition)."""
    if not epsilon_pre and not delta_pre:
        return budgets
    left = budgets.epsilons - epsilon_pre
    if np.any(left <= 0):
        raise InvalidParameterError(
            "normalization_epsilon",
            epsilon_pre,
            f"must be below the smallest budget {budgets.epsilons.min():g} (the private "
            "normalization is charged to every example)",
        )
    if not budgets.delta - delta_pre > 0:
        raise InvalidParameterError("normalization_delta", delta_pre, f"must be below --delta={budgets.delta:g}")
    return Budgets(left, budgets.delta - delta_pre)


def public_report(report: dict) -> dict:
    """The report without its private section (what report.json and stdout show by default)."""
    return {k: v for k, v in report.items() if k != "private"}


def train(
    dataset,
    budgets: Budgets,
    config: TrainConfig,
    out_dir=None,
    resume: bool = False,
    *,
    model: torch.nn.Module | None = None,
    criterion=None,
    optimizer_factory=None,
    individual: IndividualAccountingOptions | None = None,
    overwrite: bool = False,
    release_epsilon: float = 0.5,
    pdp=None,
    test_dataset=None,
    num_classes: int | None = None,
    fingerprint: str | None = None,
    users=None,
) -> dict:
    """Train with individualized budgets; returns the report (also written to ``out_dir``).

    Args:
        dataset: the data: an :class:`idpsgd.data.Dataset` (:func:`idpsgd.data.load_dataset`), or
            any map-style torch ``Dataset`` of ``(input, label)`` items (the training set; then
            ``test_dataset`` and ``num_classes`` are required, see :mod:`.map_data`).
        test_dataset, num_classes, fingerprint: with a torch ``Dataset`` only: the test set, the
            number of classes, and optionally the data's identity for ``resume`` (default: a hash
            of every item).
        budgets: one budget per training example and δ.
        config: method and hyperparameters.
        out_dir: run folder (a path or :class:`~idpsgd.runfolder.RunFolder`): public report.json and
            model.pt, private/ checkpoint.pt, ledger.csv, history.json, seed.json, per-example files.
        resume: continue from the folder's checkpoint if it exists (with the seed the private
            checkpoint recorded when ``config.seed`` is None; ``config.epochs`` may differ: the
            plan's calibration stays, the filter guards every extra step).
        model, criterion, optimizer_factory: see :class:`Trainer`.
        individual: individual accounting options (Yu et al. 2023), or None.
        overwrite: replace another run already in ``out_dir``.
        release_epsilon: ε of the private release of individual-ε statistics.
        pdp: :class:`~idpsgd.training.pdp.PdpOptions` of the PDP methods (default options).
        users: a :class:`~idpsgd.users.Users` (the user of every training row, and k): user-level
            individualized DP (ULS, :mod:`idpsgd.engine.clipping.users`); ``budgets`` are then one per user
            (``users.ids`` order) and ``config.batch_size`` is the expected number of users per step.
    """
    check_delta(budgets.delta)
    from .pdp import train_pdp

    dataset = as_training_data(dataset, test_dataset, num_classes, fingerprint=fingerprint)
    if isinstance(dataset, MapStyleData):
        if config.method in PDP_METHODS:
            raise InvalidParameterError(
                "method",
                config.method,
                "needs an idpsgd.data.Dataset (in-memory tensors); "
                "with a torch Dataset use uniform, sample, scale, exclude or sequential",
            )
        if individual is not None:
            raise InvalidParameterError(
                "individual",
                "IndividualAccountingOptions",
                "in idpsgd.train needs an "
                "idpsgd.data.Dataset (its report evaluates every training example in "
                "memory); with a torch Dataset call engine.enable_individual_accounting "
                "on your own loop",
            )
    if config.method in PDP_METHODS:  # (Φ, Δ)-PDP methods: their own round structure, no checkpoints
        config.validate()
        if users is not None:
            raise InvalidParameterError("method", config.method, "at user level must be uniform, sample or scale")
        if resume:
            raise InvalidParameterError("resume", True, f"{config.method} runs have no checkpoints to resume")
        if individual is not None:
            raise InvalidParameterError(
                "method",
                config.method,
                "individual accounting supports the IDP-SGD methods (uniform, sample, scale, exclude)",
            )
        folder = (
            RunFolder(out_dir, overwrite=overwrite)
            if out_dir is not None and not isinstance(out_dir, RunFolder)
            else out_dir
        )
        return train_pdp(dataset, budgets, config, folder, options=pdp)
    return run_in_folder(
        lambda cfg, folder: Trainer(
            dataset,
            budgets,
            cfg,
            folder,
            model=model,
            criterion=criterion,
            optimizer_factory=optimizer_factory,
            individual=individual,
            release_epsilon=release_epsilon,
            users=users,
        ),
        config,
        out_dir,
        resume=resume,
        overwrite=overwrite,
    )


def run_in_folder(
    build, config: TrainConfig, out_dir, *, resume: bool, overwrite: bool, keep_plan: bool = True
) -> dict:
    """Open the run folder, restore its checkpoint when resuming, run the trainer ``build(config,
    folder)`` makes and write its outputs; returns the report.

    On resume, a run without a seed continues with its recorded one; with ``keep_plan`` the
    calibration stays that of the original plan (its ``planned_epochs``) and the run is then
    extended to ``config.epochs`` (the filter guards every extra step).
    """
    folder = (
        out_dir
        if isinstance(out_dir, RunFolder) or out_dir is None
        else distributed.main_first(
            lambda: RunFolder(out_dir, resume=resume, overwrite=overwrite), lambda: RunFolder(out_dir, resume=True)
        )
    )
    ckpt = folder.path / PRIVATE / CHECKPOINT if folder is not None else None
    state = load_torch(ckpt) if resume and ckpt is not None and ckpt.is_file() else None
    epochs = config.epochs
    if state is not None:
        saved = state.get("signature", {}) if isinstance(state, dict) else {}
        if config.seed is None and not config.secure_mode:  # a run without a seed continues with its recorded one
            config = dataclasses.replace(config, seed=saved.get("config", {}).get("seed"))
        if keep_plan and isinstance(saved.get("planned_epochs"), int):  # the original plan's calibration stays
            config = dataclasses.replace(config, epochs=saved["planned_epochs"])
    trainer = build(config, folder)
    if state is not None:
        trainer.load_checkpoint(state, ckpt)
        if keep_plan:
            trainer.set_epochs(epochs)
        log.info("resumed from %s at step %d", ckpt, trainer.step)
    report = trainer.run()
    trainer.write_outputs(report)
    return report
