#!/usr/bin/env bash
# The wheels a stock CUDA PyTorch image lacks for bench/gpu.sh, downloaded here (where there is a network) for a
# GPU machine that has none: opacus and dp-accounting (with dm-tree, which dp-accounting needs) are not in such
# images, and transformers and peft are pinned to releases idpsgd is tested with (pyproject.toml's `hf` extra; an
# image's transformers can be older than its floor). bench/gpu_device.sh installs them there beside the image's
# own packages (its torch, tokenizers, huggingface-hub, accelerate, numpy, scipy stay). How to use both: docs/performance.md, "A GPU machine with no network".
#   bash bench/gpu_wheels.sh [DIR]          # default .whl/ (ignored by git); wheels for CPython 3.12 on x86-64
#   GPU_PYTHON=3.11 bash bench/gpu_wheels.sh  # another Python on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
# opacus and dp-accounting as pyproject.toml requires them; dm-tree: dp-accounting's compiled dependency
WHEELS=(opacus==1.6.0 dp-accounting==0.6.0 dm-tree==0.1.10 peft==0.21.2 transformers==5.24.0)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    PLATFORMS+=(--platform "$p")
done
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
ls -l "$DIR"/*.whl
