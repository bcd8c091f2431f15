"""Engine against Opacus (issue 11, Bench): seconds per epoch and peak memory.

Compared on the same model, data, loop, σ, clip norm c = 1 and expected batch size, both with
Poisson sampling:

* ours — ``IndividualizedPrivacyEngine.make_private`` (IDP-SGD *Sample* and *Scale*, Boenisch et
  al. 2023 §3.3/§3.4; demo budgets 1/2/3 at 34/43/23 %, δ = 1e-5), ``grad_sample_mode`` "hooks"
  and "ghost";
* Opacus 1.6 — ``PrivacyEngine().make_private`` (hooks, and ``grad_sample_mode="ghost"``), at the
  noise multiplier our *Sample* calibration gives.

Opacus's Poisson loader samples at q = 1/len(data_loader) for len(data_loader) steps per epoch;
ours is given the same mean rate (``sample_rate=1/len(data_loader)``), so both have the same
expected batch size Σ q_i and steps per epoch.  Models: the digits CNN (``digits_cnn``, the
registry's digits default) on sklearn digits, and Opacus's CIFAR-10 example CNN on random
CIFAR-shaped tensors (3×32×32, 10 classes).

Every measurement runs in a fresh subprocess (one configuration each): a few warm-up steps, then
timed epochs (only the training loop: no evaluation, no calibration).  Peak memory is the
subprocess's ``ru_maxrss`` at the end minus its ``ru_maxrss`` after set-up (before the first
step) — the training's high-water mark above the data and model (on CUDA also
``torch.cuda.max_memory_allocated``).  Repetitions interleave the configurations (order
reversed every other round: A B C … C B A …) so that drift from other jobs on the machine hits
all of them alike; we report medians, the ratio of medians and the median of the per-round
paired ratios, plus the load average seen around every run.

Usage::

    python bench/bench_engine.py [--device cpu|cuda] [--repeats 5] [--quick] [--out PATH]
    python bench/run.py engine_vs_opacus        # the same with the defaults (CPU)
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

from common import bench

RESULT_PATH = HERE / "results" / "engine_vs_opacus.json"
TARGET_RATIO = 1.05
DELTA = 1e-5
CLIP = 1.0
#: (implementation, IDP-SGD method, grad_sample_mode); Opacus has no method.
CONFIGS = (("opacus", None, "hooks"), ("ours", "sample", "hooks"), ("ours", "scale", "hooks"),
           ("opacus", None, "ghost"), ("ours", "sample", "ghost"), ("ours", "scale", "ghost"))
#: per model: dataset size (None: all of digits' training split), batch size, timed epochs
FULL = {"digits": {"n": None, "batch_size": 128, "epochs": 5, "warmup_steps": 3, "repeats": 4, "memory_rounds": 1},
        "cifar": {"n": 5000, "batch_size": 250, "epochs": 1, "warmup_steps": 2, "repeats": 3, "memory_rounds": 1}}
QUICK = {"digits": {"n": 256, "batch_size": 64, "epochs": 1, "warmup_steps": 1, "repeats": 1, "memory_rounds": 0},
         "cifar": {"n": 128, "batch_size": 32, "epochs": 1, "warmup_steps": 1, "repeats": 1, "memory_rounds": 0}}
#: glibc's dynamic mmap threshold keeps freed tensor memory in the heap, so ``ru_maxrss`` overstates
#: (and scatters) the peak of live memory; the memory probes fix the threshold so that every block
#: over 64 KiB is mapped and unmapped with its tensor.
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def label(impl: str, method: str | None, mode: str) -> str:
    return f"{impl}_{method}_{mode}" if method else f"{impl}_{mode}"


# --- one configuration (runs in a fresh subprocess) -------------------------------------------
def cifar_convnet(num_classes: int = 10):
    """Opacus's CIFAR-10 example CNN (examples/cifar10.py ``convnet``)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(), nn.Linear(128, num_classes))


def _data_and_model(spec: dict):
    import torch

    if spec["model"] == "digits":
        from idpsgd.data import load_dataset
        from idpsgd.models import create_model

        data = load_dataset("digits")
        x, y = data.x_train, data.y_train
        if spec["n"] is not None:
            x, y = x[:spec["n"]], y[:spec["n"]]
        torch.manual_seed(spec["seed"])
        return x, y, create_model("digits_cnn", data.input_shape, data.num_classes)
    if spec["model"] == "cifar":
        g = torch.Generator().manual_seed(10_000 + spec["seed"])
        x = torch.randn(spec["n"], 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (spec["n"],), generator=g)
        torch.manual_seed(spec["seed"])
        return x, y, cifar_convnet(10)
    raise ValueError(f"unknown model {spec['model']!r}")


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0     # Linux: KiB


def run_config(spec: dict) -> dict:
    """Train one configuration: warm-up steps, then ``spec['epochs']`` timed epochs."""
    import warnings

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd.assignment import assign
    from idpsgd.cli.train_commands import demo_budgets
    from idpsgd.engine import IndividualizedPrivacyEngine

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    x, y, model = _data_and_model(spec)
    model = model.to(device)
    n = len(y)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=spec["batch_size"])
    q = 1.0 / len(loader)                              # Opacus's Poisson rate for this loader
    planned = spec["epochs"] + 1                       # the warm-up steps fit in the extra epoch
    budgets = demo_budgets(n, DELTA, spec["seed"])
    mode = spec["mode"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec["impl"] == "ours":
            engine = IndividualizedPrivacyEngine(accountant="rdp", seed=spec["seed"])
            out = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, budgets=budgets,
                                      method=spec["method"], epochs=planned, max_grad_norm=CLIP, sample_rate=q,
                                      grad_sample_mode=mode)
            sigma = engine.parameters["noise_multiplier"]
            ebs = engine.parameters["expected_batch_size"]
        else:
            from opacus import PrivacyEngine

            sigma = assign(budgets, "sample", q, planned * len(loader), CLIP, "rdp").noise_multiplier
            out = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                               noise_multiplier=sigma, max_grad_norm=CLIP, poisson_sampling=True,
                                               grad_sample_mode=mode, criterion=nn.CrossEntropyLoss())
            ebs = out[1].expected_batch_size
    if mode == "ghost":
        model, optimizer, criterion, loader = out
    else:
        (model, optimizer, loader), criterion = out, nn.CrossEntropyLoss()

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def loop(limit=None):
        steps = examples = 0
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            optimizer.step()
            steps += 1
            examples += len(yb)
            if limit is not None and steps >= limit:
                break
        return steps, examples

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _timed_training(spec, loop, sync, device, sigma, ebs, n)


def _timed_training(spec, loop, sync, device, sigma, ebs, n) -> dict:
    import torch

    cuda = device.type == "cuda"
    rss_setup = _maxrss_mib()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        cuda_setup = torch.cuda.memory_allocated(device)
    loop(spec["warmup_steps"])
    sync()
    epochs = spec["epochs"]                  # 0: a memory probe (warm-up steps only, nothing timed)
    steps = examples = 0
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        s, e = loop()
        steps, examples = steps + s, examples + e
    sync()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    result = {"seconds_per_epoch": seconds / epochs if epochs else None,
              "cpu_seconds_per_epoch": cpu / epochs if epochs else None,
              "steps_per_epoch": steps / epochs if epochs else None,
              "examples_per_epoch": examples / epochs if epochs else None, "noise_multiplier": float(sigma),
              "expected_batch_size": float(ebs), "n": n, "rss_setup_mib": rss_setup, "rss_peak_mib": _maxrss_mib()}
    result["peak_training_mib"] = result["rss_peak_mib"] - rss_setup
    if cuda:
        result["cuda_peak_training_mib"] = (torch.cuda.max_memory_allocated(device) - cuda_setup) / 2**20
    return result


def run_isolated(spec: dict, probe: bool = False) -> dict:
    """:func:`run_config` in a fresh Python process (so ``ru_maxrss`` is this configuration's own);
    ``probe``: with :data:`PROBE_ENV` (the memory probes)."""
    env = os.environ | {"PYTHONWARNINGS": "ignore"} | (PROBE_ENV if probe else {})
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                          check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {spec}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the comparison ---------------------------------------------------------------------------
def _summary(runs: list[dict]) -> dict:
    sec = [r["seconds_per_epoch"] for r in runs]
    cpu = [r["cpu_seconds_per_epoch"] for r in runs]
    mem = [r["peak_training_mib"] for r in runs]
    out = {"seconds_per_epoch_median": statistics.median(sec), "seconds_per_epoch": sec,
           "cpu_seconds_per_epoch_median": statistics.median(cpu), "cpu_seconds_per_epoch": cpu,
           "steps_per_epoch": statistics.median(r["steps_per_epoch"] for r in runs),
           "examples_per_epoch_median": statistics.median(r["examples_per_epoch"] for r in runs),
           "peak_training_mib_median": statistics.median(mem), "peak_training_mib": mem,
           "rss_peak_mib_median": statistics.median(r["rss_peak_mib"] for r in runs),
           "noise_multiplier": runs[0]["noise_multiplier"], "expected_batch_size": runs[0]["expected_batch_size"]}
    if "cuda_peak_training_mib" in runs[0]:
        out["cuda_peak_training_mib_median"] = statistics.median(r["cuda_peak_training_mib"] for r in runs)
    return out


def _ratio(raw: dict, configs: dict, name: str, base: str, metric: str) -> dict:
    paired = [a[metric] / b[metric] for a, b in zip(raw[name], raw[base])]
    ratio = configs[name][f"{metric}_median"] / configs[base][f"{metric}_median"]
    return {"ratio_of_medians": ratio, "median_paired_ratio": statistics.median(paired), "paired_ratios": paired}


def compare(model: str, sizes: dict, *, device: str, repeats: int, threads: int, isolate: bool = True,
            memory_rounds: int = 0, log=print) -> dict:
    """All :data:`CONFIGS` on one model, ``repeats`` interleaved rounds; medians, ratios, memory.

    The target is judged on CPU seconds on the CPU (wall seconds on a shared machine measure the
    other jobs as much as ours) and on wall seconds on CUDA; both ratios are reported.  Peak memory:
    ``memory_rounds`` extra isolated runs per configuration (warm-up steps only, :data:`PROBE_ENV`);
    without them, the timing runs' ``ru_maxrss``."""
    runner = run_isolated if isolate else run_config
    sizes = {k: v for k, v in sizes.items() if k not in ("repeats", "memory_rounds")}
    out = {"sizes": sizes, "repeats": repeats}
    if repeats:
        out |= _timing(model, sizes, device, repeats, threads, runner, log)
    if memory_rounds and isolate:
        out |= _memory_probes(model, sizes, device, memory_rounds, threads, log)
    elif repeats:
        out["peak_memory_ghost_vs_hooks"] = _ghost_vs_hooks(out["configs"], "peak_training_mib_median")
        out["peak_memory_source"] = "timing runs' ru_maxrss (default malloc settings)"
    return out


def _ghost_vs_hooks(configs: dict, key: str) -> dict:
    memory = {}
    for impl, method in (("opacus", None), ("ours", "sample"), ("ours", "scale")):
        ghost, hooks = configs[label(impl, method, "ghost")][key], configs[label(impl, method, "hooks")][key]
        memory[label(impl, method, "ghost_vs_hooks")] = {"ghost_mib": ghost, "hooks_mib": hooks,
                                                         "ratio": ghost / hooks if hooks else None}
    return memory


def _memory_probes(model, sizes, device, rounds, threads, log) -> dict:
    raw = {label(*c): [] for c in CONFIGS}
    for rnd in range(rounds):
        for impl, method, mode in (CONFIGS if rnd % 2 == 0 else tuple(reversed(CONFIGS))):
            spec = {"model": model, "impl": impl, "method": method, "mode": mode, "device": device,
                    "threads": threads, "seed": rnd, **sizes, "epochs": 0}
            r = run_isolated(spec, probe=True)
            raw[label(impl, method, mode)].append(r)
            log(f"  {model} memory probe {rnd + 1}/{rounds} {label(impl, method, mode):<18} "
                f"peak +{r['peak_training_mib']:.0f} MiB")
    summary = {}
    for name, runs in raw.items():
        summary[name] = {"peak_training_mib_median": statistics.median(r["peak_training_mib"] for r in runs),
                         "peak_training_mib": [r["peak_training_mib"] for r in runs],
                         "rss_peak_mib": [r["rss_peak_mib"] for r in runs]}
        if "cuda_peak_training_mib" in runs[0]:
            summary[name]["cuda_peak_training_mib_median"] = statistics.median(
                r["cuda_peak_training_mib"] for r in runs)
    key = "cuda_peak_training_mib_median" if device == "cuda" else "peak_training_mib_median"
    return {"memory_probe": {"rounds": rounds, "steps": sizes["warmup_steps"], "env": PROBE_ENV, "configs": summary},
            "peak_memory_ghost_vs_hooks": _ghost_vs_hooks(summary, key),
            "peak_memory_source": (f"memory probes: {sizes['warmup_steps']} training steps in a fresh process per "
                                   f"configuration, {'torch.cuda.max_memory_allocated' if device == 'cuda' else 'ru_maxrss'}"
                                   " after the steps minus after set-up")}


def _timing(model, sizes, device, repeats, threads, runner, log) -> dict:
    primary = "cpu_seconds_per_epoch" if device == "cpu" else "seconds_per_epoch"
    raw = {label(*c): [] for c in CONFIGS}
    loads = []
    for rnd in range(repeats):
        order = CONFIGS if rnd % 2 == 0 else tuple(reversed(CONFIGS))
        for impl, method, mode in order:
            spec = {"model": model, "impl": impl, "method": method, "mode": mode, "device": device,
                    "threads": threads, "seed": rnd, **sizes}
            load_before = os.getloadavg()[0]
            r = runner(spec)
            r["load_avg_1min"] = [load_before, os.getloadavg()[0]]
            loads += r["load_avg_1min"]
            raw[label(impl, method, mode)].append(r)
            log(f"  {model} round {rnd + 1}/{repeats} {label(impl, method, mode):<18} "
                f"{r['seconds_per_epoch']:.4f} s/epoch (cpu {r['cpu_seconds_per_epoch']:.4f})  "
                f"peak +{r['peak_training_mib']:.0f} MiB  "
                f"load {load_before:.2f}")
    configs = {name: _summary(runs) for name, runs in raw.items()}
    ratios = {}
    for impl, method, mode in CONFIGS:
        if impl != "ours":
            continue
        name, base = label(impl, method, mode), label("opacus", None, mode)
        entry = {"wall": _ratio(raw, configs, name, base, "seconds_per_epoch"),
                 "cpu": _ratio(raw, configs, name, base, "cpu_seconds_per_epoch"),
                 "judged_on": primary, "target": TARGET_RATIO}
        judged = entry["cpu" if primary.startswith("cpu") else "wall"]["ratio_of_medians"]
        entry["meets_target"] = judged <= TARGET_RATIO
        ratios[f"{name}_vs_{base}"] = entry
    return {"judged_on": primary, "configs": configs, "ratios": ratios,
            "load_avg_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
            "runs": raw}


def measure(*, device: str = "cpu", repeats: int | None = None, threads: int = 1, quick: bool = False,
            isolate: bool = True, memory_rounds: int | None = None, models=("digits", "cifar"), log=print) -> dict:
    """The whole benchmark (both models); the dict written to ``engine_vs_opacus.json``."""
    import opacus
    import torch

    sizes = QUICK if quick else FULL
    t0 = time.perf_counter()
    out = {"device": device, "threads": threads, "repeats": repeats, "quick": quick, "isolated_processes": isolate,
           "torch": torch.__version__, "opacus": opacus.__version__, "cpu_count": os.cpu_count(),
           "target_ratio": TARGET_RATIO, "clip_norm": CLIP, "delta": DELTA,
           "memory_measure": ("ru_maxrss after training minus after set-up, one fresh process per run "
                              "(see each model's peak_memory_source)" if isolate else "ru_maxrss of the shared "
                              "process: not per configuration (quick smoke mode only)"),
           "note": ("interleaved rounds (order reversed every other round); seconds per epoch cover the "
                    "training loop only; the machine is shared, see load_avg_1min per model")}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    for model in models:
        out[model] = compare(model, sizes[model], device=device, threads=threads,
                             repeats=sizes[model]["repeats"] if repeats is None else repeats, isolate=isolate,
                             memory_rounds=sizes[model]["memory_rounds"] if memory_rounds is None else memory_rounds,
                             log=log)
    out["wall_seconds"] = time.perf_counter() - t0
    return out


@bench
def bench_engine_vs_opacus():
    """Seconds per epoch and peak memory: engine Sample/Scale (hooks, ghost) against Opacus 1.6,
    digits CNN and a CIFAR-shaped CNN, CPU (``bench/bench_engine.py --device cuda`` on a GPU)."""
    return measure()


def table(result: dict) -> str:
    """A plain-text table of the medians and ratios."""
    lines = []
    for model in ("digits", "cifar"):
        if model not in result:
            continue
        r = result[model]
        if "configs" not in r:
            lines.append(f"{model} {r['sizes']} (memory probes only)")
            lines += _memory_lines(r)
            continue
        la = r["load_avg_1min"]
        lines.append(f"{model} {r['sizes']} (load avg {la['min']:.2f}-{la['max']:.2f})")
        lines.append(f"  {'config':<18} {'wall s/ep':>9} {'ratio':>6} {'paired':>6} {'cpu s/ep':>9} {'ratio':>6} "
                     f"{'paired':>6} {'peak MiB':>9}")
        for impl, method, mode in CONFIGS:
            name = label(impl, method, mode)
            c = r["configs"][name]
            rat = r["ratios"].get(f"{name}_vs_{label('opacus', None, mode)}")
            w = rat["wall"] if rat else {"ratio_of_medians": 1.0, "median_paired_ratio": 1.0}
            u = rat["cpu"] if rat else {"ratio_of_medians": 1.0, "median_paired_ratio": 1.0}
            lines.append(f"  {name:<18} {c['seconds_per_epoch_median']:>9.4f} {w['ratio_of_medians']:>6.3f} "
                         f"{w['median_paired_ratio']:>6.3f} {c['cpu_seconds_per_epoch_median']:>9.4f} "
                         f"{u['ratio_of_medians']:>6.3f} {u['median_paired_ratio']:>6.3f} "
                         f"{c['peak_training_mib_median']:>9.1f}")
        lines += _memory_lines(r)
    return "\n".join(lines)


def _memory_lines(r: dict) -> list[str]:
    lines = [f"  peak memory from {r['peak_memory_source']}"]
    for name, m in r["peak_memory_ghost_vs_hooks"].items():
        ratio = "n/a" if m["ratio"] is None else f"{m['ratio']:.2f}"
        lines.append(f"  memory {name}: ghost {m['ghost_mib']:.1f} MiB / hooks {m['hooks_mib']:.1f} MiB = {ratio}")
    return lines


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (cuda when available)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds (default 4 for digits, 3 for cifar; 1 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1: on a shared "
                   "machine CPU seconds of one thread measure the work)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests (not a measurement)")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (faster start; memory is not per configuration)")
    p.add_argument("--models", default="digits,cifar", help="comma-separated subset of digits,cifar")
    p.add_argument("--memory-rounds", type=int, default=None,
                   help="memory probes per configuration (default 1; 0 with --quick)")
    p.add_argument("--memory-only", action="store_true",
                   help="run only the memory probes; with an existing --out, replace its memory sections")
    p.add_argument("--out", default=None, help=f"result JSON (default {RESULT_PATH.relative_to(HERE.parent)}; "
                   "with --quick: none unless given)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_config(json.loads(args.worker))))
        return None

    import torch

    from idpsgd.io import write_json
    from idpsgd.validation import InvalidParameterError

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise InvalidParameterError("device", device, "must be cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", device, "CUDA is not available on this machine (use cpu)")
    repeats = 0 if args.memory_only else args.repeats
    if repeats is not None and repeats < 1 and not args.memory_only:
        raise InvalidParameterError("repeats", repeats, "must be an integer >= 1")
    if args.memory_rounds is not None and args.memory_rounds < 0:
        raise InvalidParameterError("memory_rounds", args.memory_rounds, "must be an integer >= 0")
    if args.memory_only and (args.in_process or args.memory_rounds == 0):
        raise InvalidParameterError("memory_only", True, "needs isolated processes and --memory-rounds >= 1")
    if args.threads < 1:
        raise InvalidParameterError("threads", args.threads, "must be an integer >= 1")
    models = tuple(m for m in args.models.split(",") if m)
    if not models or any(m not in FULL for m in models):
        raise InvalidParameterError("models", args.models, "must be a comma-separated subset of digits,cifar")
    result = {"benchmark": "engine_vs_opacus", "machine": platform.platform(), "python": platform.python_version(),
              **measure(device=device, repeats=repeats, threads=args.threads, quick=args.quick,
                        isolate=not args.in_process, memory_rounds=args.memory_rounds, models=models,
                        log=lambda s: print(s, file=sys.stderr))}
    out = args.out if args.out is not None else (None if args.quick else RESULT_PATH)
    if args.memory_only and out is not None and Path(out).exists():
        merged = json.loads(Path(out).read_text())
        if merged.get("device") != device:
            raise InvalidParameterError("out", str(out), f"holds a {merged.get('device')} run; merge {device} "
                                        "memory probes only into a run on the same device")
        for model in models:
            merged.setdefault(model, {}).update({k: result[model][k] for k in
                                                 ("memory_probe", "peak_memory_ghost_vs_hooks", "peak_memory_source")})
        result = merged
    if out is not None:
        write_json(out, result)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
