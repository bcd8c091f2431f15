"""Smoke test of bench/bench_engine.py (issue 11's engine-vs-Opacus benchmark) in its quick mode.

Not a timing test: it checks that every configuration trains, that ours and Opacus are compared at
the same expected batch size, steps per epoch and σ, that the ratios are the ratios of the
measured times, and that the isolated worker reports its own memory high-water mark."""
import json
import statistics
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_engine

    return bench_engine


def test_quick_mode_compares_like_with_like(bench_engine, tmp_path):
    out = tmp_path / "engine_vs_opacus.json"
    bench_engine.main(["--quick", "--in-process", "--models", "digits", "--out", str(out)])
    saved = json.loads(out.read_text())
    digits = saved["digits"]
    names = {bench_engine.label(*c) for c in bench_engine.CONFIGS}
    assert set(digits["configs"]) == names
    sizes = bench_engine.QUICK["digits"]
    steps = sizes["n"] // sizes["batch_size"]                # Opacus: len(loader) steps at q = 1/len(loader)
    for c in digits["configs"].values():
        assert c["seconds_per_epoch_median"] > 0 and c["cpu_seconds_per_epoch_median"] > 0
        assert c["steps_per_epoch"] == steps
        # Opacus: n·q exactly; ours: Σ q_i of the calibrated per-group rates (solver tolerance)
        assert c["expected_batch_size"] == pytest.approx(sizes["batch_size"], rel=1e-3)
    sigma = digits["configs"]["opacus_hooks"]["noise_multiplier"]
    assert digits["configs"]["ours_sample_hooks"]["noise_multiplier"] == pytest.approx(sigma)
    assert digits["configs"]["ours_sample_ghost"]["noise_multiplier"] == pytest.approx(sigma)
    r = digits["ratios"]["ours_scale_ghost_vs_opacus_ghost"]
    runs = digits["runs"]
    assert r["cpu"]["ratio_of_medians"] == pytest.approx(
        statistics.median(x["cpu_seconds_per_epoch"] for x in runs["ours_scale_ghost"])
        / statistics.median(x["cpu_seconds_per_epoch"] for x in runs["opacus_ghost"]))
    assert r["meets_target"] == (r["cpu"]["ratio_of_medians"] <= bench_engine.TARGET_RATIO)
    assert set(digits["peak_memory_ghost_vs_hooks"]) == {"opacus_ghost_vs_hooks", "ours_sample_ghost_vs_hooks",
                                                          "ours_scale_ghost_vs_hooks"}


@pytest.mark.slow      # a fresh Python process importing torch and opacus
def test_isolated_worker_reports_its_own_peak(bench_engine):
    spec = {"model": "cifar", "impl": "ours", "method": "scale", "mode": "ghost", "device": "cpu", "threads": 1,
            "seed": 0, "n": 32, "batch_size": 16, "epochs": 1, "warmup_steps": 1}
    r = bench_engine.run_isolated(spec)
    assert r["steps_per_epoch"] == 2 and r["n"] == 32
    assert r["rss_peak_mib"] >= r["rss_setup_mib"] > 0
    assert r["peak_training_mib"] == pytest.approx(r["rss_peak_mib"] - r["rss_setup_mib"])


def test_bad_options_are_refused(bench_engine):
    from idpsgd.validation import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="models"):
        bench_engine.main(["--quick", "--models", "mnist"])
    with pytest.raises(InvalidParameterError, match="repeats"):
        bench_engine.main(["--quick", "--repeats", "0"])
