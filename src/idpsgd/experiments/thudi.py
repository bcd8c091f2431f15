"""Thudi et al. (2024, "Gradients look alike"), Fig. 1a–1c as one experiment (``idpsgd reproduce thudi-figure1``).

For each data-independent ε (the paper's lines), DP-SGD runs at the paper's sampling rate
(q ≈ 0.002) with C = 1 and δ = 1e-5 on the training set X and on each target's X' = X ∪ {x*}, all
from one initialisation (:func:`~idpsgd.training.per_instance.run_per_instance`).  Per point and
step, Thm. 3.3's contribution of the step (Thm. 3.2 at x*'s measured clipped gradient norm) is
divided by the data-independent per-step RDP at α (Mironov et al. §3.3); the figure shows the mean
(Fig. 1a, 1c) and 10th percentile (Fig. 1b) over the points, in both directions.  Every value is an
**estimate** (means over ``seeds`` runs, the paper's "10 trials"); α defaults to the order at which
the data-independent ε of Thm. 3.3 at sensitivity C is smallest (the paper's α = 8 is past the
phase transition at ε = 10).  Privacy hygiene: the curves are exact statistics of per-point values,
so the figure and every per-point file go to ``private/`` (mode 0600); the public JSON holds the
settings, test accuracy and data-independent quantities only.

What was measured, and what differs from the paper on digits: ``docs/reproducing.md``.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from ..accounting.neighbouring import neighbouring
from ..validation import InvalidParameterError
from .registry import SEED, Experiment, Option, at_least_one, positive, register, valid_delta
from .summary import randomness, record_seed, repetition_seeds

#: the paper's sampling rate (MNIST, expected batch 128 of 60,000)
PAPER_SAMPLE_RATE = 128 / 60000
#: the paper's models (LeNet-5 on MNIST; digits: a perceptron, see the module doc)
PAPER_MODELS = {"digits": "mlp", "mnist": "lenet5"}
PAPER = (
    "Paper (MNIST, LeNet-5, q = 128/60000, 10 epochs, C = 1, alpha = 8, 10 runs, 100 test points; Fig. 1a/1b): "
    "the per-step contribution relative to the per-step baseline decreases as training progresses and ends "
    "below 1 (the 10th percentile far below), for every epsilon; the early steps are above 1 (the "
    "composition's order growth); Fig. 1c (10 training points, both directions) shows the same trend."
)


def parse_epsilons(name: str, value) -> list[float]:
    """``"1,10"`` -> [1.0, 10.0]; each must be a finite number > 0."""
    try:
        out = [float(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise InvalidParameterError(name, value, "must be comma-separated numbers > 0, e.g. 1,10") from None
    if not out or not all(v > 0 and math.isfinite(v) for v in out):
        raise InvalidParameterError(name, value, "must be comma-separated numbers > 0, e.g. 1,10")
    return out


def parse_alpha(name: str, value) -> float | None:
    """``auto`` -> None (the order minimising the data-independent ε); else a Rényi order > 1."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        a = float(value)
    except ValueError:
        raise InvalidParameterError(name, value, "must be auto or a Rényi order > 1 (e.g. 8)") from None
    if not (a > 1 and math.isfinite(a)):
        raise InvalidParameterError(name, value, "must be auto or a Rényi order > 1 (e.g. 8)")
    return a


def _check_batch(name: str, value) -> None:
    if value is not None:
        at_least_one(name, value)


def _check_checkpoint(name: str, value) -> None:
    at_least_one(name, value)


def _check_momentum(name: str, value) -> None:
    if not 0 <= float(value) < 1:
        raise InvalidParameterError(name, value, "must be in [0, 1)")


def _check_target_set(name: str, value) -> None:
    if value not in ("test", "train"):
        raise InvalidParameterError(name, value, "must be test (Fig. 1a/1b) or train (Fig. 1c)")


def _load() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def run_thudi_figure1(
    data,
    seeds: int = 2,
    points: int = 20,
    epsilons: str = "10",
    alpha: str = "auto",
    batch_size: int | None = None,
    epochs: int = 10,
    lr: float = 0.03,
    momentum: float = 0.0,
    clip_norm: float = 1.0,
    delta: float = 1e-5,
    checkpoint_every: int = 1,
    target_set: str = "test",
    device: str = "cpu",
    model: str | None = None,
    progress: bool = True,
    out=None,
    seed: int | None = None,
) -> dict:
    """Fig. 1 of Thudi et al. on ``data`` (module docstring); returns the public result, with the curves and
    statistics of per-point values under ``["private"]``.  ``out``: the run folder for the per-instance
    files (``eps<ε>_per_instance.csv`` ..., private; ``eps<ε>_settings.json``, public)."""
    from ..training import TrainConfig
    from ..training.per_instance import run_per_instance

    eps_list = parse_epsilons("epsilons", epsilons)
    order = parse_alpha("alpha", alpha)
    for name, value in (("seeds", seeds), ("points", points), ("epochs", epochs)):
        at_least_one(name, value)
    _check_batch("batch_size", batch_size)
    _check_checkpoint("checkpoint_every", checkpoint_every)
    _check_momentum("momentum", momentum)
    _check_target_set("target_set", target_set)
    positive("lr", lr)
    positive("clip_norm", clip_norm)
    valid_delta("delta", delta)
    n = len(data.y_train)
    size = len(data.y_test) if target_set == "test" else n
    if points > size:
        raise InvalidParameterError("points", points, f"must be at most the {size} examples of the {target_set} set")
    batch = int(batch_size) if batch_size is not None else max(1, round(PAPER_SAMPLE_RATE * n))
    model_name = model or PAPER_MODELS.get(data.name)
    chosen = np.sort(np.random.default_rng(0).choice(size, int(points), replace=False))  # a public choice
    base, _ = repetition_seeds(seed, 0)  # every analysis: one initialisation and runs from this (private) seed
    load_before, t0 = _load(), time.perf_counter()
    public, private = [], []
    for eps in eps_list:
        cfg = TrainConfig(
            method="uniform",
            epochs=int(epochs),
            batch_size=batch,
            lr=float(lr),
            momentum=float(momentum),
            clip_norm=float(clip_norm),
            model=model_name,
            seed=base,
            progress=progress,
            device=device,
        )
        t = time.perf_counter()
        s = run_per_instance(
            data,
            chosen,
            runs=int(seeds),
            alpha=order,
            config=cfg,
            epsilon=float(eps),
            delta=float(delta),
            checkpoint_every=int(checkpoint_every),
            out_dir=out,
            target_set=target_set,
            file_prefix=f"eps{eps:g}_",
            figures=False,
        )
        from ..training.per_instance import public_summary

        public.append({**public_summary(s), "seconds": time.perf_counter() - t})
        late = slice(s["steps"] // 2, s["steps"])
        curves = s["curves"]
        private.append(
            {
                "epsilon": float(eps),
                "median_late_step_ratio": {
                    "add": s["median_late_step_ratio_add"],
                    "remove": s["median_late_step_ratio_remove"],
                },
                "late_mean_of_mean_curve": {dn: float(np.mean(curves[dn]["mean"][late])) for dn in curves},
                "late_mean_of_p10_curve": {dn: float(np.mean(curves[dn]["p10"][late])) for dn in curves},
                "last_step": {dn: {"mean": curves[dn]["mean"][-1], "p10": curves[dn]["p10"][-1]} for dn in curves},
                "first_step": {dn: {"mean": curves[dn]["mean"][0], "p10": curves[dn]["p10"][0]} for dn in curves},
                "median_late_thm32_ratio": s["median_late_thm32_ratio"],
                "share_points_below_baseline_late": s["share_points_below_baseline_late"],
                "median_ratio_to_baseline": s["median_ratio_to_baseline"],
                "median_ratio_to_same_composition": s["median_ratio_to_same_composition"],
                "share_guarantee_below_data_independent": s["share_guarantee_below_data_independent"],
                "correct_vs_incorrect": s["correct_vs_incorrect"],
                "curves": curves,
            }
        )
    return {
        "experiment": "thudi-figure1",
        "dataset": data.name,
        "model": model_name or "default",
        "seeds": int(seeds),
        "points": int(points),
        "target_set": target_set,
        "epsilons": eps_list,
        "alpha": "auto" if order is None else order,
        "batch_size": batch,
        "sample_rate": batch / n,
        "epochs": int(epochs),
        "lr": float(lr),
        "momentum": float(momentum),
        "clip_norm": float(clip_norm),
        "delta": float(delta),
        "checkpoint_every": int(checkpoint_every),
        "per_epsilon": public,
        "seconds": time.perf_counter() - t0,
        "load_average_before": load_before,
        "load_average_after": _load(),
        "cpu_count": os.cpu_count(),
        "randomness": randomness(),
        **neighbouring(),
        "private": {
            "about": "statistics over the target points of their per-instance values (exact statistics "
            "of private values; estimates of Thm. 3.3)",
            "per_epsilon": private,
            "seed": base,
        },
    }


# --- outputs ------------------------------------------------------------------------------------
def thudi_markdown(r, show_private: bool = False) -> str:
    """The settings and the public values; with ``show_private`` the statistics of per-point values too."""
    lines = [
        f"Thudi et al. Fig. 1 on {r['dataset']} ({r['model']}): q = {r['sample_rate']:.5f} (expected batch "
        f"{r['batch_size']}), {r['epochs']} epochs, C = {r['clip_norm']:g}, lr {r['lr']:g}, momentum "
        f"{r['momentum']:g}, {r['seeds']} runs per chain, {r['points']} {r['target_set']}-set points, sensitivity "
        f"recorded every {r['checkpoint_every']} step(s)"
        + (
            " (per-point upper values and guarantees in the analysis files: confidence bounds, probability "
            ">= 1 - J per point, no union bound over the points)"
            if r["checkpoint_every"] == 1
            else " (per-point upper values: estimates, the sensitivity of the steps between measurements is "
            "reused; per-point guarantee: the data-independent bound)"
        ),
        "",
        "| eps | sigma | steps | alpha | test accuracy (%) | per-step baseline RDP | data-independent RDP at "
        "alpha | same-composition RDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pe in r["per_epsilon"]:
        acc = 100 * np.asarray(pe["test_accuracy_runs"])
        lines.append(
            f"| {pe['training_epsilon']:g} | {pe['noise_multiplier']:.3f} | {pe['steps']} | {pe['alpha']:.3g} "
            f"| {acc.mean():.1f} ± {acc.std():.1f} | {pe['baseline_step_rdp']:.3g} | {pe['baseline_rdp']:.4g} "
            f"| {pe['same_composition_rdp']:.4g} |"
        )
    if show_private and "private" in r:
        lines += [
            "",
            "[private] per-step contribution / per-step baseline (estimates), second half of training, "
            "add = D(Train(X')||Train(X)), remove = D(Train(X)||Train(X')):",
            "",
            "| eps | mean curve add / remove | 10th pct curve add / remove | last step mean add / remove | "
            "Thm. 3.2 alone (median) add / remove | points below 1 |",
            "|---|---|---|---|---|---|",
        ]
        for pv in r["private"]["per_epsilon"]:
            m, p10, last = pv["late_mean_of_mean_curve"], pv["late_mean_of_p10_curve"], pv["last_step"]
            th = pv["median_late_thm32_ratio"] or {"add": float("nan"), "remove": float("nan")}
            lines.append(
                f"| {pv['epsilon']:g} | {m['add']:.3g} / {m['remove']:.3g} | {p10['add']:.3g} / "
                f"{p10['remove']:.3g} | {last['add']['mean']:.3g} / {last['remove']['mean']:.3g} | "
                f"{th['add']:.3g} / {th['remove']:.3g} | "
                f"{100 * pv['share_points_below_baseline_late']:.0f} % |"
            )
    lines += ["", PAPER]
    return "\n".join(lines) + "\n"


def _figure(out, r) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..training.per_instance_outputs import draw_curves, finish_curves

    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for i, (pv, pe) in enumerate(zip(r["private"]["per_epsilon"], r["per_epsilon"], strict=True)):
        draw_curves(axes, pv["curves"], f", eps={pv['epsilon']:g} (alpha={pe['alpha']:.3g})", styles[i % len(styles)])
    finish_curves(axes, f"{r['dataset']}, q={r['sample_rate']:.4f}: ")
    return out.save_figure(
        "thudi_figure1.png",
        fig,
        "private",
        "per-step contribution / per-step baseline over "
        "training: mean and 10th percentile over the points, both directions (Fig. 1a-1c; "
        "statistics of per-point values)",
    ).name


def write_thudi_figure1(out, r) -> list[str]:
    """Public: ``thudi_figure1.json`` (settings, test accuracy, data-independent quantities, time and load).
    Private (``private/``, 0600): ``thudi_figure1.png`` (the figure), ``thudi_figure1_private.json`` (the
    curves and statistics over points) and ``thudi_figure1.md`` (the tables)."""
    from ..io import atomic_open

    public = {k: v for k, v in r.items() if k != "private"}
    out.write_json(
        "thudi_figure1.json",
        public,
        "public",
        "settings, the runs' test accuracy and the "
        "data-independent baselines per epsilon (no per-point value), time and machine load",
    )
    out.write_json(
        "thudi_figure1_private.json",
        r["private"],
        "private",
        "Fig. 1 curves (mean and 10th percentile "
        "over points per step, both directions) and statistics over points (estimates)",
    )
    with atomic_open(
        out.file("thudi_figure1.md", "private", "the tables with the statistics over points"), "w", private=True
    ) as fh:
        fh.write(thudi_markdown(r, show_private=True))
    return [
        "thudi_figure1.json",
        "private/thudi_figure1_private.json",
        "private/thudi_figure1.md",
        f"private/{_figure(out, r)}",
        *record_seed(out, r),
    ]


def _text(r) -> str:
    return (
        thudi_markdown(r, show_private="private" in r) + f"\n{len(r['per_epsilon'])} analyses in "
        f"{r['seconds']:.0f} s (load average before/after: {r['load_average_before']} / "
        f"{r['load_average_after']}, {r['cpu_count']} CPUs); the figure is private: {r['out']}/private/"
        f"thudi_figure1.png (statistics of per-point values, mode 0600); files: {', '.join(r['files'])}"
    )


register(
    Experiment(
        "thudi-figure1",
        "Thudi et al. Fig. 1: per-step per-instance contributions over the per-step baseline, mean "
        "and 10th percentile over points, both directions",
        run_thudi_figure1,
        write_thudi_figure1,
        options=(
            Option("seeds", "runs per chain (on X and on each target's X'; the paper's 10 trials)", at_least_one),
            Option("points", "random target points (the paper: 100 test points for Fig. 1a/1b)", at_least_one),
            Option(
                "epsilons",
                "data-independent epsilons, comma-separated: one line each (the paper's lines include 1 and 10)",
                parse_epsilons,
            ),
            Option(
                "alpha",
                "Renyi order: auto (the order minimising the data-independent epsilon of Thm. 3.3 at "
                "sensitivity C, per epsilon) or a number (the paper: 8)",
                parse_alpha,
            ),
            Option(
                "batch_size",
                "expected batch size (default: the paper's q = 128/60000 times the training set, 3 "
                "on digits, 128 on MNIST)",
                _check_batch,
                type=int,
            ),
            Option("epochs", "epochs (the paper: 10 on MNIST)", at_least_one),
            Option("lr", "learning rate (default %(default)s: tuned for digits at a batch of 3)", positive),
            Option(
                "momentum", "SGD momentum (default 0: plain SGD, tuned for digits at a batch of 3)", _check_momentum
            ),
            Option("clip_norm", "clip norm C (the paper: 1)", positive),
            Option("delta", "delta", valid_delta),
            Option(
                "checkpoint_every",
                "steps between measurements of the targets' gradient norms (1: every step's own "
                "value, needed for the per-point upper values and guarantees to be confidence bounds)",
                _check_checkpoint,
            ),
            Option(
                "target_set", "test (Fig. 1a/1b: X' = X + {x*}) or train (Fig. 1c: X = X' - {x*})", _check_target_set
            ),
            Option("device", "cpu, cuda, auto or a torch device"),
            SEED,
        ),
        paper_models=PAPER_MODELS,
        text=_text,
        out_help="folder for thudi_figure1.json (public) and, in private/, the figure, the curves and the per-instance "
        "analyses",
        description="Thudi et al. 2024 (per-instance DP of DP-SGD), Fig. 1a-1c: DP-SGD at the paper's sampling rate "
        "(q = 128/60000; an expected batch of 3 on digits), runs on X and on each target's X' = X + {x*}; "
        "per step, Thm. 3.3's contribution (with Thm. 3.2 at the measured sensitivity) over the "
        "data-independent per-step RDP (Mironov et al. sec. 3.3), mean and 10th percentile over the points, "
        "both directions.  Estimates (means over the runs).  The figure and every statistic of per-point "
        "values go to private/ (mode 0600).",
    )
)
