"""Private against non-private, step by step in one process (issue 50): the CIFAR-shaped CNN (B = 256) or a GPT-2
LM (12 × 768, T 128, B 16; ``gpt2_lora``: with LoRA r 8), one non-private step and one book-keeping step in turn
(order reversed every other pair), CPU time of one torch thread per step.

The fresh-process benches (``bench_engine.py``, ``bench_hf.py``) time whole runs a few rounds apart; on this shared
machine their rounds move by ±10 %.  Here the two models live in one process and alternate step by step, so a
slow minute hits both alike.  The private model trains through ``make_private`` (Scale, the demo's budgets,
Poisson batches, bk); both see the same data.  Reported: total CPU seconds over total examples per configuration
(the engine's seed fixes the Poisson batches, so two trees see the same sizes) and the median of the per-step
seconds per example, each with its ratio; ``--ghost-unfold`` adds a third configuration, bk with every
convolution's ghost norm from unfolded patches (the path before the pixels' Gram matrix), for a side-by-side.

Usage::

    python bench/interleaved_steps.py cnn [--steps 40] [--ghost-unfold]
    python bench/interleaved_steps.py gpt2 [--steps 8] [--layers 12]
    python bench/interleaved_steps.py gpt2_lora [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings


def _forever(loader):
    while True:
        yield from loader


def _timed(it, run):
    """A step function: the next batch (not timed), then ``run(batch)`` timed; (CPU seconds, examples)."""

    def step():
        batch = next(it)
        start = time.process_time()
        run(batch)
        return time.process_time() - start, len(batch[0])

    return step


def cnn_steps(n: int = 2560, batch: int = 256):
    """(model factory, data, batch size, loss, trainable parameters, optimizer settings) of the CIFAR-shaped CNN on
    random CIFAR-shaped tensors; SGD with momentum 0.9 as ``bench_engine.py``."""
    import torch
    from torch import nn

    from idpsgd.models import create_model

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )

    def model():
        torch.manual_seed(0)
        return create_model("tramer_boneh_cifar10", (3, 32, 32), 10)

    def loss(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    return model, data, batch, loss, lambda m: m.parameters(), {"lr": 0.05, "momentum": 0.9}


def gpt2_steps(
    layers: int = 12,
    batch: int = 16,
    seq: int = 128,
    lora: bool = False,
    quick: bool = False,
    width: int | None = None,
    vocab: int | None = None,
):
    """The same for a GPT-2 LM (bench_hf's shape; ``quick``: 32 wide, vocabulary 256; ``width``/``vocab``: another
    width (heads of 16) and vocabulary), each example's mean token loss, averaged; plain SGD as ``bench_hf.py``
    (momentum would add a parameter-sized state that the write guard reads twice per step)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd.integrations.hf.losses import PerExampleLoss

    n, vocab = 16 * batch, vocab or (256 if quick else 50257)
    data = torch.utils.data.TensorDataset(torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0)))
    shape = {"n_embd": width, "n_head": max(1, width // 16)} if width else {"n_embd": 32, "n_head": 2} if quick else {}
    per_example = PerExampleLoss("causal_lm")

    def model():
        torch.manual_seed(0)
        m = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=max(seq, 1024), vocab_size=vocab, **shape))
        if lora:
            from peft import LoraConfig, get_peft_model

            m = get_peft_model(m, LoraConfig(r=8, task_type="CAUSAL_LM"))
        return m.train()

    def loss(m, b):
        return per_example(m(input_ids=b[0]), b[0]).mean()

    return model, data, batch, loss, lambda m: [p for p in m.parameters() if p.requires_grad], {"lr": 1e-3}


def private_training(model, data, batch: int, trainable, sgd: dict):
    """(module, optimizer, loader) of ``model`` trained through ``make_private``: Scale, the demo's budgets, Poisson
    batches of expected size ``batch``, bk, plain SGD with ``sgd``'s settings, the engine's seed 0."""
    import torch

    from idpsgd.cli.train_commands import demo_budgets
    from idpsgd.engine import IndividualizedPrivacyEngine

    n = len(data)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(trainable(model), **sgd),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch),
        budgets=demo_budgets(n, 1e-5, 0),
        method="scale",
        steps=10_000,
        max_grad_norm=1.0,
        sample_rate=batch / n,
        grad_sample_mode="bk",
    )


def configurations(model, data, batch, loss, trainable, sgd: dict, ghost_unfold: bool) -> dict:
    """name -> step function: ``nonprivate``, ``bk`` (and ``bk_unfold``)."""
    import torch

    from idpsgd.engine.per_example.bk.rules.conv import ConvRule

    m = model()
    opt = torch.optim.SGD(trainable(m), **sgd)
    shuffled = torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )

    def nonprivate_step(b):
        opt.zero_grad(set_to_none=True)
        loss(m, b).backward()
        opt.step()

    out = {"nonprivate": _timed(_forever(shuffled), nonprivate_step)}

    def private():
        module, popt, loader = private_training(model(), data, batch, trainable, sgd)

        def step(b):
            popt.zero_grad(set_to_none=True)
            if len(b[0]):
                loss(module, b).backward()
            popt.step()

        return _timed(_forever(loader), step)

    pixels = ConvRule._pixels

    def with_pixels(step, on: bool):
        def run():
            ConvRule._pixels = pixels if on else (lambda *_: 0)
            try:
                return step()
            finally:
                ConvRule._pixels = pixels

        return run

    out["bk"] = private()
    if ghost_unfold:
        out["bk_unfold"] = with_pixels(private(), False)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("cnn", "gpt2", "gpt2_lora"))
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (CNN 40, GPT-2 8)")
    ap.add_argument("--warm", type=int, default=2, help="untimed steps per configuration first (default 2)")
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (default 12)")
    ap.add_argument("--ghost-unfold", action="store_true", help="also bk with convolution ghost norms by unfolding")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a test of the script, not a measurement)")
    a = ap.parse_args(argv)
    import torch

    from idpsgd.validation import InvalidParameterError

    steps = a.steps if a.steps is not None else (40 if a.model == "cnn" else 8)
    if steps < 1 or a.warm < 0:
        raise InvalidParameterError("steps", steps, "must be an integer >= 1 (and --warm >= 0)")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if a.model == "cnn":
        spec = cnn_steps(64, 16) if a.quick else cnn_steps()
    else:
        spec = gpt2_steps(
            1 if a.quick else a.layers,
            4 if a.quick else 16,
            16 if a.quick else 128,
            lora=a.model == "gpt2_lora",
            quick=a.quick,
        )
    runs = configurations(*spec, ghost_unfold=a.ghost_unfold)
    load_before = os.getloadavg()[0]
    for step in runs.values():
        for _ in range(a.warm):
            step()
    got: dict = {k: [] for k in runs}
    names = list(runs)
    for r in range(steps):
        for k in names if r % 2 == 0 else names[::-1]:
            got[k].append(runs[k]())
    total = {k: sum(t for t, _ in v) / max(1, sum(b for _, b in v)) for k, v in got.items()}
    median = {k: statistics.median(t / max(b, 1) for t, b in v) for k, v in got.items()}
    result = {
        "model": a.model,
        "steps": steps,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "cpu_ms_per_example_total": {k: 1e3 * v for k, v in total.items()},
        "cpu_ms_per_example_median": {k: 1e3 * v for k, v in median.items()},
        "ratio_total": {k: v / total["nonprivate"] for k, v in total.items()},
        "ratio_median": {k: v / median["nonprivate"] for k, v in median.items()},
    }
    return report(result, a.out)


def report(result: dict, out: str | None) -> dict:
    """Print ``result`` as JSON and write it to ``out`` (atomically) when given; returns it."""
    if out:
        from idpsgd.io import write_json

        write_json(out, result)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
