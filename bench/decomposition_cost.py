"""What the decomposition check costs (issue 46): one DP-SGD step with the check and without it.

The check (``idpsgd.engine.guards.decomposition``) proves, per parameter, that the per-example gradients add
up to autograd's gradient of the summed loss.  This bench times steps of a GPT-2-shaped language model
(token and position embeddings, pre-LayerNorm causal self-attention blocks, a 4x GELU MLP, an untied
LM head; loss summed over tokens per example) and of the CIFAR-10 CNN of Tramèr & Boneh 2021, in
``hooks`` and ``ghost`` mode, with the check run at every step ("on") and detached ("off"), in
interleaved rounds (off, on, off, on, ...) so that a changing machine load hits both alike.  It prints
one JSON line per (model, mode): the median milliseconds per step, the overhead of a checked step, and
the overhead averaged over a run of 1000 steps on the engine's schedule (the first
``FIRST_STEPS`` steps and every power of two), with the load average before and after::

    PYTHONPATH=src python bench/decomposition_cost.py [--device cpu|cuda|auto] [--rounds 4] [--steps 3]
        [--models gpt2,cnn] [--modes hooks,ghost]

CPU: one torch thread, CPU time (``time.process_time``: on a shared machine it measures the work);
CUDA: wall time around synchronised steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import parse_models, resolve_device
from idpsgd.engine import IndividualizedPrivacyEngine
from idpsgd.engine.guards.decomposition import due
from idpsgd.models import create_model

MODELS = ("gpt2", "cnn")
MODES = ("hooks", "ghost")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class GPT2Shaped(nn.Module):
    """GPT-2's layout with nn.Linear layers (the shape, not the weights: vocabulary and width small)."""

    def __init__(self, vocab=2048, length=64, d=128, heads=4, layers=4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)  # one row per example
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class TokenLoss(nn.Module):
    """Next-token cross-entropy summed over each example's tokens (one loss per example for "none")."""

    def __init__(self):
        super().__init__()
        self.reduction = "sum"

    def forward(self, logits, ids):
        per_token = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        per_example = per_token.sum(1)
        return per_example if self.reduction == "none" else per_example.sum()


def build(name: str, batch: int, device: str):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "gpt2":
        x = torch.randint(0, 2048, (batch, 64), generator=g)
        return x, x.clone(), GPT2Shaped(), TokenLoss()
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    crit = nn.CrossEntropyLoss(reduction="sum")
    return x, y, create_model("tramer_boneh_cifar10", (3, 32, 32), 10), crit


def stepper(name: str, mode: str, batch: int, device: str):
    """(one step, the step's decomposition check, where the check attaches)."""
    x, y, model, crit = build(name, batch, device)
    model = model.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
        out = engine.make_private_with_parameters(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
            data_loader=DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=batch),
            budgets=None,
            sample_rates=np.ones(batch),
            clip_norms=np.ones(batch),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode=mode,
            privacy_filter=None,
            loss_reduction="sum",
            criterion=crit if mode == "ghost" else None,
        )
    module, opt, loader = out[0], out[1], out[-1]
    loss_fn = out[2] if mode == "ghost" else crit
    check = opt.guard.decomposition
    holders = [opt.guard, opt] + ([module] if mode == "ghost" else [])

    def step():
        for xb, yb in loader:
            opt.zero_grad()
            loss_fn(module(xb), yb).backward()
            opt.step()

    def switch(on: bool):
        for h in holders:
            h.decomposition = check if on else None
        check.every_step = on

    return step, switch


def timed(fn, device: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
        else:
            start = time.process_time()
            fn()
            out.append(time.process_time() - start)
    return out


def scheduled_fraction(steps: int = 1000) -> float:
    return sum(due(t) for t in range(1, steps + 1)) / steps


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and setting")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if device == "cpu":
        torch.set_num_threads(1)
    results = []
    for name in parse_models(args.models, MODELS):
        for mode in parse_models(args.modes, MODES):
            load_before = os.getloadavg()[0]
            step, switch = stepper(name, mode, args.batch, device)
            for on in (False, True):  # warm-up, both paths
                switch(on)
                step()
            times = {False: [], True: []}
            for _ in range(args.rounds):
                for on in (False, True):
                    switch(on)
                    times[on] += timed(step, device, args.steps)
            off, on = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
            overhead = (on - off) / off
            row = {
                "model": name,
                "mode": mode,
                "device": device if device == "cpu" else torch.cuda.get_device_name(),
                "batch": args.batch,
                "step_ms_check_off": round(off, 1),
                "step_ms_check_on": round(on, 1),
                "checked_step_overhead": round(overhead, 4),
                "overhead_over_1000_steps_on_schedule": round(overhead * scheduled_fraction(), 5),
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


if __name__ == "__main__":
    main()
