"""Yu et al. 2023 (individual privacy accounting for DP-SGD): Figs. 1, 2/6, 4 and 5 as one experiment
(``idpsgd reproduce yu-figure``).

DP-SGD at one target ε for every example, with individual accounting (Alg. 2: norms refreshed
``refreshes_per_epoch`` times per epoch, rounded to the nearest multiple of 0.01·C, per-example
RDP): the distribution of the individual ε against the worst case (Fig. 1), ε against the final
training loss (Fig. 5), per class mean ε against test accuracy (Figs. 2/6), and estimate against
exact tracking on ``validate_subset`` examples (Fig. 4), with a second run that clips each example
at its latest estimate (App. B.2, Alg. 3: every ε a guarantee).  Privacy hygiene: per-example ε,
losses and exact statistics of them go to ``private/`` (mode 0600); the public outputs hold
accuracies, hyper-parameters, σ, the worst-case ε and **privately released statistics** (§3.4,
:mod:`idpsgd.accounting.release`: the ε_i's mean and quantiles at ``release_epsilon``, each class's
mean at ``class_release_epsilon`` by parallel composition), so a run's releases cost
(``release_epsilon`` + ``class_release_epsilon``, 2δ) on top of its training guarantee.

What was measured, and what differs from the paper: ``docs/reproducing.md``.
"""

from __future__ import annotations

import time

import numpy as np

from ..accounting.neighbouring import neighbouring
from ..io import atomic_open
from ..training.individual_outputs import pearson
from .registry import SEED, Experiment, Option, at_least_one, at_least_zero, positive, register, valid_delta
from .summary import mean_std, percent, randomness, record_seed, repetition_seeds

#: the paper's MNIST Table 2 (non-private statistics of the ε_i, MNIST, ResNet-20, 100 epochs)
PAPER_MNIST = (
    "Paper, MNIST (Table 2, non-private): mean ε 0.686, quantiles 0.1/0.3/0.5/0.7/0.9: 0.236 / 0.318 / "
    "0.431 / 0.697 / 1.682; ~3 % of the examples at the worst case (CIFAR-10: ~35 %); Pearson r of ε and "
    "log loss > 0.9 on every dataset; CIFAR-10: the class with the lowest accuracy ('cat') has a 44.2 % "
    "larger mean ε than the one with the highest ('automobile')."
)
#: the paper's models (ResNet-20 with GroupNorm; CIFAR-10 used WRN16-4, not in the registry)
PAPER_MODELS = {"mnist": "resnet20", "cifar10": "resnet20"}


def per_example(trainer) -> dict:
    """A finished individually accounted run's per-example arrays (private values): ``epsilon`` (the
    reported ε_i, min of its own bound and the cap), ``estimate_rdp`` (its own RDP ε), ``worst``
    (the data-independent ε), final ``loss`` and ``correct``, ``label``; on the exact-tracked subset
    ``subset`` (indices) and ``exact``."""
    from ..training.individual_outputs import final_losses

    tracker, delta = trainer.tracker, trainer.train_budgets.delta
    eps_pre = trainer.preprocessing_cost[0]
    cap = trainer.engine.accountant.individual_epsilons(delta)
    rep = tracker.report(delta, cap=cap)
    loss, correct = final_losses(trainer)
    out = {
        "epsilon": rep.epsilon + eps_pre,
        "estimate_rdp": rep.rdp + eps_pre,
        "worst": cap + eps_pre,
        "loss": loss,
        "correct": correct.astype(np.int8),
        "label": trainer.dataset.y_train.numpy(),
        "subset": tracker.subset.astype(np.int64),
    }
    out["exact"] = tracker.exact.epsilon(delta) + eps_pre if tracker.exact is not None else np.zeros(0)
    return out


def _exact_statistics(pe: dict, num_classes: int) -> dict:
    """Exact statistics of the per-example values (private)."""
    eps, worst, labels = pe["epsilon"], pe["worst"], pe["label"]
    stats = {
        "mean": float(eps.mean()),
        "min": float(eps.min()),
        "max": float(eps.max()),
        "quantiles": {f"{q:g}": float(np.quantile(eps, q)) for q in (0.1, 0.3, 0.5, 0.7, 0.9)},
        "share_at_worst_case": float(np.mean(eps >= worst * (1 - 1e-3))),
        "pearson_r_log_loss": pearson(eps, np.log(np.maximum(pe["loss"], 1e-12))),
        "class_mean_epsilon": [
            float(eps[labels == k].mean()) if np.any(labels == k) else None for k in range(num_classes)
        ],
    }
    if pe["exact"].size:
        est = pe["estimate_rdp"][pe["subset"]]
        stats["estimate_vs_exact"] = {
            "examples": int(pe["subset"].size),
            "pearson_r": pearson(est, pe["exact"]),
            "mean_abs_error": float(np.mean(np.abs(est - pe["exact"]))),
            "max_abs_error": float(np.max(np.abs(est - pe["exact"]))),
            "min_estimate_minus_exact": float(np.min(est - pe["exact"])),
        }
    return stats


def _class_release(pe: dict, num_classes: int, upper: float, epsilon: float, delta: float) -> list:
    """Each class's mean ε, privately released ((epsilon, delta)-DP per class; disjoint classes).

    Every class of the public label set (``num_classes``) is released, a class without training
    examples too (noise only): which classes have examples is a fact of the private data."""
    from ..accounting.release import release_mean

    return [
        release_mean(pe["epsilon"][pe["label"] == k], upper, epsilon, delta, allow_empty=True)["value"]
        for k in range(num_classes)
    ]


def run_yu_figure(
    data,
    seeds: int = 3,
    epsilon: float = 2.0,
    delta: float = 1e-5,
    epochs: int = 20,
    batch_size: int = 128,
    lr: float = 0.05,
    clip_norm: float = 2.0,
    refreshes_per_epoch: float = 3.0,
    validate_subset: int = 200,
    individual_clipping: bool = True,
    release_epsilon: float = 0.5,
    class_release_epsilon: float = 1.0,
    device: str = "cpu",
    model: str | None = None,
    progress: bool = True,
    seed: int | None = None,
) -> dict:
    """Yu et al.'s figures on ``data`` (module docstring); returns the public result, with the
    exact statistics under ``["private"]`` and the per-example arrays under
    ``["private"]["per_example"]`` (written to private files only)."""
    from tqdm import tqdm

    from ..assignment import Budgets
    from ..engine import IndividualAccountingOptions
    from ..training import TrainConfig, Trainer

    Budgets.from_array([float(epsilon)], delta)  # refuses a bad epsilon or delta before any work
    model = model or PAPER_MODELS.get(data.name)
    n = len(data.y_train)
    variants = [("estimate", False)] + ([("individual_clipping", True)] if individual_clipping else [])
    runs = {v: [] for v, _ in variants}
    exact = {v: [] for v, _ in variants}
    arrays = {}
    t0 = time.perf_counter()
    base, run_seeds = repetition_seeds(seed, seeds)
    jobs = [(s, v, ic) for s in range(seeds) for v, ic in variants]
    for s, variant, ic in tqdm(jobs, disable=None if progress else True, desc="yu-figure", unit="run"):
        budgets = Budgets.from_array(np.full(n, float(epsilon)), delta)
        cfg = TrainConfig(
            method="uniform",
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            clip_norm=clip_norm,
            seed=run_seeds[s],
            progress=False,
            model=model,
            device=device,
        )
        opts = IndividualAccountingOptions(
            refreshes_per_epoch=refreshes_per_epoch,
            rounding="nearest",
            individual_clipping=ic,
            validate_subset=validate_subset,
        )
        trainer = Trainer(data, budgets, cfg, None, individual=opts, release_epsilon=release_epsilon)
        report = trainer.run()
        pe = per_example(trainer)
        if np.any(pe["epsilon"] > pe["worst"] * (1 + 1e-12)) or np.any(pe["epsilon"] > epsilon * (1 + 1e-9)):
            raise RuntimeError("internal error: an individual epsilon above the worst case")
        # (numerical tolerance: the two computations differ by up to ~6e-9 on digits, measured)
        if ic and pe["exact"].size and np.any(pe["estimate_rdp"][pe["subset"]] < pe["exact"] * (1 - 1e-6)):
            raise RuntimeError("internal error: with individual clipping an epsilon fell below its exact value")
        worst = float(pe["worst"].max())
        released = report["individual_privacy"]["released"]
        runs[variant].append(
            {
                "run": s,
                "test_accuracy": report["test_accuracy"],
                "per_class_accuracy": report["per_class_accuracy"],
                "noise_multiplier": report["noise_multiplier"],
                "sample_rate": report["groups"][0]["sample_rate"],
                "steps": report["steps"],
                "worst_case_epsilon": worst,
                "kind": report["individual_privacy"]["kind"],
                "released": released,
                "released_class_mean_epsilon": _class_release(
                    pe, data.num_classes, float(epsilon), class_release_epsilon, delta
                ),
            }
        )
        exact[variant].append({"run": s, **_exact_statistics(pe, data.num_classes)})
        arrays[f"{variant}_seed{s}"] = pe  # (k-th repetition; the name predates private seeds)
    seconds = time.perf_counter() - t0
    classes = list(range(data.num_classes))
    summary = {}
    for variant, _ in variants:
        rs = runs[variant]
        acc = [[r["per_class_accuracy"][k] for r in rs] for k in classes]
        rel = [[r["released_class_mean_epsilon"][k] for r in rs] for k in classes]
        per_class = [
            {
                "class": k,
                "test_accuracy": float(np.mean([a for a in acc[k] if a is not None]))
                if any(a is not None for a in acc[k])
                else None,
                "released_mean_epsilon": float(np.mean([e for e in rel[k] if e is not None]))
                if any(e is not None for e in rel[k])
                else None,
            }
            for k in classes
        ]
        ok = [c for c in per_class if c["test_accuracy"] is not None and c["released_mean_epsilon"] is not None]
        worst_acc = min(ok, key=lambda c: c["test_accuracy"]) if ok else None
        best_acc = max(ok, key=lambda c: c["test_accuracy"]) if ok else None
        summary[variant] = {
            "test_accuracy": mean_std([r["test_accuracy"] for r in rs]),
            "released_mean_epsilon": mean_std([r["released"]["mean"]["value"] for r in rs]),
            "released_quantiles": {
                q: mean_std([r["released"]["quantiles"]["values"][q] for r in rs])
                for q in rs[0]["released"]["quantiles"]["values"]
            },
            "per_class": per_class,
            "class_accuracy_vs_released_epsilon_pearson_r": pearson(
                [c["test_accuracy"] for c in ok], [c["released_mean_epsilon"] for c in ok]
            ),
            "lowest_accuracy_class": worst_acc and worst_acc["class"],
            "highest_accuracy_class": best_acc and best_acc["class"],
            "epsilon_gap_lowest_vs_highest_accuracy_class": (
                worst_acc["released_mean_epsilon"] / best_acc["released_mean_epsilon"] - 1
                if worst_acc and best_acc and best_acc["released_mean_epsilon"] > 0
                else None
            ),
        }
    first = runs["estimate"][0]
    return {
        "experiment": "yu-figure",
        "dataset": data.name,
        "model": trainer.model_name,
        "seeds": int(seeds),
        "epsilon": float(epsilon),
        "delta": float(delta),
        "epochs": int(epochs),
        "batch_size": int(batch_size),
        "lr": float(lr),
        "clip_norm": float(clip_norm),
        "refreshes_per_epoch": float(refreshes_per_epoch),
        "rounding": "nearest, r = 0.01 C",
        "validate_subset": int(min(validate_subset, n)),
        "noise_multiplier": first["noise_multiplier"],
        "sample_rate": first["sample_rate"],
        "worst_case_epsilon": first["worst_case_epsilon"],
        "release": {
            "epsilon": float(release_epsilon + class_release_epsilon),
            "delta": 2 * float(delta),
            "what": f"per run: mean and quantiles of the individual epsilons at ({release_epsilon:g}, "
            f"{delta:g}), each class's mean at ({class_release_epsilon:g}, {delta:g}) (classes "
            "are disjoint: parallel composition); in total by basic composition",
        },
        "variants": [v for v, _ in variants],
        "summary": summary,
        "runs": runs,
        "seconds": seconds,
        "trainings": len(jobs),
        "randomness": randomness(),
        **neighbouring(),
        "private": {
            "about": "exact statistics of per-example values (not covered by the guarantee)",
            "statistics": exact,
            "per_example": arrays,
            "seed": base,
        },
    }


# --- outputs ------------------------------------------------------------------------------------
def yu_markdown(r) -> str:
    s = r["summary"]
    lines = [
        (
            f"Yu et al. on {r['dataset']} ({r['model']}): DP-SGD at eps {r['epsilon']:g} (worst case "
            f"{r['worst_case_epsilon']:.3f}), delta {r['delta']:g}, sigma {r['noise_multiplier']:.3f}, q "
            f"{r['sample_rate']:.4f}, C = {r['clip_norm']:g}, {r['epochs']} epochs, lr {r['lr']:g}; individual "
            f"accounting with {r['refreshes_per_epoch']:g} norm refreshes per epoch, {r['rounding']}; "
            f"{r['seeds']} seed(s).  Statistics of the individual eps are privately released "
            f"(eps {r['release']['epsilon']:g}, delta {r['release']['delta']:g} per run)."
        ),
        "",
        "| run | test accuracy (%) | released mean eps | released quantiles 0.1 / 0.3 / 0.5 / 0.7 / 0.9 |",
        "|---|---|---|---|",
    ]
    names = {"estimate": "Alg. 2 (estimate)", "individual_clipping": "individual clipping (guarantee, App. B.2)"}
    for v in r["variants"]:
        q = " / ".join(f"{c['mean']:.2f}" for c in s[v]["released_quantiles"].values())
        lines.append(
            f"| {names[v]} | {percent(s[v]['test_accuracy'])} | {s[v]['released_mean_epsilon']['mean']:.3f} | {q} |"
        )
    e = s["estimate"]
    lines += [
        "",
        "Per class (Fig. 2/6; Alg. 2 run): test accuracy and the privately released mean eps, averaged over seeds:",
        "",
        "| class | " + " | ".join(str(c["class"]) for c in e["per_class"]) + " |",
        "|---" * (len(e["per_class"]) + 1) + "|",
        "| test accuracy (%) | "
        + " | ".join("" if c["test_accuracy"] is None else f"{100 * c['test_accuracy']:.1f}" for c in e["per_class"])
        + " |",
        "| released mean eps | "
        + " | ".join(
            "" if c["released_mean_epsilon"] is None else f"{c['released_mean_epsilon']:.3f}" for c in e["per_class"]
        )
        + " |",
    ]
    gap = e["epsilon_gap_lowest_vs_highest_accuracy_class"]
    r_acc = e["class_accuracy_vs_released_epsilon_pearson_r"]
    if gap is not None:
        lines += [
            "",
            f"The class with the lowest test accuracy ({e['lowest_accuracy_class']}) has a released mean eps "
            f"{100 * gap:+.1f} % against the class with the highest ({e['highest_accuracy_class']}); Pearson r "
            f"of class accuracy and released class eps: {r_acc:.2f}."
            if r_acc is not None
            else "",
        ]
    lines += [
        "",
        PAPER_MNIST,
        "",
        "Figures of per-example values (Fig. 1 histogram, Fig. 5 eps vs loss, Fig. 4 estimate vs exact, the exact "
        "class means) and their exact statistics are in private/ (mode 0600): not covered by the guarantee.",
    ]
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _public_plots(out, r) -> list[str]:
    plt = _plt()
    files = []
    e = r["summary"]["estimate"]
    ok = [c for c in e["per_class"] if c["test_accuracy"] is not None and c["released_mean_epsilon"] is not None]
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    ax.scatter([c["released_mean_epsilon"] for c in ok], [100 * c["test_accuracy"] for c in ok])
    for c in ok:
        ax.annotate(
            str(c["class"]),
            (c["released_mean_epsilon"], 100 * c["test_accuracy"]),
            textcoords="offset points",
            xytext=(3, 3),
        )
    ax.set_xlabel("privately released mean ε of the class")
    ax.set_ylabel("test accuracy of the class (%)")
    ax.set_title(f"{r['dataset']}: class accuracy vs released class ε (Fig. 2/6), {r['seeds']} seed(s)", fontsize=9)
    files.append(
        out.save_figure(
            "yu_class_accuracy_vs_epsilon.png",
            fig,
            "public",
            "each class's test accuracy vs its privately released mean epsilon (Fig. 2/6)",
        ).name
    )

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    names = {"estimate": "Alg. 2 (estimate)", "individual_clipping": "individual clipping (guarantee)"}
    for v in r["variants"]:
        qs = r["summary"][v]["released_quantiles"]
        x = [float(q) for q in qs]
        ax.errorbar(
            [qs[q]["mean"] for q in qs], x, xerr=[qs[q]["std"] for q in qs], marker="o", capsize=3, label=names[v]
        )
    ax.axvline(r["worst_case_epsilon"], color="black", ls="--", lw=1, label="worst case (every example)")
    ax.set_xlabel("individual ε")
    ax.set_ylabel("share of the examples (released quantile)")
    ax.set_title(f"{r['dataset']}: released quantiles of the individual ε (Fig. 1)", fontsize=9)
    ax.legend(fontsize=8)
    files.append(
        out.save_figure(
            "yu_released_quantiles.png",
            fig,
            "public",
            "privately released quantiles of the individual epsilons vs the worst case (Fig. 1)",
        ).name
    )
    return files


def _private_plots(out, r) -> list[str]:
    plt = _plt()
    files = []
    pe = r["private"]["per_example"]
    est = pe["estimate_seed0"]
    ic = pe.get("individual_clipping_seed0")
    worst = float(est["worst"].max())

    fig, ax = plt.subplots(figsize=(6, 3.8))
    bins = np.linspace(0, worst * 1.02, 50)
    ax.hist(est["epsilon"], bins=bins, alpha=0.6, label="Alg. 2 (estimate)")
    if ic is not None:
        ax.hist(ic["epsilon"], bins=bins, alpha=0.5, label="individual clipping (guarantee)")
    ax.axvline(worst, color="black", ls="--", lw=1.5, label="worst case")
    ax.set_xlabel("individual ε (repetition 0)")
    ax.set_ylabel("examples")
    ax.legend(fontsize=8)
    files.append(
        out.save_figure(
            "fig1_epsilon_histogram.png",
            fig,
            "private",
            "histogram of the individual epsilons (Fig. 1; per-example values)",
        ).name
    )

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.scatter(np.maximum(est["loss"], 1e-8), est["epsilon"], s=5, alpha=0.5)
    ax.set_xscale("log")
    ax.axhline(worst, color="black", ls="--", lw=1)
    rr = pearson(est["epsilon"], np.log(np.maximum(est["loss"], 1e-12)))
    ax.set_xlabel("final training loss (log scale)")
    ax.set_ylabel("individual ε (estimate)")
    ax.set_title(
        "ε vs loss (Fig. 5), repetition 0" + (f": Pearson r (ε, log loss) = {rr:.2f}" if rr is not None else ""),
        fontsize=9,
    )
    files.append(
        out.save_figure(
            "fig5_epsilon_vs_loss.png",
            fig,
            "private",
            "individual epsilon vs final training loss (Fig. 5; per-example values)",
        ).name
    )

    if est["exact"].size:
        fig, ax = plt.subplots(figsize=(4.8, 4.2))
        lo = worst
        for pe, label, marker in ((est, "Alg. 2 (estimate)", "o"), (ic, "individual clipping (guarantee)", "x")):
            if pe is None or not pe["exact"].size:
                continue
            e = pe["estimate_rdp"][pe["subset"]]
            ax.scatter(pe["exact"], e, s=6, alpha=0.5, marker=marker, label=label)
            lo = float(min(lo, pe["exact"].min(), e.min()))
        ax.plot([lo, worst], [lo, worst], color="black", lw=1)
        ax.set_xlabel("exact ε of its run (norms at every step, no rounding)")
        ax.set_ylabel("ε by Alg. 2 (refreshed, rounded norms)")
        ax.set_title(f"estimate vs exact (Fig. 4), {est['subset'].size} examples, repetition 0", fontsize=9)
        ax.legend(fontsize=8)
        files.append(
            out.save_figure(
                "fig4_estimate_vs_exact.png",
                fig,
                "private",
                "estimated vs exact individual epsilons on the exact-tracked subset (Fig. 4)",
            ).name
        )

    stats = r["private"]["statistics"]["estimate"]
    cls = np.array([[np.nan if v is None else v for v in s["class_mean_epsilon"]] for s in stats], dtype=float)
    acc = np.array(
        [[np.nan if v is None else v for v in run["per_class_accuracy"]] for run in r["runs"]["estimate"]], dtype=float
    )
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    mx, my = np.nanmean(cls, axis=0), 100 * np.nanmean(acc, axis=0)
    ax.scatter(mx, my)
    for k, (a, b) in enumerate(zip(mx, my, strict=True)):
        ax.annotate(str(k), (a, b), textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("exact mean ε of the class")
    ax.set_ylabel("test accuracy of the class (%)")
    ax.set_title("class accuracy vs exact class ε (Fig. 2/6)", fontsize=9)
    files.append(
        out.save_figure(
            "fig2_class_epsilon_exact.png",
            fig,
            "private",
            "each class's exact mean epsilon vs its test accuracy (exact statistic)",
        ).name
    )
    return files


def write_yu_figure(out, r) -> list[str]:
    """Public: ``yu_figure.json``/``.md``, ``yu_class_accuracy_vs_epsilon.png``, ``yu_released_quantiles.png``
    (test accuracies, hyper-parameters, released statistics).  Private (``private/``, 0600):
    ``yu_figure_exact.json``, ``yu_per_example.npz`` and the per-example figures."""
    public = {k: v for k, v in r.items() if k != "private"}
    out.write_json(
        "yu_figure.json",
        public,
        "public",
        "test accuracies (overall, per class), hyper-parameters and "
        "the privately released statistics of the individual epsilons (overall, per class)",
    )
    with atomic_open(out.file("yu_figure.md", "public", "the results as markdown"), "w") as fh:
        fh.write(yu_markdown(r))
    files = ["yu_figure.json", "yu_figure.md", *_public_plots(out, r)]
    out.write_json(
        "yu_figure_exact.json",
        {k: v for k, v in r["private"].items() if k != "per_example"},
        "private",
        "exact statistics of the individual epsilons: quantiles, Pearson r with log loss, class means, "
        "estimate vs exact",
    )
    arrays = {
        f"{run}__{key}": np.asarray(v) for run, pe in r["private"]["per_example"].items() for key, v in pe.items()
    }
    out.write_npz(
        "yu_per_example.npz",
        "private",
        "every example's individual epsilon (estimate and, on the subset, "
        "exact), worst case, final loss, correctness and label, per run (personal data)",
        **arrays,
    )
    files += ["private/yu_figure_exact.json", "private/yu_per_example.npz"]
    files += [f"private/{f}" for f in _private_plots(out, r)]
    return files + record_seed(out, r)


def _text(r) -> str:
    return (
        yu_markdown(r) + f"\n{r['trainings']} runs in {r['seconds']:.0f} s; files in {r['out']}: "
        f"{', '.join(r['files'])}"
    )


register(
    Experiment(
        "yu-figure",
        "Yu et al. Figs. 1, 2, 4, 5: individual eps, eps vs loss, class eps vs accuracy, estimate vs exact",
        run_yu_figure,
        write_yu_figure,
        options=(
            Option("seeds", "repetitions, each with its own seed derived from --seed", at_least_one),
            Option("epsilon", "target (worst-case) epsilon of DP-SGD for every example", positive),
            Option("delta", "delta", valid_delta),
            Option("epochs", "epochs (the paper: 100 on MNIST)", at_least_one),
            Option("batch_size", "expected batch size (the paper: 1024 on MNIST)", at_least_one),
            Option("lr", "learning rate", positive),
            Option(
                "clip_norm",
                "clip norm C (default %(default)s: about the median gradient norm at initialisation on "
                "digits, the paper's rule for MNIST, fixed in advance)",
                positive,
            ),
            Option("refreshes_per_epoch", "gradient-norm refreshes per epoch (the paper's gamma = 3)", positive),
            Option(
                "validate_subset",
                "examples whose norms are also computed exactly at every step (Fig. 4; 0: none)",
                at_least_zero,
            ),
            Option(
                "individual_clipping", "skip the second run with individual clipping (App. B.2, every eps a guarantee)"
            ),
            Option(
                "release_epsilon",
                "epsilon of each run's private release of the mean and quantiles of the individual eps",
                positive,
            ),
            Option(
                "class_release_epsilon",
                "epsilon of each run's private release of every class's mean eps (classes "
                "are disjoint; digits has about 144 examples per class)",
                positive,
            ),
            Option("device", "cpu, cuda, auto or a torch device"),
            SEED,
        ),
        paper_models={"digits": "digits_cnn", **PAPER_MODELS},
        text=_text,
        out_help="folder for yu_figure.json/.md and the public figures; per-example figures in private/",
        description="Yu et al. 2023 (individual privacy accounting): DP-SGD at one target epsilon with individual "
        "accounting (Alg. 2); Fig. 1 (distribution of the individual eps), Fig. 5 (eps vs training loss), Fig. "
        "2/6 (class eps vs class accuracy), Fig. 4 (estimate vs exact) and individual clipping (App. B.2).  "
        "Per-example figures and exact statistics go to private/ (mode 0600); the public files hold test "
        "accuracies and privately released statistics.",
    )
)
