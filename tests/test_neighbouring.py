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

import numpy as np
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
    user_csv_pair,
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
            r"runs/\d+/(epsilon\w*(/[\d.]+)?|groups/.*|noise_multiplier|sample_rate)",
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


# --- Hugging Face: the finetune command and the IndividualizedTrainer ------------------------------
UNIQUE = "zebra"  # the outlier's label (text classification): no other row has it
#: the outlier's text: a word no other row has, and the longest text by far
UNIQUE_TEXT = " ".join(["xylophone"] + ["privacy consent budget"] * 9)
HF_RUN = [
    *RUN,
    Allow("model/model.safetensors", r".*:float-values", WEIGHTS),
    *_both(r"test_metrics/.*", TEST),
    *_both(r"epsilon|batch_size|max_steps", PUBLIC_N),  # loosest group epsilon; the expected batch size
    *_both(r"history/\d+/(epsilon\w*|step|epoch)", PUBLIC_N),  # the public log: epsilon per group
    *_both(r"history/\d+/(eval_\w+|test_\w+)", TEST),
    *_line(r"finetune \(\w+, \w+\): .*", r"\d+", TEST + "; " + PUBLIC_N),
    *_line(r"\s*group with budget #: .*", r"[1-9]\d*", PUBLIC_N),
    *_both(r"data/train/rows", PUBLIC_N),
    *_both(r"history/\d+/(train_runtime|train_samples_per_second|train_steps_per_second)", TIME),
    # Hugging Face's progress bars on stderr (loading and writing the model): elapsed time and rate
    *_line(r"[\w ]+: #%\|#+\| #/# \[#:#<#:#, #it/s\]", "[3-7]", TIME, files=("stderr",)),
]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The HF test helpers (tiny Llama, a word-level tokenizer trained on a public word list) and a
    local model folder."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import test_hf_integration as h

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))  # as test_hf_integration's fixture: public words
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(h._lines(200), trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    folder = tmp_path_factory.mktemp("hf") / "model"
    h._llama(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return h, tok, folder


def _text_pair(h, base, *, labels: bool):
    """D (one more row: the unique label, word and length) and D′ as jsonl files; public test data."""
    lines = h._lines(24, seed=11)
    out = []
    for name, outlier in (("D", True), ("Dprime", False)):
        root = base / name
        root.mkdir(parents=True)
        rows = [{"text": s, **({"label": "pos" if "cat" in s else "neg"} if labels else {})} for s in lines]
        if outlier:
            rows.append({"text": UNIQUE_TEXT, **({"label": UNIQUE} if labels else {})})
        test = [{"text": s, **({"label": "pos" if "cat" in s else "neg"} if labels else {})} for s in h._lines(8, 12)]
        h._write_jsonl(root / "train.jsonl", rows)
        h._write_jsonl(root / "test.jsonl", test)
        out.append(root)
    return out


@pytest.mark.parametrize("task", [pytest.param("causal_lm", marks=pytest.mark.slow), "classification"])
def test_finetune(hf, tmp_path, task):
    """A unique word, a unique length and (classification) a unique label: the model's config, the
    tokenizer files, the head's shape and the report stay the same."""
    h, _, model = hf
    labels = task == "classification"
    argv = ["finetune", "--model", str(model), "--method", "scale", "--budgets", "1,8", "--fractions", "0.5,0.5"]
    argv += ["--epochs", "1", "--batch-size", "8", "--seed", "3"]
    if labels:
        argv += ["--label-column", "label", "--labels", f"neg,pos,{UNIQUE}"]
    runs = []
    for root in _text_pair(h, tmp_path, labels=labels):
        runs.append(
            run_cli([*argv, "--data", str(root / "train.jsonl"), "--eval-data", str(root / "test.jsonl")], root)
        )
    used = _compare(*runs, HF_RUN, f"finetune ({task})")
    assert WEIGHTS in used
    assert {"model/config.json", "model/tokenizer.json", "model/model.safetensors"} <= runs[0].files.keys()


def test_individualized_trainer_with_save_state_and_save_metrics(hf, tmp_path):
    """The library's Trainer on D and D′ (a unique token and length), then ``save_state`` and
    ``save_metrics``: trainer_state.json, train_results.json, all_results.json and the run folder."""
    h, tok, _ = hf
    from idpsgd.integrations.hf import PrivacyArguments

    outs = []
    for name, outlier in (("D", True), ("Dprime", False)):
        train = h._lm_data(tok, 40, seed=0)
        if outlier:
            enc = tok([UNIQUE_TEXT], truncation=True, max_length=16)  # 16 tokens: the others have at most 11
            train = train.add_item(
                {"input_ids": enc["input_ids"][0], "attention_mask": enc["attention_mask"][0], "epsilon": 8.0}
            )
        root = tmp_path / name
        privacy = PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=3)
        t = h._trainer(tok, h._llama(tok), train, root / "out", privacy=privacy, logging_steps=1)
        outs.append(_trained_outputs(t, root))
    timing = r"(.*/)?(train_runtime|train_samples_per_second|train_steps_per_second)"
    allow = [
        *HF_RUN,
        *_both(timing, TIME, files=("*results.json", "trainer_state.json", "TrainOutput --json")),
        *_both(r"log_history/\d+/(epsilon\w*)", PUBLIC_N, files=("trainer_state.json",)),
        *_both(
            r"max_steps|global_step|num_train_epochs|log_history/\d+/(step|epoch)|epoch",
            PUBLIC_N,
            files=("trainer_state.json", "*results.json", "TrainOutput --json"),
        ),
        *_both(r"global_step|metrics/.*", PUBLIC_N, files=("TrainOutput --json",)),
    ]
    _compare(*outs, allow, "IndividualizedTrainer")
    assert {"trainer_state.json", "train_results.json", "all_results.json"} <= outs[0].files.keys()


@pytest.mark.slow
def test_reproduce_heo_table1(tmp_path):
    """Heo et al.'s budgets (20 groups, sizes from an exponential shape) need about a thousand rows for
    every group to have one; the tables publish test accuracies only."""
    d, dp = mnist_pair(tmp_path, n=1200)
    argv = ["reproduce", "heo-table1", "--seeds", "1", "--epochs", "1", "--batch-size", "256", "--rounds", "1"]
    argv += ["--no-figures", "--model", "mlp", "--no-progress", "--seed", "3"]
    a, b = (run_cli([*argv, *s.args], s.root) for s in (d, dp))
    allow = [
        *EXPERIMENT,
        *_table("heo_table1"),
        *_line(r"\| # \| # ± # \| # ± # \| # ± # \| # ± # \| # ± # \|", r"[1-9]\d*", TEST, files=("stdout", "*.md")),
    ]
    _compare(a, b, allow, "reproduce heo-table1")


def test_assign_from_a_budgets_file(tmp_path):
    """``idpsgd assign`` reads per-example budgets (a column of the table): it prints only the groups'
    parameters, computed from the group sizes."""
    d, dp = csv_pair(tmp_path, extra={"budget": lambda i, label: (1, 2, 3)[i % 3] if label != 3 else 3})
    argv = ["assign", "--method", "sample", "--budget-column", "budget", "--delta", "1e-5", "--sample-rate", "0.2"]
    argv += ["--steps", "20", "--clip-norm", "1"]
    a, b = (run_cli([*argv, "--budgets-file", str(s.root / "data" / "train.csv")], s.root, out=False) for s in (d, dp))
    allow = [
        *_both(
            r"num_examples|" + GROUP_N + r"|noise_multiplier|groups/\d+/(epsilon|fraction)",
            PUBLIC_N,
            files=("stdout --json",),
        ),
        *_line(r".*", r"\d+", PUBLIC_N + " (the text of the same result)"),
    ]
    used = _compare(a, b, allow, "assign")
    assert PUBLIC_N in used


# --- user level: one user's rows replaced by a different number of rows ------------------------------
#: at user level the neighbours have the same users, so N (the users), the groups' sizes and everything
#: computed from them are equal: only the weights, test metrics and timings may differ
COVERED = (WEIGHTS, TEST, TIME)
USERS = ["--user-column", "user", "--max-rows-per-user", "2"]


def _user_level(allow) -> list[Allow]:
    return [a for a in allow if a.reason in COVERED]


def test_train_at_user_level(tmp_path):
    """``train --user-column``: the target user has 1 row in D and 5 other rows (label 3, far features)
    in D′; nothing public but the weights and the test metrics may differ."""
    d, dp = user_csv_pair(tmp_path)
    argv = ["train", "--method", "sample", "--budgets", "1,3", "--fractions", "0.5,0.5", *NUM_CLASSES, *USERS]
    argv += ["--epochs", "1", "--no-progress", "--batch-size", "8", "--seed", "7"]
    a, b = (run_cli([*argv, *s.args], s.root) for s in (d, dp))
    used = _compare(a, b, _user_level(RUN), "train at user level")
    assert WEIGHTS in used and PUBLIC_N not in used
    assert json.loads(a.files["report.json"])["privacy_unit"] == "user"


def _user_texts(h, base, *, target: list[str]):
    """D and D′ (jsonl with a user column): 12 users of 2 rows and the target user's rows ``target[0]`` (D)
    or ``target[1]`` (D′, more rows, one of them the longest text)."""
    lines = h._lines(24, seed=11)
    out = []
    for name, rows in (("D", target[:1]), ("Dprime", target[1:])):
        root = base / name
        root.mkdir(parents=True)
        data = [{"text": s, "user": f"u{i // 2:02d}"} for i, s in enumerate(lines)]
        data += [{"text": t, "user": "u-target"} for t in rows]
        h._write_jsonl(root / "train.jsonl", data)
        h._write_jsonl(root / "test.jsonl", [{"text": s} for s in h._lines(8, 12)])
        out.append(root)
    return out


TARGET_TEXTS = ["the cat sat", UNIQUE_TEXT, "a lazy dog", "privacy budget", "consent group over the mat"]


def test_finetune_at_user_level(hf, tmp_path):
    """``finetune --user-column``: the report publishes the number of users, never the rows' (one user's
    row count would move it)."""
    h, _, model = hf
    argv = ["finetune", "--model", str(model), "--method", "scale", "--budgets", "1,8", "--fractions", "0.5,0.5"]
    argv += ["--epochs", "1", "--batch-size", "4", "--seed", "3", *USERS]
    runs = [
        run_cli([*argv, "--data", str(root / "train.jsonl"), "--eval-data", str(root / "test.jsonl")], root)
        for root in _user_texts(h, tmp_path, target=TARGET_TEXTS)
    ]
    allow = [
        *_user_level(HF_RUN),
        *_line(r"finetune \(\w+, \w+\) .*", r"[1-9]\d*", TEST),  # the test metrics (#0: the steps)
    ]
    used = _compare(*runs, allow, "finetune at user level")
    assert WEIGHTS in used
    report = json.loads(runs[0].files["report.json"])
    assert "rows" not in report["data"]["train"] and report["data"]["train"]["users"] == 13


def test_individualized_trainer_at_user_level(hf, tmp_path):
    """The Trainer with ``PrivacyArguments(user_column=...)``, then ``save_state`` and ``save_metrics``."""
    h, tok, _ = hf
    import datasets

    from idpsgd.integrations.hf import PrivacyArguments

    outs = []
    for name, target in (("D", TARGET_TEXTS[:1]), ("Dprime", TARGET_TEXTS[1:])):
        texts = h._lines(24, seed=0) + target
        users = [f"u{i // 2:02d}" for i in range(24)] + ["u-target"] * len(target)
        enc = tok(texts, truncation=True, max_length=16)
        train = datasets.Dataset.from_dict(
            {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "user": users}
        )
        root = tmp_path / name
        privacy = PrivacyArguments(
            budgets=np.full(13, 4.0), delta=1e-5, method="uniform", seed=3, user_column="user", max_rows_per_user=2
        )
        t = h._trainer(
            tok, h._llama(tok), train, root / "out", privacy=privacy, logging_steps=1, per_device_train_batch_size=4
        )
        outs.append(_trained_outputs(t, root))
    timing = r"(.*/)?(train_runtime|train_samples_per_second|train_steps_per_second)"
    allow = [
        *_user_level(HF_RUN),
        *_both(timing, TIME, files=("*results.json", "trainer_state.json", "TrainOutput --json")),
    ]
    used = _compare(*outs, allow, "IndividualizedTrainer at user level")
    assert WEIGHTS in used


def _trained_outputs(t, root):
    """Train ``t`` to the end, save its state and metrics as a user would, and collect what it wrote."""
    result = t.train()
    t.save_state()
    t.save_metrics("train", result.metrics)
    return collect(root, root / "out", {"TrainOutput --json": json.dumps(result._asdict(), default=str, indent=1)})
