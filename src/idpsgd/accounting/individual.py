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

import numpy as np

from ..validation import InvalidParameterError, _bad_where, check_positive, check_positive_array, check_sample_rate
from .conversion import rdp_to_epsilon
from .ledger import RdpLedger
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
    _bad_where("norms", norms, ~(np.isfinite(norms) & (norms >= 0)), "must be >= 0 and finite")
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
        self.values = values.reshape(self.rates.size * n, -1)                   # row q_j·n + k
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
        k = np.clip(((u - self.u[0]) / self.h).astype(np.int64, copy=False) if u.size else u.astype(np.int64),
                    0, self.n - 2)
        k = np.where(np.isfinite(u), k, 0)
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


class IndividualAccountant:
    """Per-example RDP along the trajectory (Yu et al. Alg. 2), vectorized over examples.

    Args:
        sample_rates: q_i per example (or one shared rate).
        noise_multiplier: σ (noise std σ·c).
        clip_norm: the reference clip norm c.
        clip_norms: c_i per example (default c); before the first refresh s_i = c_i (worst case).
        rounding, rounding_step: see :func:`round_sensitivities`.
    """

    BLOCK = 4096

    def __init__(self, sample_rates, noise_multiplier: float, clip_norm: float, clip_norms=None,
                 orders=DEFAULT_ORDERS, rounding: str = "nearest", rounding_step: float | None = None):
        q = np.asarray(sample_rates, dtype=float).ravel()
        self.sigma = check_positive(noise_multiplier, "noise_multiplier")
        self.c = check_positive(clip_norm, "clip_norm")
        n = q.size if clip_norms is None else np.size(clip_norms)
        self.q = np.broadcast_to(check_sample_rate(q, "sample_rates", allow_zero=True), (n,)).copy()
        self.clip_norms = (np.full(n, self.c) if clip_norms is None
                           else check_positive_array(clip_norms, "clip_norms").ravel().astype(float))
        if rounding not in ROUNDING:
            raise InvalidParameterError("rounding", rounding, f"must be one of {', '.join(ROUNDING)}")
        self.rounding = rounding
        self.rounding_step = (check_positive(rounding_step, "rounding_step") if rounding_step is not None
                              else DEFAULT_ROUNDING_FRACTION * float(self.clip_norms.max()))
        self.ledger = RdpLedger(n, orders)
        self.sensitivity = self.clip_norms.copy()
        self.refreshes = 0
        self._pending = 0
        self._rates, self._rate_index = np.unique(self.q, return_inverse=True)
        self._rate_index = self._rate_index.ravel()
        self._table = None       # exact: RdpInterpolator; rounding: (candidates, values)
        self._rows = None        # per example: row into the table (and du for exact)
        self._worst = self._worst_index = None   # exact mode: per-step RDP at s = c_i per (q_i, c_i)

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
                self._table = RdpInterpolator(self._rates, float(self.clip_norms.max()) / (self.sigma * self.c),
                                              self.ledger.orders)
            row, du, zero = self._table.locate(t, self._rate_index)
            if self._worst is None:  # exact per-step RDP at s = c_i caps the interpolation
                pairs, self._worst_index = np.unique(np.stack([self.q, self.clip_norms]), axis=1, return_inverse=True)
                self._worst = compute_rdp(pairs[0], self.sigma * self.c / pairs[1], self.ledger.orders)
                self._worst_index = self._worst_index.ravel()
            self._rows = (row, np.where(zero, 0.0, du), zero, self._worst_index)
            return
        # rounded sensitivities take few values: multiples of r and the clip norms themselves
        if self._table is None:
            r, cmax = self.rounding_step, float(self.clip_norms.max())
            cand = np.unique(np.concatenate([np.arange(int(np.ceil(cmax / r - 1e-12)) + 1) * r,
                                             np.unique(self.clip_norms)]))
            with np.errstate(divide="ignore"):
                sig = np.where(cand > 0, self.sigma * self.c / np.where(cand > 0, cand, 1.0), np.inf)
            values = compute_rdp(np.repeat(self._rates, cand.size), np.tile(sig, self._rates.size),
                                 self.ledger.orders)
            self._table = (cand, values)
        cand, values = self._table
        idx = np.clip(np.searchsorted(cand, self.sensitivity - 1e-9 * self.rounding_step), 0, cand.size - 1)
        if np.any(np.abs(cand[idx] - self.sensitivity) > 1e-9 * self.rounding_step):
            raise RuntimeError("rounded sensitivity off the candidate grid")  # unreachable by construction
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
            self.ledger.rdp[rows] += block

        starts = range(0, self.num_examples, self.BLOCK)
        if self.num_examples > 4 * self.BLOCK:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                list(pool.map(work, starts))
        else:
            for start in starts:
                work(start)
        self.ledger.steps += self._pending
        self._pending = 0

    def rdp(self) -> np.ndarray:
        self._flush()
        return self.ledger.rdp

    def epsilon(self, delta: float) -> np.ndarray:
        """ε_i per example at δ (improved RDP conversion)."""
        self._flush()
        return self.ledger.epsilon(delta)[0]

    def worst_case_epsilon(self, delta: float, steps: int | None = None) -> np.ndarray:
        """Data-independent ε per example: every step at sensitivity c_i (the worst case)."""
        steps = self.steps if steps is None else int(steps)
        rdp = compute_rdp(self.q, self.sigma * self.c / self.clip_norms, self.ledger.orders, steps=steps)
        return rdp_to_epsilon(rdp, self.ledger.orders, delta)[0]

    def state_dict(self) -> dict:
        self._flush()
        return {"ledger": self.ledger.state_dict(), "sensitivity": self.sensitivity.copy(),
                "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state["ledger"])
        self.sensitivity = np.asarray(state["sensitivity"], dtype=float)
        self.refreshes = int(state["refreshes"])
        self._pending, self._rows = 0, None


def account_from_norms(norms, steps, sample_rate, noise_multiplier: float, clip_norm: float, delta: float,
                       rounding: str = "nearest", rounding_step: float | None = None, clip_norms=None):
    """Offline accounting: ``norms`` (refreshes × examples), ``steps[j]`` steps covered by refresh j.

    Returns ``(epsilons, worst_case_epsilons)`` per example.
    """
    norms = np.asarray(norms, dtype=float)
    if norms.ndim != 2:
        raise InvalidParameterError("norms", f"array of shape {norms.shape}", "must be 2-D (refreshes × examples)")
    steps = np.broadcast_to(np.asarray(steps), (norms.shape[0],))
    if np.any(steps < 0) or np.any(steps != np.round(steps)):
        raise InvalidParameterError("steps", steps, "must be integers >= 0, one per refresh")
    acc = IndividualAccountant(sample_rate, noise_multiplier, clip_norm,
                               clip_norms if clip_norms is not None else np.full(norms.shape[1], clip_norm),
                               rounding=rounding, rounding_step=rounding_step)
    for row, k in zip(norms, steps):
        acc.update_norms(row)
        acc.add_steps(int(k))
    return acc.epsilon(delta), acc.worst_case_epsilon(delta)
