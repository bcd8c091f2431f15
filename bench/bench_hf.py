"""Fine-tuning Hugging Face models privately at near non-private cost (issue 30, item 7): time per
example and peak memory of non-private training, the engine's book-keeping with per-example budgets,
and Opacus 1.6's ghost clipping, on the models people fine-tune.

Models (random initialisation from configs, no download; random tokens):

* ``gpt2_lm`` — a GPT-2-small-shaped causal LM (12 layers, d = 768, 12 heads, vocabulary 50,257,
  tied input/output embeddings), full fine-tuning at sequence length 128; ``--layers`` uses fewer
  layers (on CPU), and the results say how many;
* ``bert_cls`` — a BERT-base-shaped sequence classifier (12 layers, d = 768, vocabulary 30,522,
  2 classes), full fine-tuning;
* ``gpt2_lora`` — the GPT-2 LM with LoRA adapters of rank 8 (PEFT's default target modules), the
  base frozen.

Configurations (same model, data, loss, SGD, clip norm, expected batch size B):

* ``nonprivate`` — plain SGD over shuffled batches of B;
* ``ours_bk`` — ``IndividualizedPrivacyEngine.make_private`` with IDP-SGD *Scale* for two consent
  groups (ε = 1 and 8, half each: a clip norm per example), ``grad_sample_mode="bk"``, Poisson
  batches (an empty batch is a noise-only step);
* ``opacus_ghost`` — Opacus 1.6 ``PrivacyEngine.make_private(grad_sample_mode="ghost")`` (fast
  gradient clipping, two backward passes) at the σ of our calibration.

The loss of the language models is each sequence's mean token cross-entropy, averaged over the
batch (:mod:`idpsgd.integrations.hf.losses`; Opacus's ghost clipping uses the same per-sequence
mean).  A configuration that does not run on a model (a layer or a shared parameter the private
mode refuses) is reported with its error instead of figures.

Each run is a fresh subprocess: warm-up steps, then ``--steps`` timed steps; rounds interleave the
configurations (order reversed every other round).  Figures: seconds per example (CPU seconds of one
torch thread on the CPU, wall seconds on CUDA), medians over rounds, ratios to ``nonprivate``; peak
memory from separate probes in fresh processes — ``ru_maxrss`` with glibc's mmap threshold fixed
(CPU), ``torch.cuda.max_memory_allocated`` (CUDA).

Usage::

    python bench/bench_hf.py [--models gpt2_lm,bert_cls,gpt2_lora] [--layers 12] [--batch-size 16]
                             [--seq-len 128] [--steps 4] [--repeats 2] [--device cpu|cuda] [--smoke]
    python bench/run.py hf_cost          # the same with the defaults (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_engine import PROBE_ENV, _maxrss_mib, run_isolated
from common import bench, parse_models, resolve_device

RESULT_PATH = HERE / "results" / "hf_cost.json"
MODELS = ("gpt2_lm", "bert_cls", "gpt2_lora")
CONFIGS = ("nonprivate", "ours_bk", "opacus_ghost")
#: every configuration ``--configs`` takes: ours in each grad_sample_mode, Opacus 1.6 in hooks and ghost
ALL_CONFIGS = ("nonprivate", "ours_bk", "ours_ghost", "ours_hooks", "opacus_ghost", "opacus_hooks")
#: ``--precision``: float32, or autocast in bfloat16 / float16 (float16: a GradScaler where the mode takes one)
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
DELTA, CLIP = 1e-5, 1.0
#: issue 30's goals: full fine-tuning ≤ 1.25× time and ≤ 1.2× memory of non-private, LoRA ≤ 1.1×
TARGETS = {"full_time": 1.25, "full_memory": 1.2, "lora_time": 1.1, "lora_memory": 1.1}
FULL = {
    "layers": 12,
    "width": 768,
    "heads": 12,
    "gpt2_vocab": 50257,
    "bert_vocab": 30522,
    "seq_len": 128,
    "batch_size": 16,
    "steps": 4,
    "warmup_steps": 1,
    "probe_steps": 2,
    "lora_r": 8,
}
SMOKE = {
    "layers": 1,
    "width": 32,
    "heads": 2,
    "gpt2_vocab": 101,
    "bert_vocab": 101,
    "seq_len": 16,
    "batch_size": 8,
    "steps": 1,
    "warmup_steps": 1,
    "probe_steps": 1,
    "lora_r": 8,
}


# --- one configuration (runs in a fresh subprocess) ---------------------------------------------
def build_model(spec: dict):
    """(model, task) for ``spec['model']``: ``lm`` or ``cls``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(spec["seed"])
    d, layers, heads = spec["width"], spec["layers"], spec["heads"]
    if spec["model"] == "bert_cls":
        return BertForSequenceClassification(
            BertConfig(
                vocab_size=spec["bert_vocab"],
                hidden_size=d,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=4 * d,
                max_position_embeddings=max(512, spec["seq_len"]),
                num_labels=2,
            )
        ), "cls"
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=spec["gpt2_vocab"],
            n_positions=max(1024, spec["seq_len"]),
            n_embd=d,
            n_layer=layers,
            n_head=heads,
        )
    )
    if spec["model"] == "gpt2_lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=spec["lora_r"], task_type="CAUSAL_LM"))
    return model, "lm"


def _data(spec: dict, task: str):
    import torch

    g = torch.Generator().manual_seed(10_000 + spec["seed"])
    vocab = spec["bert_vocab"] if spec["model"] == "bert_cls" else spec["gpt2_vocab"]
    x = torch.randint(0, vocab, (spec["n"], spec["seq_len"]), generator=g)
    y = torch.randint(0, 2, (spec["n"],), generator=g) if task == "cls" else x
    return x, y


def _losses(task: str):
    """(loss(model, x, y) for nonprivate and ours, ghost_loss(criterion, model, x, y) for Opacus)."""
    import torch.nn.functional as F

    from idpsgd.integrations.hf.losses import PerExampleLoss

    if task == "cls":
        return (
            lambda m, x, y: F.cross_entropy(m(input_ids=x).logits, y),
            lambda crit, m, x, y: crit(m(input_ids=x).logits, y),
        )
    per_example = PerExampleLoss("causal_lm")

    def ghost(crit, m, x, y):
        logits = m(input_ids=x).logits[:, :-1]
        return crit(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), shape=logits.shape[:2])

    return (lambda m, x, y: per_example(m(input_ids=x), y).mean()), ghost


def run_config(spec: dict) -> dict:
    """Train one configuration: warm-up steps, then ``spec['steps']`` timed steps (``steps`` 0: a
    memory probe of ``probe_steps`` steps).  Returns the figures, or ``error`` when it does not run."""
    import warnings

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    model, task = build_model(spec)
    model = model.to(device).train()
    x, y = _data(spec, task)
    x, y = x.to(device), y.to(device)
    n, b = len(x), spec["batch_size"]
    loss_fn, ghost_loss = _losses(task)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=b,
        shuffle=spec["config"] == "nonprivate",
        generator=torch.Generator().manual_seed(spec["seed"]),
    )
    config, engine, sigma, criterion = spec["config"], None, None, None
    total_steps = spec["warmup_steps"] + max(spec["steps"], spec["probe_steps"])
    result = {"n": n, "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if config != "nonprivate":
                from idpsgd.assignment import Budgets, assign

                budgets = Budgets.from_groups([1.0, 8.0], [0.5, 0.5], n, DELTA, seed=spec["seed"])
                from torch import nn

                mode = config.split("_", 1)[1]
                if config.startswith("ours_"):
                    from idpsgd.engine import IndividualizedPrivacyEngine

                    engine = IndividualizedPrivacyEngine(seed=spec["seed"])
                    got = engine.make_private(
                        module=model,
                        optimizer=optimizer,
                        data_loader=loader,
                        budgets=budgets,
                        method="scale",
                        steps=total_steps,
                        max_grad_norm=CLIP,
                        sample_rate=b / n,
                        grad_sample_mode=mode,
                        **({"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}),
                    )
                    model, optimizer, loader = got[0], got[1], got[-1]
                    criterion = got[2] if mode == "ghost" else None
                    sigma = engine.parameters.noise_multiplier
                else:
                    from opacus import PrivacyEngine

                    sigma = assign(budgets, "scale", b / n, total_steps, CLIP, "rdp").noise_multiplier
                    got = PrivacyEngine().make_private(
                        module=model,
                        optimizer=optimizer,
                        data_loader=loader,
                        noise_multiplier=sigma,
                        max_grad_norm=CLIP,
                        poisson_sampling=True,
                        grad_sample_mode=mode,
                        **({"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}),
                    )
                    model, optimizer, loader = got[0], got[1], got[-1]
                    criterion = got[2] if mode == "ghost" else None
    except Exception as exc:  # this private mode refuses the model
        return {**result, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    cuda = device.type == "cuda"
    half = PRECISIONS[spec.get("precision", "fp32")]
    import contextlib

    def autocast():
        return torch.autocast(device.type, dtype=getattr(torch, half)) if half else contextlib.nullcontext()

    # float16: a GradScaler for non-private and bk (the engine refuses one in hooks and ghost mode, whose scaler
    # would see the un-clipped summed gradient; Opacus takes none); the others run float16 autocast without one
    scaler = torch.amp.GradScaler(device.type) if half == "float16" and config in ("nonprivate", "ours_bk") else None
    if scaler is not None:
        scaler.scale(torch.zeros((), device=device))  # makes the scale: a first empty batch calls no scale()
    result["precision"], result["grad_scaler"] = spec.get("precision", "fp32"), scaler is not None

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def batches():
        while True:
            yield from loader

    it = batches()

    def steps(count):
        examples = 0
        for _ in range(count):
            xb, yb = next(it)
            optimizer.zero_grad(set_to_none=True)
            if len(xb):
                with autocast():
                    loss = ghost_loss(criterion, model, xb, yb) if criterion is not None else loss_fn(model, xb, yb)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            elif criterion is not None:  # Opacus cannot take an empty batch through the model
                continue
            if scaler is not None:
                scaler.step(optimizer)  # ours: an empty batch is a noise-only step
                scaler.update()
            else:
                optimizer.step()
            examples += len(xb)
        return examples

    try:
        rss_setup = _maxrss_mib()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            cuda_setup = torch.cuda.memory_allocated(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps(spec["warmup_steps"] if spec["steps"] else spec["probe_steps"])
            sync()
            t, cpu = time.perf_counter(), time.process_time()
            examples = steps(spec["steps"])
            sync()
            seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    except Exception as exc:
        return {**result, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    per = max(examples, 1)
    result.update(
        {
            "steps": spec["steps"],
            "examples": examples,
            "seconds_per_example": seconds / per if spec["steps"] else None,
            "cpu_seconds_per_example": cpu / per if spec["steps"] else None,
            "noise_multiplier": sigma,
            "rss_setup_mib": rss_setup,
            "rss_peak_mib": _maxrss_mib(),
        }
    )
    result["peak_training_mib"] = result["rss_peak_mib"] - rss_setup
    if cuda:
        result["cuda_peak_training_mib"] = (torch.cuda.max_memory_allocated(device) - cuda_setup) / 2**20
    if engine is not None:
        paths = engine.layer_paths
        result["layer_paths"] = paths
        result["fallback_layers"] = sorted(k for k, v in paths.items() if "fallback" in v)
    if not np.isfinite(result["rss_peak_mib"]):
        result["error"] = "no memory reading"
    return result


# --- the comparison -----------------------------------------------------------------------------
def _freed_after(run, spec: dict) -> dict:
    """``run(spec)`` in this process, then its model, optimizer and any refused run's per-sample tensors freed
    (their reference cycles collected, CUDA's cached blocks returned) before the next configuration runs."""
    import gc

    import torch

    try:
        return run(spec)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_model(
    model: str,
    sizes: dict,
    *,
    device: str,
    repeats: int,
    threads: int,
    isolate: bool = True,
    memory: bool = True,
    log=print,
    configs: tuple = CONFIGS,
) -> dict:
    """Interleaved timing rounds, memory probes, medians and ratios for one model."""
    names = configs
    runner = (
        (lambda spec, probe=False: run_isolated(spec, probe, script=__file__))
        if isolate
        else (lambda spec, probe=False: _freed_after(run_config, spec))
    )
    raw: dict[str, list] = {c: [] for c in names}
    loads = []
    for rnd in range(repeats):
        for config in names if rnd % 2 == 0 else tuple(reversed(names)):
            spec = {"model": model, "config": config, "device": device, "threads": threads, "seed": rnd, **sizes}
            before = os.getloadavg()[0]
            r = runner(spec)
            r["load_avg_1min"] = [before, os.getloadavg()[0]]
            loads += r["load_avg_1min"]
            raw[config].append(r)
            what = r["error"] if "error" in r else f"{1e3 * r['cpu_seconds_per_example']:8.2f} cpu ms/example"
            log(f"  {model} round {rnd + 1}/{repeats} {config:<13} {what}  load {before:.2f}")
    primary = "cpu_seconds_per_example" if device == "cpu" else "seconds_per_example"
    configs = {}
    for c, runs in raw.items():
        ok = [r for r in runs if "error" not in r]
        configs[c] = (
            {"error": runs[0]["error"]}
            if not ok
            else {
                "seconds_per_example_median": statistics.median(r["seconds_per_example"] for r in ok),
                "cpu_seconds_per_example_median": statistics.median(r["cpu_seconds_per_example"] for r in ok),
                **(
                    {"layer_paths": ok[0]["layer_paths"], "fallback_layers": ok[0]["fallback_layers"]}
                    if "layer_paths" in ok[0]
                    else {}
                ),
            }
        )
    out = {
        "sizes": sizes,
        "judged_on": primary,
        "configs": configs,
        "runs": raw,
        "load_avg_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
    }
    if memory and isolate:
        probes = {}
        for config in names:
            if "error" in configs[config]:
                continue
            r = run_isolated(
                {
                    "model": model,
                    "config": config,
                    "device": device,
                    "threads": threads,
                    "seed": 0,
                    **sizes,
                    "steps": 0,
                },
                probe=True,
                script=__file__,
            )
            probes[config] = {
                k: r[k]
                for k in ("rss_peak_mib", "rss_setup_mib", "peak_training_mib", "cuda_peak_training_mib")
                if k in r
            }
            log(f"  {model} memory probe {config:<13} peak RSS {r['rss_peak_mib']:.0f} MiB")
        out["memory"] = {
            "steps": sizes["probe_steps"],
            "env": PROBE_ENV,
            "probes": probes,
            "source": "torch.cuda.max_memory_allocated" if device == "cuda" else "ru_maxrss",
        }
    out["ratios"] = ratios(out, device)
    return out


def ratios(result: dict, device: str) -> dict:
    """Time and peak memory of each private configuration that ran, over non-private's."""
    configs, primary = result["configs"], result["judged_on"]
    mem = result.get("memory", {}).get("probes", {})
    out = {}
    if "error" in configs["nonprivate"]:
        return out
    base = configs["nonprivate"][f"{primary}_median"]
    key = "cuda_peak_training_mib" if device == "cuda" else "rss_peak_mib"
    for c in [c for c in configs if c != "nonprivate"]:
        if "error" in configs[c]:
            continue
        out[f"{c}_time_vs_nonprivate"] = configs[c][f"{primary}_median"] / base
        if c in mem and "nonprivate" in mem and key in mem[c]:
            out[f"{c}_peak_memory_vs_nonprivate"] = mem[c][key] / mem["nonprivate"][key]
    return out


def verdict(result: dict) -> dict:
    """Issue 30's goals on this run, for ``ours_bk`` where it ran (None where it did not)."""
    out = {}
    for model in MODELS:
        if model not in result:
            continue
        if "ours_bk" not in result[model]["configs"]:
            continue
        r = result[model]["ratios"]
        lora = model == "gpt2_lora"
        t_goal, m_goal = (
            (TARGETS["lora_time"], TARGETS["lora_memory"]) if lora else (TARGETS["full_time"], TARGETS["full_memory"])
        )
        t, m = r.get("ours_bk_time_vs_nonprivate"), r.get("ours_bk_peak_memory_vs_nonprivate")
        out[model] = {
            "time": t,
            "time_ok": None if t is None else t <= t_goal,
            "memory": m,
            "memory_ok": None if m is None else m <= m_goal,
            "runs": "error" not in result[model]["configs"]["ours_bk"],
        }
    return out


def measure(
    *,
    device: str = "cpu",
    repeats: int = 2,
    threads: int = 1,
    smoke: bool = False,
    isolate: bool = True,
    memory: bool = True,
    models=MODELS,
    layers: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    steps: int | None = None,
    log=print,
    configs: tuple = CONFIGS,
    precision: str = "fp32",
    on_model=None,
) -> dict:
    """The whole benchmark; the dict written to ``hf_cost.json``. ``on_model``: called with the result so far
    (``partial``: True) after each model, so that a run stopped by a time limit keeps its finished models."""
    import opacus
    import torch
    import transformers

    sizes = dict(SMOKE if smoke else FULL)
    given = {"layers": layers, "batch_size": batch_size, "seq_len": seq_len, "steps": steps}
    sizes.update({k: v for k, v in given.items() if v is not None})
    sizes["n"] = max(4 * sizes["batch_size"], 64)  # Poisson rate B/n; n only sets the rate
    sizes["precision"] = precision
    t0 = time.perf_counter()
    out = {
        "device": device,
        "threads": threads,
        "repeats": repeats,
        "smoke": smoke,
        "isolated_processes": isolate,
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "targets": TARGETS,
        "clip_norm": CLIP,
        "delta": DELTA,
        "layers": sizes["layers"],
        "layers_note": (
            f"{sizes['layers']} of GPT-2 small's / BERT-base's 12 layers"
            if sizes["layers"] != 12
            else "12 layers (full size)"
        ),
        "note": (
            "interleaved rounds (order reversed every other round), a fresh process per run; per-example "
            "times cover the training steps only; the machine may be shared, see load_avg_1min per model"
        ),
    }
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    for model in models:
        out[model] = measure_model(
            model,
            sizes,
            device=device,
            repeats=repeats,
            threads=threads,
            isolate=isolate,
            memory=memory,
            log=log,
            configs=configs,
        )
        if on_model is not None and model != models[-1]:
            on_model({**out, "verdict": verdict(out), "partial": True})
    out["verdict"] = verdict(out)
    out["wall_seconds"] = time.perf_counter() - t0
    return out


@bench
def bench_hf_cost():
    """Time per example and peak memory of non-private, ours (bk, per-example budgets) and Opacus ghost
    on a GPT-2-small-shaped LM, a BERT-base-shaped classifier and GPT-2 with LoRA r=8 (CPU: 2 layers)."""
    return measure(layers=2)


def table(result: dict) -> str:
    lines = [f"layers: {result['layers_note']}; device {result['device']}"]
    for model in MODELS:
        if model not in result:
            continue
        r = result[model]
        s = r["sizes"]
        lines.append(
            f"{model} (d={s['width']}, seq {s['seq_len']}, B={s['batch_size']}; {r['judged_on']}, load avg "
            f"{r['load_avg_1min']['min']:.2f}-{r['load_avg_1min']['max']:.2f})"
        )
        mem = r.get("memory", {}).get("probes", {})
        for c in r["configs"]:
            cfg = r["configs"][c]
            if "error" in cfg:
                lines.append(f"  {c:<13} does not run: {cfg['error']}")
                continue
            m = mem.get(c, {})
            t = r["ratios"].get(f"{c}_time_vs_nonprivate", 1.0 if c == "nonprivate" else None)
            mr = r["ratios"].get(f"{c}_peak_memory_vs_nonprivate", 1.0 if c == "nonprivate" and m else None)
            lines.append(
                f"  {c:<13} {1e3 * cfg[r['judged_on'] + '_median']:>9.2f} ms/example  x{t:.2f}"
                + (
                    f"   peak {m.get('cuda_peak_training_mib', m.get('rss_peak_mib')):.0f} MiB  x{mr:.2f}"
                    if m and mr is not None
                    else ""
                )
            )
    lines.append("verdict: " + json.dumps(result.get("verdict")))
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (cuda when available)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--layers", type=int, help="transformer layers (default 12: GPT-2 small / BERT-base; fewer on CPU)")
    p.add_argument("--batch-size", type=int, help=f"expected batch size (default {FULL['batch_size']})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {FULL['seq_len']})")
    p.add_argument("--steps", type=int, help=f"timed steps per run (default {FULL['steps']})")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timing rounds (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for smoke tests (not a measurement)")
    p.add_argument(
        "--in-process", action="store_true", help="run every configuration in this process (no memory probes)"
    )
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(ALL_CONFIGS)} (default {','.join(CONFIGS)}; nonprivate first)",
    )
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp32",
        help="fp32 (default), or autocast in bf16 / fp16 (fp16: a GradScaler for nonprivate and ours_bk)",
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"result JSON (default {RESULT_PATH.relative_to(HERE.parent)}; with --smoke: none unless given)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_config(json.loads(args.worker))))
        return None

    from idpsgd.io import write_json
    from idpsgd.validation import InvalidParameterError

    device = resolve_device(args.device)
    models = parse_models(args.models, MODELS)
    for name in ("layers", "batch_size", "seq_len", "steps", "repeats", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise InvalidParameterError(name, v, "must be an integer >= 1")
    configs = tuple(c for c in args.configs.split(",") if c)
    if not configs or configs[0] != "nonprivate" or not set(configs) <= set(ALL_CONFIGS):
        raise InvalidParameterError(
            "configs", args.configs, f"must be nonprivate followed by some of {', '.join(ALL_CONFIGS[1:])}"
        )
    if args.seq_len is not None and args.seq_len < 2:
        raise InvalidParameterError("seq_len", args.seq_len, "must be >= 2 (a language model predicts the next token)")
    out = args.out if args.out is not None else (None if args.smoke else RESULT_PATH)
    head = {"benchmark": "hf_cost", "machine": platform.platform(), "python": platform.python_version()}
    result = {
        **head,
        **measure(
            device=device,
            repeats=args.repeats,
            threads=args.threads,
            smoke=args.smoke,
            isolate=not args.in_process,
            memory=not args.no_memory and not args.in_process,
            models=models,
            layers=args.layers,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            steps=args.steps,
            log=lambda s: print(s, file=sys.stderr),
            configs=configs,
            precision=args.precision,
            on_model=None if out is None else (lambda partial: write_json(out, {**head, **partial})),
        ),
    }
    if out is not None:
        write_json(out, result)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
