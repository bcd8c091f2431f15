"""Individual Rényi filter on the engine: every example leaves training when its own budget is spent.

Feldman & Zrnic 2021 ("Individual privacy accounting via a Rényi filter", arXiv:2008.11193) with
individual budgets, as Boenisch et al. 2023 combine it with individualized assignment (§5,
App. D.5).  Example i has a fixed Rényi order α_i and an RDP budget B(ε_i, α_i) (Balle et al.
2020, Thm. 21); before each step the filter bounds the step's RDP at α_i from a clip bound C_{i,t}
fixed from already-released parameters, clips i at it, and admits i only while the running sum
stays within B_i; a dropped example gets rate 0 and is refused in any batch.
:class:`IndividualFilter` is the engine's filter with ``privacy_filter="individual"`` (the
:class:`~.group_filter.StepFilter` interface); :func:`prepare_filter` builds it at set-up.  Why it
is a valid filter, the order choice and what is private: docs/filter.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...accounting import DEFAULT_ORDERS, RdpLedger, compute_rdp_pointwise, order_universe, round_sensitivities
from ...accounting.output_specific import DEFAULT_ROUNDING_FRACTION
from ...validation import InvalidParameterError, check_delta, check_positive
from .accountant import PrivacyBudgetExceeded

DEFINITION = (
    "individual (epsilon_i, delta)-DP for every example i: an individual Renyi filter at a fixed order "
    "alpha_i with RDP budget B(epsilon_i, alpha_i) (Feldman & Zrnic 2021; Boenisch et al. 2023, §5, App. D.5)"
)
#: Safety margin subtracted from every RDP budget (absolute, × max(1, ε)): the float error of the
#: conversion is ~1e-15, so the converted ε of a ledger at its budget stays ≤ ε.
BUDGET_MARGIN = 1e-12


@dataclass(frozen=True)
class FilterOptions:
    """Options of the individual Rényi filter and of the filtered training recipe.

    Engine: ``order``, ``gd``, ``refreshes_per_epoch``, ``rounding_step``, ``norm_batch_size``.
    Recipe (:mod:`idpsgd.training.filtered`): ``gd`` (full batch) and ``extend`` (run length).
    """

    order: float | None = None  # fixed Rényi order for everyone (None: per class, see the module doc)
    gd: bool = False  # full-batch DP-GD: q = 1, exact bounds refreshed every step
    extend: float = 2.0  # the recipe runs extend × the calibrated steps (public, fixed)
    refreshes_per_epoch: float = 1.0  # DP-SGD: clip-bound refreshes per epoch (GD: every step)
    rounding_step: float | None = None  # DP-SGD: bounds rounded up to multiples of r (default 0.01 × max c_i)
    norm_batch_size: int = 256  # batch size of the norm passes

    def validate(self) -> FilterOptions:
        if self.order is not None:
            a = float(self.order)
            if not (a > 1 and math.isfinite(a)):
                raise InvalidParameterError("filter_order", self.order, "must be a Rényi order > 1 and finite")
        if not isinstance(self.gd, bool):
            raise InvalidParameterError("gd", self.gd, "must be True or False")
        check_positive(self.extend, "filter_extend")
        if self.extend < 1:
            raise InvalidParameterError("filter_extend", self.extend, "must be >= 1 (the calibrated steps at least)")
        check_positive(self.refreshes_per_epoch, "filter_refreshes_per_epoch")
        if self.rounding_step is not None:
            check_positive(self.rounding_step, "filter_rounding_step")
        if int(self.norm_batch_size) != self.norm_batch_size or self.norm_batch_size < 1:
            raise InvalidParameterError("norm_batch_size", self.norm_batch_size, "must be an integer >= 1")
        return self


# --- budgets and orders (numpy only) -------------------------------------------------------------
def conversion_cost(alpha, delta: float) -> np.ndarray:
    """ε − ρ of the improved RDP → (ε, δ) conversion at order α: log(1 − 1/α) − (log δ + log α)/(α − 1)."""
    a = np.asarray(alpha, dtype=float)
    return np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1)


def rdp_budget(epsilon, alpha, delta: float) -> np.ndarray:
    """B(ε, α) = ε − :func:`conversion_cost` (α, δ) − margin: the RDP at order α that converts to ≤ ε at δ
    (may be ≤ 0: then no RDP fits)."""
    eps = np.asarray(epsilon, dtype=float)
    return eps - conversion_cost(alpha, check_delta(delta)) - BUDGET_MARGIN * np.maximum(1.0, eps)


def worst_case_orders(
    sample_rate: float, noise_multiplier: float, epsilons, delta: float, orders=DEFAULT_ORDERS
) -> np.ndarray:
    """For each budget ε: the order α of the universe of ``orders`` maximizing B(ε, α)/ρ(q, σ, α) — the
    fixed order at which the most worst-case steps (sensitivity = clip norm, effective noise
    multiplier σ, rate q) fit.  Raises when a budget cannot pay for one such step at any order."""
    u, _ = order_universe(orders)
    eps = np.atleast_1d(np.asarray(epsilons, dtype=float))
    rho = compute_rdp_pointwise(np.full(u.size, float(sample_rate)), np.full(u.size, float(noise_multiplier)), u)
    cost = conversion_cost(u, check_delta(delta))
    values, inverse = np.unique(eps, return_inverse=True)
    best = np.empty(values.size)
    for start in range(0, values.size, 1024):  # (budgets × orders) in blocks
        v = values[start : start + 1024]
        budget = v[:, None] - cost[None, :] - BUDGET_MARGIN * np.maximum(1.0, v)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(budget > 0, budget / rho[None, :], -np.inf)
        k = np.argmax(ratio, axis=1)
        fits = ratio[np.arange(v.size), k] >= 1
        if not np.all(fits):
            e = float(v[np.flatnonzero(~fits)[0]])
            raise InvalidParameterError(
                "budgets",
                e,
                f"is too small for even one step: at every Rényi order in [{u[0]:g}, {u[-1]:g}] one "
                f"step at the clip norm (sampling rate {sample_rate:g}, effective noise multiplier "
                f"{noise_multiplier:.6g}) costs more RDP than the budget allows; raise the budget or the noise",
            )
        best[start : start + v.size] = u[k]
    return best[inverse.ravel()]


class IndividualFilter:
    """Individual Rényi filter for one phase of an engine (see the module doc).

    Built from the phase's public parameters and the budgets (orders, RDP budgets, checks: nothing
    of the engine changes if it refuses), then :meth:`attach` ed to the engine.

    Args:
        options: :class:`FilterOptions`.
        per_sample_loss: ``fn(module, batch) -> one loss per example`` for the norm passes
            (default: cross-entropy of ``(inputs, targets, ...)`` batches).
        budgets: the per-example budgets ε_i and δ (:class:`~idpsgd.assignment.Budgets`).
        sample_rates, clip_norms: q_i and c_i of the phase (q_i = 0: never trained, never charged).
        noise_multiplier, max_grad_norm: σ and the reference clip norm c (noise std σ·c).
    """

    def __init__(
        self,
        options: FilterOptions | None,
        per_sample_loss,
        budgets,
        sample_rates,
        clip_norms,
        noise_multiplier: float,
        max_grad_norm: float,
    ):
        self.options = o = (options or FilterOptions()).validate()
        self.per_sample_loss = per_sample_loss
        q = np.asarray(sample_rates, dtype=float).ravel().copy()
        clip = np.asarray(clip_norms, dtype=float).ravel().copy()
        sigma, c = float(noise_multiplier), float(max_grad_norm)
        if not (sigma > 0 and math.isfinite(sigma)):
            raise InvalidParameterError(
                "noise_multiplier", noise_multiplier, "must be > 0 and finite with the individual filter"
            )
        if o.gd and np.any((q > 0) & (q < 1)):
            raise InvalidParameterError(
                "sample_rates",
                float(q[(q > 0) & (q < 1)][0]),
                "full-batch DP-GD (gd=True) needs every sampling rate 1 (or 0: not trained)",
            )
        self.delta = budgets.delta
        self.q, self.clip_norms, self.sigma, self.c = q, clip, sigma, c
        self.group_values, _, self.group_of = budgets.groups()
        self.order = self._orders(budgets.epsilons, q, clip)
        self.rdp_budget = np.where(
            q > 0, rdp_budget(budgets.epsilons, np.where(q > 0, self.order, 2.0), self.delta), 0.0
        )
        self._check_one_step(budgets.epsilons)
        self.rounding = "exact" if o.gd else "ceil"
        self.rounding_step = (
            None
            if o.gd
            else o.rounding_step
            if o.rounding_step is not None
            else DEFAULT_ROUNDING_FRACTION * float(clip.max())
        )
        # one ledger per distinct filter order: each example is charged at, and reads, its own order only
        self.filter_orders = np.unique(self.order[q > 0])
        self._members = [np.flatnonzero(self.order == a) for a in self.filter_orders]
        self.ledgers = [RdpLedger(m.size, [a]) for m, a in zip(self._members, self.filter_orders, strict=True)]
        self.active = q > 0
        self.rates = q.copy()  # the sampler reads these: 0 drops an example
        self.bounds = clip.copy()  # C_{i,t}: the clip bound of the coming step
        self.dropped_at = np.full(q.size, -1, dtype=np.int64)  # first step an example missed (-1: active)
        self.next_rdp = np.zeros(q.size)
        self.history: list[np.ndarray] = []  # active examples per group in every step taken
        self.phase = None  # the engine's phase (engine/phase.py), once attached
        self.every = 1
        self.steps = 0
        self.refreshes = 0
        self._rho = None
        self._prepared = False

    # --- attachment ----------------------------------------------------------------------
    def attach(self, phase) -> IndividualFilter:
        """Called by ``make_private_with_parameters`` once the phase is set up (``phase``: its
        :class:`~..phase.Phase`): the sampler reads the filter's rates, the optimizer runs its hook after
        every update, and the first step is prepared (norms at θ_0, bounds, admissions)."""
        if self.phase is not None:
            raise RuntimeError("this filter is already attached to an engine")
        spe = phase.parameters.steps_per_epoch
        self.every = 1 if self.options.gd else max(1, round(spe / float(self.options.refreshes_per_epoch)))
        self.phase = phase
        phase.data_loader.poisson_sampler.follow_rates(self.rates)
        phase.optimizer.add_post_step_hook(self._after_step)
        self._prepare_step()
        return self

    def _orders(self, eps, q, clip) -> np.ndarray:
        order = np.full(q.size, np.nan)
        on = q > 0
        if self.options.order is not None:
            order[on] = float(self.options.order)
            return order
        idx = np.flatnonzero(on)
        pairs, inv = np.unique(np.stack([q[on], clip[on]], axis=1), axis=0, return_inverse=True)
        inv = inv.ravel()
        for j, (qq, cc) in enumerate(pairs):  # one RDP curve per (rate, clip norm); all budgets against it
            rows = idx[inv == j]
            order[rows] = worst_case_orders(qq, self.sigma * self.c / cc, eps[rows], self.delta)
        return order

    def _check_one_step(self, eps) -> None:
        on = np.flatnonzero(self.q > 0)
        worst = compute_rdp_pointwise(self.q[on], self.sigma * self.c / self.clip_norms[on], self.order[on])
        bad = worst > self.rdp_budget[on]
        if np.any(bad):
            j = on[np.flatnonzero(bad)[0]]
            b = float(self.rdp_budget[j])
            why = (
                f"its RDP budget at order {self.order[j]:g} is {b:.4g} <= 0 (the conversion to delta="
                f"{self.delta:g} alone costs more); choose a larger --filter-order"
                if b <= 0
                else f"one step at the clip norm costs RDP {float(worst[np.flatnonzero(bad)[0]]):.4g} at order "
                f"{self.order[j]:g}, above its RDP budget {b:.4g}; raise the budget or the noise"
            )
            raise InvalidParameterError(
                "budgets", float(eps[j]), f"is too small for even one step of the individual filter: {why}"
            )

    # --- the filter, step by step ---------------------------------------------------------
    @property
    def rdp_spent(self) -> np.ndarray:
        """Each example's accumulated RDP at its own filter order (private values)."""
        out = np.zeros(self.q.size)
        for m, led in zip(self._members, self.ledgers, strict=True):
            out[m] = led.rdp[:, 0]
        return out

    def _refresh(self, act: np.ndarray) -> None:
        norms, _ = self.phase.grad_norms(self.per_sample_loss, indices=act, batch_size=self.options.norm_batch_size)
        self.bounds[act] = round_sensitivities(norms, self.clip_norms[act], self.rounding, self.rounding_step)
        self.phase.clipping.set_clip_norms(self.bounds)
        self.refreshes += 1
        self._rho = None

    def _prepare_step(self) -> None:
        """Bounds and admissions for the coming step, at the current (released) parameters."""
        act = np.flatnonzero(self.active)
        if act.size and self.steps % self.every == 0:
            self._refresh(act)
        if self._rho is None:  # per-step RDP at the current bounds (active examples)
            self._rho = np.zeros(self.q.size)
            if act.size:
                with np.errstate(divide="ignore"):
                    sig = np.where(self.bounds[act] > 0, self.sigma * self.c / self.bounds[act], np.inf)
                self._rho[act] = compute_rdp_pointwise(self.q[act], sig, self.order[act])
        spent = self.rdp_spent
        admit = spent[act] + self._rho[act] <= self.rdp_budget[act]
        drop = act[~admit]
        self.active[drop] = False
        self.rates[drop] = 0.0
        self.dropped_at[drop] = self.steps + 1
        self.next_rdp = np.where(self.active, self._rho, 0.0)
        self._prepared = True

    def guard(self, optimizer) -> None:
        """Before the noise: the step's examples must all be active (a dropped example has rate 0; a
        batch drawn before the filter's decision is refused, nothing is released)."""
        if not self._prepared:
            raise PrivacyBudgetExceeded(
                f"individual filter: step {self.steps + 1} is beyond the {self.phase.parameters.steps} steps "
                "planned for this phase; no bounds were set for it (give make_private the run's length as steps)"
            )
        pending = self.phase.clipping.pending_indices  # this step's clipped examples, in clipping order
        if pending:
            idx = torch.cat([t.reshape(-1) for t in pending]).cpu().numpy()
            bad = ~self.active[idx]
            if np.any(bad):
                raise PrivacyBudgetExceeded(
                    f"individual filter: step {self.steps + 1} holds {int(bad.sum())} example(s) the filter has "
                    "dropped (a batch drawn before the filter's decision); the step was not taken"
                )

    def can_step(self) -> bool:
        """The filter never refuses a whole step: dropped examples just take no part (the run's length
        is the recipe's public choice)."""
        return True

    def _after_step(self, _optimizer) -> None:
        for m, led in zip(self._members, self.ledgers, strict=True):
            led.add(self.next_rdp[m][:, None])
            led.count_steps()
        self.steps += 1
        self.history.append(np.bincount(self.group_of[self.active], minlength=self.group_values.size))
        self._prepared = False
        planned = self.phase.parameters.steps
        if planned is None or self.steps < planned:
            self._prepare_step()

    # --- results ---------------------------------------------------------------------------
    def realized_epsilons(self, delta: float | None = None) -> np.ndarray:
        """ε of each example's accumulated RDP converted at its own order (0 for untrained examples);
        private, output-specific values — by the filter each is ≤ the example's budget at its δ."""
        delta = self.delta if delta is None else check_delta(delta)
        out = np.zeros(self.q.size)
        for m, led in zip(self._members, self.ledgers, strict=True):
            out[m] = led.epsilon(delta)[0]
        return out

    def guarantee_epsilons(self, delta: float | None = None) -> np.ndarray:
        """The filter's guarantee per example: its RDP budget at its order converted at ``delta`` (the
        budget ε_i itself at the budgets' δ); 0 for examples never trained."""
        delta = self.delta if delta is None else check_delta(delta)
        out = np.zeros(self.q.size)
        on = self.q > 0
        out[on] = self.rdp_budget[on] + conversion_cost(self.order[on], delta)
        return out

    def active_counts(self) -> np.ndarray:
        """(steps × groups): active examples of every budget group in every step taken (private)."""
        g = self.group_values.size
        return np.array(self.history, dtype=np.int64).reshape(-1, g)

    def summary(self) -> dict:
        """Public description (functions of the public parameters and the group budgets only)."""
        groups = []
        for k, v in enumerate(self.group_values):
            m = (self.group_of == k) & (self.q > 0)
            orders = np.unique(self.order[m])
            groups.append(
                {"budget": float(v), "orders": orders.tolist(), "rdp_budgets": np.unique(self.rdp_budget[m]).tolist()}
            )
        return {
            "definition": DEFINITION,
            "gd": self.options.gd,
            "fixed_order": self.options.order,
            "order_choice": "fixed" if self.options.order is not None else "worst-case optimal per group",
            "conversion": "improved (Balle et al. 2020 Thm. 21): B = eps - log(1-1/alpha) + (log delta + log "
            "alpha)/(alpha-1)",
            "refresh_every_steps": self.every,
            "bounds": self.rounding,
            "rounding_step": self.rounding_step,
            "groups": groups,
        }

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "refreshes": self.refreshes,
            "prepared": self._prepared,
            "order": self.order.copy(),
            "active": self.active.copy(),
            "rates": self.rates.copy(),
            "bounds": self.bounds.copy(),
            "dropped_at": self.dropped_at.copy(),
            "next_rdp": self.next_rdp.copy(),
            "rho": None if self._rho is None else self._rho.copy(),
            "history": self.active_counts(),
            "ledgers": [led.state_dict() for led in self.ledgers],
        }

    def load_state_dict(self, state: dict) -> None:
        if not np.array_equal(np.asarray(state["order"], dtype=float), self.order, equal_nan=True):
            raise ValueError("the filter state was saved with other filter orders (budgets, rates or options differ)")
        self.steps, self.refreshes = int(state["steps"]), int(state["refreshes"])
        self._prepared = bool(state["prepared"])
        self.active = np.asarray(state["active"], dtype=bool).copy()
        self.rates[:] = np.asarray(state["rates"], dtype=float)
        self.bounds = np.asarray(state["bounds"], dtype=float).copy()
        self.dropped_at = np.asarray(state["dropped_at"], dtype=np.int64).copy()
        self.next_rdp = np.asarray(state["next_rdp"], dtype=float).copy()
        self._rho = None if state.get("rho") is None else np.asarray(state["rho"], dtype=float).copy()
        self.history = list(np.asarray(state["history"], dtype=np.int64).reshape(-1, self.group_values.size))
        for led, s in zip(self.ledgers, state["ledgers"], strict=True):
            led.load_state_dict({k: np.asarray(v) if k != "steps" else int(v) for k, v in s.items()})
        self.phase.clipping.set_clip_norms(self.bounds)


def prepare_filter(
    engine,
    data_loader,
    options,
    per_sample_loss,
    budgets,
    sample_rates,
    clip_norms,
    noise_multiplier: float,
    max_grad_norm: float,
) -> IndividualFilter:
    """Refuse what the individual filter cannot honour and build it (not yet attached); called by the
    engine before any of its state changes."""
    if engine.accountant_name != "rdp":
        raise InvalidParameterError(
            "accountant",
            engine.accountant_name,
            "is not supported with the individual filter: a Rényi filter composes RDP at a "
            "fixed order (Feldman & Zrnic 2021); use the rdp accountant",
        )
    if engine.individual is not None:
        raise InvalidParameterError(
            "individual_accounting",
            True,
            "cannot be combined with the individual filter (the filter already accounts every example individually)",
        )
    if engine.accountant is not None:
        raise InvalidParameterError(
            "privacy_filter",
            "individual",
            "supports one-phase runs (this engine already has a phase; use a new engine)",
        )
    if data_loader.num_workers > 0:
        raise InvalidParameterError(
            "num_workers",
            data_loader.num_workers,
            "must be 0 with the individual filter: worker processes draw batches ahead, "
            "before the filter has dropped the examples that spent their budget",
        )
    if options is not None and not isinstance(options, FilterOptions):
        raise InvalidParameterError("filter_options", type(options).__name__, "must be a FilterOptions")
    return IndividualFilter(
        options, per_sample_loss, budgets, sample_rates, clip_norms, noise_multiplier, max_grad_norm
    )
