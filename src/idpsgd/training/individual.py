"""Individual privacy accounting inside a training run (Yu et al. 2023, Alg. 2 and 3, §3.3–3.4).

:class:`IndividualTracker` is driven by the training loop: before every step it refreshes the
gradient norms of all the phase's examples every K steps (K = steps per epoch / γ, γ refreshes
per epoch), optionally clips every example at its latest (rounded) norm estimate (individual
clipping, Alg. 3), and tracks a random validation subset exactly at every step (§3.3); after
every step it composes each example's per-step RDP.  :meth:`finish` writes the per-example CSV,
the summary JSON and the plots (Figs. 1, 2, 5) into the run folder.

What the numbers are (the report says which):

* **guarantee** — output-specific individual (ε_i, δ)-DP (Yu et al. Def. 4, Thm. 3.3): with
  individual clipping (the accounted sensitivity bounds the clipped gradient at every step), or
  with norms refreshed every step (K = 1) and rounding ``exact`` or ``ceil``;
* **estimate** — otherwise: norms between refreshes are taken from the last refresh, and
  ``nearest`` rounding can round down.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..accounting import IndividualAccountant
from ..accounting.release import release_statistics
from ..io import write_csv, write_json
from ..validation import InvalidParameterError, check_positive
from .norms import per_example_grad_norms

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
DEFINITION = "output-specific individual (epsilon_i, delta)-DP (Yu et al. 2023, Def. 4, Thm. 3.3)"


def _pearson(a, b) -> float | None:
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.size < 2 or np.std(a) == 0 or np.std(b) == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


class IndividualTracker:
    """Per-example accounting for one training phase (examples ``x``, ``y`` of the phase)."""

    def __init__(self, assignment, steps_per_epoch: int, x: torch.Tensor, y: torch.Tensor, *,
                 refreshes_per_epoch: float = 1.0, rounding: str = "nearest", rounding_step: float | None = None,
                 individual_clipping: bool = False, validate_subset: int = 1000, seed: int = 0):
        check_positive(refreshes_per_epoch, "refreshes_per_epoch")
        if int(validate_subset) < 0:
            raise InvalidParameterError("validate_subset", validate_subset, "must be an integer >= 0")
        self.x, self.y = x, y
        self.every = max(1, int(round(steps_per_epoch / float(refreshes_per_epoch))))
        self.individual_clipping = bool(individual_clipping)
        a = assignment
        self.accountant = IndividualAccountant(a.sample_rates, a.noise_multiplier, a.clip_norm, a.clip_norms,
                                               rounding=rounding, rounding_step=rounding_step)
        n = len(y)
        m = min(int(validate_subset), n)
        self.subset = np.sort(np.random.default_rng([seed, 1]).choice(n, m, replace=False)) if m else np.zeros(0, int)
        self.exact = (IndividualAccountant(a.sample_rates[self.subset], a.noise_multiplier, a.clip_norm,
                                           a.clip_norms[self.subset], rounding="exact") if m else None)

    @property
    def kind(self) -> str:
        exact_every_step = self.every == 1 and self.accountant.rounding in ("exact", "ceil")
        return "guarantee" if self.individual_clipping or exact_every_step else "estimate"

    def apply_clip_norms(self, optimizer) -> None:
        """Individual clipping: clip example i at its current sensitivity Z_i (≤ c_i)."""
        if self.individual_clipping and self.accountant.refreshes:
            optimizer.clip_norms = torch.as_tensor(self.accountant.sensitivity, dtype=torch.float32)

    def before_step(self, model, optimizer, phase_step: int) -> None:
        refreshed = None
        if phase_step % self.every == 0:
            refreshed, _ = per_example_grad_norms(model, self.x, self.y)
            self.accountant.update_norms(refreshed)
            self.apply_clip_norms(optimizer)
        if self.exact is not None:
            norms = (refreshed[self.subset] if refreshed is not None
                     else per_example_grad_norms(model, self.x[self.subset], self.y[self.subset])[0])
            if self.individual_clipping:   # the clipped gradient's norm is at most Z_i
                norms = np.minimum(norms, self.accountant.sensitivity[self.subset])
            self.exact.update_norms(norms)

    def after_step(self) -> None:
        self.accountant.add_steps(1)
        if self.exact is not None:
            self.exact.add_steps(1)

    def state_dict(self) -> dict:
        return {"accountant": self.accountant.state_dict(),
                "exact": self.exact.state_dict() if self.exact is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.accountant.load_state_dict(state["accountant"])
        if self.exact is not None and state["exact"] is not None:
            self.exact.load_state_dict(state["exact"])

    # --- results ---------------------------------------------------------------------------
    def finish(self, model, delta: float, indices, budgets, out_dir, per_class_test_accuracy,
               release_epsilon: float = 0.1, seed: int = 0) -> dict:
        """Compute ε_i, write the per-example CSV, summary JSON and plots; return the summary."""
        eps = self.accountant.epsilon(delta)
        worst = self.accountant.worst_case_epsilon(delta)
        module = getattr(model, "_module", model)
        was = module.training
        module.eval()
        with torch.no_grad():
            out = torch.cat([module(self.x[i:i + 1024]) for i in range(0, len(self.x), 1024)])
            loss = F.cross_entropy(out, self.y, reduction="none").double().numpy()
            correct = (out.argmax(1) == self.y).numpy()
        module.train(was)
        labels = self.y.numpy()
        worst_max = float(worst.max())
        at_worst = eps >= worst * (1 - 1e-3)
        summary = {
            "kind": self.kind, "definition": DEFINITION, "delta": delta, "examples": int(eps.size),
            "rounding": self.accountant.rounding, "rounding_step": self.accountant.rounding_step,
            "refresh_every_steps": self.every, "refreshes": self.accountant.refreshes,
            "individual_clipping": self.individual_clipping, "steps": self.accountant.steps,
            "mean": float(eps.mean()), "max": float(eps.max()), "min": float(eps.min()),
            "quantiles": {f"{q:g}": float(np.quantile(eps, q)) for q in QUANTILES},
            "worst_case_epsilon": worst_max, "share_at_worst_case": float(at_worst.mean()),
            "pearson_r_log_loss": _pearson(eps, np.log(np.maximum(loss, 1e-12))),
            "all_at_or_below_worst_case": bool(np.all(eps <= worst * (1 + 1e-12))),
        }
        if self.exact is not None:
            exact = self.exact.epsilon(delta)
            est = eps[self.subset]
            summary["validation"] = {"examples": int(self.subset.size), "pearson_r": _pearson(est, exact),
                                     "mean_abs_error": float(np.mean(np.abs(est - exact))),
                                     "max_abs_error": float(np.max(np.abs(est - exact))),
                                     "min_estimate_minus_exact": float(np.min(est - exact))}
        summary["released"] = release_statistics(eps, worst_max, epsilon=release_epsilon, delta=delta, seed=seed)
        if out_dir is not None:
            write_csv(out_dir / "individual_epsilons.csv",
                      ["index", "label", "budget", "epsilon", "worst_case_epsilon", "final_loss", "correct"],
                      [np.asarray(indices), labels, np.asarray(budgets), eps, worst, loss, correct.astype(int)],
                      private=True)
            write_json(out_dir / "individual_privacy.json", summary, private=True)
            summary["plots"] = plot_individual(out_dir, eps, worst_max, loss, labels, per_class_test_accuracy,
                                               summary["pearson_r_log_loss"], self.kind)
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
