"""The audit's models: trained through the project's harness, scored, and checkpointed one by one.

Every model of an audit — the shadows and the target — is trained exactly as ``idpsgd train``
trains (same method, budgets, hyper-parameters), on a subset of the training examples:
:class:`~idpsgd.training.Trainer` for uniform, Sample and Scale; :func:`~idpsgd.training.pdp.train_pdp`
for PDP-SGD.  A finished model is saved atomically (membership mask, per-example φ and loss, weights
and reported guarantees), so an interrupted audit resumes without retraining it.  **One plan for
every model** (:class:`SharedPlan`): calibrated once for the expected subset (half of every privacy
group), so a model's public parameters (σ, q_p, c_p, steps, normaliser; PDP-SGD's rounds,
:func:`~idpsgd.training.pdp.plan_rounds`) never depend on the membership the attack guesses; each
example's guarantee depends only on its own (q_p, c_p/c, σ, T), so every group still spends at most
its budget in every model (:func:`check_model_report` checks the reports).  Why, and what was
measured: ``docs/audit.md`` (One plan for every model).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..assignment import Budgets
from ..data import Dataset
from ..io import CheckpointError, load_torch
from ..names import AUDIT_METHODS, IDP_METHODS, PDP_AUDIT_METHODS
from ..validation import InvalidParameterError
from .lira import logit_confidence


def check_method(method: str) -> str:
    if method == "adapdp":
        raise InvalidParameterError(
            "method",
            method,
            "is not supported by the audit: AdaPDP predicts with a weighted "
            "ensemble of models, not one model to score; audit one of "
            f"{', '.join(AUDIT_METHODS)}",
        )
    if method not in AUDIT_METHODS:
        raise InvalidParameterError("method", method, f"the audit supports {', '.join(AUDIT_METHODS)}")
    return method


def subset(dataset: Dataset, indices: np.ndarray, labels: np.ndarray | None = None) -> Dataset:
    """The training examples ``indices`` (with ``labels`` instead of the true ones, if given)."""
    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    y = dataset.y_train if labels is None else torch.as_tensor(np.asarray(labels, dtype=np.int64))
    return Dataset(
        dataset.name,
        dataset.x_train[idx],
        y[idx],
        dataset.x_test,
        dataset.y_test,
        dataset.num_classes,
        dataset.preprocessing,
    )


@dataclass(frozen=True)
class SharedPlan:
    """The one plan every model of an audit runs (see the module docstring).

    ``reference`` is the :class:`~idpsgd.assignment.Assignment` calibrated for the expected
    subset (uniform, Sample, Scale) or the list of PDP rounds
    (:func:`~idpsgd.training.pdp.plan_rounds`); ``train_budgets`` the budgets left for training
    of all N examples (after a private preprocessing step's cost); ``expected_examples`` the
    expected number of examples of a model, for which the plan is calibrated."""

    method: str
    train_budgets: Budgets
    reference: object
    epochs: int
    steps_per_epoch: int
    expected_batch_size: float
    expected_examples: float

    @property
    def steps(self) -> int:
        if self.method in PDP_AUDIT_METHODS:
            return int(sum(r["steps"] for r in self.reference))
        return self.epochs * self.steps_per_epoch

    @property
    def noise_multiplier(self):
        """σ (one phase) or the rounds' σ_R (PDP), as the runs' reports state it."""
        if self.method in PDP_AUDIT_METHODS:
            return [float(r["noise_multiplier"]) for r in self.reference]
        return float(self.reference.noise_multiplier)

    def for_subset(self, indices: np.ndarray):
        """The plan of a run on the examples ``indices``: a :class:`~idpsgd.training.plans.TrainingPlan`
        (one phase with this plan's σ, per-example q_i and c_i, steps) or the PDP rounds."""
        if self.method in PDP_AUDIT_METHODS:
            return self.reference
        from ..training.plans import Phase, TrainingPlan

        idx = np.asarray(indices, dtype=np.int64)
        ref = self.reference
        present, inverse, counts = np.unique(
            np.asarray(ref.example_group)[idx], return_inverse=True, return_counts=True
        )
        groups = tuple(
            dataclasses.replace(ref.groups[g], count=int(k), fraction=float(k) / idx.size)
            for g, k in zip(present, counts, strict=True)
        )
        assignment = dataclasses.replace(ref, groups=groups, example_group=inverse.astype(np.int64))
        sub = Budgets(self.train_budgets.epsilons[idx], self.train_budgets.delta)
        phase = Phase("all", np.arange(idx.size, dtype=np.int64), assignment, self.epochs, self.steps_per_epoch)
        return TrainingPlan(self.method, sub, (phase,))

    def signature(self) -> dict:
        """What a resumed audit's models must have run (steps and σ, to 10 digits)."""
        sig = self.noise_multiplier
        sig = [float(f"{s:.10g}") for s in sig] if isinstance(sig, list) else float(f"{sig:.10g}")
        return {
            "steps": self.steps,
            "noise_multiplier": sig,
            "expected_examples": float(f"{self.expected_examples:.10g}"),
        }

    def summary(self) -> dict:
        """The plan's public parameters (hyper-parameters: audit.json)."""
        out = {
            "calibrated_for": f"the expected model: {self.expected_examples:.1f} examples, each privacy group in "
            "its expected share (calibrated once; every model of the audit runs this plan)",
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": self.expected_batch_size,
        }
        if self.method in PDP_AUDIT_METHODS:
            out["rounds"] = [
                {
                    k: r[k]
                    for k in (
                        "round",
                        "threshold",
                        "sample_rate",
                        "expected_sample_size",
                        "epochs",
                        "steps",
                        "noise_multiplier",
                    )
                }
                for r in self.reference
            ]
        else:
            out.update(
                steps_per_epoch=self.steps_per_epoch,
                sample_rate=float(self.reference.sample_rate),
                groups=[
                    {
                        "budget": g.budget,
                        "sample_rate": g.sample_rate,
                        "clip_norm": g.clip_norm,
                        "noise_multiplier": g.noise_multiplier,
                        "epsilon": g.epsilon,
                    }
                    for g in self.reference.groups
                ],
            )
        return out


def shared_plan(dataset: Dataset, budgets: Budgets, config, inclusion, pdp=None) -> SharedPlan:
    """Calibrate the audit's one plan for the expected model: example i is in a model with
    probability ``inclusion[i]`` (1/2 for LiRA; for the one-run audit 1 outside the canaries),
    so the rate is q = B / Σ_i inclusion[i] and the groups weigh by their expected counts
    (Sample's σ and Scale's σ_scale depend on them).  Raises what calibration raises (e.g.
    :class:`~idpsgd.validation.UnreachableTargetError`), before any model trains."""
    from ..assignment import assign
    from ..engine import steps_per_epoch_for
    from ..training.loop import training_budgets

    n = len(dataset.y_train)
    p = np.broadcast_to(np.asarray(inclusion, float), (n,))
    size = float(p.sum())
    if config.method in PDP_AUDIT_METHODS:
        from ..training.pdp import plan_rounds

        rounds = plan_rounds(budgets, config, pdp, population=p)
        if not rounds:
            raise InvalidParameterError(
                "budgets",
                budgets.values.tolist(),
                "leave no PDP round to train (the expected sample of every round is below one example)",
            )
        return SharedPlan(
            config.method,
            budgets,
            rounds,
            int(config.epochs),
            int(rounds[0]["steps_per_epoch"]),
            float(rounds[0]["sample_rate"] * rounds[0]["expected_sample_size"]),
            size,
        )
    if int(config.batch_size) > size:
        raise InvalidParameterError(
            "batch_size",
            config.batch_size,
            f"must be <= {size:g}, the expected number of training examples of an audit model (of the {n} examples)",
        )
    pre = getattr(dataset, "preprocessing", None) or {}
    train_budgets = training_budgets(budgets, float(pre.get("epsilon", 0.0)), float(pre.get("delta", 0.0)))
    _, _, group_of = train_budgets.groups()
    weights = np.bincount(group_of, weights=p) / size
    q = int(config.batch_size) / size
    spe = steps_per_epoch_for(q)
    reference = assign(
        train_budgets,
        config.method,
        q,
        int(config.epochs) * spe,
        float(config.clip_norm),
        config.accountant,
        group_weights=weights,
    )
    return SharedPlan(
        config.method, train_budgets, reference, int(config.epochs), spe, float(p @ reference.sample_rates), size
    )


def check_model_report(report: dict, plan: SharedPlan, name: str) -> None:
    """Every model ran the plan (its steps and σ) and spent at most each group's budget; an
    internal error otherwise (the audit would compare unlike models, or a guarantee is broken)."""
    if int(report["steps"]) != plan.steps or not np.allclose(
        report["noise_multiplier"], plan.noise_multiplier, rtol=1e-12, atol=0
    ):
        raise RuntimeError(
            f"internal error: audit model {name} trained {report['steps']} steps with noise multiplier "
            f"{report['noise_multiplier']}, not the plan's {plan.steps} and {plan.noise_multiplier}"
        )
    for g in report["groups"]:
        if float(g["epsilon_spent"]) > float(g["budget"]) * (1 + 1e-9) + 1e-12:
            raise RuntimeError(
                f"internal error: audit model {name} spent epsilon {g['epsilon_spent']} on the group "
                f"with budget {g['budget']}"
            )


@dataclass
class TrainedModel:
    model: torch.nn.Module
    report: dict


def train_model(
    dataset: Dataset,
    budgets: Budgets,
    indices: np.ndarray,
    config,
    *,
    plan: SharedPlan,
    labels=None,
    scratch: Path | None = None,
    pdp=None,
) -> TrainedModel:
    """Train one model of the audit on the examples ``indices`` with their budgets, running the
    audit's one ``plan``.

    ``scratch`` is a private folder for the files a PDP run writes (removed afterwards); ``pdp``
    the :class:`~idpsgd.training.pdp.PdpOptions` of a PDP run."""
    from ..runfolder import RunFolder
    from ..training import Trainer
    from ..training.pdp import train_pdp

    sub = subset(dataset, indices, labels)
    sub_budgets = Budgets(budgets.epsilons[np.asarray(indices)], budgets.delta)
    if config.method in IDP_METHODS:
        trainer = Trainer(
            sub, sub_budgets, config, plan=plan.for_subset(indices), expected_batch_size=plan.expected_batch_size
        )
        report = trainer.run()
        model = getattr(trainer.model, "_module", trainer.model)
        return TrainedModel(model.eval(), report)
    # PDP-SGD: the run writes its model.pt into a private scratch folder, read back from there
    if scratch is None:
        raise InvalidParameterError("scratch", None, "a PDP audit needs a private scratch folder")
    scratch.mkdir(parents=True, exist_ok=True)
    os.chmod(scratch, 0o700)  # private models
    tmp = Path(tempfile.mkdtemp(dir=scratch, prefix="run-"))
    try:
        report = train_pdp(
            sub, sub_budgets, config, RunFolder(tmp, overwrite=True), options=pdp, plan=plan.for_subset(indices)
        )
        model = _load_pdp_model(tmp, report, sub)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TrainedModel(model.eval(), report)


def _load_pdp_model(folder: Path, report: dict, data: Dataset) -> torch.nn.Module:
    from ..models import create_model

    path = next((p for p in (folder / "model.pt", folder / "private" / "model.pt") if p.is_file()), None)
    if path is None:
        raise CheckpointError(f"the PDP run wrote no model.pt in {folder}")
    state = load_torch(path, "model")
    if isinstance(state, (list, tuple)):
        if len(state) != 1:
            raise InvalidParameterError(
                "method", report.get("method"), f"trained {len(state)} models (an ensemble); the audit scores one model"
            )
        state = state[0]
    model = create_model(report["model"], data.input_shape, data.num_classes)
    model.load_state_dict(state)
    return model


def model_outputs(model: torch.nn.Module, x: torch.Tensor, y, batch_size: int = 2048):
    """(φ, loss) of every example: logit-scaled confidence of label y and cross-entropy (float64)."""
    device = next(model.parameters()).device
    model.eval()
    y = torch.as_tensor(np.asarray(y, dtype=np.int64))
    logits = []
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits.append(model(x[i : i + batch_size].to(device)).double().cpu())
    z = torch.cat(logits) if logits else torch.zeros(0, 1, dtype=torch.float64)
    loss = F.cross_entropy(z, y, reduction="none").numpy()
    return logit_confidence(z.numpy(), y.numpy()), loss


def reported_guarantees(report: dict) -> dict:
    """{budget: (reported ε, δ)} of a run's report (δ per group for PDP, else the run's δ)."""
    out = {}
    for g in report["groups"]:
        out[float(g["budget"])] = (float(g["epsilon_spent"]), float(g.get("delta", report["delta"])))
    return out


class ModelStore:
    """The audit folder's finished models: ``private/models/<name>.pt``, each written atomically
    with the audit's settings hash (a file of another audit is refused)."""

    def __init__(self, folder, settings_hash: str):
        self.folder, self.settings_hash = folder, settings_hash

    def _name(self, name: str) -> str:
        return f"models/{name}.pt"

    def load(self, name: str) -> dict | None:
        path = self.folder.path / "private" / self._name(name)
        if not path.is_file():
            return None
        state = load_torch(path, "audit model checkpoint")
        if not isinstance(state, dict) or state.get("settings_sha256") != self.settings_hash:
            raise InvalidParameterError(
                "resume",
                str(self.folder.path),
                f"{path.name} was written by an audit with other settings; use a new --out folder",
            )
        return state

    def save(
        self, name: str, *, members: np.ndarray, phi: np.ndarray, loss: np.ndarray, model: torch.nn.Module, report: dict
    ) -> dict:
        state = {
            "settings_sha256": self.settings_hash,
            "name": name,
            "members": np.asarray(members, bool),
            "phi": np.asarray(phi, np.float64),
            "loss": np.asarray(loss, np.float64),
            "report": _small_report(report),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        }
        self.folder.save_torch(
            self._name(name),
            state,
            "private",
            f"audit model {name}: training membership, per-example scores, weights (resumable)",
        )
        return state


def _small_report(report: dict) -> dict:
    keep = ("method", "model", "delta", "test_accuracy", "steps", "guarantee")
    out = {k: report.get(k) for k in keep if k in report}
    out["noise_multiplier"] = report.get("noise_multiplier")
    out["groups"] = [
        {
            "budget": float(g["budget"]),
            "epsilon_spent": float(g["epsilon_spent"]),
            **({"delta": float(g["delta"])} if "delta" in g else {}),
        }
        for g in report["groups"]
    ]
    return out


def settings_hash(settings: dict) -> str:
    import json

    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def config_settings(config) -> dict:
    """The training settings every model of the audit shares (what a resume must not change)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("progress", "device", "seed")}
