"""Peak memory of one private Trainer step with and without gradient (activation) checkpointing
(issue 40): a Llama-style causal LM built from a config (no download), one DP-SGD step at sampling rate 1
on B random sequences of T tokens, in a fresh process per setting.

CPU: the rise of the process's peak resident memory (``ru_maxrss``) during ``train()`` over its peak
before it (the model, data and libraries are loaded by then); CUDA: ``torch.cuda.max_memory_allocated``
during ``train()``.  Run::

    PYTHONPATH=src python bench/hf_checkpointing_memory.py            # CPU
    PYTHONPATH=src python bench/hf_checkpointing_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile


def one(mode: str, checkpointing: bool, device: str, batch: int, tokens: int, layers: int, hidden: int) -> dict:
    import datasets
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments, default_data_collator

    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=tokens,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = np.random.default_rng(0).integers(0, 1000, size=(batch, tokens))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "epsilon": [4.0] * batch})
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=f"{out}/run",
            per_device_train_batch_size=batch,
            max_steps=1,
            save_strategy="no",
            use_cpu=device == "cpu",
            report_to=[],
            disable_tqdm=True,
            gradient_checkpointing=checkpointing,
        )
        t = IndividualizedTrainer(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=default_data_collator,
            privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="uniform", seed=0, grad_sample_mode=mode),
        )
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t.train()
        if device == "cuda":
            peak_mib = (torch.cuda.max_memory_allocated() - start) / 2**20
        else:
            peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux
    return {"mode": mode, "checkpointing": checkpointing, "device": device, "peak_rise_mib": round(peak_mib, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--one", nargs=2, metavar=("MODE", "CHECKPOINTING"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1] == "1", a.device, a.batch, a.tokens, a.layers, a.hidden)))
        return
    rows = []
    for mode in ("bk", "hooks"):
        for ckpt in ("0", "1"):
            argv = [sys.executable, __file__, "--one", mode, ckpt, "--device", a.device]
            argv += ["--batch", str(a.batch), "--tokens", str(a.tokens), "--layers", str(a.layers)]
            argv += ["--hidden", str(a.hidden)]
            proc = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    for mode in ("bk", "hooks"):
        off, on = (r["peak_rise_mib"] for r in rows if r["mode"] == mode)
        print(f"{mode}: peak rise {off:.0f} MiB without, {on:.0f} MiB with checkpointing ({1 - on / off:.0%} less)")


if __name__ == "__main__":
    main()
