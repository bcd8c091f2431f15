"""The engine's cost in two versions of the code, side by side in one run (before/after a change).

Each run is one configuration of :mod:`bench_engine` (``--worker SPEC``: a fresh process training one
epoch) executed with one version's own ``bench/bench_engine.py`` and ``src/`` — this checkout's and
``--base``'s (another checkout, e.g. ``git worktree add ../base <commit>``) — so both versions train
the same model, data and batches with their own engine.  Rounds interleave the versions and the
configurations (the order reversed every other round), so machine load moves both alike.

Figures: CPU seconds of one torch thread per epoch (wall seconds on CUDA), medians over rounds; per
version the private configuration's ratio to non-private, and per configuration this checkout's
ratio to the base.  The Hugging Face models of :mod:`bench_hf` (``gpt2_lm``: GPT-2-small-shaped,
``gpt2_lora``, ``bert_cls``; ``--hf-layers`` of their 12 layers, 2 by default on the CPU) run with
that bench's worker and are judged on CPU seconds per example (wall seconds on CUDA).

Usage::

    git worktree add ../base 452eada
    python bench/bench_versions.py --base ../base [--models cifar_cnn,gpt2_lm,gpt2_lora]
                                   [--configs nonprivate,ours_bk] [--batch-size 256] [--hf-layers 2]
                                   [--repeats 3] [--out bench/results/versions.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_engine import FULL, QUICK
from bench_hf import FULL as HF_FULL
from bench_hf import MODELS as HF_MODELS
from bench_hf import SMOKE as HF_SMOKE
from common import parse_models, resolve_device

RESULT_PATH = HERE / "results" / "versions.json"


def _revision(root: Path) -> str:
    proc = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or "unknown"


def run_version(root: Path, spec: dict) -> dict:
    """One configuration with the version at ``root`` (its bench worker, its ``src/``)."""
    env = os.environ | {"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(root / "src")}
    script = "bench_hf.py" if spec["model"] in HF_MODELS else "bench_engine.py"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / script), "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{root}: benchmark worker failed for {spec}:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in out:
        raise RuntimeError(f"{root}: {spec['model']} {spec['config']} does not run: {out['error']}")
    return out


def hf_sizes(quick: bool, layers: int, batch_size: int) -> dict:
    """bench_hf's sizes for its models (``layers`` of 12; Poisson rate B/n with n = 4B)."""
    sizes = dict(HF_SMOKE if quick else HF_FULL)
    sizes.update({"layers": layers if not quick else sizes["layers"], "batch_size": batch_size})
    sizes["n"] = max(4 * batch_size, 64)
    return sizes


def compare(
    base: Path, models, configs, batch_size: int, repeats: int, device: str, threads: int, sizes=FULL, log=print
) -> dict:
    versions = {"base": base.resolve(), "this": HERE.parent}
    primary = "cpu_seconds_per_epoch" if device == "cpu" else "seconds_per_epoch"
    primary_hf = "cpu_seconds_per_example" if device == "cpu" else "seconds_per_example"
    out = {
        "revisions": {k: _revision(v) for k, v in versions.items()},
        "judged_on": primary,
        "batch_size": batch_size,
        "repeats": repeats,
        "device": device,
        "threads": threads,
        "models": {},
    }
    loads = []
    for model in models:
        runs = [(v, c) for c in configs for v in versions]
        raw: dict = {f"{v}:{c}": [] for v, c in runs}
        for rnd in range(repeats):
            for version, config in runs if rnd % 2 == 0 else list(reversed(runs)):
                spec = {
                    "model": model,
                    "config": config,
                    "batch_size": sizes[model].get("batch_size", batch_size),
                    "device": device,
                    "threads": threads,
                    "seed": rnd,
                    **sizes[model],
                }
                key, unit = (primary_hf, "s/example") if model in HF_MODELS else (primary, "s/epoch")
                before = os.getloadavg()[0]
                r = run_version(versions[version], spec)
                loads += [before, os.getloadavg()[0]]
                raw[f"{version}:{config}"].append(r[key])
                log(f"  {model} round {rnd + 1}/{repeats} {version:>4} {config:<14} {r[key]:8.4f} {unit}")
        med = {k: statistics.median(v) for k, v in raw.items()}
        entry = {
            "median": med,
            "runs": raw,
            "judged_on": key,
            "batch_size": sizes[model].get("batch_size", batch_size),
        }
        if "nonprivate" in configs:
            entry["vs_nonprivate"] = {
                f"{v}:{c}": med[f"{v}:{c}"] / med[f"{v}:nonprivate"]
                for v in versions
                for c in configs
                if c != "nonprivate"
            }
        entry["this_vs_base"] = {c: med[f"this:{c}"] / med[f"base:{c}"] for c in configs}
        out["models"][model] = entry
    out["load_avg_1min"] = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    return out


def summarize(result: dict) -> str:
    lines = [f"versions: base {result['revisions']['base']}, this {result['revisions']['this']}"]
    for model, entry in result["models"].items():
        lines.append(f"{model} (B={entry['batch_size']}, {entry['judged_on']} medians)")
        for key, value in entry["median"].items():
            lines.append(f"  {key:<24} {value:10.5f}")
        for key, value in entry.get("vs_nonprivate", {}).items():
            lines.append(f"  {key:<24} x{value:.3f} of non-private")
        for key, value in entry["this_vs_base"].items():
            lines.append(f"  this/base {key:<14} x{value:.3f}")
    load = result["load_avg_1min"]
    lines.append(f"load average (1 min) {load['min']:.2f}-{load['max']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    from idpsgd.io import write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="another checkout of idpsgd (the version to compare with)")
    p.add_argument("--models", default="cifar_cnn", help=f"comma-separated subset of {','.join([*FULL, *HF_MODELS])}")
    p.add_argument("--hf-layers", type=int, default=2, help="layers of the Hugging Face models (default 2 of 12)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="expected batch size of the HF models (default 16)")
    p.add_argument("--configs", default="nonprivate,ours_bk", help="comma-separated bench_engine configurations")
    p.add_argument("--batch-size", type=int, default=256, help="expected batch size (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests (not a measurement)")
    p.add_argument(
        "--out", default=None, help=f"result JSON (default {RESULT_PATH.relative_to(HERE.parent)}; none with --quick)"
    )
    args = p.parse_args(argv)
    base = Path(args.base)
    if not (base / "bench" / "bench_engine.py").is_file() or not (base / "src" / "idpsgd").is_dir():
        p.error(f"--base={args.base!r} is not a checkout of idpsgd (needs bench/bench_engine.py and src/idpsgd)")
    models = parse_models(args.models, {**FULL, **dict.fromkeys(HF_MODELS)})
    configs = [c for c in args.configs.split(",") if c]
    sizes = dict(QUICK if args.quick else FULL)
    hf = hf_sizes(args.quick, args.hf_layers, args.hf_batch_size)
    sizes.update(dict.fromkeys(HF_MODELS, hf))
    device = resolve_device(args.device)
    result = compare(base, models, configs, args.batch_size, args.repeats, device, args.threads, sizes)
    out = args.out or (None if args.quick else str(RESULT_PATH))
    if out:
        write_json(out, result)
    print(summarize(result))
    return result


if __name__ == "__main__":
    main()
