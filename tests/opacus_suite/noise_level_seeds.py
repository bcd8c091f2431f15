"""Opacus's ``PrivacyEngineCustomLayerTest::test_noise_level`` over many torch seeds, for both engines.

The test asks the noise norm after 3 steps (~100 parameters, zero gradients) to lie within 15 % of
its expectation for one fixed seed. This script repeats it over ``--seeds`` seeds and prints, per
engine, the mean and standard deviation of the ratio and how many seeds pass — the evidence behind
its entry in ``allowed_other.txt``. Run after ``make test-opacus`` (torchvision in ``.opacus-suite``)::

    .venv/bin/python tests/opacus_suite/noise_level_seeds.py [--seeds 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def ratio(
    engine_cls, seed: int, steps: int = 3, sigma: float = 1.0, lr: float = 2.0, batch: int = 64, wrap_model: bool = True
) -> float:
    """Noise norm² over its expectation steps·n·σ²·lr²/B², as the Opacus test computes it (``wrap_model=False``:
    its ``PrivacyEngineCustomLayerHooksTest`` variant, the user's module with Opacus 1.6's hooks)."""
    import torch
    from opacus.tests.privacy_engine_test import ModelWithCustomLinear
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(512, 4), torch.randint(0, 3, (512,)))
    model = ModelWithCustomLinear()
    engine = engine_cls()
    wrapped, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        wrap_model=wrap_model,
    )
    if wrap_model:
        model = wrapped
    for p in model.parameters():
        p.data.zero_()
    taken = 0
    for x, _ in loader:
        opt.zero_grad()
        logits = model(x)
        logits.view(logits.size(0), -1).sum(1).backward(torch.zeros(logits.size(0)))
        opt.step()
        taken += 1
        if taken >= steps:
            break
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = taken * n * sigma**2 * lr**2 / opt.expected_batch_size**2
    return sum(float((p.data**2).sum()) for p in model.parameters()) / expected


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40, help="torch seeds to try (default 40)")
    p.add_argument("--site", default=str(HERE.parents[1] / ".opacus-suite"), help="where torchvision is installed")
    p.add_argument("--unwrapped", action="store_true", help="the wrap_model=False variant (...HooksTest)")
    args = p.parse_args(argv)
    sys.path[:0] = [args.site, str(HERE)]
    warnings.simplefilter("ignore")
    import harness
    from opacus import PrivacyEngine

    from idpsgd import IndividualizedPrivacyEngine

    harness.import_torchvision()
    for cls in (IndividualizedPrivacyEngine, PrivacyEngine):
        r = [ratio(cls, s, wrap_model=not args.unwrapped) for s in range(args.seeds)]
        within = sum(abs(x - 1) <= 0.15 for x in r)
        print(
            f"{cls.__name__}: ratio {statistics.mean(r):.3f} ± {statistics.stdev(r):.3f}, {within}/{len(r)} within 15 %"
        )


if __name__ == "__main__":
    main()
