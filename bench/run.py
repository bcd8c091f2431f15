"""Benchmarks (``make bench``): results as JSON under bench/results/.

Usage: python bench/run.py [NAME ...]   (default: all).  Speed targets live here, not in tests.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
BENCHES = {}


def bench(fn):
    BENCHES[fn.__name__.removeprefix("bench_")] = fn
    return fn


def _timed(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


@bench
def bench_rdp():
    """Per-example RDP over the default orders for 50,000 distinct (q, σ) pairs in one call,
    beside Opacus compute_rdp in a loop over 1,000 pairs."""
    from opacus.accountants.analysis.rdp import compute_rdp as opacus_rdp

    from idpsgd.accounting import DEFAULT_ORDERS, compute_rdp

    rng = np.random.default_rng(0)
    n = 50_000
    # Realistic DP-SGD pairs: q up to 0.1, effective σ = σ·c/‖g‖ ≥ σ ∈ [0.8, 100].
    q = 10 ** rng.uniform(-4, -1, n)
    sigma = 10 ** rng.uniform(np.log10(0.8), 2, n)
    seconds, out = _timed(lambda: compute_rdp(q, sigma, DEFAULT_ORDERS), repeat=2)
    assert np.all(np.isfinite(out))
    m = 1000
    t = time.perf_counter()
    for i in range(m):
        opacus_rdp(q=q[i], noise_multiplier=sigma[i], steps=1, orders=DEFAULT_ORDERS)
    opacus_seconds = time.perf_counter() - t
    ours_per_pair, theirs_per_pair = seconds / n, opacus_seconds / m
    return {
        "pairs": n, "orders": int(DEFAULT_ORDERS.size), "seconds": seconds, "target_seconds": 1.0,
        "opacus_pairs": m, "opacus_seconds": opacus_seconds,
        "per_pair_us": ours_per_pair * 1e6, "opacus_per_pair_us": theirs_per_pair * 1e6,
        "speedup_per_pair": theirs_per_pair / ours_per_pair,
        "note": "Opacus's fractional series can under-estimate (see tests); ours is exact.",
    }


def main(argv):
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; available: {sorted(BENCHES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in names:
        result = {"benchmark": name, "machine": platform.platform(), "python": platform.python_version(),
                  **BENCHES[name]()}
        path = RESULTS / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
