"""Audit benchmarks (issues 12, 25): time of a 16-shadow LiRA audit and of a one-run audit on digits.

Both audit Sample with budgets 1 and 32 (half the examples each: a deliberately weak group) at the
README's power recipe (``RECIPE``: 40 epochs, lr 0.1; otherwise the `idpsgd train` defaults B = 128,
clip 1, RDP), seed 0: the README's measured audit.  The results record the epochs, learning rate
and clip norm the audit actually ran (from its own result), so the claim cannot drift from the run.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from common import bench

BUDGETS = ([1.0, 32.0], [0.5, 0.5])
RECIPE = {"epochs": 40, "lr": 0.1}  # README, "Audit": the power recipe


def _groups(result):
    rows = []
    for g in [*result["groups"], result["all"]]:
        row = {"budget": g["budget"], "reported_epsilon": g["reported_epsilon"], "verdict": g["verdict"]}
        if "attacks" in g:
            for name, a in g["attacks"].items():
                b = a.get("epsilon_lower_bound")
                row[name] = {
                    "auc": a["auc"],
                    "auc_leave_one_out": a.get("auc_leave_one_out"),
                    "tpr_at_fpr": {
                        f"{t['fpr']:g}": [t["tpr"], t["true_positives"], t["false_positives"]]
                        for t in a.get("tpr_at_fpr", [])
                    },
                    "epsilon_lower_bound": b["lower"] if b else None,
                    "one_run_bound": a["one_run_bound"]["epsilon"] if a.get("one_run_bound") else None,
                }
        else:
            row.update(
                auc=g["auc"],
                epsilon_lower_bound=g["one_run"]["epsilon"],
                ceiling=g["one_run"]["ceiling"],
                guesses=g["one_run"]["guesses"],
                correct=g["one_run"]["correct"],
            )
        rows.append(row)
    return rows


def _audit(options, method="sample"):
    from idpsgd.assignment import Budgets
    from idpsgd.audit import run_audit
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig

    data = load_dataset("digits")
    budgets = Budgets.from_groups(*BUDGETS, len(data.y_train), 1e-5, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        t, cpu = time.perf_counter(), time.process_time()
        r = run_audit(
            data, budgets, TrainConfig(method=method, seed=0, progress=False, **RECIPE), Path(tmp) / "audit", options
        )
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    r["cpu_seconds"] = cpu
    return seconds, r


def _setting(r):
    """What the audit ran (from its own result) and the one plan of its models."""
    return {
        "epochs": r["epochs"],
        "lr": r["lr"],
        "clip_norm": r["clip_norm"],
        "batch_size": r["batch_size"],
        "plan_steps": r["plan"]["steps"],
        "plan_noise_multiplier": r["plan"]["noise_multiplier"],
        "cpu_seconds": r["cpu_seconds"],
        "load_average": list(os.getloadavg()),
    }


def _tests(result):
    return [
        {k: t[k] for k in ("groups", "population", "student_t", "student_p", "mann_whitney_p")} for t in result["tests"]
    ]


@bench
def bench_audit_lira():
    """`idpsgd audit --method sample --budgets 1,32 --fractions 0.5,0.5 --lr 0.1 --epochs 40
    --shadow-models 16 --seed 0` on digits: 16 shadow models + the target, LiRA online/offline with
    fixed variance and the loss baseline; wall time and the per-group results."""
    from idpsgd.audit import AuditOptions

    seconds, r = _audit(AuditOptions(attack="lira", shadow_models=16))
    return {
        "dataset": "digits",
        "method": "sample",
        "budgets": "1,32 at 50/50 %",
        "shadow_models": 16,
        **_setting(r),
        "models_trained": 17,
        "seconds": seconds,
        "seconds_per_model": seconds / 17,
        "target_test_accuracy": r["target"]["test_accuracy"],
        "audit_passed": r["audit_passed"],
        "groups": _groups(r),
        "tests": _tests(r),
        "protection_tests": [
            {k: t[k] for k in ("groups", "mean_auc", "student_t", "student_p_b_higher", "wilcoxon_p_b_higher")}
            for t in r["protection_tests"]
        ],
    }


@bench
def bench_audit_one_run():
    """`idpsgd audit --method sample --budgets 1,32 --fractions 0.5,0.5 --lr 0.1 --epochs 40 --attack
    one-run --canaries 100 --seed 0` on digits: one training run with 100 mislabeled canaries per group
    (each included with probability 1/2); wall time and the per-group one-run bounds (Steinke et al. 2023)."""
    from idpsgd.audit import AuditOptions

    seconds, r = _audit(AuditOptions(attack="one-run", canaries=100))
    return {
        "dataset": "digits",
        "method": "sample",
        "budgets": "1,32 at 50/50 %",
        "canaries_per_group": 100,
        **_setting(r),
        "seconds": seconds,
        "target_test_accuracy": r["target"]["test_accuracy"],
        "audit_passed": r["audit_passed"],
        "groups": _groups(r),
    }
