"""Ranks with balanced loads (issue 51): the ranks' real batch sizes when the budgets follow the row order.

W gloo processes train a small model privately (the engine on DPDDP, Sample, two privacy groups whose
budgets alternate row by row, so their rates q_i follow i mod 2) and record their Poisson batch sizes.
Printed per rank: the mean batch size over the steps, the expected one Σ_{i on r} q_i, and the mean's
standard error √(Σ q_i(1−q_i)/steps); the largest difference between two ranks' means in units of the
Poisson noise of that difference; and, for contrast, the expected loads under the former i mod W deal::

    PYTHONPATH=src python bench/bench_rank_balance.py                  # W = 2, 2000 rows, 200 steps
    PYTHONPATH=src python bench/bench_rank_balance.py --nproc 3 --steps 400
"""

from __future__ import annotations

import argparse
import json
import math


def run(n: int, batch: int, steps: int) -> list:
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd.engine import IndividualizedPrivacyEngine, distributed

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))
    budgets = np.where(np.arange(n) % 2 == 0, 1.0, 8.0)  # follow the row order (i mod 2)
    model = distributed.wrap_model(torch.nn.Linear(8, 2))
    engine = IndividualizedPrivacyEngine(seed=0)
    wrapped, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch),
        budgets=budgets,
        target_delta=1e-5,
        steps=steps,
        method="sample",
    )
    sizes = []
    while len(sizes) < steps:  # (an epoch of the loader is 1/q steps)
        for x, y in loader:
            sizes.append(len(x))
            opt.zero_grad()
            if len(x):
                torch.nn.functional.cross_entropy(wrapped(x), y).backward()
            opt.step()
            if len(sizes) == steps:
                break
    sampler = loader.poisson_sampler
    q = sampler.sample_rates
    mine = {
        "mean_batch": float(np.mean(sizes)),
        "expected_batch": float(q[sampler.shard].sum()),
        "std_error": math.sqrt(float((q[sampler.shard] * (1 - q[sampler.shard])).sum()) / steps),
        "rank_mod_w_expected_batch": float(q[dist.get_rank() :: dist.get_world_size()].sum()),
    }
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64, help="expected examples per step, all ranks together")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args(argv)
    from idpsgd.engine.distributed import launch

    ranks = launch(run, a.nproc, (a.rows, a.batch, a.steps), timeout_s=900)
    worst = 0.0
    for i, r in enumerate(ranks):
        for s in ranks[i + 1 :]:
            noise = math.hypot(r["std_error"], s["std_error"])
            worst = max(worst, abs(r["mean_batch"] - s["mean_batch"]) / noise)
    result = {
        "nproc": a.nproc,
        "rows": a.rows,
        "steps": a.steps,
        "budgets": "1 and 8 by turns (row order i mod 2), method sample",
        "per_rank": ranks,
        "largest_difference_of_means_in_poisson_std": worst,
        "within_poisson_noise": worst <= 3.0,
        "former_i_mod_w_expected_batches": [r["rank_mod_w_expected_batch"] for r in ranks],
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
