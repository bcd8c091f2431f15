"""Issue 50's CPU figures in one command: the per-step Python tax of a private GPT-2-small step (provenance, the
write guard, the checks) and the time and memory of private training against non-private (the CIFAR-shaped
CNN, GPT-2 small full and with LoRA).

The tax (one process, one torch thread, CPU milliseconds, medians of interleaved rounds) on a GPT-2-small LM
(12 × 768, 12 heads, T 128, B 16 by default; ``--layers`` etc. for a smaller one):

* provenance: one book-kept forward with the attribution traced (every torch call intercepted) against the
  same forward replayed (``bk/replay.py``) — the difference is what the replay removes; what the replay
  itself costs per forward: its signature (the model's structure and the inputs: a Python walk) and the
  answers (``replay_ms``);
* the write guard: one logical step's guard work in steady state — the snapshot at the step's end, the one with
  the value fingerprint at the first forward and the comparison before the noise (``integrity.py``; two reads of
  the parameters and the optimizer's state, the second reusing the first's reading plan), with SGD and with Adam;
* the checks: the decomposition check does not run in bk (provenance refuses what it would catch:
  docs/performance.md, "The decomposition check"); the batch-independence and padding probes run at the first
  forward only.

The ratios run ``bench_engine.py`` (``cifar_cnn`` at B = 256) and ``bench_hf.py`` (``gpt2_lm``, ``gpt2_lora``),
non-private and ours_bk only (``--configs``), fresh processes, interleaved rounds, memory probes (step by step in
one process, steadier on a shared machine: ``interleaved_steps.py``); the goals: CNN ≤ 1.15×, GPT-2 small
≤ 1.10×, LoRA ≤ 1.05× time, memory ≤ 1.1×, provenance + guard + checks ≤ 1 ms per GPT-2-small step.  On a quiet
machine::

    python bench/step_tax.py                    # everything (GPT-2 small: long on one CPU thread)
    python bench/step_tax.py --tax-only         # the tax alone
    python bench/step_tax.py --hf-layers 2      # the ratios on a 2-layer GPT-2 (bench_hf's CPU default)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def tax(layers: int, d: int, heads: int, batch: int, seq: int, vocab: int, rounds: int) -> dict:
    """The per-step tax on a GPT-2 LM (module docstring), in this process."""
    import warnings

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd.engine.guards import integrity
    from idpsgd.engine.per_example.bk import replay
    from idpsgd.engine.per_example.bk.keeper import BookKeeper

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=vocab, n_positions=max(seq, 128), n_embd=d, n_layer=layers, n_head=heads)
        ).train()
    ids = torch.randint(0, vocab, (batch, seq))
    keeper = BookKeeper.attach(model)
    attribution = keeper.attribution
    out: dict = {"model": f"GPT-2 {layers} x {d}, {heads} heads, vocabulary {vocab}", "batch": batch, "seq": seq}

    def forward(how):
        keeper.active = how != "inactive"
        attribution.enabled = how == "replayed"
        spent = _cpu_ms(lambda: model(input_ids=ids))
        keeper.clear()
        return spent

    kinds = ("traced", "replayed", "inactive")
    for how in kinds:
        forward(how)
    got: dict = {k: [] for k in kinds}
    for r in range(rounds):
        for how in kinds if r % 2 == 0 else kinds[::-1]:
            got[how].append(forward(how))
    forwards = {k: statistics.median(v) for k, v in got.items()}
    keeper.active, attribution.enabled = True, True
    # the signature as a replayed forward computes it (with the attribution's attribute watch, where the tree has
    # one); the median of single calls, so that a garbage collection falling into one call does not count 20 times
    watch = {"watch": attribution.watch} if hasattr(attribution, "watch") else {}
    signature_ms = statistics.median(
        _cpu_ms(lambda: replay.signature(model, batch, (), {"input_ids": ids}, **watch)) for _ in range(41)
    )
    plan = next(iter(attribution.plans.values()))[0] if attribution.plans else []
    keeper.active = False
    out["provenance"] = {
        "forward_traced_ms": forwards["traced"],
        "forward_replayed_ms": forwards["replayed"],
        "forward_bookkeeper_inactive_ms": forwards["inactive"],
        "removed_by_replay_ms": forwards["traced"] - forwards["replayed"],
        "replay_ms": signature_ms,
        "replay_queries": len(plan),
        "attribution": attribution.status,
    }
    guards = {}
    for name, opt in (
        ("sgd", torch.optim.SGD(model.parameters(), lr=1e-3)),
        ("adam", torch.optim.Adam(model.parameters(), lr=1e-4)),
    ):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer's state exists (Adam: two tensors per parameter)
        guard = integrity.WriteGuard(model)  # the guard's work in one logical step, in steady state: the step's
        guard.watch_too(opt, None)  # end (arm), the snapshot at the first forward, the comparison before the noise

        def step_of_guard(guard=guard):
            guard.arm()
            guard._first_forward()
            guard.check()

        step_of_guard()
        times = [_cpu_ms(step_of_guard) for _ in range(max(3, rounds // 2))]
        guards[f"guard_{name}_ms"] = statistics.median(times)
        guard.detach()
        del opt, guard
    for p in model.parameters():
        p.grad = None
    out["guard"] = guards
    out["checks"] = {"decomposition_bk_ms": 0.0, "note": "no decomposition check in bk; probes at the first forward"}
    out["tax_per_step_ms"] = {
        k: signature_ms + guards[f"guard_{k}_ms"] for k in ("sgd", "adam")
    }  # after the replay: its own cost + the guard (the checks: none per step in bk)
    return out


def ratios(hf_layers: int, repeats: int, quick: bool) -> dict:
    """The CNN and the GPT-2 benches against non-private (fresh processes; their JSON results)."""
    out = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="idpsgd-step-tax-") as tmp:
        return _ratios(Path(tmp), env, out, hf_layers, repeats, quick)


def _ratios(with_tmp: Path, env: dict, out: dict, hf_layers: int, repeats: int, quick: bool) -> dict:
    cnn = with_tmp / "step_tax_cnn.json"
    cmd = [sys.executable, str(HERE / "bench_engine.py"), "--models", "cifar_cnn", "--repeats", str(repeats)]
    cmd += ["--configs", "nonprivate,ours_bk"]  # the goals are bk's; Opacus's runs would double the time
    cmd += ["--quick", "--batch-sizes", "32"] if quick else ["--batch-sizes", "256"]
    subprocess.run([*cmd, "--out", str(cnn)], env=env, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(cnn.read_text())["cifar_cnn"]["ratios"]
    out["cnn"] = {k: v for b in r.values() if isinstance(b, dict) for k, v in b.items() if k.startswith("ours_bk")}
    hf = with_tmp / "step_tax_hf.json"
    cmd = [sys.executable, str(HERE / "bench_hf.py"), "--models", "gpt2_lm,gpt2_lora", "--repeats", str(repeats)]
    cmd += ["--configs", "nonprivate,ours_bk"]
    cmd += ["--smoke"] if quick else ["--layers", str(hf_layers)]
    subprocess.run([*cmd, "--out", str(hf)], env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(hf.read_text())
    for model in ("gpt2_lm", "gpt2_lora"):
        out[model] = {k: v for k, v in result[model]["ratios"].items() if k.startswith("ours_bk")}
    out["hf_layers"] = result["layers_note"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tax-only", action="store_true", help="the per-step tax only (no ratio benches)")
    p.add_argument("--ratios-only", action="store_true", help="the ratio benches only")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the tax (default 5)")
    p.add_argument("--hf-layers", type=int, default=12, help="GPT-2 layers of the ratio bench (default 12)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the ratio benches (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a test of the script, not a measurement)")
    a = p.parse_args(argv)
    result: dict = {"load_avg_1min_before": os.getloadavg()[0]}
    if not a.ratios_only:
        sizes = (2, 32, 2, 2, 8, 101, 1) if a.quick else (a.layers, a.d, a.heads, a.batch, a.seq, a.vocab, a.rounds)
        result["tax"] = tax(*sizes)
    if not a.tax_only:
        result["ratios"] = ratios(a.hf_layers, a.repeats, a.quick)
    result["load_avg_1min_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
