"""The audit's models: trained through the project's harness, scored, and checkpointed one by one.

Every model of an audit — the shadows and the target — is trained exactly as ``idpsgd train``
trains (same method, budgets, hyper-parameters), on a subset of the training examples:
:class:`~idpsgd.training.Trainer` for uniform, Sample and Scale; :func:`~idpsgd.training.train`
(which runs :func:`~idpsgd.training.pdp.train_pdp`) for PDP-SGD, whose single model is read back
from the ``model.pt`` it writes.  A finished model is saved atomically (its membership mask,
per-example φ and loss on all examples, the weights and the guarantees its run reported), so an
interrupted audit resumes without retraining it.
"""
from __future__ import annotations

import os

import dataclasses
import hashlib
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
from ..validation import InvalidParameterError
from .lira import logit_confidence

TRAINER_METHODS = ("uniform", "sample", "scale")
PDP_AUDIT_METHODS = ("pdp-sgd",)
AUDIT_METHODS = TRAINER_METHODS + PDP_AUDIT_METHODS


def check_method(method: str) -> str:
    if method == "adapdp":
        raise InvalidParameterError("method", method, "is not supported by the audit: AdaPDP predicts with a weighted "
                                    "ensemble of models, not one model to score; audit one of "
                                    f"{', '.join(AUDIT_METHODS)}")
    if method not in AUDIT_METHODS:
        raise InvalidParameterError("method", method, f"the audit supports {', '.join(AUDIT_METHODS)}")
    return method


def subset(dataset: Dataset, indices: np.ndarray, labels: np.ndarray | None = None) -> Dataset:
    """The training examples ``indices`` (with ``labels`` instead of the true ones, if given)."""
    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    y = dataset.y_train if labels is None else torch.as_tensor(np.asarray(labels, dtype=np.int64))
    return Dataset(dataset.name, dataset.x_train[idx], y[idx], dataset.x_test, dataset.y_test,
                   dataset.num_classes, dataset.preprocessing)


@dataclass
class TrainedModel:
    model: torch.nn.Module
    report: dict


def train_model(dataset: Dataset, budgets: Budgets, indices: np.ndarray, config, *, labels=None,
                scratch: Path | None = None, pdp=None) -> TrainedModel:
    """Train one model of the audit on the examples ``indices`` with their budgets.

    ``scratch`` is a private folder for the files a PDP run writes (removed afterwards); ``pdp``
    the :class:`~idpsgd.training.pdp.PdpOptions` of a PDP run."""
    from ..training import Trainer, train

    sub = subset(dataset, indices, labels)
    sub_budgets = Budgets(budgets.epsilons[np.asarray(indices)], budgets.delta)
    if config.method in TRAINER_METHODS:
        trainer = Trainer(sub, sub_budgets, config)
        report = trainer.run()
        model = getattr(trainer.model, "_module", trainer.model)
        return TrainedModel(model.eval(), report)
    # PDP-SGD: through the harness's `train`, reading its model back from the run folder
    if scratch is None:
        raise InvalidParameterError("scratch", None, "a PDP audit needs a private scratch folder")
    scratch.mkdir(parents=True, exist_ok=True)
    os.chmod(scratch, 0o700)                     # private models
    tmp = Path(tempfile.mkdtemp(dir=scratch, prefix="run-"))
    try:
        report = train(sub, sub_budgets, config, tmp, overwrite=True, pdp=pdp)
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
            raise InvalidParameterError("method", report.get("method"), f"trained {len(state)} models (an ensemble); "
                                        "the audit scores one model")
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
            logits.append(model(x[i:i + batch_size].to(device)).double().cpu())
    z = torch.cat(logits) if logits else torch.zeros(0, 1, dtype=torch.float64)
    loss = F.cross_entropy(z, y, reduction="none").numpy()
    return logit_confidence(z.numpy(), y.numpy()), loss


def reported_guarantees(report: dict) -> dict:
    """{budget: (reported ε, δ)} of a run's report (δ per group for PDP, else the run's δ)."""
    out = {}
    for g in report["groups"]:
        out[float(g["budget"])] = (float(g["epsilon_spent"]), float(g.get("delta", report["delta"])))
    return out


def derived_seed(seed: int, *path: int) -> int:
    """A training seed for one model of the audit, derived from the audit's seed (< 2^63)."""
    state = np.random.SeedSequence([int(seed), *map(int, path)]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


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
            raise InvalidParameterError("resume", str(self.folder.path), f"{path.name} was written by an audit with "
                                        "other settings; use a new --out folder")
        return state

    def save(self, name: str, *, members: np.ndarray, phi: np.ndarray, loss: np.ndarray, model: torch.nn.Module,
             report: dict) -> dict:
        state = {"settings_sha256": self.settings_hash, "name": name, "members": np.asarray(members, bool),
                 "phi": np.asarray(phi, np.float64), "loss": np.asarray(loss, np.float64),
                 "report": _small_report(report), "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
        self.folder.save_torch(self._name(name), state, "private", f"audit model {name}: training membership, "
                               "per-example scores, weights (resumable)")
        return state


def _small_report(report: dict) -> dict:
    keep = ("method", "model", "delta", "test_accuracy", "steps", "seed", "guarantee")
    out = {k: report.get(k) for k in keep if k in report}
    out["noise_multiplier"] = report.get("noise_multiplier")
    out["groups"] = [{"budget": float(g["budget"]), "epsilon_spent": float(g["epsilon_spent"]),
                      **({"delta": float(g["delta"])} if "delta" in g else {})} for g in report["groups"]]
    return out


def settings_hash(settings: dict) -> str:
    import json

    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def config_settings(config) -> dict:
    """The training settings every model of the audit shares (what a resume must not change)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("progress", "device", "seed")}
