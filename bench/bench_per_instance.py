"""Per-instance DP benchmarks (Thudi et al.): the clip-norm trade-off on digits."""
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
        s = run_per_instance(data, points, runs=2, alpha=8, config=TrainConfig(clip_norm=c, lr=0.05 / c,
                                                                                progress=False), epsilon=10.0)
        rows.append({"clip_norm": c, "lr": 0.05 / c, "test_accuracy": s["test_accuracy"],
                     "median_ratio": s["median_ratio_to_baseline"], "p10_ratio": s["p10_ratio_to_baseline"],
                     "median_upper_ratio": s["median_upper_ratio_to_baseline"],
                     "share_points_below_baseline_late": s["share_points_below_baseline_late"],
                     "seconds": time.perf_counter() - t})
    return {"dataset": "digits", "alpha": 8, "epsilon": 10.0, "batch_size": 128, "epochs": 30, "points": 10,
            "runs_per_chain": 2, "target_set": "test", "sweep": rows}
