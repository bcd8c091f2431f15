"""Fine-tune a GPT-2-shaped language model with two consent groups: ε = 1 and ε = 8.

Half of the texts belong to people who consented to ε = 8, half to people who demand ε = 1.
Individualized DP-SGD (Boenisch et al. 2023, *Scale*: a clip norm per group) trains one model
that gives each group its own guarantee, through ``idpsgd.integrations.hf.IndividualizedTrainer``
(a ``transformers.Trainer``).  Prints each group's ε and the test perplexity; writes the run folder
(public model/, report.json, report.html; private/).

    python examples/hf_finetune_gpt2.py [--data texts.txt] [--model LOCAL_GPT2_FOLDER] [--lora-r 8]
                                        [--out runs/hf_gpt2] [--tiny]

* ``--data``: a local text file — one text per line (``.txt``), or JSON Lines / CSV with a ``text``
  column; default: a synthetic corpus of short sentences (no download).
* ``--model``: a local GPT-2 folder (``save_pretrained``: config, weights, tokenizer); default: a
  GPT-2-shaped model built from a config (random initialisation) with a byte-level tokenizer whose
  vocabulary is the 256 bytes — fixed in advance, so the released tokenizer reveals nothing about
  the texts (a tokenizer trained on the private texts would).
* ``--tiny`` (or ``IDPSGD_EXAMPLE_TINY=1``): a one-layer model on 64 texts, one epoch — seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

SUBJECTS = [
    "the nurse",
    "a patient",
    "my neighbour",
    "the doctor",
    "our teacher",
    "a student",
    "the driver",
    "his sister",
    "the clerk",
    "a visitor",
]
VERBS = ["visited", "called", "left", "reached", "cleaned", "opened", "closed", "painted", "watched", "found"]
OBJECTS = [
    "the clinic",
    "the old house",
    "a small shop",
    "the river bank",
    "the station",
    "a quiet park",
    "the library",
    "the market",
    "a red car",
    "the school",
]
TIMES = [
    "on monday",
    "at noon",
    "in the evening",
    "last week",
    "before dawn",
    "after lunch",
    "on friday",
    "in spring",
    "yesterday",
    "at night",
]


def synthetic_texts(n: int, seed: int) -> list[str]:
    """Short sentences from a fixed grammar (the example's stand-in for personal texts)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(part) for part in (SUBJECTS, VERBS, OBJECTS, TIMES)) + "." for _ in range(n)]


def read_texts(path: str) -> list[str]:
    p = Path(path)
    if p.suffix.lower() in (".jsonl", ".json", ".csv"):
        from idpsgd.integrations.hf import load_text_data

        return load_text_data(p).texts
    texts = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise SystemExit(f"{p}: no texts (one per line)")
    return texts


def byte_level_tokenizer():
    """A GPT-2-style byte-level tokenizer with the 256 bytes as its vocabulary (no merges: nothing
    learned from data) and an end-of-text token that also pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="local text file (.txt one text per line, or .jsonl/.csv with a text column)")
    p.add_argument("--model", help="local GPT-2 folder (default: a GPT-2-shaped model from a config)")
    p.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank (default 0: all weights)")
    p.add_argument("--epochs", type=float, help="passes over the data (default 3; tiny 1)")
    p.add_argument("--out", default="runs/hf_gpt2", help="run folder (default runs/hf_gpt2)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data split, groups, model and noise (default 0; "
        "a real run leaves the privacy seed to OS entropy)",
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (also IDPSGD_EXAMPLE_TINY=1)")
    args = p.parse_args(argv)
    tiny = args.tiny or os.environ.get("IDPSGD_EXAMPLE_TINY") == "1"

    import datasets
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        GPT2Config,
        GPT2LMHeadModel,
        TrainingArguments,
    )
    from transformers.trainer_callback import PrinterCallback

    from idpsgd import Budgets
    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    texts = read_texts(args.data) if args.data else synthetic_texts(80 if tiny else 4000, args.seed)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(texts))
    n_test = max(8, len(texts) // 10)
    train_texts, test_texts = [texts[i] for i in order[n_test:]], [texts[i] for i in order[:n_test]]
    max_length = 64
    torch.manual_seed(args.seed)
    if args.model:
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        tok.pad_token = tok.pad_token or tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    else:
        tok = byte_level_tokenizer()
        layers, width, heads = (1, 16, 2) if tiny else (4, 128, 4)
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(tok),
                n_positions=max_length,
                n_layer=layers,
                n_embd=width,
                n_head=heads,
                bos_token_id=tok.eos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, task_type="CAUSAL_LM"))

    def encode(rows):
        enc = tok(rows, truncation=True, max_length=max_length)
        return datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})

    # two consent groups, half each, assigned at random: epsilon 1 and epsilon 8
    budgets = Budgets.from_groups([1.0, 8.0], [0.5, 0.5], len(train_texts), delta=1e-5, seed=args.seed)
    targs = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=8 if tiny else 32,
        gradient_accumulation_steps=1 if tiny else 2,
        num_train_epochs=args.epochs or (1 if tiny else 3),
        learning_rate=1e-2 if tiny else 2e-3,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        save_strategy="no",
        logging_strategy="epoch",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=args.seed,
    )
    trainer = IndividualizedTrainer(
        model=model,
        args=targs,
        train_dataset=encode(train_texts),
        eval_dataset=encode(test_texts),
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        privacy=PrivacyArguments(budgets=budgets, method="scale", seed=args.seed, overwrite=True),
        dataset_name=Path(args.data).name if args.data else "synthetic sentences",
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    report = trainer.report
    print(
        f"{report['model']}: {report['steps']} DP-SGD steps (Scale, expected batch {report['batch_size']}, "
        f"clip norm {report['clip_norm']:g}, noise multiplier {report['noise_multiplier']:.3f})"
    )
    for g in report["groups"]:
        print(
            f"  group with budget {g['budget']:g}: {g['count']} texts, epsilon spent {g['epsilon_spent']:.3f} "
            f"(delta {g['delta']:g}), clip norm {g['clip_norm']:.3f}"
        )
    ppl = report["test_metrics"]["test_perplexity"]
    print(
        f"test perplexity {ppl:.2f} on {report['test_metrics']['test_examples']} held-out texts "
        f"(uniform over the vocabulary: {len(tok)})"
    )
    print(f"run folder: {args.out} (model/, report.html; private/ holds the per-example values)")
    if not math.isfinite(ppl):
        sys.exit("the test perplexity is not finite")
    return report


if __name__ == "__main__":
    main()
