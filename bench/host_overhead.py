"""The per-step host work of a private step (issue 50): what a GPU cannot hide.

On a GPU a GPT-2-small step is milliseconds to tens of milliseconds of kernels, and the host (Python, dispatch, our
book-keeping, the guard, the noise loop) must keep ahead of them; what the host does on top of a non-private step is
then the private step's extra time. This bench measures that host work on a model so small that its kernels cost
little: GPT-2's 12 blocks at width 64 (vocabulary 128, T 16, Poisson batches of expected size 4; ``--lora``: with
LoRA r 8), one non-private and one book-keeping step in turn in one process (order reversed every other pair),
milliseconds per phase — forward, backward, optimizer step — medians over the timed steps, after warm-up steps that
cover the Poisson batch sizes (each is traced once by provenance, then replayed). The book-keeping optimizer step is
split further: the per-example norms, the clipped sum, the step's admission (the write guard's comparison, the
checks) and the noise, means over the timed steps (an empty Poisson batch has no norms); the rest of the optimizer
step's mean (Opacus's optimizer, the accounting, the guard's snapshot at the step's end) is ``other``.

The clock: on the CPU, CPU time of one torch thread; on CUDA (``--device cuda``), wall time with the device
synchronised at every phase boundary, and then a few more steps of each configuration under ``torch.profiler``
give the kernels' time per step, ``device_ms_median``, and ``busy`` = kernel time / wall time of a step: near 1
the step is the GPU's work, well below 1 the host keeps the GPU waiting (what batching the book-keeping's
per-layer work, or CUDA graphs, would win). ``--full``: GPT-2 small itself (12 x 768, vocabulary 50,257, T 128,
B 16), where ``ms_per_example`` (total time over total examples: the Poisson batches vary) is the ratio to read.

Usage::

    python bench/host_overhead.py [--lora] [--steps 80] [--warm 150] [--out FILE]
    python bench/host_overhead.py --device cuda --full [--lora] --steps 20 --warm 6   # on a GPU (bench/gpu.sh)
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
PHASES = ("forward", "backward", "optimizer")


def _clock(device: str):
    """A clock in seconds: CPU time of this process on the CPU; on CUDA wall time after the device's queue
    has drained (every reading synchronises)."""
    if device == "cpu":
        return time.process_time
    import torch

    def now():
        torch.cuda.synchronize()
        return time.perf_counter()

    return now


def _timed(record: dict, name: str, fn, clock):
    def run(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            record.setdefault(name, []).append(clock() - start)

    return run


def _kernel_ms(step, count: int) -> list[float]:
    """Milliseconds of CUDA kernels per step over ``count`` profiled steps: the device events' own time, summed
    as torch.profiler's table sums its "Self CUDA time total" (a CPU operation's device time is its kernels',
    already counted as device events)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out = []
    for _ in range(count):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        kernels = [
            e for e in prof.events() if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        out.append(sum(e.self_device_time_total for e in kernels) / 1e3)
    return out


def measure(
    lora: bool = False,
    steps: int = 80,
    warm: int = 150,
    quick: bool = False,
    device: str = "cpu",
    full: bool = False,
    profiled: int = 3,
) -> dict:
    import torch

    from idpsgd.engine.per_example.bk.keeper import BookKeeper
    from interleaved_steps import _forever, gpt2_steps, private_training

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if full:
        shape, what = gpt2_steps(12, 16, 128, lora=lora), "GPT-2 small (12 x 768, vocabulary 50,257), T 128, B 16"
    else:
        layers, width = (2, 32) if quick else (12, 64)
        shape = gpt2_steps(layers, 4, 16, lora=lora, width=width, vocab=128)
        what = f"GPT-2 {layers} x {width}, vocabulary 128, T 16, B 4"
    model, data, batch, loss, trainable, sgd = shape
    clock = _clock(device)
    plain = model().to(device)
    runs = {"nonprivate": (plain, torch.optim.SGD(trainable(plain), **sgd))}
    shuffled = torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    private = model().to(device)
    module, optimizer, loader = private_training(private, data, batch, trainable, sgd)
    runs["bk"] = (module, optimizer)
    batches = {"nonprivate": _forever(shuffled), "bk": _forever(loader)}
    parts: dict = {}
    keeper = BookKeeper.attach(private)
    for _, attr, name in PARTS:
        setattr(keeper, attr, _timed(parts, name, getattr(keeper, attr), clock))
    for attr, name in OPTIMIZER_PARTS:
        setattr(optimizer, attr, _timed(parts, name, getattr(optimizer, attr), clock))

    def step(name):
        m, opt = runs[name]
        b = [t.to(device) for t in next(batches[name])]
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        out = loss(m, b) if len(b[0]) else None  # an empty Poisson batch: the noise-only step
        t1 = clock()
        if out is not None:
            out.backward()
        t2 = clock()
        opt.step()
        return t1 - t0, t2 - t1, clock() - t2, len(b[0])

    for _ in range(warm):
        for name in runs:
            step(name)
    parts.clear()
    got: dict = {name: [] for name in runs}
    load = os.getloadavg()[0]
    for r in range(steps):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            got[name].append(step(name))
    ms = {name: {p: 1e3 * statistics.median(t[i] for t in v) for i, p in enumerate(PHASES)} for name, v in got.items()}
    for name, v in got.items():
        ms[name]["step"] = 1e3 * statistics.median(sum(t[:3]) for t in v)
    per_example = {name: 1e3 * sum(sum(t[:3]) for t in v) / max(1, sum(t[3] for t in v)) for name, v in got.items()}
    split = {k: 1e3 * sum(v) / steps for k, v in parts.items()}  # means: a part can be absent from a step
    split["other"] = 1e3 * sum(t[2] for t in got["bk"]) / steps - sum(split.values())  # of the optimizer step's mean
    result = {
        "model": what + (", LoRA r 8" if lora else ""),
        "device": device,
        "clock": "CPU time of one torch thread" if device == "cpu" else "wall time, the device synchronised",
        "steps": steps,
        "load_avg_1min": [load, os.getloadavg()[0]],
        "ms_median": ms,
        "extra_ms": {phase: ms["bk"][phase] - ms["nonprivate"][phase] for phase in ms["bk"]},
        "ratio": ms["bk"]["step"] / ms["nonprivate"]["step"],
        "ms_per_example": per_example,
        "ratio_per_example": per_example["bk"] / per_example["nonprivate"],
        "bk_optimizer_ms_mean": split,
    }
    if device == "cuda" and profiled:
        kernels = {name: statistics.median(_kernel_ms(lambda n=name: step(n), profiled)) for name in runs}
        result["device_ms_median"] = kernels
        result["busy"] = {name: kernels[name] / ms[name]["step"] for name in runs}
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora", action="store_true", help="GPT-2 with LoRA r 8 (peft)")
    ap.add_argument("--steps", type=int, default=80, help="timed steps per configuration (default 80)")
    ap.add_argument("--warm", type=int, default=150, help="untimed steps per configuration first (default 150)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    ap.add_argument("--full", action="store_true", help="GPT-2 small itself (12 x 768, T 128, B 16)")
    ap.add_argument("--profiled", type=int, default=3, help="CUDA: steps per configuration under the profiler")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--quick", action="store_true", help="2 blocks at width 32 (a test of the script)")
    a = ap.parse_args(argv)
    from common import resolve_device
    from idpsgd.validation import InvalidParameterError

    if a.steps < 1 or a.warm < 0 or a.profiled < 0:
        raise InvalidParameterError("steps", a.steps, "must be an integer >= 1 (and --warm, --profiled >= 0)")
    if a.quick and a.full:
        raise InvalidParameterError("quick", True, "and --full are two sizes: give one")
    from interleaved_steps import report

    device = resolve_device(a.device)
    return report(measure(a.lora, a.steps, a.warm, a.quick, device, a.full, a.profiled), a.out)


if __name__ == "__main__":
    main()
