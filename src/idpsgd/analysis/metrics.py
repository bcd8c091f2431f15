"""Test-set metrics: accuracy, per-class accuracy and mean cross-entropy."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def evaluate(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int = 2048
) -> dict:
    """Accuracy, per-class accuracy and mean cross-entropy of ``model`` on (x, y) (batches are moved
    to the model's device; results come back to the CPU)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    preds, loss = [], 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            out = model(x[i : i + batch_size].to(device))
            loss += float(F.cross_entropy(out, y[i : i + batch_size].to(device), reduction="sum"))
            preds.append(out.argmax(1).cpu())
    model.train(was_training)
    pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)
    return {**accuracies(pred, y, num_classes), "loss": loss / max(len(y), 1)}


def accuracies(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict:
    """Accuracy and per-class accuracy (None for a class absent from ``y``) of predictions."""
    pred, y = pred.cpu(), y.cpu()
    correct = (pred == y).numpy()
    labels = y.numpy()
    per_class = [float(correct[labels == k].mean()) if np.any(labels == k) else None for k in range(num_classes)]
    return {"accuracy": float(correct.mean()) if len(y) else float("nan"), "per_class_accuracy": per_class}
