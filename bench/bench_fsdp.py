"""Cost of privacy on FSDP2 (issue 39): seconds per step of FSDP2 + book-keeping (per-example clip norms,
two privacy groups' rates, noise per shard) against FSDP2 non-private training of the same model on
the same shards, W gloo processes on CPU (a GPT-2 built from a config, no download).

Both runs wrap the blocks and the root with ``fully_shard`` and step AdamW on the shards; the
non-private run takes fixed batches of B examples (B/W per rank) with FSDP2's own reduce-scatter, the
private run Poisson batches of expected size B (per-rank rates q_i = B/n).  Reported: the median
seconds per step of each (after warm-up steps), and the ratio (target ≤ 1.3).  Run it on an idle
machine::

    PYTHONPATH=src python bench/bench_fsdp.py                 # W = 2, GPT-2 4×256, B = 16, T = 64
    PYTHONPATH=src python bench/bench_fsdp.py --nproc 4 --layers 6 --hidden 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _model(layers: int, hidden: int, vocab: int, tokens: int):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab,
            n_positions=tokens,
            n_embd=hidden,
            n_layer=layers,
            n_head=max(1, hidden // 64),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _loss(model, x, vocab):
    import torch

    logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))


def run(layers: int, hidden: int, vocab: int, tokens: int, batch: int, steps: int, warmup: int, threads: int):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd.engine import IndividualizedPrivacyEngine

    torch.set_num_threads(threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = batch * (steps + warmup)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, size=(n, tokens)))

    def plain() -> list[float]:
        model = _model(layers, hidden, vocab, tokens)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        local = batch // world
        times = []
        for s in range(steps + warmup):
            x = ids[s * batch + rank * local : s * batch + (rank + 1) * local]
            dist.barrier()
            t = time.perf_counter()
            _loss(model, x, vocab).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        return times[warmup:]

    def private() -> list[float]:
        model = _model(layers, hidden, vocab, tokens)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = IndividualizedPrivacyEngine(seed=0)
        # two privacy groups, assigned at random (the ranks' loads are balanced whatever the order:
        # engine/sampling/rank_balance.py)
        budgets = np.where(np.random.default_rng(1).random(n) < 0.5, 2.0, 8.0)
        wrapped, dp_opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(TensorDataset(ids), batch_size=batch),
            budgets=budgets,
            target_delta=1e-5,
            steps=steps + warmup,
            grad_sample_mode="bk",
        )
        times = []
        it = iter(loader)
        for _ in range(steps + warmup):
            (x,) = next(it)
            dist.barrier()
            t = time.perf_counter()
            _loss(wrapped, x, vocab).backward()
            dp_opt.step()
            dp_opt.zero_grad()
            times.append(time.perf_counter() - t)
        return times[warmup:]

    first = plain()
    priv = private()
    second = plain()
    base = min(statistics.median(first), statistics.median(second))
    mine = {"plain": base, "private": statistics.median(priv)}
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="(expected) examples per step, all ranks together")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    from idpsgd.engine.distributed import launch

    threads = max(1, (os.cpu_count() or 1) // a.nproc)
    load = os.getloadavg()[0]
    ranks = launch(
        run, a.nproc, (a.layers, a.hidden, a.vocab, a.tokens, a.batch, a.steps, a.warmup, threads), timeout_s=3600
    )
    plain = max(r["plain"] for r in ranks)  # a step ends when the slowest rank ends
    private = max(r["private"] for r in ranks)
    print(
        json.dumps(
            {
                "nproc": a.nproc,
                "model": f"GPT-2 {a.layers} layers x {a.hidden}, vocab {a.vocab}, T={a.tokens}",
                "batch": a.batch,
                "plain_fsdp2_seconds_per_step": plain,
                "private_fsdp2_bk_seconds_per_step": private,
                "ratio_private_over_plain": private / plain,
                "target_ratio": 1.3,
                "load_average_before": load,
                "load_average_after": os.getloadavg()[0],
                "per_rank": ranks,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
