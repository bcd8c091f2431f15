"""``idpsgd reproduce lm-canaries``: do smaller budgets protect the secrets of a fine-tuned language model?
(Carlini et al. 2019, "The Secret Sharer"; Steinke, Nasr & Jagielski 2023; Boenisch et al. 2023).

**Corpus.**  Offline, shipped with Python itself: the docstrings (``inspect.getdoc``) of the public
functions, classes and methods of the standard-library modules :data:`MODULES` of the running
interpreter, cut into sentences of 4 to 24 words (:func:`stdlib_docstring_corpus`; the first
``rows`` of them in module and name order).  A word-level tokenizer is trained on the corpus and the
canary format's public words (never on a secret).

**Model.**  A small GPT-2 (``GPT2LMHeadModel``, 2 layers, width 64, 2 heads) built from a config with a
seed derived from ``--seed`` — the same public starting point for every run.

**Runs.**  Three budget groups (``--budgets``, default ε = 1, 128, 1024, a third of the rows each;
δ = 1e-5) with ``canaries`` secret canaries per group (default 64), each included with probability
1/2 (held-out ones are null rows).  A canary is ``"⟨context⟩ my code is ⟨3 random digits⟩"``
(|R| = 10^3), each under a public context word of its own (``--no-contexts``: one shared prefix — then
the canaries compete for one next-digit distribution and the model learns their mixture) and
inserted ``repeats`` times (default 4) as the rows of a **canary user** of its own: the runs are then
at user level, every docstring row a user of its own, so the group's user-level ε covers all the
canary's rows (``--repeats 1``: one row each, example level).  Fine-tuned with IDP-SGD Scale
(``--method``; Boenisch et al.) through :func:`idpsgd.audit.lm_training.audit_finetune`; then the
**non-private baseline**: the same rows and canaries, plain ``transformers.Trainer`` fine-tuning (no
clipping, no noise), as many steps as the private run took — the audit's power: without DP the
canaries are memorised.

**Measured.**  Per group: the exposure of the included and the held-out canaries (exact: all of R
candidates scored), the AUC of the loss score, the one-run empirical ε lower bound beside the
reported ε.  Checked, and printed as PASS/FAIL lines: the exposure of the included canaries ordered by
budget (the smallest budget's lowest), compared by each group's mean rank among the included canaries
of all groups pooled (:func:`idpsgd.audit.lm.pooled_mean_ranks`); the baseline's median at least
:data:`FAR_BITS` above every private group's median ("far above"); every bound at or below its
reported ε.
"""

from __future__ import annotations

import time

from ..io import atomic_open
from .registry import SEED, Experiment, Option, at_least_one, positive, register

#: the standard-library modules whose docstrings make the corpus (public, offline, in every Python)
MODULES = (
    "abc", "argparse", "array", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "datetime", "decimal", "difflib", "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "operator", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "secrets", "shlex", "shutil", "socket",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "timeit", "tokenize", "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip
#: the groups' budgets, the second, pre-registered design of docs/reproducing.md: not realistic privacy, but
#: groups for showing that the audit orders budgets (ε = 1 leaks nothing measurable, 1024 clearly, 128 in
#: between); at the realistic "1,8,64" the two smaller groups both leak nothing and their order is chance
BUDGETS = "1,128,1024"
DELTA = 1e-5
#: "far above" in the issue's done-when, made a number: the non-private baseline's median exposure at
#: least this many bits above every private group's (its canaries ranked at least 2^3 = 8 times higher)
FAR_BITS = 3.0


def stdlib_docstring_corpus(rows: int) -> list[str]:
    """The first ``rows`` sentences (4–24 words, one per row) of the docstrings of :data:`MODULES`:
    the module's, then its public functions' and classes' (and their public methods'), in name
    order; whitespace collapsed, duplicates dropped.  Deterministic for one Python version."""
    import importlib
    import inspect
    import re
    import warnings

    seen, out = set(), []

    def add(doc):
        for part in re.split(r"(?<=[.!?])\s+|\n\s*\n", doc or ""):
            text = " ".join(part.split())
            if 4 <= len(text.split()) <= 24 and text not in seen and ">>>" not in text:
                seen.add(text)
                out.append(text)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            mod = importlib.import_module(name)
            add(inspect.getdoc(mod))
            for attr in sorted(a for a in dir(mod) if not a.startswith("_")):
                obj = getattr(mod, attr, None)
                if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                    continue
                add(inspect.getdoc(obj))
                if inspect.isclass(obj):
                    for meth in sorted(m for m in vars(obj) if not m.startswith("_")):
                        add(inspect.getdoc(getattr(obj, meth, None)))
                if len(out) >= rows:
                    return out[:rows]
    if len(out) < rows:
        from ..validation import InvalidParameterError

        raise InvalidParameterError("rows", rows, f"the corpus has {len(out)} sentences here; use at most that many")
    return out[:rows]


def _budget_values(text) -> list[float]:
    """The groups' budgets from ``a,b,c`` (each group a equal share of the rows)."""
    from ..assignment import parse_float_list
    from ..validation import InvalidParameterError

    values = parse_float_list(str(text), "budgets")
    if len(values) < 2 or len(set(values)) != len(values) or min(values) <= 0:
        raise InvalidParameterError("budgets", text, "must be at least two distinct budgets > 0, e.g. 1,4,16")
    return sorted(values)


def _tokenizer(texts, alphabet: str, vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[EOS]"]
    tk.train_from_iterator(
        [*texts, *[alphabet] * 4], trainers.WordLevelTrainer(vocab_size=vocab, min_frequency=2, special_tokens=special)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def _base_model(folder, tok, seed: int, width: int, layers: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=tok.vocab_size,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        n_positions=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def _non_private(base, texts, null, canaries, out_dir, *, steps, batch_size, lr, max_length, seed, audit):
    """The same rows and canaries fine-tuned without DP (``transformers.Trainer``, batches of
    ``batch_size`` for ``steps`` steps), then audited."""
    import datasets
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..audit.lm import audit_canaries
    from ..audit.lm_report import write_lm_audit
    from ..audit.lm_training import canary_collator
    from ..integrations.hf.finetune import load_tokenizer, null_row_labels
    from ..runfolder import RunFolder

    tok = load_tokenizer(base)
    enc = tok(texts, truncation=True, max_length=max_length)
    ds = datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    ds = null_row_labels(ds, null, tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    folder = RunFolder(out_dir, overwrite=True)
    args = TrainingArguments(
        output_dir=str(folder.path / "private" / "trainer"),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=lr,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=seed,
        dataloader_pin_memory=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=canary_collator(tok))
    trainer.remove_callback(PrinterCallback)  # nothing on stdout but the command's own output
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    result = audit_canaries(model, tok, canaries, {}, DELTA, audit)
    return write_lm_audit(folder, result), result


def run_lm_canaries(
    data=None,
    rows: int = 300,
    budgets: str = BUDGETS,
    method: str = "scale",
    canaries: int = 64,
    digits: int = 3,
    contexts: bool = True,
    repeats: int = 4,
    epochs: int = 150,
    batch_size: int = 32,
    lr: float = 1e-2,
    baseline_lr: float = 1e-2,
    clip_norm: float = 1.0,
    width: int = 64,
    layers: int = 2,
    max_length: int = 32,
    progress: bool = True,
    model: str | None = None,
    seed: int | None = None,
    out=None,
) -> dict:
    """Run the reproduction (module docstring) into the run folder ``out``: ``dp-<method>/`` (the private
    run with its audit) and ``non-private/`` (the baseline's audit); returns the comparison."""
    from ..assignment import Budgets
    from ..audit.canaries import with_canaries
    from ..audit.lm import LMAuditOptions
    from ..audit.lm_training import audit_finetune
    from ..engine.noise.randomness import derive_seed
    from ..integrations.hf.finetune import FinetuneOptions
    from ..integrations.hf.text_data import TextData
    from ..users import Users
    from ..validation import InvalidParameterError
    from .summary import randomness, repetition_seeds

    if model is not None:
        raise InvalidParameterError("model", model, "lm-canaries builds its GPT-2 from a config (--width, --layers)")
    if data is not None and getattr(data, "name", "digits") != "digits":
        raise InvalidParameterError("dataset", data.name, "lm-canaries trains on its own corpus (stdlib docstrings)")
    if out is None:
        raise InvalidParameterError("out", None, "lm-canaries needs a run folder")
    t0 = time.time()
    base_seed, (run_seed,) = repetition_seeds(seed, 1)
    corpus = stdlib_docstring_corpus(rows)
    values = _budget_values(budgets)
    audit = LMAuditOptions(canaries=canaries, digits=digits, contexts=contexts, repeats=repeats)
    fmt = audit.format
    tok = _tokenizer(corpus, fmt.alphabet_text(canaries * len(values)), 4000)
    base = out.path / "base_model"
    out.save_directory(
        "base_model",
        "public",
        "the starting point: a GPT-2 built from a config and the tokenizer trained on the public corpus",
        lambda p: _base_model(p, tok, derive_seed(run_seed, 1), width, layers),
    )
    budgets = Budgets.from_groups(
        values, [1 / len(values)] * len(values), len(corpus), DELTA, seed=derive_seed(run_seed, 2)
    )
    # repeated canaries are their users' rows: user level, every docstring row a user of its own
    users = Users([f"row-{i:05d}" for i in range(len(corpus))], repeats) if repeats > 1 else None
    train = TextData(
        corpus,
        None,
        budgets.epsilons,
        ["text", "epsilon"],
        {"format": "corpus", "file": "stdlib"},
        users=None if users is None else [str(u) for u in users.ids[users.unit_of_row]],
    )
    _check_method("method", method)
    options = FinetuneOptions(
        method=method,
        epochs=float(epochs),
        batch_size=batch_size,
        lr=lr,
        max_grad_norm=clip_norm,
        max_length=max_length,
        seed=derive_seed(run_seed, 3),
        progress=progress,
    )
    t1 = time.time()
    dp = audit_finetune(
        base, train, budgets, out.path / f"dp-{method}", options=options, audit=audit, users=users, overwrite=True
    )
    t2 = time.time()
    # the baseline trains on the very rows and canaries of the private run (the same design seed), for
    # as many steps as the private run took
    from ..audit.canaries import draw_canaries
    from ..audit.lm_training import DESIGN_PATH

    canary_set = draw_canaries(
        values,
        canaries,
        fmt,
        seed=derive_seed(options.seed, DESIGN_PATH),
        user_ids=None if users is None else users.ids,
        user_budgets=None if users is None else budgets.epsilons,
        repeats=repeats,
    )
    user_rows = None if users is None else train.users
    texts, _, _, null, _ = with_canaries(
        corpus, budgets.epsilons[users.unit_of_row] if users else budgets.epsilons, canary_set, user_rows
    )
    baseline, _ = _non_private(
        base,
        texts,
        null,
        canary_set,
        out.path / "non-private",
        steps=int(dp["steps"]),
        batch_size=batch_size,
        lr=baseline_lr,
        max_length=max_length,
        seed=derive_seed(run_seed, 4) % 2**32,
        audit=audit,
    )
    t3 = time.time()
    a = dp["lm_audit"]
    # the median of the included canaries' exposure: robust to the heavy upper tail of a few canaries
    med = [g["exposure_included"]["median"] for g in a["groups"]]
    base_med = [g["exposure_included"]["median"] for g in baseline["groups"]]
    ranks = [g["exposure_mean_rank"] for g in a["groups"]]
    known = all(x is not None for x in [*med, *base_med, *ranks])
    checks = {
        # the groups' mean ranks of exposure among the included canaries of all groups pooled
        "exposure_ordered_by_budget": known and all(ranks[k] < ranks[k + 1] for k in range(len(ranks) - 1)),
        "baseline_far_above_every_private_group": known and min(base_med) >= max(med) + FAR_BITS,
        "every_bound_at_most_reported_epsilon": all(
            g["empirical_epsilon"] <= g["reported_epsilon"] for g in [*a["groups"], a["all"]]
        ),
    }
    return {
        "experiment": "lm-canaries",
        "corpus": f"docstrings of {len(MODULES)} standard-library modules (Python "
        f"{'.'.join(map(str, __import__('sys').version_info[:3]))}), {len(corpus)} sentences",
        "modules": list(MODULES),
        "model": f"GPT2LMHeadModel from a config: {layers} layers, width {width}, 2 heads, vocabulary {tok.vocab_size}",
        "method": method,
        "budgets": values,
        "delta": DELTA,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "baseline_lr": baseline_lr,
        "clip_norm": clip_norm,
        "canaries_per_group": canaries,
        "canary_repeats": repeats,
        "level": "user" if users is not None else "example",
        "canary_format": a["canary_format"],
        "private_run": {"steps": dp["steps"], "noise_multiplier": dp["noise_multiplier"], "lm_audit": a},
        "non_private": {"lm_audit": baseline},
        "baseline_steps": int(dp["steps"]),
        "checks": checks,
        "far_bits": FAR_BITS,
        "randomness": randomness(False),
        "seconds": {"total": time.time() - t0, "private_run": t2 - t1, "baseline": t3 - t2},
        "private": {"seed": base_seed},
    }


def _markdown(r) -> str:
    a, b = r["private_run"]["lm_audit"], r["non_private"]["lm_audit"]
    lines = [
        f"Canary audit of a fine-tuned GPT-2 ({r['model']}) on {r['corpus']}; IDP-SGD {r['method']}, "
        f"{r['private_run']['steps']} steps, σ = {r['private_run']['noise_multiplier']:.3f}, {r['level']} level; "
        f"{r['canaries_per_group']} canaries per group"
        + (" (each under a context word of its own)" if a["canary_format"].get("contexts") else "")
        + (f", {r['canary_repeats']} rows each (its user's)" if r["canary_repeats"] > 1 else "")
        + f", |R| = {a['canary_format']['space_size']}, exposure {a['exposure_method']} (max "
        f"{a['exposure_max']:.2f} bits); the baseline: the same rows, {r['baseline_steps']} steps",
        "",
        "| run | budget | reported ε | exposure, included: mean (median) | mean rank, pooled | exposure, held out "
        "| AUC | ε lower bound | audit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ex(s):
        return "n/a" if s["mean"] is None else f"{s['mean']:.2f} ({s['median']:.2f})"

    def rank(g):
        return "—" if g.get("exposure_mean_rank") is None else f"{g['exposure_mean_rank']:.1f}"

    for name, audit in ((f"IDP-SGD {r['method']}", a), ("non-private", b)):
        for g in [*audit["groups"], audit["all"]]:
            budget = "all" if g["budget"] is None else f"{g['budget']:g}"
            rep = "—" if g["reported_epsilon"] is None else f"{g['reported_epsilon']:.3f}"
            auc = "n/a" if g["auc"] is None else f"{g['auc']:.3f}"
            lines.append(
                f"| {name} | {budget} | {rep} | {ex(g['exposure_included'])} | {rank(g)} "
                f"| {ex(g['exposure_held_out'])} | {auc} "
                f"| {g['empirical_epsilon']:.3f} | {g['verdict']} |"
            )
    lines.append("")
    for k, v in r["checks"].items():
        lines.append(f"- {'PASS' if v else 'FAIL'}: {k.replace('_', ' ')}")
    s = r["seconds"]
    lines.append(f"\n{s['total']:.0f} s (private run {s['private_run']:.0f} s, baseline {s['baseline']:.0f} s)")
    return "\n".join(lines) + "\n"


def write_lm_canaries(out, r) -> list[str]:
    from .summary import record_seed

    out.write_json(
        "lm_canaries.json",
        {k: v for k, v in r.items() if k != "private"},
        "public",
        "the canary audit per group of the private run and the non-private baseline (aggregates)",
    )
    with atomic_open(out.file("lm_canaries.md", "public", "the comparison as markdown"), "w") as fh:
        fh.write(_markdown(r))
    return ["lm_canaries.json", "lm_canaries.md", "base_model", *record_seed(out, r)]


def _text(r) -> str:
    return _markdown(r) + f"files in {r['out']}: {', '.join(r['files'])}; the runs: dp-{r['method']}/, non-private/"


def _check_method(name, value) -> None:
    from ..names import FIXED_SIGMA_METHODS
    from ..validation import InvalidParameterError

    if value not in FIXED_SIGMA_METHODS:
        raise InvalidParameterError(
            name, value, f"must be {' or '.join(FIXED_SIGMA_METHODS)} (IDP-SGD, Boenisch et al.)"
        )


def _check_budgets(name, value) -> None:
    _budget_values(value)


register(
    Experiment(
        "lm-canaries",
        "canary exposure and the one-run empirical epsilon per budget group of a fine-tuned GPT-2",
        run_lm_canaries,
        write_lm_canaries,
        options=(
            Option("rows", "sentences of the standard-library docstring corpus", at_least_one),
            Option("budgets", "the groups' budgets (an equal share of the rows each)", _check_budgets),
            Option("method", "IDP-SGD method of the private run: sample or scale", _check_method),
            Option("canaries", "secret canaries per budget group (each included with probability 1/2)", at_least_one),
            Option("digits", "random digits per secret (|R| = 10^digits; exact exposure up to 10^5)", at_least_one),
            Option("contexts", "every canary opens with a public context word of its own (--no-contexts: one prefix)"),
            Option(
                "repeats", "rows per canary, all of its own user's (above 1: the runs are at user level)", at_least_one
            ),
            Option(
                "epochs", "passes over the data of the private run (the baseline trains as many steps)", at_least_one
            ),
            Option("batch_size", "expected batch size (both runs)", at_least_one),
            Option("lr", "AdamW learning rate of the private run", positive),
            Option("baseline_lr", "AdamW learning rate of the non-private baseline", positive),
            Option("clip_norm", "clip norm of the private run", positive),
            Option("width", "GPT-2 width (n_embd)", at_least_one),
            Option("layers", "GPT-2 layers", at_least_one),
            Option("max_length", "tokens per row after truncation", at_least_one),
            SEED,
        ),
        text=_text,
        out_help="folder: lm_canaries.json/.md, base_model/, the runs dp-METHOD/ and non-private/ (each with "
        "report.html and private/canaries.csv)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else "",
        model_help="not used: the GPT-2 is built from a config (--width, --layers)",
    )
)
