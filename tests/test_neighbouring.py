"""Every command on neighbouring data sets (issue 35): only what the guarantee covers may differ.

Each command runs on D and on D′ = D without one row (an outlier: a unique label, features far from
every other row; for text a unique token and a unique length), with the same seed, not in secure
mode; every public output is compared field by field (:mod:`neighbouring`).  The guarantee's
neighbouring relation is zero-out (docs/guarantees.md, "Neighbouring data sets"): N and the budget
groups' sizes are public inputs, so they and what is computed from them alone may differ here as
well.  Every allow-list entry names its fields and carries its reason; anything else that differs —
a config field, a label map, a count, a vocabulary, a maximum length, a digest — fails the test
with the file and the field.
"""

from __future__ import annotations

import json

import pytest

from neighbouring import (
    PUBLIC_N,
    TEST,
    TIME,
    WEIGHTS,
    Allow,
    Outputs,
    assert_same_public_outputs,
    collect,
    csv_pair,
    differences,
    fields_matching,
    mnist_pair,
    run_cli,
)

RELEASED = (
    "a privately released statistic: its (epsilon_r, delta_r) is stated in the report and charged to "
    "every example (noise from OS entropy), or post-processing of such statistics"
)
LOAD = "the machine's load average around a timing: a measurement of the machine, not of the data"
FAST = ["--epochs", "1", "--no-progress", "--batch-size", "32", "--seed", "7"]
BUDGETS = ["--budgets", "1,2,3", "--fractions", "0.34,0.43,0.23"]
NUM_CLASSES = ["--num-classes", "4"]  # the label set is public: given, never read from the rows
JSON = ("*report.json", "stdout --json")  # the run's report, as written and as printed


def _both(field: str, reason: str, files=JSON) -> list[Allow]:
    return [Allow(f, field, reason) for f in files]


def _line(template: str, numbers: str, reason: str, files=("stdout",)) -> list[Allow]:
    """Numbers ``numbers`` (a regex over their index) of the text lines whose template (numbers
    replaced by ``#``) matches ``template``."""
    return [Allow(f, rf"'{template}'\[\d+\] #(?:{numbers})", reason) for f in files]


# --- the allow-list of a training run folder (train, PDP, demo's runs, finetune) ---------------
GROUP_N = (
    r"groups/\d+/(count|examples|sample_rate|noise_multiplier|clip_norm|epsilon_spent|epsilon_training|"
    r"epsilon_rdp|steps)"
)
RUN = [
    Allow("*model.pt", r".*:float-values", WEIGHTS),
    *_both(r"test_accuracy|per_class_accuracy/\d+|history/\d+/test_accuracy", TEST),
    *_both(r"rounds/\d+/test_accuracy_round_model", TEST),
    *_both(GROUP_N, PUBLIC_N),
    *_both(
        r"noise_multiplier(/\d+)?|steps|planned_steps|phases/\d+/(examples|sample_rate|noise_multiplier|steps)",
        PUBLIC_N,
    ),
    *_both(r"rounds/\d+/(epsilon_round|expected_sample_size|noise_multiplier|sample_rate|steps)", PUBLIC_N),
    *_both(r"individual_privacy/examples", PUBLIC_N),
    *_both(
        r"individual_privacy/released/(mean/(value|noisy_sum|noisy_count|noise_std)|quantiles/values/[\d.]+)", RELEASED
    ),
    *_both(r"wall_seconds", TIME),
    # report.html: rendered from report.json
    Allow(
        "*report.html",
        r"Guarantee > table 0 > row \d+ > (examples|sampling rate|clip norm|effective σ|ε spent|in words)",
        PUBLIC_N,
    ),
    Allow("*report.html", r"\(top\) > <p> 'model .*'\[0\] #\d+", PUBLIC_N),  # "T steps of T planned"
    Allow(
        "*report.html",
        r"Privacy ledger and training curve > image 0 .*",
        PUBLIC_N + " (the ledger figure: each group's epsilon after each step, from q, sigma and the steps)",
    ),
    Allow("*report.html", r"Privacy ledger and training curve > image 1 .*", TEST + " (the test accuracy per epoch)"),
    Allow("*report.html", r"(Accuracy|Test metrics) > .*", TEST),
    Allow("*report.html", r"Individual privacy \(Yu et al\. #\) > table 0 > row \d+ > released value", RELEASED),
    # stdout (text): the first line, the groups' table, the PDP rounds' table, the released statistics
    *_line(r"[\w-]+ on \w+ \([\w ]+\): test accuracy # after # steps.*", "0", TEST),
    *_line(r"[\w-]+ on \w+ \([\w ]+\): test accuracy # after # steps.*", "1", PUBLIC_N),
    *_line(r"\s+#\s+#\s+#\s+#\s+#", "[1-4]", PUBLIC_N),  # budget count q c eps_spent
    *_line(r"\s+#\s+#\s+#\s+#", "[1-2]", PUBLIC_N),  # PDP: budget count eps_spent delta
    *_line(r"\s+#\s+#\s+#\s+#\s+#", "[2-4]", PUBLIC_N),  # PDP: round threshold sigma q E|D_R|
    *_line(
        r"individual epsilon \(estimate\), privately released with epsilon #: mean #; quantiles.*",
        r"[1-9]\d*",
        RELEASED,
    ),
]


def _compare(a: Outputs, b: Outputs, allow, what: str) -> dict:
    return assert_same_public_outputs(a, b, allow, what=what)


def _train(tmp_path, argv, allow=(), **data):
    d, dp = csv_pair(tmp_path, **data)
    a = run_cli([*argv, *d.args], d.root)
    b = run_cli([*argv, *dp.args], dp.root)
    return a, b, _compare(a, b, [*RUN, *allow], " ".join(argv[:3]))


# --- train, every kind of run ---------------------------------------------------------------------
def test_train_sample_csv_with_a_unique_label(tmp_path):
    """The outlier's label (3) is unique: with the label set given (``--num-classes``), the model's
    output layer, the per-class accuracies and every file stay the same shape."""
    a, b, used = _train(tmp_path, ["train", "--method", "sample", *BUDGETS, *NUM_CLASSES, *FAST])
    assert a.files.keys() == b.files.keys() and {"model.pt", "report.json", "report.html"} <= a.files.keys()
    assert fields_matching(a, "model.pt", r"3\.weight:shape") == fields_matching(b, "model.pt", r"3\.weight:shape")
    assert WEIGHTS in used and PUBLIC_N in used  # the harness saw the differences it should
    r = json.loads(a.files["report.json"])
    assert r["neighbouring"] == "zero-out" and any("N" in x for x in r["public_inputs"])
    assert "Neighbouring data sets: zero-out" in a.files["report.html"].decode()


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        (
            "individual accounting with a private release",
            ["--method", "sample", "--individual-accounting", "--validate-subset", "0", "--save-norms"],
        ),
        ("the individual filter", ["--method", "sample", "--filter", "individual"]),
        ("pdp-sgd", ["--method", "pdp-sgd", "--rounds", "2"]),
    ],
)
def test_train_kinds(tmp_path, name, argv):
    _train(tmp_path, ["train", *argv, *BUDGETS, *NUM_CLASSES, *FAST])


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [["--method", "scale"], ["--method", "pdp-sampling"], ["--method", "adapdp"], ["--method", "uniform"]],
)
def test_train_other_methods(tmp_path, argv):
    _train(tmp_path, ["train", *argv, *BUDGETS, *NUM_CLASSES, *FAST])


def test_the_harness_names_a_leak(tmp_path):
    """A public field that differs outside the allow-list fails with its file and field (a leak
    planted here: the report states the number of examples of a label only D has)."""
    a, b, _ = _train(tmp_path, ["train", "--method", "uniform", "--budgets", "2", *NUM_CLASSES, *FAST])
    for out, k in ((a, 1), (b, 0)):
        r = json.loads(out.files["report.json"])
        r["examples_of_label_3"] = k
        out.files["report.json"] = json.dumps(r).encode()
    with pytest.raises(AssertionError, match=r"report\.json: examples_of_label_3: D=1, D'=0"):
        assert_same_public_outputs(a, b, RUN, what="planted")
    found = [str(d) for d in differences(a, b)]
    assert any(s.startswith("model.pt: ") and "float-values" in s for s in found)  # the weights differ


# --- the other commands ----------------------------------------------------------------------------
def test_report_and_account(tmp_path):
    """``idpsgd report DIR`` re-renders the public report; ``idpsgd account`` reads the private norms
    of an individual-accounting run and writes its own folder."""
    argv = ["train", "--method", "sample", "--individual-accounting", "--validate-subset", "0", "--save-norms"]
    d, dp = csv_pair(tmp_path)
    for s in (d, dp):
        run_cli([*argv, *BUDGETS, *NUM_CLASSES, *FAST, *s.args], s.root)
    rep = [run_cli(["report", str(s.out)], s.root, out=False) for s in (d, dp)]
    rep = [collect(s.root, s.out, o.streams) for s, o in zip((d, dp), rep, strict=True)]
    _compare(*rep, RUN, "report")
    acc = []
    for s in (d, dp):
        norms = s.out / "private" / "norms.npz"
        acc.append(run_cli(["account", "--norms", str(norms), "--delta", "1e-5"], s.root, out=s.root / "account"))
    allow = [
        *_both(
            r"sample_rate|noise_multiplier|examples|worst_case_epsilon",
            PUBLIC_N,
            files=("account.json", "stdout --json"),
        ),
        *_both(r"released/.*|epsilon_.*released.*", RELEASED, files=("account.json", "stdout --json")),
        Allow("stdout", r".*", "checked field by field in stdout --json (the text prints the same result)"),
    ]
    _compare(*acc, allow, "account")


def test_per_instance(tmp_path):
    argv = ["per-instance", *FAST, "--points", "0,1", "--runs", "1", "--samples", "2,2"]
    d, dp = csv_pair(tmp_path)
    a, b = (run_cli([*argv, *s.args, *NUM_CLASSES], s.root) for s in (d, dp))
    n = r"sample_rate|noise_multiplier|baseline_\w+|data_independent_epsilon|same_composition_\w+"
    allow = [
        *_both(n, PUBLIC_N, files=("settings.json", "stdout --json")),
        *_both(r"test_accuracy|test_accuracy_runs/\d+", TEST, files=("settings.json", "stdout --json")),
        *_line(r"per-instance RDP at alpha=#.*", "5|6|10|11|12|13|14|15", PUBLIC_N),  # q sigma; the baselines
        *_line(r"per-instance RDP at alpha=#.*", "9", TEST),
    ]
    _compare(a, b, allow, "per-instance")
    assert json.loads(a.files["settings.json"])["neighbouring"] == "zero-out"


def test_audit(tmp_path):
    """The audit's results (AUC, TPR, bounds, verdict: statistics of the training data and of the
    secret membership) are private; the public audit.json holds settings, plan, reported ε."""
    argv = ["audit", "--method", "sample", *BUDGETS, *NUM_CLASSES, *FAST[:-4], "--batch-size", "8", "--seed", "7"]
    d, dp = csv_pair(tmp_path)
    a, b = (run_cli([*argv, "--attack", "loss", *s.args], s.root) for s in (d, dp))
    files = ("audit.json", "stdout --json")
    allow = [
        *_both(r"groups/\d+/(examples|reported_epsilon)|plan/.*|target/noise_multiplier", PUBLIC_N, files=files),
        *_both(r"target/test_accuracy|shadow_test_accuracy_mean", TEST, files=files),
        *_line(r"\s+#\s+#\s+#", "[12]", PUBLIC_N),
        *_line(r"idpsgd audit: .*target test accuracy #", "0", TEST),
    ]
    _compare(a, b, allow, "audit")
    public = json.loads(a.files["audit.json"])
    assert public["neighbouring"] == "zero-out" and "all" not in public and "roc_by_group.png" not in a.files


@pytest.mark.slow
def test_demo(tmp_path):
    d, dp = csv_pair(tmp_path)
    a, b = (run_cli(["demo", *FAST, *s.args, *NUM_CLASSES], s.root) for s in (d, dp))
    allow = [
        *RUN,
        *_both(r"runs/\d+/test_accuracy", TEST, files=("summary.json", "stdout --json")),
        *_both(
            r"runs/\d+/(epsilon\w*|groups/.*|noise_multiplier|sample_rate)",
            PUBLIC_N,
            files=("summary.json", "stdout --json"),
        ),
        *_line(r"[\w =.]+\s+#\s+#\s+#\s+#\s+#", "1", TEST),
    ]
    _compare(a, b, allow, "demo")


# --- reproduce: one cheap experiment per paper module ------------------------------------------------
EXPERIMENT = [
    *_both(r"seconds|.*/seconds", TIME, files=("*.json", "stdout --json")),
    *_both(r"load_average_(before|after)/\d+", LOAD, files=("*.json", "stdout --json")),
    *_line(r"# (runs|analyses) in # s.*", r"\d+", TIME + "; " + LOAD),
]


@pytest.mark.slow
def test_reproduce_boenisch_table3(tmp_path):
    d, dp = csv_pair(tmp_path)
    argv = ["reproduce", "boenisch-table3", "--seeds", "1", "--calibrated-steps", "3", "--no-progress", "--seed", "7"]
    a, b = (run_cli([*argv, *s.args, *NUM_CLASSES], s.root) for s in (d, dp))
    allow = [
        *EXPERIMENT,
        *_both(r"columns/.*/(accuracy|mean|std|runs/\d+)", TEST, files=("boenisch_table3.json", "stdout --json")),
    ]
    _compare(a, b, allow, "reproduce boenisch-table3")


def _table(base: str) -> list[Allow]:
    files = (f"{base}.json", "stdout --json")
    return [
        *_both(r"table/\d+/[^/]+/parameters/.*", PUBLIC_N, files=files),
        *_both(r"table/\d+/[^/]+/(mean|std|runs/\d+)", TEST, files=files),
        Allow(f"{base}.png", r".*", TEST + " (the figure of the table's accuracies)"),
    ]


@pytest.mark.slow
def test_reproduce_boenisch_table2(tmp_path):
    d, dp = mnist_pair(tmp_path)
    argv = ["reproduce", "boenisch-table2", "--seeds", "1", "--epochs", "1", "--batch-size", "16", "--no-upper-bound"]
    argv += ["--setups", "34-43-23", "--model", "mlp", "--no-progress", "--seed", "7"]
    a, b = (run_cli([*argv, *s.args], s.root) for s in (d, dp))
    allow = [
        *EXPERIMENT,
        *_table("boenisch_table2"),
        *_line(
            r"- [\w-]+ \((eps #|#-#-#)\): sigma #, q [#/]+, c [#/]+", r"[1-9]\d*", PUBLIC_N, files=("stdout", "*.md")
        ),
        *_line(r"\| #%#%#% \| # ± # \| # ± # \| # ± # \|", r"[3-8]", TEST, files=("stdout", "*.md")),
    ]
    _compare(a, b, allow, "reproduce boenisch-table2")


@pytest.mark.slow
def test_reproduce_yu_figure(tmp_path):
    d, dp = mnist_pair(tmp_path)
    argv = ["reproduce", "yu-figure", "--seeds", "1", "--epochs", "1", "--batch-size", "16", "--validate-subset", "0"]
    argv += ["--no-individual-clipping", "--model", "mlp", "--no-progress", "--seed", "7"]
    a, b = (run_cli([*argv, *s.args], s.root) for s in (d, dp))
    files = ("yu_figure.json", "stdout --json")
    allow = [
        *EXPERIMENT,
        *_both(
            r"noise_multiplier|sample_rate|worst_case_epsilon|runs/\w+/\d+/(noise_multiplier|sample_rate|worst_case_epsilon)",
            PUBLIC_N,
            files=files,
        ),
        *_both(
            r"runs/\w+/\d+/(test_accuracy|per_class_accuracy/\d+)|summary/\w+/(test_accuracy/.*|per_class/\d+/test_accuracy|highest_accuracy_class|lowest_accuracy_class)",
            TEST,
            files=files,
        ),
        *_both(
            r"runs/\w+/\d+/(released/.*|released_class_mean_epsilon/\d+)|summary/\w+/(released_.*|per_class/\d+/released_mean_epsilon)",
            RELEASED,
            files=files,
        ),
        *_both(
            r"summary/\w+/(class_accuracy_vs_released_epsilon_pearson_r|epsilon_gap_lowest_vs_highest_accuracy_class)",
            RELEASED + "; " + TEST,
            files=files,
        ),
        Allow("yu_released_quantiles.png", r".*", RELEASED),
        Allow("yu_class_accuracy_vs_epsilon.png", r".*", RELEASED + "; " + TEST),
        *_line(r"Yu et al\. on .*", r"\d+", PUBLIC_N, files=("stdout", "*.md")),
        *_line(r"\| Alg\. # \(estimate\) .*", r"[1-9]\d*", TEST + "; " + RELEASED, files=("stdout", "*.md")),
        *_line(
            r"\| (test accuracy \(%\)|released mean eps) \|.*", r"\d+", TEST + "; " + RELEASED, files=("stdout", "*.md")
        ),
        *_line(r"The class with the lowest test accuracy .*", r"\d+", TEST + "; " + RELEASED, files=("stdout", "*.md")),
    ]
    _compare(a, b, allow, "reproduce yu-figure")


@pytest.mark.slow
def test_reproduce_thudi_figure1(tmp_path):
    d, dp = mnist_pair(tmp_path)
    argv = ["reproduce", "thudi-figure1", "--seeds", "1", "--points", "2", "--epochs", "1", "--batch-size", "16"]
    argv += ["--model", "mlp", "--no-progress", "--seed", "7"]
    a, b = (run_cli([*argv, *s.args], s.root) for s in (d, dp))
    n = r"(per_epsilon/\d+/)?(sample_rate|noise_multiplier|baseline_\w+|data_independent_epsilon|same_composition_\w+)"
    allow = [
        *EXPERIMENT,
        *_both(n, PUBLIC_N, files=("*.json", "stdout --json")),
        *_both(r"(per_epsilon/\d+/)?test_accuracy(_runs/\d+)?", TEST, files=("*.json", "stdout --json")),
        *_line(r"\| # \| # \| # \| # \| # ± # \| # \| # \| # \|", r"[1-9]", PUBLIC_N),
        *_line(r"Thudi et al\. Fig\. # on .*", r"\d+", PUBLIC_N),
    ]
    _compare(a, b, allow, "reproduce thudi-figure1")
