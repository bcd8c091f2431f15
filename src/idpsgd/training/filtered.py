"""Training with an individual Rényi filter: examples leave training when their own budget is spent.

Boenisch et al. 2023, §5 ("Synergy between individualized privacy accounting and assignment"),
App. D.5, Table 3, Fig. 3: Feldman & Zrnic's individual Rényi filter (2021) with individualized
budgets, on :class:`~idpsgd.engine.IndividualizedPrivacyEngine` with ``privacy_filter="individual"``
(:mod:`idpsgd.engine.budget.filter` has the filter and why it is valid).  This module owns the two
recipes — full-batch DP-GD (``FilterOptions(gd=True)``, Feldman & Zrnic Alg. 3: each step charged
at the exact sensitivity min(c, ‖g_i(θ_t)‖)) and Poisson-subsampled DP-SGD with individual clipping
(Yu et al. 2023 Alg. 3) — and their run folder.  Calibration is the ordinary one
(:func:`~idpsgd.training.plans.build_plan`) for ``config.epochs``; the run lasts ``extend`` × that
long, a length fixed in advance (public), so an example whose gradients stay below its clip bound
keeps training until its own filter drops it.

User guide and outputs: ``docs/filter.md``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..assignment import Budgets
from ..data import Dataset
from ..engine.budget.filter import DEFINITION, FilterOptions
from ..names import IDP_METHODS
from ..validation import InvalidParameterError, check_delta
from .loop import TrainConfig, Trainer, run_in_folder


def check_filter_config(config: TrainConfig, options: FilterOptions | None) -> FilterOptions:
    """Refuse combinations the filtered recipes cannot honour; returns the validated options."""
    if options is not None and not isinstance(options, FilterOptions):
        raise InvalidParameterError("filter_options", type(options).__name__, "must be a FilterOptions")
    options = (options or FilterOptions()).validate()
    if config.method not in IDP_METHODS:
        raise InvalidParameterError(
            "method",
            config.method,
            f"is not supported with --filter individual: use {', '.join(IDP_METHODS)} (one phase over all examples)",
        )
    if config.accountant != "rdp":
        raise InvalidParameterError(
            "accountant",
            config.accountant,
            "is not supported with --filter individual: a "
            "Rényi filter composes RDP at a fixed order (Feldman & Zrnic 2021); use rdp",
        )
    if options.gd and config.method == "sample":
        raise InvalidParameterError(
            "method",
            "sample",
            "cannot be used with --gd: full-batch DP-GD samples every "
            "example (q = 1), so rates cannot differ; use uniform (the filter individualizes "
            "through the budgets) or scale",
        )
    return options


class FilteredTrainer(Trainer):
    """:class:`~idpsgd.training.loop.Trainer` with the individual Rényi filter on its engine.

    Args:
        dataset, budgets, config, out_dir, model, criterion, optimizer_factory: as for ``Trainer``;
            ``config.epochs`` is the calibration horizon (with ``gd``, one epoch is one step).
        options: :class:`~idpsgd.engine.budget.filter.FilterOptions` (``gd``: full-batch DP-GD; ``extend``:
            the run lasts ``ceil(extend × epochs)`` epochs).
    """

    def __init__(
        self,
        dataset: Dataset,
        budgets: Budgets,
        config: TrainConfig,
        options: FilterOptions | None = None,
        out_dir=None,
        **kwargs,
    ):
        self.filter_options = check_filter_config(config, options)
        if self.filter_options.gd and kwargs.get("users") is not None:
            raise InvalidParameterError(
                "gd",
                True,
                "full-batch DP-GD takes every row, while a user-level step takes up to k rows of each user (the "
                "unit that is clipped): use Poisson sampling (without --gd) at user level",
            )
        if self.filter_options.gd:
            config = dataclasses.replace(config, batch_size=len(dataset.y_train))
        super().__init__(dataset, budgets, config, out_dir, **kwargs)
        self.calibrated_steps = self.plan.steps
        self.set_epochs(math.ceil(self.filter_options.extend * config.epochs - 1e-9))

    def _phase_kwargs(self) -> dict:
        return {
            "privacy_filter": "individual",
            "filter_options": self.filter_options,
            "per_sample_loss": self._per_sample_loss,
        }

    @property
    def filter(self):
        return self.engine.filter

    def _signature(self) -> dict:
        return {**super()._signature(), "filter": dataclasses.asdict(self.filter_options)}

    # --- results -------------------------------------------------------------------------
    def realized_epsilons(self) -> np.ndarray:
        """Every example's realized ε (its accumulated RDP converted at its filter order, plus the
        preprocessing's ε): private values, each ≤ its budget."""
        return self.filter.realized_epsilons() + self.preprocessing_cost[0]

    def report(self) -> dict:
        r = super().report()
        f, o = self.filter, self.filter_options
        eps_pre, delta_pre = self.preprocessing_cost
        for g, s in zip(r["groups"], f.summary()["groups"], strict=True):
            g.pop("epsilon_rdp", None)  # the data-independent ε of all steps run: not the guarantee here
            g["filter_orders"], g["rdp_budgets"] = s["orders"], s["rdp_budgets"]
        r["filter"] = {
            **f.summary(),
            "extend": o.extend,
            "calibrated_steps": int(self.calibrated_steps),
            "run_steps": int(self.plan.steps),
        }
        r["guarantee"] = (
            f"model: {DEFINITION}; for every example of a group, epsilon_spent is the smaller of its budget "
            "(the filter's guarantee) and the data-independent epsilon of the steps run, at delta = "
            f"{self.train_budgets.delta + delta_pre:g}"
            + (f" (including ({eps_pre:g}, {delta_pre:g}) spent by the private normalization)" if eps_pre else "")
        )
        eps, budgets = self.realized_epsilons(), self.budgets.epsilons
        counts = f.active_counts()
        groups = []
        for k, v in enumerate(self.budget_values):
            m = self.group_of == k
            groups.append(
                {
                    "budget": float(v),
                    "count": int(m.sum()),
                    "active_at_end": int(f.active[m].sum()),
                    "realized_epsilon_mean": float(eps[m].mean()),
                    "realized_epsilon_max": float(eps[m].max()),
                    "realized_epsilon_min": float(eps[m].min()),
                }
            )
        r["private"]["filter"] = {
            "about": "exact statistics of private per-example values (not covered by the guarantee)",
            "steps": int(f.steps),
            "refreshes": int(f.refreshes),
            "groups": groups,
            "active_per_step": counts.tolist(),  # steps × budget groups
            "all_rdp_within_budget": bool(np.all(f.rdp_spent <= f.rdp_budget)),
            "all_at_or_below_budget": bool(np.all(eps <= budgets)),
        }
        return r

    def write_outputs(self, report: dict) -> None:
        """Public: report.json, model.pt; private: active.csv, active.png, filter_epsilons.csv, filter.json,
        history.json (no ledger.csv: the group accountant's data-independent ε is not this run's guarantee)."""
        if self.run_folder is None:
            return
        rf, f = self.run_folder, self.filter
        counts = f.active_counts()
        header = ["step", "active_total"] + [f"active_budget_{v:g}" for v in self.budget_values]
        rf.write_csv(
            "active.csv",
            header,
            [np.arange(1, counts.shape[0] + 1), counts.sum(axis=1), *counts.T],
            "private",
            "active examples of each budget group at every step (counts of private data: the "
            "guarantee does not cover them)",
        )
        rf.save_figure(
            "active.png",
            active_figure({"individual filter": (counts, self.budget_values)}),
            "private",
            "active examples over the steps, one line per budget group (Boenisch et al. Fig. 3)",
        )
        eps = self.realized_epsilons()
        dropped = f.dropped_at
        users = self.users  # user level: one row per user, with its number of rows instead of a label
        rf.write_csv(
            "filter_epsilons.csv",
            ["index", "label" if users is None else "rows", *FILTER_COLUMNS],
            [
                np.arange(eps.size),
                self.dataset.y_train.numpy() if users is None else users.rows_per_user,
                self.budgets.epsilons,
                f.order,
                f.rdp_budget,
                f.rdp_spent,
                eps,
                dropped,
            ],
            "private",
            "every example's budget, filter order, RDP budget and RDP spent at that order, realized "
            "epsilon (<= budget) and the first step it missed (-1: active to the end); personal data",
        )
        rf.write_json(
            "filter.json", report["private"]["filter"], "private", "exact statistics of the filter's per-example values"
        )
        self.write_model_and_report(report, "the filter's orders and RDP budgets, test metrics, hyper-parameters")


#: the per-unit columns of filter_epsilons.csv after the index and the label (user level: the rows)
FILTER_COLUMNS = ("budget", "filter_order", "rdp_budget", "rdp_spent", "epsilon", "dropped_at_step")


def active_figure(runs: dict, title: str | None = None):
    """Boenisch et al. Fig. 3: active examples over the steps, one panel per run and one line per
    budget group (plus the total).  ``runs``: label → (counts (steps × groups), group budgets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.8 * len(runs), 3.6), sharey=True, squeeze=False)
    for ax, (label, (counts, values)) in zip(axes[0], runs.items(), strict=True):
        counts = np.asarray(counts).reshape(-1, len(values))
        steps = np.arange(1, counts.shape[0] + 1)
        ax.plot(steps, counts.sum(axis=1), color="black", lw=2, label="all examples")
        if len(values) > 1:
            colors = plt.cm.viridis(np.linspace(0.15, 0.8, len(values)))
            for k, (v, col) in enumerate(zip(values, colors, strict=True)):
                ax.plot(steps, counts[:, k], color=col, lw=1.5, label=f"budget ε = {v:g}")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("active examples")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def train_filtered(
    dataset: Dataset,
    budgets: Budgets,
    config: TrainConfig,
    options: FilterOptions | None = None,
    out_dir=None,
    resume: bool = False,
    *,
    model=None,
    criterion=None,
    optimizer_factory=None,
    overwrite: bool = False,
    users=None,
) -> dict:
    """Train with the individual Rényi filter (full-batch DP-GD with ``options.gd``, else
    Poisson-subsampled DP-SGD with individual clipping); returns the report (also written to ``out_dir``).

    Args:
        dataset: the data (:func:`idpsgd.data.load_dataset`).
        budgets: one budget per training example and δ.
        config: calibration method (uniform, sample, scale), ``epochs`` (the calibration horizon)
            and hyperparameters; the rdp accountant only.
        options: :class:`~idpsgd.engine.budget.filter.FilterOptions`.
        out_dir: run folder (a path or :class:`~idpsgd.runfolder.RunFolder`).
        resume: continue from the folder's checkpoint (same settings) if it exists.
        model, criterion, optimizer_factory: see :class:`~idpsgd.training.loop.Trainer`.
        overwrite: replace another run already in ``out_dir``.
        users: an :class:`idpsgd.Users` over the training rows: the filter at user level (one budget per
            user, each user's summed gradient the unit; Poisson sampling only).
    """
    check_delta(budgets.delta)
    options = check_filter_config(config, options)
    return run_in_folder(
        lambda cfg, folder: FilteredTrainer(
            dataset,
            budgets,
            cfg,
            options,
            folder,
            model=model,
            criterion=criterion,
            optimizer_factory=optimizer_factory,
            users=users,
        ),
        config,
        out_dir,
        resume=resume,
        overwrite=overwrite,
        keep_plan=False,
    )


__all__ = [
    "FilterOptions",
    "FilteredTrainer",
    "active_figure",
    "check_filter_config",
    "train_filtered",
]
