"""Secret canaries per privacy group for auditing language models (Carlini et al. 2019, "The Secret
Sharer", §3–4; Steinke, Nasr & Jagielski 2023, Alg. 1).  numpy only.

A canary is a random secret in a fixed format, ``"<prefix> d₁ d₂ … d_k"`` (k digits, each a
separate word so that every tokenizer sees every digit), drawn uniformly and without repetition
from the candidate space R of the 10^k secrets.  Every budget group receives ``per_group`` canaries
with the group's budget; each canary is **included** with probability 1/2, independently (the
inclusion coins S of Steinke et al.'s Alg. 1); the others are the held-out reference.

Every canary, included or not, is a row of the training data, so N and every group's size — public
inputs of the guarantee — do not depend on the coins (:mod:`idpsgd.accounting.neighbouring`): a
held-out canary is a **null row** (zero-out: sampled like any row, all of its tokens unlabelled, so
its loss is 0 and it adds nothing to the clipped sum; :mod:`idpsgd.integrations.hf.losses`).  The
one-run audit's inclusion coins are then exactly the zero-out relation the reported ε is stated for.

At user level a canary is one row of a user: of a new user of its own (``users="new"``, the
default: the canary's membership is that user's) or of an existing user of the group, chosen at
random (``users="existing"``: the canary counts as that user's row, and the user-level guarantee of
the user bounds what the model reveals of it).

The design (secrets, groups, coins) is drawn from the auditor's seed; in secure mode a given seed is
refused, as elsewhere, and the design draws a fresh one (it must be recorded: the audit must know
the coins to score them — the design is the auditor's randomness, not the mechanism's).
"""

from __future__ import annotations

import math
import secrets as _secrets
from dataclasses import dataclass

import numpy as np

from ..validation import InvalidParameterError

DEFAULT_PREFIX = "my code is"
DEFAULT_DIGITS = 6
USER_MODES = ("new", "existing")
MAX_GROUPS = 16  # canaries per distinct budget: budgets must come in groups
CANARY_USER = "idpsgd-canary-"  # the id prefix of new canary users
MAX_CONTEXTS = 25 * 26 * 26  # distinct context words (CanaryFormat.context)


@dataclass(frozen=True)
class CanaryFormat:
    """The format of the secrets: ``prefix`` then ``digits`` decimal digits separated by spaces.

    With ``contexts`` every canary slot ``i`` (its index in the design) opens with a public context
    word of its own, :meth:`context` (``"xbaa my code is 3 1 4 1"``): the canaries then do not share
    one prefix whose next-digit distribution they would all pull at (with a shared prefix a model
    learns the digits' mixture over the canaries rather than each secret), and each canary's
    candidate space is R under its own context (Carlini et al. §3: the format s[r] is public, only r
    is secret).  The context is the first word, so a causal model is never trained to predict it."""

    prefix: str = DEFAULT_PREFIX
    digits: int = DEFAULT_DIGITS
    contexts: bool = False

    def __post_init__(self):
        if not isinstance(self.prefix, str) or not self.prefix.strip():
            raise InvalidParameterError("canary_prefix", self.prefix, "must be a non-empty text")
        d = self.digits
        if isinstance(d, bool) or int(d) != d or not 1 <= d <= 18:
            raise InvalidParameterError("canary_digits", d, "must be an integer in 1..18 (|R| = 10^digits)")
        if not isinstance(self.contexts, bool):
            raise InvalidParameterError("canary_contexts", self.contexts, "must be True or False")
        object.__setattr__(self, "digits", int(d))
        object.__setattr__(self, "prefix", self.prefix.strip())

    @property
    def space_size(self) -> int:
        """|R| = 10^digits."""
        return 10**self.digits

    def secret_digits(self, ids) -> np.ndarray:
        """The digits (shape (n, digits)) of secrets given as integers in [0, |R|)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1, 1)
        powers = 10 ** np.arange(self.digits - 1, -1, -1, dtype=np.int64)
        return (ids // powers) % 10

    @staticmethod
    def context(slot: int) -> str:
        """The public context word of canary slot ``slot`` (0 ≤ slot < :data:`MAX_CONTEXTS`): ``x``
        then three letters (``xbaa``, ``xbab``, …; no English word, so it occurs in no corpus)."""
        if isinstance(slot, bool) or int(slot) != slot or not 0 <= slot < MAX_CONTEXTS:
            raise InvalidParameterError("canary_slot", slot, f"must be an integer in 0..{MAX_CONTEXTS - 1}")
        a, rest = divmod(int(slot), 26 * 26)
        b, c = divmod(rest, 26)
        return "x" + "".join(chr(ord("a") + v) for v in (a + 1, b, c))

    def texts(self, ids, slot: int | None = None, slots=None) -> list[str]:
        """The texts ``"<prefix> d₁ … d_k"`` of secrets given as integers in [0, |R|); with
        :attr:`contexts` each opens with the context of its slot (``slot``: one for all, e.g. the
        candidate space of one canary; ``slots``: one per secret)."""
        rows = self.secret_digits(ids).tolist()
        if not self.contexts:
            return [f"{self.prefix} {' '.join(map(str, row))}" for row in rows]
        if (slot is None) == (slots is None):
            raise InvalidParameterError("slots", None, "a format with contexts needs the canary slot of every text")
        names = [self.context(slot)] * len(rows) if slot is not None else [self.context(s) for s in slots]
        if len(names) != len(rows):
            raise InvalidParameterError("slots", f"{len(names)} values", f"need one per secret ({len(rows)})")
        return [f"{n} {self.prefix} {' '.join(map(str, row))}" for n, row in zip(names, rows, strict=True)]

    def alphabet_text(self, slots: int = 0) -> str:
        """Every word the format uses (the prefix, the ten digits and, with :attr:`contexts`, the
        contexts of ``slots`` canaries): public, for training a tokenizer that knows the format without
        ever seeing a secret."""
        names = [self.context(s) for s in range(slots)] if self.contexts else []
        return " ".join([self.prefix, *map(str, range(10)), *names])


@dataclass(frozen=True)
class Canaries:
    """The canaries of one audit (private: the secrets and the coins are what the attack guesses).

    Attributes:
        format: the :class:`CanaryFormat`.
        secret_ids: each canary's secret as an integer in [0, |R|) (distinct).
        group: each canary's privacy group (index into ``group_budgets``).
        group_budgets: the budget ε of every group, ascending.
        included: the inclusion coins (True: trained on; False: a null row, the held-out reference).
        users: at user level, each canary's user id; None at example level.
        seed: the design's seed (private).
        repeats: rows per canary (user level only: all of them its user's, so the user-level
            guarantee covers every repeat; one inclusion coin for all).
    """

    format: CanaryFormat
    secret_ids: np.ndarray
    group: np.ndarray
    group_budgets: np.ndarray
    included: np.ndarray
    users: list | None = None
    seed: int | None = None
    repeats: int = 1

    def __len__(self) -> int:
        return int(self.secret_ids.size)

    def __repr__(self) -> str:  # never the secrets or the coins
        return f"Canaries({len(self)} in {self.group_budgets.size} groups, {self.format})"

    @property
    def texts(self) -> list[str]:
        """Every canary's text (with contexts: canary i under the context of slot i)."""
        slots = np.arange(len(self)) if self.format.contexts else None
        return self.format.texts(self.secret_ids, slots=slots)

    @property
    def budgets(self) -> np.ndarray:
        """Each canary's budget ε (its group's)."""
        return self.group_budgets[self.group]

    @property
    def per_group(self) -> int:
        return int(np.bincount(self.group, minlength=self.group_budgets.size).max())


def design_seed(seed, secure_mode: bool) -> int:
    """The design's seed: the given one, or a fresh one from OS entropy (secure mode refuses a given
    seed, as :func:`~idpsgd.engine.noise.randomness.resolve_seed` does)."""
    from ..engine.noise.randomness import resolve_seed

    resolved = resolve_seed(seed, secure_mode)
    return int(resolved) if resolved is not None else _secrets.randbits(63)


def check_per_group(per_group) -> int:
    if isinstance(per_group, bool) or int(per_group) != per_group or per_group < 2:
        raise InvalidParameterError("canaries", per_group, "must be an integer >= 2 (canaries per privacy group)")
    return int(per_group)


def draw_canaries(
    group_budgets,
    per_group: int,
    fmt: CanaryFormat | None = None,
    *,
    seed: int | None = None,
    secure_mode: bool = False,
    user_ids=None,
    user_budgets=None,
    users: str = "new",
    repeats: int = 1,
) -> Canaries:
    """Draw ``per_group`` canaries for every budget in ``group_budgets`` (distinct secrets uniform
    from R, independent fair inclusion coins).

    Args:
        group_budgets: the privacy groups' budgets (the distinct ε of the run).
        per_group: m canaries per group (>= 2); m·groups must not exceed |R|/2.
        seed: the design's seed (None: a fresh recorded one; refused in secure mode).
        user_ids, user_budgets: at user level, the distinct existing user ids and each one's budget.
        users: ``new`` (each canary a new user of its own) or ``existing`` (a random existing user of
            the canary's group; needs ``user_ids`` and ``user_budgets``).
        repeats: r rows per canary, all its user's (Carlini et al. insert a canary several times);
            at user level only — at example level each repeat would be a row of its own, and the
            group's ε, stated per row, would not cover the canary (group privacy over r rows would).
    """
    fmt = fmt or CanaryFormat()
    values = np.unique(np.asarray(group_budgets, dtype=float))
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise InvalidParameterError("budgets", group_budgets, "need at least one finite budget > 0")
    if values.size > MAX_GROUPS:
        raise InvalidParameterError(
            "budgets",
            f"{values.size} distinct values",
            f"the canary audit puts canaries into every budget group: give at most {MAX_GROUPS} groups "
            "(e.g. --budgets with --fractions, or a budget column with few values)",
        )
    m = check_per_group(per_group)
    total = m * values.size
    if total > fmt.space_size // 2:
        raise InvalidParameterError(
            "canaries",
            m,
            f"{total} canaries need a candidate space of at least {2 * total} secrets; the format has "
            f"{fmt.space_size} (use more digits)",
        )
    if fmt.contexts and total > MAX_CONTEXTS:
        raise InvalidParameterError("canaries", m, f"{total} canaries: a format with contexts has {MAX_CONTEXTS}")
    if users not in USER_MODES:
        raise InvalidParameterError("canary_users", users, f"must be one of {', '.join(USER_MODES)}")
    r = check_repeats(repeats, user_ids is not None)
    seed = design_seed(seed, secure_mode)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 5201]))
    ids = _distinct(rng, fmt.space_size, total)
    group = np.repeat(np.arange(values.size), m)
    included = rng.random(total) < 0.5  # Steinke et al. Alg. 1: independent fair coins
    owners = None
    if user_ids is not None:
        owners = _owners(rng, group, values, user_ids, user_budgets, users)
    elif users != "new":
        raise InvalidParameterError("canary_users", users, "is for user level (a user column); leave it out")
    return Canaries(fmt, ids, group, values, included, owners, seed, r)


def check_repeats(repeats, user_level: bool) -> int:
    """Rows per canary: an integer >= 1, above 1 only at user level (see :func:`draw_canaries`)."""
    if isinstance(repeats, bool) or int(repeats) != repeats or repeats < 1:
        raise InvalidParameterError("canary_repeats", repeats, "must be an integer >= 1 (rows per canary)")
    if repeats > 1 and not user_level:
        raise InvalidParameterError(
            "canary_repeats",
            repeats,
            "repeated canaries need user level (a user column): at example level every repeat is a row with "
            "its own per-row ε, which does not cover the canary's r rows together; use 1",
        )
    return int(repeats)


def _distinct(rng, space: int, n: int) -> np.ndarray:
    """n distinct integers uniform in [0, space) (without replacement)."""
    if space <= 1 << 22:
        return rng.choice(space, size=n, replace=False).astype(np.int64)
    out: list[int] = []
    seen: set[int] = set()
    while len(out) < n:
        for v in rng.integers(0, space, size=2 * (n - len(out)), dtype=np.int64).tolist():
            if v not in seen and len(out) < n:
                seen.add(v)
                out.append(v)
    return np.asarray(out, dtype=np.int64)


def _owners(rng, group, values, user_ids, user_budgets, mode) -> list:
    ids = np.asarray(user_ids)
    if mode == "new":
        taken = {str(u) for u in ids.tolist()}
        width = max(1, math.ceil(math.log10(group.size + 1)))
        names = [f"{CANARY_USER}{i:0{width}d}" for i in range(group.size)]
        clash = [n for n in names if n in taken]
        if clash:
            raise InvalidParameterError(
                "user_column", "a user id", f"starts with the reserved prefix {CANARY_USER!r}: rename those users"
            )
        return names
    budgets = np.asarray(user_budgets, dtype=float)
    if budgets.shape != ids.shape:
        raise InvalidParameterError("user_budgets", budgets.shape, f"need one budget per user ({ids.size})")
    out = []
    for g in group.tolist():
        pool = np.flatnonzero(np.isclose(budgets, values[g]))
        if pool.size == 0:
            raise InvalidParameterError("canary_users", "existing", f"the group with budget {values[g]:g} has no user")
        out.append(ids[rng.choice(pool)].item())
    return out


def with_canaries(texts, epsilons, canaries: Canaries, user_rows=None):
    """The training rows with every canary appended (included ones as ordinary rows, held-out ones as
    null rows; a canary with repeats as ``repeats`` consecutive rows of its user): (texts, epsilons,
    user ids or None, null mask over all rows, the canary of every appended row).

    ``epsilons``: each row's budget (example level) — or, with ``user_rows`` (each row's user id,
    user level), each row's user budget."""
    texts = list(texts)
    eps = np.asarray(epsilons, dtype=float).ravel()
    if eps.size != len(texts):
        raise InvalidParameterError("budgets", f"{eps.size} values", f"need one per row ({len(texts)})")
    n = len(texts)
    if (user_rows is None) != (canaries.users is None):
        raise InvalidParameterError(
            "user_column",
            "given" if user_rows is not None else None,
            "canaries drawn with users need the rows' users and vice versa (draw_canaries(user_ids=...))",
        )
    of = np.repeat(np.arange(len(canaries)), canaries.repeats)  # the canary of every appended row
    canary_texts = canaries.texts
    all_texts = texts + [canary_texts[i] for i in of.tolist()]
    all_eps = np.concatenate([eps, canaries.budgets[of]])
    users = None if user_rows is None else [*list(user_rows), *(canaries.users[i] for i in of.tolist())]
    null = np.zeros(n + of.size, bool)
    null[n:] = ~canaries.included[of]
    return all_texts, all_eps, users, null, of
