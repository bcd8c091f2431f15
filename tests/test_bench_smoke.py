"""Smoke test of bench/bench_engine.py (issue 23's cost benchmark) in its quick mode.

Not a timing test: it checks that every configuration trains and every refresh covers all examples,
that the private configurations are compared at the same batch size and σ, that the ratios are the
ratios of the measured medians, and that the isolated worker reports its own memory high-water mark."""

import json
import statistics
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_engine

    return bench_engine


def test_quick_mode_compares_like_with_like(bench_engine, tmp_path):
    out = tmp_path / "engine_cost.json"
    bench_engine.main(
        ["--quick", "--in-process", "--repeats", "1", "--models", "cifar_cnn", "--batch-sizes", "32", "--out", str(out)]
    )
    saved = json.loads(out.read_text())
    r = saved["cifar_cnn"]
    n = bench_engine.QUICK["cifar_cnn"]["n"]
    keys = {f"{c}@32" for c in bench_engine.TRAINING} | {
        f"{c}@{bench_engine.REFRESH_BATCH}" for c in ("nonprivate", *bench_engine.REFRESH)
    }
    assert set(r["configs"]) == keys
    for c in r["configs"].values():
        assert c["seconds_per_epoch_median"] > 0 and c["cpu_seconds_per_epoch_median"] > 0
    for c in bench_engine.REFRESH:  # a refresh covers every example once
        assert r["configs"][f"{c}@{bench_engine.REFRESH_BATCH}"]["examples_per_epoch_median"] == n
    runs = r["runs"]
    sigma = runs["opacus_hooks@32"][0]["noise_multiplier"]
    assert runs["opacus_ghost@32"][0]["noise_multiplier"] == sigma
    assert {len(runs[f"{c}@32"]) for c in bench_engine.TRAINING} == {1}
    assert "ghost norm" in r["configs"]["ours_bk@32"]["layer_paths"].values()
    ratio = r["ratios"]["B=32"]["ours_bk_time_vs_nonprivate"]
    assert ratio == pytest.approx(
        statistics.median(x["cpu_seconds_per_epoch"] for x in runs["ours_bk@32"])
        / statistics.median(x["cpu_seconds_per_epoch"] for x in runs["nonprivate@32"])
    )
    assert saved["verdict"]["cifar_cnn_bk_time_ok"] == (ratio <= bench_engine.TARGETS["bk_time_vs_nonprivate"])


def test_a_subset_of_configurations(bench_engine, tmp_path):
    """``--configs nonprivate,ours_bk`` runs those two only (no refresh, no Opacus): its ratio, its verdict."""
    out = tmp_path / "engine_cost.json"
    quick = ["--quick", "--in-process", "--repeats", "1", "--models", "cifar_cnn", "--batch-sizes", "32"]
    bench_engine.main([*quick, "--configs", "nonprivate,ours_bk", "--out", str(out)])
    saved = json.loads(out.read_text())
    r = saved["cifar_cnn"]
    assert set(r["configs"]) == {"nonprivate@32", "ours_bk@32"} and saved["configs"] == ["nonprivate", "ours_bk"]
    assert set(r["ratios"]) == {"B=32"} and set(r["ratios"]["B=32"]) == {"ours_bk_time_vs_nonprivate"}
    assert set(saved["verdict"]) == {"cifar_cnn_bk_time", "cifar_cnn_bk_time_ok"}


@pytest.mark.slow  # a fresh Python process importing torch and opacus
def test_isolated_worker_reports_its_own_peak(bench_engine):
    spec = {
        "model": "cifar_cnn",
        "config": "ours_bk",
        "batch_size": 16,
        "device": "cpu",
        "threads": 1,
        "seed": 0,
        **bench_engine.QUICK["cifar_cnn"],
        "n": 32,
    }
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
    with pytest.raises(InvalidParameterError, match="batch_sizes"):
        bench_engine.main(["--quick", "--batch-sizes", "0"])
    for bad in ("ours_bk", "nonprivate,opacus_fast", ""):  # non-private first, known names only
        with pytest.raises(InvalidParameterError, match="configs"):
            bench_engine.main(["--quick", "--configs", bad])


def test_hf_bench_smoke(monkeypatch, tmp_path):
    """bench/bench_hf.py --smoke: every configuration either has figures or says why it does not run; the
    ratios are those of the medians; LoRA GPT-2 runs in bk with no fallback layer; the JSON is written after each
    model too (marked partial), so that a run stopped by bench/gpu.sh's time limit keeps its finished models."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_hf
    import idpsgd.io

    writes = []
    write_json = idpsgd.io.write_json
    monkeypatch.setattr(idpsgd.io, "write_json", lambda path, obj: (writes.append(obj), write_json(path, obj)))
    out = tmp_path / "hf_cost.json"
    bench_hf.main(["--smoke", "--in-process", "--repeats", "1", "--models", "gpt2_lora,gpt2_lm", "--out", str(out)])
    assert [w.get("partial") for w in writes] == [True, None]
    assert "gpt2_lora" in writes[0] and "gpt2_lm" not in writes[0] and writes[0]["benchmark"] == "hf_cost"
    saved = json.loads(out.read_text())
    assert saved["layers"] == 1 and "1 of" in saved["layers_note"]
    for model in ("gpt2_lora", "gpt2_lm"):
        configs = saved[model]["configs"]
        assert set(configs) == set(bench_hf.CONFIGS)
        for c in configs.values():
            assert (c.get("error")) or c["cpu_seconds_per_example_median"] > 0
    lora = saved["gpt2_lora"]
    assert "error" not in lora["configs"]["ours_bk"] and lora["configs"]["ours_bk"]["fallback_layers"] == []
    runs = lora["runs"]
    assert lora["ratios"]["ours_bk_time_vs_nonprivate"] == pytest.approx(
        runs["ours_bk"][0]["cpu_seconds_per_example"] / runs["nonprivate"][0]["cpu_seconds_per_example"]
    )
    assert saved["verdict"]["gpt2_lora"]["runs"]
    with pytest.raises(Exception, match="models"):
        bench_hf.main(["--smoke", "--models", "gpt3"])


def test_hf_bench_float16_runs_the_grad_scaler_path_and_takes_the_modes(monkeypatch, tmp_path):
    """bench_hf.py --precision fp16: non-private and bk train under float16 autocast with a GradScaler (the path
    bench/gpu.sh runs on CUDA), ghost and hooks without one (or say why they do not run the model); --configs picks
    the configurations."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_hf

    out = tmp_path / "hf.json"
    configs = "nonprivate,ours_bk,ours_ghost,ours_hooks"
    args = ["--smoke", "--in-process", "--repeats", "1", "--models", "bert_cls", "--configs", configs]
    bench_hf.main([*args, "--precision", "fp16", "--out", str(out)])
    runs = json.loads(out.read_text())["bert_cls"]["runs"]
    assert list(runs) == configs.split(",")
    for c in ("nonprivate", "ours_bk"):  # the GradScaler path runs through the engine
        (run,) = runs[c]
        assert "error" not in run and run["cpu_seconds_per_example"] > 0, run.get("error")
        assert run["precision"] == "fp16" and run["grad_scaler"]
    for c in ("ours_ghost", "ours_hooks"):  # figures, or the reason this mode does not run the model
        (run,) = runs[c]
        assert run.get("error") or (run["precision"] == "fp16" and not run["grad_scaler"])
    with pytest.raises(Exception, match="configs"):
        bench_hf.main(["--smoke", "--configs", "ours_bk,nonprivate"])


def _gpu_script(*args):
    """``bash bench/gpu.sh --cpu ARGS`` with a bare environment (as CI runs it)."""
    import subprocess
    import sys

    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", str(BENCH / "gpu.sh"), "--cpu", *args], capture_output=True, text=True, env=env)


def _probe_wheel(folder):
    """A wheel of one module, ``idpsgd_probe``, written by hand (no build, no network)."""
    import zipfile

    folder.mkdir()
    files = {
        "idpsgd_probe.py": "ANSWER = 42\n",
        "idpsgd_probe-0.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: idpsgd-probe\nVersion: 0.0.0\n",
        "idpsgd_probe-0.0.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files["idpsgd_probe-0.0.0.dist-info/RECORD"] = "".join(
        f"{name},,\n" for name in [*files, "idpsgd_probe-0.0.0.dist-info/RECORD"]
    )
    with zipfile.ZipFile(folder / "idpsgd_probe-0.0.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


def test_gpu_script_writes_its_figures(tmp_path, monkeypatch):
    """bench/gpu.sh --cpu (a tiny version on the CPU) through bench/gpu_device.sh (the GPU machine's entry): the
    wheels in $IDPSGD_WHEELS are installed and put on the path, the versions are said, the stage runs with its
    status, and one JSON of figures and a log are written into OUTDIR; an unknown stage is refused (by the
    script's Python half, in this process: gpu.sh execs it). One stage here (the Hugging Face fp16 bench); the
    CUDA tests' stage (a pytest of its own, selected by the ``cuda`` marker: they skip here) and every other stage
    run in the slow twin below."""
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_figures

    with pytest.raises(SystemExit) as refused:
        gpu_figures.main(["--cpu", "--stages", "nope"])
    assert "unknown stage" in str(refused.value.code)
    _probe_wheel(tmp_path / "wheels")
    env = {
        "PYTHON": sys.executable,
        "PATH": "/usr/bin:/bin",
        "IDPSGD_WHEELS": str(tmp_path / "wheels"),
        "TMPDIR": str(tmp_path),
    }
    outdir = tmp_path / "figures"
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_device.sh"), str(outdir), "--cpu", "--stages", "hf_fp16"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "installed 1 wheel(s)" in done.stderr and "opacus 1.6" in done.stderr
    assert "from the wheels: idpsgd-probe 0.0.0" in done.stderr
    assert "hf_fp16" in (outdir / "gpu.log").read_text()
    saved = json.loads((outdir / "gpu.json").read_text())
    assert set(saved["stages"]) == {"hf_fp16"}
    assert all(s["status"] == "ok" for s in saved["stages"].values()), saved["stages"]
    assert saved["figures"]["hf_fp16.gpt2_lm"]["ours_bk_time_vs_nonprivate"] > 0


@pytest.mark.slow  # every stage at tiny sizes on the CPU: a few minutes (the fast twin above runs one stage)
def test_gpu_script_runs_every_stage_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    done = _gpu_script("--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert all(s["status"] == "ok" for s in saved["stages"].values()), saved["stages"]
    assert {"cnn", "host", "demo_test_accuracy", "hf_time.gpt2_lm", "hf_bf16.gpt2_lm", "hf_fp16.gpt2_lm"} <= set(
        saved["figures"]
    )
    assert saved["figures"]["hf_fp16.gpt2_lm"]["ours_bk_time_vs_nonprivate"] > 0
    counts = saved["figures"]["cuda_tests"]  # the CUDA tests, selected by their marker (they skip here)
    assert counts["tests"] >= 3 and counts["failures"] == counts["errors"] == 0
    bad = _gpu_script("--stages", "nope")
    assert bad.returncode != 0 and "unknown stage" in bad.stderr


def test_step_tax_reports_the_replayed_provenance_and_the_guard(monkeypatch):
    """bench/step_tax.py --quick --tax-only: a book-kept GPT-2 forward traced, replayed and without the keeper, the
    replay's own cost, the guard with SGD and Adam (a tiny model: a test of the script, not a measurement)."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(BENCH))
    import step_tax

    got = step_tax.main(["--quick", "--tax-only"])["tax"]
    prov = got["provenance"]
    assert prov["attribution"] == "replayed" and prov["replay_queries"] > 0
    assert min(prov["forward_traced_ms"], prov["forward_replayed_ms"], prov["replay_ms"]) > 0
    assert got["guard"]["guard_adam_ms"] > 0 and got["guard"]["guard_sgd_ms"] > 0


def test_profile_step_counts_an_op_in_the_part_of_the_step_that_called_it(monkeypatch):
    """bench/profile_step.py's grouping: our modules map to the parts of the step, and a built-in (a torch op) is
    counted in the group of the Python function that called it, so the groups add up to the profiled time."""
    import cProfile
    import time

    monkeypatch.syspath_prepend(str(BENCH))
    import profile_step

    root = "/x/src/idpsgd/engine/"
    assert profile_step.group_of(root + "guards/fingerprint.py") == "write guard"
    assert profile_step.group_of(root + "guards/decomposition.py") == "other checks (decomposition, probes)"
    assert profile_step.group_of(root + "per_example/bk/replay.py") == "provenance (trace, replay)"
    assert profile_step.group_of(root + "per_example/bk/rules/conv.py") == "per-example norms and clipped sum (bk)"
    assert profile_step.group_of("/x/src/idpsgd/accounting/rdp.py") == "accounting (ledger, filter, journal)"
    from idpsgd.engine.guards import fingerprint

    tensors = [torch.randn(300_000) for _ in range(4)]
    profile = cProfile.Profile(time.process_time)
    start = time.process_time()
    profile.runcall(lambda: [fingerprint.Fingerprint.take(tensors) for _ in range(5)])
    spent = time.process_time() - start
    groups = profile_step.grouped(profile)
    assert groups["write guard"] >= 0.8 * sum(groups.values())  # torch.cat and torch.mv: the guard's own ops
    assert sum(groups.values()) == pytest.approx(spent, rel=0.25)


@pytest.mark.slow  # about 7 s of CPU: two tiny trainings of the CIFAR CNN, one through the train harness
def test_profile_step_profiles_the_cnn_through_the_train_harness(monkeypatch):
    """bench/profile_step.py cnn on tiny sizes: the steps after the warm-up are profiled, non-private against the
    train harness's private step, whose table has the book-keeping and the write guard (a test of the script, not
    a measurement)."""
    import gc

    from idpsgd.engine.guards import integrity

    monkeypatch.syspath_prepend(str(BENCH))
    import profile_step

    # an earlier test's model in a reference cycle keeps its guard's global trigger (a forward pre-hook on every
    # module) until the cycle is collected: the non-private profile would count that hook as guard work
    gc.collect()
    assert not integrity._WAITING, "a guard of an earlier test still waits for its model's first call"
    got = profile_step.main(["cnn", "--n", "64", "--batch", "16", "--warm", "1", "--top", "3"])
    for run in ("nonprivate", "private"):
        assert got[run]["profiled_steps"] >= 2 and got[run]["cpu_ms_per_step"] > 0
        assert sum(got[run]["groups_ms_per_step"].values()) == pytest.approx(got[run]["cpu_ms_per_step"], rel=0.3)
    private = got["private"]["groups_ms_per_step"]
    assert private["per-example norms and clipped sum (bk)"] > 0 and private["write guard"] > 0
    assert "write guard" not in got["nonprivate"]["groups_ms_per_step"]


def _versions_bench(monkeypatch, tmp_path):
    """bench/bench_versions.py with this checkout as its own base, two rounds; returns its result."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_versions

    out = tmp_path / "versions.json"
    r = bench_versions.main(
        ["--base", str(BENCH.parent), "--quick", "--repeats", "2", "--batch-size", "32", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == r
    return r, bench_versions


def test_versions_bench_interleaves_rounds_and_takes_ratios_of_medians(monkeypatch, tmp_path, bench_engine):
    """The fast twin of the test below: each version's worker run in this process (bench_engine's
    run_config, as its ``--worker`` runs it), so the rounds, their order and the figures are the bench's own
    without eight fresh Python processes; the order reverses every other round."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_versions

    order = []

    def in_process(root, spec):
        order.append((root, spec["config"], spec["seed"]))
        return bench_engine.run_config(spec)

    monkeypatch.setattr(bench_versions, "run_version", in_process)
    r, bench_versions = _versions_bench(monkeypatch, tmp_path)
    root = BENCH.parent.resolve()  # both versions: this checkout (base and this)
    first = [(root, "nonprivate", 0), (root, "nonprivate", 0), (root, "ours_bk", 0), (root, "ours_bk", 0)]
    assert order == [*first, *[(p, c, 1) for p, c, _ in reversed(first)]]
    _check_versions(r)
    with pytest.raises(SystemExit):
        bench_versions.main(["--base", str(tmp_path), "--quick"])


@pytest.mark.slow  # eight fresh Python processes (the fast twin above runs the workers in this process)
def test_versions_bench_compares_two_checkouts(monkeypatch, tmp_path):
    """bench/bench_versions.py with this checkout as its own base: every (version, configuration) ran
    in every round, and the ratios are those of the medians."""
    r, bench_versions = _versions_bench(monkeypatch, tmp_path)
    _check_versions(r)
    with pytest.raises(SystemExit):
        bench_versions.main(["--base", str(tmp_path), "--quick"])


def _check_versions(r):
    m = r["models"]["cifar_cnn"]
    assert set(m["runs"]) == {"base:nonprivate", "base:ours_bk", "this:nonprivate", "this:ours_bk"}
    assert all(len(v) == 2 and min(v) > 0 for v in m["runs"].values())
    assert m["this_vs_base"]["ours_bk"] == m["median"]["this:ours_bk"] / m["median"]["base:ours_bk"]
    assert m["vs_nonprivate"]["this:ours_bk"] == m["median"]["this:ours_bk"] / m["median"]["this:nonprivate"]


def test_interleaved_steps_alternates_private_and_nonprivate_steps(monkeypatch, tmp_path):
    """bench/interleaved_steps.py --quick: the CNN's non-private, bk and bk-by-unfolding steps alternate in one
    process; the ratios are those of the reported per-example times; LoRA GPT-2 runs too."""
    monkeypatch.syspath_prepend(str(BENCH))
    import interleaved_steps

    out = tmp_path / "steps.json"
    got = interleaved_steps.main(["cnn", "--quick", "--steps", "2", "--warm", "1", "--ghost-unfold", "--out", str(out)])
    assert json.loads(out.read_text()) == got
    assert set(got["ratio_total"]) == {"nonprivate", "bk", "bk_unfold"} and got["steps"] == 2
    for k, v in got["cpu_ms_per_example_total"].items():
        assert v > 0 and got["ratio_total"][k] == pytest.approx(v / got["cpu_ms_per_example_total"]["nonprivate"])
    lora = interleaved_steps.main(["gpt2_lora", "--quick", "--steps", "1", "--warm", "0"])
    assert set(lora["ratio_median"]) == {"nonprivate", "bk"}


def test_host_overhead_splits_the_private_step_into_its_parts(monkeypatch, tmp_path):
    """bench/host_overhead.py --quick: per-phase medians of non-private and bk steps on a small GPT-2, the extra
    time per phase, and the bk optimizer step split into norms, clipped sum, admission, noise and the rest."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(BENCH))
    import host_overhead

    out = tmp_path / "host.json"
    got = host_overhead.main(["--quick", "--steps", "3", "--warm", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == got
    ms = got["ms_median"]
    assert got["device"] == "cpu" and got["clock"].startswith("CPU time") and "device_ms_median" not in got
    for phase in ("forward", "backward", "optimizer", "step"):
        assert got["extra_ms"][phase] == pytest.approx(ms["bk"][phase] - ms["nonprivate"][phase])
    per = got["ms_per_example"]
    assert got["ratio_per_example"] == pytest.approx(per["bk"] / per["nonprivate"]) and per["bk"] > 0
    split = got["bk_optimizer_ms_mean"]
    assert set(split) == {"norms", "clipped_sum", "admission", "noise", "other"}
    assert all(split[k] > 0 for k in ("norms", "clipped_sum", "admission", "noise"))
    assert got["ratio"] == pytest.approx(ms["bk"]["step"] / ms["nonprivate"]["step"])
    with pytest.raises(Exception, match="steps"):
        host_overhead.main(["--quick", "--steps", "0"])
    with pytest.raises(Exception, match="two sizes"):
        host_overhead.main(["--quick", "--full"])
