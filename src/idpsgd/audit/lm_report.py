"""The outputs of a language-model canary audit (:mod:`.lm`) in a run folder.

* ``private/canaries.csv`` (0600): every canary — its group's budget, its user at user level, its
  secret text, its inclusion coin, tokens, log-likelihood, score, exposure (and whether it was
  extrapolated): the auditor's secret;
* ``private/lm_audit_settings.json`` (0600): the design's seed and the format;
* ``lm_audit.json`` (public): the per-group summary and the verdict (see :mod:`.lm` for why the
  aggregates are public);
* ``exposure_by_group.png`` (public): exposure per group, included vs held-out canaries (box plots);
* when the folder holds a run's ``report.json``: its ``lm_audit`` key, and ``report.html`` again
  with the audit's section.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from .lm import public_result

log = logging.getLogger("idpsgd")

FIGURE = "exposure_by_group.png"


def _quoted(values) -> np.ndarray:
    """Texts as CSV fields (quoted where they hold a comma, a quote or a line break)."""
    out = []
    for v in values:
        t = str(v)
        out.append('"' + t.replace('"', '""') + '"' if any(c in t for c in ',"\n\r') else t)
    return np.asarray(out, dtype=object)


def _name(budget) -> str:
    return "all" if budget is None else f"{budget:g}"


def exposure_figure(result: dict, exposures, group, included, title: str | None = None):
    """Box plots of exposure per privacy group: included canaries (filled) beside the held-out
    reference (hatched); dashed: the largest exposure log₂|R|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["groups"]
    fig, ax = plt.subplots(figsize=(1.9 * len(rows) + 3, 4.4))
    colors = plt.cm.viridis(np.linspace(0.15, 0.85, max(len(rows), 1)))
    ticks, labels = [], []
    for g, row in enumerate(rows):
        for k, (sel, hatch) in enumerate(((included, None), (~included, "//"))):
            v = np.asarray(exposures)[(group == g) & sel]
            if v.size == 0:
                continue
            b = ax.boxplot([v], positions=[3 * g + k], widths=0.75, patch_artist=True, showfliers=True)
            b["boxes"][0].set(facecolor=colors[g], alpha=0.85 if hatch is None else 0.3, hatch=hatch)
        rep = row.get("reported_epsilon")
        ticks.append(3 * g + 0.5)
        labels.append(f"budget {row['budget']:g}\n" + (f"reported ε {rep:.2f}" if rep is not None else "non-private"))
    ax.axhline(result["exposure_max"], color="0.5", ls="--", lw=0.9)
    ax.text(3 * len(rows) - 1.4, result["exposure_max"], "log₂|R|", va="bottom", ha="right", fontsize=8, color="0.4")
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("exposure (bits)" + (" — estimate" if result["exposure_is_estimate"] else ""))
    ax.set_ylim(0, result["exposure_max"] * 1.08)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(facecolor="0.5", label="included"), Patch(facecolor="0.85", hatch="//", label="held out")],
        fontsize=8,
        loc="center left",
        frameon=False,
    )
    ax.set_title(title or "canary exposure per privacy group (Carlini et al. 2019)", fontsize=10)
    fig.tight_layout()
    return fig


def write_lm_audit(folder, result: dict) -> dict:
    """Write the files (module docstring) into the :class:`~idpsgd.runfolder.RunFolder` ``folder``;
    returns the public result with ``files``.  A failed audit is logged as an error."""
    raw = result["_private"]
    public = public_result(result)
    if public["failed_groups"]:
        log.error(
            "AUDIT FAILED: the empirical epsilon lower bound exceeds the reported epsilon for budget(s) %s "
            "(an accounting or implementation error)",
            ", ".join(_name(b) for b in public["failed_groups"]),
        )
    n = len(raw["texts"])
    header = ["canary", "budget", "included", "tokens", "log_likelihood", "score", "exposure", "extrapolated"]
    cols = [
        np.arange(n),
        raw["budget"],
        raw["included"].astype(int),
        raw["tokens"].astype(int),
        raw["log_likelihood"],
        raw["score"],
        raw["exposure"],
        raw["extrapolated"].astype(int),
    ]
    if raw.get("users") is not None:
        header.insert(2, "user")
        cols.insert(2, _quoted(raw["users"]))
    header.append("text")
    cols.append(_quoted(raw["texts"]))
    folder.write_csv(
        "canaries.csv",
        header,
        cols,
        "private",
        "every canary: budget, inclusion coin, secret text, the model's log-likelihood, score and exposure "
        "(the audit's secret: whoever holds it knows what the attack guesses)",
    )
    folder.write_json(
        "lm_audit_settings.json",
        {"seed": raw["seed"], "canary_format": public["canary_format"]},
        "private",
        "the canary design's seed (draws the secrets and the inclusion coins)",
    )
    folder.save_figure(
        FIGURE,
        exposure_figure(public, raw["exposure"], raw["group"], raw["included"]),
        "public",
        "exposure of the canaries per privacy group, included vs held out (box plots)",
    )
    public["files"] = {"summary": "lm_audit.json", "figure": FIGURE, "canaries": "private/canaries.csv"}
    folder.write_json(
        "lm_audit.json",
        public,
        "public",
        "the canary audit per privacy group: exposure summaries, AUC, the one-run empirical epsilon lower "
        "bound beside the reported epsilon, the verdict",
    )
    report = folder.path / "report.json"
    if report.is_file():  # a run's folder: the summary into its report, and report.html again
        from ..analysis.report import write_report

        data = json.loads(report.read_text())
        data["lm_audit"] = public
        data.setdefault("files", {})
        if isinstance(data["files"], dict):
            data["files"].update(
                {f: folder.manifest.get(f, {}).get("kind", "public") for f in ("lm_audit.json", FIGURE)}
            )
            data["files"]["private/canaries.csv"] = "private"
        folder.write_json("report.json", data, "public", "the run's report with the canary audit (lm_audit)")
        write_report(folder)
    return public


def lm_audit_text(r: dict) -> str:
    """The audit as a table (public values only)."""
    est = " (estimate)" if r["exposure_is_estimate"] else ""
    f = r["canary_format"]
    ctx = "<context> " if f.get("contexts") else ""
    rep = f", {f['repeats']} rows each" if f.get("repeats", 1) > 1 else ""
    lines = [
        f"canary audit: {r['canaries_per_group']} canaries per group{rep} ('{ctx}{f['prefix']} + {f['digits']} "
        f"digits', |R| = {f['space_size']:g}); exposure {r['exposure_method']}",
        f"{'budget':>7} {'reported eps':>12} {'exposure in' + est:>24} {'exposure out':>13} {'AUC':>6} "
        f"{'guesses':>7} {'correct':>7} {'eps lower':>9} {'audit':>11}",
    ]
    for row in [*r["groups"], r["all"]]:
        o = row["one_run"]
        ein, eout = row["exposure_included"], row["exposure_held_out"]

        def med(s):
            return "n/a" if s["median"] is None else f"{s['mean']:.2f} (med {s['median']:.2f})"

        rep = "n/a" if row["reported_epsilon"] is None else f"{row['reported_epsilon']:.3f}"
        auc = "n/a" if row["auc"] is None else f"{row['auc']:.3f}"
        lines.append(
            f"{_name(row['budget']):>7} {rep:>12} {med(ein):>24} {med(eout):>13} {auc:>6} {o['guesses']:>7} "
            f"{o['correct']:>7} {o['epsilon']:>9.3f} {row['verdict']:>11}"
        )
    m = r["multiplicity"]
    lines.append(
        f"  exposure: mean (median) over the group's included / held-out canaries, bits (max "
        f"{r['exposure_max']:.2f}); eps lower: Steinke et al.'s one-run bound at {100 * m['confidence_per_test']:.4g}% "
        f"each (Bonferroni over {m['tests']} tests); FAILED if it exceeds the reported epsilon"
    )
    if not r["audit_passed"]:
        lines.insert(0, "AUDIT FAILED: an empirical epsilon lower bound exceeds the reported epsilon")
    return "\n".join(lines)
