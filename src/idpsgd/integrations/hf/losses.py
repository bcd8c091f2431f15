"""Per-example losses of Hugging Face models: the loss convention of private fine-tuning.

The engine clips each example's gradient g_i = ∇ℓ_i and takes the batch loss to be the mean over
the batch's examples (Opacus's ``loss_reduction="mean"``), so ℓ_i must depend on example i alone.
Hugging Face's token-level losses do not: a causal LM's ``loss`` is the mean over *all* target
tokens of the batch, whose per-example parts depend on the other examples' lengths — adding or
removing one example would change every other example's clipped contribution, and DP-SGD's
sensitivity bound would not hold.  This module owns the per-example loss instead: for token-level
tasks the mean over example i's labelled tokens (0 without any), for sequence and image
classification the loss ``config.problem_type`` names; the batch loss is the mean of the ℓ_i.
Evaluation keeps the models' own loss.  User guide: ``docs/huggingface.md`` (The loss and the
clipping convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...validation import InvalidParameterError

IGNORE_INDEX = -100
#: task -> (labels shifted by one position, loss family)
TASKS = {
    "causal_lm": (True, "token"),
    "masked_lm": (False, "token"),
    "token_classification": (False, "token"),
    "sequence_classification": (False, "sequence"),
    "image_classification": (False, "sequence"),
}


def token_losses(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, number of labelled tokens) per example, both shape (B,).

    ``logits`` (B, T, V), ``labels`` (B, T) with ``-100`` for tokens without a label; ``shift``:
    token t predicts label t+1 (causal LM).  Computed in float32 (or float64 for float64 logits)."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"token-level losses need logits (B, T, V) and labels (B, T); got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    b, t = labels.shape
    work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    tok = F.cross_entropy(
        work.reshape(b * t, -1), labels.reshape(-1).long(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(b, t)
    return tok.sum(1), (labels != IGNORE_INDEX).sum(1)


def sequence_losses(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None, num_labels: int
) -> torch.Tensor:
    """Per-example loss of a sequence (or image) classifier, shape (B,), as the models choose it."""
    b = logits.shape[0]
    if problem_type is None:  # the models' rule (e.g. BertForSequenceClassification)
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if problem_type == "regression":
        diff = work.reshape(b, -1) - labels.reshape(b, -1).to(work.dtype)
        return (diff * diff).mean(1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(work.reshape(b, -1), labels.reshape(b).long(), reduction="none")
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(
            work.reshape(b, -1), labels.reshape(b, -1).to(work.dtype), reduction="none"
        ).mean(1)
    raise ValueError(
        f"problem_type {problem_type!r} is not one of regression, single_label_classification, "
        "multi_label_classification"
    )


def base_model(model):
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def task_of(model) -> str | None:
    """The model's task from its class (a PEFT model's base class), or None when unknown."""
    from transformers.models.auto import modeling_auto as auto

    name = type(base_model(model)).__name__
    mappings = {
        "causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "masked_lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "token_classification": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        "sequence_classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "image_classification": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }
    for task, mapping in mappings.items():
        for value in mapping.values():
            if name == value or (isinstance(value, (tuple, list)) and name in value):
                return task
    return None


class PerExampleLoss:
    """ℓ_i for every example of a batch from the model's outputs and the labels (see the module).

    Args:
        task: one of :data:`TASKS`.
        problem_type, num_labels: a classifier's ``config.problem_type`` and ``config.num_labels``.
    """

    def __init__(self, task: str, problem_type: str | None = None, num_labels: int = 2):
        if task not in TASKS:
            raise InvalidParameterError("task", task, f"must be one of {', '.join(TASKS)}")
        self.task, self.problem_type, self.num_labels = task, problem_type, int(num_labels)
        self.shift, self.family = TASKS[task]

    @classmethod
    def for_model(cls, model) -> PerExampleLoss:
        """The loss of ``model``'s task; refused (with what to do) when the task is unknown."""
        task = task_of(model)
        if task is None:
            raise InvalidParameterError(
                "model",
                type(base_model(model)).__name__,
                "has no known per-example loss "
                "(causal LM, masked LM, token, sequence or image classification); pass "
                "per_example_loss=fn(outputs, labels) returning one loss per example",
            )
        config = getattr(base_model(model), "config", None)
        return cls(task, getattr(config, "problem_type", None), getattr(config, "num_labels", 2))

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
        if self.family == "token":
            total, count = token_losses(logits, labels, self.shift)
            return total / count.clamp(min=1).to(total.dtype)
        return sequence_losses(logits, labels, self.problem_type, self.num_labels)

    def __repr__(self) -> str:
        return f"PerExampleLoss({self.task!r})"
