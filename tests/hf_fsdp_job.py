"""A private Trainer run sharded with FSDP2, for ``tests/test_fsdp_checkpoints.py``:

    torchrun --nproc-per-node N tests/hf_fsdp_job.py MODEL_DIR OUT

With ``SAVE_STEPS=k`` sharded checkpoints every k steps; ``CRASH_AT=s`` makes rank ``CRASH_RANK``
(default 1) raise at the end of step s; ``RESUME=1`` resumes from the latest checkpoint (privacy
seed None: the checkpoint's).  Rank 0 saves the final parameters, ε and ledger to OUT/result.pt.
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

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat", "on", "mat", "privacy"]


class _Crash(TrainerCallback):
    def __init__(self, at, rank):
        self.at, self.rank = at, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at and args.process_index == self.rank:
            raise SystemExit(3)  # one rank dies; the others fail in the next collective


def main(model_dir, out):
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
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
        gradient_accumulation_steps=1,
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
            fsdp=True,
        ),
    )
    if os.environ.get("CRASH_AT"):
        t.add_callback(_Crash(int(os.environ["CRASH_AT"]), int(os.environ.get("CRASH_RANK", "1"))))
    t.train(resume_from_checkpoint=True if os.environ.get("RESUME") else None)
    if t.is_world_process_zero():
        torch.save(
            {
                "params": torch.cat([p.detach().flatten() for p in t.model.parameters()]),
                "epsilon": t.engine.get_epsilon().per_group.tolist(),
                "ledger": [[float(v) for v in row] for row in t.ledger_rows],
            },
            f"{out}/result.pt",
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
