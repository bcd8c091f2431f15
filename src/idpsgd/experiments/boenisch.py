"""Boenisch et al. 2023 (IDP-SGD): Table 2 and Table 3 as experiments (``idpsgd reproduce
boenisch-table2`` / ``boenisch-table3``).

* **Table 2** (§4.1, Table 4's hyper-parameters as in Table 7) — test accuracy over seeds of DP-SGD
  at the strictest budget, Sample (Alg. 1) and Scale (Alg. 2) for the paper's two budget
  distributions, and DP-SGD at the loosest budget for everyone (the unattainable upper bound of
  §4.1); DP-SGD's hyper-parameters are reused for Sample and Scale, as in the paper.  The
  individualization parameters each method derived (Table 6) depend on public inputs only.
* **Table 3** (§5, App. D.5) — full-batch DP-GD with the individual Rényi filter (Feldman & Zrnic
  2021): vanilla, + individual accounting (the run lasts ``extend`` × the calibrated steps, fixed
  in advance), + individualized assignment.

Each repetition's seed (derived from the private base ``seed``) fixes the group assignment,
initialisation, sampling and noise.  Public outputs: accuracies, per-group guarantees and
hyper-parameters; the seed and Table 3's active examples and realized ε go to ``private/``.
What was measured, and how digits stands in for the paper's data: ``docs/reproducing.md``.
"""

from __future__ import annotations

import time

import numpy as np

from ..accounting.neighbouring import neighbouring
from ..io import atomic_open
from .registry import SEED, Experiment, Option, at_least_one, positive, register, valid_delta
from .summary import mean_std, percent, randomness, record_seed, repetition_seeds

# --- Table 2 ----------------------------------------------------------------------------------
BUDGETS = (1.0, 2.0, 3.0)
#: privacy-group fractions of Table 2: Alaggan et al. (first setup) and Niu et al. (second)
SETUPS = {"34-43-23": (0.34, 0.43, 0.23), "54-37-9": (0.54, 0.37, 0.09)}
#: Table 4: standard DP-SGD's hyper-parameters at ε = 1 (reused for Sample and Scale, Table 7)
PAPER_SETTINGS = {
    "mnist": {"epochs": 80, "batch_size": 512, "lr": 0.6, "clip_norm": 0.2},
    "svhn": {"epochs": 30, "batch_size": 1024, "lr": 0.2, "clip_norm": 0.9},
    "cifar10": {"epochs": 30, "batch_size": 1024, "lr": 0.7, "clip_norm": 0.4},
}
#: the paper's CNNs (Tramèr & Boneh 2021): the library's defaults for these datasets
PAPER_MODELS = {"mnist": "tramer_boneh_mnist", "svhn": "tramer_boneh_cifar10", "cifar10": "tramer_boneh_cifar10"}
#: Table 7 (Table 4's hyper-parameters for all three methods; on MNIST identical to Table 2):
#: (DP-SGD, Sample, Scale) test accuracy % per setup
PAPER_TABLE7 = {
    "mnist": {"34-43-23": (96.75, 97.81, 97.78), "54-37-9": (96.75, 97.6, 97.54)},
    "svhn": {"34-43-23": (83.26, 84.56, 84.48), "54-37-9": (83.26, 84.32, 84.31)},
    "cifar10": {"34-43-23": (52.77, 54.89, 54.92), "54-37-9": (52.77, 54.88, 55.00)},
}
T2_COLUMNS = ("DP-SGD (eps 1)", "Sample", "Scale", "DP-SGD (eps 3, upper bound)")


def _hyper(data_name: str, epochs, batch_size, lr, clip_norm) -> dict:
    """The run's (epochs, batch_size, lr, clip_norm): given values, else the paper's Table 4 for its
    datasets, else the ``TrainConfig`` defaults (uniform ε = 1's best on digits)."""
    from ..training import TrainConfig

    base = PAPER_SETTINGS.get(data_name) or {
        k: getattr(TrainConfig, k) for k in ("epochs", "batch_size", "lr", "clip_norm")
    }
    given = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "clip_norm": clip_norm}
    return {k: (v if v is not None else base[k]) for k, v in given.items()}


def parse_setups(setups: str) -> list[str]:
    """``"34-43-23,54-37-9"`` -> the list of Table 2 setups (each one of :data:`SETUPS`)."""
    from ..validation import InvalidParameterError

    names = [s.strip() for s in str(setups).split(",") if s.strip()]
    bad = [s for s in names if s not in SETUPS]
    if not names or bad or len(set(names)) != len(names):
        raise InvalidParameterError(
            "setups", setups, f"must be a comma-separated list of distinct setups from {', '.join(SETUPS)}"
        )
    return names


def _check_setups(name, value) -> None:
    parse_setups(value)


def _check_optional(check):
    def inner(name, value):
        if value is not None:
            check(name, value)

    return inner


def _momentum(name, value) -> None:
    from ..validation import InvalidParameterError

    if not 0 <= float(value) < 1:
        raise InvalidParameterError(name, value, "must be in [0, 1)")


def _check_budgets(report, budgets) -> None:
    spent = {g["budget"]: g["epsilon_spent"] for g in report["groups"]}
    if any(spent[b] > b * (1 + 1e-9) for b in spent):
        raise RuntimeError(f"internal error: a run exceeded a budget ({spent})")


def run_boenisch_table2(
    data,
    seeds: int = 5,
    setups: str = "34-43-23,54-37-9",
    epochs: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    clip_norm: float | None = None,
    delta: float = 1e-5,
    upper_bound: bool = True,
    device: str = "cpu",
    model: str | None = None,
    progress: bool = True,
    seed: int | None = None,
) -> dict:
    """Boenisch et al. Table 2 on ``data``: DP-SGD at ε = 1, Sample and Scale (budgets 1/2/3 at each
    setup's fractions) and, with ``upper_bound``, DP-SGD at ε = 3; ``seeds`` runs each (repetition k
    with a seed derived from the base ``seed``, kept under ``["private"]``)."""
    from tqdm import tqdm

    from ..assignment import Budgets
    from ..models import DEFAULT_MODEL
    from ..training import TrainConfig, train

    names = parse_setups(setups)
    hp = _hyper(data.name, epochs, batch_size, lr, clip_norm)
    given = [
        k
        for k, v in (("epochs", epochs), ("batch_size", batch_size), ("lr", lr), ("clip_norm", clip_norm))
        if v is not None
    ]
    n = len(data.y_train)
    base, run_seeds = repetition_seeds(seed, seeds)
    jobs = []  # (column, setup or None, repetition)
    for s in range(seeds):
        jobs.append(("DP-SGD (eps 1)", None, s))
        for name in names:
            jobs += [("Sample", name, s), ("Scale", name, s)]
        if upper_bound:
            jobs.append(("DP-SGD (eps 3, upper bound)", None, s))
    acc: dict = {}
    params: dict = {}
    t0 = time.perf_counter()
    for column, setup, s in tqdm(jobs, disable=None if progress else True, desc="boenisch-table2", unit="run"):
        if setup is None:
            eps = BUDGETS[0] if column.startswith("DP-SGD (eps 1") else BUDGETS[-1]
            budgets, method = Budgets.from_array(np.full(n, eps), delta), "uniform"
        else:
            budgets = Budgets.from_groups(list(BUDGETS), list(SETUPS[setup]), n, delta, seed=run_seeds[s])
            method = column.lower()
        cfg = TrainConfig(method=method, seed=run_seeds[s], progress=False, model=model, device=device, **hp)
        report = train(data, budgets, cfg)
        _check_budgets(report, budgets)
        acc.setdefault((column, setup), []).append(report["test_accuracy"])
        if (column, setup) not in params:  # calibration depends on n, budgets and fractions only
            params[(column, setup)] = {
                "noise_multiplier": report["noise_multiplier"],
                "groups": [
                    {
                        k: g[k]
                        for k in (
                            "budget",
                            "count",
                            "sample_rate",
                            "clip_norm",
                            "noise_multiplier",
                            "steps",
                            "epsilon_spent",
                            "delta",
                        )
                    }
                    for g in report["groups"]
                ],
            }
    seconds = time.perf_counter() - t0
    table = []
    for name in names:
        row = {"setup": name, "fractions": list(SETUPS[name]), "budgets": list(BUDGETS)}
        for column in T2_COLUMNS:
            key = (column, name if column in ("Sample", "Scale") else None)
            if key in acc:
                row[column] = {**mean_std(acc[key]), "parameters": params[key]}
        paper = PAPER_TABLE7.get(data.name, {}).get(name)
        if paper:
            row["paper"] = dict(zip(T2_COLUMNS[:3], paper, strict=True))
        table.append(row)
    return {
        "experiment": "boenisch-table2",
        "dataset": data.name,
        "model": model or DEFAULT_MODEL.get(data.name, "mlp"),
        "seeds": int(seeds),
        **hp,
        "delta": float(delta),
        "momentum": TrainConfig.momentum,
        "accountant": TrainConfig.accountant,
        "columns": [c for c in T2_COLUMNS if upper_bound or not c.startswith("DP-SGD (eps 3")],
        "table": table,
        "seconds": seconds,
        "runs": len(jobs),
        "hyper_parameters": (
            "the paper's Table 4 (standard DP-SGD at eps 1, reused for Sample and Scale)"
            if data.name in PAPER_SETTINGS
            else "uniform eps 1's best on digits "
            "(bench/bench_comparison.py; the TrainConfig defaults), reused for Sample and Scale"
        )
        + (f"; given: {', '.join(given)}" if given else ""),
        "randomness": randomness(),
        **neighbouring(),
        "private": {"seed": base},
    }


def table2_markdown(r) -> str:
    cols = r["columns"]
    lines = [
        (
            f"Boenisch et al. Table 2 on {r['dataset']} ({r['model']}): test accuracy (%), mean ± std over "
            f"{r['seeds']} seed(s); budgets eps = 1/2/3, delta {r['delta']:g}; {r['epochs']} epochs, B = "
            f"{r['batch_size']}, lr {r['lr']:g}, C = {r['clip_norm']:g} ({r['hyper_parameters']})"
        ),
        "",
        "| privacy groups | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for row in r["table"]:
        label = "-".join(f"{100 * f:.0f}%" for f in row["fractions"])
        lines.append(f"| {label} | " + " | ".join(percent(row[c], 2) for c in cols) + " |")
        if "paper" in row:
            lines.append(
                f"| paper (Table 7), {label} | "
                + " | ".join(f"{row['paper'][c]:.2f}" if c in row["paper"] else "" for c in cols)
                + " |"
            )
    lines += ["", "Individualization parameters (Table 6; public: they depend on n, the budgets and the fractions):"]
    for row in r["table"]:
        for c in ("Sample", "Scale"):
            if c in row:
                p = row[c]["parameters"]
                q = "/".join(f"{g['sample_rate']:.4f}" for g in p["groups"])
                cn = "/".join(f"{g['clip_norm']:.3f}" for g in p["groups"])
                lines.append(f"- {c} ({row['setup']}): sigma {p['noise_multiplier']:.3f}, q {q}, c {cn}")
    dp = r["table"][0]["DP-SGD (eps 1)"]["parameters"]
    lines.append(
        f"- DP-SGD (eps 1): sigma {dp['noise_multiplier']:.3f}, q {dp['groups'][0]['sample_rate']:.4f}, "
        f"c {dp['groups'][0]['clip_norm']:.3f}"
    )
    return "\n".join(lines) + "\n"


def _table2_plot(out, r) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = r["columns"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(cols)
    x = np.arange(len(r["table"]))
    for k, c in enumerate(cols):
        m = [100 * row[c]["mean"] for row in r["table"]]
        s = [100 * row[c]["std"] for row in r["table"]]
        ax.bar(x + (k - (len(cols) - 1) / 2) * width, m, width, yerr=s, capsize=3, label=c)
    ax.set_xticks(x, ["-".join(f"{100 * f:.0f}%" for f in row["fractions"]) for row in r["table"]])
    ax.set_xlabel("privacy groups (eps = 1 / 2 / 3)")
    ax.set_ylabel("test accuracy (%)")
    low = min(100 * row[c]["mean"] - 100 * row[c]["std"] for row in r["table"] for c in cols)
    ax.set_ylim(max(0.0, low - 5), 100)
    ax.set_title(f"IDP-SGD on {r['dataset']}: Sample and Scale vs DP-SGD (Table 2), {r['seeds']} seed(s)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return out.save_figure(
        "boenisch_table2.png", fig, "public", "test accuracy of each method and setup (Table 2)"
    ).name


def write_boenisch_table2(out, r) -> list[str]:
    """``boenisch_table2.json``, ``.md`` and ``.png``: all public (test accuracies, hyper-parameters,
    per-group guarantees and calibration)."""
    out.write_json(
        "boenisch_table2.json",
        {k: v for k, v in r.items() if k != "private"},
        "public",
        "test accuracy (mean, std over repetitions) of every method and setup, hyper-parameters, each "
        "method's calibration and per-group guarantee",
    )
    with atomic_open(out.file("boenisch_table2.md", "public", "Table 2 as markdown"), "w") as fh:
        fh.write(table2_markdown(r))
    return ["boenisch_table2.json", "boenisch_table2.md", _table2_plot(out, r), *record_seed(out, r)]


def _table2_text(r) -> str:
    return (
        table2_markdown(r) + f"\n{r['runs']} runs in {r['seconds']:.0f} s; files in {r['out']}: {', '.join(r['files'])}"
    )


# --- Table 3 ----------------------------------------------------------------------------------
#: the paper's budgets on MNIST (Table 3): ε = 0.3, and 0.3 / 0.31 with individualized assignment
PAPER_T3_EPSILON = (0.3, 0.31)
#: digits: the same noise relative to the summed gradients as MNIST at 0.3 (module docstring)
DIGITS_T3_EPSILON = (10.0, 10.33)
#: Table 3 on MNIST: vanilla DP-GD, + individual accounting, + individualized assignment (accuracy %)
PAPER_TABLE3 = ((93.29, 0.49), (93.64, 0.46), (94.16, 0.23))
T3_COLUMNS = ("vanilla", "accounting", "accounting_assignment")
T3_LABELS = {
    "vanilla": "vanilla DP-GD",
    "accounting": "+ individual accounting (filter)",
    "accounting_assignment": "+ individualized assignment",
}


def softmax_regression(input_shape, num_classes: int, seed: int):
    """Softmax regression (flatten, one linear layer), initialised from ``seed``: Table 3's default model."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))


def table3_epsilons(data_name: str, epsilon: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """(ε, ε_high): given values, else digits' (10, 10.33), else the paper's (0.3, 0.31)."""
    from ..validation import InvalidParameterError

    base = DIGITS_T3_EPSILON if data_name == "digits" else PAPER_T3_EPSILON
    eps = float(epsilon) if epsilon is not None else base[0]
    high = float(epsilon_high) if epsilon_high is not None else eps * base[1] / base[0]
    if not high > eps:
        raise InvalidParameterError("epsilon_high", high, f"must be larger than --epsilon ({eps:g})")
    return eps, high


def run_boenisch_table3(
    data,
    seeds: int = 5,
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    delta: float = 1e-5,
    calibrated_steps: int = 20,
    extend: float = 2.0,
    clip_norm: float = 3.0,
    lr: float = 0.5,
    momentum: float = 0.9,
    device: str = "cpu",
    model: str | None = None,
    progress: bool = True,
    seed: int | None = None,
) -> dict:
    """Boenisch et al. Table 3 (and Fig. 3) on ``data``: full-batch DP-GD, its individual Rényi
    filter, and the filter with individualized assignment; ``seeds`` runs each.  Returns the public
    result; ``["private"]`` holds the active examples per step (Fig. 3) and realized ε statistics."""
    from tqdm import tqdm

    from ..assignment import Budgets
    from ..engine.budget.filter import FilterOptions
    from ..models import create_model
    from ..training import TrainConfig, train
    from ..training.filtered import train_filtered

    eps, high = table3_epsilons(data.name, epsilon, epsilon_high)
    n = len(data.y_train)
    opts = FilterOptions(gd=True, extend=extend)
    base, run_seeds = repetition_seeds(seed, seeds)

    def net(seed):
        if model is None:
            return softmax_regression(data.input_shape, data.num_classes, seed)
        import torch

        torch.manual_seed(seed)
        return create_model(model, data.input_shape, data.num_classes)

    acc = {k: [] for k in T3_COLUMNS}
    runs = {k: [] for k in T3_COLUMNS}
    private = {k: [] for k in T3_COLUMNS[1:]}
    figure = {}
    sigma = None
    t0 = time.perf_counter()
    for k in tqdm(range(seeds), disable=None if progress else True, desc="boenisch-table3", unit="seed"):
        cfg = TrainConfig(
            method="uniform",
            epochs=calibrated_steps,
            batch_size=n,
            lr=lr,
            momentum=momentum,
            clip_norm=clip_norm,
            seed=run_seeds[k],
            progress=False,
            device=device,
        )
        uniform = Budgets.from_array(np.full(n, eps), delta)
        halves = Budgets.from_groups([eps, high], [0.5, 0.5], n, delta, seed=run_seeds[k])
        vanilla = train(data, uniform, cfg, model=net(run_seeds[k]))
        _check_budgets(vanilla, uniform)
        acc["vanilla"].append(vanilla["test_accuracy"])
        runs["vanilla"].append({"steps": vanilla["steps"]})
        sigma = vanilla["noise_multiplier"]
        for label, budgets in (("accounting", uniform), ("accounting_assignment", halves)):
            r = train_filtered(data, budgets, cfg, opts, model=net(run_seeds[k]))
            f = r["private"]["filter"]
            if not (f["all_at_or_below_budget"] and f["all_rdp_within_budget"]):
                raise RuntimeError("internal error: an example exceeded its budget under the filter")
            acc[label].append(r["test_accuracy"])
            runs[label].append(
                {
                    "steps": r["steps"],
                    "orders": [g["filter_orders"] for g in r["groups"]],
                    "epsilon_spent": [g["epsilon_spent"] for g in r["groups"]],
                }
            )
            private[label].append(
                {
                    "active_at_end": [g["active_at_end"] for g in f["groups"]],
                    "max_realized_epsilon": [g["realized_epsilon_max"] for g in f["groups"]],
                }
            )
            if k == 0:
                figure[label] = {"active_per_step": f["active_per_step"], "budgets": [g["budget"] for g in r["groups"]]}
    out = {
        "experiment": "boenisch-table3",
        "dataset": data.name,
        "model": model or f"softmax regression ({int(np.prod(data.input_shape))} -> {data.num_classes})",
        "seeds": int(seeds),
        "epsilon": eps,
        "epsilon_high": high,
        "delta": float(delta),
        "calibrated_steps": int(calibrated_steps),
        "extend": float(extend),
        "clip_norm": float(clip_norm),
        "lr": float(lr),
        "momentum": float(momentum),
        "noise_multiplier": sigma,
        "seconds": time.perf_counter() - t0,
        "runs": 3 * int(seeds),
        "randomness": randomness(),
        **neighbouring(),
        "columns": {k: {"label": T3_LABELS[k], **mean_std(acc[k]), "runs_detail": runs[k]} for k in T3_COLUMNS},
        "private": {
            "about": "statistics of private per-example values (active examples, realized epsilon): "
            "not covered by the guarantee",
            "runs": private,
            "figure_seed0": figure,
            "seed": base,
        },
    }
    if data.name == "mnist":
        out["paper"] = {k: {"mean": m, "std": s} for k, (m, s) in zip(T3_COLUMNS, PAPER_TABLE3, strict=True)}
    return out


def table3_markdown(r) -> str:
    c = r["columns"]
    head = (
        f"| vanilla DP-GD (ε = {r['epsilon']:g}) | individual accounting (ε = {r['epsilon']:g}) | individual "
        f"accounting + assignment (ε = {r['epsilon']:g} / {r['epsilon_high']:g}) |"
    )
    lines = [
        (
            f"Boenisch et al. Table 3 on {r['dataset']} ({r['model']}): test accuracy (%), mean ± std over "
            f"{r['seeds']} seed(s); full-batch DP-GD, sigma {r['noise_multiplier']:.3f} calibrated for "
            f"{r['calibrated_steps']} steps, the filtered runs {r['extend']:g}x as long, C = {r['clip_norm']:g}, "
            f"lr {r['lr']:g}, momentum {r['momentum']:g}, delta {r['delta']:g}"
        ),
        "",
        head,
        "|---|---|---|",
        "| " + " | ".join(percent(c[k], 2) for k in T3_COLUMNS) + " |",
    ]
    lines += [
        "",
        "Paper (MNIST, ε = 0.3 / 0.31): "
        + " | ".join(f"{m:.2f} ± {s:.2f}" for m, s in PAPER_TABLE3)
        + " (ordering: vanilla < accounting < accounting + assignment)",
    ]
    return "\n".join(lines) + "\n"


def write_boenisch_table3(out, r) -> list[str]:
    """Public: ``boenisch_table3.json``/``.md`` (accuracies, σ, hyper-parameters, the filter orders,
    per-group guarantees).  Private: ``private/boenisch_table3_filter.json`` and
    ``private/fig3_active.png`` (active examples per step, realized ε: per-example statistics)."""
    from ..training.filtered import active_figure

    public = {k: v for k, v in r.items() if k != "private"}
    out.write_json(
        "boenisch_table3.json",
        public,
        "public",
        "test accuracy (mean, std over seeds) of vanilla DP-GD, "
        "the individual filter and the filter with individualized assignment; hyper-parameters",
    )
    with atomic_open(out.file("boenisch_table3.md", "public", "Table 3 as markdown"), "w") as fh:
        fh.write(table3_markdown(r))
    files = ["boenisch_table3.json", "boenisch_table3.md"]
    p = r["private"]
    out.write_json(
        "boenisch_table3_filter.json",
        p,
        "private",
        "active examples per step and realized epsilon of every filtered run (statistics of per-example values)",
    )
    files.append("private/boenisch_table3_filter.json")
    fig = p["figure_seed0"]
    if fig:
        figure = active_figure(
            {
                f"(a) accounting, ε = {r['epsilon']:g}": (
                    np.array(fig["accounting"]["active_per_step"]),
                    fig["accounting"]["budgets"],
                ),
                f"(b) accounting + assignment, ε = {r['epsilon']:g} / {r['epsilon_high']:g}": (
                    np.array(fig["accounting_assignment"]["active_per_step"]),
                    fig["accounting_assignment"]["budgets"],
                ),
            },
            title=f"{r['dataset']}, DP-GD with individual Rényi filters, δ = {r['delta']:g} (repetition 0)",
        )
        out.save_figure(
            "fig3_active.png", figure, "private", "active examples over the steps (Fig. 3; counts of private data)"
        )
        files.append("private/fig3_active.png")
    return files + record_seed(out, r)


def _table3_text(r) -> str:
    return (
        table3_markdown(r) + f"\n{r['runs']} runs in {r['seconds']:.0f} s; files in {r['out']}: "
        f"{', '.join(r['files'])} (private/: active examples per step, Fig. 3 — per-example statistics, mode 0600)"
    )


_DEVICE = Option("device", "cpu, cuda, auto or a torch device")
register(
    Experiment(
        "boenisch-table2",
        "Boenisch et al. Table 2: Sample and Scale vs DP-SGD at eps 1 (budgets 1/2/3)",
        run_boenisch_table2,
        write_boenisch_table2,
        options=(
            Option(
                "seeds",
                "repetitions per method and setup, each with its own seed derived from --seed (the paper: 10)",
                at_least_one,
            ),
            Option(
                "setups",
                "privacy-group fractions of budgets 1/2/3, comma-separated: 34-43-23 (Alaggan et al.), "
                "54-37-9 (Niu et al.)",
                _check_setups,
            ),
            Option(
                "epochs",
                "epochs (default: the paper's Table 4 for mnist 80, svhn 30, cifar10 30; digits 20)",
                _check_optional(at_least_one),
                type=int,
            ),
            Option(
                "batch_size",
                "expected batch size (default: Table 4 for mnist 512, svhn and cifar10 1024; digits 128)",
                _check_optional(at_least_one),
                type=int,
            ),
            Option(
                "lr",
                "learning rate (default: Table 4 for mnist 0.6, svhn 0.2, cifar10 0.7; digits 0.05)",
                _check_optional(positive),
                type=float,
            ),
            Option(
                "clip_norm",
                "clip norm C (default: Table 4 for mnist 0.2, svhn 0.9, cifar10 0.4; digits 1)",
                _check_optional(positive),
                type=float,
            ),
            Option("delta", "delta of every budget", valid_delta),
            Option("upper_bound", "skip DP-SGD at eps 3 for everyone (the unattainable upper bound)"),
            _DEVICE,
            SEED,
        ),
        paper_models={"digits": "digits_cnn", **PAPER_MODELS},
        text=_table2_text,
        out_help="folder for boenisch_table2.json/.md/.png",
        description="Boenisch et al. (IDP-SGD) Table 2: test accuracy of standard DP-SGD at the strictest budget "
        "(eps 1), Sample and Scale (budgets 1/2/3 at 34/43/23 % and 54/37/9 %) and DP-SGD at eps 3 (the "
        "unattainable upper bound), mean ± std over seeds, with DP-SGD's hyper-parameters reused.",
    )
)
register(
    Experiment(
        "boenisch-table3",
        "Boenisch et al. Table 3: DP-GD, + individual Rényi filter, + individualized assignment",
        run_boenisch_table3,
        write_boenisch_table3,
        options=(
            Option("seeds", "repetitions per column, each with its own seed derived from --seed", at_least_one),
            Option(
                "epsilon",
                "budget of every example (default: 10 on digits, the paper's 0.3 otherwise)",
                _check_optional(positive),
                type=float,
            ),
            Option(
                "epsilon_high",
                "budget of the second half with individualized assignment (default: epsilon x "
                "10.33/10 on digits, x 0.31/0.3 otherwise)",
                _check_optional(positive),
                type=float,
            ),
            Option("delta", "delta of every budget", valid_delta),
            Option("calibrated_steps", "DP-GD steps sigma is calibrated for (vanilla stops there)", at_least_one),
            Option("extend", "the filtered runs last this many times the calibrated steps", positive),
            Option("clip_norm", "clip norm C", positive),
            Option("lr", "learning rate", positive),
            Option("momentum", "momentum", _momentum),
            _DEVICE,
            SEED,
        ),
        paper_models={"digits": "softmax regression", "mnist": "softmax regression"},
        text=_table3_text,
        model_help="a registered model (default: softmax regression, flatten + one linear layer, on every dataset)",
        out_help="folder for boenisch_table3.json/.md (public) and private/fig3_active.png",
        description="Boenisch et al. (IDP-SGD) Table 3 (§5): full-batch DP-GD at one budget, with the individual Rényi "
        "filter (Feldman & Zrnic), and with the filter and half of the examples at a slightly larger "
        "budget; test accuracy, mean ± std over seeds.  Fig. 3 (active examples per step) goes to private/.",
    )
)
