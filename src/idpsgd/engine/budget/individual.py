"""Individual privacy accounting on the engine (Yu et al. 2023, Alg. 2 and 3, §3.3).

:class:`IndividualTracker` attaches to the engine and composes every example's per-step RDP at its
sensitivity min(c_i, ‖g_i(θ_t)‖) along the trajectory the model takes: norms refreshed every K
steps with the user's per-sample loss (right after the previous update), optionally individual
clipping at the latest rounded norm (Alg. 3), and an exactly tracked validation subset (§3.3).
Whether the numbers are a **guarantee** (output-specific individual DP, Yu et al. Def. 4,
Thm. 3.3: every charge is enforced by clipping at it) or an **estimate** is a function of the
options alone (:attr:`IndividualTracker.kind`, :meth:`IndividualTracker.verdict`); the reported ε
is the minimum of the RDP, PLD and data-independent bounds.  The rules in full, the check's
private record (:mod:`.sensitivity_check`) and the outputs: docs/individual-accounting.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...accounting import ROUNDING, IndividualAccountant, IndividualEpsilons
from ...accounting.output_specific import INDIVIDUAL_ACCOUNTANTS
from ...validation import InvalidParameterError, check_positive
from ..per_example.unwrap import raw_module
from .sensitivity_check import SensitivityCheck, active_dropout, dropout_modules

DEFINITION = "output-specific individual (epsilon_i, delta)-DP (Yu et al. 2023, Def. 4, Thm. 3.3)"


@dataclass(frozen=True)
class IndividualAccountingOptions:
    """Options of individual accounting (Yu et al. 2023)."""

    refreshes_per_epoch: float = 1.0  # γ: gradient-norm refreshes per epoch
    rounding: str = "nearest"  # exact | ceil | nearest (Alg. 2)
    rounding_step: float | None = None  # r (default 0.01 × the largest clip norm)
    individual_clipping: bool = False  # Alg. 3: clip example i at its latest estimate
    validate_subset: int = 1000  # examples tracked exactly at every step (0: none)
    norm_batch_size: int = 256  # batch size of the norm passes
    record_norms: bool = False  # keep every refresh's norms (for offline accounting; private)
    accountant: str = "rdp"  # rdp: per-example RDP; pld: per-example PLD as well (rounded modes)

    def validate(self) -> IndividualAccountingOptions:
        check_positive(self.refreshes_per_epoch, "refreshes_per_epoch")
        if self.rounding not in ROUNDING:
            raise InvalidParameterError("rounding", self.rounding, f"must be one of {', '.join(ROUNDING)}")
        if self.accountant not in INDIVIDUAL_ACCOUNTANTS:
            raise InvalidParameterError(
                "accountant", self.accountant, f"must be one of {', '.join(INDIVIDUAL_ACCOUNTANTS)}"
            )
        if self.accountant == "pld" and self.rounding == "exact":
            raise InvalidParameterError(
                "rounding",
                self.rounding,
                "cannot be used with the pld accountant: "
                "per-example PLD needs rounded sensitivity levels (use ceil or nearest)",
            )
        if self.rounding_step is not None:
            check_positive(self.rounding_step, "rounding_step")
        if int(self.validate_subset) != self.validate_subset or self.validate_subset < 0:
            raise InvalidParameterError("validate_subset", self.validate_subset, "must be an integer >= 0")
        if int(self.norm_batch_size) != self.norm_batch_size or self.norm_batch_size < 1:
            raise InvalidParameterError("norm_batch_size", self.norm_batch_size, "must be an integer >= 1")
        return self


class IndividualTracker:
    """Per-example accounting for one phase of an engine.

    Args:
        options: :class:`IndividualAccountingOptions`.
        per_sample_loss: ``fn(module, batch) -> one loss per example`` (default: cross-entropy of
            ``(inputs, targets, ...)`` batches); the norms are those of this loss's gradients.
        seed: chooses the validation subset.
    """

    def __init__(self, options: IndividualAccountingOptions | None = None, per_sample_loss=None, seed: int = 0):
        self.options = (options or IndividualAccountingOptions()).validate()
        self.per_sample_loss = per_sample_loss
        self.seed = 0 if seed is None else int(seed)
        self.phase = None  # the engine's phase (engine/phase.py), once attached
        self.accountant = self.exact = None
        self.subset = np.zeros(0, dtype=np.int64)
        self.every = 1
        self.stale_steps = 0  # steps taken with norms that were due but not refreshed
        self.enforced_steps = 0  # steps whose clip norms were the charges (configuration, not data)
        self.recorded: list[np.ndarray] = []  # refreshed norms (record_norms)
        self.recorded_steps: list[int] = []  # steps each recorded refresh covered
        self.check: SensitivityCheck | None = None
        self._pass_norms = None  # the last norm pass's raw norms (private) ...
        self._pass_at = -1  # ... computed for this step index (at its parameters)
        self._due = False

    # --- attachment ----------------------------------------------------------------------
    def attach(self, phase) -> None:
        """Called by ``make_private``: set up on the engine's (single) phase (``phase``: its
        :class:`~..phase.Phase`) and hook the optimizer."""
        if self.phase is not None and self.phase.accountant is phase.accountant and len(phase.accountant.phases) > 1:
            raise InvalidParameterError(
                "individual_accounting", True, "supports one-phase runs (a second make_private on this engine)"
            )
        p = phase.parameters
        n = p.sample_rates.size
        if self.accountant is None:
            o = self.options
            self.every = max(1, int(round(p.steps_per_epoch / float(o.refreshes_per_epoch))))
            self.accountant = IndividualAccountant(
                p.sample_rates,
                p.noise_multiplier,
                p.max_grad_norm,
                p.clip_norms,
                rounding=o.rounding,
                rounding_step=o.rounding_step,
            )
            m = min(int(o.validate_subset), n)
            self.subset = (
                np.sort(np.random.default_rng([self.seed, 1]).choice(n, m, replace=False))
                if m
                else np.zeros(0, dtype=np.int64)
            )
            self.exact = (
                IndividualAccountant(
                    p.sample_rates[self.subset],
                    p.noise_multiplier,
                    p.max_grad_norm,
                    p.clip_norms[self.subset],
                    rounding="exact",
                )
                if m
                else None
            )
            self.check = SensitivityCheck(float(p.clip_norms.max()))
        self.phase = phase
        self._dropouts = dropout_modules(raw_module(phase.module))
        phase.optimizer.add_post_step_hook(self._after_step)
        self._due = True
        self._prepare_step()

    def detach(self) -> None:
        """Unhook from the engine's optimizer (a tracker replaced by one with another seed)."""
        if self.phase is not None:
            self.phase.optimizer.remove_post_step_hook(self._after_step)

    def follow_seed(self, seed: int) -> None:
        """The engine's seed changed before the subset was drawn (rank 0's, shared by every rank)."""
        self.seed = int(seed)

    @property
    def enforces(self) -> bool:
        """Whether every example is clipped at its charged sensitivity at every step: individual
        clipping, or norms refreshed every step (K = 1) with ``exact`` or ``ceil`` rounding (options
        and the steps per epoch only)."""
        o = self.options
        return bool(o.individual_clipping) or (self.every == 1 and o.rounding in ("exact", "ceil"))

    @property
    def kind(self) -> str:
        """``guarantee`` or ``estimate`` (the rule: the module doc; why: :attr:`kind_reason`)."""
        return self.verdict()[0]

    @property
    def kind_reason(self) -> str:
        """Why the ε are a guarantee or an estimate (a function of the options, the steps per epoch
        and the checkpoint the run resumed from: no statistic of the data or the norms)."""
        return self.verdict()[1]

    def verdict(self) -> tuple[str, str]:
        """(kind, reason): a guarantee exactly when the charges are enforced (:attr:`enforces`) at
        every step taken; otherwise every reason for the estimate, joined."""
        o = self.options
        if self.enforces:
            if self.enforced_steps < self.accountant.steps:
                return "estimate", (
                    "steps taken before a checkpoint of a version that did not clip each example at its "
                    "charged sensitivity with norms of every step were not bounded by their charges"
                )
            if o.individual_clipping:
                return "guarantee", (
                    "individual clipping (Yu et al. Alg. 3): every example is clipped at the sensitivity "
                    "it is charged at"
                )
            return "guarantee", (
                f"norms refreshed every step ({self.accountant.rounding} rounding) and every example "
                "clipped at the sensitivity it is charged at, min(its clip norm, its norm-pass gradient "
                "norm) (Yu et al. Alg. 3 at every step): the charges bound what training adds"
            )
        broken = []
        if self.every > 1:
            broken.append(
                f"norms refreshed every {self.every} steps without individual clipping: between refreshes "
                "a sensitivity is taken from the last refresh (Yu et al. Alg. 2, K > 1)"
            )
        if self.accountant.rounding == "nearest":
            broken.append("nearest rounding without individual clipping can round a sensitivity below the norm")
        return "estimate", "; ".join(broken)

    def sensitivity_check(self) -> dict:
        """The check's record (private: statistics of the gradient norms): logical ``steps`` checked,
        sampled ``examples`` checked, how many ``exceeded`` their charged sensitivity when clipped at
        their own clip norm (with enforcement: how many it clipped further) and the largest
        ``max_ratio`` of the two, how many were ``compared`` with a norm pass at the same parameters
        and how many ``mismatched`` (``max_relative_mismatch``), active ``dropout`` modules, the
        tolerances, whether the charges were ``enforced`` and at how many steps."""
        return {**self.check.summary(), "enforced": self.enforces, "enforced_steps": self.enforced_steps}

    @property
    def steps(self) -> int:
        return self.accountant.steps

    # --- norms ---------------------------------------------------------------------------
    def grad_norms(self, indices=None):
        """(norms, losses) of the given examples (default: all) at the current parameters."""
        # sharded across ranks and all-gathered when distributed; each user's norm at user level
        return self.phase.grad_norms(self.per_sample_loss, indices, self.options.norm_batch_size)

    def _apply_clip_norms(self) -> None:
        """With enforcement, the coming steps clip every example at its charge (≤ its clip norm)."""
        if self.enforces and self.accountant.refreshes:
            self.phase.clipping.set_clip_norms(self.accountant.sensitivity)

    def _prepare_step(self) -> None:
        """Norms at the current θ for the coming step: a refresh when due, the exact subset always."""
        refreshed = None
        if self.accountant.steps % self.every == 0:
            refreshed, _ = self.grad_norms()
            self.accountant.update_norms(refreshed)
            self._pass_norms, self._pass_at = refreshed, self.accountant.steps
            if self.options.record_norms:
                self.recorded.append(refreshed.astype(np.float32))
                self.recorded_steps.append(0)
            self._apply_clip_norms()
        if self.exact is not None:
            norms = refreshed[self.subset] if refreshed is not None else self.grad_norms(self.subset)[0]
            if self.enforces:  # the clipped gradient's norm is at most Z_i
                norms = np.minimum(norms, self.accountant.sensitivity[self.subset])
            self.exact.update_norms(norms)
        self._due = False

    def _after_step(self, optimizer) -> None:
        if self._due:  # this step ran on norms that should have been refreshed
            self.stale_steps += 1
        self._check(optimizer)
        if self.enforces:
            self.enforced_steps += 1
        self.accountant.add_steps(1)
        if self.recorded_steps:
            self.recorded_steps[-1] += 1
        if self.exact is not None:
            self.exact.add_steps(1)
        self._due = True
        planned = self.phase.parameters.steps
        if (planned is not None and self.phase.steps >= planned) or not self.phase.can_step():
            return  # no further step is planned: no norm pass for it
        self._prepare_step()

    def _check(self, optimizer) -> None:
        """The step just taken: with enforcement, its clip norms must be its charges (else a
        :class:`RuntimeError`: they were replaced); its sampled examples' training norms clipped at
        their own clip norms against their charges and, when the norms were refreshed at this step's
        parameters, against the norm pass (private record)."""
        charged = self.accountant.sensitivity
        if self.enforces and self.accountant.refreshes:
            used = optimizer.clip_norms.detach().cpu().numpy()
            if used.shape != charged.shape or np.any(used > charged):
                raise RuntimeError(
                    "individual accounting clips every example at its charged sensitivity, but this step's "
                    "clip norms were not those charges (engine.clipping.set_clip_norms called during training?)"
                )
        fresh = self._pass_at == self.accountant.steps and not self._due
        self.check.note_dropout(active_dropout(self._dropouts))
        self.check.observe(
            optimizer.last_norms,
            optimizer.last_indices,
            self.accountant.clip_norms,
            charged,
            self._pass_norms if fresh else None,
        )

    # --- results -------------------------------------------------------------------------
    def epsilons(self, delta: float) -> np.ndarray:
        """Output-specific ε_i of every example: its RDP ε, and with ``accountant="pld"`` the
        smaller of that and its PLD ε — a guarantee or an estimate as :attr:`kind` says."""
        return self.report(delta, cap=None).epsilon

    def report(self, delta: float, cap="engine") -> IndividualEpsilons:
        """Each example's ε as the minimum of its own bounds (RDP; PLD with ``accountant="pld"``)
        and ``cap``, with the name of the bound that gave it (``rdp``, ``pld`` or ``cap``).

        ``cap="engine"`` (default) is each example's data-independent ε from the engine's group
        accountant — the run's accountant, ≤ its budget by calibration; ``None``: no cap.  A
        guarantee or an estimate as :attr:`kind` says (capped by a bound either way)."""
        if isinstance(cap, str) and cap == "engine":
            cap = self.phase.accountant.individual_epsilons(delta)
        return self.accountant.report(delta, self.options.accountant, cap=cap)

    def worst_case_epsilons(self, delta: float) -> np.ndarray:
        return self.accountant.worst_case_epsilon(delta)

    def validation(self, delta: float, estimates: np.ndarray) -> dict | None:
        """Estimates vs exact per-step tracking on the validation subset (private statistics)."""
        if self.exact is None:
            return None
        exact = self.exact.epsilon(delta)
        est = np.asarray(estimates)[self.subset]
        r = None
        if est.size > 1 and np.std(est) > 0 and np.std(exact) > 0:
            r = float(np.corrcoef(est, exact)[0, 1])
        return {
            "examples": int(self.subset.size),
            "pearson_r": r,
            "mean_abs_error": float(np.mean(np.abs(est - exact))),
            "max_abs_error": float(np.max(np.abs(est - exact))),
            "min_estimate_minus_exact": float(np.min(est - exact)),
        }

    def norms_record(self) -> dict:
        """What ``idpsgd account --norms`` reads: every refresh's norms and the steps it covered, with
        the run's per-example rates and clip norms, σ and the reference clip norm (private data)."""
        p = self.phase.parameters
        return {
            "norms": np.stack(self.recorded) if self.recorded else np.zeros((0, self.accountant.num_examples)),
            "steps": np.asarray(self.recorded_steps, dtype=np.int64),
            "sample_rates": p.sample_rates,
            "clip_norms": p.clip_norms,
            "noise_multiplier": np.float64(p.noise_multiplier),
            "clip_norm": np.float64(p.max_grad_norm),
            "rounding": np.str_(self.accountant.rounding),
            "rounding_step": np.float64(self.accountant.rounding_step),
            "accounting_kind": np.str_(self.kind),
            "individual_clipping": np.bool_(self.options.individual_clipping),
            "enforced": np.bool_(self.enforces),  # every example clipped at its charge
        }

    def state_dict(self) -> dict:
        return {
            "accountant": _tensors(self.accountant.state_dict()),
            "stale_steps": self.stale_steps,
            "enforced_steps": self.enforced_steps,
            "check": self.check.state_dict(),
            "pass_at": self._pass_at,
            "pass_norms": None if self._pass_norms is None else torch.from_numpy(np.asarray(self._pass_norms)),
            "exact": _tensors(self.exact.state_dict()) if self.exact is not None else None,
            "recorded": [torch.from_numpy(r) for r in self.recorded],
            "recorded_steps": list(self.recorded_steps),
        }

    def load_state_dict(self, state: dict) -> None:
        self.accountant.load_state_dict(_arrays(state["accountant"]))
        if self.exact is not None and state.get("exact") is not None:
            self.exact.load_state_dict(_arrays(state["exact"]))
        self.stale_steps = int(state.get("stale_steps", 0))
        # a checkpoint without the count: every version enforced individual clipping, none K = 1 alone
        default = self.accountant.steps if self.options.individual_clipping else 0
        self.enforced_steps = int(state.get("enforced_steps", default))
        self.check.load_state_dict(state.get("check"))
        saved = state.get("pass_norms")
        self._pass_norms = None if saved is None else np.asarray(saved, dtype=np.float64)
        self._pass_at = int(state.get("pass_at", -1)) if saved is not None else -1
        self.recorded = [np.asarray(r) for r in state.get("recorded", [])]
        self.recorded_steps = [int(k) for k in state.get("recorded_steps", [])]
        self._apply_clip_norms()


def _tensors(obj):
    """numpy arrays → tensors (checkpoints load with ``weights_only=True``)."""
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _arrays(obj):
    if isinstance(obj, dict):
        return {k: _arrays(v) for k, v in obj.items()}
    if torch.is_tensor(obj):
        return obj.numpy()
    return obj
