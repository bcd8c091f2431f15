"""A private Trainer run, for ``tests/test_hf_longrun.py``: the same run under ``torchrun
--nproc-per-node N`` (expected batch per_device × accumulation × N) and in one process.

    python tests/hf_torchrun_job.py MODEL_DIR OUT ACCUMULATION GRAD_SAMPLE_MODE

With ``SAVE_STEPS=k`` private checkpoints every k steps; ``CRASH_AT=s`` dies at the end of step s;
``RESUME=1`` resumes from the latest checkpoint (privacy seed None: the checkpoint's).

:func:`run` is the run itself, shared with ``tests/hf_fsdp_job.py`` (its FSDP2 twin).
"""

import os
import sys

import datasets
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TrainerCallback,
    TrainingArguments,
)

from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments


class _Crash(TrainerCallback):
    """Raise at the end of step ``at``: on every rank, or on rank ``rank`` only."""

    def __init__(self, at, rank=None):
        self.at, self.rank = at, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at and self.rank in (None, args.process_index):
            raise SystemExit(3)  # with a rank: one rank dies; the others fail in the next collective


WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat", "on", "mat", "privacy"]


def run(tok, model, out, accumulation, crash_rank=None, **privacy):
    """Train ``model`` privately on 48 seeded lines (ε 1 and 8 by turns), ``privacy`` added to the
    :class:`PrivacyArguments`, following the environment (``SAVE_STEPS``, ``CRASH_AT``: on every rank, or
    on ``crash_rank`` only; ``RESUME``); rank 0 saves the trainer's final parameters, ε and ledger to
    ``OUT/result.pt``."""
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(48)]
    enc = tok(lines, truncation=True, max_length=16)
    eps = np.where(np.arange(48) % 2 == 0, 1.0, 8.0)
    train = datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "epsilon": eps}
    )
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=int(accumulation),
        num_train_epochs=2,
        learning_rate=1e-2,
        save_strategy="steps" if os.environ.get("SAVE_STEPS") else "no",
        save_steps=int(os.environ.get("SAVE_STEPS", "500")),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=2,
        seed=0,
    )
    t = IndividualizedTrainer(
        model=model,
        args=args,
        train_dataset=train,
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        privacy=PrivacyArguments(
            budgets="epsilon",
            delta=1e-5,
            method="scale",
            seed=None if os.environ.get("RESUME") else 3,
            **privacy,
        ),
    )
    if os.environ.get("CRASH_AT"):
        t.add_callback(_Crash(int(os.environ["CRASH_AT"]), crash_rank))
    t.train(resume_from_checkpoint=True if os.environ.get("RESUME") else None)
    if t.is_world_process_zero():
        torch.save(
            {
                # the trainer's model: ``model`` itself, or under FSDP rank 0's gathered plain copy
                "params": torch.cat([p.detach().flatten() for p in t.model.parameters()]),
                "epsilon": t.engine.get_epsilon().per_group.tolist(),
                "ledger": [[float(v) for v in row] for row in t.ledger_rows],
            },
            f"{out}/result.pt",
        )


def main(model_dir, out, accumulation, mode):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    run(tok, model, out, accumulation, grad_sample_mode=mode)


if __name__ == "__main__":
    main(*sys.argv[1:5])
