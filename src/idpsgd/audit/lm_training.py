"""Canaries into Hugging Face fine-tuning, then the audit (:mod:`.lm`): the two ways in.

* :func:`audit_finetune` — a local model folder and a text file (``idpsgd audit --model DIR --data
  FILE``): the canaries are appended to the rows, :func:`~idpsgd.integrations.hf.finetune` trains
  with them (held-out canaries as null rows), and the released ``model/`` is audited; everything in
  one run folder.
* :func:`add_canaries`, :data:`canary_collator` and :func:`audit_trainer` — the same for an
  :class:`~idpsgd.integrations.hf.IndividualizedTrainer` built by the user::

      canaries = draw_canaries(budget_values, 32, seed=0)
      train = add_canaries(train, canaries, tokenizer, budget_column="epsilon")
      trainer = IndividualizedTrainer(..., train_dataset=train, data_collator=canary_collator(tokenizer))
      trainer.train()
      audit = audit_trainer(trainer, canaries)

Imports transformers and datasets lazily (the ``hf`` extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..validation import InvalidParameterError
from .canaries import Canaries, draw_canaries, with_canaries
from .lm import LMAuditOptions, audit_canaries, check_format_tokens, public_result, reported_by_group

#: the design's seed is derived from the run's seed on this path (never the privacy seed itself)
DESIGN_PATH = 52


def _design_seed(seed, secure_mode: bool):
    from ..engine.noise.randomness import derive_seed

    return None if secure_mode or seed is None else derive_seed(int(seed), DESIGN_PATH)


def audit_finetune(
    model_dir,
    data,
    budgets,
    out,
    *,
    options=None,
    audit: LMAuditOptions | None = None,
    users=None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune ``model_dir`` on ``data`` (a :class:`~idpsgd.integrations.hf.text_data.TextData`
    without labels) plus canaries in every budget group, then audit the released model.

    Args:
        budgets: one budget per row (example level) or per user (``users``: an
            :class:`idpsgd.Users` over ``data``'s rows).
        options: :class:`~idpsgd.integrations.hf.FinetuneOptions` (its seed also derives the canary
            design's; secure mode draws a fresh design).
        audit: :class:`~idpsgd.audit.lm.LMAuditOptions`.

    Returns the run's public report with its ``lm_audit`` and, under ``"private"``, the run's
    private part and where the canaries are.
    """
    from ..assignment import Budgets
    from ..integrations.hf.finetune import FinetuneOptions, finetune, load_tokenizer
    from ..integrations.hf.text_data import TextData
    from ..runfolder import RunFolder
    from ..users import Users

    options = options or FinetuneOptions()
    audit = audit or LMAuditOptions()
    if data.labels is not None:
        raise InvalidParameterError(
            "label_column", data.source.get("label_column"), "the canary audit is for causal language models"
        )
    if options.nproc > 1 or options.fsdp or options.lora_r:
        raise InvalidParameterError(
            "nproc" if options.nproc > 1 else "fsdp" if options.fsdp else "lora_r",
            options.nproc if options.nproc > 1 else True if options.fsdp else options.lora_r,
            "the canary audit fine-tunes one model in one process with full fine-tuning",
        )
    if not isinstance(budgets, Budgets):
        raise InvalidParameterError("budgets", type(budgets).__name__, "must be an idpsgd.Budgets")
    if users is None:
        if len(budgets) != len(data):
            raise InvalidParameterError("budgets", f"{len(budgets)} values", f"need one per row ({len(data)})")
        row_eps, user_rows = budgets.epsilons, None
    else:
        if len(budgets) != users.num_users:
            raise InvalidParameterError("budgets", f"{len(budgets)} values", f"need one per user ({users.num_users})")
        row_eps, user_rows = budgets.epsilons[users.unit_of_row], list(data.users)
    canaries = draw_canaries(
        budgets.values,
        audit.canaries,
        audit.format,
        seed=_design_seed(options.seed, options.secure_mode),
        user_ids=None if users is None else users.ids,
        user_budgets=None if users is None else budgets.epsilons,
        users=audit.users,
        repeats=audit.repeats,
    )
    check_format_tokens(load_tokenizer(model_dir), canaries.format, len(canaries))  # before training
    texts, eps, all_users, null, of = with_canaries(data.texts, row_eps, canaries, user_rows)
    source = {**data.source, "rows": len(texts), "canary_rows": int(of.size)}
    lines = list(data.lines or range(1, len(data) + 1)) + [0] * int(of.size)
    train = TextData(texts, None, eps, list(data.columns), source, lines, data.path, all_users)
    if users is None:
        run_budgets = Budgets.from_array(eps, budgets.delta)
        run_users = None
    else:
        run_users = Users(all_users, users.k)
        run_budgets = run_users.budgets_from_rows(eps, budgets.delta)
    report = finetune(
        model_dir, train, run_budgets, out, options=options, overwrite=overwrite, users=run_users, null_rows=null
    )
    model, tokenizer = _released_model(Path(out) / "model", load_tokenizer, options.device)
    result = audit_canaries(model, tokenizer, canaries, reported_by_group(report, budgets.delta), budgets.delta, audit)
    from .lm_report import write_lm_audit

    public = write_lm_audit(RunFolder(out, resume=True), result)
    private = report.get("private", {})
    return {
        **{k: v for k, v in report.items() if k != "private"},
        "lm_audit": public,
        "private": {**private, "canaries": str(Path(out) / "private" / "canaries.csv"), "design_seed": canaries.seed},
    }


def _released_model(folder: Path, load_tokenizer, device: str = "cpu"):
    """The released model (what anyone holding ``model/`` can score) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..integrations.hf.finetune import LOCAL_FILES

    model = AutoModelForCausalLM.from_pretrained(folder, **LOCAL_FILES)
    if device in ("cuda", "auto") and torch.cuda.is_available():
        model = model.to("cuda")
    return model, load_tokenizer(folder)


# ---------------------------------------------------------------- the Trainer path


def canary_collator(tokenizer):
    """The collator for a training set with canaries (:func:`add_canaries`): pads ``input_ids`` and
    ``attention_mask`` and pads ``labels`` with "no label" (-100), keeping the null rows unlabelled."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)


def add_canaries(
    dataset,
    canaries: Canaries,
    tokenizer,
    *,
    budget_column: str = "epsilon",
    user_column: str | None = None,
    max_length: int = 128,
):
    """``dataset`` (a tokenized ``datasets.Dataset``: ``input_ids``, optional ``attention_mask``, the
    budget column, at user level the user column) with a ``labels`` column and every canary appended
    (held-out ones as null rows: no label; a canary drawn with ``repeats`` as that many rows of its
    user).  Train it with :func:`canary_collator`."""
    import datasets

    from ..integrations.hf.finetune import null_row_labels

    allowed = {"input_ids", "attention_mask", budget_column} | ({user_column} if user_column else set())
    columns = list(dataset.column_names)
    other = [c for c in columns if c not in allowed]
    if "input_ids" not in columns or budget_column not in columns or other:
        raise InvalidParameterError(
            "train_dataset",
            ", ".join(columns),
            f"must hold input_ids, the budget column {budget_column!r}"
            + (f", the user column {user_column!r}" if user_column else "")
            + " and optionally attention_mask (a causal LM's tokenized rows), nothing else",
        )
    if (user_column is not None) != (canaries.users is not None):
        raise InvalidParameterError(
            "user_column", user_column, "give it exactly when the canaries were drawn at user level"
        )
    if user_column and canaries.users is not None:
        kind = getattr(dataset.features[user_column], "dtype", None)
        if kind not in ("string", "large_string") and any(isinstance(u, str) for u in canaries.users):
            raise InvalidParameterError(
                "user_column",
                f"{user_column} ({kind})",
                "holds non-text user ids, but the canaries' new users have text ids: store the user ids as "
                "text (dataset.cast_column) or draw the canaries with users='existing'",
            )
    check_format_tokens(tokenizer, canaries.format, len(canaries))  # before the user trains
    pad = tokenizer.pad_token_id
    base = null_row_labels(dataset, np.zeros(len(dataset), bool), pad)
    of = np.repeat(np.arange(len(canaries)), canaries.repeats)  # the canary of every appended row
    enc = tokenizer(canaries.texts, truncation=True, max_length=max_length)
    rows = {"input_ids": [enc["input_ids"][i] for i in of.tolist()]}
    if "attention_mask" in columns:
        rows["attention_mask"] = [enc["attention_mask"][i] for i in of.tolist()]
    rows[budget_column] = canaries.budgets[of].tolist()
    if user_column:
        rows[user_column] = [canaries.users[i] for i in of.tolist()]
    extra = datasets.Dataset.from_dict(rows)
    extra = null_row_labels(extra, ~canaries.included[of], pad)
    extra = extra.cast(base.features)
    return datasets.concatenate_datasets([base, extra])


def audit_trainer(trainer, canaries: Canaries, options: LMAuditOptions | None = None, tokenizer=None) -> dict:
    """Audit a trained :class:`~idpsgd.integrations.hf.IndividualizedTrainer` whose training set
    holds ``canaries`` (:func:`add_canaries`); writes the audit into its run folder and returns the
    public result."""
    from .lm_report import write_lm_audit

    report = getattr(trainer, "report", None)
    if report is None:
        raise InvalidParameterError(
            "trainer", type(trainer).__name__, "has not trained yet: call trainer.train() first"
        )
    tok = tokenizer or trainer.processing_class
    if tok is None:
        raise InvalidParameterError("tokenizer", None, "the trainer has no processing_class: pass tokenizer=")
    delta = trainer.budgets.delta
    result = audit_canaries(trainer.model, tok, canaries, reported_by_group(report, delta), delta, options)
    return write_lm_audit(trainer.run_folder, result)


__all__ = ["add_canaries", "audit_finetune", "audit_trainer", "canary_collator", "public_result"]
