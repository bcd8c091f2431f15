"""The audit: ε lower bounds on mechanisms with known ε, LiRA statistics, and `idpsgd audit` end to end."""

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats

from idpsgd.assignment import Budgets
from idpsgd.audit import AuditOptions, bounds, lira, run_audit
from idpsgd.audit.shadows import subset
from idpsgd.validation import InvalidParameterError
from support import file_mode

# ---------------------------------------------------------------- bounds on known mechanisms


def _randomized_response(eps, n, rng):
    member = rng.random(n) < 0.5
    truthful = rng.random(n) < 1 / (1 + math.exp(-eps))
    return member, np.where(truthful, member, ~member)


def test_clopper_pearson_matches_scipys_exact_interval():
    for k, n in [(0, 10), (3, 10), (10, 10), (17, 250), (250, 251)]:
        lo, hi = bounds.clopper_pearson(k, n, 0.95)
        ref = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
        assert lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12)
        # the closed form: beta quantiles Beta(k, n − k + 1) at 2.5 % and Beta(k + 1, n − k) at 97.5 %
        assert lo == (0.0 if k == 0 else pytest.approx(stats.beta.ppf(0.025, k, n - k + 1), rel=1e-12))
        assert hi == (1.0 if k == n else pytest.approx(stats.beta.ppf(0.975, k + 1, n - k), rel=1e-12))


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
def test_lower_bound_on_randomized_response_comes_close_to_its_epsilon(eps, rng):
    member, guess = _randomized_response(eps, 400_000, rng)
    b = bounds.epsilon_from_counts(
        int((guess & member).sum()), int(member.sum()), int((guess & ~member).sum()), int((~member).sum()), 1e-6
    )
    assert eps - 0.05 < b["lower"] <= eps <= b["largest_showable"]
    assert b["estimate"] == pytest.approx(eps, abs=0.03)


def test_lower_bound_exceeds_the_truth_in_at_most_5_percent_of_audits(rng):
    eps, trials, n = 1.0, 400, 2000
    member = rng.random((trials, n)) < 0.5
    guess = np.where(rng.random((trials, n)) < 1 / (1 + math.exp(-eps)), member, ~member)
    tp, fp = (guess & member).sum(1), (guess & ~member).sum(1)
    lower = bounds.epsilon_lower_bound_counts(tp, member.sum(1), fp, (~member).sum(1), 1e-6)
    assert np.mean(lower > eps) <= 0.05
    assert np.median(lower) > 0.6  # and it is not vacuous


def test_gaussian_mechanism_with_known_sensitivity(rng):
    """N(0, σ²) vs N(Δ, σ²) with σ from dp_accounting for (ε, δ) = (1, 1e-2): a threshold chosen on
    selection samples, evaluated on fresh ones, gives a lower bound just under 1."""
    import dp_accounting

    eps, delta = 1.0, 1e-2
    mu = 1.0 / dp_accounting.get_sigma_gaussian(eps, delta)  # sensitivity 1

    def draw(n):
        member = rng.random(n) < 0.5
        return rng.normal(size=n) + mu * member, member

    sel_s, sel_in = draw(400_000)
    s, member = draw(2_000_000)
    t = bounds.choose_threshold(sel_s, sel_in, int(member.sum()), int((~member).sum()), delta)
    assert t == pytest.approx(eps / mu + mu / 2, abs=0.3)  # the optimal test of the privacy profile
    tp, fp = bounds.threshold_counts(s, member, [t])
    b = bounds.epsilon_from_counts(int(tp[0]), int(member.sum()), int(fp[0]), int((~member).sum()), delta)
    assert eps - 0.1 < b["lower"] <= eps


def test_tpr_at_fpr_counts():
    member = np.array([1, 1, 1, 0, 0, 0, 0, 0], bool)
    scores = np.array([9, 8, 1, 7, 2, 2, 0, -1], float)
    r = bounds.tpr_at_fpr(scores, member, 0.2)  # ⌊0.2·5⌋ = 1 false positive allowed
    assert (r["true_positives"], r["false_positives"], r["tpr"], r["resolved"]) == (2, 1, 2 / 3, True)
    r = bounds.tpr_at_fpr(scores, member, 0.01)  # none allowed: test "score > 7"
    assert (r["true_positives"], r["false_positives"], r["resolved"]) == (2, 0, False)


def test_auc_and_tests_between_groups(rng):
    a, b = rng.normal(size=500), rng.normal(0.3, 1, size=600)
    r = bounds.compare_groups(a, b)
    assert r["student_p"] == pytest.approx(stats.ttest_ind(a, b).pvalue)
    assert r["student_p"] < 1e-3 and r["mann_whitney_p"] < 1e-3
    # one-sided: "a scores lower" (a: the stricter group), against scipy's own one-sided tests
    assert r["student_p_a_lower"] == pytest.approx(stats.ttest_ind(a, b, alternative="less").pvalue)
    assert r["mann_whitney_p_a_lower"] == pytest.approx(stats.mannwhitneyu(a, b, alternative="less").pvalue)
    assert r["student_p_a_lower"] == pytest.approx(r["student_p"] / 2) and r["mann_whitney_p_a_lower"] < 1e-3
    assert bounds.compare_groups(b, a)["student_p_a_lower"] > 0.99
    assert bounds.auc(np.r_[a, b], np.r_[np.zeros(500), np.ones(600)]) == pytest.approx(
        stats.mannwhitneyu(b, a).statistic / (500 * 600)
    )


def test_per_model_auc_comparison(rng):
    """The paired protection test against scipy's one-sided paired tests."""
    a = 0.50 + 0.01 * rng.normal(size=30)
    b = a + 0.02 + 0.01 * rng.normal(size=30)
    r = bounds.compare_auc_per_model(a, b)
    assert r["student_p_b_higher"] == pytest.approx(stats.ttest_rel(b, a, alternative="greater").pvalue)
    assert r["wilcoxon_p_b_higher"] == pytest.approx(stats.wilcoxon(b - a, alternative="greater").pvalue)
    assert r["student_p_b_higher"] < 1e-3 and r["mean_difference"] == pytest.approx(np.mean(b - a))
    assert bounds.compare_auc_per_model(b, a)["student_p_b_higher"] > 0.99


# ---------------------------------------------------------------- one-run bound (Steinke et al.)


def _p_value_reference(m, r, v, eps, delta):
    """Steinke et al. App. D `p_value_DP_audit`, written as a plain loop."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        alpha = max(alpha, total / i)
    return min(beta + alpha * delta * 2 * m, 1)


def test_one_run_p_value_matches_the_papers_procedure():
    for m, r, v, eps, delta in [
        (1000, 100, 75, 0.5, 1e-4),
        (200, 40, 40, 2.0, 1e-5),
        (50, 10, 3, 0.1, 0.0),
        (10_000, 600, 420, 0.8, 1e-6),
    ]:
        assert bounds.one_run_p_value(m, r, v, eps, delta) == pytest.approx(
            _p_value_reference(m, r, v, eps, delta), rel=1e-10, abs=1e-15
        )


def test_one_run_bound_reproduces_the_papers_printed_values():
    # App. D's worked example (m = 1000, r = 100, v = 75, δ = 1e-4, 95 %) and §7 (Fig. 11) of arXiv:2305.08846v1
    assert bounds.one_run_epsilon(1000, 100, 75, 1e-4, 0.95) == pytest.approx(0.673, abs=1e-3)
    assert bounds.one_run_epsilon(100_000, 1510, 1439, 1e-5, 0.95) == pytest.approx(2.675, abs=1e-3)


def test_one_run_bound_on_randomized_response(rng):
    eps, m = 1.0, 20_000
    member, guess = _randomized_response(eps, m, rng)
    score = guess + 1e-3 * rng.random(m)  # guess "in" for the top k: the RR answer, ties at random
    r = bounds.one_run_audit(score, member, delta=1e-6)
    assert 0.8 < r["epsilon"] <= eps
    assert r["ceiling"] > r["epsilon"]
    assert bounds.one_run_audit(rng.random(m), member, 1e-6)["epsilon"] < 0.15  # no information: ~0


def test_one_run_bound_is_monotone():
    """More correct guesses: a larger bound; a larger δ or a higher confidence: a smaller one; the
    p-value grows with the ε under test (what the bisection relies on)."""
    eps_v = [bounds.one_run_epsilon(1000, 100, v, 1e-4) for v in range(50, 101, 5)]
    assert eps_v[0] == 0.0 and all(x < y for x, y in itertools.pairwise(eps_v[1:]))
    eps_d = [bounds.one_run_epsilon(1000, 100, 80, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
    assert all(x >= y for x, y in itertools.pairwise(eps_d)) and eps_d[0] > eps_d[-1]
    assert bounds.one_run_epsilon(1000, 100, 80, 1e-4, 0.99) < bounds.one_run_epsilon(1000, 100, 80, 1e-4, 0.9)
    p = [bounds.one_run_p_value(1000, 100, 80, e, 1e-4) for e in np.linspace(0, 3, 31)]
    assert all(x <= y for x, y in itertools.pairwise(p))
    # with δ = 0 the bound solves P[Binomial(r, e^ε/(1 + e^ε)) ≥ v] = 5 % (the binomial tail, closed form)
    e0 = bounds.one_run_epsilon(1000, 100, 80, 0.0)
    assert stats.binom.sf(79, 100, 1 / (1 + math.exp(-e0))) == pytest.approx(0.05, rel=1e-5)


def test_one_run_ceiling_grows_with_the_number_of_canaries():
    c = [bounds.one_run_ceiling(m, 1e-5) for m in (20, 100, 1000)]
    assert c[0] < c[1] < c[2] < math.log(1000) + 1


# ---------------------------------------------------------------- LiRA statistics


def test_logit_confidence_is_stable_and_correct():
    z = np.array([[2.0, 0.5, -1.0], [40.0, -40.0, 0.0]])
    y = np.array([1, 0])
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    phi = lira.logit_confidence(z, y)
    assert phi[0] == pytest.approx(math.log(p[0, 1] / (1 - p[0, 1])))
    assert np.isfinite(phi[1]) and phi[1] == pytest.approx(40.0, abs=1e-6)  # p = 1 - 4e-18: no log(0)


def test_shadow_design_puts_every_example_in_half_of_the_models(rng):
    d = lira.shadow_design(7, 1000, rng)
    assert (d.sum(0) == 3).all() and abs(d.sum(1).mean() - 1000 * 3 / 7) < 1e-9


def _synthetic(rng, m=8, n=3000, effect=1.0):
    difficulty = rng.normal(0, 2, n)
    design = lira.shadow_design(m, n, rng)
    shadow_phi = difficulty + effect * design + rng.normal(0, 1, (m, n))
    target_in = rng.random(n) < 0.5
    target_phi = difficulty + effect * target_in + rng.normal(0, 1, n)
    return design, shadow_phi, target_in, target_phi


@pytest.mark.parametrize("variance", ["fixed", "per-example"])
def test_lira_recovers_the_membership_signal(rng, variance):
    design, shadow_phi, target_in, target_phi = _synthetic(rng, m=16)
    s = lira.attack_scores(target_phi, -target_phi, shadow_phi, design, variance)
    # difficulty-calibrated LiRA beats the uncalibrated loss threshold (AUC Φ(1/√10) = 0.62 here) and comes
    # within the error of 8 + 8 estimates per example of the optimum Φ(1/√2) = 0.76 (known difficulty);
    # per-example variances from 8 values are noisier (Carlini et al.: fixed variance for few shadows)
    auc = bounds.auc(s["lira-online"], target_in)
    assert {"fixed": 0.71, "per-example": 0.68}[variance] < auc < stats.norm.cdf(1 / math.sqrt(2)) + 0.02
    assert auc > bounds.auc(s["loss"], target_in) + 0.05
    assert bounds.auc(s["lira-offline"], target_in) > 0.65
    design0, shadow_phi0, target_in0, target_phi0 = _synthetic(rng, effect=0.0)
    s0 = lira.attack_scores(target_phi0, -target_phi0, shadow_phi0, design0, variance)
    assert abs(bounds.auc(s0["lira-online"], target_in0) - 0.5) < 0.04


def test_leave_one_out_fits_equal_refitting_without_the_models(rng):
    design, shadow_phi, _, _ = _synthetic(rng, m=8, n=200)
    for variance in ("fixed", "per-example"):
        loo = lira.fit_gaussians_leave_one_out(shadow_phi, design, variance)
        for j in (0, 5):
            keep = np.arange(8) != j
            ref = lira.fit_gaussians(shadow_phi[keep], design[keep], variance)
            for f in ("mu_in", "mu_out") + (("sd_in", "sd_out") if variance == "per-example" else ()):
                np.testing.assert_allclose(getattr(loo, f)[j], getattr(ref, f), rtol=1e-9)
        if variance == "fixed":  # the global variances of all the shadows
            full = lira.fit_gaussians(shadow_phi, design, "fixed")
            assert (loo.sd_in == full.sd_in).all() and (loo.sd_out == full.sd_out).all()
    partners = lira.leave_one_out_partners(design, rng)
    assert (design[partners, np.arange(200)] != design).all()  # the other side: counts balanced
    loo = lira.fit_gaussians_leave_one_out(shadow_phi, design, "per-example", partners)
    for j, i in [(0, 3), (2, 17), (7, 199)]:
        keep = ~np.isin(np.arange(8), [j, partners[j, i]])
        ref = lira.fit_gaussians(shadow_phi[keep][:, [i]], design[keep][:, [i]], "per-example")
        for f in ("mu_in", "sd_in", "mu_out", "sd_out"):
            assert getattr(loo, f)[j, i] == pytest.approx(getattr(ref, f)[0], rel=1e-9)
        assert design[keep, i].sum() == 3 and (~design[keep, i]).sum() == 3


def test_balanced_leave_one_out_scores_are_distributed_like_the_targets(rng):
    """Without partners, a shadow's members have one in-model fewer than its non-members, which
    lowers their online scores (AUC below 0.5 with no signal at all); with them, no bias."""
    m, n = 16, 4000
    design = lira.shadow_design(m, n, rng)
    phi = rng.normal(0, 2, n) + rng.normal(0, 0.5, (m, 1)) + rng.normal(0, 1, (m, n))  # no membership effect
    naive = lira.lira_scores(phi, lira.fit_gaussians_leave_one_out(phi, design, "fixed"))
    fair = lira.leave_one_out_scores(phi, -phi, design, "fixed", rng)["lira-online"]

    def auc(s):
        return np.mean([bounds.auc(s[j], design[j]) for j in range(m)])

    assert auc(naive) < 0.495 and abs(auc(fair) - 0.5) < 0.004


def test_lira_refuses_too_few_shadow_models():
    for m, variance in [(1, "fixed"), (3, "fixed"), (5, "per-example")]:
        with pytest.raises(InvalidParameterError, match="shadow_models"):
            lira.check_lira("online", variance, m)
    lira.check_lira("online", "fixed", 4)


# ---------------------------------------------------------------- run_audit end to end (fast)


@pytest.fixture(scope="module")
def small():
    from idpsgd.data import load_dataset

    data = subset(load_dataset("digits"), np.arange(240))
    return data, Budgets.from_groups([1.0, 8.0], [0.5, 0.5], 240, 1e-5, seed=0)


def _config(**kw):
    from idpsgd.training import TrainConfig

    return TrainConfig(**{"method": "sample", "epochs": 1, "batch_size": 32, "seed": 5, "progress": False, **kw})


def _pdp(**kw):
    from idpsgd.training.pdp import PdpOptions

    return PdpOptions(**kw)


def test_lira_audit_writes_private_outputs_and_resumes_without_retraining(small, tmp_path, monkeypatch):
    from idpsgd.audit import runner

    data, budgets = small
    calls = []
    real = runner.train_model

    def counting(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # an interrupted audit: two shadows are finished
        return real(*a, **k)

    monkeypatch.setattr(runner, "train_model", counting)
    opts = AuditOptions(shadow_models=4)
    with pytest.raises(KeyboardInterrupt):
        run_audit(data, budgets, _config(), tmp_path / "a", opts)
    calls.clear()
    monkeypatch.setattr(runner, "train_model", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    r = run_audit(data, budgets, _config(), tmp_path / "a", opts, resume=True)
    assert len(calls) == 3  # shadows 2, 3 and the target; not 0 and 1 again
    folder, private = tmp_path / "a", tmp_path / "a" / "private"
    for name in (
        "audit_scores.csv",
        "audit_settings.json",
        "models/shadow_000.pt",
        "models/target.pt",
        "audit.json",
        "roc_by_group.png",
    ):
        assert file_mode(private / name) == 0o600  # per-example scores, models, the results: private
    assert file_mode(folder / "audit.json") == 0o644 and not (folder / "roc_by_group.png").exists()
    manifest = json.loads((folder / "outputs.json").read_text())["files"]
    assert manifest["audit.json"]["kind"] == "public" and manifest["private/audit_scores.csv"]["kind"] == "private"
    assert manifest["private/audit.json"]["kind"] == "private"
    assert (private / "roc_by_group.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((private / "audit.json").read_text())
    assert saved["groups"] == r["groups"] and "do not cover" in saved["disclosure"] and "private" not in saved
    assert saved["audit_passed"] is True and saved["failed_groups"] == []
    # the public audit.json: settings, plan, group sizes and reported epsilon; no membership statistic
    public = json.loads((folder / "audit.json").read_text())
    assert public["results"] == "private/audit.json" and public["neighbouring"] == "zero-out"
    assert [set(g) for g in public["groups"]] == [{"budget", "examples", "reported_epsilon", "delta"}] * 2
    assert not {"all", "tests", "audit_passed", "failed_groups"} & set(public)
    assert set(public["target"]) == {"test_accuracy", "noise_multiplier"} and public["plan"] == r["plan"]
    g = {row["budget"]: row for row in r["groups"]}
    assert set(g) == {1.0, 8.0} and r["all"]["examples"] == 240
    for row in g.values():
        assert row["reported_epsilon"] <= row["budget"] + 1e-9
        assert set(row["attacks"]) == {"lira-online", "lira-offline", "loss"}
        a = row["attacks"]["lira-online"]
        assert 0 <= a["auc"] <= 1 and [t["fpr"] for t in a["tpr_at_fpr"]] == [0.01, 0.001]
        b = a["epsilon_lower_bound"]
        assert b["true_positives"] <= b["members"] == row["members"]
        assert row["verdict"] in ("passed", "FAILED")
    assert {(t["population"], tuple(t["groups"])) for t in r["tests"]} == {
        ("all examples", (1.0, 8.0)),
        ("members", (1.0, 8.0)),
    }
    (p,) = r["protection_tests"]
    assert p["groups"] == [1.0, 8.0] and p["models"] == 4 and 0 <= p["student_p_b_higher"] <= 1
    header = (private / "audit_scores.csv").read_text().splitlines()[0].split(",")
    assert header == [
        "index",
        "label",
        "budget",
        "target_member",
        "lira_online_score",
        "lira_offline_score",
        "loss_score",
        "phi",
    ]
    _check_one_plan(private, r, budgets)
    # the verdict is corrected for its 6 tests (2 groups + all data, each Clopper-Pearson and one-run)
    assert r["multiplicity"]["tests"] == 6 and r["multiplicity"]["confidence_per_test"] == pytest.approx(1 - 0.05 / 6)
    for row in [*r["groups"], r["all"]]:
        a = row["attacks"]["lira-online"]
        assert a["epsilon_lower_bound"]["confidence"] == pytest.approx(1 - 0.05 / 6)
        o = a["one_run_bound"]
        assert o["confidence"] == pytest.approx(1 - 0.05 / 6) and o["randomized"] == row["examples"]
        assert 0 <= o["epsilon"] <= o["ceiling"] and o["included"] == row["members"]
    from idpsgd.audit.report import audit_text

    text = audit_text(r)
    assert "eps lower" in text and "test max" in text and "one-run" in text and "CI" not in text
    assert "every bound at 99.17% (Bonferroni over the verdict's 6 tests: 95% jointly)" in text
    # a finished audit resumes from its models alone, to the same result
    calls.clear()
    again = run_audit(data, budgets, _config(), tmp_path / "a", AuditOptions(shadow_models=4), resume=True)
    assert calls == [] and again["groups"] == r["groups"]
    # other settings on --resume: refused, naming what differs
    with pytest.raises(InvalidParameterError, match="shadow_models: 4 -> 6"):
        run_audit(data, budgets, _config(), tmp_path / "a", AuditOptions(shadow_models=6), resume=True)
    with pytest.raises(InvalidParameterError, match="epochs: 1 -> 2"):
        run_audit(data, budgets, _config(epochs=2), tmp_path / "a", opts, resume=True)
    with pytest.raises(InvalidParameterError, match="already holds files"):
        run_audit(data, budgets, _config(), tmp_path / "a", opts)


def _check_one_plan(private, r, budgets):
    """Every model of the audit (shadows of different sizes and the target) ran the one plan: the
    same steps and σ, and each group's reported ε is the accountant's ε of the plan's (q_p, σ_p, T),
    within its budget (issue 25: per-subset calibration split the models into two step counts)."""
    from idpsgd.accounting import epsilon_sgm
    from idpsgd.io import load_torch

    models = [load_torch(q, "audit model") for q in sorted((private / "models").glob("*.pt"))]
    assert len({int(np.asarray(m["members"]).sum()) for m in models}) > 1  # subsets of different sizes
    plan = r["plan"]
    assert {m["report"]["steps"] for m in models} == {plan["steps"]}
    assert {m["report"]["noise_multiplier"] for m in models} == {plan["noise_multiplier"]}
    by_budget = {g["budget"]: g for g in plan["groups"]}
    for m in models:
        for g in m["report"]["groups"]:
            p = by_budget[g["budget"]]
            eps = float(epsilon_sgm(p["sample_rate"], p["noise_multiplier"], plan["steps"], budgets.delta, "rdp"))
            assert g["epsilon_spent"] == pytest.approx(eps, rel=1e-6) and eps <= g["budget"] * (1 + 1e-9)


def test_pdp_audit_models_run_one_round_plan(small, tmp_path):
    """PDP-SGD: every model runs the rounds planned once for the expected half (τ_R, q_R, steps,
    σ_R), whatever its subset; each model's (Φ, Δ)-PDP guarantee stays within its budgets."""
    from idpsgd.io import load_torch
    from idpsgd.training.pdp import PdpOptions

    data, _ = small
    budgets = Budgets.from_groups([1.0, 2.0, 3.0], [0.34, 0.43, 0.23], 240, 1e-5, seed=0)  # two rounds
    r = run_audit(
        data,
        budgets,
        _config(method="pdp-sgd"),
        tmp_path / "p",
        AuditOptions(shadow_models=4),
        pdp=PdpOptions(rounds=2),
    )
    plan = r["plan"]
    assert len(plan["rounds"]) == 2 and plan["steps"] == sum(x["steps"] for x in plan["rounds"])
    models = [load_torch(q, "audit model") for q in sorted((tmp_path / "p" / "private" / "models").glob("*.pt"))]
    assert len(models) == 5 and len({int(np.asarray(m["members"]).sum()) for m in models}) > 1
    assert {m["report"]["steps"] for m in models} == {plan["steps"]}
    assert {tuple(m["report"]["noise_multiplier"]) for m in models} == {tuple(plan["noise_multiplier"])}
    for m in models:
        assert all(g["epsilon_spent"] <= g["budget"] * (1 + 1e-9) for g in m["report"]["groups"])


def test_verdict_tests_and_their_level():
    from idpsgd.audit.runner import per_test_confidence, verdict_tests

    assert [verdict_tests(1, 2), verdict_tests(2, 2), verdict_tests(5, 1)] == [2, 6, 6]
    assert per_test_confidence(0.95, 6) == pytest.approx(1 - 0.05 / 6)


def test_a_failed_calibration_leaves_no_audit_folder(small, tmp_path):
    """The one plan is calibrated before the folder is made: an unreachable budget is refused,
    naming it, and leaves nothing behind (a half-made folder would refuse the corrected re-run)."""
    from idpsgd.validation import UnreachableTargetError

    data, _ = small
    for attack in ("lira", "one-run"):
        tiny = Budgets.from_groups([1e-3, 8.0], [0.5, 0.5], 240, 1e-5, seed=0)
        opts = AuditOptions(attack=attack, **({"canaries": 10} if attack == "one-run" else {}))
        with pytest.raises(UnreachableTargetError, match="budgets=0.001 "):
            run_audit(data, tiny, _config(), tmp_path / "c", opts)
        assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("method", ["sample", "uniform"])
def test_loss_audit_trains_only_the_target(small, tmp_path, method):
    data, budgets = small
    r = run_audit(data, budgets, _config(method=method), tmp_path / "l", AuditOptions(attack="loss"))
    assert r["method"] == method
    assert r["shadow_models"] == 0 and r["primary_attack"] == "loss"
    assert sorted(p.name for p in (tmp_path / "l" / "private" / "models").iterdir()) == ["target.pt"]
    assert not (tmp_path / "l" / "private" / "scratch").exists() or not any(
        (tmp_path / "l" / "private" / "scratch").iterdir()
    )
    assert "half" in r["threshold_selection"]
    assert all(set(row["attacks"]) == {"loss"} for row in r["groups"])


@pytest.mark.parametrize("method", ["sample", "pdp-sgd"])
def test_one_run_audit(small, tmp_path, method):
    data, budgets = small
    from idpsgd.training.pdp import PdpOptions

    pdp = PdpOptions(rounds=2) if method == "pdp-sgd" else None
    r = run_audit(
        data, budgets, _config(method=method), tmp_path / method, AuditOptions(attack="one-run", canaries=30), pdp=pdp
    )
    assert r["target"]["examples"] == 240 - 60 + r["target"]["canaries_included"]
    for row in r["groups"]:
        o = row["one_run"]
        assert row["canaries"] == 30 and o["randomized"] == 30 and 0 <= o["epsilon"] <= o["ceiling"]
        assert row["reported_epsilon"] <= row["budget"] + 1e-9 and row["verdict"] == "passed"
    assert "loose by design" in r["note"]
    header = (tmp_path / method / "private" / "audit_scores.csv").read_text().splitlines()
    assert header[0] == "index,label,canary_label,budget,included,score" and len(header) == 61


def test_attack_sees_an_overfit_model_and_not_a_tiny_epsilon_one(tmp_path):
    """The loss attack on 200 digits: a practically non-private model (ε = 1e5: σ ≈ 0.02, clip 20,
    40 epochs) overfits and leaks membership (AUC clearly above 1/2), a model at ε = 0.05 does not
    (AUC within the ±0.1 of chance that 100 + 100 examples allow), and neither bound exceeds its ε."""
    from idpsgd.data import load_dataset

    data = subset(load_dataset("digits"), np.arange(200))
    auc = {}
    for eps, epochs in [(1e5, 40), (0.05, 10)]:
        budgets = Budgets.from_groups([eps], [1.0], 200, 1e-5, seed=0)
        r = run_audit(
            data,
            budgets,
            _config(epochs=epochs, batch_size=25, lr=0.1, clip_norm=20.0, seed=1),
            tmp_path / f"e{eps:g}",
            AuditOptions(attack="loss"),
        )
        a = r["all"]["attacks"]["loss"]
        auc[eps] = a["auc"]
        assert a["epsilon_lower_bound"]["lower"] <= r["all"]["reported_epsilon"] and r["audit_passed"]
    assert auc[1e5] > 0.62
    assert abs(auc[0.05] - 0.5) < 0.1


def test_failed_audit_is_flagged_loudly(small, tmp_path, monkeypatch, caplog):
    """A reported ε below what the attack shows (here: the report is forged to claim ε = 1e-3 on an
    overfit target) fails the audit: verdict FAILED, audit_passed false, an error in the log and a
    banner in the text."""
    from idpsgd.audit import runner
    from idpsgd.audit.report import audit_text

    data, budgets = small
    real = runner.reported_guarantees
    monkeypatch.setattr(runner, "reported_guarantees", lambda rep: {b: (1e-3, d) for b, (e, d) in real(rep).items()})
    monkeypatch.setattr(
        bounds, "epsilon_lower_bound_counts", lambda *a, **k: np.full(np.shape(a[0]), 0.5)
    )  # the bound the test is given
    r = run_audit(data, budgets, _config(), tmp_path / "f", AuditOptions(attack="loss"))
    assert not r["audit_passed"] and set(r["failed_groups"]) == {1.0, 8.0, None}
    assert all(row["verdict"] == "FAILED" and "clopper-pearson" in row["failed_by"] for row in r["groups"])
    assert "AUDIT FAILED" in caplog.text
    assert audit_text(r).startswith("AUDIT FAILED")


def test_bad_input_is_refused_with_one_line(small, tmp_path):
    data, budgets = small
    cases = [
        ({"options": AuditOptions(shadow_models=1)}, "shadow_models=1"),
        ({"options": AuditOptions(attack="one-run", canaries=121)}, "canaries=121 is invalid: must be at most 120"),
        ({"options": AuditOptions(attack="loss", shadow_models=4)}, "only used with --attack lira"),
        ({"options": AuditOptions(attack="lira", canaries=4)}, "only used with --attack one-run"),
        ({"config": _config(method="adapdp")}, "ensemble"),
        ({"config": _config(method="exclude")}, "the audit supports uniform, sample, scale, pdp-sgd"),
        ({"options": AuditOptions(attack="membership")}, "attack='membership' is invalid: must be one of lira, loss"),
        ({"options": AuditOptions(fprs=(0.01, 1.0))}, "fpr=1.0 is invalid: must be in \\(0, 1\\)"),
        ({"options": AuditOptions(fprs=(0.0,))}, "fpr=0.0 is invalid"),
        ({"options": AuditOptions(fprs=())}, "fpr="),
        ({"options": AuditOptions(confidence=1.0)}, "confidence=1.0"),
        ({"config": _config(batch_size=121)}, "batch_size=121 is invalid: must be <= 120, the expected number"),
        ({"config": _config(secure_mode=True)}, "seed=5 is invalid: must not be given in secure mode"),
        ({"pdp": _pdp()}, "PDP options apply to --method pdp-sgd"),
    ]
    for kw, message in cases:
        with pytest.raises(InvalidParameterError, match=message) as exc:
            run_audit(
                data, budgets, kw.get("config", _config()), tmp_path / "bad", kw.get("options"), pdp=kw.get("pdp")
            )
        assert "\n" not in str(exc.value)
    other = tmp_path / "train_run"
    other.mkdir()
    (other / "report.json").write_text("{}")
    with pytest.raises(InvalidParameterError, match="holds no audit"):
        run_audit(data, budgets, _config(), other, AuditOptions(shadow_models=4), resume=True)


def test_cli_audit(capsys, tmp_path):
    from idpsgd.cli.main import main

    assert (
        main(
            ["audit", "--method", "adapdp", "--budgets", "1,2", "--fractions", "0.5,0.5", "--out", str(tmp_path / "x")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("idpsgd audit: error: --method=") and err.count("\n") == 1
    base = ["audit", "--method", "sample", "--budgets", "1,3", "--fractions", "0.5,0.5", "--out", str(tmp_path / "b")]
    for extra, message in [
        (["--fpr", "1.5"], "--fpr=1.5 is invalid"),
        (["--fpr", "x"], "--fpr='x' is invalid"),
        (["--shadow-models", "1"], "--shadow-models=1 is invalid"),
        (["--rounds", "5"], "--rounds=5 is invalid: only applies to --method pdp-sgd"),
        (["--secure-mode", "--seed", "1"], "--seed=1 is invalid: must not be given in secure mode"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"idpsgd audit: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "b").exists()  # refused before any folder is made
    argv = [
        "audit",
        "--method",
        "scale",
        "--budgets",
        "1,3",
        "--fractions",
        "0.5,0.5",
        "--attack",
        "one-run",
        "--canaries",
        "10",
        "--epochs",
        "1",
        "--seed",
        "0",
        "--out",
        str(tmp_path / "o"),
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out  # by default: the plan and where the (private) results are
    assert "one-run audit (Steinke et al. 2023)" not in out and "private/audit.json (mode 0600)" in out
    assert main([*argv[:-3], "--out", str(tmp_path / "o"), "--resume", "--show-private"]) == 0
    out = capsys.readouterr().out
    assert "one-run audit (Steinke et al. 2023)" in out and "loose by design" in out
    assert main([*argv[:-3], "--out", str(tmp_path / "o"), "--resume", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [g["budget"] for g in r["groups"]] == [1.0, 3.0] and r["canaries_per_group"] == 10
    assert "private" not in r and "all" not in r and "attacks" not in r["groups"][0]
    # resuming without --seed reads the audit's recorded seed (same budgets' assignment, same design)
    assert main([*argv[:-5], "--out", str(tmp_path / "o"), "--no-progress", "--resume", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == r["groups"]


def test_secure_mode_audit_runs_without_a_seed(small, tmp_path):
    """Secure mode: no seed is accepted; the models train with OS-entropy sampling and noise, the
    design's seed (the auditor's randomness) is drawn fresh and recorded privately for --resume."""
    data, budgets = small
    r = run_audit(
        data, budgets, _config(seed=None, secure_mode=True), tmp_path / "s", AuditOptions(attack="one-run", canaries=10)
    )
    settings = json.loads((tmp_path / "s" / "private" / "audit_settings.json").read_text())
    assert settings["config"]["secure_mode"] is True and r["private"]["seed"] == settings["seed"]
    assert "seed" not in json.loads((tmp_path / "s" / "audit.json").read_text())
    assert all(row["verdict"] == "passed" for row in r["groups"])


# ---------------------------------------------------------------- the measured claim (slow)


@pytest.mark.slow
def test_weak_group_leaks_more_and_no_bound_exceeds_its_epsilon(tmp_path):
    """The README's power recipe: digits, Sample with budgets 1 and 32 (a deliberately weak group),
    lr 0.1, 40 epochs (otherwise the train defaults: B = 128, clip 1), 16 shadow models (about 100 s
    of CPU).  The weak group is the more exposed one (LiRA's AUC on every shadow model as a target,
    paired over the models, one-sided t and Wilcoxon tests; measured 0.566 vs 0.506, t = 11.6), every
    model ran the one plan, and no attack's lower bound exceeds a group's reported ε.  (At the train
    defaults the difference is about 0.02 in AUC: p = 0.025 with 16 shadows, README.)"""
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig

    data = load_dataset("digits")
    budgets = Budgets.from_groups([1.0, 32.0], [0.5, 0.5], len(data.y_train), 1e-5, seed=0)
    r = run_audit(
        data,
        budgets,
        TrainConfig(method="sample", seed=0, lr=0.1, epochs=40, progress=False),
        tmp_path / "w",
        AuditOptions(shadow_models=16),
    )
    (p,) = r["protection_tests"]
    assert p["groups"] == [1.0, 32.0] and p["mean_auc"][1] > p["mean_auc"][0] + 0.03, p
    assert p["student_p_b_higher"] < 1e-3 and p["wilcoxon_p_b_higher"] < 1e-3, p
    weak, strict = (next(g for g in r["groups"] if g["budget"] == b)["attacks"]["lira-online"] for b in (32.0, 1.0))
    assert weak["auc_leave_one_out"] > strict["auc_leave_one_out"] + 0.03
    assert r["audit_passed"]
    _check_one_plan(tmp_path / "w" / "private", r, budgets)
    for row in [*r["groups"], r["all"]]:
        for a in row["attacks"].values():
            assert a["epsilon_lower_bound"]["lower"] <= row["reported_epsilon"]
        assert row["attacks"]["lira-online"]["one_run_bound"]["epsilon"] <= row["reported_epsilon"]
