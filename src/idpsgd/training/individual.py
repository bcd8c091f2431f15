"""Individual privacy accounting reports of a training run (Yu et al. 2023, §3.3–3.4, Figs. 1, 2, 5).

The accounting itself runs on the engine (:class:`idpsgd.engine.IndividualTracker`); this module
turns it into the run's outputs: every example's ε — the smaller of its output-specific ε and its
data-independent ε, both valid bounds — the per-example CSV (personal data, mode 0600), the
summary with the validation against exact tracking, the privately released statistics, and the
plots.
"""
from __future__ import annotations

import numpy as np
import torch

from ..accounting.release import release_statistics
from ..engine.individual import DEFINITION
from ..io import write_csv, write_json

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def _pearson(a, b) -> float | None:
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.size < 2 or np.std(a) == 0 or np.std(b) == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def final_losses(trainer):
    """(per-example training loss, correctly classified) of the final model (private values)."""
    module = trainer._module()
    x, y = trainer.dataset.x_train, trainer.dataset.y_train
    device = next(module.parameters()).device
    was = module.training
    module.eval()
    losses, correct = [], []
    with torch.no_grad():
        for i in range(0, len(x), 1024):
            out = module(x[i:i + 1024].to(device))
            yb = y[i:i + 1024].to(device)
            losses.append(trainer.per_example_loss(out, yb).double().cpu())
            correct.append((out.argmax(1) == yb).cpu())
    module.train(was)
    return torch.cat(losses).numpy(), torch.cat(correct).numpy()


def individual_report(trainer, per_class_test_accuracy, release_epsilon: float = 0.1) -> dict:
    """ε_i of every example, the summary JSON, CSV and plots in the run folder; returns the summary."""
    tracker, engine = trainer.tracker, trainer.engine
    delta = trainer.budgets.delta
    cap = engine.accountant.individual_epsilons(delta)         # data-independent, the run's accountant
    own = tracker.epsilons(delta)                               # output-specific (RDP of the trajectory)
    eps = np.minimum(own, cap)
    worst = cap
    loss, correct = final_losses(trainer)
    labels = trainer.dataset.y_train.numpy()
    worst_max = float(worst.max())
    at_worst = eps >= worst * (1 - 1e-3)
    a = tracker.accountant
    summary = {
        "kind": tracker.kind, "definition": DEFINITION, "delta": delta, "examples": int(eps.size),
        "rounding": a.rounding, "rounding_step": a.rounding_step, "refresh_every_steps": tracker.every,
        "refreshes": a.refreshes, "individual_clipping": tracker.options.individual_clipping, "steps": a.steps,
        "stale_steps": tracker.stale_steps,
        "mean": float(eps.mean()), "max": float(eps.max()), "min": float(eps.min()),
        "quantiles": {f"{q:g}": float(np.quantile(eps, q)) for q in QUANTILES},
        "worst_case_epsilon": worst_max, "share_at_worst_case": float(at_worst.mean()),
        "pearson_r_log_loss": _pearson(eps, np.log(np.maximum(loss, 1e-12))),
        "all_at_or_below_worst_case": bool(np.all(eps <= worst * (1 + 1e-12))),
    }
    val = tracker.validation(delta, own)
    if val is not None:
        summary["validation"] = val
    summary["released"] = release_statistics(eps, worst_max, epsilon=release_epsilon, delta=delta,
                                             seed=trainer.seed or 0)
    out_dir = trainer.out_dir
    if out_dir is not None:
        write_csv(out_dir / "individual_epsilons.csv",
                  ["index", "label", "budget", "epsilon", "worst_case_epsilon", "final_loss", "correct"],
                  [np.arange(eps.size), labels, trainer.budgets.epsilons, eps, worst, loss, correct.astype(int)],
                  private=True)
        write_json(out_dir / "individual_privacy.json", summary, private=True)
        summary["plots"] = plot_individual(out_dir, eps, worst_max, loss, labels, per_class_test_accuracy,
                                           summary["pearson_r_log_loss"], tracker.kind)
    return summary


def plot_individual(out_dir, eps, worst, loss, labels, per_class_acc, r, kind) -> list[str]:
    """Fig. 1 (histogram + worst case), Fig. 5 (ε vs final loss), Fig. 2 (class ε vs accuracy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..io import atomic_open

    def save(fig, name):
        with atomic_open(out_dir / name, "wb", private=True) as fh:
            fig.savefig(fh, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        return name

    files = []
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.hist(eps, bins=40, color="tab:blue", alpha=0.8)
    ax.axvline(worst, color="tab:red", ls="--", label=f"worst case ε = {worst:.3g}")
    ax.set_xlabel(f"individual ε ({kind})")
    ax.set_ylabel("examples")
    ax.legend()
    files.append(save(fig, "epsilon_histogram.png"))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter(np.maximum(loss, 1e-12), eps, s=4, alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("final training loss")
    ax.set_ylabel("individual ε")
    ax.set_title(f"Pearson r (ε, log loss) = {r:.3f}" if r is not None else "ε vs loss")
    files.append(save(fig, "epsilon_vs_loss.png"))

    classes = [k for k in range(len(per_class_acc)) if np.any(labels == k) and per_class_acc[k] is not None]
    if classes:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        mean_eps = [float(eps[labels == k].mean()) for k in classes]
        acc = [per_class_acc[k] for k in classes]
        ax.scatter(mean_eps, acc)
        for k, a, b in zip(classes, mean_eps, acc):
            ax.annotate(str(k), (a, b), textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("average individual ε of the class")
        ax.set_ylabel("test accuracy of the class")
        files.append(save(fig, "class_epsilon_vs_accuracy.png"))
    return files
