"""The per-step host work of a private step (issue 50): what a GPU cannot hide.

On a GPU a GPT-2-small step is milliseconds to tens of milliseconds of kernels, and the host (Python, dispatch, our
book-keeping, the guard, the noise loop) must keep ahead of them; what the host does on top of a non-private step is
then the private step's extra time. This CPU bench measures that host work on a model so small that its kernels cost
little: GPT-2's 12 blocks at width 64 (vocabulary 128, T 16, Poisson batches of expected size 4; ``--lora``: with
LoRA r 8), one non-private and one book-keeping step in turn in one process (order reversed every other pair), CPU
milliseconds of one torch thread per phase — forward, backward, optimizer step — medians over the timed steps, after
warm-up steps that cover the Poisson batch sizes (each is traced once by provenance, then replayed). The
book-keeping optimizer step is split further: the per-example norms, the clipped sum, the step's admission (the
write guard's comparison, the checks) and the noise, means over the timed steps (an empty Poisson batch has no
norms); the rest of the optimizer step's mean (Opacus's optimizer, the accounting, the guard's snapshot at the
step's end) is ``other``.

Usage::

    python bench/host_overhead.py [--lora] [--steps 80] [--warm 150] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the book-keeping optimizer step's parts, timed by wrapping these methods (owner, attribute, name)
PARTS = (("keeper", "norms", "norms"), ("keeper", "clipped_sum", "clipped_sum"))
OPTIMIZER_PARTS = (("_admit_step", "admission"), ("_draw_noise", "noise"))


def _timed(record: dict, name: str, fn):
    def run(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            record.setdefault(name, []).append(time.process_time() - start)

    return run


def measure(lora: bool = False, steps: int = 80, warm: int = 150, quick: bool = False) -> dict:
    import torch

    from idpsgd.engine.per_example.bk.keeper import BookKeeper
    from interleaved_steps import _forever, gpt2_steps, private_training

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    layers, width = (2, 32) if quick else (12, 64)
    model, data, batch, loss, trainable, sgd = gpt2_steps(layers, 4, 16, lora=lora, width=width, vocab=128)
    plain = model()
    runs = {"nonprivate": (plain, torch.optim.SGD(trainable(plain), **sgd))}
    shuffled = torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    private = model()
    module, optimizer, loader = private_training(private, data, batch, trainable, sgd)
    runs["bk"] = (module, optimizer)
    batches = {"nonprivate": _forever(shuffled), "bk": _forever(loader)}
    parts: dict = {}
    keeper = BookKeeper.attach(private)
    for _, attr, name in PARTS:
        setattr(keeper, attr, _timed(parts, name, getattr(keeper, attr)))
    for attr, name in OPTIMIZER_PARTS:
        setattr(optimizer, attr, _timed(parts, name, getattr(optimizer, attr)))

    def step(name):
        m, opt = runs[name]
        b = next(batches[name])
        t0 = time.process_time()
        opt.zero_grad(set_to_none=True)
        out = loss(m, b) if len(b[0]) else None  # an empty Poisson batch: the noise-only step
        t1 = time.process_time()
        if out is not None:
            out.backward()
        t2 = time.process_time()
        opt.step()
        return t1 - t0, t2 - t1, time.process_time() - t2

    for _ in range(warm):
        for name in runs:
            step(name)
    parts.clear()
    got: dict = {name: [] for name in runs}
    load = os.getloadavg()[0]
    for r in range(steps):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            got[name].append(step(name))
    ms = {
        name: {
            phase: 1e3 * statistics.median(t[i] for t in v)
            for i, phase in enumerate(("forward", "backward", "optimizer"))
        }
        for name, v in got.items()
    }
    for name, v in got.items():
        ms[name]["step"] = 1e3 * statistics.median(sum(t) for t in v)
    split = {k: 1e3 * sum(v) / steps for k, v in parts.items()}  # means: a part can be absent from a step
    split["other"] = 1e3 * sum(t[2] for t in got["bk"]) / steps - sum(split.values())  # of the optimizer step's mean
    return {
        "model": f"GPT-2 {layers} x {width}, vocabulary 128, T 16, B 4" + (", LoRA r 8" if lora else ""),
        "steps": steps,
        "load_avg_1min": [load, os.getloadavg()[0]],
        "cpu_ms_median": ms,
        "extra_ms": {phase: ms["bk"][phase] - ms["nonprivate"][phase] for phase in ms["bk"]},
        "ratio": ms["bk"]["step"] / ms["nonprivate"]["step"],
        "bk_optimizer_ms_mean": split,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora", action="store_true", help="GPT-2 with LoRA r 8 (peft)")
    ap.add_argument("--steps", type=int, default=80, help="timed steps per configuration (default 80)")
    ap.add_argument("--warm", type=int, default=150, help="untimed steps per configuration first (default 150)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--quick", action="store_true", help="2 blocks at width 32 (a test of the script)")
    a = ap.parse_args(argv)
    from idpsgd.validation import InvalidParameterError

    if a.steps < 1 or a.warm < 0:
        raise InvalidParameterError("steps", a.steps, "must be an integer >= 1 (and --warm >= 0)")
    from interleaved_steps import report

    return report(measure(a.lora, a.steps, a.warm, a.quick), a.out)


if __name__ == "__main__":
    main()
