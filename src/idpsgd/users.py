"""User-level privacy units: which rows of a dataset belong to which person (numpy only).

With user-level individualized DP the unit of neighbouring is a *user*: two datasets are neighbours
when they differ in all the rows of one user (add/remove), and user u's guarantee ε_u bounds the
privacy loss of the whole set of u's rows, whatever their number.  :class:`Users` holds the user id
of every row and ``k`` — the public cap on the rows of one user that go into one step's update
(user-level sampling, ULS: Charles et al. 2024, Chua et al. 2024).

Everything here except ``k`` is **private**: the set of users, which rows are whose, how many rows
each has.  ``repr`` shows ``k`` only; budgets per user (a :class:`~idpsgd.assignment.Budgets` with
one ε per user, in the order of :attr:`Users.ids`) are built with :meth:`Users.budgets_from_rows`
(a per-row column, constant within each user), :meth:`Users.budgets_from_mapping` (user id → ε) or
``Budgets.from_groups(..., num_examples=users.num_users)``.
"""

from __future__ import annotations

import numpy as np

from .assignment.budgets import Budgets
from .validation import InvalidParameterError, check_epsilon


class Users:
    """The user of every row of a dataset and the public per-step cap ``k`` (ULS).

    Args:
        ids: one user id per row (ints or strings; any hashable numpy can sort), in dataset order.
        k: at most this many of a sampled user's rows go into one step's update (chosen uniformly at
            random without replacement at every step); public configuration.  ``max_rows_per_user=``
            is the same number under the name the CLI (``--max-rows-per-user``), ``PrivacyArguments``
            and ``report.json`` use; give one of them.

    Attributes (private):
        ids: the distinct user ids, sorted; user j of the engine's arrays is ``ids[j]``.
        unit_of_row: for every row, the index of its user in :attr:`ids` (int64).
        rows_per_user: the number of rows of every user.
    """

    def __init__(self, ids, k: int | None = None, *, max_rows_per_user: int | None = None):
        if (k is None) == (max_rows_per_user is None):
            raise InvalidParameterError(
                "max_rows_per_user",
                max_rows_per_user,
                "give the per-step cap once: Users(ids, k) or Users(ids, max_rows_per_user=k)",
            )
        k = k if k is not None else max_rows_per_user
        raw = np.asarray(ids)
        if raw.ndim != 1 or raw.size == 0:
            raise InvalidParameterError("user_ids", f"array of shape {raw.shape}", "must be a non-empty 1-D array")
        if raw.dtype.kind == "f":
            if not np.all(np.isfinite(raw)):
                raise InvalidParameterError("user_ids", "a missing (nan) id", "every row needs a user id")
            if not np.all(raw == np.round(raw)):
                raise InvalidParameterError("user_ids", "a non-integer number", "ids must be integers or strings")
            raw = raw.astype(np.int64)
        if raw.dtype.kind == "O":
            if any(v is None or v == "" for v in raw.tolist()):
                raise InvalidParameterError("user_ids", "an empty id", "every row needs a user id")
            raw = raw.astype(str)
        if raw.dtype.kind in "US" and np.any(np.char.str_len(raw.astype(str)) == 0):
            raise InvalidParameterError("user_ids", "an empty id", "every row needs a user id")
        if isinstance(k, bool) or int(k) != k or int(k) < 1:
            raise InvalidParameterError("max_rows_per_user", k, "must be an integer >= 1 (k, public)")
        self.k = int(k)
        self.ids, inverse, counts = np.unique(raw, return_inverse=True, return_counts=True)
        self.unit_of_row = inverse.ravel().astype(np.int64)
        self.rows_per_user = counts.astype(np.int64)
        # CSR: rows of user j are order[offsets[j]:offsets[j + 1]]
        self.order = np.argsort(self.unit_of_row, kind="stable").astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.rows_per_user)]).astype(np.int64)

    def __repr__(self) -> str:  # never the ids or the counts
        return f"Users(max_rows_per_user={self.k})"

    @property
    def max_rows_per_user(self) -> int:
        """k, under the name of the CLI flag and ``report.json``."""
        return self.k

    def rows_beyond_k(self) -> dict:
        """How many rows lie beyond k (private: statistics of the users' row counts): the users with
        more than k rows and their rows beyond the first k — rows a step never takes together with
        all of their user's other rows (each step draws k of them afresh)."""
        over = np.maximum(self.rows_per_user - self.k, 0)
        return {
            "max_rows_per_user": self.k,
            "users": self.num_users,
            "rows": self.num_rows,
            "users_with_more_than_k_rows": int(np.count_nonzero(over)),
            "rows_beyond_k": int(over.sum()),
        }

    def digest(self) -> str:
        """SHA-256 of the row → user assignment (for a checkpoint's signature; private)."""
        import hashlib

        return hashlib.sha256(np.ascontiguousarray(self.unit_of_row).tobytes()).hexdigest()

    @property
    def num_users(self) -> int:
        return int(self.ids.size)

    @property
    def num_rows(self) -> int:
        return int(self.unit_of_row.size)

    def draw_rows(self, users: np.ndarray, rng) -> np.ndarray:
        """Rows of a step for the sampled ``users``: min(k, n_u) of each user's rows, chosen uniformly
        at random without replacement (random keys, ``rng.random``), grouped by user.  Vectorised:
        O(rows of the sampled users)."""
        users = np.asarray(users, dtype=np.int64)
        counts = self.rows_per_user[users]
        total = int(counts.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pos = np.arange(total) - np.repeat(starts, counts)  # position within its user's rows
        rows = self.order[np.repeat(self.offsets[users], counts) + pos]
        owner = np.repeat(np.arange(users.size), counts)
        keys = np.asarray(rng.random(total), dtype=float)
        perm = np.lexsort((keys, owner))  # by user, then in random order
        keep = pos < self.k  # after the sort, pos is the rank within the user
        return rows[perm][keep]

    def capped_rows(self, seed: int) -> np.ndarray:
        """For example-level sampling (ELS): the rows kept when every user keeps at most ``k`` of their
        rows, chosen at random once (seeded), sorted."""
        rows = self.draw_rows(np.arange(self.num_users), np.random.default_rng(seed))
        return np.sort(rows)

    # --- budgets per user ------------------------------------------------------------------
    def budgets_from_rows(self, row_epsilons, delta: float, *, row_names=None) -> Budgets:
        """Per-user budgets from a per-row column (every row of a user must carry the same ε).  A user
        whose rows differ is refused naming two of those rows — ``row_names[i]`` names row i (e.g.
        ``"train.csv line 7"``; default ``"row i+1"``) — for the operator's terminal, never a file."""
        try:
            eps = np.asarray(row_epsilons, dtype=float).ravel()
        except (TypeError, ValueError):
            raise InvalidParameterError(
                "budgets", "a per-row column", "must hold numbers (each row's epsilon)"
            ) from None
        if eps.size != self.num_rows:
            raise InvalidParameterError(
                "budgets", f"{eps.size} values", f"need one per row ({self.num_rows}) to read the users' budgets"
            )
        check_epsilon(eps, "budgets")
        first = eps[self.order[self.offsets[:-1]]]
        differs = np.flatnonzero(eps != first[self.unit_of_row])
        if differs.size:  # the rows, for the operator's terminal (an error, never a file)
            row = int(differs[0])
            other = int(self.order[self.offsets[self.unit_of_row[row]]])
            name = (lambda i: f"row {i + 1}") if row_names is None else (lambda i: str(row_names[i]))
            raise InvalidParameterError(
                "budgets",
                "a per-row column",
                f"gives one user's rows different budgets: {name(other)} and {name(row)} have {eps[other]:g} and "
                f"{eps[row]:g}; with a user column the budget is per user: every row of a user must carry the "
                "same value",
            )
        return Budgets(first, delta)

    def budgets_from_mapping(self, mapping: dict, delta: float) -> Budgets:
        """Per-user budgets from ``{user id: ε}`` (every user needs one)."""
        lut = {str(key): float(v) for key, v in mapping.items()}
        missing = [u for u in self.ids.tolist() if str(u) not in lut]
        if missing:
            raise InvalidParameterError(
                "budgets", f"{len(missing)} users without a budget", "give a budget for every user"
            )
        return Budgets(np.array([lut[str(u)] for u in self.ids.tolist()]), delta)


def group_privacy(epsilon, delta, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Group privacy for groups of ``k`` (Dwork & Roth 2014, Thm 2.2 with δ; Vadhan 2017, Lemma 2.2):
    an (ε, δ)-DP mechanism is (kε, k·e^{(k−1)ε}·δ)-DP for datasets differing in k elements.

    This is the conversion ELS (example-level sampling with at most k rows per user) uses for a
    user-level guarantee (Charles et al. 2024, §3; Chua et al. 2024, §3.1)."""
    eps = np.asarray(epsilon, dtype=float)
    k = int(k)
    if k < 1:
        raise InvalidParameterError("k", k, "must be an integer >= 1")
    return k * eps, k * np.exp((k - 1) * eps) * np.asarray(delta, dtype=float)


def els_user_epsilon(
    sample_rate, noise_multiplier, steps, k: int, delta: float, accountant: str = "rdp", iterations: int = 60
) -> float:
    """User-level ε of ELS — example-level Poisson sampling at rate q with at most ``k`` rows per user,
    the example-level sampled Gaussian (q, σ, T) — through :func:`group_privacy`:

        ε_user(δ) = k · ε_ex(δ_ex)  for the largest δ_ex with  k · e^{(k−1)·ε_ex(δ_ex)} · δ_ex ≤ δ,

    ε_ex(δ_ex) by ``accountant`` (``rdp``, ``pld``, ``prv``: :func:`~idpsgd.accounting.epsilon_sgm`).
    δ_ex is found by bisection on log δ_ex; the returned ε is at a δ_ex that meets the constraint
    (checked), so it is a valid user-level (ε, δ) bound whether or not the search found the best
    δ_ex.  k = 1 is the example-level ε."""
    from .accounting import epsilon_sgm
    from .validation import check_delta

    delta = check_delta(delta)
    k = int(k)
    if k < 1:
        raise InvalidParameterError("k", k, "must be an integer >= 1")

    def exact(d):
        return float(epsilon_sgm(sample_rate, noise_multiplier, steps, d, accountant))

    if k == 1:
        return exact(delta)
    if accountant == "rdp":  # the search on the RDP curve at the order grid, computed once (an upper
        from .accounting import DEFAULT_ORDERS, compute_rdp, rdp_to_epsilon  # bound of the refined ε)

        curve = compute_rdp(sample_rate, noise_multiplier, DEFAULT_ORDERS, steps=steps)

        def eps_ex(d):
            return float(rdp_to_epsilon(curve, DEFAULT_ORDERS, d)[0])
    else:
        eps_ex = exact

    def feasible(log_d):
        e = eps_ex(float(np.exp(log_d)))
        return k * np.exp((k - 1) * e) * np.exp(log_d) <= delta, e

    hi = np.log(delta / k)  # δ_ex ≤ δ/k always
    ok, e = feasible(hi)
    if ok:
        return k * min(e, exact(float(np.exp(hi))))
    lo = np.log(delta / k) - 60.0
    ok, e_lo = feasible(lo)
    if not ok:
        raise InvalidParameterError(
            "k", k, f"group privacy gives no finite user-level ε at delta={delta:g} (ε_ex too large for k rows)"
        )
    for _ in range(int(iterations)):
        mid = 0.5 * (lo + hi)
        ok, e = feasible(mid)
        if ok:
            lo, e_lo = mid, e
        else:
            hi = mid
    # the refined ε at the chosen δ_ex is at most the grid's, so the constraint still holds
    return k * min(e_lo, exact(float(np.exp(lo))))


def synthetic_user_ids(num_rows: int, num_users: int, seed: int = 0, tail: float = 1.5) -> np.ndarray:
    """A heavy-tailed split of ``num_rows`` rows into ``num_users`` synthetic users (for experiments on
    datasets without users).

    Each user's share is drawn from a Pareto (Lomax) distribution with shape ``tail`` (smaller: heavier
    tail; 1.5 gives a few users with tens of times the median), the row counts are the shares scaled
    to ``num_rows`` by the largest remainder with at least one row per user, and the rows are
    assigned to users at random (seeded).  Returns one user id (0..num_users-1) per row."""
    n, u = int(num_rows), int(num_users)
    if u < 1 or n < u:
        raise InvalidParameterError("num_users", num_users, f"must be in [1, num_rows={n}]")
    if not float(tail) > 0:
        raise InvalidParameterError("tail", tail, "must be > 0")
    rng = np.random.default_rng(seed)
    share = rng.pareto(float(tail), u) + 1.0
    raw = share / share.sum() * (n - u)
    counts = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: (n - u) - int(counts.sum())]] += 1
    counts += 1
    ids = np.repeat(np.arange(u), counts)
    rng.shuffle(ids)
    return ids


def els_noise_multiplier(
    sample_rate: float, steps: int, k: int, epsilon: float, delta: float, accountant: str = "rdp"
) -> float:
    """The smallest σ (to 0.1 %) at which ELS — example-level sampling at ``sample_rate`` for ``steps``
    steps, at most ``k`` rows per user — gives user-level (``epsilon``, ``delta``) by
    :func:`els_user_epsilon` (bisection on log σ; the returned σ meets the target)."""
    from .validation import UnreachableTargetError

    def eps(s):
        try:
            return els_user_epsilon(sample_rate, s, steps, k, delta, accountant, iterations=40)
        except InvalidParameterError:  # no δ_ex meets the group-privacy constraint at this σ
            return float("inf")

    lo, hi = np.log(0.5), np.log(2000.0)
    if eps(float(np.exp(hi))) > epsilon:
        raise UnreachableTargetError(
            f"ELS cannot reach user-level epsilon={epsilon:g} with k={k} rows per user at delta={delta:g}"
        )
    if eps(float(np.exp(lo))) <= epsilon:
        return float(np.exp(lo))
    while hi - lo > 1e-3:
        mid = 0.5 * (lo + hi)
        if eps(float(np.exp(mid))) <= epsilon:
            hi = mid
        else:
            lo = mid
    return float(np.exp(hi))
