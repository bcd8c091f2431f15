"""The audit's outputs: ``audit.json``, ``private/audit.json``, ``audit_scores.csv``,
``roc_by_group.png``, and its text.

Through :class:`~idpsgd.runfolder.RunFolder`.  The results — per group: budget, reported ε, AUC,
TPR at low FPR with counts, the ε lower bound with its estimate and the largest ε the test could
show, the one-run bound on the same guesses, the verdict's Bonferroni level, tests between groups
— are statistics of the training data and of the secret membership of the audit's models, which
no reported guarantee covers (issue 35: they differ between neighbouring data sets): they are for
the auditor, in ``private/audit.json`` and ``private/roc_by_group.png`` (mode 0600) beside the
per-example scores ``private/audit_scores.csv``, the models and the settings.  The public
``audit.json`` (:func:`public_audit`) holds only what the guarantee covers or what is public:
the settings, the one plan every model ran (calibrated from N and the group sizes, public inputs),
each group's size and reported ε, the test accuracy of the models on public test data, where the
results are.  A group whose lower bound exceeds its reported ε fails the audit: the result says
``audit_passed: false`` with the groups, the text starts with ``AUDIT FAILED`` and the failure is
logged as an error (on stderr: a failed audit means the reported guarantee is wrong).
"""

from __future__ import annotations

import logging

import numpy as np

from ..accounting.neighbouring import neighbouring
from . import bounds

log = logging.getLogger("idpsgd")

#: settings of the audit and the plan every model ran: public (no membership score enters them)
PUBLIC_KEYS = (
    "attack",
    "primary_attack",
    "lira",
    "method",
    "dataset",
    "model",
    "accountant",
    "guarantee",
    "delta",
    "confidence",
    "multiplicity",
    "shadow_models",
    "canaries_per_group",
    "canary_kind",
    "epochs",
    "batch_size",
    "lr",
    "clip_norm",
    "threshold_selection",
    "plan",
    "shadow_test_accuracy_mean",
    "disclosure",
)
RESULTS = "audit.json"  # private/audit.json: every result of the audit


def public_audit(result: dict) -> dict:
    """The public part of an audit's result (what ``audit.json`` and stdout show by default): the
    settings, the plan, each group's size and reported ε, the target's test accuracy (public test
    data) and σ, where the private results are; never a statistic of membership scores."""
    out = {k: result[k] for k in PUBLIC_KEYS if k in result}
    out.update(neighbouring())
    target = result.get("target") or {}
    out["target"] = {k: target[k] for k in ("test_accuracy", "noise_multiplier") if k in target}
    out["groups"] = [
        {k: row[k] for k in ("budget", "examples", "reported_epsilon", "delta") if k in row}
        for row in result.get("groups", [])
    ]
    out["results"] = f"private/{RESULTS}"
    if "files" in result:
        out["files"] = result["files"]
    return out


ATTACK_LABELS = {
    "lira-online": "LiRA online",
    "lira-offline": "LiRA offline",
    "loss": "loss threshold",
    "one-run": "one-run (Steinke et al.)",
}


def write_outputs(folder, result: dict) -> dict:
    """Write the files; return the audit without its per-example arrays, with ``files`` and the
    overall verdict (``audit_passed``, ``failed_groups``)."""
    raw = result.pop("_scores")
    failed = [row["budget"] for row in [*result["groups"], result["all"]] if row.get("verdict") == "FAILED"]
    result["audit_passed"] = not failed
    result["failed_groups"] = failed
    if failed:
        log.error(
            "AUDIT FAILED: the empirical epsilon lower bound exceeds the reported epsilon for budget(s) %s "
            "(an accounting or implementation error)",
            ", ".join("all" if b is None else f"{b:g}" for b in failed),
        )
    files = {"audit": str(folder.path / "audit.json"), "results": str(folder.path / "private" / RESULTS)}
    if result["attack"] == "one-run":
        _write_one_run_csv(folder, raw)
    else:
        _write_scores_csv(folder, raw)
        folder.save_figure(
            "roc_by_group.png",
            roc_figure(result, raw),
            "private",
            "ROC of the membership inference attack per privacy group (Boenisch et al. Fig. 2 "
            "style; log-log inset): a statistic of membership scores, not covered by the guarantee",
        )
        files["roc"] = str(folder.path / "private" / "roc_by_group.png")
    files["scores"] = str(folder.path / "private" / "audit_scores.csv")
    result["files"] = files
    folder.write_json(
        RESULTS,
        {k: v for k, v in result.items() if k != "private"},
        "private",
        "the audit's results per privacy group: reported epsilon, AUC, TPR at low FPR with counts, "
        "empirical epsilon lower bounds with confidence intervals, tests between groups, the verdict "
        "(statistics of the training data and the secret membership: not covered by the DP guarantees)",
    )
    folder.write_json(
        "audit.json",
        public_audit(result),
        "public",
        "the audit's settings, the plan every model ran, each group's size and reported epsilon, the "
        "target's test accuracy; the results are in private/audit.json",
    )
    return result


def _write_scores_csv(folder, raw):
    target_in, scores = raw["target_in"], raw["scores"]
    names = list(scores)
    header = ["index", "label", "budget", "target_member", *[n.replace("-", "_") + "_score" for n in names], "phi"]
    cols = [
        np.arange(target_in.size),
        raw["labels"],
        raw["budgets"],
        target_in.astype(int),
        *[scores[n] for n in names],
        raw["phi"],
    ]
    folder.write_csv(
        "audit_scores.csv",
        header,
        cols,
        "private",
        "per example: budget, membership in the "
        "target, every attack's score, the target's logit-scaled confidence (personal data)",
    )


def _write_one_run_csv(folder, raw):
    idx = np.flatnonzero(raw["canary"])
    header = ["index", "label", "canary_label", "budget", "included", "score"]
    cols = [
        idx,
        raw["labels"][idx],
        raw["canary_labels"][idx],
        raw["budgets"][idx],
        raw["included"][idx].astype(int),
        raw["score"][idx],
    ]
    folder.write_csv(
        "audit_scores.csv",
        header,
        cols,
        "private",
        "per canary: budget, whether it was included, its score on the trained model (personal data)",
    )


# ---------------------------------------------------------------- the figure


def roc_figure(result: dict, raw: dict):
    """ROC per privacy group plus all data (dotted), linear axes with a log–log inset (Boenisch et
    al. Fig. 2 style): on the target, and — with shadow models — pooled over every shadow model as
    a target with leave-one-out fits (M times the data: the steadier picture)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attack = result["primary_attack"]
    group_of, values = raw["group_of"], raw["values"]
    panels = [("target model", raw["scores"][attack], raw["target_in"], "auc")]
    if raw.get("loo") is not None:
        m = raw["design"].shape[0]
        panels.append(
            (f"pooled over the {m} shadow models (leave-one-out)", raw["loo"], raw["design"], "auc_leave_one_out")
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 5.8), squeeze=False)
    colors = plt.cm.viridis(np.linspace(0.05, 0.85, max(len(values), 1)))
    n_all = int(result["all"]["non_members"])
    for ax, (where, scores, member, key) in zip(axes[0], panels, strict=True):
        inset = ax.inset_axes([0.60, 0.06, 0.38, 0.34])
        curves = [(f"ε = {v:g}", group_of == g, colors[g], "-", result["groups"][g]) for g, v in enumerate(values)]
        curves.append(("all data", np.ones(group_of.size, bool), "tab:blue", ":", result["all"]))
        lo = 1.0
        for label, mask, color, style, row in curves:
            s, mem = scores[..., mask].ravel(), member[..., mask].ravel()
            if not mem.any() or mem.all():
                continue
            fpr, tpr = bounds.roc(s, mem)
            auc = row["attacks"][attack].get(key)
            rel = "≤" if row["budget"] is None else "="
            rep = f", reported ε {rel} {row['reported_epsilon']:.2f}" if row.get("reported_epsilon") is not None else ""
            ax.plot(fpr, tpr, style, color=color, lw=1.6, label=f"{label}: AUC = {auc:.3f}{rep}")
            keep = (fpr > 0) & (tpr > 0)
            inset.plot(fpr[keep], tpr[keep], style, color=color, lw=1.1)
            lo = min(lo, 1.0 / max(int((~mem).sum()), 1))
        for a in (ax, inset):
            a.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls="--")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("False positive rate")
        ax.set_ylabel("True positive rate")
        ax.set_title(where, fontsize=10)
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        lo = min(lo, 1.0 / max(n_all, 1))
        inset.set_xscale("log")
        inset.set_yscale("log")
        inset.set_xlim(lo, 1)
        inset.set_ylim(lo, 1)
        inset.text(0.96, 0.04, "log–log", transform=inset.transAxes, ha="right", va="bottom", fontsize=8)
        inset.tick_params(labelsize=7)
    title = {"lira-online": "LiRA (online)", "lira-offline": "LiRA (offline)", "loss": "loss threshold"}[attack]
    fig.suptitle(
        f"{title} membership inference per privacy group — {result['method']} on {result['dataset']}, "
        f"{result.get('shadow_models') or 0} shadow models, target members {result['target']['members']}",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- text


def _num(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


def _tpr(t):
    flag = "" if t["resolved"] else "*"
    return f"{t['tpr']:.3f}{flag} ({t['true_positives']}/{t['false_positives']})"


def _banner(r: dict) -> list[str]:
    if r.get("audit_passed", True):
        return []
    names = ", ".join("all" if b is None else f"{b:g}" for b in r["failed_groups"])
    return [
        f"AUDIT FAILED: the empirical epsilon lower bound exceeds the reported epsilon for budget(s) {names}: "
        "the accounting or the implementation is wrong"
    ]


def _pct(f: float, digits: int = 6) -> str:
    return f"{100 * f:.{digits}g}%"


def audit_text(r: dict) -> str:
    text = _one_run_text(r) if r["attack"] == "one-run" else _membership_text(r)
    return "\n".join([*_banner(r), text, *_banner(r)])


def public_audit_text(r: dict) -> str:
    """The text of :func:`public_audit`: the plan and reported ε per group, where the results are."""
    rows = [f"{'budget':>7} {'examples':>8} {'reported eps':>12}"]
    rows += [f"{g['budget']:>7g} {g.get('examples', ''):>8} {g['reported_epsilon']:>12.4f}" for g in r["groups"]]
    acc = r.get("target", {}).get("test_accuracy")
    return "\n".join(
        [
            f"idpsgd audit: {r['attack']} membership inference on {r['method']} ({r['dataset']}, {r['model']})"
            + (f"; target test accuracy {_num(acc)}" if acc is not None else ""),
            *rows,
            f"results (statistics of the training data and the secret membership, not covered by the "
            f"guarantee): {r['files']['results']} (mode 0600); --show-private prints them",
        ]
    )


def _membership_text(r: dict) -> str:
    primary = r["primary_attack"]
    loo = bool(r["shadow_models"])
    fprs = next(
        (
            row["attacks"][primary]["tpr_at_fpr"]
            for row in [*r["groups"], r["all"]]
            if row["attacks"][primary].get("auc") is not None
        ),
        [],
    )
    heads = "".join(f" {'TPR@' + _pct(t['fpr']) + 'FPR (TP/FP)':>20}" for t in fprs)
    lines = [
        (
            f"idpsgd audit: {ATTACK_LABELS[primary]} membership inference on {r['method']} ({r['dataset']}, "
            f"{r['model']}); {r['shadow_models']} shadow models; target: {r['target']['members']} of "
            f"{r['target']['examples']} examples, test accuracy {_num(r['target']['test_accuracy'])}"
        ),
        (
            f"{'budget':>7} {'reported eps':>12} {'AUC':>6} {'AUC loo' if loo else '':>7}{heads} "
            f"{'eps lower':>9} {'estimate':>8} {'test max':>8} {'one-run':>7} {'audit':>7}"
        ),
    ]
    for row in [*r["groups"], r["all"]]:
        a = row["attacks"][primary]
        name = "all" if row["budget"] is None else f"{row['budget']:g}"
        b, o = a.get("epsilon_lower_bound"), a.get("one_run_bound")
        est, most = (
            ("n/a", "n/a")
            if not b
            else (
                _num(b["estimate"], "{:.2f}").replace("n/a", "inf"),
                _num(b["largest_showable"], "{:.2f}").replace("n/a", "inf"),
            )
        )
        tprs = a["tpr_at_fpr"] if a.get("auc") is not None else [None] * len(fprs)
        cells = "".join(f" {(_tpr(t) if t else 'n/a'):>20}" for t in tprs)
        lines.append(
            f"{name:>7} {_num(row['reported_epsilon']):>12} {_num(a.get('auc')):>6} "
            f"{_num(a.get('auc_leave_one_out')) if loo else '':>7}{cells} "
            f"{_num(b['lower'] if b else None, '{:.2f}'):>9} {est:>8} {most:>8} "
            f"{_num(o['epsilon'] if o else None, '{:.2f}'):>7} {row['verdict']:>7}"
        )
        if row.get("secondary_exceeding"):
            lines.append(
                f"        warning: the bound of {', '.join(row['secondary_exceeding'])} exceeds the reported epsilon"
            )
    mult = r["multiplicity"]
    lines.append(
        (
            "  AUC: on the target; AUC loo: pooled over the shadow models' leave-one-out scores; "
            if loo
            else "  AUC: on the target; "
        )
        + "*: FPR below 1/non-members (no false positive allowed)"
    )
    lines.append(
        "  eps lower: Clopper-Pearson lower bound (threshold chosen "
        + ("on the shadow models" if loo else "on a random half, bound on the other half")
        + "); estimate: at the observed rates; test max: the largest eps this test could show with these "
        "counts (not an upper bound on eps); one-run: Steinke et al.'s bound on the same guesses (rigorous: "
        "no independence between examples assumed)"
    )
    lines.append(
        f"  audit: FAILED if either lower bound exceeds the reported epsilon; every bound at "
        f"{_pct(mult['confidence_per_test'], 4)} (Bonferroni over the verdict's {mult['tests']} tests: "
        f"{_pct(mult['confidence'])} jointly)"
    )
    others = [n for n in r["groups"][0]["attacks"] if n != primary] if r["groups"] else []
    for n in others:
        cells = []
        for row in r["groups"]:
            a = row["attacks"][n]
            b = a.get("epsilon_lower_bound")
            cells.append(f"{row['budget']:g}: AUC {_num(a.get('auc'))}, bound {_num(b['lower'] if b else None)}")
        lines.append(f"  {ATTACK_LABELS[n]}: " + "; ".join(cells))
    if r["tests"]:
        lines.append(
            f"  tests between groups ({ATTACK_LABELS[primary]} scores; Student t, Mann-Whitney U; two-sided p, "
            "and one-sided p for 'the stricter group scores lower'):"
        )
        for t in r["tests"]:
            if t["student_t"] is None:
                continue
            lines.append(
                f"    {t['groups'][0]:g} vs {t['groups'][1]:g} ({t['population']}): t = {t['student_t']:.3f}, "
                f"p = {t['student_p']:.3g} (one-sided {t['student_p_a_lower']:.3g}); U p = "
                f"{t['mann_whitney_p']:.3g} (one-sided {t['mann_whitney_p_a_lower']:.3g})"
            )
    if r.get("protection_tests"):
        lines.append(
            "  is the stricter group better protected? per-model AUC over the shadow models (leave-one-out), "
            "paired; one-sided p for 'the looser group has the higher AUC':"
        )
        for t in r["protection_tests"]:
            a, b = t["mean_auc"]
            lines.append(
                f"    {t['groups'][0]:g} vs {t['groups'][1]:g}: mean AUC {_num(a)} vs {_num(b)} over "
                f"{t['models']} models; paired t = {_num(t['student_t'])}, "
                f"p = {_num(t['student_p_b_higher'], '{:.3g}')}; "
                f"Wilcoxon p = {_num(t['wilcoxon_p_b_higher'], '{:.3g}')}"
            )
    lines.append(
        f"audit: {r['files']['audit']}, {r['files']['roc']} (aggregates of membership scores: not covered "
        f"by the DP guarantees); per-example scores: {r['files']['scores']} (private)"
    )
    return "\n".join(lines)


def _one_run_text(r: dict) -> str:
    lines = [
        (
            f"idpsgd audit: one-run audit (Steinke et al. 2023) of {r['method']} on {r['dataset']} ({r['model']}); "
            f"{r['canaries_per_group']} {r['canary_kind']} canaries per group, each included with probability 1/2; "
            f"test accuracy {_num(r['target']['test_accuracy'])}"
        ),
        (
            f"{'budget':>7} {'reported eps':>12} {'canaries':>8} {'guesses':>7} {'correct':>7} "
            f"{'eps lower bound':>15} {'ceiling':>7} {'audit':>7}"
        ),
    ]
    for row in [*r["groups"], r["all"]]:
        o = row["one_run"]
        name = "all" if row["budget"] is None else f"{row['budget']:g}"
        lines.append(
            f"{name:>7} {_num(row['reported_epsilon']):>12} {row['canaries']:>8} {o['guesses']:>7} "
            f"{o['correct']:>7} {o['epsilon']:>15.3f} {o['ceiling']:>7.2f} {row['verdict']:>7}"
        )
    mult = r["multiplicity"]
    lines.append(
        f"  every bound at {_pct(mult['confidence_per_test'], 4)} (Bonferroni over the verdict's "
        f"{mult['tests']} tests: {_pct(mult['confidence'])} jointly); FAILED if a bound exceeds the reported "
        "epsilon"
    )
    lines.append(
        "  loose by design: valid for this run's mechanism, but m canaries cannot certify more than the "
        "ceiling, and a black-box score of the final model sees far less than the analysis allows"
    )
    lines.append(
        f"audit: {r['files']['audit']} (aggregates of membership scores: not covered by the DP guarantees); "
        f"per-canary scores: {r['files']['scores']} (private)"
    )
    return "\n".join(lines)
