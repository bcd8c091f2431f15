"""Book-keeping on tiny Hugging Face models of 24 architectures (and a held-out set) against brute force
(issue 36): per-example norms and clipped sums equal one backward pass per example in float64 (1e-8
relative), at T ≠ B and at T = B; a right-padded batch with its attention mask; with LoRA on every model
with attention; under bf16 autocast
(against float32, a loose tolerance); and ``idpsgd finetune`` on a saved folder of each.  The harness
is :mod:`hf_architectures` (``python bench/survey_architectures.py`` prints the whole table).

Every case must be exact.  :data:`KNOWN` lists the cases today's engine does not handle, as strict
xfails that only accept the failure they name: a case known to be *refused* that starts giving a wrong
result fails the suite (a silent misattribution never passes), and a case that becomes exact fails as
an unexpected pass (remove its entry then).

Default suite: four cases (GPT-2 at T = B, BERT at T != B, ViT, T5 at T = B — the silent case) and
``idpsgd finetune`` on GPT-2 and ViT; everything else is ``slow`` (``make test-slow``, or
``pytest -m slow tests/test_hf_architectures.py``).

The survey by enumeration (issue 47, :mod:`hf_enumeration`): a fixed sample of six architectures (causal
LM, padded sequence classification, seq2seq, image, audio) in each idpsgd mode in the default suite, every
architecture of transformers' auto mappings ``slow`` (the survey's recorded failures as strict xfails);
the harness's own checks (independence test, hang and signal, not built); and that docs/architectures.md
is the runner's rendering of bench/results/architectures.json."""

import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_architectures as hf
import hf_enumeration as en


class Refused(AssertionError):
    """The engine refused the case with its own error (it did not train)."""


class Crashed(AssertionError):
    """An error from PyTorch, Opacus or transformers while the engine ran (no refusal of the engine's)."""


class Wrong(AssertionError):
    """The engine returned norms or clipped sums that differ from brute force: a silent misattribution."""


class HarnessError(AssertionError):
    """The model or the reference failed (not the engine)."""


RAISES = {"refused": Refused, "crash": Crashed, "WRONG": Wrong, "error": HarnessError}

_MIXED = "layers saw different batch sizes (the batch dimension guessed by shape)"
_TIE = "a tie with an Embedding subclass of its own forward (scaled embeddings): refused"
_EXPERTS = "the experts module falls back; the fallback re-calls forward without its routing arguments"
_THREE = ("T!=B", "T=B", "mask", "bf16")  # mask, bf16: at T != B first
# (architecture, case) → (the outcome on today's main, why); case: "T!=B", "T=B", "LoRA", "bf16"
KNOWN: dict = {
    # issue 36 (provenance) made every case of the 24 exact; the mixture-of-experts decoders with LoRA, refused
    # then (frozen experts' routing rows), are exact since transformers' eager expert dispatch is a row-by-row map
}


def _case(name, column):
    marks = [] if (name, column) in FAST else [pytest.mark.slow]
    known = KNOWN.get((name, column)) or KNOWN.get((name, "*"))
    if known:
        marks.append(pytest.mark.xfail(strict=True, raises=RAISES[known[0]], reason=f"{known[0]}: {known[1]}"))
    return pytest.param(name, column, marks=marks, id=f"{name}-{column}")


FAST = {("gpt2", "T=B"), ("bert", "T!=B"), ("vit", "T=B"), ("t5", "T=B")}  # T5 at T = B: the silent case
CASES = [
    _case(name, column)
    for name in hf.ALL
    for column in hf.COLUMNS
    if (column != "LoRA" or name in hf.LORA) and (column != "mask" or name in hf.MASKED)
]


def test_every_known_failure_names_a_case():
    ids = {(p.values[0], p.values[1]) for p in CASES}
    assert set(KNOWN) <= ids, set(KNOWN) - ids
    assert set(FINETUNE_KNOWN) <= set(hf.ALL)


def _expect_exact(outcome):
    if outcome.status != "exact":
        raise RAISES[outcome.status](str(outcome))


@pytest.mark.parametrize(("name", "column"), CASES)
def test_norms_and_clipped_sums_equal_brute_force(name, column):
    """Per-example norms and Σ_i min(1, c_i/‖g_i‖) g_i of the engine's book-keeper equal brute force."""
    _expect_exact(hf.run(name, column))


def test_a_wrong_result_is_never_taken_for_exact(monkeypatch):
    """The harness itself: a book-keeper whose clipped sum is off in one parameter (by 1e-6) is reported WRONG;
    an error raised in idpsgd's code counts as a refusal, one raised elsewhere as a crash."""
    from idpsgd.engine.per_example.bk.keeper import BookKeeper

    clipped_sum = BookKeeper.clipped_sum

    def off(self, factors, loss_scale=1.0):
        out = clipped_sum(self, factors, loss_scale)
        p = next(iter(out))
        out[p] = out[p] * (1 + 1e-6)
        return out

    monkeypatch.setattr(BookKeeper, "clipped_sum", off)
    outcome = hf.check("distilbert", 3, 7)
    assert outcome.status == "WRONG" and 1e-9 < outcome.sum_err < 1e-5, outcome

    def refuse(self, loss_scale=1.0):
        raise RuntimeError("refused by the test")

    monkeypatch.setattr(BookKeeper, "norms", refuse)
    outcome = hf.check("distilbert", 3, 7)
    assert outcome.status == "crash" and "refused by the test" in outcome.detail  # raised here, not in idpsgd
    from idpsgd.engine.opacus_compat import refuse_opacus_options

    with pytest.raises(ValueError, match="poisson") as info:
        refuse_opacus_options(poisson_sampling=False)
    assert hf._raised_by_engine(info.value)


# --- idpsgd finetune on a model folder of each architecture ---------------------------------------
# architecture → (the outcome on today's main, why): "traceback" where the command raises instead of its one line
FINETUNE_KNOWN: dict[str, str] = {}  # provenance (issue 36): every architecture trains or exits 2 in one line
FINETUNE_FAST = ("gpt2", "vit")  # one that trains, one refused in one line (no sequence classifier for ViT)


def _finetune_case(name):
    marks = [] if name in FINETUNE_FAST else [pytest.mark.slow]
    if name in FINETUNE_KNOWN:
        marks.append(pytest.mark.xfail(strict=True, raises=Crashed, reason=FINETUNE_KNOWN[name]))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", [_finetune_case(name) for name in hf.ALL])
def test_finetune_runs_or_exits_2_with_one_line(name, tmp_path):
    """``idpsgd finetune`` on a saved folder (save_pretrained, a word-level tokenizer) and 16 JSONL rows with
    budgets: it trains (exit 0), or exits 2 with one line ``idpsgd finetune: error: …``; never a traceback."""
    code, line = hf.finetune(name, tmp_path)
    if code == "traceback":
        raise Crashed(line)
    assert code == 0 or (code == 2 and line.startswith("idpsgd finetune: error: ")), (code, line)


# --- the survey by enumeration (issue 47): every architecture of transformers' auto mappings ----------
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "architectures.json"
PAGE = ROOT / "docs" / "architectures.md"
# the fixed sample of the default suite: a causal LM, a padded sequence classifier, a seq2seq LM, an image
# and an audio classifier; the outcome each idpsgd mode gives today, over T != B, T = B and the padded batch
SAMPLE = {
    ("llama", "causal-lm"): {"bk": "exact", "ghost": "exact", "hooks": "exact"},
    ("llama", "seq-cls"): {"bk": "exact", "ghost": "exact", "hooks": "exact"},  # padded: the last real token
    # the per-layer modes refuse T5's (T, T) relative-bias lookup, naming bk (hooks was silently wrong at T = B)
    ("t5", "seq2seq"): {
        "bk": "exact",
        "ghost": "refused, examples independent",
        "hooks": "refused, examples independent",
    },
    ("vit", "image-cls"): {"bk": "exact", "ghost": "exact", "hooks": "exact"},
    ("wav2vec2", "audio-cls"): {"bk": "exact", "ghost": "exact", "hooks": "exact"},
    # and GPT-2's position lookup with (1, T) ids, shared by the batch
    ("gpt2", "seq-cls"): {
        "bk": "exact",
        "ghost": "refused, examples independent",
        "hooks": "refused, examples independent",
    },
}
BAD = {"crash": Crashed, "WRONG": Wrong, "refused, examples independent": Refused, "error": HarnessError}
_CLASSES = {(t, task): cls for t, task, cls in en.architectures()}


def _survey(model_type, task, modes):
    return en.survey_one(model_type, task, _CLASSES[model_type, task], modes)


def _sample_case(arch, mode):
    expected = SAMPLE[arch][mode]
    marks = []
    if expected in BAD:  # today's failure, named: a strict xfail that accepts only that kind of failure
        marks.append(pytest.mark.xfail(strict=True, raises=BAD[expected], reason=f"{expected} (issue 47's survey)"))
    return pytest.param(arch, mode, marks=marks, id=f"{arch[0]}-{arch[1]}-{mode}")


def _expect_trainable(record, mode):
    """exact, or refused where the examples really interact; anything else raises its kind."""
    status, condition, detail = en.outcome(record, mode)
    if status not in ("exact", "refused, examples interact"):
        raise BAD.get(status, HarnessError)(f"{status} [{condition}]: {detail}")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("arch", "mode"), [_sample_case(a, m) for a in SAMPLE for m in hf.ENGINE_MODES])
def test_the_sample_of_the_enumeration_is_exact_or_truly_refused(arch, mode):
    """One noiseless step of each idpsgd mode equals brute force (norms and clipped sum, float64) at T != B,
    T = B and on a padded batch, or is refused for examples that really interact; never a crash or WRONG."""
    record = _survey(*arch, (mode,))
    assert "not_built" not in record, record["not_built"]
    assert record["conditions"]["T!=B"]["independent"]
    _expect_trainable(record, mode)


@functools.cache
def _recorded():
    """The recorded survey by (model type, task), read once at collection (a 1.7 MB file, 419 cases)."""
    return {(r["model_type"], r["task"]): r for r in json.loads(RESULTS.read_text())["records"]}


def _enumerated_case(arch):
    record = _recorded().get(arch[:2]) if RESULTS.exists() else None
    marks = [pytest.mark.slow]
    bad = sorted({en.outcome(record, m)[0] for m in hf.ENGINE_MODES} & set(BAD)) if record else []
    if record and "not_built" in record:
        marks.append(pytest.mark.skip(reason=f"not built: {record['not_built']}"))
    elif bad:  # the recorded survey's failures: strict, the test fails when one is fixed (re-run the survey)
        marks.append(
            pytest.mark.xfail(strict=True, raises=(Crashed, Wrong, Refused, HarnessError), reason=", ".join(bad))
        )
    return pytest.param(arch, marks=marks, id=en.key(*arch[:2]))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("arch", [_enumerated_case(a) for a in en.architectures()])
def test_every_architecture_is_exact_or_truly_refused(arch, tmp_path):
    """The whole enumeration (slow), each architecture in its own process with a timeout: every idpsgd mode
    exact or refused for a true reason; the architectures recorded failing in bench/results/architectures.json
    are strict xfails (re-run ``python bench/survey_architectures.py --enumerate --fresh`` after a fix)."""
    record = en.run_isolated(arch, hf.ENGINE_MODES, tmp_path / "record.json")
    if "not_built" in record:
        raise HarnessError(record["not_built"])
    for mode in hf.ENGINE_MODES:
        _expect_trainable(record, mode)


def test_the_architectures_page_is_the_runners_output():
    """docs/architectures.md is exactly what the runner renders from bench/results/architectures.json (not edited
    by hand), of the architectures the auto mappings list."""
    results = json.loads(RESULTS.read_text())
    assert PAGE.read_text() == en.render(results)
    assert {(r["model_type"], r["task"]) for r in results["records"]} <= {a[:2] for a in en.architectures()}
    assert results["enumerated"] == len(en.architectures())


def test_the_independence_test_tells_interacting_examples_from_independent_ones():
    """The check behind "refused, examples interact": batch norm in training mode mixes the batch, a linear
    layer does not."""
    import torch
    from torch import nn

    x, y = torch.randn(4, 3, 5, dtype=torch.float64), torch.tensor([0, 1, 0, 1])

    def loss(model, inputs):
        return nn.functional.cross_entropy(model(inputs["x"]), inputs["y"], reduction="none")

    mixing = nn.Sequential(nn.BatchNorm1d(3), nn.Flatten(), nn.Linear(15, 2))
    for model, independent in ((nn.Sequential(nn.Flatten(), nn.Linear(15, 2)), True), (mixing, False)):
        case = hf.Case(model.double().train(), {"x": x, "y": y}, loss, 1)
        assert en.independence(case)[0] is independent


def _hang(*args):
    import time

    time.sleep(60)


def _segfault(*args):
    import faulthandler
    import os
    import signal

    faulthandler.disable()  # (pytest's traceback dump of the child: noise)
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.parametrize(("target", "why"), [(_hang, "crash: timeout"), (_segfault, "crash: signal")])
def test_a_hang_or_a_signal_is_a_crash_cell_not_the_end_of_the_survey(target, why, tmp_path):
    arch = ("gpt2", "causal-lm", "GPT2LMHeadModel")
    record = en.run_isolated(arch, hf.ENGINE_MODES, tmp_path / "r.json", timeout=2.0, target=target)
    status, _condition, detail = en.outcome(record, "bk")
    assert f"{status}: {detail}".startswith(why), record
    assert json.loads((tmp_path / "r.json").read_text()) == record  # written for the resumed survey


def test_an_architecture_that_cannot_be_built_is_not_built_not_an_engine_outcome():
    record = en.survey_one("gpt2", "causal-lm", "NoSuchModelClass", hf.ENGINE_MODES)
    assert record["not_built"].startswith("NoSuchModelClass is not importable")
    assert {en.outcome(record, m)[0] for m in hf.MODES} == {en.HARNESS}
    assert en.summary([record])["counts"]["bk"][en.HARNESS] == 1
