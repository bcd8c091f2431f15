"""User-level book-keeping cost (issue 37): one bk step at user level vs example level, same rows per step.

The same model, the same B rows per step (B/k users of k rows each at user level; B examples at example
level), σ and clip norm; the median wall time of a full private step (forward, backward, per-unit norms,
clipped sum, noise, update) over ``--repeats`` steps after warm-up.  Usage:

    python bench/bench_users.py [--device cuda] [--rows 32] [--k 4] [--seq 128] [--repeats 20]

Prints JSON: per model, the two medians (seconds) and their ratio (user / example).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import IndividualizedPrivacyEngine, Users


def gpt2(vocab=2048, layers=4, dim=256, seq=128):
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=dim, n_head=4, vocab_size=vocab, n_positions=seq, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _private(build, x, y, users, device):
    torch.manual_seed(0)
    model = build().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = IndividualizedPrivacyEngine(seed=0)
        module, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            noise_multiplier=1.0,
            sample_rate=1.0,  # every unit every step: exactly the rows per step
            users=users,
            grad_sample_mode="bk",
        )
    return module, opt, loader


def _one_step(module, opt, loader, n, device):
    xb, yb = next(iter(loader))
    assert len(xb) == n
    xb, yb = xb.to(device), yb.to(device)
    pos = torch.arange(xb.shape[1], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad()
    logits = module(input_ids=xb, position_ids=pos.expand(len(xb), -1)).logits
    nn.functional.cross_entropy(logits.transpose(1, 2), yb).backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def step_times(build, x, y, users, device, repeats):
    """Median step time at example level and at user level, the two interleaved step by step (a load
    that comes and goes hits both alike)."""
    ex = _private(build, x, y, None, device)
    us = _private(build, x, y, users, device)
    t_ex, t_us = [], []
    for i in range(repeats + 2):
        a, b = _one_step(*ex, len(x), device), _one_step(*us, len(x), device)
        if i >= 2:
            t_ex.append(a)
            t_us.append(b)
    return statistics.median(t_ex), statistics.median(t_us)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2048, (a.rows, a.seq), generator=g)
    y = torch.roll(x, -1, 1)
    ids = np.repeat(np.arange(a.rows // a.k), a.k)

    def build():
        return gpt2(layers=a.layers, dim=a.dim, seq=a.seq)

    example, user = step_times(build, x, y, Users(ids, a.k), device, a.repeats)
    out = {
        "model": f"gpt2 {a.layers} layers, d={a.dim}, vocab 2048, T={a.seq}",
        "device": str(device),
        "rows_per_step": a.rows,
        "k": a.k,
        "example_level_s": example,
        "user_level_s": user,
        "ratio": user / example,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
