"""Private training at near non-private cost (issue 23): seconds per epoch and peak memory of
non-private SGD, Opacus 1.6 (hooks, ghost) and the engine (hooks, book-keeping), and the cost of one
individual-accounting norm refresh over all examples, in one run.

Configurations (same model, data, loop, clip norm, expected batch size and — for the private ones —
Poisson sampling):

* ``nonprivate`` — plain SGD over a shuffled DataLoader of batch size B;
* ``opacus_hooks`` / ``opacus_ghost`` — Opacus 1.6 ``PrivacyEngine().make_private`` (per-sample
  gradients by hooks; fast gradient clipping with its two backward passes), at the σ of our
  *Scale* calibration;
* ``ours_hooks`` / ``ours_bk`` — ``IndividualizedPrivacyEngine.make_private`` with IDP-SGD *Scale*
  (demo budgets 1/2/3 at 34/43/23 %: three different clip norms, so a clip norm per example) with
  ``grad_sample_mode`` "hooks" (the previous default) and "bk" (book-keeping with mixed ghost norms,
  ``idpsgd.engine.per_example.bk.keeper``);
* ``refresh_before`` / ``refresh_bk`` — one individual-accounting norm refresh over all n examples
  (batches of 256, eval mode, no parameter update): the previous release's norm pass (Opacus's
  ``GradSampleModuleFastGradientClipping``, reproduced here) and the book-keeper's
  (``engine.individual.grad_norms()``); its cost is compared with one non-private epoch.

Models: ``cifar_cnn`` — the registry's ``tramer_boneh_cifar10`` on random CIFAR-shaped tensors
(3×32×32, 10 classes); ``wrn16`` — WideResNet-16-k with GroupNorm (``idpsgd.models.wide_resnet``;
De et al. 2022 train WRN-16-4; the CPU default is a narrower width, ``--wrn-width``); ``transformer`` —
``idpsgd.models.TransformerClassifier`` (2 encoder layers, d = 128, sequences of 64 tokens of a
10,000-token vocabulary, 2 classes).

Every run is a fresh subprocess (one configuration and batch size): warm-up steps, then timed
epochs of the training loop only.  Rounds interleave the configurations (order reversed every other
round) so that drift from other jobs hits all of them alike; we report medians and ratios to
``nonprivate`` (CPU seconds of one torch thread on the CPU — on a shared machine CPU time measures
the work, wall time the neighbours too; wall seconds on CUDA).  Peak memory comes from separate
probes (a few training steps in a fresh process with glibc's mmap threshold fixed, so freed tensors
are returned at once): the process's peak RSS (``ru_maxrss``), total and above the set-up, and on
CUDA ``torch.cuda.max_memory_allocated``.

Usage::

    python bench/bench_engine.py [--models cifar_cnn,wrn16,transformer] [--batch-sizes 256,1024]
                                 [--repeats 2] [--device cpu|cuda] [--quick] [--out PATH]
    python bench/run.py engine_cost           # the same with the defaults (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import bench, parse_models, resolve_device

RESULT_PATH = HERE / "results" / "engine_cost.json"
DELTA = 1e-5
CLIP = 1.0
TRAINING = ("nonprivate", "opacus_hooks", "opacus_ghost", "ours_hooks", "ours_bk")
REFRESH = ("refresh_before", "refresh_bk")
REFRESH_BATCH = 256
#: issue 23's targets: bk time and memory against non-private, a refresh against one epoch
TARGETS = {"bk_time_vs_nonprivate": 1.25, "bk_peak_memory_vs_nonprivate": 1.2, "refresh_vs_epoch": 1.3}
#: per model: examples, timed epochs per run, warm-up steps, memory-probe steps, model options
FULL = {
    "cifar_cnn": {"n": 5000, "epochs": 1, "warmup_steps": 2, "probe_steps": 3},
    "wrn16": {"n": 2048, "epochs": 1, "warmup_steps": 1, "probe_steps": 2, "width": 2},
    "transformer": {
        "n": 4096,
        "epochs": 1,
        "warmup_steps": 2,
        "probe_steps": 3,
        "vocab": 10000,
        "length": 64,
        "dim": 128,
        "layers": 2,
    },
}
QUICK = {
    "cifar_cnn": {"n": 96, "epochs": 1, "warmup_steps": 1, "probe_steps": 1},
    "wrn16": {"n": 64, "epochs": 1, "warmup_steps": 1, "probe_steps": 1, "width": 1},
    "transformer": {
        "n": 96,
        "epochs": 1,
        "warmup_steps": 1,
        "probe_steps": 1,
        "vocab": 100,
        "length": 16,
        "dim": 32,
        "layers": 1,
    },
}
#: glibc's dynamic mmap threshold keeps freed tensor memory in the heap, so ``ru_maxrss`` overstates
#: (and scatters) the peak of live memory; the memory probes fix the threshold so that every block
#: over 64 KiB is mapped and unmapped with its tensor.
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# --- one configuration (runs in a fresh subprocess) -------------------------------------------
def _data_and_model(spec: dict):
    import torch

    from idpsgd.models import TransformerClassifier, create_model, wide_resnet

    n, g = spec["n"], torch.Generator().manual_seed(10_000 + spec["seed"])
    torch.manual_seed(spec["seed"])
    if spec["model"] == "transformer":
        x = torch.randint(0, spec["vocab"], (n, spec["length"]), generator=g)
        y = torch.randint(0, 2, (n,), generator=g)
        return (
            x,
            y,
            TransformerClassifier(
                spec["vocab"],
                2,
                max_length=spec["length"],
                dim=spec["dim"],
                heads=4,
                layers=spec["layers"],
                ff_dim=2 * spec["dim"],
            ),
        )
    x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    if spec["model"] == "wrn16":
        return x, y, wide_resnet((3, 32, 32), 10, depth=16, width=spec["width"])
    if spec["model"] == "cifar_cnn":
        return x, y, create_model("tramer_boneh_cifar10", (3, 32, 32), 10)
    raise ValueError(f"unknown model {spec['model']!r}")


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _private(spec, model, optimizer, loader, n):
    """(module, optimizer, criterion, loader, engine or None, σ) of a private configuration."""
    from torch import nn

    from idpsgd.assignment import assign
    from idpsgd.cli.train_commands import demo_budgets
    from idpsgd.engine import IndividualAccountingOptions, IndividualizedPrivacyEngine

    config, q = spec["config"], 1.0 / len(loader)  # Opacus's Poisson rate for this loader
    budgets = demo_budgets(n, DELTA, spec["seed"])
    planned = (spec["epochs"] + 1) * len(loader)  # the warm-up steps fit in the extra epoch
    if config.startswith("opacus"):
        from opacus import PrivacyEngine

        sigma = assign(budgets, "scale", q, planned, CLIP, "rdp").noise_multiplier  # ours' σ (Scale)
        mode = config.split("_")[1]
        out = PrivacyEngine().make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=CLIP,
            poisson_sampling=True,
            grad_sample_mode=mode,
            criterion=nn.CrossEntropyLoss(),
        )
        if mode == "ghost":
            return (*out, None, sigma)
        return out[0], out[1], nn.CrossEntropyLoss(), out[2], None, sigma
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=spec["seed"])
    mode = "bk" if config in ("ours_bk", "refresh_bk") else "hooks"
    if config == "refresh_bk":
        engine.enable_individual_accounting(IndividualAccountingOptions(refreshes_per_epoch=1, validate_subset=0))
    module, opt, data = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        budgets=budgets,
        method="scale",
        steps=planned,
        max_grad_norm=CLIP,
        sample_rate=q,
        grad_sample_mode=mode,
    )
    return module, opt, nn.CrossEntropyLoss(), data, engine, engine.parameters.noise_multiplier


def _refresh_before(model, x, y):
    """The previous release's norm pass: Opacus's fast-gradient-clipping module (ghost norms for
    Linear/Embedding, per-sample gradients otherwise), loss mean-reduced as Opacus rescales it."""
    import torch
    import torch.nn.functional as F
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    from idpsgd.engine.per_example.norms import _clear, eval_mode_with_hooks

    fast = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean", use_ghost_clipping=True)

    def run():
        out = []
        with eval_mode_with_hooks(model):
            for s in range(0, len(y), REFRESH_BATCH):
                F.cross_entropy(fast(x[s : s + REFRESH_BATCH]), y[s : s + REFRESH_BATCH]).backward()
                out.append(fast.get_norm_sample().detach())
                _clear(model)
        return torch.cat(out)

    return run


def run_config(spec: dict) -> dict:
    """Train one configuration at one batch size: warm-up steps, then ``spec['epochs']`` timed epochs
    (``epochs`` 0: a memory probe of ``probe_steps`` steps); a refresh configuration times norm passes."""
    import warnings

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    x, y, model = _data_and_model(spec)
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    n = len(y)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=spec["batch_size"],
        shuffle=spec["config"] == "nonprivate",
        generator=torch.Generator().manual_seed(spec["seed"]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, sigma = None, None
        if spec["config"] == "nonprivate":
            criterion = nn.CrossEntropyLoss()
        elif spec["config"] == "refresh_before":
            refresh = _refresh_before(model, x, y)
        else:
            model, optimizer, criterion, loader, engine, sigma = _private(spec, model, optimizer, loader, n)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def loop(limit=None):
        steps = examples = 0
        for xb, yb in loader:
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            optimizer.step()
            steps, examples = steps + 1, examples + len(yb)
            if limit is not None and steps >= limit:
                break
        return steps, examples

    if spec["config"] == "refresh_bk":

        def refresh():
            return torch.as_tensor(engine.individual.grad_norms()[0])

    rss_setup = _maxrss_mib()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        cuda_setup = torch.cuda.memory_allocated(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        if spec["config"].startswith("refresh"):
            refresh()  # warm-up pass
            sync()
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(max(1, spec["epochs"])):
                norms = refresh()
            sync()
            seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
            reps = max(1, spec["epochs"])
            result = {
                "seconds_per_epoch": seconds / reps,
                "cpu_seconds_per_epoch": cpu / reps,
                "examples_per_epoch": int(norms.numel()),
            }
        else:
            loop(spec["warmup_steps"] if spec["epochs"] else spec["probe_steps"])
            sync()
            steps = examples = 0
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(spec["epochs"]):
                s, e = loop()
                steps, examples = steps + s, examples + e
            sync()
            seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
            ep = spec["epochs"]
            result = {
                "seconds_per_epoch": seconds / ep if ep else None,
                "cpu_seconds_per_epoch": cpu / ep if ep else None,
                "steps_per_epoch": steps / ep if ep else None,
                "examples_per_epoch": examples / ep if ep else None,
            }
    result.update({"noise_multiplier": sigma, "n": n, "rss_setup_mib": rss_setup, "rss_peak_mib": _maxrss_mib()})
    result["peak_training_mib"] = result["rss_peak_mib"] - rss_setup
    if engine is not None:
        result["layer_paths"] = engine.layer_paths_taken  # the bench's synthetic data: not private
    if cuda:
        result["cuda_peak_training_mib"] = (torch.cuda.max_memory_allocated(device) - cuda_setup) / 2**20
    return result


def run_isolated(spec: dict, probe: bool = False, script=None) -> dict:
    """:func:`run_config` in a fresh Python process (its ``ru_maxrss`` is this configuration's own);
    ``probe``: with :data:`PROBE_ENV` (the memory probes).  ``script``: another benchmark with the
    same ``--worker SPEC`` entry point (default this one)."""
    env = os.environ | {"PYTHONWARNINGS": "ignore"} | (PROBE_ENV if probe else {})
    script = Path(script or __file__).resolve()
    proc = subprocess.run(
        [sys.executable, str(script), "--worker", json.dumps(spec)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {spec}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the comparison ---------------------------------------------------------------------------
def _runs(batch_sizes, configs=TRAINING + REFRESH) -> list[tuple[str, int]]:
    """(configuration, batch size) pairs of one round: every training configuration of ``configs`` at every
    batch size, its refreshes (and their non-private reference) at the refresh batch size."""
    runs = [(c, b) for b in batch_sizes for c in TRAINING if c in configs]
    refresh = [(c, REFRESH_BATCH) for c in REFRESH if c in configs]
    if refresh and ("nonprivate", REFRESH_BATCH) not in runs:
        runs.append(("nonprivate", REFRESH_BATCH))
    return runs + refresh


def _key(config: str, batch: int) -> str:
    return f"{config}@{batch}"


def measure_model(
    model: str,
    sizes: dict,
    batch_sizes,
    *,
    device: str,
    repeats: int,
    threads: int,
    isolate: bool = True,
    memory: bool = True,
    configs=TRAINING + REFRESH,
    log=print,
) -> dict:
    """Interleaved timing rounds, memory probes at every batch size, medians and ratios for one model
    (the configurations ``configs``, non-private first)."""
    runner = run_isolated if isolate else run_config
    runs = _runs(batch_sizes, configs)
    raw: dict[str, list] = {_key(c, b): [] for c, b in runs}
    loads = []
    for rnd in range(repeats):
        for config, batch in runs if rnd % 2 == 0 else list(reversed(runs)):
            spec = {
                "model": model,
                "config": config,
                "batch_size": batch,
                "device": device,
                "threads": threads,
                "seed": rnd,
                **sizes,
            }
            before = os.getloadavg()[0]
            r = runner(spec)
            r["load_avg_1min"] = [before, os.getloadavg()[0]]
            loads += r["load_avg_1min"]
            raw[_key(config, batch)].append(r)
            log(
                f"  {model} round {rnd + 1}/{repeats} {_key(config, batch):<22} {r['seconds_per_epoch']:8.3f} s/epoch "
                f"(cpu {r['cpu_seconds_per_epoch']:8.3f})  load {before:.2f}"
            )
    primary = "cpu_seconds_per_epoch" if device == "cpu" else "seconds_per_epoch"
    summaries = {k: _summary(v) for k, v in raw.items()}
    out = {
        "sizes": sizes,
        "batch_sizes": list(batch_sizes),
        "repeats": repeats,
        "judged_on": primary,
        "configs": summaries,
        "runs": raw,
        "load_avg_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
    }
    if memory and isolate:
        out["memory"] = _memory_probes(model, sizes, batch_sizes, device, threads, log, configs)
    out["ratios"] = _ratios(out, batch_sizes, primary, device)
    return out


def _summary(runs: list[dict]) -> dict:
    out = {
        "seconds_per_epoch_median": statistics.median(r["seconds_per_epoch"] for r in runs),
        "cpu_seconds_per_epoch_median": statistics.median(r["cpu_seconds_per_epoch"] for r in runs),
        "examples_per_epoch_median": statistics.median(r["examples_per_epoch"] for r in runs),
    }
    if runs[0].get("layer_paths"):
        out["layer_paths"] = runs[0]["layer_paths"]
    return out


def _memory_probes(model, sizes, batch_sizes, device, threads, log, configs=TRAINING) -> dict:
    probes = {}
    for batch in batch_sizes:
        for config in (c for c in TRAINING if c in configs):
            spec = {
                "model": model,
                "config": config,
                "batch_size": batch,
                "device": device,
                "threads": threads,
                "seed": 0,
                **sizes,
                "epochs": 0,
            }
            r = run_isolated(spec, probe=True)
            probes[_key(config, batch)] = {
                k: r[k]
                for k in ("rss_peak_mib", "rss_setup_mib", "peak_training_mib", "cuda_peak_training_mib")
                if k in r
            }
            log(
                f"  {model} memory probe {_key(config, batch):<22} peak RSS {r['rss_peak_mib']:.0f} MiB "
                f"(+{r['peak_training_mib']:.0f} above set-up)"
            )
    return {
        "steps": sizes["probe_steps"],
        "env": PROBE_ENV,
        "probes": probes,
        "source": f"{sizes['probe_steps']} training steps in a fresh process per configuration, "
        + ("torch.cuda.max_memory_allocated" if device == "cuda" else "ru_maxrss"),
    }


def _ratios(result: dict, batch_sizes, primary: str, device: str) -> dict:
    configs, mem = result["configs"], result.get("memory", {}).get("probes", {})
    training = [c for c in TRAINING[1:] if _key(c, batch_sizes[0]) in configs]
    out = {}
    for batch in batch_sizes:
        base = configs[_key("nonprivate", batch)][f"{primary}_median"]
        entry = {f"{c}_time_vs_nonprivate": configs[_key(c, batch)][f"{primary}_median"] / base for c in training}
        if "ours_bk" in training and "opacus_hooks" in training:
            entry["bk_vs_opacus_hooks_time"] = (
                configs[_key("ours_bk", batch)][f"{primary}_median"]
                / configs[_key("opacus_hooks", batch)][f"{primary}_median"]
            )
        if mem:
            key = "cuda_peak_training_mib" if device == "cuda" else "rss_peak_mib"
            np_mem = mem[_key("nonprivate", batch)][key]
            entry.update({f"{c}_peak_memory_vs_nonprivate": mem[_key(c, batch)][key] / np_mem for c in training})
            if device != "cuda":
                np_train = mem[_key("nonprivate", batch)]["peak_training_mib"]
                entry.update(
                    {
                        f"{c}_training_memory_vs_nonprivate": mem[_key(c, batch)]["peak_training_mib"] / np_train
                        for c in training
                    }
                )
        out[f"B={batch}"] = entry
    refresh = [c for c in REFRESH if _key(c, REFRESH_BATCH) in configs]
    if refresh:
        epoch = configs[_key("nonprivate", REFRESH_BATCH)][f"{primary}_median"]
        out["refresh"] = {
            f"{c}_vs_nonprivate_epoch": configs[_key(c, REFRESH_BATCH)][f"{primary}_median"] / epoch for c in refresh
        }
    return out


def verdict(result: dict) -> dict:
    """Issue 23's targets on this run: CIFAR CNN bk ≤ 1.25× non-private time (every batch size) and
    ≤ 1.2× non-private peak memory at the largest batch size; bk no slower than Opacus hooks on any
    model; a refresh ≤ 1.3× one non-private epoch."""
    out = {}
    cnn = result.get("cifar_cnn")
    if cnn and "ours_bk_time_vs_nonprivate" in cnn["ratios"][f"B={cnn['batch_sizes'][0]}"]:
        r = cnn["ratios"]
        out["cifar_cnn_bk_time"] = {b: r[f"B={b}"]["ours_bk_time_vs_nonprivate"] for b in cnn["batch_sizes"]}
        out["cifar_cnn_bk_time_ok"] = all(
            v <= TARGETS["bk_time_vs_nonprivate"] for v in out["cifar_cnn_bk_time"].values()
        )
        big = f"B={max(cnn['batch_sizes'])}"
        if "ours_bk_peak_memory_vs_nonprivate" in r[big]:
            out["cifar_cnn_bk_peak_memory"] = r[big]["ours_bk_peak_memory_vs_nonprivate"]
            out["cifar_cnn_bk_peak_memory_ok"] = (
                out["cifar_cnn_bk_peak_memory"] <= TARGETS["bk_peak_memory_vs_nonprivate"]
            )
    ran = [m for m in FULL if m in result]
    models = [m for m in ran if "bk_vs_opacus_hooks_time" in result[m]["ratios"][f"B={result[m]['batch_sizes'][0]}"]]
    if models:
        out["bk_vs_opacus_hooks"] = {
            m: {b: result[m]["ratios"][f"B={b}"]["bk_vs_opacus_hooks_time"] for b in result[m]["batch_sizes"]}
            for m in models
        }
        out["bk_no_slower_than_opacus_hooks"] = all(
            v <= 1.0 for m in models for v in out["bk_vs_opacus_hooks"][m].values()
        )
    models = [m for m in ran if "refresh_bk_vs_nonprivate_epoch" in result[m]["ratios"].get("refresh", {})]
    if models:
        out["refresh_bk_vs_epoch"] = {
            m: result[m]["ratios"]["refresh"]["refresh_bk_vs_nonprivate_epoch"] for m in models
        }
        out["refresh_ok"] = all(v <= TARGETS["refresh_vs_epoch"] for v in out["refresh_bk_vs_epoch"].values())
    return out


def measure(
    *,
    device: str = "cpu",
    repeats: int = 2,
    threads: int = 1,
    quick: bool = False,
    isolate: bool = True,
    memory: bool = True,
    models=tuple(FULL),
    batch_sizes=(256, 1024),
    wrn_width: int | None = None,
    configs=TRAINING + REFRESH,
    log=print,
) -> dict:
    """The whole benchmark (the configurations ``configs``: all by default); the dict written to
    ``engine_cost.json``."""
    import opacus
    import torch

    sizes = {m: dict(s) for m, s in (QUICK if quick else FULL).items()}
    if wrn_width is not None:
        sizes["wrn16"]["width"] = wrn_width
    if quick:
        batch_sizes = tuple(sorted({min(b, 32) for b in batch_sizes}))
    t0 = time.perf_counter()
    out = {
        "device": device,
        "threads": threads,
        "repeats": repeats,
        "quick": quick,
        "isolated_processes": isolate,
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "cpu_count": os.cpu_count(),
        "targets": TARGETS,
        "clip_norm": CLIP,
        "delta": DELTA,
        "refresh_batch_size": REFRESH_BATCH,
        "configs": list(configs),
        "note": (
            "interleaved rounds (order reversed every other round), a fresh process per run; seconds per "
            "epoch cover the training loop only; the machine may be shared, see load_avg_1min per model"
        ),
    }
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    for model in models:
        out[model] = measure_model(
            model,
            sizes[model],
            batch_sizes,
            device=device,
            repeats=repeats,
            threads=threads,
            isolate=isolate,
            memory=memory,
            configs=configs,
            log=log,
        )
    out["verdict"] = verdict(out)
    out["wall_seconds"] = time.perf_counter() - t0
    return out


@bench
def bench_engine_cost():
    """Seconds per epoch and peak memory of non-private, Opacus (hooks, ghost) and ours (hooks, bk) on
    the CIFAR CNN, a GroupNorm WideResNet and a transformer, B = 256 and 1024; norm refresh vs epoch."""
    return measure()


def table(result: dict) -> str:
    """Plain-text tables: per model and batch size, time and memory against non-private."""
    lines = []
    for model in FULL:
        if model not in result:
            continue
        r = result[model]
        la = r["load_avg_1min"]
        lines.append(f"{model} n={r['sizes']['n']} ({r['judged_on']}, load avg {la['min']:.2f}-{la['max']:.2f})")
        lines.append(
            f"  {'config':<14} {'B':>5} {'s/epoch':>9} {'cpu s/ep':>9} {'x nonpriv':>9} {'peak RSS':>9} "
            f"{'x nonpriv':>9}"
        )
        mem = r.get("memory", {}).get("probes", {})
        for batch in r["batch_sizes"]:
            base = r["configs"][_key("nonprivate", batch)][f"{r['judged_on']}_median"]
            for c in (c for c in TRAINING if _key(c, batch) in r["configs"]):
                cfg = r["configs"][_key(c, batch)]
                m = mem.get(_key(c, batch), {})
                np_m = mem.get(_key("nonprivate", batch), {})
                mem_txt = f"{m['rss_peak_mib']:>9.0f} {m['rss_peak_mib'] / np_m['rss_peak_mib']:>9.2f}" if m else ""
                ratio = cfg[r["judged_on"] + "_median"] / base
                lines.append(
                    f"  {c:<14} {batch:>5} {cfg['seconds_per_epoch_median']:>9.2f} "
                    f"{cfg['cpu_seconds_per_epoch_median']:>9.2f} {ratio:>9.2f} {mem_txt}"
                )
        for c in (c for c in REFRESH if _key(c, REFRESH_BATCH) in r["configs"]):
            cfg = r["configs"][_key(c, REFRESH_BATCH)]
            ratio = r["ratios"]["refresh"][f"{c}_vs_nonprivate_epoch"]
            lines.append(
                f"  {c:<14} {'':>5} {cfg['seconds_per_epoch_median']:>9.2f} "
                f"{cfg['cpu_seconds_per_epoch_median']:>9.2f} {ratio:>9.2f}   (one pass over all examples "
                f"vs one non-private epoch)"
            )
    if "verdict" in result:
        lines.append("verdict: " + json.dumps(result["verdict"]))
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (cuda when available)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timing rounds (default 2)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads per run (default 1: on a shared machine CPU seconds of one thread measure the work)",
    )
    p.add_argument("--models", default=",".join(FULL), help=f"comma-separated subset of {','.join(FULL)}")
    p.add_argument("--batch-sizes", default="256,1024", help="comma-separated batch sizes (default 256,1024)")
    p.add_argument(
        "--wrn-width",
        type=int,
        default=None,
        help=f"width of the WideResNet-16 (default {FULL['wrn16']['width']} on the CPU; De et al. use 4)",
    )
    p.add_argument(
        "--configs",
        default=",".join(TRAINING + REFRESH),
        help=f"comma-separated configurations, nonprivate first (default all: {','.join(TRAINING + REFRESH)})",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests (not a measurement)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every configuration in this process (faster start; no memory probes)",
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"result JSON (default {RESULT_PATH.relative_to(HERE.parent)}; with --quick: none unless given)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_config(json.loads(args.worker))))
        return None

    from idpsgd.io import write_json
    from idpsgd.validation import InvalidParameterError

    device = resolve_device(args.device)
    if args.repeats < 1:
        raise InvalidParameterError("repeats", args.repeats, "must be an integer >= 1")
    if args.threads < 1:
        raise InvalidParameterError("threads", args.threads, "must be an integer >= 1")
    models = parse_models(args.models, FULL)
    try:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b)
    except ValueError:
        batch_sizes = ()
    if not batch_sizes or min(batch_sizes) < 1:
        raise InvalidParameterError("batch_sizes", args.batch_sizes, "must be comma-separated integers >= 1")
    configs = tuple(c for c in args.configs.split(",") if c)
    if not configs or configs[0] != "nonprivate" or not set(configs) <= set(TRAINING + REFRESH):
        raise InvalidParameterError(
            "configs", args.configs, f"must be nonprivate followed by some of {', '.join(TRAINING[1:] + REFRESH)}"
        )
    if args.wrn_width is not None and args.wrn_width < 1:
        raise InvalidParameterError("wrn_width", args.wrn_width, "must be an integer >= 1")
    result = {
        "benchmark": "engine_cost",
        "machine": platform.platform(),
        "python": platform.python_version(),
        **measure(
            device=device,
            repeats=args.repeats,
            threads=args.threads,
            quick=args.quick,
            isolate=not args.in_process,
            memory=not args.no_memory and not args.in_process,
            models=models,
            batch_sizes=batch_sizes,
            wrn_width=args.wrn_width,
            configs=configs,
            log=lambda s: print(s, file=sys.stderr),
        ),
    }
    out = args.out if args.out is not None else (None if args.quick else RESULT_PATH)
    if out is not None:
        write_json(out, result)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
