"""Issue 52: auditing fine-tuned language models per privacy group — canaries, exposure, empirical ε.

Statistics against references (exposure against a brute-force ranking of a small candidate space, the
sampled estimate against the exact value, the one-run bound against :mod:`idpsgd.audit.bounds`), the
canary design, the zero-out null rows, and the two ways in (``idpsgd audit --model DIR --data FILE``
at example and user level, and an ``IndividualizedTrainer`` run) on a tiny GPT-2 built from a config.
The full reproduction is ``slow``."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from idpsgd import InvalidParameterError
from idpsgd.audit import bounds
from idpsgd.audit.canaries import CanaryFormat, draw_canaries, with_canaries
from idpsgd.audit.exposure import estimated_exposure, exact_exposure
from support import file_mode

# --------------------------------------------------------------------------- exposure (numpy only)


def _brute_force_rank(canary: float, space: list[float]) -> float:
    """The canary's position in the candidates sorted from most to least likely, ties sharing the mean
    of their positions (a plain loop: the reference)."""
    ordered = sorted(space, reverse=True)
    positions = [k + 1 for k, v in enumerate(ordered) if v == canary]
    return sum(positions) / len(positions)


def test_exact_exposure_is_the_brute_force_ranking():
    """On a candidate space of 1000 (ties included) every canary's exposure is log2|R| − log2(rank) with the
    rank of a brute-force sort."""
    rng = np.random.default_rng(0)
    space = np.round(rng.normal(size=1000), 1)  # many ties
    canaries = rng.choice(1000, size=40, replace=False)
    got = exact_exposure(space[canaries], space)
    for k, i in enumerate(canaries):
        rank = _brute_force_rank(space[i], space.tolist())
        assert got["rank"][k] == pytest.approx(rank)
        assert got["exposure"][k] == pytest.approx(math.log2(1000) - math.log2(rank))
    best = int(np.argmax(space))
    if np.sum(space == space[best]) == 1:
        assert exact_exposure([space[best]], space)["exposure"][0] == pytest.approx(math.log2(1000))
    flat = exact_exposure(np.zeros(3), np.zeros(1000))  # a model that tells nothing apart: exposure ≈ 1, not max
    assert np.allclose(flat["exposure"], math.log2(1000) - math.log2(500.5))
    with pytest.raises(InvalidParameterError, match="every canary must be one of the candidates"):
        exact_exposure([10.0], space)


def test_the_sampled_estimate_matches_the_exact_exposure():
    """The estimate from the whole space as the 'sample' is the exact value; from 20 000 uniform samples of a
    space of 10^6 it is within sampling error of the exact value (canaries resolved by the sample); a canary
    beyond the sample is extrapolated with the skew-normal fit and flagged."""
    rng = np.random.default_rng(1)
    small = rng.normal(size=500)
    assert np.allclose(
        estimated_exposure(small[:20], small, 500)["exposure"], exact_exposure(small[:20], small)["exposure"]
    )
    space = rng.normal(size=10**6)
    canaries = np.array([0.0, 1.0, 2.0, 3.0])  # tail probabilities 0.5, 0.16, 0.023, 0.0013
    exact = np.log2(10**6) - np.log2(0.5 + (space[None, :] > canaries[:, None]).sum(1))
    sample = space[rng.integers(0, 10**6, size=20000)]
    est = estimated_exposure(canaries, sample, 10**6)
    assert est["method"] == "sampled estimate" and not est["extrapolated"].any()
    assert np.allclose(est["exposure"], exact, atol=0.15)
    far = estimated_exposure([6.0], sample, 10**6)
    assert far["extrapolated"][0]
    # the skew-normal tail of a standard normal sample at 6 sigma: P ≈ 1e-9, below 1/|R|: rank 1, exposure max
    assert far["exposure"][0] == pytest.approx(math.log2(10**6))
    mid = estimated_exposure([4.6], sample, 10**6)
    assert mid["extrapolated"][0]
    assert mid["exposure"][0] == pytest.approx(math.log2(10**6) - math.log2(0.5 + 10**6 * 2.1e-6), abs=0.5)


# --------------------------------------------------------------------------- canaries


def test_canaries_one_design_per_seed_distinct_secrets_fair_coins():
    fmt = CanaryFormat("my code is", 4)
    a = draw_canaries([8.0, 1.0, 2.0], 50, fmt, seed=3)
    b = draw_canaries([1.0, 2.0, 8.0], 50, fmt, seed=3)
    assert np.array_equal(a.secret_ids, b.secret_ids) and np.array_equal(a.included, b.included)
    assert len(set(a.secret_ids.tolist())) == 150 and a.secret_ids.max() < 10**4
    assert a.group_budgets.tolist() == [1.0, 2.0, 8.0] and np.bincount(a.group).tolist() == [50, 50, 50]
    assert 50 < a.included.sum() < 100
    assert a.texts[0].startswith("my code is ") and len(a.texts[0].split()) == 3 + 4
    assert fmt.texts([7])[0] == "my code is 0 0 0 7"
    assert "secret" not in repr(a) and str(a.secret_ids[0]) not in repr(a)
    c = draw_canaries([1.0], 8, CanaryFormat(digits=18), seed=3)  # a large space: no enumeration
    assert len(set(c.secret_ids.tolist())) == 8
    with pytest.raises(InvalidParameterError, match="seed.*must not be given in secure mode"):
        draw_canaries([1.0], 4, fmt, seed=1, secure_mode=True)
    fresh = [draw_canaries([1.0], 4, fmt, secure_mode=True).seed for _ in range(2)]
    assert fresh[0] != fresh[1]
    with pytest.raises(InvalidParameterError, match="candidate space of at least"):
        draw_canaries([1.0, 2.0], 30, CanaryFormat(digits=1), seed=0)
    with pytest.raises(InvalidParameterError, match="canaries"):
        draw_canaries([1.0], 1, fmt, seed=0)


def test_canaries_join_the_rows_as_rows_or_null_rows_and_at_user_level_as_users():
    fmt = CanaryFormat(digits=4)
    c = draw_canaries([1.0, 4.0], 6, fmt, seed=0)
    texts, eps, users, null, of = with_canaries(["a b", "c d", "e f"], [1.0, 4.0, 4.0], c)
    assert len(texts) == 3 + 12 and users is None
    assert eps[3:].tolist() == c.budgets.tolist() and null[:3].sum() == 0
    assert np.array_equal(null[3:], ~c.included) and of.tolist() == list(range(12))
    u = draw_canaries([1.0, 4.0], 6, fmt, seed=0, user_ids=np.array(["u1", "u2"]), user_budgets=[1.0, 4.0])
    assert len(set(u.users)) == 12 and all(x.startswith("idpsgd-canary-") for x in u.users)
    e = draw_canaries(
        [1.0, 4.0], 6, fmt, seed=0, user_ids=np.array(["u1", "u2"]), user_budgets=[1.0, 4.0], users="existing"
    )
    assert [x for x, g in zip(e.users, e.group, strict=True) if g == 0] == ["u1"] * 6  # the group's own user
    assert set(e.users) == {"u1", "u2"}
    with pytest.raises(InvalidParameterError, match="reserved prefix"):
        draw_canaries([1.0], 2, fmt, seed=0, user_ids=np.array(["idpsgd-canary-0"]), user_budgets=[1.0])


def test_repeated_canaries_are_rows_of_one_user_and_refused_at_example_level():
    """A canary with r repeats is r consecutive rows of its user, with one coin (all r null or none); at
    example level repeats are refused (the per-row ε would not cover the canary's r rows)."""
    fmt = CanaryFormat(digits=4)
    ids, budgets = np.array(["u1", "u2"]), [1.0, 4.0]
    c = draw_canaries([1.0, 4.0], 5, fmt, seed=1, user_ids=ids, user_budgets=budgets, repeats=3)
    assert c.repeats == 3 and len(c) == 10
    texts, eps, users, null, of = with_canaries(["a b", "c d"], [1.0, 4.0], c, ["u1", "u2"])
    assert len(texts) == 2 + 30 and of.tolist() == np.repeat(np.arange(10), 3).tolist()
    for i in range(10):
        rows = 2 + np.flatnonzero(of == i)
        assert {texts[j] for j in rows} == {c.texts[i]} and {users[j] for j in rows} == {c.users[i]}
        assert set(null[rows].tolist()) == {not c.included[i]} and set(eps[rows].tolist()) == {c.budgets[i]}
    assert len(set(c.users)) == 10  # each canary a user of its own, owning its 3 rows
    with pytest.raises(InvalidParameterError, match="repeated canaries need user level"):
        draw_canaries([1.0, 4.0], 5, fmt, seed=1, repeats=2)
    with pytest.raises(InvalidParameterError, match="canary_repeats"):
        draw_canaries([1.0], 5, fmt, seed=1, user_ids=ids, user_budgets=budgets, repeats=0)


def test_canaries_with_contexts_each_open_with_a_public_word_of_their_own():
    """With contexts canary slot i reads "<context i> <prefix> d₁ … d_k": distinct, lower-case words that are no
    digit; the candidate texts of one slot share its context; the alphabet holds the contexts."""
    fmt = CanaryFormat("my code is", 3, contexts=True)
    c = draw_canaries([1.0, 8.0], 40, fmt, seed=0)
    words = [t.split()[0] for t in c.texts]
    assert len(set(words)) == 80 and all(w.isalpha() and w.islower() and w.startswith("x") for w in words)
    assert [t.split()[1:4] for t in c.texts] == [["my", "code", "is"]] * 80
    assert [t.split()[4:] for t in c.texts] == [list(map(str, row)) for row in fmt.secret_digits(c.secret_ids)]
    assert fmt.texts([7, 42], slot=5) == [f"{fmt.context(5)} my code is 0 0 7", f"{fmt.context(5)} my code is 0 4 2"]
    assert fmt.context(0) == "xbaa" and fmt.context(27) == "xbbb"
    assert set(words) <= set(fmt.alphabet_text(80).split())
    with pytest.raises(InvalidParameterError, match="slot"):
        fmt.texts([1])
    with pytest.raises(InvalidParameterError, match="canary_slot"):
        fmt.context(-1)


# --------------------------------------------------------------------------- the one-run bound is the audit's


def test_the_group_bound_is_the_existing_one_run_implementation():
    """A group's empirical ε is bounds.one_run_audit of the loss scores and coins, at the Bonferroni level of
    the existing audit (groups + all data): one implementation."""
    from idpsgd.audit.lm import _row
    from idpsgd.audit.runner import per_test_confidence, verdict_tests

    rng = np.random.default_rng(2)
    inc = rng.random(200) < 0.5
    score = inc * 3.0 + rng.normal(size=200)
    conf = per_test_confidence(0.95, verdict_tests(3, 1))
    row = _row(1.0, 0.5, 1e-5, np.ones(200, bool), inc, score, np.zeros(200), conf)
    ref = bounds.one_run_audit(score, inc, 1e-5, conf)
    assert row["one_run"] == ref and row["empirical_epsilon"] == ref["epsilon"] > 0.5
    assert row["verdict"] == "FAILED"  # a bound above the reported 0.5
    ok = _row(1.0, 10.0, 1e-5, np.ones(200, bool), inc, score, np.zeros(200), conf)
    assert ok["verdict"] == "passed"


def test_pooled_mean_ranks_are_the_groups_rank_means_among_all_included_canaries():
    """A group's mean rank: its included canaries' positions (1: lowest exposure, ties their mean position)
    among the included canaries of every group, by a plain sort (the reference); held-out canaries do not enter."""
    from idpsgd.audit.lm import pooled_mean_ranks

    rng = np.random.default_rng(4)
    exp = np.round(rng.exponential(size=60), 1)  # ties
    group, inc = np.repeat(np.arange(3), 20), rng.random(60) < 0.5
    inc[40:] = False
    got = pooled_mean_ranks(exp, group, inc, 4)
    pooled = sorted(exp[inc].tolist())
    for g in range(2):
        ref = [np.mean([k + 1 for k, v in enumerate(pooled) if v == x]) for x in exp[inc & (group == g)]]
        assert got[g] == pytest.approx(np.mean(ref))
    assert got[2] is None and got[3] is None
    lo_hi = pooled_mean_ranks([0.1, 0.2, 5.0, 6.0], [0, 0, 1, 1], [True] * 4, 2)
    assert lo_hi == [1.5, 3.5]


# --------------------------------------------------------------------------- a tiny GPT-2 and a text file

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import torch

from hf_text import WORDS, word_tokenizer
from idpsgd.cli.main import main

FMT = CanaryFormat(digits=3)


def _lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 10)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer([*_lines(200), FMT.alphabet_text()])  # the format's words, never a secret


def _gpt2(tok, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=tok.vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=32, pad_token_id=tok.pad_token_id
    )
    return GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm") / "model"
    _gpt2(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _data_file(path, n=48, users=False):
    rows = [{"text": s, "epsilon": [1.0, 8.0][i % 2]} for i, s in enumerate(_lines(n, seed=3))]
    if users:
        for i, r in enumerate(rows):
            r["user"] = f"u{i % 16}"  # user j's rows all carry budget [1, 8][j % 2]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(model_dir, data, out, *extra):
    return [
        "audit", "--model", str(model_dir), "--data", str(data), "--method", "sample", "--epochs", "1",
        "--batch-size", "8", "--lr", "1e-2", "--max-length", "16", "--canaries", "4", "--canary-digits", "3",
        "--seed", "0", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


SPARSE = "ignore:method sample. the examples of budget.s. 1 are expected to be sampled fewer:UserWarning"


def _brute_force_exposures(folder, texts):
    """Every canary's exposure recomputed from the released model: all 1000 candidates scored, the rank by a
    brute-force sort (the references of the first test)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from idpsgd.audit.lm import sequence_log_likelihoods

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    t = AutoTokenizer.from_pretrained(folder)
    space, _ = sequence_log_likelihoods(model, t, FMT.texts(np.arange(1000)))
    ll, _ = sequence_log_likelihoods(model, t, texts)
    return np.array([math.log2(1000) - math.log2(_brute_force_rank(v, space.tolist())) for v in ll])


def test_scored_exposure_exact_and_estimated_on_a_model(tok):
    """On a GPT-2: the batched scoring equals one forward pass per text, and the audit's exposure is exact
    (every candidate scored) up to exact_limit and an estimate (labelled so) from sampled candidates above it,
    close to the exact values."""
    from idpsgd.audit.lm import LMAuditOptions, audit_canaries, sequence_log_likelihoods

    model = _gpt2(tok, seed=4).eval()  # no dropout in the reference either
    texts = [*FMT.texts([0, 17, 999]), "the quick brown fox jumps"]
    batched, counts = sequence_log_likelihoods(model, tok, texts, batch_size=3)
    with torch.no_grad():
        for text, ll, c in zip(texts, batched, counts, strict=True):
            ids = torch.tensor([tok(text)["input_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            ref = logp.gather(1, ids[0, 1:, None]).sum().item()
            assert ll == pytest.approx(ref, abs=1e-4) and c == ids.shape[1] - 1
    canaries = draw_canaries([1.0, 8.0], 6, FMT, seed=2)
    exact = audit_canaries(model, tok, canaries, {1.0: (1.0, 1e-5), 8.0: (8.0, 1e-5)}, 1e-5,
                           LMAuditOptions(canaries=6, digits=3))  # fmt: skip
    est = audit_canaries(model, tok, canaries, {1.0: (1.0, 1e-5), 8.0: (8.0, 1e-5)}, 1e-5,
                         LMAuditOptions(canaries=6, digits=3, exact_limit=100, candidates=8000))  # fmt: skip
    assert not exact["exposure_is_estimate"] and exact["candidates_scored"] == 1000
    assert est["exposure_is_estimate"] and est["candidates_scored"] == 8000 and "estimate" in est["exposure_method"]
    diff = np.abs(est["_private"]["exposure"] - exact["_private"]["exposure"])
    assert diff.mean() < 0.25, diff


def test_candidates_scored_by_shared_stems_equal_full_scoring_and_rank_each_context(tok):
    """Scoring candidates by their shared stems (all tokens but the last, run once) gives the full texts'
    log-likelihoods; with contexts every canary's exposure is its brute-force rank among the candidates under
    its own context."""
    from idpsgd.audit.lm import LMAuditOptions, audit_canaries, candidate_log_likelihoods, sequence_log_likelihoods

    model = _gpt2(tok, seed=5).eval()
    texts = [*FMT.texts(np.arange(1000)), "the quick brown fox jumps", "a b"]
    full, _ = sequence_log_likelihoods(model, tok, texts, batch_size=64)
    stems = candidate_log_likelihoods(model, tok, texts, batch_size=64)
    assert np.allclose(stems, full, atol=1e-4)
    ctx = CanaryFormat("my code is", 3, contexts=True)
    t = word_tokenizer([*_lines(200), ctx.alphabet_text(8)])
    model = _gpt2(t, seed=6).eval()
    canaries = draw_canaries([1.0, 8.0], 4, ctx, seed=3)
    got = audit_canaries(model, t, canaries, {}, 1e-5, LMAuditOptions(canaries=4, digits=3, contexts=True))
    assert got["canary_format"]["contexts"] and not got["exposure_is_estimate"]
    for i in range(len(canaries)):
        space, _ = sequence_log_likelihoods(model, t, ctx.texts(np.arange(1000), slot=i))
        rank = _brute_force_rank(space[canaries.secret_ids[i]], space.tolist())
        assert got["_private"]["exposure"][i] == pytest.approx(math.log2(1000) - math.log2(rank), abs=1e-6)


def _csv(path):
    import csv

    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.filterwarnings(SPARSE)
def test_audit_command_fine_tunes_with_canaries_and_audits_each_group(model_dir, tmp_path, capsys):
    """``idpsgd audit --model DIR --data FILE``: 4 canaries per group join the 48 rows (held-out ones as null
    rows: N = 56, the plan does not depend on the coins); per group the exposure (exact, |R| = 1000, equal to a
    brute-force ranking of the released model), the one-run bound beside the reported ε, the verdict; the
    canaries private (0600), the summary and figure public in report.json / report.html."""
    out = tmp_path / "out"
    assert main(_argv(model_dir, _data_file(tmp_path / "d.jsonl"), out, "--json")) == 0
    printed = capsys.readouterr().out
    r = json.loads(printed)
    a = r["lm_audit"]
    assert [g["budget"] for g in a["groups"]] == [1.0, 8.0] and a["canaries_per_group"] == 4
    assert [g["count"] for g in r["groups"]] == [28, 28]  # 24 rows + 4 canaries, included or not
    assert a["exposure_method"].startswith("exact") and not a["exposure_is_estimate"]
    for g, run in zip(a["groups"], r["groups"], strict=True):
        assert g["reported_epsilon"] == run["epsilon_spent"] and g["canaries"] == 4
        assert g["empirical_epsilon"] <= g["reported_epsilon"] and g["verdict"] == "passed"
    assert a["audit_passed"] and a["all"]["reported_epsilon"] == max(g["reported_epsilon"] for g in a["groups"])
    rows = _csv(out / "private" / "canaries.csv")
    assert len(rows) == 8 and file_mode(out / "private" / "canaries.csv") == 0o600
    assert all(row["text"].startswith("my code is ") for row in rows)
    assert not any(row["text"] in printed for row in rows)  # no secret on stdout
    exp = np.array([float(row["exposure"]) for row in rows])
    assert np.allclose(exp, _brute_force_exposures(out / "model", [row["text"] for row in rows]))
    included = np.array([row["included"] == "1" for row in rows])
    for g, budget in zip(a["groups"], (1.0, 8.0), strict=True):
        mine = np.array([float(row["budget"]) == budget for row in rows])
        assert g["included"] == int((mine & included).sum())
        if (mine & included).any():
            assert g["exposure_included"]["mean"] == pytest.approx(exp[mine & included].mean())
    ref = bounds.one_run_audit(
        [float(row["score"]) for row in rows[:4]], included[:4], 1e-5, a["multiplicity"]["confidence_per_test"]
    )
    assert a["groups"][0]["one_run"] == ref  # the existing implementation on the canaries' scores and coins
    assert len(_csv(out / "private" / "epsilons.csv")) == 56
    report = json.loads((out / "report.json").read_text())
    assert report["lm_audit"]["groups"][0]["exposure_included"] == a["groups"][0]["exposure_included"]
    assert "private" not in json.dumps(report["lm_audit"]).replace("private/canaries.csv", "")
    html = (out / "report.html").read_text()
    assert "Canary audit" in html and "data:image/png;base64" in html
    assert file_mode(out / "exposure_by_group.png") == 0o644 and file_mode(out / "lm_audit.json") == 0o644
    assert not any(row["text"] in html for row in rows)
    assert file_mode(out / "private" / "lm_audit_settings.json") == 0o600
    # the same seed: the same canaries and coins, the same audit
    again = tmp_path / "again"
    assert main(_argv(model_dir, tmp_path / "d.jsonl", again, "--json")) == 0
    capsys.readouterr()
    assert [row["text"] for row in _csv(again / "private" / "canaries.csv")] == [row["text"] for row in rows]


@pytest.mark.filterwarnings(SPARSE)
def test_audit_command_at_user_level_a_canary_is_a_users_row(model_dir, tmp_path, capsys):
    """With --user-column every canary is the one row of a new user (--canary-users new) or a row of an
    existing user of its group (existing): the run is user level, its groups count users, the audit passes."""
    data = _data_file(tmp_path / "u.jsonl", users=True)
    out = tmp_path / "new"
    assert main(_argv(model_dir, data, out, "--user-column", "user", "--max-rows-per-user", "2", "--json")) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["privacy_unit"] == "user" and [g["count"] for g in r["groups"]] == [12, 12]  # 8 users + 4 canaries
    assert r["lm_audit"]["canary_users"] == "new" and r["lm_audit"]["audit_passed"]
    rows = _csv(out / "private" / "canaries.csv")
    assert len({row["user"] for row in rows}) == 8 and all(row["user"].startswith("idpsgd-canary-") for row in rows)
    out2 = tmp_path / "existing"
    argv = _argv(model_dir, data, out2, "--user-column", "user", "--canary-users", "existing", "--json")
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert [g["count"] for g in r["groups"]] == [8, 8]  # no new user: each canary counts as its user's row
    rows = _csv(out2 / "private" / "canaries.csv")
    assert all(row["user"] in {f"u{j}" for j in range(16)} for row in rows)
    assert all((int(row["user"][1:]) % 2 == 0) == (float(row["budget"]) == 1.0) for row in rows)
    assert r["lm_audit"]["audit_passed"]


@pytest.mark.filterwarnings(SPARSE)
def test_audit_command_canary_contexts_and_repeats_flags(tok, tmp_path, capsys):
    """--canary-contexts: every canary opens with a context word of its own (ranked under it: exact, as the
    library test above checks); --canary-repeats 2 at user level: each canary is 2 rows of a new user of its
    own.  Refused with exit 2 and the value named: repeats at example level or below 1, either flag without
    --data, and contexts with a tokenizer that maps the context words to one token (before training, here and
    in the Trainer path's add_canaries)."""
    ctx = CanaryFormat("my code is", 3, contexts=True)
    folder = tmp_path / "ctx-model"
    t = word_tokenizer([*_lines(200), ctx.alphabet_text(8)])
    _gpt2(t).save_pretrained(folder)
    t.save_pretrained(folder)
    data = _data_file(tmp_path / "u.jsonl", users=True)
    out = tmp_path / "out"
    flags = ("--user-column", "user", "--canary-contexts", "--canary-repeats", "2", "--json")
    assert main(_argv(folder, data, out, *flags)) == 0
    r = json.loads(capsys.readouterr().out)
    fmt = r["lm_audit"]["canary_format"]
    assert fmt["contexts"] and fmt["repeats"] == 2 and r["privacy_unit"] == "user"
    assert [g["count"] for g in r["groups"]] == [12, 12]  # 8 users + 4 canary users per group
    rows = _csv(out / "private" / "canaries.csv")
    assert [row["text"].split()[0] for row in rows] == [ctx.context(i) for i in range(8)]
    assert all(row["text"].split()[1:4] == ["my", "code", "is"] for row in rows)
    assert len({row["user"] for row in rows}) == 8 and r["lm_audit"]["audit_passed"]
    cases = [
        ((str(folder), data, ("--canary-repeats", "2")), "repeated canaries need user level"),
        ((str(folder), data, ("--user-column", "user", "--canary-repeats", "0")), "--canary-repeats=0"),
    ]
    for (model, d, extra), message in cases:
        assert main(_argv(model, d, tmp_path / "x", *extra)) == 2, extra
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit) as exit_:
        main(_argv(folder, data, tmp_path / "x", "--canary-repeats", "x"))
    assert exit_.value.code == 2 and "--canary-repeats='x' is invalid" in capsys.readouterr().err
    plain = tmp_path / "plain-model"  # the module's tokenizer: no context word, all of them [UNK]
    _gpt2(tok).save_pretrained(plain)
    tok.save_pretrained(plain)
    assert main(_argv(plain, data, tmp_path / "x", "--canary-contexts")) == 2
    assert "context words of the canary format" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not (tmp_path / "x" / "model").exists()  # refused before training
    import datasets

    from idpsgd.audit.lm_training import add_canaries

    one = datasets.Dataset.from_dict({"input_ids": [[3, 4]], "epsilon": [1.0]})
    with pytest.raises(InvalidParameterError, match="context words"):  # the Trainer path: before training too
        add_canaries(one, draw_canaries([1.0], 2, ctx, seed=0), tok)
    for extra in (("--canary-contexts",), ("--canary-repeats", "2")):
        argv = ["audit", "--method", "sample", "--budgets", "1", "--fractions", "1", "--out", str(tmp_path / "z")]
        assert main([*argv, *extra]) == 2
        assert "give --data FILE" in capsys.readouterr().err


def test_audit_command_refuses_what_the_language_model_audit_cannot_honour(model_dir, tmp_path, capsys):
    data = _data_file(tmp_path / "d.jsonl")
    cases = [
        (("--attack", "lira"), "attack"),
        (("--budgets-per-class", "0:1,1:2"), "no classes"),
        (("--budgets", "1,8", "--fractions", "0.5,0.5"), "budget column 'epsilon': give the budgets one way"),
        (("--canaries", "1"), "canaries"),
        (("--canary-digits", "0"), "--canary-digits=0 is invalid"),
    ]
    for extra, message in cases:
        assert main(_argv(model_dir, data, tmp_path / "x", *extra)) == 2, extra
        assert message in capsys.readouterr().err, extra
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"text": s, "epsilon": 1.0 + i}) + "\n" for i, s in enumerate(_lines(20))))
    assert main(_argv(model_dir, many, tmp_path / "y")) == 2
    assert "at most 16 groups" in capsys.readouterr().err
    assert main(["audit", "--method", "sample", "--budgets", "1", "--fractions", "1", "--user-column", "u",
                 "--out", str(tmp_path / "z")]) == 2  # fmt: skip
    assert "give --data FILE" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_null_rows_add_nothing_and_other_rows_are_labelled_as_the_lm_collator_labels_them(tok):
    """A held-out canary is a zero-out null row: no label, per-example loss 0 (so gradient 0); every other
    row's labels equal DataCollatorForLanguageModeling's."""
    import datasets
    from transformers import DataCollatorForLanguageModeling

    from idpsgd.audit.lm_training import canary_collator
    from idpsgd.integrations.hf.finetune import null_row_labels
    from idpsgd.integrations.hf.losses import PerExampleLoss

    enc = tok(_lines(6), truncation=True, max_length=16)
    ds = datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    null = np.array([False, True, False, False, True, False])
    batch = canary_collator(tok)([dict(r) for r in null_row_labels(ds, null, tok.pad_token_id)])
    lm = DataCollatorForLanguageModeling(tok, mlm=False)([dict(r) for r in ds])
    assert torch.equal(batch["input_ids"], lm["input_ids"])
    assert torch.equal(batch["labels"][~torch.from_numpy(null)], lm["labels"][~torch.from_numpy(null)])
    assert (batch["labels"][torch.from_numpy(null)] == -100).all()
    model = _gpt2(tok)
    labels = batch.pop("labels")
    loss = PerExampleLoss("causal_lm")(model(**batch), labels)
    assert torch.all(loss[torch.from_numpy(null)] == 0) and torch.all(loss[~torch.from_numpy(null)] > 0)
    grads = torch.autograd.grad(loss[1], list(model.parameters()), allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.filterwarnings(SPARSE)
@pytest.mark.parametrize("level", ["example", "user"])
def test_an_individualized_trainer_run_is_audited_from_python(tok, tmp_path, level):
    """The Trainer path: add_canaries + canary_collator, train, audit_trainer writes the audit into the run
    folder; the bound is checked against the ε the run reports.  At user level each canary is a new user owning
    its 2 repeated rows (the run's groups count users)."""
    import datasets
    from transformers import TrainingArguments

    from idpsgd.audit.lm import LMAuditOptions
    from idpsgd.audit.lm_training import add_canaries, audit_trainer, canary_collator
    from idpsgd.integrations.hf import IndividualizedTrainer, PrivacyArguments

    enc = tok(_lines(40), truncation=True, max_length=16)
    eps = np.where(np.arange(40) % 2 == 0, 1.0, 8.0)
    columns = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "epsilon": eps}
    users = None
    if level == "user":
        columns["user"] = [f"u{i % 20}" for i in range(40)]  # user j: budget [1, 8][j % 2]
        users = np.array([f"u{j}" for j in range(20)]), np.where(np.arange(20) % 2 == 0, 1.0, 8.0)
    ds = datasets.Dataset.from_dict(columns)
    canaries = draw_canaries(
        [1.0, 8.0], 4, FMT, seed=5, user_ids=None if users is None else users[0],
        user_budgets=None if users is None else users[1], repeats=1 if users is None else 2,
    )  # fmt: skip
    user_column = "user" if users is not None else None
    train = add_canaries(ds, canaries, tok, budget_column="epsilon", user_column=user_column, max_length=16)
    assert len(train) == 40 + 8 * canaries.repeats and set(train.column_names) == {*columns, "labels"}
    if users is not None:  # a canary's two rows: its text twice, its user's, one coin
        rows = train.select(range(40, 56))
        assert rows["user"] == np.repeat(canaries.users, 2).tolist()
        assert rows["input_ids"][::2] == rows["input_ids"][1::2]
        labelled = [any(v != -100 for v in x) for x in rows["labels"]]
        assert labelled == np.repeat(canaries.included, 2).tolist()
    out = tmp_path / "run"
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=8, num_train_epochs=1, learning_rate=1e-2,
        save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = IndividualizedTrainer(
        model=_gpt2(tok),
        args=args,
        train_dataset=train,
        processing_class=tok,
        data_collator=canary_collator(tok),
        privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale", seed=3, user_column=user_column),
    )
    with pytest.raises(InvalidParameterError, match="has not trained yet"):
        audit_trainer(trainer, canaries)
    trainer.train()
    a = audit_trainer(trainer, canaries, LMAuditOptions(canaries=4, digits=3))
    assert [g["count"] for g in trainer.report["groups"]] == ([24, 24] if users is None else [14, 14])
    assert trainer.report["privacy_unit"] == level
    assert [g["reported_epsilon"] for g in a["groups"]] == [g["epsilon_spent"] for g in trainer.report["groups"]]
    assert a["audit_passed"] and all(g["empirical_epsilon"] <= g["reported_epsilon"] for g in a["groups"])
    assert json.loads((out / "report.json").read_text())["lm_audit"]["audit_passed"]
    assert file_mode(out / "private" / "canaries.csv") == 0o600
    with pytest.raises(InvalidParameterError, match="nothing else"):
        add_canaries(ds.add_column("extra", [0] * 40), canaries, tok)


# --------------------------------------------------------------------------- the reproduction


def _secrets_of(run: Path) -> list[str]:
    return [row["text"] for row in _csv(run / "private" / "canaries.csv")]


def _public_text(folder: Path) -> str:
    return "".join(
        p.read_text(errors="ignore")
        for p in folder.rglob("*")
        if p.is_file() and "private" not in p.parts and p.suffix in (".json", ".md", ".html")
    )


@pytest.mark.filterwarnings(SPARSE)
def test_reproduce_lm_canaries_tiny(tmp_path, capsys):
    """``idpsgd reproduce lm-canaries`` at a tiny size (the fast twin of the slow test below): the stdlib
    docstring corpus, a private run with three budget groups at user level (each canary a user owning its 4
    repeated rows, under a context word of its own) and the non-private baseline on the same rows and canaries
    for as many steps, each audited; the checks of the issue reported; secrets only in the runs' private/
    (0600), nothing but the result on stdout."""
    from idpsgd.experiments.lm_canaries import stdlib_docstring_corpus

    corpus = stdlib_docstring_corpus(40)
    assert len(corpus) == 40 and all(4 <= len(s.split()) <= 24 for s in corpus)
    assert corpus == stdlib_docstring_corpus(40)  # deterministic
    out = tmp_path / "rep"
    argv = ["reproduce", "lm-canaries", "--rows", "60", "--canaries", "3", "--digits", "3", "--epochs", "2",
            "--batch-size", "8", "--width", "16", "--layers", "1", "--seed", "0",
            "--no-progress", "--out", str(out), "--json"]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["budgets"] == [1.0, 128.0, 1024.0] and r["canaries_per_group"] == 3  # the default budgets
    # the defaults' design: every canary under a context word of its own, 4 rows of a canary user (user level)
    assert (
        r["level"] == "user" and r["canary_repeats"] == 4 and r["private_run"]["lm_audit"]["canary_format"]["contexts"]
    )
    assert r["baseline_steps"] == r["private_run"]["steps"]  # the baseline trains as many steps
    a, b = r["private_run"]["lm_audit"], r["non_private"]["lm_audit"]
    assert [g["budget"] for g in a["groups"]] == [g["budget"] for g in b["groups"]] == [1.0, 128.0, 1024.0]
    assert all(g["reported_epsilon"] <= g["budget"] * (1 + 1e-9) for g in a["groups"])
    assert all(g["reported_epsilon"] is None and g["verdict"] == "not private" for g in b["groups"])
    assert set(r["checks"]) == {
        "exposure_ordered_by_budget",
        "baseline_far_above_every_private_group",
        "every_bound_at_most_reported_epsilon",
    }
    assert r["checks"]["every_bound_at_most_reported_epsilon"]
    med = [g["exposure_included"]["median"] for g in a["groups"]]
    base = [g["exposure_included"]["median"] for g in b["groups"]]
    assert r["far_bits"] == 3.0  # "far above": the baseline's medians at least 3 bits above every private group's
    far = None not in med + base and min(base) >= max(med) + 3.0
    assert r["checks"]["baseline_far_above_every_private_group"] == far
    ranks = [g["exposure_mean_rank"] for g in a["groups"]]  # the ordering: mean ranks among all included canaries
    assert r["checks"]["exposure_ordered_by_budget"] == (None not in ranks and ranks[0] < ranks[1] < ranks[2])
    assert _secrets_of(out / "dp-scale") == _secrets_of(out / "non-private")  # the same canaries
    rows = _csv(out / "dp-scale" / "private" / "canaries.csv")
    assert len({row["text"].split()[0] for row in rows}) == 9 and len({row["user"] for row in rows}) == 9
    for run in ("dp-scale", "non-private"):
        assert file_mode(out / run / "private" / "canaries.csv") == 0o600
        assert (out / run / "exposure_by_group.png").is_file()
    public = _public_text(out)
    assert not any(s in public for s in _secrets_of(out / "dp-scale"))
    assert (out / "lm_canaries.md").read_text().count("| IDP-SGD scale |") == 4
    assert file_mode(out / "private" / "seed.json") == 0o600
    assert main([*argv[:-1], "--overwrite", "--model", "mlp"]) == 2
    assert "builds its GPT-2 from a config" in capsys.readouterr().err


@pytest.mark.slow  # the reproduction's defaults: about 10.5 min of CPU per seed (measured under load)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reproduce_lm_canaries_meets_the_issue(tmp_path, capsys, seed):
    """Issue 52, done when: exposure ordered by budget (the smallest budget lowest), the non-private baseline's
    exposure far above every private group's (its median at least 3 bits above every private median), every
    group's empirical lower bound at or below its reported ε; the ordering compares the groups' mean ranks of the
    included canaries' exposure among all groups' (docs/reproducing.md), on three seeds."""
    out = tmp_path / "rep"
    assert main(["reproduce", "lm-canaries", "--seed", str(seed), "--no-progress", "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    a, b = r["private_run"]["lm_audit"], r["non_private"]["lm_audit"]
    medians = [g["exposure_included"]["median"] for g in a["groups"]]
    base = [g["exposure_included"]["median"] for g in b["groups"]]
    ranks = [g["exposure_mean_rank"] for g in a["groups"]]
    assert all(g["empirical_epsilon"] <= g["reported_epsilon"] for g in [*a["groups"], a["all"]])
    assert ranks[0] < ranks[1] < ranks[2], ranks  # ordered by budget: mean ranks among all included canaries
    assert min(base) >= max(medians) + 3.0, (base, medians)
    assert b["all"]["auc"] > 0.9 and b["all"]["empirical_epsilon"] > 0  # the audit's power without DP
    assert all(r["checks"].values()), r["checks"]
