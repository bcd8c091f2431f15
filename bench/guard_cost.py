"""The write guard's cost per logical step (issue 35): snapshot with the value fingerprint + compare
(``idpsgd.engine.guards.integrity``), the fingerprint of the parameters alone, and one book-keeping step, for
one model and optimizer, in CPU seconds of one torch thread (on a shared machine CPU time measures the
work).  Run it once per source tree to compare (``PYTHONPATH=<tree>/src``), in fresh processes::

    python bench/guard_cost.py transformer|cifar_cnn|wrn16_4 sgd|sgdm|adam
"""

from __future__ import annotations

import json
import statistics
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


if __name__ == "__main__":
    print(json.dumps(main(*(sys.argv[1:3] if len(sys.argv) > 2 else ("transformer", "sgd")))))
