"""The engine's privacy accountant: data-independent ε per privacy group, and what the filter asks it.

Data-independent individual (ε_p, δ)-DP for every example of privacy group p (Boenisch et al.
2023, eq. 3): at every step each example i is a Poisson-subsampled Gaussian mechanism with its rate
q_i and effective noise multiplier σ·c/c_i, charged whether or not it was sampled.  Examples with
one budget, rate and clip norm in every phase (a *cohort*) share their composition; a group's ε is
the largest over its cohorts.  ε comes from the run's accountant (``rdp``, ``pld``, ``prv``;
:func:`idpsgd.accounting.get_accountant`), so filter, report and calibration agree.
:class:`GroupAccountant` has Opacus's accountant interface; :class:`GroupEpsilons` is what
``get_epsilon`` returns.  Whether one more step fits is answered by cached step-count searches
(:mod:`.group_filter` asks); details: docs/inside-the-engine.md.
"""

from __future__ import annotations

import numpy as np
import torch

from ...accounting import DEFAULT_ORDERS, SampledGaussianEvent, compute_rdp, get_accountant, rdp_to_epsilon
from ...assignment import Budgets
from ...names import ACCOUNTANTS
from ...validation import InvalidParameterError, check_delta


class PrivacyBudgetExceeded(RuntimeError):
    """The privacy filter refused a step, or ``make_private`` a plan: it would take a privacy group
    over its budget."""


def phase_sha256(q, sigma, group, class_of) -> str:
    """A phase's identity as the accountant sees it (its classes and each example's class): a journal
    record of a drawn step names it, so a draw of the same phase is charged exactly (:mod:`.journal`)."""
    import hashlib

    h = hashlib.sha256()
    for a, dt in ((q, np.float64), (sigma, np.float64), (group, np.int64), (class_of, np.int64)):
        h.update(np.ascontiguousarray(np.asarray(a, dtype=dt)).tobytes())
        h.update(b"|")
    return h.hexdigest()


def _epsilon(events, delta: float, accountant: str) -> float:
    """ε of a composition by the named accountant (:func:`idpsgd.accounting.get_accountant`); 0 for none."""
    return float(get_accountant(accountant)(events, delta)) if events else 0.0


class GroupEpsilons(float):
    """ε spent, as returned by ``engine.get_epsilon`` and ``engine.accountant.get_epsilon``: **a float**
    — the loosest privacy group's ε — that also carries every group's ε.

    **As a number** it is a plain Python float in every way (``round``, ``json.dumps``,
    comparisons, arithmetic, ``f"{eps:.2f}"``, ``torch.tensor(eps)``, numpy), as Opacus's
    ``get_epsilon`` returns.  Its value is the *largest* group's ε, the loosest one: every example
    of group p is (ε_p, δ)-DP and ε_p ≤ max_p ε_p, so the maximum is the one ε that bounds every
    example; the strictest group's ε would overstate the privacy of every other group.  With one
    budget (Opacus's setting) it is simply the ε.

    **Per group**: :attr:`per_group` is the numpy array of the groups' ε (ascending budgets, the
    order of :attr:`budgets`); :attr:`loosest` / :attr:`strictest` name the two ends.  ``repr``
    shows the table when there are several groups.  Arithmetic gives plain floats.

    Attributes: ``per_group``, ``budgets`` (the groups' budgets; inf without budgets), ``counts``
    (units per group), ``delta``, ``accountant``, ``steps`` (the step count the values are for),
    ``unit`` (what a group counts: ``"example"``, or ``"user"`` at user level).
    """

    def __new__(cls, epsilons, budgets, counts, delta, accountant: str, steps: int, unit: str = "example"):
        per_group = np.array(epsilons, dtype=float).reshape(-1)
        obj = super().__new__(cls, float(per_group.max()) if per_group.size else 0.0)
        per_group.setflags(write=False)
        obj.per_group = per_group
        obj.budgets = np.asarray(budgets, dtype=float)
        obj.counts = np.asarray(counts, dtype=np.int64)
        obj.delta, obj.accountant, obj.steps, obj.unit = delta, accountant, int(steps), str(unit)
        return obj

    def __reduce__(self):  # pickles and deep-copies whole
        return (
            GroupEpsilons,
            (self.per_group.copy(), self.budgets, self.counts, self.delta, self.accountant, self.steps, self.unit),
        )

    @property
    def loosest(self) -> float:
        """The largest group ε (the value of this float): a bound for every example."""
        return float(self)

    @property
    def strictest(self) -> float:
        """The smallest group ε (the strictest group's; a bound for that group only)."""
        return float(self.per_group.min()) if self.per_group.size else 0.0

    def __repr__(self) -> str:
        if self.per_group.size <= 1:
            return float.__repr__(self)
        head = (
            f"GroupEpsilons({float.__repr__(self)}: {self.accountant}, delta={self.delta:g}, after {self.steps} "
            "steps; as a number the loosest group's)"
        )
        rows = [f"  {'budget':>10} {self.unit + 's':>9} {'epsilon':>10}"]
        for b, n, e in zip(self.budgets, self.counts, self.per_group, strict=True):
            rows.append(f"  {'-' if not np.isfinite(b) else format(b, '.4g'):>10} {int(n):>9d} {e:>10.4f}")
        return "\n".join([head, *rows])


class GroupAccountant:
    """Per-group (and per-example, data-independent) ε of the steps taken so far.

    Args:
        budgets: per-example budgets ε_i and δ; the privacy groups are the distinct budgets.  None:
            one group without a budget (``num_examples`` examples; ``delta`` the default δ, or None:
            every ε query names its δ).
        accountant: ``rdp``, ``pld`` or ``prv``.
    """

    def __init__(
        self,
        budgets: Budgets | None,
        accountant: str = "rdp",
        orders=DEFAULT_ORDERS,
        *,
        num_examples: int | None = None,
        delta: float | None = None,
    ):
        if accountant not in ACCOUNTANTS:
            raise InvalidParameterError("accountant", accountant, f"must be one of {', '.join(ACCOUNTANTS)}")
        self.budgets, self.accountant = budgets, accountant
        self.unit = "example"  # "user" at user level (:meth:`count_units`): what the groups count
        if budgets is not None:
            self.values, self.counts, self.group_of = budgets.groups()
            self.delta = budgets.delta
        else:  # no budgets (one σ, as Opacus's make_private): one group, nothing to filter
            n = int(num_examples)
            self.values, self.counts = np.array([np.inf]), np.array([n])
            self.group_of = np.zeros(n, dtype=np.int64)
            self.delta = None if delta is None else check_delta(delta)
        self.orders = np.asarray(orders, dtype=float)
        self.phases: list[dict] = []
        #: noise draws charged beside the kept steps (abandoned attempts of a resumed run: engine/budget/journal.py),
        #: one entry per draw: its phase and classes, and ``at`` (a pending replay of kept step ``at``) or None
        self.extra: list[dict] = []
        self._cohorts = None  # (cohort of every example, [per-cohort class index per phase])
        self._ok: dict = {}  # (phase, cohort) -> largest phase step count known within budget
        self._bad: dict = {}  # (phase, cohort) -> smallest phase step count known over budget

    @property
    def num_examples(self) -> int:
        return int(self.group_of.size)

    @property
    def steps(self) -> int:
        """Steps kept: the logical steps of this run's lineage (the model descends from them)."""
        return int(sum(p["steps"] for p in self.phases))

    @property
    def released_steps(self) -> int:
        """Noise draws of abandoned attempts charged beside the kept steps (their outputs may have left
        the process: a resumed secure run, :mod:`.journal`)."""
        return sum(1 for e in self.extra if e["at"] is None)

    @property
    def pending_steps(self) -> int:
        """Draws of an abandoned attempt that this run replays (reproducible mode: the same noise) and has
        not reached yet: the kept step that replays one is the same output, charged once; those the run
        does not reach are charged when it ends (:meth:`settle`)."""
        kept = self.steps
        return sum(1 for e in self.extra if e["at"] is not None and e["at"] > kept)

    @property
    def charged_steps(self) -> int:
        """Every step charged: kept and released (the ε reported covers all of them)."""
        return self.steps + self.released_steps

    def settle(self) -> int:
        """The run ends here: pending replays it did not reach are released draws, charged from now on.
        Returns how many."""
        kept, n = self.steps, 0
        for e in self.extra:
            if e["at"] is not None and e["at"] > kept:
                e["at"], n = None, n + 1
        if n:
            self._ok, self._bad = {}, {}
        return n

    def charge_drawn(self, draws: list[dict]) -> None:
        """Charge noise draws that no kept step covers (:mod:`.journal`): each ``{"phase": k, "sha256":
        the phase's identity, "events": [[group, q, σ_eff], ...] (the accountant's classes of that
        phase), "at": step index or None}``.  A draw is charged to every example of each listed group at
        its class's (q, σ_eff) — exactly when phase k of this accountant is that phase, else at the
        group's largest q with its smallest σ_eff (which dominates each of its classes).  ``at``: a
        pending replay of step ``at`` (:attr:`pending_steps`), charged by :meth:`settle` if the run ends
        before it.  Validated before anything changes."""
        entries = []
        for d in draws:
            ev = np.asarray(d["events"], dtype=float).reshape(-1, 3)
            group = ev[:, 0].astype(np.int64)
            if np.any(group < 0) or np.any(group >= self.values.size) or np.any(group != ev[:, 0]):
                raise ValueError(f"a drawn step's groups {ev[:, 0].tolist()} are not this run's privacy groups")
            if not (np.all((ev[:, 1] > 0) & (ev[:, 1] <= 1)) and np.all(ev[:, 2] > 0)):
                raise ValueError("a drawn step's events are not subsampled Gaussian mechanisms (0 < q <= 1, sigma > 0)")
            at = d.get("at")
            entries.append(
                {
                    "phase": int(d["phase"]),
                    "sha256": str(d["sha256"]),
                    "q": ev[:, 1].copy(),
                    "sigma": ev[:, 2].copy(),
                    "group": group,
                    "at": None if at is None else int(at),
                }
            )
        self.extra.extend(entries)
        self._ok, self._bad = {}, {}

    def _extra_class(self, entry: dict, cohort: int) -> tuple[float, float] | None:
        """(q, σ_eff) at which a charged draw counts for ``cohort`` (None: not in it)."""
        _, table, cohort_group = self.cohorts()
        k = entry["phase"]
        if k < len(self.phases) and self.phases[k]["sha256"] == entry["sha256"]:
            cls = table[cohort, k]
            if cls < 0:
                return None
            return float(self.phases[k]["q"][cls]), float(self.phases[k]["sigma"][cls])
        on = entry["group"] == cohort_group[cohort]
        if not np.any(on):
            return None
        return float(entry["q"][on].max()), float(entry["sigma"][on].min())

    def _extras_counted(self, kept: int = 0) -> list[dict]:
        """The charged draws: released ones (a pending replay of step j is the kept step j itself, charged
        by it; :meth:`settle` releases those not reached)."""
        return [e for e in self.extra if e["at"] is None]

    # --- phases ----------------------------------------------------------------------------
    def count_units(self, unit: str) -> None:
        """What a privacy group counts in the reports (:class:`GroupEpsilons`): ``"example"``, or ``"user"``
        when the protected unit is a user (user-level DP); set by the engine at each phase."""
        if unit not in ("example", "user"):
            raise InvalidParameterError("unit", unit, 'must be "example" or "user"')
        self.unit = unit

    def begin_phase(self, sample_rates, clip_norms, noise_multiplier: float, max_grad_norm: float) -> None:
        """Start a phase: example i has rate q_i and effective noise multiplier σ·c/c_i."""
        q = np.asarray(sample_rates, dtype=float).ravel()
        c = np.asarray(clip_norms, dtype=float).ravel()
        if q.size != self.num_examples or c.size != self.num_examples:
            raise InvalidParameterError(
                "sample_rates", f"{q.size} rates and {c.size} clip norms", f"need one per example ({self.num_examples})"
            )
        sig = float(noise_multiplier) * float(max_grad_norm) / c
        active = q > 0
        rows = np.stack([self.group_of[active].astype(float), q[active], sig[active]], axis=1)
        classes, inv = (
            np.unique(rows, axis=0, return_inverse=True)
            if rows.size
            else (np.zeros((0, 3)), np.zeros(0, dtype=np.int64))
        )
        class_of = np.full(self.num_examples, -1, dtype=np.int64)
        class_of[active] = inv.ravel()
        self.phases.append(
            self._phase(classes[:, 1].copy(), classes[:, 2].copy(), classes[:, 0].astype(np.int64), class_of, 0)
        )
        self._forget_phase(len(self.phases) - 1)

    def discard_phase(self) -> None:
        """Undo the last :meth:`begin_phase` (before any step of it): a set-up that was refused."""
        if not self.phases or self.phases[-1]["steps"]:
            raise RuntimeError("only a phase without steps can be discarded")
        self.phases.pop()
        self._forget_phase(len(self.phases))

    def _forget_phase(self, k: int) -> None:
        """Drop the cached cohorts and the filter's cache of phase index ``k`` (it belongs to one phase only)."""
        self._cohorts = None
        self._ok = {key: v for key, v in self._ok.items() if key[0] != k}
        self._bad = {key: v for key, v in self._bad.items() if key[0] != k}

    def _require_phase(self) -> dict:
        if not self.phases:
            raise RuntimeError("no phase: call begin_phase (make_private) first")
        return self.phases[-1]

    def step(self) -> None:
        """Charge one step of the current phase to every example with q_i > 0 in it."""
        self._require_phase()["steps"] += 1

    # --- cohorts (examples with one rate and clip norm in every phase) and events -----------
    def cohorts(self):
        """(cohort index per example, class index per phase for each cohort: array cohorts × phases)."""
        if self._cohorts is None:
            table = (
                np.stack([p["class_of"] for p in self.phases], axis=1)
                if self.phases
                else np.full((self.num_examples, 0), -1)
            )
            uniq, inv = np.unique(np.concatenate([self.group_of[:, None], table], axis=1), axis=0, return_inverse=True)
            self._cohorts = (inv.ravel(), uniq[:, 1:], uniq[:, 0].astype(np.int64))
        return self._cohorts

    def _events(self, cohort: int, extra_steps: int = 0, phase_steps=None) -> list[SampledGaussianEvent]:
        _, table, _ = self.cohorts()
        events = []
        last = len(self.phases) - 1
        kept = 0
        for k, ph in enumerate(self.phases):
            cls = table[cohort, k]
            steps = ph["steps"] if phase_steps is None or k != last else phase_steps
            steps += extra_steps if k == last else 0
            kept += steps
            if cls >= 0 and steps > 0:
                events.append(SampledGaussianEvent(float(ph["q"][cls]), float(ph["sigma"][cls]), int(steps)))
        for entry in self._extras_counted(kept):  # charged draws of abandoned attempts compose with the kept
            qs = self._extra_class(entry, cohort)
            if qs is None:
                continue
            for i, e in enumerate(events):
                if (e.sample_rate, e.noise_multiplier) == qs:
                    events[i] = SampledGaussianEvent(e.sample_rate, e.noise_multiplier, e.count + 1)
                    break
            else:
                events.append(SampledGaussianEvent(qs[0], qs[1], 1))
        return events

    def resolve_delta(self, delta: float | None) -> float:
        """``delta``, checked, or the budgets' δ (``target_delta`` without budgets)."""
        if delta is not None:
            return check_delta(delta)
        if self.delta is None:
            raise InvalidParameterError(
                "delta",
                None,
                "is required: this engine has no budgets (nor target_delta) to take it from; pass get_epsilon(delta)",
            )
        return self.delta

    def cohort_epsilons(self, delta: float | None = None, extra_steps: int = 0) -> np.ndarray:
        delta = self.resolve_delta(delta)
        _, table, _ = self.cohorts()
        return np.array([_epsilon(self._events(p, extra_steps), delta, self.accountant) for p in range(table.shape[0])])

    def group_epsilons(self, delta: float | None = None, extra_steps: int = 0) -> np.ndarray:
        """ε per privacy group (ascending budgets): the largest over the group's examples; with
        ``extra_steps``, after that many more steps of the current phase (a plan, not a spend)."""
        _cohort_of, _, cohort_group = self.cohorts()
        eps = self.cohort_epsilons(delta, extra_steps)
        out = np.zeros(self.values.size)
        np.maximum.at(out, cohort_group, eps)
        return out

    # --- Opacus's accountant interface ---------------------------------------------------------
    def get_epsilon(self, delta: float | None = None, extra_steps: int = 0) -> GroupEpsilons:
        """Opacus's ``accountant.get_epsilon(delta)``: a float, the loosest group's ε (a
        :class:`GroupEpsilons`, which also carries every group's); ``delta`` defaults to the budgets'."""
        delta = self.resolve_delta(delta)
        return GroupEpsilons(
            self.group_epsilons(delta, extra_steps),
            self.values,
            self.counts,
            delta,
            self.accountant,
            self.steps + int(extra_steps),
            unit=self.unit,
        )

    def mechanism(self) -> str:
        """Opacus's name of the accounting mechanism: ``rdp``, ``prv`` or ``pld``."""
        return self.accountant

    def __len__(self) -> int:
        """Opacus's ``len(accountant)``: the number of entries of :attr:`history` (one per run of steps with
        the same noise multiplier and sampling rate — 1 for a one-phase run, as Opacus's accountants give);
        the steps accounted are ``engine.steps``."""
        return len(self.history)

    def __bool__(self) -> bool:  # an accountant is an accountant, also before its first step
        return True

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus's history, ``[(noise_multiplier, sample_rate, steps), ...]``: with one privacy group
        (Opacus's setting) its composition; with several, the largest budget's group's (the loosest
        when the groups are calibrated to their budgets; :meth:`group_history` has every group's)."""
        return self.group_history()[-1]

    def group_history(self) -> list[list[tuple[float, float, int]]]:
        """Per group (ascending budgets), the SGM events composing its ε, in Opacus's history form
        ``(noise_multiplier, sample_rate, steps)``, one per phase that charged the group.

        A group whose examples share one cohort (every ``make_private`` method) gets exactly its
        composition.  Examples of one group with different rates or clip norms in a phase (explicit
        per-example parameters) are covered by the phase's largest rate with its smallest effective
        noise multiplier, which dominates each of them (the SGM's ε grows with q and falls with σ).
        """
        out: list[list[tuple[float, float, int]]] = [[] for _ in range(self.values.size)]
        for ph in self.phases:
            if not ph["steps"]:
                continue
            for g in range(self.values.size):
                on = ph["group"] == g
                if np.any(on):
                    out[g].append((float(ph["sigma"][on].min()), float(ph["q"][on].max()), int(ph["steps"])))
        for entry in self._extras_counted(self.steps):  # charged draws of abandoned attempts
            for g in range(self.values.size):
                on = entry["group"] == g
                if np.any(on):
                    out[g].append((float(entry["sigma"][on].min()), float(entry["q"][on].max()), 1))
        return out

    def individual_epsilons(self, delta: float | None = None) -> np.ndarray:
        """Data-independent ε of every example (its cohort's composition)."""
        cohort_of, _, _ = self.cohorts()
        return self.cohort_epsilons(delta)[cohort_of]

    def grid_epsilon(self, delta: float | None = None) -> np.ndarray:
        """Cheap per-group ε from the RDP at the fixed order grid (an upper bound, looser than
        :meth:`get_epsilon` with the RDP accountant); for per-step ledgers."""
        delta = self.resolve_delta(delta)
        _, table, cohort_group = self.cohorts()
        rdp = np.zeros((table.shape[0], self.orders.size))
        for k, ph in enumerate(self.phases):
            cls = table[:, k]
            on = cls >= 0
            rdp[on] += ph["steps"] * ph["step_rdp"][cls[on]]
        for entry in self._extras_counted(self.steps):
            for c in range(table.shape[0]):
                qs = self._extra_class(entry, c)
                if qs is not None:
                    rdp[c] += compute_rdp(np.array([qs[0]]), np.array([qs[1]]), self.orders)[0]
        eps = rdp_to_epsilon(rdp, self.orders, delta)[0]
        out = np.zeros(self.values.size)
        np.maximum.at(out, cohort_group, eps)
        return out

    # --- the filter ------------------------------------------------------------------------
    def _within(self, phase: int, cohort: int, steps: int) -> bool:
        key = (phase, cohort)
        if steps <= self._ok.get(key, 0):
            return True
        if steps >= self._bad.get(key, np.iinfo(np.int64).max):
            return False
        _, _, cohort_group = self.cohorts()
        if not np.isfinite(self.values[cohort_group[cohort]]):  # no budget: every step is within it
            return True
        eps = _epsilon(self._events(cohort, phase_steps=steps), self.delta, self.accountant)
        if eps <= self.values[cohort_group[cohort]]:
            self._ok[key] = steps
            return True
        self._bad[key] = steps
        return False

    def admissible_steps(self, phase_steps: int) -> bool:
        """Would every example stay within its budget with ``phase_steps`` steps in this phase?"""
        ph = self._require_phase()
        k = len(self.phases) - 1
        _, table, _ = self.cohorts()
        active = np.flatnonzero(table[:, k] >= 0)
        del ph
        return all(self._within(k, int(p), int(phase_steps)) for p in active)

    def can_step(self) -> bool:
        """Whether one more step of the current phase keeps every group within its budget."""
        return self.admissible_steps(self._require_phase()["steps"] + 1)

    def prime(self, planned_steps: int) -> bool:
        """Check a phase's planned step count once (the filter then admits those steps cheaply)."""
        return self.admissible_steps(int(planned_steps))

    def max_admissible_steps(self, upper: int) -> int:
        """The largest step count ≤ ``upper`` of the current phase that keeps every group within its
        budget (0 if not even one step fits); binary search on the filter's monotone test."""
        lo, hi = 0, int(upper)
        if self.admissible_steps(hi):
            return hi
        while hi - lo > 1:  # admissible(lo), not admissible(hi)
            mid = (lo + hi) // 2
            if self.admissible_steps(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # --- state -----------------------------------------------------------------------------
    def state_dict(self, destination: dict | None = None) -> dict:
        """Plain data (lists, numbers, strings: comparable with ``==``, loadable with
        ``weights_only=True``): every phase's per-class rates, noise multipliers, groups and each
        example's class, with Opacus's keys ``history`` and ``mechanism`` beside them."""
        out = destination if destination is not None else {}
        out.update(
            {
                "history": self.history,
                "mechanism": self.accountant,
                "accountant": self.accountant,
                "phases": [
                    {
                        "q": p["q"].tolist(),
                        "sigma": p["sigma"].tolist(),
                        "group": p["group"].tolist(),
                        "class_of": p["class_of"].tolist(),
                        "steps": int(p["steps"]),
                    }
                    for p in self.phases
                ],
                "extra": [
                    {
                        "phase": e["phase"],
                        "sha256": e["sha256"],
                        "events": [
                            [int(g), float(q), float(sg)]
                            for g, q, sg in zip(e["group"], e["q"], e["sigma"], strict=True)
                        ],
                        "at": e["at"],
                    }
                    for e in self.extra
                ],
            }
        )
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore a state of :meth:`state_dict` (the same phase set up by ``make_private`` must be
        the last one), or an **Opacus accountant's** state (``history`` and ``mechanism`` only):
        its history becomes this accountant's earlier phases, every example at each entry's rate
        and noise multiplier, continued by the current phase (merged into it when the last entry
        has its rate and noise multiplier) — only without budgets, where every example shares one
        rate and clip norm as in Opacus.  Nothing changes when the state is refused."""
        if not isinstance(state, dict) or not ("phases" in state or "history" in state):
            raise ValueError(
                "the accountant state has neither idpsgd's phases nor Opacus's history: it cannot be loaded"
            )
        name = state.get("accountant", state.get("mechanism"))
        if name != self.accountant:
            raise ValueError(
                f"accountant state is for {name!r}, this accountant is {self.accountant!r}: create the "
                f"engine with accountant={name!r} to load it"
            )
        phases = (
            self._phases_from_state(state["phases"])
            if "phases" in state
            else self._phases_from_history(state["history"])
        )
        current = self.phases[-1] if self.phases else None
        if current is not None and "phases" in state:  # must continue the phase make_private set up
            last = phases[-1] if phases else None
            same = last is not None and all(
                last[k].shape == current[k].shape and np.array_equal(last[k], current[k])
                for k in ("q", "sigma", "group", "class_of")
            )
            if not same:
                raise ValueError(
                    "the saved accountant state is for other sampling rates, clip norms, noise or "
                    "examples than the phase make_private set up; load it into an engine set up with "
                    "the same parameters"
                )
        extra, self.extra = self.extra, []
        try:
            self.charge_drawn(state.get("extra", []))
        except (ValueError, KeyError, TypeError):
            self.extra = extra
            raise ValueError("the saved accountant state's charged draws cannot be read") from None
        self.phases = phases
        self._cohorts, self._ok, self._bad = None, {}, {}

    def _phase(self, q, sig, group, class_of, steps: int) -> dict:
        def arr(v, dtype):
            return np.asarray(torch.as_tensor(v).cpu().numpy() if torch.is_tensor(v) else v, dtype=dtype).reshape(-1)

        q, sig, group, class_of = arr(q, float), arr(sig, float), arr(group, np.int64), arr(class_of, np.int64)
        return {
            "q": q,
            "sigma": sig,
            "group": group,
            "class_of": class_of,
            "sha256": phase_sha256(q, sig, group, class_of),  # the phase's identity (journal records name it)
            "steps": int(steps),
            "step_rdp": compute_rdp(q, sig, self.orders) if q.size else np.zeros((0, self.orders.size)),
        }

    def _phases_from_state(self, saved: list) -> list[dict]:
        return [self._phase(p["q"], p["sigma"], p["group"], p["class_of"], p["steps"]) for p in saved]

    def _phases_from_history(self, history) -> list[dict]:
        """Opacus's history as phases (every example at each entry's rate and noise multiplier)."""
        if self.budgets is not None or self.values.size != 1:
            raise ValueError(
                "an Opacus accountant state has one history for all examples; this engine has "
                "per-example budgets: load it into an engine set up with "
                "make_private(noise_multiplier=...) without budgets"
            )
        current = self.phases[-1] if self.phases else None
        if current is not None and (current["q"].size != 1 or np.any(current["class_of"] != 0)):
            raise ValueError(
                "an Opacus accountant state is for one sampling rate and clip norm shared by every "
                "example; this engine's phase has several"
            )
        n = self.num_examples
        out = []
        for entry in history:
            sigma, q, steps = (float(entry[0]), float(entry[1]), int(entry[2]))
            if not (sigma > 0 and 0 < q <= 1 and steps >= 0):
                raise ValueError(
                    f"an Opacus history entry (noise_multiplier={sigma}, sample_rate={q}, steps={steps}) "
                    "is not a subsampled Gaussian mechanism the accountant can charge"
                )
            if out and out[-1]["q"][0] == q and out[-1]["sigma"][0] == sigma:
                out[-1]["steps"] += steps
            else:
                out.append(self._phase([q], [sigma], [0], np.zeros(n), steps))
        if current is not None:
            if out and out[-1]["q"][0] == current["q"][0] and out[-1]["sigma"][0] == current["sigma"][0]:
                current_steps = out.pop()["steps"]
            else:
                current_steps = 0
            out.append(dict(current, steps=current_steps))
        return out
