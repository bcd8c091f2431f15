"""The first look at a GPU, in one command (``bench/gpu.sh``): the CUDA tests, the demo on CUDA, the CIFAR-shaped
CNN bench and the Hugging Face bench (GPT-2 small full and LoRA, BERT-base) in bk / ghost / hooks against
non-private and Opacus, in float32, bfloat16 and float16 (the GradScaler path), written as one JSON of figures.

Every stage is a subprocess with a time limit taken from one overall budget (default 470 s: the whole run
stays under 8 minutes on one GPU); a stage that fails or runs out of time is recorded with its status and
the tail of its output, and the next one runs.  Stages, most important first:

* ``cuda_tests`` — ``pytest -m cuda`` (the tests marked ``cuda``: they skip without a CUDA device);
* ``hf_time`` — ``bench_hf.py`` in one process (``--in-process``: times, no memory; its JSON rewritten after
  each model), float32, every configuration: nonprivate, ours_bk, ours_ghost, ours_hooks, opacus_ghost, opacus_hooks;
* ``cnn`` — ``bench_engine.py`` on ``cifar_cnn`` at B = 256 (in one process: times);
* ``host`` — ``host_overhead.py --full`` on GPT-2 small: bk's extra wall time per phase, its optimizer step split into
  norms, clipped sum, admission and noise, and ``busy``, the kernels' share of a step's wall time (host-bound or not);
* ``hf_memory`` — ``bench_hf.py`` with its memory probes (a fresh process per run), float32, nonprivate and
  ours_bk on GPT-2 and GPT-2 with LoRA;
* ``hf_bf16`` / ``hf_fp16`` — ``bench_hf.py`` under autocast (float16: a GradScaler for nonprivate and
  ours_bk, the path no GPU had run);
* ``demo`` — ``idpsgd demo --device cuda`` for 2 epochs (test accuracy of the four runs).

``--cpu`` runs a tiny version of every stage on the CPU (smoke sizes; the CUDA tests then all skip) so that CI
can test this script; ``--stages`` picks some.  The JSON (default ``bench/results/gpu.json``, written
atomically) holds per stage its command, status, seconds and output tail, and ``figures``: the CUDA tests'
counts, the demo's accuracies, and every time and memory ratio to non-private.  How to read it:
docs/performance.md ("A first look at a GPU").

    bash bench/gpu.sh                 # on the GPU machine
    bash bench/gpu.sh --cpu --out /tmp/gpu.json --stages hf_fp16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT_PATH = HERE / "results" / "gpu.json"
BUDGET_S = 470
#: on the CPU (``--cpu``) every stage's limit is this many times longer, and so is the default budget
CPU_SLOWER = 5
HF_ALL = "nonprivate,ours_bk,ours_ghost,ours_hooks,opacus_ghost,opacus_hooks"


def stages(cpu: bool, work: Path) -> list[dict]:
    """name, command, time limit (s), the JSON it writes (or None): full size on CUDA, tiny on the CPU."""
    py = sys.executable
    device = "cpu" if cpu else "cuda"
    hf = [py, str(HERE / "bench_hf.py"), "--device", device] + (["--smoke"] if cpu else [])
    small = ["--models", "gpt2_lm"] if cpu else []

    def hf_stage(name, limit, *extra):
        out = work / f"{name}.json"
        return {"name": name, "command": [*hf, *extra, "--out", str(out)], "limit": limit, "json": out}

    return [
        {
            "name": "cuda_tests",
            "command": [py, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={work / 'cuda.xml'}"]
            + [str(f) for f in sorted((ROOT / "tests").glob("test_*.py")) if "pytest.mark.cuda" in f.read_text()],
            "limit": 75,
            "json": None,
            "junit": work / "cuda.xml",
        },
        hf_stage(
            "hf_time",
            150,
            *(small or ["--models", "gpt2_lm,gpt2_lora,bert_cls"]),
            "--configs",
            "nonprivate,ours_bk" if cpu else HF_ALL,
            "--repeats",
            "1" if cpu else "2",
            "--in-process",
        ),
        {
            "name": "cnn",
            "command": [py, str(HERE / "bench_engine.py"), "--device", device, "--models", "cifar_cnn"]
            + (["--quick", "--batch-sizes", "16", "--repeats", "1"] if cpu else ["--batch-sizes", "256"])
            + ["--in-process", "--out", str(work / "cnn.json")],
            "limit": 75,
            "json": work / "cnn.json",
        },
        {
            "name": "host",
            "command": [py, str(HERE / "host_overhead.py"), "--device", device]
            + (["--quick", "--steps", "2", "--warm", "1"] if cpu else ["--full", "--steps", "20", "--warm", "10"])
            + ["--out", str(work / "host.json")],
            "limit": 60,
            "json": work / "host.json",
        },
        hf_stage(
            "hf_memory",
            130,  # 8 fresh processes (2 models x 2 configurations x timing and probe), each importing torch
            *(small or ["--models", "gpt2_lm,gpt2_lora"]),
            "--configs",
            "nonprivate,ours_bk",
            "--repeats",
            "1",
        ),
        hf_stage(
            "hf_bf16",
            60,
            *(small or ["--models", "gpt2_lm,gpt2_lora"]),
            "--configs",
            "nonprivate,ours_bk" if cpu else "nonprivate,ours_bk,ours_ghost,opacus_ghost",
            "--precision",
            "bf16",
            "--repeats",
            "1",
            "--in-process",
        ),
        hf_stage(
            "hf_fp16",
            45,
            *(small or ["--models", "gpt2_lm"]),
            "--configs",
            "nonprivate,ours_bk" if cpu else "nonprivate,ours_bk,ours_ghost",
            "--precision",
            "fp16",
            "--repeats",
            "1",
            "--in-process",
        ),
        {
            "name": "demo",
            "command": [
                *(py, "-m", "idpsgd", "demo", "--device", device, "--seed", "0"),
                *("--epochs", "1" if cpu else "2", "--out", str(work / "demo"), "--overwrite"),
            ],
            "limit": 45,
            "json": work / "demo" / "summary.json",
        },
    ]


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_stage(stage: dict, limit: float) -> dict:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            stage["command"], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit
        )
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timed out after {limit:.0f} s"
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    got = {"command": stage["command"], "status": status, "seconds": round(time.perf_counter() - start, 1)}
    got["output_tail"] = _tail(output)
    path = stage["json"]
    if path is not None and Path(path).exists():
        try:
            got["result"] = json.loads(Path(path).read_text())
        except ValueError as e:
            got["status"] += f"; its JSON does not parse: {e}"
    junit = stage.get("junit")
    if junit is not None and Path(junit).exists():
        suite = ElementTree.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        got["counts"] = counts
    return got


def figures(done: dict) -> dict:
    """The figures to read first: test counts, demo accuracies, time and memory ratios to non-private."""
    out: dict = {}
    if "counts" in done.get("cuda_tests", {}):
        out["cuda_tests"] = done["cuda_tests"]["counts"]
    for name in ("hf_time", "hf_memory", "hf_bf16", "hf_fp16"):
        result = done.get(name, {}).get("result")
        if not result:
            continue
        for model in ("gpt2_lm", "gpt2_lora", "bert_cls"):
            if model in result:
                r = result[model]
                errors = {c: v["error"] for c, v in r["configs"].items() if "error" in v}
                out[f"{name}.{model}"] = {**r["ratios"], **({"does_not_run": errors} if errors else {})}
    cnn = done.get("cnn", {}).get("result")
    if cnn and "cifar_cnn" in cnn:
        out["cnn"] = cnn["cifar_cnn"]["ratios"]
    host = done.get("host", {}).get("result")
    if host:
        keys = ("ratio", "ratio_per_example", "busy", "extra_ms", "bk_optimizer_ms_mean")
        out["host"] = {k: host[k] for k in keys if k in host}
    demo = done.get("demo", {}).get("result")
    if demo:
        out["demo_test_accuracy"] = {r["run"]: r["test_accuracy"] for r in demo["runs"]}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="a tiny version on the CPU (for CI)")
    p.add_argument("--stages", help="comma-separated subset of the stages (default: all, in order)")
    p.add_argument(
        "--budget", type=float, help=f"seconds for all stages (default {BUDGET_S}; with --cpu x{CPU_SLOWER})"
    )
    p.add_argument("--out", default=str(RESULT_PATH), help=f"the JSON of figures (default {RESULT_PATH})")
    a = p.parse_args(argv)
    import torch

    from idpsgd.io import write_json

    if not a.cpu and not torch.cuda.is_available():
        sys.exit("bench/gpu.sh: no CUDA device here; --cpu runs a tiny version on the CPU")
    budget = a.budget if a.budget is not None else BUDGET_S * (CPU_SLOWER if a.cpu else 1)
    with tempfile.TemporaryDirectory(prefix="idpsgd-gpu-") as tmp:
        plan = stages(a.cpu, Path(tmp))
        for stage in plan if a.cpu else ():
            stage["limit"] *= CPU_SLOWER
        names = [s["name"] for s in plan]
        wanted = a.stages.split(",") if a.stages else names
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            sys.exit(f"bench/gpu.sh: unknown stage(s) {unknown}; the stages: {', '.join(names)}")
        start = time.perf_counter()
        done: dict = {}
        for stage in plan:
            if stage["name"] not in wanted:
                continue
            left = budget - (time.perf_counter() - start)
            if left < 10:
                done[stage["name"]] = {"command": stage["command"], "status": "skipped: out of the time budget"}
                continue
            print(f"bench/gpu.sh: {stage['name']} (at most {min(stage['limit'], left):.0f} s)", file=sys.stderr)
            done[stage["name"]] = run_stage(stage, min(stage["limit"], left))
            print(f"  {done[stage['name']]['status']} in {done[stage['name']]['seconds']} s", file=sys.stderr)
    result = {
        "benchmark": "gpu",
        "device": "cpu (tiny sizes: a test of the script, not a measurement)" if a.cpu else "cuda",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.cpu else None,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1min": os.getloadavg()[0],
        "budget_s": budget,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "figures": figures(done),
        "stages": done,
    }
    write_json(a.out, result)  # atomic (idpsgd.io)
    print(json.dumps(result["figures"], indent=2))
    print(f"bench/gpu.sh: {a.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
