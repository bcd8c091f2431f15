"""Output-specific individual privacy accounting for DP-SGD (Yu et al. 2023, §2.2, §3, Alg. 2).

Along the trajectory the model actually took, one step of DP-SGD costs example i the RDP of
the sampled Gaussian mechanism with its rate q_i and effective noise multiplier σ·c / s_i, where
s_i = min(c_i, ‖g_i‖) is its sensitivity at that step (c_i its clip norm, σ·c the noise std).
Composing these per-step RDPs and converting at δ gives example i's ε:

* with the norms of every step (K = 1, rounding ``exact``), an output-specific individual
  (ε_i, δ)-DP guarantee (Yu et al. Thm. 3.3);
* with norms refreshed every K steps (Alg. 2), an **estimate** — unless the run clips example i
  at its latest (rounded) norm estimate (individual clipping, Alg. 3), which makes the
  accounted sensitivity a bound again and the ε a **guarantee**.

Rounding of sensitivities (Alg. 2): ``nearest`` — to the grid {r, 2r, …, C} (the paper's; can
round down), ``ceil`` — up to a multiple of r (never below the norm; at most c_i), ``exact`` —
none.  Few distinct values are evaluated exactly (:func:`~idpsgd.accounting.compute_rdp`
deduplicates); ``exact`` mode, with one distinct value per example and refresh, evaluates the RDP
by linear interpolation in log-sensitivity on a dense geometric grid of exact values
(:class:`RdpInterpolator`).  The SGM's RDP is convex in log-sensitivity, so the chord lies above
the curve and the interpolated value is an upper bound (checked in the tests); its relative excess
is below 1e-4 at typical (q, σ).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..names import INDIVIDUAL_ACCOUNTANTS as INDIVIDUAL_ACCOUNTANTS  # re-exported
from ..validation import InvalidParameterError, check_positive, check_positive_array, check_sample_rate, refuse_where
from .ledger import RdpLedger
from .orders import chord_refined_epsilon
from .rdp import DEFAULT_ORDERS, compute_rdp

ROUNDING = ("exact", "ceil", "nearest")
#: Default rounding step as a fraction of the (reference) clip norm: r = 0.01·C (Yu et al. §3.2).
DEFAULT_ROUNDING_FRACTION = 0.01


def round_sensitivities(norms, clip_norms, rounding: str = "nearest", step: float | None = None) -> np.ndarray:
    """Sensitivities s_i = min(c_i, ‖g_i‖), rounded as in Yu et al. Alg. 2.

    ``nearest`` maps to the closest point of {r, 2r, …, ⌈C/r⌉r} (then at most c_i); ``ceil`` rounds
    up to a multiple of r (at most c_i); ``exact`` keeps the value.  ``step`` r defaults to 0.01·max c_i.
    """
    if rounding not in ROUNDING:
        raise InvalidParameterError("rounding", rounding, f"must be one of {', '.join(ROUNDING)}")
    norms = np.asarray(norms, dtype=float)
    refuse_where("norms", norms, ~(np.isfinite(norms) & (norms >= 0)), "must be >= 0 and finite")
    clip = np.broadcast_to(np.asarray(clip_norms, dtype=float), norms.shape)
    s = np.minimum(norms, clip)
    if rounding == "exact":
        return s
    r = check_positive(step if step is not None else DEFAULT_ROUNDING_FRACTION * float(clip.max()), "rounding_step")
    if rounding == "ceil":
        return np.minimum(np.ceil(s / r - 1e-12) * r, clip)
    top = np.ceil(float(clip.max()) / r - 1e-12)
    return np.minimum(np.clip(np.round(s / r), 1, top) * r, clip)


class RdpInterpolator:
    """Per-step SGM RDP as a function of t = s/(σc) (= 1/effective σ), for one or more rates q.

    Exact values on a geometric grid of t over [t_max·``span``, t_max] with log-spacing about
    ``h``; linear interpolation in log t in between (an upper bound: the RDP is convex in log t),
    the grid's first value below it (monotone: an upper bound), and 0 at t = 0.
    """

    def __init__(self, rates, t_max: float, orders=DEFAULT_ORDERS, h: float = 5e-4, span: float = 1e-8):
        self.rates = np.atleast_1d(np.asarray(rates, dtype=float))
        lo, hi = np.log(t_max * span), np.log(t_max)
        n = int(np.ceil((hi - lo) / h)) + 1
        self.u = np.linspace(lo, hi, n)
        self.h = float(self.u[1] - self.u[0])
        qq = np.repeat(self.rates, n)
        values = compute_rdp(qq, np.exp(-np.tile(self.u, self.rates.size)), orders)
        self.values = values.reshape(self.rates.size * n, -1)  # row q_j·n + k
        slopes = np.diff(values.reshape(self.rates.size, n, -1), axis=1) / self.h
        self.slopes = np.concatenate([slopes, np.zeros_like(slopes[:, :1])], axis=1).reshape(self.rates.size * n, -1)
        self.n = n

    def locate(self, t, rate_index=0):
        """(row, du) so that RDP = values[row] + du·slopes[row] (du = 0 and row of zeros at t = 0)."""
        t = np.asarray(t, dtype=float)
        if np.any(t > np.exp(self.u[-1]) * (1 + 1e-12)):
            raise ValueError(f"t={float(np.max(t))} beyond the table's t_max={float(np.exp(self.u[-1]))}")
        with np.errstate(divide="ignore"):
            u = np.log(t)
        finite = np.isfinite(u)
        pos = np.where(finite, (u - self.u[0]) / self.h, 0.0)
        k = np.clip(pos, 0, self.n - 2).astype(np.int64)
        k = np.where(finite, k, 0)
        du = np.clip(np.where(np.isfinite(u), u - self.u[k], 0.0), 0.0, None)
        return np.asarray(rate_index) * self.n + k, du, t <= 0

    def evaluate(self, row, du, zero) -> np.ndarray:
        """RDP rows at located points (see :meth:`locate`)."""
        out = self.values[row]
        out += du[:, None] * self.slopes[row]
        out[zero] = 0.0
        return out

    def __call__(self, t, rate_index=0) -> np.ndarray:
        return self.evaluate(*self.locate(t, rate_index))


#: Most rounded sensitivity levels (multiples of the rounding step up to the largest clip norm):
#: the per-step RDP table holds levels × rates × orders values.
MAX_ROUNDING_LEVELS = 100_000
#: Largest per-example level-count table kept for PLD (examples × levels × 4 bytes).
MAX_LEVEL_COUNT_BYTES = 2 * 2**30


@dataclass(frozen=True)
class IndividualEpsilons:
    """Per-example ε and which bound produced it.

    ``epsilon[i]`` is the minimum of the valid bounds available for example i and
    ``source[i]`` names the one that gave it: ``"rdp"`` (its own RDP, adaptive-order conversion),
    ``"pld"`` (its own PLD) or ``"cap"`` (the data-independent per-example cap given by the
    caller, e.g. its group's ε from the run's accountant).  The separate arrays are kept (``None``
    where not computed); every number is an (ε, δ) upper bound at ``delta``.
    """

    epsilon: np.ndarray
    source: np.ndarray
    rdp: np.ndarray
    pld: np.ndarray | None
    cap: np.ndarray | None
    delta: float

    def counts(self) -> dict:
        """How many examples each bound decided (for reports)."""
        labels, n = np.unique(self.source, return_counts=True)
        return {str(k): int(v) for k, v in zip(labels, n, strict=True)}


def combine_bounds(delta: float, rdp, pld=None, cap=None) -> IndividualEpsilons:
    """Elementwise minimum of the available bounds, with the name of the one that won (ties: rdp, pld, cap)."""
    rdp = np.asarray(rdp, dtype=float)
    cols = [("rdp", rdp)]
    if pld is not None:
        cols.append(("pld", np.broadcast_to(np.asarray(pld, dtype=float), rdp.shape)))
    if cap is not None:
        cap = np.broadcast_to(np.asarray(cap, dtype=float), rdp.shape)
        if np.any(np.isnan(cap)) or np.any(cap < 0):
            raise InvalidParameterError("cap", cap, "every value must be >= 0 (an epsilon)")
        cols.append(("cap", cap))
    stack = np.stack([c for _, c in cols])
    which = np.argmin(stack, axis=0)
    labels = np.array([name for name, _ in cols])
    return IndividualEpsilons(
        np.min(stack, axis=0), labels[which], rdp, None if pld is None else cols[1][1], cap, float(delta)
    )


class IndividualAccountant:
    """Per-example RDP along the trajectory (Yu et al. Alg. 2), vectorized over examples.

    Args:
        sample_rates: q_i per example (or one shared rate).
        noise_multiplier: σ (noise std σ·c).
        clip_norm: the reference clip norm c.
        clip_norms: c_i per example (default c); before the first refresh s_i = c_i (worst case).
        rounding, rounding_step: see :func:`round_sensitivities`.

    Besides the per-example RDP ledger, rounded modes (``ceil``, ``nearest``) keep, per example,
    how many steps it took at each rounded sensitivity level (``level_counts``): what its
    per-example PLD (:meth:`pld_epsilon`) is computed from.  ``report`` returns the minimum of the
    available bounds with their sources.
    """

    BLOCK = 4096

    def __init__(
        self,
        sample_rates,
        noise_multiplier: float,
        clip_norm: float,
        clip_norms=None,
        orders=DEFAULT_ORDERS,
        rounding: str = "nearest",
        rounding_step: float | None = None,
    ):
        q = np.asarray(sample_rates, dtype=float).ravel()
        self.sigma = check_positive(noise_multiplier, "noise_multiplier")
        self.c = check_positive(clip_norm, "clip_norm")
        n = q.size if clip_norms is None else np.size(clip_norms)
        self.q = np.broadcast_to(check_sample_rate(q, "sample_rates", allow_zero=True), (n,)).copy()
        self.clip_norms = (
            np.full(n, self.c)
            if clip_norms is None
            else check_positive_array(clip_norms, "clip_norms").ravel().astype(float)
        )
        if rounding not in ROUNDING:
            raise InvalidParameterError("rounding", rounding, f"must be one of {', '.join(ROUNDING)}")
        self.rounding = rounding
        self.rounding_step = (
            check_positive(rounding_step, "rounding_step")
            if rounding_step is not None
            else DEFAULT_ROUNDING_FRACTION * float(self.clip_norms.max())
        )
        self.ledger = RdpLedger(n, orders)
        self.sensitivity = self.clip_norms.copy()
        self.refreshes = 0
        self._pending = 0
        self._rates, self._rate_index = np.unique(self.q, return_inverse=True)
        self._rate_index = self._rate_index.ravel()
        self._table = None  # exact: RdpInterpolator; rounding: (candidates, values)
        self._rows = None  # per example: row into the table (and du for exact)
        self._level = None  # rounded modes: per example, its level (candidate) index
        self._worst = self._worst_index = None  # exact mode: per-step RDP at s = c_i per (q_i, c_i)
        self._counts = None  # rounded modes: steps per example per level (int32)
        self.levels = None
        if rounding != "exact":
            self.levels = _rounding_levels(self.clip_norms, self.rounding_step)
            if n * self.levels.size * 4 <= MAX_LEVEL_COUNT_BYTES:
                self._counts = np.zeros((n, self.levels.size), dtype=np.int32)

    @property
    def level_counts(self) -> np.ndarray | None:
        """(examples × levels) steps each example took at each rounded sensitivity ``levels[l]``
        (None in ``exact`` mode or when the table would be too large)."""
        self._flush()
        return self._counts

    @property
    def num_examples(self) -> int:
        return self.q.size

    @property
    def steps(self) -> int:
        return self.ledger.steps + self._pending

    def update_norms(self, norms) -> np.ndarray:
        """Refresh sensitivities from current gradient norms (all examples); returns them."""
        norms = np.asarray(norms, dtype=float).ravel()
        if norms.size != self.num_examples:
            raise InvalidParameterError("norms", f"{norms.size} values", f"need one per example ({self.num_examples})")
        self._flush()
        self.sensitivity = round_sensitivities(norms, self.clip_norms, self.rounding, self.rounding_step)
        self._rows = None
        self.refreshes += 1
        return self.sensitivity

    def add_steps(self, count: int = 1) -> None:
        """Compose ``count`` steps at the current sensitivities (applied lazily)."""
        if int(count) < 0:
            raise InvalidParameterError("count", count, "must be >= 0")
        self._pending += int(count)

    # --- per-step RDP through one lookup table (all rates stacked) ---------------------------
    def _prepare(self) -> None:
        if self._rows is not None:
            return
        t = self.sensitivity / (self.sigma * self.c)
        if self.rounding == "exact":
            if self._table is None:
                self._table = RdpInterpolator(
                    self._rates, float(self.clip_norms.max()) / (self.sigma * self.c), self.ledger.orders
                )
            row, du, zero = self._table.locate(t, self._rate_index)
            if self._worst is None:  # exact per-step RDP at s = c_i caps the interpolation
                pairs, self._worst_index = np.unique(np.stack([self.q, self.clip_norms]), axis=1, return_inverse=True)
                self._worst = compute_rdp(pairs[0], self.sigma * self.c / pairs[1], self.ledger.orders)
                self._worst_index = self._worst_index.ravel()
            self._rows = (row, np.where(zero, 0.0, du), zero, self._worst_index)
            return
        # rounded sensitivities take few values: multiples of r and the clip norms themselves
        cand = self.levels
        if self._table is None:
            with np.errstate(divide="ignore"):
                sig = np.where(cand > 0, self.sigma * self.c / np.where(cand > 0, cand, 1.0), np.inf)
            values = compute_rdp(np.repeat(self._rates, cand.size), np.tile(sig, self._rates.size), self.ledger.orders)
            self._table = (cand, values)
        idx = np.clip(np.searchsorted(cand, self.sensitivity - 1e-9 * self.rounding_step), 0, cand.size - 1)
        if np.any(np.abs(cand[idx] - self.sensitivity) > 1e-9 * self.rounding_step):
            raise RuntimeError("rounded sensitivity off the candidate grid")  # unreachable by construction
        self._level = idx
        self._rows = (self._rate_index * cand.size + idx,)

    def _block(self, rows: slice) -> np.ndarray:
        if self.rounding == "exact":
            row, du, zero, worst = (a[rows] for a in self._rows)
            # s ≤ c_i: never above the worst case (zero rows stay 0)
            out = self._table.evaluate(row, du, zero)
            return np.minimum(out, self._worst[worst], out=out)
        return self._table[1][self._rows[0][rows]]

    def step_rdp(self) -> np.ndarray:
        """(examples × orders) RDP of one step at the current sensitivities."""
        self._prepare()
        return self._block(slice(None))

    def _flush(self) -> None:
        if not self._pending:
            return
        self._prepare()
        count = float(self._pending)

        def work(start):
            rows = slice(start, min(start + self.BLOCK, self.num_examples))
            block = self._block(rows)
            block *= count
            self.ledger.add_block(rows, block)

        starts = range(0, self.num_examples, self.BLOCK)
        if self.num_examples > 4 * self.BLOCK:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                list(pool.map(work, starts))
        else:
            for start in starts:
                work(start)
        if self._counts is not None:
            self._counts[np.arange(self.num_examples), self._level] += self._pending
        self.ledger.count_steps(self._pending)
        self._pending = 0

    def rdp(self) -> np.ndarray:
        self._flush()
        return self.ledger.rdp

    # --- ε ---------------------------------------------------------------------------------
    def epsilon(self, delta: float, refine: bool = True) -> np.ndarray:
        """ε_i per example at δ by RDP (improved conversion).

        ``refine`` (default) also converts at orders between the grid orders through the chord
        bound of the convex (α − 1)·r(α) (:func:`~idpsgd.accounting.orders.chord_refined_epsilon`),
        and caps each ε by the example's data-independent ε (:meth:`worst_case_epsilon`, exact
        adaptive orders; every accounted sensitivity is ≤ c_i): never above the grid's ε, and a
        valid bound.
        """
        self._flush()
        if not refine:
            return self.ledger.epsilon(delta, refine=False)[0]
        eps = chord_refined_epsilon(self.ledger.rdp, self.ledger.orders, delta)[0]
        return np.minimum(eps, self.worst_case_epsilon(delta))

    def pld_epsilon(self, delta: float, discretization: float | None = None) -> np.ndarray:
        """ε_i per example by PLD of its level history (:mod:`.pld_individual`).

        Needs a rounding mode with levels (``ceil`` or ``nearest``) and the level counts (kept
        whenever examples × levels × 4 bytes ≤ ``MAX_LEVEL_COUNT_BYTES``).
        """
        from .pld_individual import INDIVIDUAL_PLD_DISCRETIZATION, individual_pld_epsilon

        if self.rounding == "exact":
            raise InvalidParameterError(
                "rounding",
                "exact",
                "cannot be used with the pld accountant: per-example "
                "PLD needs rounded sensitivity levels (use ceil or nearest)",
            )
        if self._counts is None:
            raise InvalidParameterError(
                "rounding_step",
                self.rounding_step,
                f"gives {self.levels.size} levels for {self.num_examples} examples: the "
                f"per-example level counts would exceed {MAX_LEVEL_COUNT_BYTES / 2**30:g} GiB; "
                "use a larger rounding step for the pld accountant",
            )
        self._flush()
        d = discretization or INDIVIDUAL_PLD_DISCRETIZATION
        with np.errstate(divide="ignore"):
            sig = np.where(self.levels > 0, self.sigma * self.c / np.where(self.levels > 0, self.levels, 1.0), np.inf)
        out = np.zeros(self.num_examples)
        for j, rate in enumerate(self._rates):
            rows = np.flatnonzero(self._rate_index == j)
            cnt = self._counts[rows]
            used = np.flatnonzero(cnt.any(axis=0))
            if rows.size == 0 or used.size == 0 or rate == 0:
                continue
            out[rows] = individual_pld_epsilon(cnt[:, used], np.full(used.size, rate), sig[used], delta, d)
        return out

    def worst_case_epsilon(self, delta: float, steps: int | None = None, accountant: str = "rdp") -> np.ndarray:
        """Data-independent ε per example: every step at sensitivity c_i (the worst case).

        ``rdp``: adaptive orders (exactly :func:`~idpsgd.accounting.epsilon_sgm`); ``pld``:
        dp_accounting's PLD.  Computed once per distinct (q_i, c_i).
        """
        from .accountants import epsilon_sgm

        steps = self.steps if steps is None else int(steps)
        pairs, inverse = np.unique(np.stack([self.q, self.clip_norms]), axis=1, return_inverse=True)
        if steps == 0:
            return np.zeros(self.num_examples)
        eps = np.atleast_1d(epsilon_sgm(pairs[0], self.sigma * self.c / pairs[1], steps, delta, accountant))
        return eps[inverse.ravel()]

    def report(
        self, delta: float, accountant: str = "rdp", cap=None, pld_discretization: float | None = None
    ) -> IndividualEpsilons:
        """Each example's ε as the minimum of the valid bounds available, with its source.

        Args:
            delta: δ of every bound.
            accountant: ``rdp`` (its RDP ε) or ``pld`` (its RDP and its PLD ε; PLD needs a rounded
                mode).
            cap: optional data-independent per-example bound (e.g. its group's ε from the run's
                accountant, which is ≤ its budget by calibration): scalar or one per example.
        """
        if accountant not in INDIVIDUAL_ACCOUNTANTS:
            raise InvalidParameterError("accountant", accountant, f"must be one of {', '.join(INDIVIDUAL_ACCOUNTANTS)}")
        if cap is not None:
            cap = np.broadcast_to(np.asarray(cap, dtype=float), (self.num_examples,))
        pld = self.pld_epsilon(delta, pld_discretization) if accountant == "pld" else None
        return combine_bounds(delta, self.epsilon(delta), pld, cap)

    def state_dict(self) -> dict:
        self._flush()
        state = {
            "ledger": self.ledger.state_dict(),
            "sensitivity": self.sensitivity.copy(),
            "refreshes": self.refreshes,
        }
        if self._counts is not None:
            state["level_counts"] = self._counts.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state["ledger"])
        self.sensitivity = np.asarray(state["sensitivity"], dtype=float)
        self.refreshes = int(state["refreshes"])
        self._pending, self._rows = 0, None
        if "level_counts" in state and state["level_counts"] is not None:
            counts = np.asarray(state["level_counts"])
            if self.levels is None or counts.shape != (self.num_examples, self.levels.size):
                raise ValueError(f"level_counts of shape {counts.shape} do not match this accountant")
            self._counts = counts.astype(np.int32).copy()
        else:
            self._counts = None  # an older state without them: PLD is unavailable


def check_rounding_step(step: float, clip_norm_max: float) -> float:
    """Refuse a rounding step that gives more than :data:`MAX_ROUNDING_LEVELS` levels up to the clip
    norm (the per-step RDP table would not fit in memory); returns the number of levels."""
    count = float(clip_norm_max) / check_positive(step, "rounding_step")
    if not count <= MAX_ROUNDING_LEVELS:
        raise InvalidParameterError(
            "rounding_step",
            step,
            f"gives {count:.3g} sensitivity levels up to the clip norm "
            f"{clip_norm_max:g} (limit {MAX_ROUNDING_LEVELS}); use a step >= "
            f"{clip_norm_max / MAX_ROUNDING_LEVELS:.3g}",
        )
    return count


def _rounding_levels(clip_norms, step: float) -> np.ndarray:
    """The rounded sensitivity levels: multiples of ``step`` up to the largest clip norm, and the clip norms."""
    count = check_rounding_step(step, float(np.max(clip_norms)))
    return np.unique(np.concatenate([np.arange(int(np.ceil(count - 1e-12)) + 1) * step, np.unique(clip_norms)]))


def offline_kind(
    recorded_kind: str | None,
    individual_clipping: bool,
    recorded_rounding: str | None,
    recorded_step: float | None,
    rounding: str,
    rounding_step: float | None,
    overridden: bool = False,
    enforced: bool | None = None,
) -> tuple[str, str]:
    """(kind, reason) of offline accounting from recorded norms (:func:`account_from_norms`).

    A norms file holds the norm passes' values, not what training clipped; only the run that wrote
    it knows whether they bounded training's clipped norms (:mod:`idpsgd.engine.budget.individual`), and
    records it (``kind``, ``enforced``; ``idpsgd train --save-norms``).  The offline ε are a
    **guarantee** only when that record says ``guarantee``, the run's own rates, σ and clip norms are
    used (``overridden=False``) and

    * the run clipped every example at its charge (``enforced``: individual clipping, or norms of
      every step with ``exact``/``ceil`` rounding; a file without ``enforced`` counts as enforced
      when it records individual clipping) and the offline rounding and step are the recorded ones
      (the charges are then the run's clip thresholds).

    Otherwise an **estimate** — also for a file of a version that labelled K = 1 runs by checking
    their norms instead of enforcing them (no ``enforced``, no individual clipping): that label
    depended on the data, and the offline ``kind`` is public.
    """
    if recorded_kind != "guarantee":
        return "estimate", (
            "the norms file does not record a run whose individual accounting was a guarantee "
            "(its norms were not charges the run enforced)"
        )
    if overridden:
        return "estimate", "the sample rate, noise multiplier or clip norm replaces the recorded run's"
    if enforced is None:
        enforced = individual_clipping
    if enforced:
        same_step = (
            recorded_step is not None
            and rounding_step is not None
            and abs(float(rounding_step) - float(recorded_step)) <= 1e-12 * float(recorded_step)
        )
        if rounding == recorded_rounding and (rounding == "exact" or same_step):
            return "guarantee", (
                "the run clipped every example at these sensitivities (individual clipping, or its "
                "charges enforced with norms of every step)"
            )
        return "estimate", (
            "the run clipped at its recorded rounding; another rounding or step charges other "
            "sensitivities than the clip thresholds"
        )
    return "estimate", (
        "the run did not clip every example at its charge (a norms file of a version that checked "
        "norms of every step instead: its label depended on the data)"
    )


def account_from_norms(
    norms,
    steps,
    sample_rate,
    noise_multiplier: float,
    clip_norm: float,
    delta: float,
    rounding: str = "nearest",
    rounding_step: float | None = None,
    clip_norms=None,
    accountant: str = "rdp",
    report: bool = False,
):
    """Offline accounting: ``norms`` (refreshes × examples), ``steps[j]`` steps covered by refresh j.

    Returns ``(epsilons, worst_case_epsilons)`` per example, the worst case (data-independent) by
    the accountant asked for; each ε is the minimum of the example's RDP ε, its PLD ε (``pld``)
    and that worst case.  With ``report=True`` the first item is the :class:`IndividualEpsilons`
    saying which bound produced each number.
    """
    norms = np.asarray(norms, dtype=float)
    if norms.ndim != 2:
        raise InvalidParameterError("norms", f"array of shape {norms.shape}", "must be 2-D (refreshes × examples)")
    steps = np.broadcast_to(np.asarray(steps), (norms.shape[0],))
    if np.any(steps < 0) or np.any(steps != np.round(steps)):
        raise InvalidParameterError("steps", steps, "must be integers >= 0, one per refresh")
    if accountant not in INDIVIDUAL_ACCOUNTANTS:
        raise InvalidParameterError("accountant", accountant, f"must be one of {', '.join(INDIVIDUAL_ACCOUNTANTS)}")
    if accountant != "rdp" and rounding == "exact":
        raise InvalidParameterError(
            "rounding",
            "exact",
            "cannot be used with the pld accountant: per-example "
            "PLD needs rounded sensitivity levels (use ceil or nearest)",
        )
    acc = IndividualAccountant(
        sample_rate,
        noise_multiplier,
        clip_norm,
        clip_norms if clip_norms is not None else np.full(norms.shape[1], clip_norm),
        rounding=rounding,
        rounding_step=rounding_step,
    )
    for row, k in zip(norms, steps, strict=True):
        acc.update_norms(row)
        acc.add_steps(int(k))
    worst = acc.worst_case_epsilon(delta, accountant=accountant)
    result = acc.report(delta, accountant, cap=worst if accountant == "pld" else None)
    return (result, worst) if report else (result.epsilon, worst)
