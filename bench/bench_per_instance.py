"""Per-instance DP benchmarks (Thudi et al.): the clip-norm trade-off, the paper's regime, and the speed of
training many runs at once."""

from __future__ import annotations

import time

from common import bench

CLIP_NORMS = (0.3, 1.0, 3.0, 10.0)


@bench
def bench_per_instance_clip_sweep():
    """Clip norm C against test accuracy and per-instance RDP (both directions, sum rule, α = 8, ε = 10,
    expected batch 128, 30 epochs, 10 test-set targets x*, 2 runs per chain; lr = 0.05/C so the noise on
    each update, lr·σC/B, is the same at every C).  Ratios are rdp / data-independent RDP (estimates);
    ``median_upper_ratio`` is the median of the Hoeffding confidence upper bounds (prob. ≥ 0.95 per point)."""
    import numpy as np

    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance

    data = load_dataset("digits")
    points = np.sort(np.random.default_rng(0).choice(len(data.y_test), 10, replace=False))
    rows = []
    for c in CLIP_NORMS:
        t = time.perf_counter()
        s = run_per_instance(
            data,
            points,
            runs=2,
            alpha=8,
            config=TrainConfig(clip_norm=c, lr=0.05 / c, epochs=30, progress=False),
            epsilon=10.0,
        )
        rows.append(
            {
                "clip_norm": c,
                "lr": 0.05 / c,
                "test_accuracy": s["test_accuracy"],
                "median_ratio": s["median_ratio_to_baseline"],
                "p10_ratio": s["p10_ratio_to_baseline"],
                "median_upper_ratio": s["median_upper_ratio_to_baseline"],
                "share_points_below_baseline_late": s["share_points_below_baseline_late"],
                "seconds": time.perf_counter() - t,
            }
        )
    return {
        "dataset": "digits",
        "alpha": 8,
        "epsilon": 10.0,
        "batch_size": 128,
        "epochs": 30,
        "points": 10,
        "runs_per_chain": 2,
        "target_set": "test",
        "sweep": rows,
    }


#: (label, expected batch, alpha, model, lr, momentum): the settings of issue 25 and the paper's regime
REGIMES = (
    ("B=128, alpha=8 (the earlier README setting)", 128, 8.0, None, 0.05, 0.9),
    ("B=128, auto alpha", 128, None, None, 0.05, 0.9),
    ("B=3 (q=0.002), auto alpha, mlp", 3, None, "mlp", 0.03, 0.0),
    ("B=3 (q=0.002), alpha=8, mlp", 3, 8.0, "mlp", 0.03, 0.0),
)


@bench
def bench_per_instance_regimes():
    """Per-instance RDP (sum rule, ε = 10, C = 1, 10 epochs, 10 test-set targets, 2 runs per chain, sensitivities
    every 5 steps) in the earlier setting (B = 128, α = 8) and in the paper's regime (q ≈ 0.002: B = 3 on digits),
    at α = 8 and at the order minimising the data-independent ε.  Per regime: test accuracy, the late-training
    per-step contribution / per-step baseline (median over points, both directions), Thm. 3.2 alone at the
    measured sensitivities (no composition), the composed ratio to the data-independent RDP and to the same
    composition at sensitivity C (all estimates), and seconds."""
    import numpy as np

    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig
    from idpsgd.training.per_instance import run_per_instance

    data = load_dataset("digits")
    points = np.sort(np.random.default_rng(0).choice(len(data.y_test), 10, replace=False))
    rows = []
    for label, batch, alpha, model, lr, momentum in REGIMES:
        t = time.perf_counter()
        cfg = TrainConfig(batch_size=batch, epochs=10, lr=lr, momentum=momentum, model=model, seed=0, progress=False)
        s = run_per_instance(data, points, runs=2, alpha=alpha, config=cfg, epsilon=10.0, checkpoint_every=5)
        rows.append(
            {
                "regime": label,
                "alpha": s["alpha"],
                "sample_rate": s["sample_rate"],
                "noise_multiplier": s["noise_multiplier"],
                "steps": s["steps"],
                "test_accuracy": s["test_accuracy"],
                "baseline_step_rdp": s["baseline_step_rdp"],
                "data_independent_rdp_at_alpha": s["baseline_rdp"],
                "median_late_step_ratio_add": s["median_late_step_ratio_add"],
                "median_late_step_ratio_remove": s["median_late_step_ratio_remove"],
                "median_late_thm32_ratio": s["median_late_thm32_ratio"],
                "median_ratio_to_baseline": s["median_ratio_to_baseline"],
                "median_ratio_to_same_composition": s["median_ratio_to_same_composition"],
                "share_points_below_baseline_late": s["share_points_below_baseline_late"],
                "engine": s["engine"],
                "seconds": time.perf_counter() - t,
            }
        )
    return {"dataset": "digits", "epsilon": 10.0, "epochs": 10, "points": 10, "runs_per_chain": 2, "regimes": rows}


@bench
def bench_per_instance_engines():
    """Seconds per DP-SGD step on digits (q ≈ 0.002, expected batch 3, mlp): one Trainer run (Opacus hooks) against
    42 runs trained together (ParallelRuns, the per-instance analysis' runs: 2 runs per chain, 20 targets)."""
    import numpy as np
    import torch

    from idpsgd.assignment import Budgets
    from idpsgd.data import load_dataset
    from idpsgd.models import create_model
    from idpsgd.training import TrainConfig, Trainer
    from idpsgd.training.per_instance_runs import ParallelRuns

    data = load_dataset("digits")
    n = len(data.y_train)
    cfg = TrainConfig(
        method="uniform",
        epochs=1,
        batch_size=3,
        lr=0.03,
        momentum=0.0,
        model="mlp",
        seed=0,
        progress=False,
        grad_sample_mode="hooks",
    )
    trainer = Trainer(data, Budgets.from_array(np.full(n, 10.0), 1e-5), cfg)
    t = time.perf_counter()
    trainer.run()
    opacus = (time.perf_counter() - t) / trainer.plan.steps
    torch.manual_seed(0)
    pr = ParallelRuns(
        create_model("mlp", data.input_shape, data.num_classes),
        data.x_train,
        data.y_train,
        np.ones((42, n), bool),
        3 / n,
        0.477,
        1.0,
        3.0,
        0.03,
        0.0,
        seed=0,
    )
    t = time.perf_counter()
    for _ in range(200):
        pr.step()
    parallel = (time.perf_counter() - t) / 200
    return {
        "opacus_seconds_per_step_one_run": opacus,
        "parallel_seconds_per_step_42_runs": parallel,
        "speed_up_per_run_step": 42 * opacus / parallel,
    }
