"""Training benchmarks: speed against Opacus, demo accuracy, individual-accounting overhead."""

from __future__ import annotations

import time

import numpy as np

from common import _demo_budgets, _digits_setup, _opacus_epochs, bench


@bench
def bench_train_speed():
    """Seconds per epoch on digits (digits_cnn, B=128): Sample and Scale (our whole loop: sampler,
    per-example clipping, privacy filter, ledger, per-epoch evaluation) against plain Opacus
    DP-SGD (PrivacyEngine with its Poisson DataLoader) with the same per-epoch evaluation."""
    import torch

    from idpsgd.training import TrainConfig, Trainer

    torch.set_num_threads(2)
    data, budgets = _digits_setup()
    epochs, repeat = 10, 3
    out = {"dataset": "digits", "epochs": epochs, "threads": torch.get_num_threads()}
    for method in ("sample", "scale"):
        best = float("inf")
        for _ in range(repeat):
            trainer = Trainer(data, budgets, TrainConfig(method=method, epochs=epochs, progress=False))
            t = time.perf_counter()
            trainer.run()
            best = min(best, time.perf_counter() - t)
        out[f"{method}_seconds_per_epoch"] = best / epochs
        sigma = trainer.plan.phases[0].assignment.noise_multiplier
    cfg = TrainConfig(epochs=epochs)
    out["opacus_seconds_per_epoch"] = min(_opacus_epochs(data, sigma, cfg, epochs) for _ in range(repeat)) / epochs
    for method in ("sample", "scale"):
        out[f"{method}_ratio"] = out[f"{method}_seconds_per_epoch"] / out["opacus_seconds_per_epoch"]
    out["target_ratio"] = 1.05
    return out


@bench
def bench_demo_accuracy():
    """Test accuracy on digits over 5 seeds for the demo's four runs (mean ± std)."""
    from idpsgd.assignment import Budgets
    from idpsgd.cli.train_commands import DEMO_RUNS
    from idpsgd.training import TrainConfig, train

    data, _ = _digits_setup()
    n = len(data.y_train)
    seeds = range(5)
    out = {"dataset": "digits", "seeds": list(seeds), "config": TrainConfig().__dict__ | {"progress": None}}
    for label, method, budgets, fractions in DEMO_RUNS:
        accs, spent = [], []
        for seed in seeds:
            b = _demo_budgets(n, seed) if fractions else Budgets.from_array([float(budgets)] * n, 1e-05)
            report = train(data, b, TrainConfig(method=method, seed=seed, progress=False))
            accs.append(report["test_accuracy"])
            spent.append([g["epsilon_spent"] for g in report["groups"]])
        out[label] = {
            "accuracy_mean": float(np.mean(accs)),
            "accuracy_std": float(np.std(accs)),
            "accuracies": accs,
            "max_epsilon_spent_per_group": np.max(spent, axis=0).tolist(),
        }
    return out


@bench
def bench_individual_overhead():
    """Whole-run time on digits (uniform ε = 3, 30 epochs) with individual accounting (one norm
    refresh per epoch, no validation subset, no output files) against the same run without it."""
    import torch

    from idpsgd.assignment import Budgets
    from idpsgd.training import TrainConfig, Trainer

    torch.set_num_threads(2)
    data, _ = _digits_setup()
    budgets = Budgets.from_array([3.0] * len(data.y_train), 1e-5)
    out = {"dataset": "digits", "epochs": 30, "target_ratio": 1.5, "repeats": 5}
    configs = (("plain", {}), ("individual", {"individual_accounting": True, "validate_subset": 0}))
    times = {label: [] for label, _ in configs}
    for _ in range(5):  # interleaved, best of 5: this machine's timings drift by ~15 %
        for label, extra in configs:
            trainer = Trainer(data, budgets, TrainConfig(method="uniform", progress=False, **extra))
            t = time.perf_counter()
            trainer.run()
            times[label].append(time.perf_counter() - t)
    for label, ts in times.items():
        out[f"{label}_seconds"] = min(ts)
    out["ratio"] = out["individual_seconds"] / out["plain_seconds"]
    return out
