"""Heo et al. (PDP-SGD): Table 1, Fig. 4 and Fig. 5 as one experiment (``idpsgd reproduce heo-table1``).

* **Table 1** — test accuracy (mean ± std over seeds) of uniform DP-SGD at the smallest budget,
  DP-SGD + Sampling (``pdp-sampling``, App. B.1), DP-SGD + AdaPDP (``adapdp``, App. B.2) and
  PDP-SGD with loss_f (w1 = 0.7) and loss_a, for budgets from App. C.1's exponential distribution
  (20 groups in [0.5, 1], k ∈ {−0.2, 0, 0.2}).  Uniform DP-SGD at min ε = 0.5 does not depend on k
  (one run per seed, shown in every row, as in the paper).
* **Fig. 4** — PDP-SGD (loss_f) accuracy against w1 ∈ {0.3, …, 0.9} for each k.
* **Fig. 5** — PDP-SGD (loss_f and loss_a) accuracy against the interval a of the budget range
  [0.5, 0.5 + a], a ∈ {0.1, …, 0.9}, k = 0 (test accuracy only: training-set accuracy is a
  statistic of the private data and is not released).

Every run's (ε_i, δ_i) stays within its budget (checked by the training code); δ is the total per
example (each PDP round gets δ/rounds).  Writes ``heo_table1.json`` (every run's accuracy and the
summaries), ``heo_table1.md`` (the table), ``fig4_w1.png`` and ``fig5_interval.png``; nothing
per-example.
"""

from __future__ import annotations

import time

import numpy as np

from ..accounting.neighbouring import neighbouring
from ..io import atomic_open
from .registry import SEED, Experiment, Option, at_least_one, positive, register, valid_delta
from .summary import mean_std, randomness, record_seed, repetition_seeds

DEFAULT_EPOCHS = 10
#: Heo et al. App. C.2's CNNs (Tables 4-5); digits keeps its own small CNN
PAPER_MODELS = {"mnist": "heo_mnist", "fashion-mnist": "heo_mnist", "svhn": "heo_svhn"}
SKEWS = (-0.2, 0.0, 0.2)
RANGE = (0.5, 1.0)
W1_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
INTERVALS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: (column label, method, threshold loss); w1 is the method's default (App. C.2) unless given
COLUMNS = (
    ("DP-SGD (min eps)", "uniform", None),
    ("Sampling", "pdp-sampling", "fixed"),
    ("AdaPDP", "adapdp", "fixed"),
    ("PDP-SGD loss_f", "pdp-sgd", "fixed"),
    ("PDP-SGD loss_a", "pdp-sgd", "adaptive"),
)
#: Heo et al. Table 1 on MNIST, for the ordering (the extracted table keeps one of three rows for AdaPDP and loss_f)
PAPER_MNIST = (
    "Paper, MNIST (Table 1, accuracy %): DP-SGD 90.42 ± 2.78 (every k); Sampling 92.57 / 92.50 / 92.48 "
    "(k = -0.2 / 0 / 0.2); AdaPDP 92.78 ± 0.53 (one k); PDP-SGD loss_f 95.19 ± 0.27 (one k); PDP-SGD "
    "loss_a 94.54 / 95.05 / 94.86.  Ordering: DP-SGD < Sampling ≈ AdaPDP < PDP-SGD (loss_f ≈ loss_a)."
)


def run_heo_table1(
    data,
    seeds: int = 3,
    epochs: int = DEFAULT_EPOCHS,
    batch_size: int = 128,
    lr: float = 0.05,
    rounds: int = 3,
    delta: float = 1e-5,
    figures: bool = True,
    progress: bool = True,
    model: str | None = None,
    seed: int | None = None,
) -> dict:
    """Run Table 1 (and Figs. 4–5 with ``figures``) on ``data``; returns every accuracy and the summaries
    (the base ``seed`` of the repetitions under ``["private"]``)."""
    from tqdm import tqdm

    from ..assignment import Budgets
    from ..training import TrainConfig, train
    from ..training.pdp import PdpOptions, train_pdp

    n = len(data.y_train)
    base, run_seeds = repetition_seeds(seed, seeds)
    jobs = []  # (key, repetition, method, loss, w1, k, (low, high))
    for s in range(seeds):
        jobs.append((("table", "DP-SGD (min eps)", None), s, "uniform", None, None, 0.0, RANGE))
        for k in SKEWS:
            for label, method, loss in COLUMNS[1:]:
                jobs.append((("table", label, k), s, method, loss, None, k, RANGE))
        if figures:
            for k in SKEWS:
                for w1 in W1_GRID:
                    if w1 != 0.7:
                        jobs.append((("fig4", w1, k), s, "pdp-sgd", "fixed", w1, k, RANGE))
            for a in INTERVALS:
                if a != 0.5:
                    for loss in ("fixed", "adaptive"):
                        jobs.append((("fig5", a, loss), s, "pdp-sgd", loss, None, 0.0, (0.5, 0.5 + a)))
    acc: dict = {}
    t0 = time.perf_counter()
    for key, s, method, loss, w1, k, (low, high) in tqdm(
        jobs, disable=None if progress else True, desc="heo-table1", unit="run"
    ):
        budgets = Budgets.from_exponential(n, low, high, k, delta, seed=run_seeds[s])
        cfg = TrainConfig(
            method=method,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=run_seeds[s],
            progress=False,
            model=model or PAPER_MODELS.get(data.name),
        )
        if method == "uniform":
            report = train(data, budgets, cfg)
        else:
            report = train_pdp(data, budgets, cfg, options=PdpOptions(threshold_loss=loss, w1=w1, rounds=rounds))
            if report["max_delta"] > delta * (1 + 1e-12):
                raise RuntimeError("internal error: a PDP run exceeded the total delta")
        if any(g["epsilon_spent"] > g["budget"] * (1 + 1e-9) for g in report["groups"]):
            raise RuntimeError("internal error: a run exceeded a budget")
        acc.setdefault(key, []).append(report["test_accuracy"])
    seconds = time.perf_counter() - t0

    table = []
    for k in SKEWS:
        row = {"skew": k}
        for label, _, _ in COLUMNS:
            key = ("table", label, None) if label == "DP-SGD (min eps)" else ("table", label, k)
            row[label] = mean_std(acc[key])
        table.append(row)
    out = {
        "experiment": "heo-table1",
        "dataset": data.name,
        "model": model or PAPER_MODELS.get(data.name) or "default",
        "seeds": int(seeds),
        "epochs": int(epochs),
        "batch_size": int(batch_size),
        "lr": float(lr),
        "rounds": int(rounds),
        "delta": float(delta),
        "budget_range": list(RANGE),
        "skews": list(SKEWS),
        "columns": [c[0] for c in COLUMNS],
        "table": table,
        "seconds": seconds,
        "runs": len(jobs),
        "randomness": randomness(),
        **neighbouring(),
        "private": {"seed": base},
    }
    if figures:
        fig4 = {
            str(k): {
                str(w): mean_std(acc[("table", "PDP-SGD loss_f", k)] if w == 0.7 else acc[("fig4", w, k)])
                for w in W1_GRID
            }
            for k in SKEWS
        }
        fig5 = {
            loss: {
                str(a): mean_std(
                    acc[("table", "PDP-SGD loss_f" if loss == "fixed" else "PDP-SGD loss_a", 0.0)]
                    if a == 0.5
                    else acc[("fig5", a, loss)]
                )
                for a in INTERVALS
            }
            for loss in ("fixed", "adaptive")
        }
        out["fig4_accuracy_vs_w1"] = fig4
        out["fig5_accuracy_vs_interval"] = fig5
    return out


def _markdown(r) -> str:
    cols = r["columns"]
    lines = [
        (
            f"Heo et al. Table 1 on {r['dataset']}: test accuracy (%), mean ± std over {r['seeds']} seed(s); "
            f"budgets: 20 groups in [{r['budget_range'][0]:g}, {r['budget_range'][1]:g}] (App. C.1), "
            f"delta {r['delta']:g} in total per example, {r['epochs']} epochs, {r['rounds']} rounds"
        ),
        "",
        "| k | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for row in r["table"]:
        cells = [f"{100 * row[c]['mean']:.1f} ± {100 * row[c]['std']:.1f}" for c in cols]
        lines.append(f"| {row['skew']:g} | " + " | ".join(cells) + " |")
    lines += ["", PAPER_MNIST]
    return "\n".join(lines) + "\n"


def _plots(out, r) -> list[str]:
    """Fig. 4 and Fig. 5 into the run folder ``out`` (a :class:`~idpsgd.runfolder.RunFolder`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for k, series in r["fig4_accuracy_vs_w1"].items():
        w = [float(v) for v in series]
        m = np.array([series[v]["mean"] for v in series])
        s = np.array([series[v]["std"] for v in series])
        ax.errorbar(w, 100 * m, yerr=100 * s, marker="o", capsize=3, label=f"k = {float(k):g}")
    ax.set_xlabel("w1 (loss_f; w2 = 1 - w1)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"PDP-SGD on {r['dataset']}: accuracy vs w1 (Fig. 4)")
    ax.legend(fontsize=8)
    written.append(out.save_figure("fig4_w1.png", fig, "public", "accuracy vs w1 (Fig. 4)").name)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for loss, series in r["fig5_accuracy_vs_interval"].items():
        a = [float(v) for v in series]
        m = np.array([series[v]["mean"] for v in series])
        s = np.array([series[v]["std"] for v in series])
        ax.errorbar(
            a, 100 * m, yerr=100 * s, marker="o", capsize=3, label="loss_f (w1 = 0.7)" if loss == "fixed" else "loss_a"
        )
    ax.set_xlabel("interval a: budgets in [0.5, 0.5 + a] (k = 0)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"PDP-SGD on {r['dataset']}: accuracy vs the ε interval (Fig. 5)")
    ax.legend(fontsize=8)
    written.append(out.save_figure("fig5_interval.png", fig, "public", "accuracy vs the budget interval (Fig. 5)").name)
    return written


def write_heo_table1(out, r) -> list[str]:
    """``heo_table1.json`` and ``.md`` (public: test accuracies and hyper-parameters), and the
    figures when ``r`` has them; returns the file names."""
    out.write_json(
        "heo_table1.json",
        {k: v for k, v in r.items() if k != "private"},
        "public",
        "test accuracy (mean, std over repetitions) of every method and setting",
    )
    with atomic_open(out.file("heo_table1.md", "public", "the table as markdown"), "w") as fh:
        fh.write(_markdown(r))
    return (
        ["heo_table1.json", "heo_table1.md"]
        + (_plots(out, r) if "fig4_accuracy_vs_w1" in r else [])
        + record_seed(out, r)
    )


def _text(r) -> str:
    return _markdown(r) + f"\n{r['runs']} runs in {r['seconds']:.0f} s; files in {r['out']}: {', '.join(r['files'])}"


register(
    Experiment(
        "heo-table1",
        "Heo et al. Table 1, Fig. 4 and Fig. 5",
        run_heo_table1,
        write_heo_table1,
        options=(
            Option(
                "seeds", "repetitions per configuration (each with its own seed, derived from --seed)", at_least_one
            ),
            Option(
                "epochs",
                "epochs of DP-SGD, of PDP-SGD's first round and of each AdaPDP model (default "
                "%(default)s: at budgets <= 1 on digits, more epochs mean more noise per step)",
                at_least_one,
            ),
            Option("batch_size", "expected batch size", at_least_one),
            Option("lr", "learning rate", positive),
            Option("rounds", "rounds of PDP-SGD and AdaPDP", at_least_one),
            Option("delta", "total delta per example", valid_delta),
            Option("figures", "only Table 1 (skip the runs of Fig. 4 and Fig. 5)"),
            SEED,
        ),
        paper_models=PAPER_MODELS,
        text=_text,
        out_help="folder for heo_table1.json/.md, fig4_w1.png, fig5_interval.png",
        description="Heo et al. (PDP-SGD): Table 1 (test accuracy of DP-SGD at the smallest budget, Sampling, AdaPDP, "
        "PDP-SGD loss_f and loss_a for skewed budget distributions), Fig. 4 (accuracy vs w1) and Fig. 5 "
        "(accuracy vs the budget interval).",
    )
)
