"""The write guard's cost per logical step (issue 35): snapshot with the value fingerprint + compare
(``idpsgd.engine.guards.integrity``), the fingerprint of the parameters alone, and one book-keeping step, for
one model and optimizer, in CPU seconds of one torch thread (on a shared machine CPU time measures the
work).  One tree (the one on ``PYTHONPATH``), or several side by side: a fresh process per tree and
round, rounds interleaved (order reversed every other round), medians over the rounds::

    python bench/guard_cost.py transformer|cifar_cnn|wrn16_4 sgd|sgdm|adam
    python bench/guard_cost.py transformer adam --src /path/to/base/src --src src [--rounds 3]
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


def main(name: str, opt_name: str) -> dict:
    torch.set_num_threads(1)
    x, y, model = build(name)
    n = x.shape[0]
    if opt_name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if opt_name == "sgdm" else 0.0)
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
        "guard_ms": round(cpu_ms(guard, 15), 2),
        "fingerprint_parameters_ms": round(cpu_ms(lambda: integrity._fingerprint(params), 15), 2),
        "bk_step_ms": round(cpu_ms(step, 6), 1),
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
    keys = ("guard_ms", "fingerprint_parameters_ms", "bk_step_ms")
    return {
        src: {**runs[0], **{k: statistics.median(run[k] for run in runs) for k in keys}, "rounds": runs}
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
            rounds = ", ".join(str(r["guard_ms"]) for r in fig["rounds"])
            print(
                f"{src}: guard {fig['guard_ms']:.2f} ms (rounds {rounds}), fingerprint of the parameters "
                f"{fig['fingerprint_parameters_ms']:.2f} ms, bk step {fig['bk_step_ms']:.1f} ms"
            )
