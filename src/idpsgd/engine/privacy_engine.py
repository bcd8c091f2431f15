"""``IndividualizedPrivacyEngine``: Opacus's ``PrivacyEngine`` with a privacy budget per example.

Boenisch et al. 2023 (IDP-SGD, Alg. 1–3): from per-example budgets, a method (``uniform``,
``sample``, ``scale``) and the planned steps, the engine calibrates per-example sampling rates
q_i, clip norms c_i and one noise multiplier σ, then runs DP-SGD with them and keeps every privacy
group within its budget.  This module is the orchestrator, one set-up read as **check → plan →
build → wire**: the inputs are checked (:mod:`.checks`, :class:`~.options.SetupOptions`), the phase
is planned (:mod:`idpsgd.assignment`, :class:`~.options.PhaseParameters`), the step is built in the
order it runs (Poisson sampler :mod:`.sampling.sampler` → per-example norms by the mode's wrapper
:mod:`.modes` → clipping :mod:`.clipping.examples` → noise :mod:`.noise.optimizer` → the ledger
:mod:`.budget.accountant` → the filter :mod:`.budget.group_filter` / :mod:`.budget.filter`), and its
guards are wired (:mod:`.guards.step_guard`).
Checkpoints: :mod:`.checkpoint`.  Opacus 1.6's API is kept (``make_private_with_epsilon``,
``get_epsilon``, checkpoints); what it cannot honour is refused (:data:`~.opacus_compat.REFUSALS`).
User guide: docs/guarantees.md, docs/opacus.md; a walk through the engine: docs/inside-the-engine.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..assignment import Budgets
from ..names import ACCOUNTANTS
from ..validation import InvalidParameterError
from . import checkpoint, distributed
from .budget.accountant import GroupAccountant, GroupEpsilons, PrivacyBudgetExceeded
from .budget.group_filter import GroupFilter
from .checks import Counted, check_phase, count_units, expected_batch_size_of, steps_per_epoch_for
from .clipping.examples import PerExampleClipping
from .distributed import fsdp
from .guards.step_guard import StepGuard
from .noise.randomness import SECURE_RNG_WARNING, RunSeeds
from .opacus_compat import refuse_opacus_options, validate_module
from .options import FILTER_ACTIONS, FILTERS, PhaseParameters, SetupOptions
from .per_example.wrap import layer_paths, release_hooks
from .phase import Phase
from .plan import epsilon_budgets, plan_phase
from .step import build_step

GUARANTEE = (
    "data-independent individual (epsilon_p, delta)-DP for every example of group p (Boenisch et al. 2023, eq. 3)"
)


@dataclass(frozen=True)
class Rollback:
    """What a set-up's build stage may change, kept to undo it if the build fails: the engine's ledger,
    seeds, sampler source, noise source and clipping, and the process's random state that the seeds
    shared by the ranks are drawn from (torch's global generator and the data loader's)."""

    budgets: object
    accountant: object
    seeds: RunSeeds
    sampler_rng: object
    noise: object
    clipping: object
    torch_rng: torch.Tensor
    loader_rng: torch.Tensor | None
    loader: object

    @classmethod
    def of(cls, engine: IndividualizedPrivacyEngine, data_loader) -> Rollback:
        gen = getattr(data_loader, "generator", None)
        return cls(
            engine.budgets, engine.accountant, engine.seeds, engine._sampler_rng, engine._noise, engine.clipping,
            torch.random.get_rng_state(), None if gen is None else gen.get_state(), data_loader,
        )  # fmt: skip

    def restore_generators(self) -> None:
        """Torch's global generator and the data loader's as they were (the engine's own state:
        :meth:`IndividualizedPrivacyEngine._roll_back`)."""
        torch.random.set_rng_state(self.torch_rng)
        if self.loader_rng is not None:
            self.loader.generator.set_state(self.loader_rng)


class IndividualizedPrivacyEngine:
    """Individualized DP-SGD for any model, data loader and device.

    Args:
        accountant: ``prv`` (privacy random variables, Gopi et al. 2021; its upper bound — the
            default, as Opacus's), ``rdp`` (Rényi DP, adaptive orders; much faster calibration) or
            ``pld`` (privacy loss distributions through dp_accounting); used for calibration, the
            filter and the reported ε.
        secure_mode: Opacus's secure mode: sampling and noise from OS entropy, secure noise
            sampling; a seed is refused.
        seed: seeds the Poisson sampler and the noise (a seed replays a run exactly).  ``None``
            follows torch's RNG as Opacus does (:mod:`.noise.randomness`): at the first draw the seed is
            drawn from torch's global generator — the sampler's from the data loader's
            ``generator`` when it has one — or from OS entropy if that generator was never seeded;
            it is recorded privately as :attr:`seed` / :attr:`sampler_seed`, and
            :meth:`load_checkpoint` continues with the checkpoint's.  The seed is secret: with it,
            anyone who knows every record but one can replay the run and compare with the
            released model.

    Before the first draw (a batch or the noise) :attr:`seed` is None; with individual
    accounting, the individual filter or several processes it is drawn at set-up.

    Without ``secure_mode`` the engine warns once (a ``UserWarning``, as Opacus's
    ``PrivacyEngine``): fine for experiments; a model meant for release must be trained with
    ``secure_mode=True``.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False, seed: int | None = None):
        if accountant not in ACCOUNTANTS:
            raise InvalidParameterError("accountant", accountant, f"must be one of {', '.join(ACCOUNTANTS)}")
        self.accountant_name = accountant
        self.secure_mode = bool(secure_mode)
        self.seeds = RunSeeds(seed, self.secure_mode)  # the run's seeds (engine/noise/randomness.py)
        if not self.secure_mode and distributed.is_main_process():
            warnings.warn(SECURE_RNG_WARNING, UserWarning, stacklevel=2)
        self.accountant: GroupAccountant | None = None
        self.budgets: Budgets | None = None
        self.module = self.optimizer = self.data_loader = self.criterion = None
        self.clipping: PerExampleClipping | None = None
        self.parameters: PhaseParameters | None = None  # the current phase's σ, c, q_i, c_i, planned steps
        self.individual = None  # IndividualTracker when individual accounting is on
        self.filter = None  # IndividualFilter with privacy_filter="individual"
        self.users = None  # Users at user level (engine/clipping/users.py)
        self.privacy_filter, self.filter_action = "group", "raise"
        self._step_filter = None  # the filter in use: GroupFilter, IndividualFilter or None (StepFilter)
        self._sampler_rng = None
        self._noise = None
        self._individual_seed_follows = False
        self._guard = None  # the phase's StepGuard (engine/guards/step_guard.py)
        self.phase: Phase | None = None  # the current phase's parts, handed to the filter and individual accounting
        self.journal = None  # the run folder's journal of drawn steps (engine/budget/journal.py), or None

    # --- the journal of drawn steps (engine/budget/journal.py) ---------------------------------------
    def attach_journal(self, path, *, writer: bool | None = None):
        """Record every noise draw in the append-only journal ``path`` (a run folder's
        ``private/drawn_steps.jsonl``, :mod:`.budget.journal`) before its noise is drawn, and charge on resume
        the draws the loaded state does not cover: an abandoned attempt's draws (secure mode; in
        reproducible mode those the resumed run does not replay) compose with the kept steps, so ε
        covers every draw made under the run folder.  Call before ``make_private``; ``writer``: this
        process appends (default: the main process; the others only charge).  Returns the journal."""
        from .budget.journal import DrawJournal

        if self.accountant is not None:
            raise RuntimeError("attach the journal of drawn steps before make_private")
        self.journal = DrawJournal(path, writer)
        return self.journal

    def _settle_journal(self) -> None:
        """A run folder's earlier draws are charged before this engine's first step or ε (a run that
        starts without a checkpoint: every recorded draw; a loaded checkpoint reconciles at load)."""
        if self.journal is not None and not self.journal.reconciled and self.accountant is not None:
            self.journal.reconcile(self, None, checkpoint=False)

    def finish_journal(self) -> int:
        """The run ends: an earlier attempt's draws it was to replay (reproducible mode) and did not reach
        are charged (:meth:`~.budget.accountant.GroupAccountant.settle`); call before reporting ε.  Returns how many."""
        if self.accountant is None:
            return 0
        self._settle_journal()
        return self.accountant.settle()

    def _before_noise(self, phase: str) -> None:
        """The step guard's journal hooks: ``"settle"`` before the filter, ``"record"`` after it."""
        if self.journal is None:
            return
        if phase == "settle":
            self._settle_journal()
        else:
            self.journal.record(self)

    # --- the run's seeds (private: a seed replays the run) ------------------------------------
    @property
    def seed(self) -> int | None:
        """The noise's seed (:class:`~.noise.randomness.RunSeeds`); None before the first draw when it
        follows torch, and in secure mode."""
        return self.seeds.seed

    @property
    def sampler_seed(self) -> int | None:
        """The Poisson sampler's seed (the engine's, or drawn from the data loader's generator)."""
        return self.seeds.sampler_seed

    @property
    def noise_source(self):
        """The noise's generator (private state: with it the noise can be replayed)."""
        return self._noise

    # --- public state ---------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Logical DP-SGD steps taken so far (all phases)."""
        return self.accountant.steps if self.accountant is not None else 0

    @property
    def group_budgets(self) -> np.ndarray:
        """The privacy groups' budgets, ascending (the order of :meth:`get_epsilon`)."""
        return self.accountant.values if self.accountant is not None else np.zeros(0)

    def get_epsilon(self, delta: float | None = None, *, steps: int | None = None) -> GroupEpsilons:
        """ε spent so far, by the run's accountant: **a float** (Opacus's ``get_epsilon(delta)``), the
        loosest privacy group's — the one ε that bounds every example; with one budget simply the
        ε — carrying every group's ε as ``.per_group`` (ascending budgets; a
        :class:`~.budget.accountant.GroupEpsilons`).  ``delta`` defaults to the budgets'.

        ``steps``: the ε each group *would* have after ``steps`` logical steps in all (the current
        phase continued to that count; no training, nothing charged) — Opacus users' "accountant
        copy stepped ahead".  With the individual filter it is the data-independent ε (an upper
        bound of the filter's).
        """
        self._require()
        self._settle_journal()
        delta = self.accountant.resolve_delta(delta)
        if steps is not None:
            if int(steps) != steps or int(steps) < self.steps:
                raise InvalidParameterError("steps", steps, f"must be an integer >= the {self.steps} steps taken")
            return self.accountant.get_epsilon(delta, extra_steps=int(steps) - self.steps)
        if self.filter is None:
            return self.accountant.get_epsilon(delta)
        # individual filter: min(data-independent ε, the filter's guarantee), per group
        per_example = np.minimum(self.accountant.individual_epsilons(delta), self.filter.guarantee_epsilons(delta))
        eps = np.zeros(self.accountant.values.size)
        np.maximum.at(eps, self.accountant.group_of, per_example)  # the group's largest
        return GroupEpsilons(
            eps,
            self.accountant.values,
            self.accountant.counts,
            delta,
            self.accountant_name,
            self.steps,
            unit=self.accountant.unit,
        )

    @property
    def history(self) -> list[list[tuple[float, float, int]]]:
        """Per privacy group (ascending budgets), the composition behind its ε in Opacus's history
        form: a list of ``(noise_multiplier, sample_rate, steps)``, one per phase (σ the group's
        effective noise multiplier σ·c/c_p).  ``opacus.accountants.PRVAccountant().history =
        engine.history[g]`` reproduces group g's ε by Opacus (see
        :meth:`~.budget.accountant.GroupAccountant.group_history`)."""
        self._require()
        return self.accountant.group_history()

    def get_individual_epsilons(self, delta: float | None = None) -> np.ndarray:
        """ε of every example, each a valid (ε, δ) bound: its data-independent ε (its group's path);
        with the individual filter, the smaller of that and the filter's realized ε; with individual
        accounting (Yu et al. 2023) whose ``engine.individual.kind`` is ``"guarantee"`` (every example
        clipped at its charged sensitivity: individual clipping, or norms of every step with exact/ceil
        rounding, :mod:`.budget.individual`), the smaller of that and the output-specific ε.

        When individual accounting's ``kind`` is ``"estimate"`` the output-specific ε bounds nothing,
        so it is not mixed in: this returns the data-independent ε, and the estimates are
        ``engine.individual.epsilons(delta)`` (or ``engine.individual.report(delta)``), labelled by
        ``engine.individual.kind`` and ``engine.individual.kind_reason``."""
        self._require()
        eps = self.accountant.individual_epsilons(delta)
        if self.filter is not None:  # individual filter: its realized ε at each example's order (≤ budget)
            return np.minimum(eps, self.filter.realized_epsilons(delta))
        if self.individual is not None and self.individual.kind == "guarantee" and not self.accountant.extra:
            # (output-specific ε covers the kept steps only: with charged draws of abandoned attempts, not mixed in)
            eps = np.minimum(eps, self.individual.epsilons(self.accountant.resolve_delta(delta)))
        return eps

    @property
    def layer_paths(self) -> dict[str, str]:
        """Layer name → how its per-example gradient norms are computed in this phase, as a function of
        the model and ``grad_sample_mode`` only (public, safe to publish): with ``"bk"`` a ghost norm,
        a per-sample gradient, either by the layer's input shapes in each step (Linear, convolutions;
        :data:`~.per_example.bk.keeper.BY_SHAPES`), or Opacus's per-sample gradient for a layer no book-keeping
        rule covers (:mod:`.per_example.bk.units`); in the other modes Opacus's.  The paths actually taken:
        :attr:`layer_paths_taken`."""
        self._require()
        return layer_paths(self.module, self.parameters.grad_sample_mode)

    @property
    def layer_paths_taken(self) -> dict[str, str]:
        """Layer name → the paths its per-example norms took so far (with ``"bk"``; the other modes:
        :attr:`layer_paths`).  Private: with inputs padded per batch, a Linear layer's ghost/per-sample
        choice depends on the batch's longest sequence — keep it out of public outputs."""
        self._require()
        return layer_paths(self.module, self.parameters.grad_sample_mode, taken=True)

    def privacy_groups(self, delta: float | None = None) -> list[dict]:
        """Per group: budget, examples, and the current phase's rate, clip norm and effective σ."""
        self._require()
        eps = self.get_epsilon(delta).per_group
        p = self.parameters
        out = []
        for g, (value, count) in enumerate(zip(self.accountant.values, self.accountant.counts, strict=True)):
            members = self.accountant.group_of == g
            q, c = p.sample_rates[members], p.clip_norms[members]
            out.append(
                {
                    "budget": float(value),
                    "count": int(count),
                    "sample_rate": float(q.max()),
                    "clip_norm": float(c.max()),
                    "noise_multiplier": float(p.noise_multiplier * p.max_grad_norm / c.max()),
                    "epsilon": float(eps[g]),
                }
            )
        return out

    def enable_individual_accounting(self, options=None, per_sample_loss=None, seed: int | None = None):
        """Turn on individual accounting (Yu et al. 2023; :mod:`.budget.individual`): call before or after
        ``make_private`` (one-phase runs).  ``per_sample_loss(module, batch)`` gives one loss per
        example (default: cross-entropy of ``(inputs, targets)`` batches).  Returns the tracker."""
        from .budget.individual import IndividualTracker

        if self.filter is not None:
            raise InvalidParameterError(
                "individual_accounting",
                True,
                "cannot be combined with the individual "
                "filter (the filter already accounts every example individually)",
            )
        self.individual = IndividualTracker(options, per_sample_loss, self.seeds.draw() if seed is None else seed)
        self._individual_seed_follows = seed is None and not self.seeds.given  # re-drawn from a loaded seed
        if self.accountant is not None:
            if self.steps:
                raise RuntimeError("enable individual accounting before the first step")
            self.individual.attach(self.phase)
        return self.individual

    def per_example_grad_norms(self, per_sample_loss=None, indices=None, batch_size: int = 256):
        """(norms, losses) of each example's loss gradient at the current parameters (private values).

        Works with any loss: ``per_sample_loss(module, batch)`` returns one loss per example of a
        batch collated from the loader's dataset (default: cross-entropy of ``(inputs, targets)``)."""
        self._require()
        return self.phase.grad_norms(per_sample_loss, indices, batch_size)  # users at user level (engine/phase.py)

    def per_user_grad_norms(self, units, collate, batch_size: int, per_sample_loss=None):
        """User level: (norms, losses) of ``units`` (user indices), each over a random choice of up to k
        of the user's rows drawn from the sampler's source (:func:`~.per_example.user_norms.per_user_grad_norms`)."""
        self._require()
        return self.phase.user_grad_norms(units, collate, batch_size, per_sample_loss)

    def can_step(self) -> bool:
        """Whether the filter admits one more step (always True without a filter)."""
        self._require()
        self._settle_journal()
        return self._step_filter is None or self._step_filter.can_step()

    def _require(self):
        if self.accountant is None:
            raise RuntimeError("call make_private first")

    def _roll_back(self, before: Rollback) -> None:
        """The engine as it was before a set-up whose build failed (:class:`Rollback`), the generators too."""
        self.budgets, self.accountant, self.seeds = before.budgets, before.accountant, before.seeds
        self._sampler_rng, self._noise, self.clipping = before.sampler_rng, before.noise, before.clipping
        before.restore_generators()

    # --- make_private ---------------------------------------------------------------------
    def make_private(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        budgets=None,
        method: str | None = None,
        target_delta: float | None = None,
        epochs: int | None = None,
        steps: int | None = None,
        max_grad_norm: float = 1.0,
        sample_rate: float | None = None,
        noise_multiplier: float | None = None,
        criterion=None,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator=None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        rand_on_empty: bool = False,
        users=None,
        **kwargs,
    ):
        """Wrap for training: calibrated to per-example ``budgets``, or with one ``noise_multiplier``.

        **With budgets** (idpsgd): per-example rates / clip norms and σ are calibrated so that each
        group spends its budget exactly at the planned length.  **With ``noise_multiplier``**
        (Opacus's ``make_private``), without budgets: every example has that σ, the rate
        ``sample_rate`` and the clip norm ``max_grad_norm``; nothing is filtered (ε is accounted and
        reported, ``get_epsilon(delta)`` needs δ unless ``target_delta`` is given).  **With
        ``noise_multiplier`` and budgets** (and ``epochs`` or ``steps``, required): σ is kept and each
        group's sampling rate (``method="sample"``, the default) or clip norm (``"scale"``) is solved so
        that the plan spends its budget (:func:`~idpsgd.assignment.methods.assign_for_noise_multiplier`);
        the filter keeps every group within its budget.

        Args:
            module, optimizer, data_loader: as for Opacus's ``make_private``; the loader may be over
                any map-style dataset (tuples, dicts, extra tensors, custom ``collate_fn``).
            budgets: a :class:`~idpsgd.assignment.Budgets`, or an array of per-example ε with
                ``target_delta``; one per example of ``data_loader.dataset``.
            method: ``uniform`` (every example at the smallest budget), ``sample`` (per-group
                rates, one σ; the default) or ``scale`` (per-group clip norms) (Boenisch et al. §3);
                only with budgets and without ``noise_multiplier``.
            epochs / steps: the planned length (one of them); the calibration spends each group's
                budget exactly at that many steps (optional with ``noise_multiplier``: a plan the
                filter checks at set-up).
            max_grad_norm: the (mean) clip norm c.
            sample_rate: the mean sampling rate; default ``1 / len(data_loader)`` (Opacus's: an epoch is
                ``len(data_loader)`` steps).
            noise_multiplier: σ for every example (Opacus's ``make_private``); with ``budgets`` and
                ``epochs``/``steps`` each group's rate (``sample``) or clip norm (``scale``) is
                solved for its budget at that σ.
            criterion, batch_first, loss_reduction, noise_generator, grad_sample_mode: as Opacus.
            poisson_sampling, clipping, rand_on_empty: Opacus's keywords; only their defaults (True,
                "flat", False) can be honoured, the others are refused.
            wrap_model: ``False`` attaches Opacus's hooks to ``module`` itself (modes ``hooks``,
                ``functorch``, ``no_op``; returned: Opacus's hooks object, keep training ``module``).
            users: a :class:`~idpsgd.users.Users` (the user of every row of the dataset, and k) for
                **user-level** individualized DP (:mod:`.clipping.users`): ``budgets``, rates and clip norms are
                then one per user, users are Poisson-sampled and each sampled user's summed gradient
                over up to k of its rows is clipped as one unit; ε is per user.
            **kwargs: see :meth:`make_private_with_parameters` (``privacy_filter``,
                ``filter_action``, ``filter_options``, ``per_sample_loss``, ...).

        Returns:
            ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion, data_loader)``
            with ``grad_sample_mode="ghost"`` (as Opacus).
        """
        return self._make_private(
            None, module=module, optimizer=optimizer, data_loader=data_loader, budgets=budgets, method=method,
            target_delta=target_delta, epochs=epochs, steps=steps, max_grad_norm=max_grad_norm, sample_rate=sample_rate,
            noise_multiplier=noise_multiplier, criterion=criterion, batch_first=batch_first,
            loss_reduction=loss_reduction, poisson_sampling=poisson_sampling, clipping=clipping,
            noise_generator=noise_generator, grad_sample_mode=grad_sample_mode, wrap_model=wrap_model,
            rand_on_empty=rand_on_empty, users=users, **kwargs,
        )  # fmt: skip

    def _make_private(
        self, counted: Counted | None, *, module, optimizer, data_loader, budgets, method, target_delta, epochs, steps,
        max_grad_norm, sample_rate, noise_multiplier, criterion, batch_first, loss_reduction, poisson_sampling,
        clipping, noise_generator, grad_sample_mode, wrap_model, rand_on_empty, users, **kwargs,
    ):  # fmt: skip
        """:meth:`make_private`; ``counted``: the units and budgets already checked (each check runs once)."""
        refuse_opacus_options(
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            rand_on_empty=rand_on_empty,
            **kwargs,
        )
        phase = plan_phase(
            self.accountant_name,
            data_loader=data_loader,
            users=users,
            budgets=budgets,
            method=method,
            target_delta=target_delta,
            epochs=epochs,
            steps=steps,
            max_grad_norm=max_grad_norm,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
            privacy_filter=kwargs.get("privacy_filter"),
            counted=counted,
        )
        if not phase.filtered:
            kwargs["privacy_filter"] = None
        out = self._set_up(
            phase.counted,
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            **phase.arguments,
            criterion=criterion,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            users=users,
            **kwargs,
        )
        if phase.assignment is not None:
            self.assignment = phase.assignment  # the calibration behind the phase (idpsgd.assignment)
        return out

    def make_private_with_epsilon(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: int | None = None,
        max_grad_norm: float,
        budgets=None,
        method: str | None = None,
        steps: int | None = None,
        sample_rate: float | None = None,
        epsilon_tolerance: float | None = None,
        criterion=None,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator=None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        **kwargs,
    ):
        """Opacus's ``make_private_with_epsilon``: calibrate σ so that training for ``epochs`` spends
        ``(target_epsilon, target_delta)`` — and, with ``budgets=``, per-example budgets instead.

        Without ``budgets`` every example has the budget ``target_epsilon`` (one group, standard
        DP-SGD; σ calibrated by the engine's accountant to ε in [(1 − 1e-4)·target, target], never
        above it).  With ``budgets`` (a :class:`~idpsgd.assignment.Budgets` or per-example array)
        the run is individualized (``method``, default ``sample``) and ``target_epsilon`` may be
        left out; if given it must be at least the largest budget (no example may get more than it).

        Differences from Opacus, by design: the calibration lands within 1e-4·target below the
        target (Opacus's search: within ``epsilon_tolerance`` = 0.01), ``steps=`` may replace
        ``epochs``, and the privacy filter refuses any step beyond the budgets.  ``epsilon_tolerance``
        (Opacus's search tolerance) is honoured when it is at least the calibration's 1e-4·target
        (always met), refused below.
        Everything else as :meth:`make_private`.
        """
        n = count_units(data_loader, kwargs.get("users"))  # users at user level
        budgets, method = epsilon_budgets(n, budgets, target_epsilon, target_delta, method, epsilon_tolerance)
        kwargs.setdefault("rand_on_empty", False)
        kwargs.setdefault("users", None)
        sigma = kwargs.pop("noise_multiplier", None)
        return self._make_private(
            Counted(n, budgets), module=module, optimizer=optimizer, data_loader=data_loader, budgets=budgets,
            method=method, target_delta=None, epochs=epochs, steps=steps, max_grad_norm=max_grad_norm,
            sample_rate=sample_rate, noise_multiplier=sigma, criterion=criterion, batch_first=batch_first,
            loss_reduction=loss_reduction, poisson_sampling=poisson_sampling, clipping=clipping,
            noise_generator=noise_generator, grad_sample_mode=grad_sample_mode, wrap_model=wrap_model, **kwargs,
        )  # fmt: skip

    def make_private_with_parameters(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        budgets,
        sample_rates,
        clip_norms,
        noise_multiplier: float,
        max_grad_norm: float,
        steps: int | None = None,
        steps_per_epoch: int | None = None,
        target_delta: float | None = None,
        expected_batch_size: float | None = None,
        grad_sample_mode: str = "hooks",
        criterion=None,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        privacy_filter: str | None = "group",
        filter_action: str = "raise",
        noise_generator=None,
        filter_options=None,
        per_sample_loss=None,
        wrap_model: bool = True,
        users=None,
    ):
        """Wrap for training with explicit per-example parameters (a phase of a recipe).

        Example i is sampled with ``sample_rates[i]`` (0: not in this phase, not charged) and
        clipped at ``clip_norms[i]``; the noise std is ``noise_multiplier · max_grad_norm``; the
        noisy sum is divided by ``expected_batch_size`` (default Σ q_i — a recipe may pass another
        *public* normaliser).  Calling it again on the same engine starts a new phase whose steps
        compose with the earlier ones.  ``steps`` is the plan: it is checked against the budgets
        once, so the filter admits those steps cheaply.

        ``privacy_filter="individual"`` attaches the individual Rényi filter (:mod:`.budget.filter`; options
        ``filter_options``, a :class:`~idpsgd.engine.budget.filter.FilterOptions`; ``per_sample_loss(module,
        batch)`` for its norm passes): ``steps`` is then the run's fixed length, and each example
        leaves training when its own budget is spent.

        ``budgets=None`` (with ``privacy_filter=None``): one σ without budgets, as Opacus — ε is
        accounted (``target_delta`` the default δ of :meth:`get_epsilon`), nothing is filtered.
        The plan (``steps``, or one step without it) is checked against the budgets, including what
        earlier phases spent: a plan that would take a group over its budget is refused here
        (:class:`PrivacyBudgetExceeded`, or a warning with ``filter_action="warn"``).
        ``noise_multiplier`` must be > 0 (σ = 0 is no privacy; it is refused).
        """
        return self._set_up(
            None, module=module, optimizer=optimizer, data_loader=data_loader, budgets=budgets,
            sample_rates=sample_rates, clip_norms=clip_norms, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, steps=steps, steps_per_epoch=steps_per_epoch, target_delta=target_delta,
            expected_batch_size=expected_batch_size, grad_sample_mode=grad_sample_mode, criterion=criterion,
            batch_first=batch_first, loss_reduction=loss_reduction, privacy_filter=privacy_filter,
            filter_action=filter_action, noise_generator=noise_generator, filter_options=filter_options,
            per_sample_loss=per_sample_loss, wrap_model=wrap_model, users=users,
        )  # fmt: skip

    def _set_up(
        self, counted: Counted | None, *, module, optimizer, data_loader, budgets, sample_rates, clip_norms,
        noise_multiplier, max_grad_norm, steps=None, steps_per_epoch=None, target_delta=None, expected_batch_size=None,
        grad_sample_mode="hooks", criterion=None, batch_first=True, loss_reduction="mean", privacy_filter="group",
        filter_action="raise", noise_generator=None, filter_options=None, per_sample_loss=None, wrap_model=True,
        users=None,
    ):  # fmt: skip
        """:meth:`make_private_with_parameters`: check → plan → build → wire (``counted``: what the entry
        point checked already, :class:`~.checks.Counted`)."""
        # --- check: pure, each check once; nothing changes until every input is known to be usable ----
        options = SetupOptions(
            grad_sample_mode=grad_sample_mode,
            criterion=criterion,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            privacy_filter=privacy_filter,
            filter_action=filter_action,
            noise_generator=noise_generator,
            filter_options=filter_options,
            per_sample_loss=per_sample_loss,
            wrap_model=wrap_model,
            users=users,
            expected_batch_size=expected_batch_size,
        )
        checked = check_phase(
            self, module=module, optimizer=optimizer, data_loader=data_loader, budgets=budgets,
            target_delta=target_delta, sample_rates=sample_rates, clip_norms=clip_norms,
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, options=options, counted=counted,
        )  # fmt: skip
        n, budgets, opts = checked.units, checked.budgets, checked.options
        q, c = checked.sample_rates, checked.clip_norms

        # --- plan: the phase's public parameters -----------------------------------------------------
        spe = int(steps_per_epoch) if steps_per_epoch is not None else steps_per_epoch_for(q)
        ebs = expected_batch_size_of(q) if opts.expected_batch_size is None else float(opts.expected_batch_size)
        plan = PhaseParameters.of(q, c, noise_multiplier, max_grad_norm, steps, spe, ebs, grad_sample_mode, users)

        # --- build: the ledger's phase, then sampler -> per-example norms -> clipping -> noise; every
        # change to the engine, the module, the seeds and the process is here, undone if it fails --------
        first = self.accountant is None
        accountant = (
            self.accountant
            if not first
            else GroupAccountant(
                budgets, self.accountant_name, num_examples=n, delta=target_delta if budgets is None else None
            )
        )
        engine_before = Rollback.of(self, data_loader)
        began = False
        try:
            accountant.begin_phase(q, c, noise_multiplier, max_grad_norm)
            began = True
            step_filter = GroupFilter(accountant, filter_action) if privacy_filter == "group" else None
            if step_filter is not None:  # the plan against the budgets, earlier phases included: here, not at step 1
                step_filter.check_plan(steps)
            release_hooks(self.module, module)  # an earlier wrap_model=False phase's hooks on this module
            seeds = checked.seeds
            if checked.ranks is not None and first and not self.secure_mode:  # one seed for the run: rank 0's
                seeds = distributed.shared_seeds(seeds)
            if checked.sharded:  # FSDP2's reduction settings and shards (engine/distributed/fsdp.py)
                fsdp.prepare(module, opts.mode)
            self.seeds = seeds
            if first:
                self.budgets, self.accountant, self._sampler_rng = budgets, accountant, seeds.sampler_rng()
            accountant.count_units("example" if users is None else "user")  # what GroupEpsilons' counts count
            if noise_generator is not None:
                self._noise = noise_generator
            elif self._noise is None or (hasattr(self._noise, "device") and self._noise.device != checked.device):
                self._noise = seeds.noise_generator(checked.device)
            built = build_step(
                module, optimizer, data_loader, plan, opts, checked.ranks, self._sampler_rng, self._noise,
                self.secure_mode, sharded=checked.sharded,
            )  # fmt: skip
            self.clipping, wrapped, dp_opt, loader = built.clipping, built.module, built.optimizer, built.data_loader
        except BaseException:  # a refused or failed set-up leaves no phase and the engine as it was
            if began:
                accountant.discard_phase()
            self._roll_back(engine_before)
            raise

        # --- wire: the guards around the step, then the engine's state ------------------------------
        if self.individual is not None and self.individual.seed == engine_before.seeds.seed != seeds.seed:
            self.individual.follow_seed(seeds.seed)  # rank 0's seed (data parallelism), as the engine's
        self._guard = StepGuard(wrapped, dp_opt, grad_sample_mode, self.accountant.step, self._before_noise)
        self.privacy_filter, self.filter_action = privacy_filter, filter_action
        self._step_filter = step_filter
        self._guard.use_filter(step_filter)
        self.parameters, self.users = plan, users
        self.module, self.optimizer, self.data_loader = wrapped, dp_opt, loader
        self.phase = Phase(
            plan, self.clipping, accountant, wrapped, dp_opt, loader, users, self._sampler_rng, self.can_step
        )
        if self.individual is not None:
            self.individual.attach(self.phase)
        if privacy_filter == "individual":
            self.filter = self._step_filter = checked.individual_filter.attach(self.phase)
            self._guard.use_filter(self.filter)
        if self.journal is not None:  # the run folder's earlier draws, read once (every rank: a collective)
            self.journal.load_records()
        if opts.mode.returns_criterion:
            from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

            crit = criterion if criterion is not None else torch.nn.CrossEntropyLoss(reduction=loss_reduction)
            self.criterion = DPLossFastGradientClipping(wrapped, dp_opt, crit, loss_reduction)
            return wrapped, dp_opt, self.criterion, loader
        return wrapped, dp_opt, loader

    # --- Opacus's module checks -------------------------------------------------------------
    @classmethod
    def get_compatible_module(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Opacus's ``PrivacyEngine.get_compatible_module``: a copy of ``module`` with the layers
        Opacus cannot train privately replaced (``opacus.validators.ModuleValidator.fix``, e.g.
        BatchNorm by GroupNorm), validated; raises :class:`~.opacus_compat.UnsupportedModuleError`
        (Opacus's error type too) if it still cannot be trained.  Build the optimizer over the
        returned module's parameters."""
        from opacus.validators import ModuleValidator

        if not isinstance(module, torch.nn.Module):
            raise InvalidParameterError("module", type(module).__name__, "must be a torch.nn.Module")
        fixed = ModuleValidator.fix(module)
        validate_module(fixed)
        return fixed

    def is_compatible(self, *, module: torch.nn.Module, optimizer=None, data_loader=None) -> bool:
        """Opacus's ``is_compatible``: whether ``module`` can be trained privately (the optimizer and
        data loader are checked by ``make_private``)."""
        from opacus.validators import ModuleValidator

        return ModuleValidator.is_valid(module)

    def validate(self, *, module: torch.nn.Module, optimizer=None, data_loader=None) -> None:
        """Opacus's ``validate``: raise :class:`~.opacus_compat.UnsupportedModuleError` (a subclass
        of Opacus's and of :class:`~idpsgd.validation.InvalidParameterError`) listing every reason
        ``module`` cannot be trained privately."""
        validate_module(module)

    # --- checkpoints (engine/checkpoint.py) ---------------------------------------------------
    def state_dict(self) -> dict:
        """Seed, accountant, sampler and noise-generator states and the phase's plan
        (:func:`~idpsgd.engine.checkpoint.state_dict`)."""
        self._require()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore after :meth:`make_private` set up the same phase as at saving time; refused,
        changing nothing, for another plan, seed or accountant (:func:`~idpsgd.engine.checkpoint.load_state_dict`)."""
        self._require()
        checkpoint.load_state_dict(self, state, self._resume_seeds)

    def _resume_seeds(self, state: dict) -> None:
        """Continue with a checkpoint's seeds (this engine's own were drawn, not given); individual
        accounting whose seed followed the engine's is set up anew with it (its subset is drawn from it)."""
        saved = state.get("seed")
        if saved != self.seed:
            self.seeds.resume(saved)
            t = self.individual
            if t is not None and self._individual_seed_follows and t.seed != self.seed:
                from .budget.individual import IndividualTracker

                t.detach()
                self.individual = IndividualTracker(t.options, t.per_sample_loss, self.seed)
                self.individual.attach(self.phase)
        if not self.seeds.given:
            self.seeds.resume_sampler(state.get("sampler_seed", self.seed))

    def save_checkpoint(
        self,
        *,
        path,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        noise_scheduler=None,
        grad_clip_scheduler=None,
        checkpoint_dict: dict | None = None,
        module_state_dict_kwargs: dict | None = None,
        torch_save_kwargs: dict | None = None,
    ) -> None:
        """Opacus's ``save_checkpoint`` with Opacus's keys; a path is written atomically with mode 0600
        (:func:`~idpsgd.engine.checkpoint.save_checkpoint`)."""
        self._require()
        checkpoint.save_checkpoint(
            self,
            path=path,
            module=module,
            optimizer=optimizer,
            noise_scheduler=noise_scheduler,
            grad_clip_scheduler=grad_clip_scheduler,
            checkpoint_dict=checkpoint_dict,
            module_state_dict_kwargs=module_state_dict_kwargs,
            torch_save_kwargs=torch_save_kwargs,
        )

    def load_checkpoint(
        self,
        *,
        path,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        noise_scheduler=None,
        grad_clip_scheduler=None,
        module_load_dict_kwargs: dict | None = None,
        torch_load_kwargs: dict | None = None,
    ) -> dict:
        """Opacus's ``load_checkpoint`` (this engine's checkpoints or Opacus's), after :meth:`make_private`
        set up the run as when it was saved (:func:`~idpsgd.engine.checkpoint.load_checkpoint`)."""
        self._require()
        return checkpoint.load_checkpoint(
            self,
            path=path,
            module=module,
            optimizer=optimizer,
            noise_scheduler=noise_scheduler,
            grad_clip_scheduler=grad_clip_scheduler,
            module_load_dict_kwargs=module_load_dict_kwargs,
            torch_load_kwargs=torch_load_kwargs,
        )


#: the IDP-SGD methods and filters, kept here for one release (defined in idpsgd.names / .options)
__all__ = [
    "FILTERS",
    "FILTER_ACTIONS",
    "GUARANTEE",
    "GroupEpsilons",
    "IndividualizedPrivacyEngine",
    "PrivacyBudgetExceeded",
    "steps_per_epoch_for",
]
