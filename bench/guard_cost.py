"""The write guard's cost per logical step (issue 35): snapshot with the value fingerprint + compare
(``idpsgd.engine.guards.integrity``), the fingerprint of the parameters alone, and one book-keeping step, for
one model and optimizer, in CPU seconds of one torch thread (on a shared machine CPU time measures the
work).  One tree (the one on ``PYTHONPATH``), or several side by side: a fresh process per tree and
round, rounds interleaved (order reversed every other round), medians over the rounds::

    python bench/guard_cost.py transformer|cifar_cnn|wrn16_4|gpt2_12x64|gpt2_small sgd|sgdm|adam
    python bench/guard_cost.py transformer adam --src /path/to/base/src --src src [--rounds 3]

``guard_step_ms`` is the guard's whole work in one logical step in steady state (the snapshot at the step's end,
the fingerprinted one at the first forward, the comparison before the noise); ``guard_ms`` one fingerprinted
snapshot and its comparison.  ``gpt2_12x64``: GPT-2's 12 blocks at width 64, vocabulary and positions 128 —
GPT-2 small's 148 tensors (444 with Adam's state), 0.6 M parameters: mostly the guard's Python work;
``gpt2_small``: 12 × 768 (124 M parameters), where the reads dominate.  The GPT-2 models take no private step
(no ``bk_step_ms``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from idpsgd.engine import IndividualizedPrivacyEngine
from idpsgd.engine.guards import integrity
from idpsgd.models import TransformerClassifier, create_model, wide_resnet


def build(name: str):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "transformer":
        model = TransformerClassifier(10_000, 2, max_length=64, dim=128, heads=4, layers=2, ff_dim=256)
        return torch.randint(0, 10_000, (32, 64), generator=g), torch.randint(0, 2, (32,), generator=g), model
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    if name == "wrn16_4":
        return x[:8], y[:8], wide_resnet((3, 32, 32), 10, depth=16, width=4)
    if name == "cifar_cnn":
        return x, y, create_model("tramer_boneh_cifar10", (3, 32, 32), 10)
    raise SystemExit(f"unknown model {name!r}")


def cpu_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def gpt2(width: int, vocab: int, positions: int):
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        heads = 12 if width % 12 == 0 else 4
        config = GPT2Config(n_layer=12, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions)
        return GPT2LMHeadModel(config).train()


def main(name: str, opt_name: str) -> dict:
    torch.set_num_threads(1)
    if name.startswith("gpt2"):
        return main_gpt2(name, opt_name)
    x, y, model = build(name)
    n = x.shape[0]
    opt = optimizer(model, opt_name)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    module, dp_opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=opt,
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=n),
        budgets=np.full(n, 1e3),
        target_delta=1e-5,
        sample_rates=np.ones(n),
        clip_norms=np.ones(n),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="bk",
        privacy_filter=None,
    )

    def step():
        for xb, yb in loader:
            dp_opt.zero_grad()
            torch.nn.functional.cross_entropy(module(xb), yb).backward()
            dp_opt.step()

    for _ in range(2):  # the optimizer's state exists from here on
        step()
    watches_optimizer = "optimizer" in integrity._Snapshot.take.__code__.co_varnames  # (older trees do not)

    def guard():
        if watches_optimizer:
            assert not integrity._Snapshot.take(model, True, opt).changes(model, opt)
        else:
            assert not integrity._Snapshot.take(model, True).changes(model)

    params = list(model.parameters())
    return {
        "model": name,
        "optimizer": opt_name,
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "guard_step_ms": round(cpu_ms(guard_step(integrity.WriteGuard.attach(model)), 15), 2),
        "guard_ms": round(cpu_ms(guard, 15), 2),
        "fingerprint_parameters_ms": round(cpu_ms(lambda: integrity._fingerprint(params), 15), 2),
        "bk_step_ms": round(cpu_ms(step, 6), 1),
    }


def optimizer(model, opt_name: str):
    if opt_name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if opt_name == "sgdm" else 0.0)


def guard_step(guard):
    """One logical step of the guard's work, in steady state (the first call warms it up)."""

    def run():
        guard.arm()
        guard._first_forward()
        guard.check()

    run()
    return run


def main_gpt2(name: str, opt_name: str) -> dict:
    """The guard on a GPT-2 LM and its optimizer's state, without a private step."""
    model = gpt2(*{"gpt2_12x64": (64, 128, 128), "gpt2_small": (768, 50257, 1024)}[name])
    opt = optimizer(model, opt_name)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the optimizer's state exists
    guard = integrity.WriteGuard.attach(model)
    guard.watch_too(opt, None)
    params = list(model.parameters())
    reps = 15 if name == "gpt2_12x64" else 3
    return {
        "model": name,
        "optimizer": opt_name,
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "guard_step_ms": round(cpu_ms(guard_step(guard), reps), 2),
        "guard_ms": round(cpu_ms(lambda: integrity._Snapshot.take(model, True, opt).changes(model, opt), reps), 2),
        "fingerprint_parameters_ms": round(cpu_ms(lambda: integrity._fingerprint(params), reps), 2),
        "bk_step_ms": None,
    }


def side_by_side(name: str, opt_name: str, srcs: list[str], rounds: int) -> dict:
    """Each tree's figures in fresh processes, rounds interleaved; the median of each figure over the rounds."""
    got: dict = {s: [] for s in srcs}
    for r in range(rounds):
        for src in srcs if r % 2 == 0 else srcs[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_NUM_THREADS": "1"}
            out = subprocess.run(
                [sys.executable, __file__, name, opt_name], env=env, capture_output=True, text=True, check=True
            ).stdout
            got[src].append(json.loads(out.strip().splitlines()[-1]))
    keys = ("guard_step_ms", "guard_ms", "fingerprint_parameters_ms", "bk_step_ms")
    return {
        src: {
            **runs[0],
            **{k: statistics.median(run[k] for run in runs) if runs[0][k] is not None else None for k in keys},
            "rounds": runs,
        }
        for src, runs in got.items()
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="transformer")
    p.add_argument("optimizer", nargs="?", default="sgd")
    p.add_argument("--src", action="append", help="a source tree (its idpsgd package), side by side; give two")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if not a.src:
        print(json.dumps(main(a.model, a.optimizer)))
    else:
        for src, fig in side_by_side(a.model, a.optimizer, a.src, a.rounds).items():
            rounds = ", ".join(str(r["guard_step_ms"]) for r in fig["rounds"])
            step = "" if fig["bk_step_ms"] is None else f", bk step {fig['bk_step_ms']:.1f} ms"
            print(
                f"{src}: guard per step {fig['guard_step_ms']:.2f} ms (rounds {rounds}), snapshot + compare "
                f"{fig['guard_ms']:.2f} ms, fingerprint of the parameters {fig['fingerprint_parameters_ms']:.2f} ms"
                f"{step}; load {os.getloadavg()[0]:.1f}"
            )
