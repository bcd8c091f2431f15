"""PDP-SGD benchmarks (Heo et al.)."""

from __future__ import annotations

import time

import numpy as np

from common import bench


@bench
def bench_pdp_comparison():
    """Heo et al. Tables 1–2 on digits: budgets in [1, 3] (20 groups, exponential with k = 0), 5
    seeds; test accuracy, wall time and iterations of uniform DP-SGD at the smallest budget,
    pdp-sampling, adapdp, PDP-SGD (fixed and adaptive loss; 3 rounds), Sample and Scale."""
    from idpsgd.assignment import Budgets
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig, train

    data = load_dataset("digits")
    runs = {
        "uniform (eps=1)": {"method": "uniform"},
        "pdp-sampling": {"method": "pdp-sampling"},
        "adapdp": {"method": "adapdp"},
        "pdp-sgd (loss_f)": {"method": "pdp-sgd"},
        "pdp-sgd (loss_a)": {"method": "pdp-sgd", "threshold_loss": "adaptive"},
        "sample": {"method": "sample"},
        "scale": {"method": "scale"},
    }
    out = {"dataset": "digits", "budgets": "exponential, 20 groups in [1, 3], k = 0", "seeds": 5, "rounds": 3}
    for label, kw in runs.items():
        accs, secs, steps = [], [], []
        for seed in range(5):
            budgets = Budgets.from_exponential(len(data.y_train), 1.0, 3.0, 0.0, 1e-5, seed=seed)
            t = time.perf_counter()
            report = train(data, budgets, TrainConfig(seed=seed, progress=False, **kw))
            secs.append(time.perf_counter() - t)
            accs.append(report["test_accuracy"])
            steps.append(report["steps"])
            assert all(g["epsilon_spent"] <= g["budget"] + 1e-12 for g in report["groups"])
        out[label] = {
            "accuracy_mean": float(np.mean(accs)),
            "accuracy_std": float(np.std(accs)),
            "seconds_mean": float(np.mean(secs)),
            "iterations_mean": float(np.mean(steps)),
        }
    return out


@bench
def bench_pdp_options():
    """Issue 19 on digits, budgets from App. C.1 (20 groups in [0.5, 1], k = 0), 10 epochs, 3 rounds, δ = 1e-5
    in total per example, 5 seeds: uniform DP-SGD at ε = 0.5 against PDP-SGD with loss_f (w1 = 0.7) and
    loss_a (eq. 7, AM–GM equality point), each with and without the noise history (Alg. 4); the first
    threshold, every round's σ, and the largest δ_i."""
    from idpsgd.assignment import Budgets
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig, train
    from idpsgd.training.pdp import PdpOptions, train_pdp

    data = load_dataset("digits")
    runs = {
        "uniform (eps=0.5)": None,
        "pdp-sgd loss_f": PdpOptions(),
        "pdp-sgd loss_a": PdpOptions(threshold_loss="adaptive"),
        "pdp-sgd loss_f + history": PdpOptions(noise_history=True),
        "pdp-sgd loss_a + history": PdpOptions(threshold_loss="adaptive", noise_history=True),
    }
    out = {
        "dataset": "digits",
        "budgets": "exponential, 20 groups in [0.5, 1], k = 0",
        "epochs": 10,
        "seeds": 5,
        "rounds": 3,
        "delta": 1e-5,
    }
    for label, opts in runs.items():
        accs, first, sigmas, max_delta, final_minus_first = [], [], [], [], []
        for seed in range(5):
            budgets = Budgets.from_exponential(len(data.y_train), 0.5, 1.0, 0.0, 1e-5, seed=seed)
            cfg = TrainConfig(method="uniform" if opts is None else "pdp-sgd", epochs=10, seed=seed, progress=False)
            r = train(data, budgets, cfg) if opts is None else train_pdp(data, budgets, cfg, options=opts)
            accs.append(r["test_accuracy"])
            if opts is not None:
                first.append(r["rounds"][0]["threshold"])
                sigmas.append(r["noise_multiplier"])
                max_delta.append(r["max_delta"])
                final_minus_first.append(r["test_accuracy"] - r["rounds"][0]["test_accuracy_round_model"])
        out[label] = {
            "accuracy_mean": float(np.mean(accs)),
            "accuracy_std": float(np.std(accs)),
            "first_threshold": first[0] if first else None,
            "noise_multipliers": sigmas[0] if sigmas else None,
            "max_delta": max(max_delta) if max_delta else None,
            "final_minus_round1_accuracy_mean": float(np.mean(final_minus_first)) if final_minus_first else None,
        }
    return out
