"""Benchmarks (``make bench``): results as JSON under bench/results/.

Usage: python bench/run.py [NAME ...]   (default: all).  Speed targets live here, not in tests.
Every ``bench_*.py`` module in this folder registers its benchmarks with ``@bench`` (common.py).
"""

from __future__ import annotations

import importlib
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from common import BENCHES
from idpsgd.io import write_json

for _module in sorted(HERE.glob("bench_*.py")):
    importlib.import_module(_module.stem)


def main(argv):
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; available: {sorted(BENCHES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in names:
        result = {
            "benchmark": name,
            "machine": platform.platform(),
            "python": platform.python_version(),
            **BENCHES[name](),
        }
        write_json(RESULTS / f"{name}.json", result)  # atomic (idpsgd.io)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
