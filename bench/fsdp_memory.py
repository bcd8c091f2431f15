"""Memory per rank of private FSDP2 training (issue 39): parameters + gradients + optimizer state of a
≥100M-parameter GPT-2 (built from a config, no download) trained with book-keeping on W gloo processes
with ``fully_shard``, against the same model unsharded in one process.

Per rank, measured after a private AdamW step (the optimizer state exists): the bytes of the tensors
this rank holds — its parameter shards, its gradient shards (``p.grad``, before ``zero_grad``) and its
optimizer state — and the process's resident memory (``VmRSS``) after the step; plus the peak resident
memory *during* a second step above the resident memory before it (``VmHWM``, reset through
``/proc/self/clear_refs``): the transient cost (activations, the book-keeper's records, the full-size
clipped sums before the reduce-scatter, the replayed full-size noise of one parameter).  Run::

    PYTHONPATH=src python bench/fsdp_memory.py                  # GPT-2 small shape (124M), W = 2
    PYTHONPATH=src python bench/fsdp_memory.py --nproc 4 --layers 12 --hidden 768
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _bytes(t) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return int(t.numel()) * t.element_size()


def measure(sharded: bool, layers: int, hidden: int, vocab: int, batch: int, tokens: int, examples: int) -> dict:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd.engine import IndividualizedPrivacyEngine, distributed

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=tokens, n_embd=hidden, n_layer=layers, n_head=max(1, hidden // 64))
    model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    gc.collect()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, size=(examples, tokens)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = IndividualizedPrivacyEngine(seed=0)
    wrapped, dp_opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(ids), batch_size=batch),
        noise_multiplier=1.0,
        sample_rate=batch / examples,
        target_delta=1e-5,
        grad_sample_mode="bk",
    )
    batches = iter(loader)

    def step():
        (x,) = next(batches)
        logits = wrapped(x).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
        dp_opt.step()

    step()
    held = {
        "parameters": sum(_bytes(p) for p in model.parameters()),
        "gradients": sum(_bytes(p.grad) for p in model.parameters()),
        "optimizer_state": sum(_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }
    dp_opt.zero_grad(set_to_none=True)
    gc.collect()
    rss_before = _status("VmRSS")
    reset = _reset_peak()
    t = time.perf_counter()
    step()
    seconds = time.perf_counter() - t
    peak = _status("VmHWM")
    rank, world = distributed.rank_and_world()
    return {
        "rank": rank,
        "world": world,
        "sharded": sharded,
        "model_parameters": int(n_params),
        **{f"{k}_bytes": v for k, v in held.items()},
        "params_grads_optimizer_bytes": sum(held.values()),
        "rss_after_step_bytes": _status("VmRSS"),
        "step_peak_rss_rise_bytes": peak - rss_before if reset else None,
        "step_seconds": seconds,
    }


def _all_ranks(*args):
    import torch.distributed as dist

    mine = measure(True, *args)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4, help="expected (Poisson) batch size, all ranks together")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--examples", type=int, default=64)
    a = ap.parse_args()
    from idpsgd.engine.distributed import launch

    args = (a.layers, a.hidden, a.vocab, a.batch, a.tokens, a.examples)
    one = launch(measure, 1, (False, *args), timeout_s=1800)  # a fresh process, no FSDP
    ranks = launch(_all_ranks, a.nproc, args, timeout_s=1800)
    mib = 1 << 20
    summary = {
        "model_parameters": one["model_parameters"],
        "nproc": a.nproc,
        "unsharded_params_grads_optimizer_MiB": one["params_grads_optimizer_bytes"] / mib,
        "per_rank_params_grads_optimizer_MiB": [r["params_grads_optimizer_bytes"] / mib for r in ranks],
        "per_rank_over_unsharded": [
            r["params_grads_optimizer_bytes"] / one["params_grads_optimizer_bytes"] for r in ranks
        ],
        "unsharded_rss_after_step_MiB": one["rss_after_step_bytes"] / mib,
        "per_rank_rss_after_step_MiB": [r["rss_after_step_bytes"] / mib for r in ranks],
        "unsharded_step_peak_rss_rise_MiB": (one["step_peak_rss_rise_bytes"] or 0) / mib,
        "per_rank_step_peak_rss_rise_MiB": [(r["step_peak_rss_rise_bytes"] or 0) / mib for r in ranks],
        "unsharded_step_seconds": one["step_seconds"],
        "per_rank_step_seconds": [r["step_seconds"] for r in ranks],
        "load_average": os.getloadavg()[0],
        "one_process": one,
        "ranks": ranks,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
