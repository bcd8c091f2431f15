"""Files and figures of a per-instance analysis (:func:`~idpsgd.training.per_instance.run_per_instance`).

Everything per point — the estimates, bounds, per-step contributions and every statistic over
points of them (the Fig. 1 curves are exact means and percentiles of per-point values) — is
private (``private/``, mode 0600), and so is the seed (``private/seed.json``).  Only
``settings.json`` is public: the analysis' settings, the runs' test accuracy and the
data-independent quantities (:data:`PUBLIC_KEYS`).
"""

from __future__ import annotations

import numpy as np

#: Columns of per_instance.csv (one row per target point).
CSV_KEYS = (
    "point",
    "label",
    "correct_fraction",
    "rdp_add",
    "rdp_remove",
    "rdp",
    "rdp_add_upper",
    "rdp_remove_upper",
    "rdp_upper",
    "epsilon",
    "epsilon_upper",
    "baseline_rdp",
    "baseline_epsilon",
    "ratio_to_baseline",
    "ratio_upper_to_baseline",
    "same_composition_rdp",
    "ratio_to_same_composition",
    "guarantee_rdp",
    "guarantee_epsilon",
    "estimate_min_epsilon",
    "step_ratio_add_mean",
    "step_ratio_add_p10",
    "step_ratio_add_late_mean",
    "step_ratio_remove_mean",
    "step_ratio_remove_p10",
    "step_ratio_remove_late_mean",
    "late_thm32_ratio_add",
    "late_thm32_ratio_remove",
    "late_mean_step_ratio",
    "late_share_steps_below_baseline",
)

#: Keys of the summary that are public: settings, test metrics of the DP-trained runs and the
#: data-independent quantities.  The per-point estimates and every statistic of them stay private.
PUBLIC_KEYS = (
    "kind",
    "definition",
    "upper_kind",
    "failure_scope",
    "guarantee_rule",
    "alpha",
    "alpha_rule",
    "best_order_data_independent",
    "update_rule",
    "target_set",
    "runs",
    "runs_trained",
    "steps",
    "checkpoint_every",
    "clip_norm",
    "sample_rate",
    "batch_size",
    "noise_multiplier",
    "lr",
    "momentum",
    "epochs",
    "model",
    "engine",
    "training_epsilon",
    "delta",
    "test_accuracy",
    "test_accuracy_runs",
    "baseline_rdp",
    "baseline_step_rdp",
    "baseline_epsilon_at_alpha",
    "data_independent_epsilon",
    "same_composition_rdp",
    "same_composition_epsilon",
    "same_composition_late_step_ratio",
    "failure",
    "p",
    "secure_mode",
    "randomness",
    "neighbouring",
    "public_inputs",
)  # never the seed: it is in private/seed.json


def public_summary(summary: dict) -> dict:
    """The public part of a per-instance summary (see :data:`PUBLIC_KEYS`)."""
    return {k: summary[k] for k in PUBLIC_KEYS if k in summary}


def write_outputs(
    out_dir, summary: dict, step_rows, curves: dict, stage_values: dict, ckpts, prefix: str = "", figures: bool = True
) -> list:
    """Write the analysis into ``out_dir`` (a :class:`~idpsgd.runfolder.RunFolder` or a path); returns the plots
    (none without ``figures``)."""
    from ..runfolder import RunFolder

    rf = out_dir if isinstance(out_dir, RunFolder) else RunFolder(out_dir, resume=True)
    per_point = summary["points"]
    keys = [k for k in CSV_KEYS if k in per_point[0]]
    rf.write_csv(
        f"{prefix}per_instance.csv",
        keys,
        [[pp[k] for pp in per_point] for k in keys],
        "private",
        f"per point: per-instance RDP estimates in both directions, upper values "
        f"({summary.get('upper_kind', 'estimate')}s), the same-composition baseline, the guarantee "
        f"({summary.get('guarantee_rule', '')}), per-step ratio statistics",
    )
    rf.write_csv(
        f"{prefix}per_instance_steps.csv",
        ["point", "step", "contribution_add", "contribution_remove", "baseline", "ratio_add", "ratio_remove"],
        list(zip(*step_rows, strict=True)),
        "private",
        "every step's per-instance contribution per point (estimates)",
    )
    n = len(curves["add"]["mean"])
    rf.write_csv(
        f"{prefix}per_instance_curves.csv",
        ["step", "mean_ratio_add", "p10_ratio_add", "mean_ratio_remove", "p10_ratio_remove"],
        [
            list(range(1, n + 1)),
            curves["add"]["mean"],
            curves["add"]["p10"],
            curves["remove"]["mean"],
            curves["remove"]["p10"],
        ],
        "private",
        "per step: mean and 10th percentile over the points of the contribution / per-step baseline (Fig. 1)",
    )
    rf.record_seed(
        summary["seed"],
        "the analysis' seed: the shared initialisation, every run's sampling and noise, "
        "the random point choice; --seed with it replays the analysis",
        name=f"{prefix}seed.json",
    )
    rf.write_json(
        f"{prefix}per_instance.json",
        {k: v for k, v in summary.items() if k != "curves"},
        "private",
        "the per-instance analysis: settings, per-point estimates, NPIU decisions, test accuracy",
    )
    rf.write_json(
        f"{prefix}settings.json",
        public_summary(summary),
        "public",
        "the analysis' settings, the runs' test accuracy and the data-independent baselines (no per-point value)",
    )
    if not figures:
        return []
    return [
        plot_steps(rf, curves, summary, f"{prefix}per_instance.png"),
        plot_stages(rf, stage_values, ckpts, summary["update_rule"], f"{prefix}per_instance_stages.png"),
    ]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_curves(axes, curves: dict, label: str = "", style: str = "-") -> None:
    """Fig. 1a/1c (mean over points) on ``axes[0]`` and Fig. 1b (10th percentile) on ``axes[1]``."""
    for dn, color in (("add", "tab:blue"), ("remove", "tab:orange")):
        name = "D(Train(X')||Train(X))" if dn == "add" else "D(Train(X)||Train(X'))"
        for ax, key in zip(axes, ("mean", "p10"), strict=True):
            y = np.maximum(np.asarray(curves[dn][key], dtype=float), 1e-12)
            ax.plot(np.arange(1, y.size + 1), y, color=color, ls=style, lw=1.1, label=f"{name}{label}")


def finish_curves(axes, title: str = "") -> None:
    for ax, what in zip(axes, ("mean over points (Fig. 1a, 1c)", "10th percentile over points (Fig. 1b)"), strict=True):
        ax.axhline(1.0, color="tab:red", ls="--", lw=1, label="per-step data-independent baseline")
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_title(f"{title}{what}", fontsize=9)
    axes[0].set_ylabel("per-step contribution / baseline (estimate)")
    axes[0].legend(fontsize=7)


def plot_steps(rf, curves: dict, summary: dict, name: str = "per_instance.png") -> str:
    """Fig. 1: per-step contribution (Thm. 3.3 with Thm. 3.2/3.6) over the per-step baseline at α."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    draw_curves(axes, curves)
    finish_curves(axes, f"alpha={summary['alpha']:.3g}: ")
    return rf.save_figure(name, fig, "private", "per-step contribution / baseline over training (Fig. 1)").name


def plot_stages(rf, values: dict, ckpts, update_rule: str, name: str = "per_instance_stages.png") -> str:
    """Fig. 2 (sum rule) / Fig. 4 (mean rule): distribution over points of the per-step guarantee at α,
    relative to the baseline, at the first, middle and last checkpoint (log axis)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    stages = {"initial": 0, "middle": len(ckpts) // 2, "final": len(ckpts) - 1}
    for ax, dn in zip(axes, ("add", "remove"), strict=True):
        v = np.maximum(values[dn], 1e-12)
        lo, hi = float(np.log10(v.min())), float(np.log10(max(v.max(), 1.0)))
        bins = np.logspace(lo - 0.1, hi + 0.1, 30)
        for stage, i in stages.items():
            ax.hist(v[i], bins=bins, alpha=0.5, label=f"{stage} (step {int(ckpts[i]) + 1})")
        ax.axvline(1.0, color="tab:purple", ls="--", label="data-independent baseline")
        ax.set_xscale("log")
        ax.set_xlabel("per-step guarantee / baseline")
        ax.set_title(
            ("D(M(X')||M(X))" if dn == "add" else "D(M(X)||M(X'))")
            + f", {update_rule} rule (Thm. {'3.2' if update_rule == 'sum' else '3.6'})",
            fontsize=9,
        )
    axes[0].set_ylabel("points")
    axes[0].legend(fontsize=7)
    return rf.save_figure(name, fig, "private", "distribution of per-step guarantees per stage (Fig. 2/4)").name
