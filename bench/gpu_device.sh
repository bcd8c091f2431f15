#!/usr/bin/env bash
# bench/gpu.sh on a GPU machine with no network, in one command: installs the wheels that bench/gpu_wheels.sh
# downloaded (.whl/, or $IDPSGD_WHEELS) into a temporary folder put first on PYTHONPATH (the image's own
# torch, transformers and the rest stay), says which versions it found, refuses to start without opacus and
# dp-accounting, then runs bench/gpu.sh with its JSON and a log of its output written into OUTDIR.
#   bash bench/gpu_device.sh [OUTDIR] [gpu.sh options]     # OUTDIR: default $OUT, else bench/results
#   bash bench/gpu_device.sh /tmp/g --cpu --stages hf_fp16  # a tiny version on the CPU (a test of the script)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUTDIR="${OUT:-$ROOT/bench/results}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUTDIR="$1"; shift; fi
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
WHEELS="${IDPSGD_WHEELS:-$ROOT/.whl}"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -z "$PY" ]; then PY="$(command -v python3 || command -v python)"; fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/idpsgd-site.XXXXXX")"
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" IDPSGD_SITE="$SITE"
    echo "bench/gpu_device.sh: installed $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS into $SITE" >&2
fi
"$PY" - <<'EOF' >&2
import importlib.metadata as md
import os
import sys

names = ("torch", "opacus", "dp-accounting", "dm-tree", "transformers", "peft", "huggingface-hub", "numpy", "scipy")
found = {}
for name in names:
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
print("bench/gpu_device.sh: Python " + sys.version.split()[0] + "; " + ", ".join(f"{k} {v or 'missing'}" for k, v in found.items()))
site = os.environ.get("IDPSGD_SITE")
if site:  # the wheels' folder must come first on the path, before the image's own packages
    if sys.path[1:2] != [site]:
        sys.exit(f"bench/gpu_device.sh: {site} is not first on the path: {sys.path[:3]}")
    print("bench/gpu_device.sh: from the wheels: " + ", ".join(f"{d.metadata['Name']} {d.version}" for d in md.distributions(path=[site])))
missing = [k for k in ("torch", "opacus", "dp-accounting") if found[k] is None]
if missing:
    sys.exit(f"bench/gpu_device.sh: {', '.join(missing)} not installed; download the wheels with "
             "`bash bench/gpu_wheels.sh` on a machine with a network and bring .whl/ along")
import torch

print(f"bench/gpu_device.sh: CUDA {'available: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not available'}")
EOF
if command -v nvidia-smi >/dev/null; then  # the card, its memory and driver, for the record
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi
export PYTHON="$PY" PYTHONUNBUFFERED=1
bash bench/gpu.sh --out "$OUTDIR/gpu.json" "$@" 2>&1 | tee "$OUTDIR/gpu.log"
