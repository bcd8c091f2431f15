"""Auditing a fine-tuned language model per privacy group: canary exposure and the one-run bound.

After a model was fine-tuned on data holding secret canaries (:mod:`.canaries`; every group's
canaries with the group's budget, each included with probability 1/2, the rest null rows):

* **exposure** (Carlini et al. 2019, §4): every canary's rank among the candidate secrets by the
  model's log-likelihood of the whole text, exact by brute force when |R| ≤ ``exact_limit``,
  otherwise an **estimate** from ``candidates`` secrets sampled uniformly from R with the paper's
  skew-normal extrapolation (:mod:`.exposure`); its distribution per group, for the included
  canaries and the held-out ones (the reference: what a model that never saw the secret gives);
* **membership inference and an empirical ε per group**: the one-run audit of Steinke, Nasr &
  Jagielski 2023 (:func:`~idpsgd.audit.bounds.one_run_audit`, the same implementation as
  ``idpsgd audit --attack one-run``) with the canaries' inclusion coins and minus the canary text's
  mean token loss as the score; a lower bound per group beside the reported ε.  A bound above the
  reported ε FAILS the audit (each bound at level (1 − confidence)/tests, Bonferroni over the groups
  and all data, as the audit does).

The candidates are scored in batches (one forward pass per batch of texts, right-padded, per-example
token losses of :func:`~idpsgd.integrations.hf.losses.token_losses`); R is scored once and shared
by every canary.

**What is private.**  The canaries' secrets, coins and per-canary scores are the auditor's secret
(``private/canaries.csv``, 0600).  The per-group aggregates (exposure distribution, AUC, the bound)
are computed from the released model and the auditor's own synthetic canaries only — no person's
row enters them except through the model, whose guarantee covers any computation on it — so they
go into the public report (``report.json``'s ``lm_audit``, ``exposure_by_group.png``, report.html).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validation import InvalidParameterError, check_delta
from . import bounds, exposure
from .canaries import (
    DEFAULT_DIGITS,
    DEFAULT_PREFIX,
    USER_MODES,
    Canaries,
    CanaryFormat,
    check_per_group,
    check_repeats,
)

DEFAULT_CANARIES = 32
DEFAULT_CANDIDATES = 4096
EXACT_LIMIT = 100_000
SCORE = "minus the canary text's mean token loss (higher: more likely a member)"


@dataclass(frozen=True)
class LMAuditOptions:
    """The canaries and how the model is scored.

    Attributes:
        canaries: m canaries per privacy group (each included with probability 1/2).
        digits, prefix: the secrets' format (|R| = 10^digits).
        exact_limit: |R| up to which exposure is exact (every candidate scored); above it an estimate.
        candidates: candidates sampled uniformly from R for the estimate.
        contexts: every canary opens with a public context word of its own and is ranked among the
            candidates under that context (:class:`~.canaries.CanaryFormat`).
        repeats: rows per canary, all its user's (user level only).
        users: at user level, ``new`` (a canary is a new user's row) or ``existing`` (a random user's).
        confidence: family-wise confidence of the verdict (Bonferroni over the groups and all data).
        score_batch_size: texts per forward pass when scoring.
    """

    canaries: int = DEFAULT_CANARIES
    digits: int = DEFAULT_DIGITS
    prefix: str = DEFAULT_PREFIX
    contexts: bool = False
    repeats: int = 1
    exact_limit: int = EXACT_LIMIT
    candidates: int = DEFAULT_CANDIDATES
    users: str = "new"
    confidence: float = bounds.CONFIDENCE
    score_batch_size: int = 256

    def __post_init__(self):
        check_per_group(self.canaries)
        CanaryFormat(self.prefix, self.digits, self.contexts)
        check_repeats(self.repeats, True)
        for name in ("exact_limit", "candidates", "score_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < (2 if name == "candidates" else 1):
                raise InvalidParameterError(name, v, "must be an integer >= " + ("2" if name == "candidates" else "1"))
        if self.users not in USER_MODES:
            raise InvalidParameterError("canary_users", self.users, f"must be one of {', '.join(USER_MODES)}")
        bounds.check_confidence(self.confidence)

    @property
    def format(self) -> CanaryFormat:
        return CanaryFormat(self.prefix, self.digits, self.contexts)


# ---------------------------------------------------------------- scoring


def sequence_log_likelihoods(model, tokenizer, texts, *, batch_size: int = 256):
    """(log-likelihood of every text, its number of predicted tokens): Σ_t log p(x_t | x_<t) over the
    text's tokens after the first, in batches of ``batch_size`` (right-padded, attention mask; one
    forward pass per batch).  float64 arrays."""
    texts = list(texts)
    if not texts:
        return np.zeros(0), np.zeros(0)
    ids = _token_ids(tokenizer, texts)
    ll, count, _ = _score_sequences(model, ids, _pad(tokenizer), batch_size)
    return ll, count


def candidate_log_likelihoods(model, tokenizer, texts, *, batch_size: int = 256) -> np.ndarray:
    """The log-likelihoods of :func:`sequence_log_likelihoods` for texts that share most of their
    tokens (the candidates of one format): every distinct **stem** (a text's tokens but the last) is
    run once and the last token's log-probability read from the stem's last position, so the 10^k
    candidates of k digits cost 10^(k−1) sequences — the same sums, a tenth of the forward passes."""
    texts = list(texts)
    if not texts:
        return np.zeros(0)
    ids = _token_ids(tokenizer, texts)
    stems: dict[tuple, int] = {}
    stem_of = np.fromiter((stems.setdefault(tuple(x[:-1]), len(stems)) for x in ids), dtype=np.int64, count=len(ids))
    last = np.fromiter((x[-1] for x in ids), dtype=np.int64, count=len(ids))
    ll, _, next_lp = _score_sequences(model, [list(k) for k in stems], _pad(tokenizer), batch_size, (stem_of, last))
    return ll[stem_of] + next_lp


def _token_ids(tokenizer, texts) -> list:
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    if min(len(x) for x in ids) < 2:
        raise InvalidParameterError("texts", "a text of fewer than 2 tokens", "has no token to predict")
    return ids


def _pad(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _score_sequences(model, ids, pad: int, batch_size: int, next_of=None):
    """(Σ log p over every sequence's tokens after the first, the number of those tokens, and with
    ``next_of`` = (sequence of every query, token of every query) the log-probability of each query's
    token after its sequence's last token); batches of similar lengths, right-padded."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from ..integrations.hf.losses import IGNORE_INDEX, token_losses

    n = len(ids)
    ll, count = np.zeros(n), np.zeros(n)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=n)
    order = np.argsort(lengths, kind="stable")  # similar lengths share a batch: less padding
    next_lp = members = None
    if next_of is not None:
        seq_of, token = next_of
        next_lp = np.zeros(seq_of.size)
        by_seq = np.argsort(seq_of, kind="stable")
        members = np.split(by_seq, np.cumsum(np.bincount(seq_of, minlength=n))[:-1])
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for s in range(0, n, int(batch_size)):
                rows = order[s : s + int(batch_size)]
                seqs = [torch.tensor(ids[i], dtype=torch.long) for i in rows.tolist()]
                x = pad_sequence(seqs, batch_first=True, padding_value=pad).to(device)
                mask = pad_sequence([torch.ones_like(q) for q in seqs], batch_first=True).to(device)
                labels = x.masked_fill(mask == 0, IGNORE_INDEX)
                logits = model(input_ids=x, attention_mask=mask).logits
                total, tokens = token_losses(logits, labels, shift=True)
                ll[rows] = -total.double().cpu().numpy()
                count[rows] = tokens.double().cpu().numpy()
                if next_of is not None:
                    ends = torch.as_tensor(lengths[rows] - 1, device=device)
                    lp = torch.log_softmax(logits[torch.arange(len(rows), device=device), ends].double(), -1)
                    q = np.concatenate([members[i] for i in rows.tolist()])
                    at = np.repeat(np.arange(len(rows)), [members[i].size for i in rows.tolist()])
                    next_lp[q] = (
                        lp[torch.as_tensor(at, device=device), torch.as_tensor(token[q], device=device)].cpu().numpy()
                    )
    finally:
        model.train(was)
    return ll, count, next_lp


def check_format_tokens(tokenizer, fmt: CanaryFormat, slots: int) -> None:
    """Refuse a tokenizer that cannot tell the format's candidates apart: the ten last digits of one
    stem, and with contexts the context words of ``slots`` canaries, must give distinct token
    sequences.  A word-level tokenizer that never saw a digit or a context word maps them all to its
    unknown token; the candidates would then tie, and every exposure would be ≈ 1 bit whatever the
    model learnt — an audit that cannot detect memorisation."""
    digits = fmt.texts(np.arange(10), slot=0 if fmt.contexts else None)
    words = [fmt.context(s) for s in range(int(slots))] if fmt.contexts else []
    for what, texts in (("the ten digits", digits), ("the canaries' context words", words)):
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        if len({tuple(x) for x in ids}) < len(texts):
            raise InvalidParameterError(
                "tokenizer",
                type(tokenizer).__name__,
                f"gives the same tokens to two of {what} of the canary format (unknown words?), so the candidate "
                "secrets would tie: use a tokenizer that knows them (train it with CanaryFormat.alphabet_text(), "
                "which holds no secret)" + (", or leave out the contexts" if words else ""),
            )


def canary_exposure(model, tokenizer, canaries: Canaries, options: LMAuditOptions, rng) -> dict:
    """Every canary's exposure (exact or estimated, see the module) and its log-likelihood.  With a
    shared prefix R is scored once for all canaries; with contexts each canary's candidates are R
    under its own context (|R| texts per canary, or ``candidates`` sampled ones)."""
    fmt = canaries.format
    bs = options.score_batch_size
    canary_ll, canary_tokens = sequence_log_likelihoods(model, tokenizer, canaries.texts, batch_size=bs)
    exact = fmt.space_size <= options.exact_limit
    slots = range(len(canaries)) if fmt.contexts else [None]
    parts = []
    for slot in slots:
        ids = np.arange(fmt.space_size) if exact else rng.integers(0, fmt.space_size, size=options.candidates)
        cand_ll = candidate_log_likelihoods(model, tokenizer, fmt.texts(ids, slot=slot), batch_size=bs)
        mine = np.arange(len(canaries)) if slot is None else np.array([slot])
        if exact:  # the canary's own entry of R: one computation ranks it among the candidates
            part = exposure.exact_exposure(cand_ll[canaries.secret_ids[mine]], cand_ll)
            part["extrapolated"] = np.zeros(mine.size, bool)
            part["samples"] = fmt.space_size
        else:
            part = exposure.estimated_exposure(canary_ll[mine], cand_ll, fmt.space_size)
        parts.append(part)
    exp = {k: parts[0][k] for k in ("space_size", "method", "samples")}
    for k in ("exposure", "rank", "extrapolated"):
        exp[k] = np.concatenate([p[k] for p in parts])
    exp["log_likelihood"] = canary_ll
    exp["tokens"] = canary_tokens
    return exp


# ---------------------------------------------------------------- the audit


def reported_by_group(report: dict | None, delta: float) -> dict:
    """budget -> (reported ε, δ) from a run's report (``groups``' ``epsilon_spent``); {} without one
    (a non-private model: nothing to check the bound against)."""
    out = {}
    for g in (report or {}).get("groups") or []:
        if g.get("epsilon_spent") is not None:
            out[float(g["budget"])] = (float(g["epsilon_spent"]), float(g.get("delta", delta)))
    return out


def audit_canaries(model, tokenizer, canaries: Canaries, reported: dict, delta: float, options=None) -> dict:
    """The audit of a trained model (see the module): per group the exposure of the included and the
    held-out canaries, the AUC of the loss score, the one-run bound and the verdict against the
    reported ε (``reported``: budget -> (ε, δ); empty for a non-private model).

    Returns the result; per-canary arrays under ``"_private"`` (write them only to a 0600 file)."""
    from .runner import per_test_confidence, verdict_tests

    options = options or LMAuditOptions()
    delta = check_delta(delta)
    check_format_tokens(tokenizer, canaries.format, len(canaries))
    rng = np.random.default_rng(np.random.SeedSequence([int(canaries.seed or 0), 5202]))
    exp = canary_exposure(model, tokenizer, canaries, options, rng)
    score = exp["log_likelihood"] / exp["tokens"]  # − mean token loss
    values = canaries.group_budgets
    tests = verdict_tests(values.size, 1)
    conf = per_test_confidence(options.confidence, tests)
    inc = canaries.included
    groups = []
    for g, value in enumerate(values.tolist()):
        mask = canaries.group == g
        eps, d = reported.get(float(value), (None, delta))
        groups.append(_row(float(value), eps, d, mask, inc, score, exp["exposure"], conf))
    for row, mean_rank in zip(
        groups, pooled_mean_ranks(exp["exposure"], canaries.group, inc, values.size), strict=True
    ):
        row["exposure_mean_rank"] = mean_rank
    eps_all = max((e for e, _ in reported.values()), default=None)
    d_all = max((d for _, d in reported.values()), default=delta)
    everyone = _row(None, eps_all, d_all, np.ones(len(canaries), bool), inc, score, exp["exposure"], conf)
    failed = [r["budget"] for r in [*groups, everyone] if r["verdict"] == "FAILED"]
    fmt = canaries.format
    method = (
        "exact (every candidate of R scored)"
        if exp["method"] == "exact"
        else f"estimate: {exp['samples']} candidates sampled uniformly from R, skew-normal extrapolation "
        "beyond the sample (Carlini et al. 2019 §4.3)"
    )
    return {
        "audit": "secret canaries per privacy group: exposure (Carlini et al. 2019) and the one-run bound "
        "(Steinke, Nasr & Jagielski 2023)",
        "canary_format": {
            "prefix": fmt.prefix,
            "digits": fmt.digits,
            "space_size": fmt.space_size,
            "contexts": fmt.contexts,
            "repeats": canaries.repeats,
        },
        "canaries_per_group": canaries.per_group,
        "canary_users": None if canaries.users is None else options.users,
        "exposure_method": method,
        "exposure_is_estimate": exp["method"] != "exact",
        "exposure_max": float(np.log2(fmt.space_size)),
        "candidates_scored": int(exp["samples"]),
        "score": SCORE,
        "confidence": options.confidence,
        "multiplicity": {
            "tests": tests,
            "confidence": options.confidence,
            "confidence_per_test": conf,
            "rule": "Bonferroni over every group and all data: the audit fails by chance with probability "
            f"at most {1 - options.confidence:g}",
        },
        "groups": groups,
        "all": everyone,
        "audit_passed": not failed,
        "failed_groups": failed,
        "_private": {
            "texts": canaries.texts,
            "group": canaries.group,
            "budget": canaries.budgets,
            "included": inc,
            "users": canaries.users,
            "score": score,
            "log_likelihood": exp["log_likelihood"],
            "tokens": exp["tokens"],
            "exposure": exp["exposure"],
            "extrapolated": exp["extrapolated"],
            "seed": canaries.seed,
        },
    }


def pooled_mean_ranks(exposures, group, included, groups: int) -> list:
    """Every group's mean rank of its included canaries' exposure among the included canaries of all
    groups pooled (1: the lowest exposure; ties share their mean rank; None for a group without one):
    the Kruskal–Wallis rank means, a comparison of the groups' exposure that every canary enters and
    no single canary dominates (a group's exposures are heavy-tailed: a few canaries far above the rest)."""
    from scipy.stats import rankdata

    inc = np.asarray(included, bool)
    ranks = rankdata(np.asarray(exposures, float)[inc])
    g = np.asarray(group)[inc]
    return [float(ranks[g == k].mean()) if np.any(g == k) else None for k in range(groups)]


def _row(budget, eps, delta, mask, inc, score, exp, conf) -> dict:
    s, i = score[mask], inc[mask]
    one = bounds.one_run_audit(s, i, delta, conf)
    row = {
        "budget": budget,
        "reported_epsilon": eps,
        "delta": delta,
        "canaries": int(mask.sum()),
        "included": int(i.sum()),
        "exposure_included": exposure.summarize(exp[mask & inc]),
        "exposure_held_out": exposure.summarize(exp[mask & ~inc]),
        "auc": bounds.auc(s, i) if 0 < i.sum() < i.size else None,
        "one_run": one,
        "empirical_epsilon": one["epsilon"],
    }
    if eps is None:
        row["verdict"] = "not private"  # no reported ε to check the bound against
    else:
        row["verdict"] = "FAILED" if one["epsilon"] > eps * (1 + 1e-9) else "passed"
    return row


def public_result(result: dict) -> dict:
    """The result without its per-canary part (what report.json and stdout show)."""
    return {k: v for k, v in result.items() if not k.startswith("_")}
