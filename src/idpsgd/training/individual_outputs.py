"""Individual privacy accounting reports of a training run (Yu et al. 2023, §3.3–3.4, Figs. 1, 2, 5).

The accounting itself runs on the engine (:class:`idpsgd.engine.IndividualTracker`); this module
turns it into the run's outputs: every example's ε — the minimum of its output-specific RDP ε, its
output-specific PLD ε (individual accountant ``pld``) and its data-independent ε from the run's
accountant, with the name of the one that gave it — the per-example CSV (personal data, mode 0600),
the summary with the validation against exact tracking and the sensitivity check, the privately
released statistics, and the plots.

``kind`` says what the output-specific numbers are (the tracker's rule, :mod:`idpsgd.engine.budget.individual`):
a **guarantee** when training clipped every example at its charged sensitivity (individual clipping,
or norms of every step with exact/ceil rounding), else an **estimate** (then each example's ε is an
estimate capped by its data-independent bound); ``kind`` and ``kind_reason`` are public and depend on
the options only; the check's statistics (how often the enforcement clipped, norms that differed from
the norm pass) are private.
"""

from __future__ import annotations

import numpy as np
import torch

from ..accounting.release import release_statistics
from ..engine.budget.individual import DEFINITION

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def pearson(a, b) -> float | None:
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
            out = module(x[i : i + 1024].to(device))
            yb = y[i : i + 1024].to(device)
            losses.append(trainer.per_example_loss(out, yb).double().cpu())
            correct.append((out.argmax(1) == yb).cpu())
    module.train(was)
    return torch.cat(losses).numpy(), torch.cat(correct).numpy()


def per_user_values(users, loss, correct) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """User level: each user's mean final loss over its rows, its share of rows classified correctly, and
    no class (-1: a user's rows may belong to several classes)."""
    counts = np.maximum(users.rows_per_user, 1)
    mean = np.bincount(users.unit_of_row, weights=loss, minlength=users.num_users) / counts
    share = np.bincount(users.unit_of_row, weights=correct.astype(float), minlength=users.num_users) / counts
    return mean, share, np.full(users.num_users, -1)


def individual_report(trainer, per_class_test_accuracy, release_epsilon: float) -> tuple[dict, dict]:
    """Every example's ε (+ the private preprocessing's ε, if any) and its outputs in the run folder.

    Returns ``(public, private)``: the public part holds what the guarantees cover (the definition,
    the options, the privately released statistics); the private part the exact statistics, the
    validation against exact tracking and the files' names (per-example CSV, summary, plots: 0600).
    """
    tracker, engine = trainer.tracker, trainer.engine
    delta = trainer.train_budgets.delta
    eps_pre = trainer.preprocessing_cost[0]
    # each example's ε: the minimum of its own RDP ε, its own PLD ε (individual accountant "pld")
    # and its data-independent ε from the run's accountant (≤ its budget by calibration)
    group_cap = engine.accountant.individual_epsilons(delta)
    rep = tracker.report(delta, cap=group_cap)
    eps = rep.epsilon + eps_pre
    worst = group_cap + eps_pre
    loss, correct = final_losses(trainer)
    labels = trainer.dataset.y_train.numpy()
    users = getattr(trainer, "users", None)
    if users is not None:  # user level: the unit is the user (its rows' mean loss and share correct; no class)
        loss, correct, labels = per_user_values(users, loss, correct)
    upper = float(trainer.budgets.epsilons.max())  # public clipping range of the release
    at_worst = eps >= worst * (1 - 1e-3)
    a = tracker.accountant
    accountants = {
        "individual": tracker.options.accountant,
        "data_independent": engine.accountant.accountant,
        "epsilon": "per example the minimum of its own rdp epsilon"
        + (", its own pld epsilon" if rep.pld is not None else "")
        + f" and its data-independent epsilon ({engine.accountant.accountant}); "
        "'source' names the bound that gave it",
    }
    public = {
        "kind": tracker.kind,
        "kind_reason": tracker.kind_reason,
        "definition": DEFINITION,
        "delta": trainer.budgets.delta,
        "examples": int(eps.size),
        "rounding": a.rounding,
        "rounding_step": a.rounding_step,
        "refresh_every_steps": tracker.every,
        "individual_clipping": tracker.options.individual_clipping,
        "accountants": accountants,
        "released": release_statistics(eps, upper, epsilon=release_epsilon, delta=trainer.budgets.delta),
    }
    exact = {
        "kind": tracker.kind,
        "refreshes": a.refreshes,
        "steps": a.steps,
        "stale_steps": tracker.stale_steps,
        "sensitivity_check": tracker.sensitivity_check(),
        "mean": float(eps.mean()),
        "max": float(eps.max()),
        "min": float(eps.min()),
        "quantiles": {f"{q:g}": float(np.quantile(eps, q)) for q in QUANTILES},
        "source_counts": rep.counts(),
        "mean_rdp": float(rep.rdp.mean() + eps_pre),
        **({"mean_pld": float(rep.pld.mean() + eps_pre)} if rep.pld is not None else {}),
        "worst_case_epsilon": float(worst.max()),
        "share_at_worst_case": float(at_worst.mean()),
        "pearson_r_log_loss": pearson(eps, np.log(np.maximum(loss, 1e-12))),
        "all_at_or_below_worst_case": bool(np.all(eps <= worst * (1 + 1e-12))),
        "all_at_or_below_budget": bool(np.all(eps <= trainer.budgets.epsilons * (1 + 1e-12))),
    }
    val = tracker.validation(delta, rep.rdp)  # RDP estimates vs exact RDP tracking
    if val is not None:
        exact["validation"] = val
    rf = trainer.run_folder
    if rf is not None:
        pld_cols = [("pld_epsilon", rep.pld + eps_pre)] if rep.pld is not None else []
        cols = [
            ("index", np.arange(eps.size)),
            ("label", labels) if users is None else ("rows", users.rows_per_user),
            ("budget", trainer.budgets.epsilons),
            ("epsilon", eps),
            ("source", rep.source),
            ("rdp_epsilon", rep.rdp + eps_pre),
            *pld_cols,
            ("worst_case_epsilon", worst),
            ("final_loss", loss),
            ("correct", correct.astype(int)) if users is None else ("share_correct", correct),
        ]
        rf.write_csv(
            "individual_epsilons.csv",
            [k for k, _ in cols],
            [v for _, v in cols],
            "private",
            f"every {'example' if users is None else 'user'}'s individual epsilon ({tracker.kind}; personal data; "
            "'source': the bound that gave it: its own rdp or pld epsilon, or 'cap', its data-independent epsilon), "
            "its budget, final loss" + ("" if users is None else " (the mean over the user's rows)"),
        )
        rf.write_json(
            "individual_privacy.json",
            {**public, **exact},
            "private",
            "exact statistics of the individual epsilons, the validation against exact tracking and "
            "the check of the charged sensitivities against training's clipped norms",
        )
        if tracker.options.record_norms:
            rf.write_npz(
                "norms.npz",
                "private",
                "every refresh's per-example gradient norms and the steps it "
                "covered, with the run's rates, clip norms and sigma (input of 'idpsgd account')",
                **tracker.norms_record(),
            )
        exact["plots"] = plot_individual(
            rf, eps, trainer.budgets.epsilons, worst, loss, labels, per_class_test_accuracy, tracker.kind
        )
    return public, exact


def plot_individual(run_folder, eps, budgets, worst, loss, labels, per_class_acc, kind) -> list[str]:
    """Fig. 1 (histogram per privacy group, each with its own worst case), Fig. 5 (ε as a share of
    its group's worst case vs final loss, coloured by group), Fig. 2 (class mean ε vs accuracy).
    These show per-example values: private files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.unique(budgets)
    colors = plt.cm.viridis(np.linspace(0.1, 0.85, values.size))
    files = []
    fig, ax = plt.subplots(figsize=(6, 3.8))
    bins = np.linspace(0, float(max(worst.max(), eps.max())) * 1.02, 50)
    for v, col in zip(values, colors, strict=True):
        m = budgets == v
        ax.hist(eps[m], bins=bins, color=col, alpha=0.6, label=f"budget {v:g} ({int(m.sum())} examples)")
        ax.axvline(float(worst[m].max()), color=col, ls="--", lw=1.5)
    ax.set_xlabel(f"individual ε ({kind}); dashed: each group's worst case")
    ax.set_ylabel("examples")
    ax.legend(fontsize=8)
    files.append(
        run_folder.save_figure(
            "epsilon_histogram.png", fig, "private", "histogram of the individual epsilons per privacy group"
        ).name
    )

    fig, ax = plt.subplots(figsize=(6, 3.8))
    share = eps / np.maximum(worst, 1e-300)
    for v, col in zip(values, colors, strict=True):
        m = budgets == v
        ax.scatter(np.maximum(loss[m], 1e-8), share[m], s=5, alpha=0.5, color=col, label=f"budget {v:g}")
    spread = np.max(loss) / max(np.min(loss), 1e-8) if loss.size else 1.0
    if spread > 20:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("final training loss" + (" (log scale)" if spread > 20 else ""))
    ax.set_ylabel("ε / the group's worst case")
    r = pearson(share, np.log(np.maximum(loss, 1e-12)))
    ax.set_title(f"Pearson r (ε share, log loss) = {r:.2f}" if r is not None else "ε share vs loss", fontsize=9)
    ax.legend(fontsize=8, markerscale=3)
    files.append(
        run_folder.save_figure(
            "epsilon_vs_loss.png", fig, "private", "individual epsilon (share of its group's worst case) vs final loss"
        ).name
    )

    classes = [k for k in range(len(per_class_acc)) if np.any(labels == k) and per_class_acc[k] is not None]
    if classes:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        mean_eps = [float(eps[labels == k].mean()) for k in classes]
        acc = [per_class_acc[k] for k in classes]
        ax.scatter(mean_eps, acc)
        for k, a, b in zip(classes, mean_eps, acc, strict=True):
            ax.annotate(str(k), (a, b), textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("average individual ε of the class")
        ax.set_ylabel("test accuracy of the class")
        files.append(
            run_folder.save_figure(
                "class_epsilon_vs_accuracy.png",
                fig,
                "private",
                "mean individual epsilon of each class vs its test accuracy",
            ).name
        )
    return files
