"""Empirical lower bounds on ε from membership guesses (numpy/scipy only).

Two analyses, both for (ε, δ)-DP with respect to adding or removing one example:

* **Hypothesis-test bound** (Kairouz et al. 2015 Thm. 2.1, as used for auditing by Jagielski,
  Ullman & Oprea 2020 and Nasr et al. 2021): every test of "x is in the training set" satisfies
  TPR ≤ e^ε·FPR + δ and TNR ≤ e^ε·FNR + δ, so ε ≥ max(ln((TPR − δ)/FPR), ln((TNR − δ)/FNR)).
  :func:`epsilon_from_counts` evaluates it with the 95 % two-sided Clopper–Pearson intervals of
  TPR and FPR (the lower end of TPR, the upper end of FPR; both fail together with probability
  ≤ 5 %, so the lower bound holds with confidence ≥ 95 %).  Clopper–Pearson treats the examples
  as independent trials: exact for independent training runs, the standard approximation when
  the examples share one trained model (the one-run bound below needs no such assumption).
  The threshold must not be chosen on the counts it is evaluated on: :func:`choose_threshold`
  picks it on independent data (shadow models, or a split).

* **One-run bound** (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training
  run"): m examples are each included independently with probability 1/2 (Alg. 1), the auditor
  guesses "in" for the k+ highest scores, "out" for the k− lowest and abstains otherwise.  For an
  (ε, δ)-DP algorithm the number W of correct guesses among the r = k+ + k− made satisfies
  P[W ≥ v] ≤ f(v) + 2mδ·max_{i ≥ 1} (f(v − i) − f(v))/i with f(v) = P[Binomial(r, e^ε/(1 + e^ε)) ≥ v]
  (their main theorem; with δ = 0 it is the stochastic domination of W by that binomial).
  :func:`one_run_p_value` and :func:`one_run_epsilon` are the paper's App. D procedures
  (``p_value_DP_audit``, ``get_eps_audit``), vectorized.  The bound is loose by design: m
  guesses can certify at most about ln(m) even for a non-private algorithm
  (:func:`one_run_ceiling`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special, stats

from ..validation import InvalidParameterError, check_delta

CONFIDENCE = 0.95


def check_confidence(confidence: float) -> float:
    c = float(confidence)
    if not 0.5 <= c < 1:
        raise InvalidParameterError("confidence", confidence, "must be in [0.5, 1)")
    return c


def _counts(k, n, name: str):
    k, n = np.asarray(k), np.asarray(n)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n) or np.any(k != np.floor(k)) or np.any(n != np.floor(n)):
        raise InvalidParameterError(
            name, f"{k.tolist()} of {n.tolist()}", "counts must be integers with 0 <= k <= n, n >= 1"
        )
    return k.astype(float), n.astype(float)


def clopper_pearson(k, n, confidence: float = CONFIDENCE):
    """Two-sided Clopper–Pearson interval (lo, hi) for a binomial proportion with ``k`` successes in
    ``n`` trials (vectorized).  Each end fails with probability ≤ (1 − confidence)/2."""
    k, n = _counts(k, n, "counts")
    a = (1 - check_confidence(confidence)) / 2
    with np.errstate(invalid="ignore"):
        lo = np.where(k > 0, stats.beta.ppf(a, np.maximum(k, 1), n - k + 1), 0.0)
        hi = np.where(k < n, stats.beta.ppf(1 - a, k + 1, np.maximum(n - k, 1)), 1.0)
    return lo, hi


def _log_ratio(num, den, delta):
    """ln((num − δ)/den) where num > δ and den > 0; 0 where num ≤ δ; inf where den = 0 < num − δ."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    out = np.zeros(np.broadcast(num, den).shape)
    pos = num > delta
    with np.errstate(divide="ignore"):
        out = np.where(pos & (den > 0), np.log(np.maximum(num - delta, 1e-300)) - np.log(np.maximum(den, 1e-300)), out)
    return np.where(pos & (den <= 0), np.inf, out)


def epsilon_from_rates(tpr, fpr, delta: float):
    """max(0, ln((TPR − δ)/FPR), ln((TNR − δ)/FNR)) (vectorized; inf when a denominator is 0)."""
    tpr, fpr = np.asarray(tpr, float), np.asarray(fpr, float)
    return np.maximum(0.0, np.maximum(_log_ratio(tpr, fpr, delta), _log_ratio(1 - fpr, 1 - tpr, delta)))


def epsilon_lower_bound_counts(tp, positives, fp, negatives, delta: float, confidence: float = CONFIDENCE):
    """The ``confidence`` lower bound on ε of :func:`epsilon_from_counts` (vectorized over thresholds)."""
    tpr_lo, _ = clopper_pearson(tp, positives, confidence)
    _, fpr_hi = clopper_pearson(fp, negatives, confidence)
    # TPR ≥ tpr_lo and FPR ≤ fpr_hi  ⇒  TNR ≥ 1 − fpr_hi and FNR ≤ 1 − tpr_lo: one event, both forms
    return np.maximum(0.0, np.maximum(_log_ratio(tpr_lo, fpr_hi, delta), _log_ratio(1 - fpr_hi, 1 - tpr_lo, delta)))


def epsilon_from_counts(
    tp: int, positives: int, fp: int, negatives: int, delta: float, confidence: float = CONFIDENCE
) -> dict:
    """Empirical ε of one threshold test from its counts, with Clopper–Pearson intervals.

    Args:
        tp: members guessed "in" (true positives) out of ``positives`` members.
        fp: non-members guessed "in" (false positives) out of ``negatives`` non-members.
        delta: the δ of the guarantee under audit.

    Returns ``lower`` (the ``confidence`` lower bound on ε: what the audit states), ``estimate``
    (the point value from the observed rates), ``largest_showable`` (the value at the other ends
    of the intervals: the largest ε this test could show with these counts — not an upper bound
    on the mechanism's ε, which no audit gives; None when infinite), the intervals and the counts.
    """
    delta = check_delta(delta)
    tp, positives, fp, negatives = int(tp), int(positives), int(fp), int(negatives)
    _counts(tp, positives, "true_positives")
    _counts(fp, negatives, "false_positives")
    tpr_lo, tpr_hi = clopper_pearson(tp, positives, confidence)
    fpr_lo, fpr_hi = clopper_pearson(fp, negatives, confidence)
    lower = float(epsilon_lower_bound_counts(tp, positives, fp, negatives, delta, confidence))
    est = float(epsilon_from_rates(tp / positives, fp / negatives, delta))
    most = float(
        np.maximum(0.0, np.maximum(_log_ratio(tpr_hi, fpr_lo, delta), _log_ratio(1 - fpr_lo, 1 - tpr_hi, delta)))
    )
    return {
        "lower": lower,
        "estimate": est if math.isfinite(est) else None,
        "largest_showable": most if math.isfinite(most) else None,
        "confidence": float(confidence),
        "tpr": tp / positives,
        "tpr_interval": [float(tpr_lo), float(tpr_hi)],
        "fpr": fp / negatives,
        "fpr_interval": [float(fpr_lo), float(fpr_hi)],
        "true_positives": tp,
        "members": positives,
        "false_positives": fp,
        "non_members": negatives,
    }


def threshold_counts(scores, is_member, thresholds):
    """(true positives, false positives) of the tests "score ≥ t" for every t (vectorized)."""
    scores, is_member = np.asarray(scores, float), np.asarray(is_member, bool)
    t = np.asarray(thresholds, float)
    ins, outs = np.sort(scores[is_member]), np.sort(scores[~is_member])
    tp = ins.size - np.searchsorted(ins, t, side="left")
    fp = outs.size - np.searchsorted(outs, t, side="left")
    return tp, fp


def candidate_thresholds(scores, limit: int = 512) -> np.ndarray:
    """Up to ``limit`` distinct thresholds spread over the scores' quantiles (plus +inf: guess none)."""
    s = np.unique(np.asarray(scores, float))
    if s.size > limit:
        s = np.unique(np.quantile(s, np.linspace(0, 1, limit), method="lower"))
    return np.append(s, np.inf)


def choose_threshold(
    scores, is_member, positives: int, negatives: int, delta: float, confidence: float = CONFIDENCE
) -> float:
    """The threshold t (test "score ≥ t") with the largest expected lower bound on data of another
    size: the rates of (``scores``, ``is_member``) — *selection* data independent of the data the
    bound is evaluated on — scaled to ``positives`` members and ``negatives`` non-members.

    Ties (e.g. every expected bound 0) go to the largest TPR − FPR (Youden's J).
    """
    scores, is_member = np.asarray(scores, float), np.asarray(is_member, bool)
    if not is_member.any() or is_member.all():
        raise InvalidParameterError(
            "selection",
            f"{int(is_member.sum())} members of {is_member.size}",
            "choosing a threshold needs members and non-members",
        )
    t = candidate_thresholds(scores)
    tp, fp = threshold_counts(scores, is_member, t)
    tpr, fpr = tp / is_member.sum(), fp / (~is_member).sum()
    bound = epsilon_lower_bound_counts(
        np.rint(tpr * positives), positives, np.rint(fpr * negatives), negatives, delta, confidence
    )
    order = np.lexsort((-(tpr - fpr), -bound))  # largest bound first, then largest Youden J
    return float(t[order[0]])


# ---------------------------------------------------------------- ROC statistics


def roc(scores, is_member):
    """(fpr, tpr) of the tests "score ≥ t" over all thresholds (sklearn's ROC)."""
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(np.asarray(is_member, bool), np.asarray(scores, float))
    return fpr, tpr


def auc(scores, is_member) -> float:
    """Area under the ROC curve (ties count one half)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.asarray(is_member, bool), np.asarray(scores, float)))


def tpr_at_fpr(scores, is_member, fpr: float) -> dict:
    """The largest TPR of a test "score > t" whose FPR is at most ``fpr``, with its counts.

    ``false_positives`` ≤ ⌊fpr·non_members⌋.  When fewer than 1/fpr non-members exist the only
    admissible test has no false positive (``resolved`` is False: the rate is not measurable at
    this FPR with this many non-members).
    """
    scores, is_member = np.asarray(scores, float), np.asarray(is_member, bool)
    ins, outs = scores[is_member], np.sort(scores[~is_member])[::-1]
    allowed = math.floor(fpr * outs.size + 1e-9)
    t = outs[allowed] if allowed < outs.size else -np.inf  # guess "in" above the (allowed+1)-th highest
    tp, fp = int(np.sum(ins > t)), int(np.sum(outs > t))
    return {
        "fpr": float(fpr),
        "tpr": tp / ins.size if ins.size else float("nan"),
        "true_positives": tp,
        "false_positives": fp,
        "members": int(ins.size),
        "non_members": int(outs.size),
        "resolved": bool(outs.size * fpr >= 1),
    }


# ---------------------------------------------------------------- one-run audit (Steinke et al.)


def _one_run_args(m, r, v, delta):
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or int(x) != x or x < 0:
            raise InvalidParameterError(name, x, "must be an integer >= 0")
    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m or m < 1:
        raise InvalidParameterError("guesses", f"v={v}, r={r}, m={m}", "need 0 <= v <= r <= m and m >= 1")
    d = float(delta)
    if not 0 <= d < 1:
        raise InvalidParameterError("delta", delta, "must be in [0, 1)")
    return m, r, v, d


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[at least ``v`` of ``r`` guesses correct] under (ε, δ)-DP with ``m`` randomized examples
    (Steinke et al. 2023, main theorem; their App. D ``p_value_DP_audit``)."""
    m, r, v, delta = _one_run_args(m, r, v, delta)
    q = special.expit(float(eps))  # accuracy of ε-DP randomized response
    beta = stats.binom.sf(v - 1, r, q)  # f(v) = P[Binomial(r, q) ≥ v]
    if delta == 0 or v == 0:
        return float(min(beta, 1.0))
    i = np.arange(1, v + 1)
    partial = np.cumsum(stats.binom.pmf(v - i, r, q))  # P[v − i ≤ Binomial < v] = f(v − i) − f(v)
    alpha = float(np.max(partial / i))
    return float(min(beta + alpha * delta * 2 * m, 1.0))


def one_run_epsilon(m: int, r: int, v: int, delta: float, confidence: float = CONFIDENCE) -> float:
    """The largest ε whose (ε, δ)-DP claim the guesses reject at level 1 − ``confidence``
    (App. D ``get_eps_audit``: bisection keeping p(ε_lo) < 1 − confidence ≤ p(ε_hi)); 0 when even
    ε = 0 is not rejected."""
    m, r, v, delta = _one_run_args(m, r, v, delta)
    level = 1 - check_confidence(confidence)
    if one_run_p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < level:
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # p(ε) → P[Binomial(r, 1) ≥ v] + ... = 1 as ε → ∞: unreachable for valid input
            raise RuntimeError(f"one-run bound did not converge (m={m}, r={r}, v={v}, delta={delta})")
    for _ in range(60):
        mid = (lo + hi) / 2
        if one_run_p_value(m, r, v, mid, delta) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-7:
            break
    return lo


def one_run_guesses(scores, included, k_pos: int, k_neg: int):
    """Alg. 1's guesses: "in" for the ``k_pos`` highest scores, "out" for the ``k_neg`` lowest,
    abstain otherwise.  Returns (r guesses, v correct)."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    m = scores.size
    k_pos, k_neg = int(k_pos), int(k_neg)
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
        raise InvalidParameterError("guesses", f"k+={k_pos}, k-={k_neg}", f"need k+ + k- <= m = {m}")
    order = np.argsort(scores, kind="stable")
    v = int(included[order[m - k_pos :]].sum()) if k_pos else 0
    v += int((~included[order[:k_neg]]).sum()) if k_neg else 0
    return k_pos + k_neg, v


GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)


def one_run_audit(scores, included, delta: float, confidence: float = CONFIDENCE, fractions=GUESS_FRACTIONS) -> dict:
    """One-run lower bound for ``m`` = len(scores) randomized examples.

    The number of guesses is not chosen after looking at the result: every k+ = k− = ⌈f·m/2⌉ for
    f in ``fractions`` (the share of the m examples guessed) is evaluated at level
    (1 − confidence)/len(fractions) (Bonferroni), and the largest bound is reported — valid at
    ``confidence`` jointly.
    """
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    m = scores.size
    if m < 2:
        raise InvalidParameterError("canaries", m, "the one-run audit needs at least 2 randomized examples")
    per = 1 - (1 - check_confidence(confidence)) / len(fractions)
    rows = []
    for f in fractions:
        k = max(1, math.ceil(f * m / 2))
        r, v = one_run_guesses(scores, included, k, k)
        rows.append(
            {"share_guessed": float(f), "guesses": r, "correct": v, "epsilon": one_run_epsilon(m, r, v, delta, per)}
        )
    best = max(rows, key=lambda x: (x["epsilon"], x["guesses"]))  # ties (e.g. all 0): the most guesses
    return {
        "epsilon": best["epsilon"],
        "guesses": best["guesses"],
        "correct": best["correct"],
        "randomized": m,
        "included": int(included.sum()),
        "confidence": float(confidence),
        "ceiling": one_run_ceiling(m, delta, confidence, fractions),
        "candidates": rows,
    }


def one_run_ceiling(m: int, delta: float, confidence: float = CONFIDENCE, fractions=GUESS_FRACTIONS) -> float:
    """The largest bound :func:`one_run_audit` can return with ``m`` examples (every guess correct):
    no audit of this size can show more, whatever the algorithm."""
    per = 1 - (1 - check_confidence(confidence)) / len(fractions)
    best = 0.0
    for f in fractions:
        k = max(1, math.ceil(f * m / 2))
        best = max(best, one_run_epsilon(m, 2 * k, 2 * k, delta, per))
    return best


# ---------------------------------------------------------------- tests between groups


def compare_groups(a, b) -> dict:
    """Student's t-test (equal variances, Boenisch et al. Table 10) and the Mann–Whitney U test
    (non-parametric) of two samples of scores: two-sided p-values (``student_p``,
    ``mann_whitney_p``; the paper's form) and one-sided ones for the alternative that ``a``'s
    scores are lower (``*_p_a_lower``: with ``a`` the stricter group, "the stricter group is
    better protected")."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.size < 2 or b.size < 2:
        return {
            "student_t": None,
            "student_p": None,
            "student_p_a_lower": None,
            "mann_whitney_u": None,
            "mann_whitney_p": None,
            "mann_whitney_p_a_lower": None,
            "sizes": [int(a.size), int(b.size)],
        }
    t = stats.ttest_ind(a, b, equal_var=True)
    t_less = stats.ttest_ind(a, b, equal_var=True, alternative="less")
    u = stats.mannwhitneyu(a, b, alternative="two-sided")
    u_less = stats.mannwhitneyu(a, b, alternative="less")
    return {
        "student_t": float(t.statistic),
        "student_p": float(t.pvalue),
        "student_p_a_lower": float(t_less.pvalue),
        "mann_whitney_u": float(u.statistic),
        "mann_whitney_p": float(u.pvalue),
        "mann_whitney_p_a_lower": float(u_less.pvalue),
        "sizes": [int(a.size), int(b.size)],
    }


def compare_auc_per_model(auc_a, auc_b) -> dict:
    """Is group ``a`` (the stricter) better protected than group ``b``?  Paired over models: the
    AUC of the attack on each model, per group (``auc_a[j]``, ``auc_b[j]``; e.g. every shadow model
    as a target with leave-one-out fits), differences d_j = AUC_b − AUC_a; one-sided paired
    Student t-test and Wilcoxon signed-rank test (non-parametric) of "d > 0" (the looser group is
    more exposed).  The models share the other models' fits, so the d_j are nearly, not exactly,
    independent."""
    a, b = np.asarray(auc_a, float), np.asarray(auc_b, float)
    if a.shape != b.shape or a.ndim != 1:
        raise InvalidParameterError("auc", f"{a.shape} and {b.shape}", "need two equal-length 1-D arrays")
    d = b - a
    out = {
        "models": int(d.size),
        "mean_auc": [float(a.mean()), float(b.mean())] if d.size else [None, None],
        "mean_difference": float(d.mean()) if d.size else None,
        "student_t": None,
        "student_p_b_higher": None,
        "wilcoxon_p_b_higher": None,
    }
    if d.size >= 2 and np.ptp(d) > 0:
        t = stats.ttest_1samp(d, 0.0, alternative="greater")
        out.update(
            student_t=float(t.statistic),
            student_p_b_higher=float(t.pvalue),
            wilcoxon_p_b_higher=float(stats.wilcoxon(d, alternative="greater").pvalue),
        )
    return out
