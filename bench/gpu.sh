#!/usr/bin/env bash
# The first look at a GPU in one command, under 8 minutes: CUDA tests, demo on CUDA, CNN and Hugging Face
# benches (bk / ghost / hooks against non-private and Opacus; fp32, bf16, fp16 with GradScaler), one JSON of
# figures (bench/results/gpu.json). How to read it: docs/performance.md, "A first look at a GPU".
#   bash bench/gpu.sh                      # on a machine with a CUDA device
#   bash bench/gpu.sh --cpu --out /tmp/g.json [--stages hf_fp16]   # a tiny version on the CPU (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu_figures.py "$@"
