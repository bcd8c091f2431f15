"""The run folder of a private fine-tuning run, in the ``train`` harness's report schema.

Public (covered by the guarantee): ``model/`` (``save_pretrained`` of the model and its tokenizer:
what the noisy steps wrote), ``report.json`` (the guarantee per privacy group with its sampling rate,
clip norm, effective noise multiplier and ε; hyper-parameters; test metrics on the held-out
``eval_dataset``; the public log history) and ``report.html`` (:mod:`idpsgd.analysis.report`).
Private (``private/``, mode 0600): ``epsilons.csv`` (each training example's budget and ε; at user
level each user's id, row count, budget and ε, and ``users.json``: how many rows lay beyond k),
``ledger.csv`` (each step's real batch size and ε per group), ``history.json`` (training losses and
other logged values the guarantee does not cover) and ``seed.json`` (the privacy seed).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...accounting.neighbouring import neighbouring
from ...analysis.metrics import accuracies
from ...engine import GUARANTEE, distributed
from ...engine.budget.journal import register_journal, step_counts
from ...engine.noise.randomness import randomness_note
from ...runfolder import PRIVATE, SEED_FILE
from .losses import PerExampleLoss, base_model, sequence_losses, token_losses


@torch.no_grad()
def test_metrics(trainer) -> dict:
    """Metrics of the trained model on ``trainer.eval_dataset`` (empty without one): for language
    models the token-weighted cross-entropy and perplexity; for single-label classifiers accuracy and
    per-class accuracy; otherwise the mean per-example loss."""
    if trainer.eval_dataset is None:
        return {}
    model, fn, label = trainer.model, trainer.per_example_loss, trainer.label_name
    was = model.training
    model.eval()
    tok_sum = tok_count = loss_sum = 0.0
    examples, preds, ys = 0, [], []
    try:
        for batch in trainer.report_eval_dataloader():
            batch = dict(trainer._prepare_inputs(batch))
            labels = batch.pop(label)
            out = model(**batch)
            examples += int(labels.shape[0])
            if isinstance(fn, PerExampleLoss) and fn.family == "token":
                s, c = token_losses(out["logits"], labels, fn.shift)
                tok_sum, tok_count = tok_sum + float(s.sum()), tok_count + float(c.sum())
            elif isinstance(fn, PerExampleLoss):
                loss_sum += float(sequence_losses(out["logits"], labels, fn.problem_type, fn.num_labels).sum())
                if out["logits"].dim() == 2 and labels.dim() == 1 and not labels.dtype.is_floating_point:
                    preds.append(out["logits"].argmax(-1).cpu())
                    ys.append(labels.cpu())
            else:
                loss_sum += float(fn(out, labels).sum())
    finally:
        model.train(was)
    if isinstance(fn, PerExampleLoss) and fn.family == "token":
        loss = tok_sum / max(tok_count, 1.0)
        metrics = {"test_loss": loss, "test_tokens": int(tok_count)}
        if fn.task in ("causal_lm", "masked_lm"):
            metrics["test_perplexity"] = math.exp(min(loss, 700.0))
    else:
        metrics = {"test_loss": loss_sum / max(examples, 1)}
    metrics["test_examples"] = examples
    if preds:
        acc = accuracies(torch.cat(preds), torch.cat(ys), max(int(getattr(fn, "num_labels", 2)), 2))
        metrics.update({"test_accuracy": acc["accuracy"], "per_class_accuracy": acc["per_class_accuracy"]})
    return metrics


def model_name(model) -> str:
    """The model's class (its base class and adapter type for a PEFT model)."""
    base = base_model(model)
    name = type(base).__name__
    if base is not model:
        cfg = getattr(model, "peft_config", {}) or {}
        kinds = sorted({str(getattr(c, "peft_type", "adapter")).split(".")[-1] for c in cfg.values()})
        name += f" + {'/'.join(kinds) or 'adapter'}"
    return name


def build_report(trainer) -> dict:
    """The run's report (``train`` harness schema; ``private`` holds what must not be published)."""
    engine, args = trainer.engine, trainer.user_args
    delta = trainer.budgets.delta
    engine.finish_journal()  # draws of earlier attempts the run did not reach: charged before the report's ε
    eps = engine.get_epsilon()
    groups = []
    for g in engine.privacy_groups():
        groups.append(
            {
                "budget": g["budget"],
                "count": g["count"],
                "trained": True,
                "sample_rate": g["sample_rate"],
                "clip_norm": g["clip_norm"],
                "noise_multiplier": g["noise_multiplier"],
                "steps": engine.steps,
                "epsilon_spent": g["epsilon"],
                "epsilon_training": g["epsilon"],
                "delta": delta,
            }
        )
    p = engine.parameters
    users = getattr(trainer, "users", None)
    metrics = test_metrics(trainer)
    history = [dict(h) for h in trainer.state.log_history]  # public by construction (trainer.log)
    return {
        "method": trainer.privacy.method,
        "dataset": trainer.dataset_name,
        "model": model_name(trainer.model),
        "task": getattr(trainer.per_example_loss, "task", "custom per_example_loss"),
        "accountant": engine.accountant_name,
        "guarantee": f"model: {_guarantee(trainer)}, with epsilon_p = the group's epsilon_spent and delta = {delta:g}",
        **neighbouring("example" if getattr(trainer, "users", None) is None else "user"),
        **({"max_rows_per_user": trainer.users.k} if getattr(trainer, "users", None) is not None else {}),
        "delta": delta,
        "epsilon": eps.loosest,
        # accuracy only where it applies (classification with labelled test data): not null / [] for a language model
        **{k: metrics[k] for k in ("test_accuracy", "per_class_accuracy") if k in metrics},
        "test_metrics": metrics,
        "loss_convention": (
            "mean over the batch's examples of each example's own loss; per example: the mean over its "
            "labelled tokens (token-level tasks) or its loss (classification)"
        ),
        "noise_multiplier": p.noise_multiplier,
        "steps": engine.steps,
        **step_counts(engine),
        "planned_steps": trainer.planned_steps,
        "stopped_early": trainer.stopped_early,
        "epochs": args.num_train_epochs if args.max_steps <= 0 else None,
        "max_steps": args.max_steps if args.max_steps > 0 else None,
        "batch_size": trainer.expected_batch_size,
        "physical_batch_size": trainer.physical_batch_size,
        "lr": args.learning_rate,
        "optimizer": str(getattr(args.optim, "value", args.optim)),
        "lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "weight_decay": args.weight_decay,
        "clip_norm": p.max_grad_norm,
        "secure_mode": engine.secure_mode,
        "randomness": randomness_note(engine.secure_mode, f"{PRIVATE}/{SEED_FILE}"),
        "grad_sample_mode": p.grad_sample_mode,
        "nproc": distributed.rank_and_world()[1],  # data-parallel processes (--nproc or torchrun); 1 without
        "layer_paths": trainer.layer_paths,
        "phases": [
            {
                "name": "all",
                "examples": len(trainer.budgets),  # the key is stable; "unit" says what it counts
                "unit": "example" if getattr(trainer, "users", None) is None else "user",
                "steps": engine.steps,
                "sample_rate": float(np.mean(p.sample_rates)),
                "noise_multiplier": p.noise_multiplier,
            }
        ],
        "groups": groups,
        "history": history,
        **({"data": public_data_source(trainer.data_source, users)} if trainer.data_source else {}),
        "files": None,
        "private": {
            **({"data_rows": trainer.data_source["train"]["rows"]} if _train_rows(trainer.data_source, users) else {}),
            "seed": engine.seed,
            "history": trainer.private_logs,
            "layer_paths_taken": trainer.layer_paths_taken,
        },  # depend on the batches' shapes
    }


def _train_rows(source: dict | None, users) -> bool:
    return users is not None and isinstance(source, dict) and "rows" in (source.get("train") or {})


def public_data_source(source: dict, users) -> dict:
    """The data's public description: at user level the training data's number of users in place of its
    number of rows (one user's row count moves the rows; the users are a public input of the
    user-level guarantee, docs/user-level.md); the rows stay in the report's private part."""
    if not _train_rows(source, users):
        return source
    train = {k: v for k, v in source["train"].items() if k != "rows"}
    return {**source, "train": {**train, "users": users.num_users}}


def save_model_folder(trainer) -> None:
    """``save_pretrained`` of the model and the tokenizer (processing class) into the run folder's
    public ``model/``, atomically."""
    model, tok = trainer.model, trainer.processing_class

    def write(path):
        model.save_pretrained(path)
        if tok is not None and hasattr(tok, "save_pretrained"):
            tok.save_pretrained(path)

    trainer.run_folder.save_directory(
        "model",
        "public",
        "the trained model (and its tokenizer) as save_pretrained writes it: load with from_pretrained(folder)",
        write,
    )


def write_run(trainer) -> dict:
    """Every output of the run (see the module docstring); returns the report."""
    from ...analysis.report import write_report
    from ...training.loop import public_report

    rf, engine = trainer.run_folder, trainer.engine
    register_journal(rf)
    report = build_report(trainer)
    save_model_folder(trainer)
    budgets, users = trainer.budgets, getattr(trainer, "users", None)
    if users is None:
        rf.write_csv(
            "epsilons.csv",
            ["index", "budget", "epsilon"],
            [np.arange(len(budgets)), budgets.epsilons, engine.get_individual_epsilons()],
            "private",
            "each training example (in train_dataset order): its budget and the epsilon it received",
        )
    else:  # user level: keyed by the user id (a private file: the id is personal data, as the budgets)
        from ...training.loop import write_users_summary

        rf.write_csv(
            "epsilons.csv",
            ["user", "rows", "budget", "epsilon"],
            [users.ids.tolist(), users.rows_per_user, budgets.epsilons, engine.get_individual_epsilons()],
            "private",
            "each user (by their id, sorted): their number of rows, their budget and the epsilon they received",
        )
        write_users_summary(rf, users)
    header = ["step", "batch_size"] + [f"epsilon_rdp_budget_{v:g}" for v in engine.group_budgets]
    cols = list(zip(*trainer.ledger_rows, strict=True)) if trainer.ledger_rows else [[] for _ in header]
    rf.write_csv(
        "ledger.csv",
        header,
        cols,
        "private",
        "every step's real Poisson batch size and each group's epsilon (RDP bound at the order grid) after it",
    )
    rf.write_json(
        "history.json",
        trainer.private_logs,
        "private",
        "logged values the guarantee does not cover: "
        "training losses on the private batches (before noise) and the like",
    )
    rf.write_json(
        SEED_FILE,
        {"seed": engine.seed, "secure_mode": engine.secure_mode},
        "private",
        "the seed of the privacy randomness (Poisson sampling and noise): whoever knows it can remove the noise",
    )
    about = "the run's report: guarantee per group, test metrics, hyper-parameters"
    rf.file("report.json", "public", about)
    rf.file("report.html", "public", "the run's readable report")
    report["files"] = {k: v["kind"] for k, v in rf.files().items()}
    rf.write_json("report.json", public_report(report), "public", about)
    write_report(rf)
    return report


def _guarantee(trainer) -> str:
    """The guarantee in words: per example, or per user at user level."""
    from ...engine.clipping.users import USER_GUARANTEE

    return GUARANTEE if getattr(trainer, "users", None) is None else USER_GUARANTEE
