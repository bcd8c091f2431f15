"""The cost of book-keeping's provenance on a GPT-2-shaped step, side by side for two source trees (issue 46:
the host-read refusal must not make provenance measurably dearer; issue 50 wants it cheaper).

A tiny GPT-2 LM (from a config, no download) with an attention mask (transformers' mask fast paths read
``padding_mask.all()`` into Python: the allowed sites), one ``grad_sample_mode="bk"`` step = forward,
backward and the engine's noisy step; CPU seconds of one thread per step (``time.process_time`` per example,
times the expected batch size), the median of ``--steps`` steps after two warm-up steps, in a fresh process
per source tree and round, rounds interleaved (order reversed every other round).

    python bench/provenance_cost.py --src /path/to/base/src --src src [--rounds 3] [--steps 8]
    python bench/provenance_cost.py --src /path/to/base/src --src src --per-op   # µs per operation
    python bench/provenance_cost.py --src base/src --src src --layers 12 --d 768 --heads 12 --batch 16 --seq 128 \
        --no-mask --rounds 2 --steps 3   # GPT-2 small, as bench_hf feeds it (no mask: replayed)
    PYTHONPATH=src python bench/provenance_cost.py --forward --layers 12 --d 768 --heads 12 --batch 16 --seq 128 \
        --no-mask --rounds 5   # one forward: traced / replayed / book-keeper inactive
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _worker(layers: int, d: int, batch: int, seq: int, steps: int, with_mask: bool = True, heads: int = 4) -> dict:
    import warnings

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd import IndividualizedPrivacyEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=1000,
        bos_token_id=0,
        eos_token_id=0,
        n_positions=seq,
        n_embd=d,
        n_layer=layers,
        n_head=heads,
        tie_word_embeddings=False,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (batch * 4, seq))
    mask = torch.ones_like(ids)
    mask[::3, -seq // 4 :] = 0  # some right padding: the masked path (transformers' mask fast paths read it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = IndividualizedPrivacyEngine(seed=0)
        module, optimizer, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            data_loader=DataLoader(TensorDataset(ids, mask), batch_size=batch),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sample_rate=batch / len(ids),
            grad_sample_mode="bk",
        )
    times = []  # CPU seconds per example of each step (Poisson batches: the engine's private loader)
    while len(times) < steps + 2:
        for x, m in loader:
            if not len(x):
                continue
            start = time.process_time()
            optimizer.zero_grad()
            logits = module(input_ids=x, attention_mask=m if with_mask else None).logits
            per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
            loss = (per_token * m[:, 1:]).sum(1) / m[:, 1:].sum(1)
            loss.mean().backward()
            optimizer.step()
            times.append((time.process_time() - start) / len(x))
    times = [t * batch for t in times[2:]]  # at the expected batch size
    keeper = getattr(model, "_idpsgd_bookkeeper", None)
    attribution = getattr(keeper, "attribution", None)  # (trees before the replay have none)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "attribution": attribution.status if attribution is not None else "traced (no replay in this tree)",
    }


def per_op(srcs: list[str], rounds: int = 21, n: int = 1000) -> dict:
    """Microseconds per torch operation under each tree's ``ProvenanceMode`` (its ``provenance.py`` loaded from
    the tree; the module imports only torch and its siblings), in one process, interleaved: a GPT-2-like mix of
    operations on tagged tensors, on untagged ones, and reads of shapes (``size``, ``dim``, ``shape``: the
    non-tensor results the host-read check looks at)."""
    import importlib
    import types

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    modules = []
    for i, src in enumerate(srcs):
        homes = [os.path.join(src, "idpsgd", "engine", *d, "provenance.py") for d in (("per_example", "bk"), ("bk",))]
        path = next((h for h in homes if os.path.exists(h)), homes[0])  # after / before the engine's sub-packages
        package = types.ModuleType(f"_prov{i}")  # its folder as a package of its own: provenance.py imports
        package.__path__ = [os.path.dirname(path)]  # its siblings (memory.py) relatively, and nothing above
        sys.modules[package.__name__] = package
        modules.append(importlib.import_module(f"{package.__name__}.provenance"))
    x, w, c = torch.randn(8, 16, 32), torch.randn(32, 32), torch.randn(16, 32)

    def ops(x):
        k = 0
        for _ in range(n // 10):
            h = F.linear(x, w)  # tagged
            h = torch.tanh(h + c)  # tagged, a constant operand
            h = h.view(8, 16, 4, 8).transpose(1, 2)
            k += h.size(0) + h.dim() + h.shape[-1]  # shape reads: non-tensor results
            pos = torch.arange(16).expand(8, 16)  # untagged
            k += int(pos.shape[0])
            h.softmax(-1)
        return k

    per = {src: [] for src in srcs}
    pairs = list(zip(srcs, modules, strict=True))
    for r in range(rounds):
        for src, mod in pairs if r % 2 == 0 else pairs[::-1]:
            mode = mod.ProvenanceMode(8)
            mode.tags[x] = mod.BATCH
            start = time.process_time()
            with mode:
                ops(x)
            per[src].append((time.process_time() - start) / n * 1e6)
    return {src: statistics.median(v) for src, v in per.items()}


def forward_cost(layers: int, d: int, heads: int, batch: int, seq: int, rounds: int, mask: bool) -> dict:
    """CPU milliseconds of one GPT-2 forward (one thread) in this tree, interleaved in one process: book-kept with
    the attribution traced (every operation intercepted), replayed (``idpsgd.engine.per_example.bk.replay``), and
    with the book-keeper inactive (no provenance, no book-kept layers: the model's own forward);
    medians over ``rounds``."""
    import warnings

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd.engine.per_example.bk.keeper import BookKeeper

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=seq, n_embd=d, n_layer=layers, n_head=heads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 1000, (batch, seq))
    attention = torch.ones_like(ids) if mask else None
    if attention is not None:
        attention[::3, -seq // 4 :] = 0
    keeper = BookKeeper.attach(model)
    attribution = keeper.attribution

    def run(how: str) -> float:
        keeper.active = how != "inactive"
        attribution.enabled = how == "replayed"
        start = time.process_time()
        model(input_ids=ids, attention_mask=attention)
        spent = time.process_time() - start
        keeper.clear()
        return spent * 1e3

    kinds = ("traced", "replayed", "inactive")
    for how in kinds:  # warm-up; the first replayed forward traces its signature
        run(how)
    got: dict = {k: [] for k in kinds}
    for r in range(rounds):
        for how in kinds if r % 2 == 0 else kinds[::-1]:
            got[how].append(run(how))
            if how == "replayed":
                said = attribution.status
    keeper.active = False
    out = {k: statistics.median(v) for k, v in got.items()}
    out["attribution"] = said
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", required=True, help="a source tree (its idpsgd package); give two")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--no-mask",
        action="store_true",
        help="no attention mask (as bench_hf): no read of the mask into Python, so the attribution can be replayed",
    )
    p.add_argument("--per-op", action="store_true", help="microseconds per operation under each tree's mode instead")
    p.add_argument(
        "--forward",
        action="store_true",
        help="this tree only (PYTHONPATH): one forward traced, replayed, and with the book-keeper inactive",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.forward:
        got = forward_cost(a.layers, a.d, a.heads, a.batch, a.seq, a.rounds, not a.no_mask)
        print(
            f"forward: traced {got['traced']:.1f} ms, replayed {got['replayed']:.1f} ms, book-keeper inactive "
            f"{got['inactive']:.1f} ms; provenance's cost {got['traced'] - got['replayed']:.1f} ms per forward "
            f"removed by the replay ({got['attribution']})"
        )
        return got
    if a.per_op:
        got = per_op(a.src)
        for src, us in got.items():
            print(f"{src}: {us:.2f} µs per operation; {us / got[a.src[0]]:.3f}x")
        return got
    shape = (a.layers, a.d, a.batch, a.seq, a.steps, not a.no_mask, a.heads)
    if a.worker:
        print(json.dumps(_worker(*shape)))
        return None
    got: dict = {s: [] for s in a.src}
    said: dict = {}
    for r in range(a.rounds):
        for src in a.src if r % 2 == 0 else a.src[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, __file__, "--src", src, "--worker", "1", "--layers", str(a.layers), "--d", str(a.d)]
            cmd += ["--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--heads", str(a.heads)]
            cmd += ["--no-mask"] if a.no_mask else []
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            got[src].append(run["median_s"])
            said[src] = run.get("attribution", "")
    base = statistics.median(got[a.src[0]])
    for src, values in got.items():
        med = statistics.median(values)
        rounds = ", ".join(f"{v * 1e3:.1f}" for v in values)
        print(f"{src}: {med * 1e3:.1f} ms per step (rounds {rounds}); {med / base:.3f}x; attribution {said[src]}")
    return got


if __name__ == "__main__":
    main()
