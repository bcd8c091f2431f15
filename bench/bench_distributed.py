"""Distributed training benchmark: 2 gloo processes vs 1 process on CPU (engine/distributed.py)."""

from __future__ import annotations

import os
import time

from common import _digits_setup, bench

EPOCHS = 5


def _epoch_seconds(epochs: int, threads: int) -> float:
    """Seconds per epoch of the Trainer's loop (Sample, digits_cnn, B=128); module-level for spawn."""
    import torch

    from idpsgd.training import TrainConfig, Trainer

    torch.set_num_threads(threads)
    data, budgets = _digits_setup()
    trainer = Trainer(data, budgets, TrainConfig(method="sample", epochs=epochs, seed=0, progress=False))
    t = time.perf_counter()
    trainer.run()
    return (time.perf_counter() - t) / epochs


@bench
def bench_distributed_speed():
    """Seconds per epoch on digits (Sample, digits_cnn, B=128, the whole Trainer loop with per-epoch
    evaluation): one process with all cores' threads against 2 gloo processes with cores/2 threads
    each (process start-up and data loading excluded; the same seed, so the same draws and ε).
    On a 2-core machine the two ranks share the cores one process already uses: expect no speed-up
    (a ratio near or above 1); the bench shows the overhead of the per-step all-reduce and of every
    rank drawing the full n uniforms, not a scaling result."""
    from idpsgd.engine.distributed import launch

    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    one = min(_epoch_seconds(EPOCHS, cores) for _ in range(2))
    one_single_thread = min(_epoch_seconds(EPOCHS, 1) for _ in range(2))
    two = min(launch(_epoch_seconds, 2, (EPOCHS, max(1, cores // 2)), timeout_s=300) for _ in range(2))
    return {
        "dataset": "digits",
        "method": "sample",
        "epochs": EPOCHS,
        "cores": cores,
        "one_process_seconds_per_epoch": one,
        "one_process_one_thread_seconds_per_epoch": one_single_thread,
        "two_process_seconds_per_epoch": two,
        "ratio_two_over_one": two / one,
        "ratio_two_over_one_single_thread": two / one_single_thread,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "note": "2 ranks on the same cores as 1 process: the ratio measures overhead, not scaling; with a "
        "load average above the core count the timings are dominated by other processes",
    }
