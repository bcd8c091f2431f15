"""One readable report per run: ``report.html``, self-contained (PNG figures embedded).

Built from the run folder's public ``report.json`` (and, only on request, its private files):

* the guarantee per privacy group in words, δ, the accountant, what preprocessing and released
  statistics add; test accuracy overall and per class;
* the privacy ledger: each group's ε over the training steps, recomputed from the public
  parameters in the report (rates, effective noise multipliers, step counts) — data-independent;
* the test accuracy per epoch;
* with individual accounting: the privately released statistics of the individual ε (public);
  with ``include_private``: the per-example figures (histogram per group with each group's worst
  case, ε vs loss, class ε vs accuracy) and the exact statistics — a private report, written with
  mode 0600 into ``private/``.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from ..accounting import DEFAULT_ORDERS, compute_rdp, rdp_to_epsilon
from ..accounting.neighbouring import NEIGHBOURING, NEIGHBOURING_SENTENCE
from ..validation import InvalidParameterError

STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; max-width: 980px; margin: 2em auto;
       color: #1b1b1b; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .6em 0; } td, th { padding: .25em .8em; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #555; font-size: .92em; } .private { border-left: 4px solid #c0392b; padding-left: 1em; }
.ok { color: #1e7b34; font-weight: 600; } .bad { color: #c0392b; font-weight: 600; }
img { max-width: 100%; } .figs { display: flex; flex-wrap: wrap; gap: 1em; } .figs img { max-width: 470px; }
"""


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _img_file(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def epsilon_curves(report: dict, points: int = 120):
    """(steps, ε per group at those steps) from the public per-group parameters of a one-phase run,
    or None when the report lacks them (multi-phase runs show one value per group)."""
    groups = report.get("groups") or []
    steps = int(report.get("steps") or 0)
    if not groups or steps < 1 or len(report.get("phases") or []) != 1:
        return None
    t = np.unique(np.linspace(1, steps, min(points, steps)).round().astype(int))
    delta = float(groups[0].get("delta", report["delta"]))
    curves = []
    for g in groups:
        if not g.get("trained") or not g.get("sample_rate"):
            curves.append(np.zeros(t.size))
            continue
        per_step = compute_rdp(g["sample_rate"], g["noise_multiplier"], DEFAULT_ORDERS)
        curves.append(
            rdp_to_epsilon(per_step[None, :] * t[:, None], DEFAULT_ORDERS, delta)[0]
            + g.get("epsilon_spent", 0)
            - g.get("epsilon_training", g.get("epsilon_spent", 0))
        )
    return t, np.array(curves)


def _ledger_figure(report: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cur = epsilon_curves(report)
    if cur is None:
        return None
    t, eps = cur
    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    colors = plt.cm.viridis(np.linspace(0.1, 0.85, len(report["groups"])))
    for g, e, col in zip(report["groups"], eps, colors, strict=True):
        ax.plot(t, e, color=col, label=f"group with budget {g['budget']:g}")
        ax.axhline(g["budget"], color=col, ls=":", lw=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("ε spent (RDP bound at the order grid)")
    ax.set_title("privacy ledger: ε of each group over training (dotted: its budget)", fontsize=9)
    ax.legend(fontsize=8)
    return _png(fig)


def _accuracy_figure(report: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = [h for h in report.get("history") or [] if h.get("test_accuracy") is not None]
    if not hist:
        return None
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    ax.plot([h["epoch"] for h in hist], [h["test_accuracy"] for h in hist], marker="o", ms=3)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    return _png(fig)


def _table(header, rows) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='num'>{c}</td>" if isinstance(c, str) and c[:1] in "0123456789-." else f"<td>{c}</td>"
            for c in r
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(x, digits=4) -> str:
    return "–" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else html.escape(str(x))


def render(run_dir, include_private: bool = False) -> str:
    """The HTML report of the run in ``run_dir``."""
    run_dir = Path(run_dir)
    path = run_dir / "report.json"
    if not path.is_file():
        raise InvalidParameterError("dir", str(run_dir), "holds no report.json (not an idpsgd run folder)")
    try:
        r = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidParameterError("dir", str(run_dir), f"its report.json is not valid JSON ({exc})") from None
    e = html.escape
    parts = [
        f"<h1>idpsgd run: {e(str(r.get('method')))} on {e(str(r.get('dataset')))}</h1>",
        f"<p class='note'>model {e(str(r.get('model')))}, accountant {e(str(r.get('accountant')))}, "
        f"{r.get('steps')} steps of {r.get('planned_steps', r.get('steps'))} planned"
        + (" — <span class='bad'>stopped early by the privacy filter</span>" if r.get("stopped_early") else "")
        + f"; {'secure mode' if r.get('secure_mode') else 'not secure mode'}</p>",
    ]
    charged, kept = r.get("steps_charged"), r.get("steps_kept", r.get("steps"))
    if charged is not None and charged != kept:  # a resume charged an abandoned attempt's draws (budget/journal.py)
        parts.append(
            f"<p class='note'>Steps charged: <b>{charged}</b> ({kept} kept — the model descends from them — and "
            f"{charged - kept} noise draws of earlier attempts of this run that the resumed run did not keep: their "
            "outputs may have left the process, so the epsilon below covers them too)</p>"
        )
    elif charged is not None:
        parts.append(f"<p class='note'>Steps charged: {charged} (every noise draw of the run; all kept)</p>")
    if r.get("randomness"):  # never the seed itself (an old report.json may still hold one: not shown)
        parts.append(f"<p class='note'>Randomness: {e(str(r['randomness']))}</p>")
    if r.get("layer_paths"):
        from ..engine.per_example.bk.plan import summarize_paths

        parts.append(
            f"<p class='note'>per-example gradient norms ({e(str(r.get('grad_sample_mode')))}): "
            f"{e(summarize_paths(r['layer_paths']))}</p>"
        )
    parts.append("<h2>Guarantee</h2>")
    parts.append(f"<p>{e(str(r.get('guarantee', '')))}</p>")
    if r.get("neighbouring") == NEIGHBOURING:
        parts.append(f"<p class='note'>{e(NEIGHBOURING_SENTENCE)}</p>")
    unit = "user" if r.get("privacy_unit") == "user" else "example"
    if unit == "user":
        parts.append(
            f"<p class='note'>User-level privacy: the unit is a user (all of their rows); at most "
            f"k = {_fmt(r.get('max_rows_per_user'))} rows of a sampled user per step (max_rows_per_user, public). "
            "The groups count users.</p>"
        )
    groups = r.get("groups") or []
    rows = []
    for g in groups:
        spent, budget = g.get("epsilon_spent"), g.get("budget")
        ok = spent is not None and budget is not None and spent <= budget * (1 + 1e-12)
        words = (
            f"every {unit} with budget {budget:g} received ({spent:.4g}, {g.get('delta', r.get('delta')):g})-DP"
            if spent is not None
            else ""
        )
        rows.append(
            [
                _fmt(budget),
                str(g.get("count")),
                _fmt(g.get("sample_rate")),
                _fmt(g.get("clip_norm")),
                _fmt(g.get("noise_multiplier")),
                _fmt(spent),
                f"<span class='{'ok' if ok else 'bad'}'>{'within budget' if ok else 'OVER BUDGET'}</span>",
                e(words),
            ]
        )
    parts.append(
        _table(["budget", f"{unit}s", "sampling rate", "clip norm", "effective σ", "ε spent", "", "in words"], rows)
    )
    pre = r.get("preprocessing") or {}
    if pre:
        cost = (
            f" — charged ({pre.get('epsilon', 0):g}, {pre.get('delta', 0):g}) to every {unit}"
            if pre.get("epsilon")
            else ""
        )
        parts.append(
            f"<p class='note'>Input normalization: {e(str(pre.get('mode')))} ({e(str(pre.get('source', '')))})"
            f"{e(cost)}.</p>"
        )
    metrics = {k: v for k, v in (r.get("test_metrics") or {}).items() if not isinstance(v, (list, dict))}
    if r.get("test_accuracy") is None and metrics:  # e.g. a language model: loss and perplexity
        parts.append("<h2>Test metrics</h2>")
        parts.append(_table(["metric", "value"], [[e(k), _fmt(v)] for k, v in metrics.items()]))
    else:
        parts.append("<h2>Accuracy</h2>")
        parts.append(f"<p>Test accuracy <b>{_fmt(r.get('test_accuracy'))}</b>.</p>")
    pca = r.get("per_class_accuracy") or []
    if pca:
        parts.append(_table(["class"] + [str(k) for k in range(len(pca))], [["accuracy"] + [_fmt(a, 3) for a in pca]]))
    figs = [f for f in (_ledger_figure(r), _accuracy_figure(r)) if f]
    if figs:
        parts.append(
            "<h2>Privacy ledger and training curve</h2><div class='figs'>"
            + "".join(f"<img alt='figure' src='{f}'>" for f in figs)
            + "</div>"
        )
    ip = r.get("individual_privacy")
    if ip:
        rel = ip["released"]
        parts.append("<h2>Individual privacy (Yu et al. 2023)</h2>")
        parts.append(
            f"<p>Each example's ε is the smaller of its output-specific ε ({e(ip['kind'])}: "
            f"{e(ip['definition'])}) and its data-independent ε"
            + (f" — {e(ip['kind'])} because {e(ip['kind_reason'])}" if ip.get("kind_reason") else "")
            + ". Only privately released statistics are "
            f"shown here: released with (ε, δ) = ({rel['total']['epsilon']:g}, {rel['total']['delta']:g}), "
            f"which every example pays on top of the model's guarantee.</p>"
        )
        qs = rel["quantiles"]["values"]
        parts.append(
            _table(
                ["statistic", "released value"],
                [["mean ε", _fmt(rel["mean"]["value"])]] + [[f"quantile {k}", _fmt(v)] for k, v in qs.items()],
            )
        )
    flt = r.get("filter")
    if flt:
        parts.append("<h2>Individual Rényi filter (Feldman &amp; Zrnic 2021; Boenisch et al. §5)</h2>")
        parts.append(
            f"<p>The run lasted {flt.get('run_steps')} steps, {_fmt(flt.get('extend'), 3)} times the "
            f"{flt.get('calibrated_steps')} steps calibrated for the worst case; each example left training "
            "when its own Rényi budget at its filter order was spent.</p>"
        )
        parts.append(
            _table(
                ["budget", "filter orders", "RDP budgets"],
                [
                    [
                        _fmt(g.get("budget")),
                        e(", ".join(_fmt(o, 3) for o in (g.get("filter_orders") or []))),
                        e(", ".join(_fmt(b) for b in (g.get("rdp_budgets") or []))),
                    ]
                    for g in groups
                ],
            )
        )
    if r.get("lm_audit"):
        parts.append(_lm_audit_section(r["lm_audit"], run_dir))
    files = r.get("files") or {}
    if files:
        parts.append("<h2>Files</h2>" + _table(["file", "kind"], [[e(k), e(v)] for k, v in sorted(files.items())]))
    if include_private:
        parts.append(_private_section(run_dir))
    title = f"idpsgd report — {r.get('method')} on {r.get('dataset')}"
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>"
    )


def _lm_audit_section(a: dict, run_dir: Path) -> str:
    """The canary audit of a language model (:mod:`idpsgd.audit.lm`): per group the exposure of the
    included and held-out canaries, the AUC, the one-run lower bound beside the reported ε, the
    verdict, and the exposure figure."""
    e = html.escape
    est = " (estimate)" if a.get("exposure_is_estimate") else ""

    def ex(s):
        return "n/a" if not s or s.get("mean") is None else f"{s['mean']:.2f} (median {s['median']:.2f})"

    rows = []
    for g in [*a.get("groups", []), a.get("all", {})]:
        ok = g.get("verdict") != "FAILED"
        rows.append(
            [
                "all" if g.get("budget") is None else _fmt(g.get("budget")),
                _fmt(g.get("reported_epsilon")),
                ex(g.get("exposure_included")),
                ex(g.get("exposure_held_out")),
                _fmt(g.get("auc"), 3),
                _fmt(g.get("empirical_epsilon")),
                f"<span class='{'ok' if ok else 'bad'}'>{e(str(g.get('verdict')))}</span>",
            ]
        )
    fmt = a.get("canary_format", {})
    m = a.get("multiplicity", {})
    parts = [
        "<h2>Canary audit (Carlini et al. 2019; Steinke, Nasr &amp; Jagielski 2023)</h2>",
        f"<p class='note'>{a.get('canaries_per_group')} canaries per group, '{e(str(fmt.get('prefix')))}' + "
        f"{fmt.get('digits')} random digits (|R| = {fmt.get('space_size')}), each included with probability 1/2 "
        f"(held out: a null row). Exposure {e(str(a.get('exposure_method')))}; maximum "
        f"{_fmt(a.get('exposure_max'), 3)} bits. Empirical ε: the one-run lower bound with the loss as the score, "
        f"at {_fmt(100 * (m.get('confidence_per_test') or 0), 4)} % each (Bonferroni over {m.get('tests')} tests); "
        "FAILED if it exceeds the reported ε.</p>",
        _table(
            [
                "budget",
                "reported ε",
                f"exposure, included{est}",
                f"exposure, held out{est}",
                "AUC",
                "ε lower bound",
                "",
            ],
            rows,
        ),
    ]
    fig = run_dir / "exposure_by_group.png"
    if fig.is_file():
        parts.append(f"<div class='figs'><img alt='exposure per group' src='{_img_file(fig)}'></div>")
    return "".join(parts)


def _private_section(run_dir: Path) -> str:
    priv = run_dir / "private"
    parts = ["<div class='private'><h2>Private: not covered by the guarantee — do not publish</h2>"]
    stats = priv / "individual_privacy.json"
    if stats.is_file():
        s = json.loads(stats.read_text())
        rows = [
            ["mean", _fmt(s.get("mean"))],
            ["min", _fmt(s.get("min"))],
            ["max", _fmt(s.get("max"))],
            ["worst case", _fmt(s.get("worst_case_epsilon"))],
            ["share at the worst case", _fmt(s.get("share_at_worst_case"))],
        ]
        rows += [[f"quantile {k}", _fmt(v)] for k, v in (s.get("quantiles") or {}).items()]
        if s.get("validation"):
            v = s["validation"]
            rows += [
                ["validation: Pearson r vs exact", _fmt(v.get("pearson_r"))],
                ["validation: mean |error|", _fmt(v.get("mean_abs_error"))],
            ]
        parts.append("<p>Exact statistics of the individual ε:</p>" + _table(["statistic", "value"], rows))
    imgs = [
        p
        for p in ("epsilon_histogram.png", "epsilon_vs_loss.png", "class_epsilon_vs_accuracy.png", "active.png")
        if (priv / p).is_file()
    ]
    if imgs:
        parts.append(
            "<div class='figs'>" + "".join(f"<img alt='{p}' src='{_img_file(priv / p)}'>" for p in imgs) + "</div>"
        )
    parts.append("</div>")
    return "".join(parts)


def move_public_seed(run_folder) -> bool:
    """A ``report.json`` written before the seed became private holds it (``"seed"``): move it to
    ``private/seed.json`` (mode 0600; an existing record is kept) and rewrite ``report.json`` without
    it.  Returns whether anything moved."""
    from ..engine.noise.randomness import randomness_note
    from ..runfolder import PRIVATE, SEED_FILE

    path = run_folder.path / "report.json"
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(r, dict) or "seed" not in r:
        return False
    seed = r.pop("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not (run_folder.path / PRIVATE / SEED_FILE).is_file():
        run_folder.record_seed(seed, "the run's seed, moved here from the public report.json of an earlier version")
    r.setdefault("randomness", randomness_note(bool(r.get("secure_mode")), f"{PRIVATE}/{SEED_FILE}"))
    run_folder.write_json(
        "report.json", r, "public", run_folder.manifest.get("report.json", {}).get("description", "the run's report")
    )
    return True


def write_report(run_folder, include_private: bool = False) -> Path:
    """Write ``report.html`` (public) or ``private/report.html`` (with the private sections, 0600)."""
    text = render(run_folder.path, include_private)
    from ..io import atomic_open

    if include_private:
        path = run_folder.file("report.html", "private", "the run's report with its private sections")
    else:
        path = run_folder.file(
            "report.html",
            "public",
            "the run's readable report (guarantee per group, accuracy, "
            "ledger, released statistics), self-contained HTML",
        )
    with atomic_open(path, "w", private=include_private) as fh:
        fh.write(text)
    return path
