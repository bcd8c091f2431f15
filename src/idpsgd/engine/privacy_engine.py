"""``IndividualizedPrivacyEngine``: Opacus's ``PrivacyEngine`` with a privacy budget per example.

One object owns the module, the optimizer, the data loader and the accountant, as in Opacus::

    engine = IndividualizedPrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,     # any map-style Dataset / collate_fn
        budgets=Budgets.from_groups([1, 2, 3], [.34, .43, .23], n, delta=1e-5),
        method="sample", epochs=30, max_grad_norm=1.0)
    for batch in loader:                 # the user's batches, unchanged
        optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()
    engine.get_epsilon().per_group       # ε per privacy group; engine.get_individual_epsilons() per example

What it does (Boenisch et al. 2023, IDP-SGD, Alg. 1–3; the product guide's model of a step):

* **calibration** — from the budgets, the method (``uniform``, ``sample``, ``scale``; Boenisch et
  al. §3, :func:`idpsgd.assignment.assign`) and the planned steps, the per-example sampling rates
  q_i, clip norms c_i and the noise multiplier σ, as Opacus's ``make_private_with_epsilon`` does
  for one budget; or explicit per-example parameters (:meth:`make_private_with_parameters`);
* **sampling** — the loader's batch sampler becomes a Poisson sampler with per-example rates
  (:mod:`.sampler`); empty batches keep the structure of the user's batches;
* **clipping and noise** — example i is clipped at c_i (Opacus's per-sample gradients with
  ``grad_sample_mode="hooks"``/``"functorch"``; Opacus's two-pass ghost clipping with ``"ghost"``;
  book-keeping with ghost norms in one backward pass with ``"bk"``, :mod:`.bookkeeping`, the
  cheapest), the noise has std σ·c and the sum is divided by Σ q_i (:mod:`.optimizer`);
* **accounting and filter** — every step is charged to every example with q_i > 0; before the
  noise of each step the filter refuses (``PrivacyBudgetExceeded``) a step that would take any
  privacy group over its budget, or warns (``filter_action="warn"``) (:mod:`.accountant`); or,
  with ``privacy_filter="individual"``, each example leaves training when its own budget is spent
  (individual Rényi filter, Feldman & Zrnic 2021; :mod:`.filter`).

Privacy definition: data-independent individual (ε_p, δ)-DP for every example of privacy group p
(Boenisch et al. eq. 3), with ε from the accountant the run was calibrated with.

**Opacus 1.6's API** on the same engine, so that an Opacus script runs unchanged (its own test
suite is the acceptance test: ``make test-opacus``): ``make_private_with_epsilon(module=,
optimizer=, data_loader=, target_epsilon=, target_delta=, epochs=, max_grad_norm=)`` (one budget;
add ``budgets=`` for per-example budgets), ``make_private(noise_multiplier=, max_grad_norm=)`` (one
σ, no budget: accounted, not filtered), ``get_epsilon(delta)`` (a float — the loosest group's —
carrying every group's, :class:`~.accountant.GroupEpsilons`), ``engine.accountant`` with Opacus's
accountant interface, ``get_compatible_module`` / ``is_compatible`` / ``validate``,
``grad_sample_mode="ew"``, ``save_checkpoint`` / ``load_checkpoint`` (file paths or file objects,
Opacus's checkpoints too), Opacus's defaults (PRV accountant, sampling rate ``1/len(data_loader)``)
and its randomness (without a seed the engine follows torch's RNG).  Opacus options the engine
cannot honour are refused with an error that says why: the one table of them is
:data:`~.opacus_compat.REFUSALS`.
"""

from __future__ import annotations

import itertools
import os
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..assignment import Budgets, assign
from ..validation import InvalidParameterError, check_epsilon, check_positive, check_positive_array, check_sample_rate
from . import distributed, fsdp
from .accountant import ACCOUNTANTS, GroupAccountant, GroupEpsilons, PrivacyBudgetExceeded
from .clipping import PerExampleClipping
from .integrity import WriteGuard, check_no_new_trainable, trainable_names
from .opacus_compat import OPACUS_PARAMETER_MISMATCH, refuse_opacus_options
from .optimizer import OPTIMIZERS, _check_noise
from .randomness import (
    SECURE_RNG_WARNING,
    DeferredGenerator,
    DeferredUniform,
    resolve_seed,
    sampler_rng,
    seed_from_torch,
)
from .randomness import noise_generator as make_noise_generator
from .sampler import BatchIndexQueue, PoissonBatchSampler, PrivateDataLoader
from .units import (
    BookKeepingUsers,
    DistributedUserPoissonBatchSampler,
    UnitClipping,
    UserPoissonBatchSampler,
    check_user_level,
)
from .wrap import ENGINE_MODES, check_wrappable, layer_paths, raw_module, release_hooks, wrap_module

FILTERS = ("group", "individual", None)  # individual: engine/filter.py (Feldman & Zrnic 2021)
FILTER_ACTIONS = ("raise", "warn")
METHODS = ("uniform", "sample", "scale")

GUARANTEE = (
    "data-independent individual (epsilon_p, delta)-DP for every example of group p (Boenisch et al. 2023, eq. 3)"
)


def steps_per_epoch_for(sample_rates) -> int:
    """Batches per pass: round(n / Σ q_i) over the examples with q_i > 0 (round(1/q) for one rate q,
    as Opacus's ``len(DPDataLoader)``), at least 1."""
    q = np.asarray(sample_rates, dtype=float).ravel()
    active = q > 0
    total = float(q[active].sum())
    return max(1, int(round(active.sum() / total))) if total > 0 else 1


def _expected_batch_size(sample_rates: np.ndarray) -> float | int:
    """Σ q_i, the noisy sum's divisor; an integer when it is one up to float rounding (100 × 0.1 sums to
    9.999999999999998: 10, as Opacus's ``int(len(dataset) · q)``)."""
    total = float(np.sum(sample_rates))
    near = round(total)
    return int(near) if near >= 1 and abs(total - near) <= 1e-9 * near else total


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    raise InvalidParameterError("module", type(module).__name__, "has no parameters to train")


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
            follows torch's RNG as Opacus does (:mod:`.randomness`): at the first draw the seed is
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
        self._follow_torch = seed is None and not self.secure_mode  # seed drawn from torch at the first draw
        self.seed = None if self._follow_torch else resolve_seed(seed, self.secure_mode)
        self.sampler_seed = self.seed  # the Poisson sampler's (the loader generator's when followed)
        self._loader_generator = None
        if not self.secure_mode and distributed.is_main_process():
            warnings.warn(SECURE_RNG_WARNING, UserWarning, stacklevel=2)
        self._seed_given = seed is not None  # a drawn seed yields to a checkpoint's on load
        self.accountant: GroupAccountant | None = None
        self.budgets: Budgets | None = None
        self.module = self.optimizer = self.data_loader = self.criterion = None
        self.clipping: PerExampleClipping | None = None
        self.parameters: dict | None = None  # the current phase's σ, c, q_i, c_i, planned steps
        self.individual = None  # IndividualTracker when individual accounting is on
        self.filter = None  # IndividualFilter with privacy_filter="individual"
        self.users = None  # Users at user level (engine/units.py)
        self.privacy_filter, self.filter_action = "group", "raise"
        self._sampler_rng = None
        self._noise = None
        self._warned = False
        self._writes, self._trainable = None, {}  # set by make_private (.integrity)

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
        :class:`~.accountant.GroupEpsilons`).  ``delta`` defaults to the budgets'.

        ``steps``: the ε each group *would* have after ``steps`` logical steps in all (the current
        phase continued to that count; no training, nothing charged) — Opacus users' "accountant
        copy stepped ahead".  With the individual filter it is the data-independent ε (an upper
        bound of the filter's).
        """
        self._require()
        delta = self._delta(delta)
        if steps is not None:
            if int(steps) != steps or int(steps) < self.steps:
                raise InvalidParameterError("steps", steps, f"must be an integer >= the {self.steps} steps taken")
            return self.accountant.get_epsilon(delta, extra_steps=int(steps) - self.steps)
        if self.filter is None:
            return self.accountant.get_epsilon(delta)
        # individual filter: min(data-independent ε, the filter's guarantee), per group
        eps = self._filter_group_max(
            np.minimum(self.accountant.individual_epsilons(delta), self.filter.guarantee_epsilons(delta))
        )
        return GroupEpsilons(
            eps, self.accountant.values, self.accountant.counts, delta, self.accountant_name, self.steps
        )

    @property
    def history(self) -> list[list[tuple[float, float, int]]]:
        """Per privacy group (ascending budgets), the composition behind its ε in Opacus's history
        form: a list of ``(noise_multiplier, sample_rate, steps)``, one per phase (σ the group's
        effective noise multiplier σ·c/c_p).  ``opacus.accountants.PRVAccountant().history =
        engine.history[g]`` reproduces group g's ε by Opacus (see
        :meth:`~.accountant.GroupAccountant.group_history`)."""
        self._require()
        return self.accountant.group_history()

    def _delta(self, delta):
        return self.accountant._delta(delta)

    def _filter_group_max(self, per_example: np.ndarray) -> np.ndarray:
        out = np.zeros(self.accountant.values.size)
        np.maximum.at(out, self.accountant.group_of, per_example)
        return out

    def get_individual_epsilons(self, delta: float | None = None) -> np.ndarray:
        """ε of every example, each a valid (ε, δ) bound: its data-independent ε (its group's path);
        with the individual filter, the smaller of that and the filter's realized ε; with individual
        accounting (Yu et al. 2023) whose ``engine.individual.kind`` is ``"guarantee"`` (every example
        clipped at its charged sensitivity: individual clipping, or norms of every step with exact/ceil
        rounding, :mod:`.individual`), the smaller of that and the output-specific ε.

        When individual accounting's ``kind`` is ``"estimate"`` the output-specific ε bounds nothing,
        so it is not mixed in: this returns the data-independent ε, and the estimates are
        ``engine.individual.epsilons(delta)`` (or ``engine.individual.report(delta)``), labelled by
        ``engine.individual.kind`` and ``engine.individual.kind_reason``."""
        self._require()
        eps = self.accountant.individual_epsilons(delta)
        if self.filter is not None:  # individual filter: its realized ε at each example's order (≤ budget)
            return np.minimum(eps, self.filter.realized_epsilons(delta))
        if self.individual is not None and self.individual.kind == "guarantee":
            eps = np.minimum(eps, self.individual.epsilons(self._delta(delta)))
        return eps

    @property
    def layer_paths(self) -> dict[str, str]:
        """Layer name → how its per-example gradient norms are computed in this phase, as a function of
        the model and ``grad_sample_mode`` only (public, safe to publish): with ``"bk"`` a ghost norm,
        a per-sample gradient, either by the layer's input shapes in each step (Linear, convolutions;
        :data:`~.bookkeeping.BY_SHAPES`), or Opacus's per-sample gradient for a layer no book-keeping
        rule covers (:mod:`.bookkeeping`); in the other modes Opacus's.  The paths actually taken:
        :attr:`layer_paths_taken`."""
        self._require()
        return layer_paths(self.module, self.parameters["grad_sample_mode"])

    @property
    def layer_paths_taken(self) -> dict[str, str]:
        """Layer name → the paths its per-example norms took so far (with ``"bk"``; the other modes:
        :attr:`layer_paths`).  Private: with inputs padded per batch, a Linear layer's ghost/per-sample
        choice depends on the batch's longest sequence — keep it out of public outputs."""
        self._require()
        return layer_paths(self.module, self.parameters["grad_sample_mode"], taken=True)

    def privacy_groups(self, delta: float | None = None) -> list[dict]:
        """Per group: budget, examples, and the current phase's rate, clip norm and effective σ."""
        self._require()
        eps = self.get_epsilon(delta).per_group
        p = self.parameters
        out = []
        for g, (value, count) in enumerate(zip(self.accountant.values, self.accountant.counts, strict=True)):
            members = self.accountant.group_of == g
            q, c = p["sample_rates"][members], p["clip_norms"][members]
            out.append(
                {
                    "budget": float(value),
                    "count": int(count),
                    "sample_rate": float(q.max()),
                    "clip_norm": float(c.max()),
                    "noise_multiplier": float(p["noise_multiplier"] * p["max_grad_norm"] / c.max()),
                    "epsilon": float(eps[g]),
                }
            )
        return out

    def enable_individual_accounting(self, options=None, per_sample_loss=None, seed: int | None = None):
        """Turn on individual accounting (Yu et al. 2023; :mod:`.individual`): call before or after
        ``make_private`` (one-phase runs).  ``per_sample_loss(module, batch)`` gives one loss per
        example (default: cross-entropy of ``(inputs, targets)`` batches).  Returns the tracker."""
        from .individual import IndividualTracker

        if self.filter is not None:
            raise InvalidParameterError(
                "individual_accounting",
                True,
                "cannot be combined with the individual "
                "filter (the filter already accounts every example individually)",
            )
        self.individual = IndividualTracker(options, per_sample_loss, self._draw_seed() if seed is None else seed)
        self._individual_seed_follows = seed is None and not self._seed_given  # re-drawn from a loaded seed
        if self.accountant is not None:
            if self.steps:
                raise RuntimeError("enable individual accounting before the first step")
            self.individual.attach(self)
        return self.individual

    def per_example_grad_norms(self, per_sample_loss=None, indices=None, batch_size: int = 256):
        """(norms, losses) of each example's loss gradient at the current parameters (private values).

        Works with any loss: ``per_sample_loss(module, batch)`` returns one loss per example of a
        batch collated from the loader's dataset (default: cross-entropy of ``(inputs, targets)``)."""
        self._require()
        loader = self.data_loader
        n = len(loader.dataset) if self.users is None else self.users.num_users
        idx = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64)
        collate = getattr(loader.collate_fn, "collate_fn", loader.collate_fn)
        if self.users is not None:  # user level: the users' norms, of each one's summed gradient (units.py)
            return self.per_user_grad_norms(idx, collate, batch_size, per_sample_loss)
        return distributed.sharded_grad_norms(self.module, loader.dataset, idx, collate, batch_size, per_sample_loss)

    def per_user_grad_norms(self, units, collate, batch_size: int, per_sample_loss=None):
        """User level: (norms, losses) of ``units`` (user indices), each over a random choice of up to k
        of the user's rows drawn from the sampler's source (:func:`~.units.per_user_grad_norms`)."""
        from .units import per_user_grad_norms

        return per_user_grad_norms(  # rows chosen with the sampler's source (seeded, or secure)
            self.module,
            self.data_loader.dataset,
            self.users,
            units,
            collate,
            batch_size,
            per_sample_loss,
            self._sampler_rng,
        )

    def can_step(self) -> bool:
        """Whether the filter admits one more step (always True without a filter)."""
        self._require()
        if self.filter is not None:
            return self.filter.can_step()
        return self.privacy_filter is None or self.accountant.can_step()

    def _require(self):
        if self.accountant is None:
            raise RuntimeError("call make_private first")

    def _draw_seed(self) -> int | None:
        """The engine's seed; without one given (non-secure), drawn now from torch's global generator."""
        if self.seed is None and self._follow_torch:
            self.seed = seed_from_torch(None)
        return self.seed

    def _draw_sampler_seed(self) -> int | None:
        """The Poisson sampler's seed: the engine's, or drawn now from the data loader's generator."""
        if self.sampler_seed is None and self._follow_torch:
            self.sampler_seed = (
                seed_from_torch(self._loader_generator) if self._loader_generator is not None else self._draw_seed()
            )
        return self.sampler_seed

    def _new_sampler_rng(self):
        if self._follow_torch and self.sampler_seed is None:
            return DeferredUniform(lambda: sampler_rng(self._draw_sampler_seed(), False))
        return sampler_rng(self.sampler_seed, self.secure_mode)

    def _new_noise_generator(self, device):
        if self._follow_torch and self.seed is None:
            return DeferredGenerator(lambda: make_noise_generator(device, self._draw_seed(), False), device)
        return make_noise_generator(device, self.seed, self.secure_mode)

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
                **user-level** individualized DP (:mod:`.units`): ``budgets``, rates and clip norms are
                then one per user, users are Poisson-sampled and each sampled user's summed gradient
                over up to k of its rows is clipped as one unit; ε is per user.
            **kwargs: see :meth:`make_private_with_parameters` (``privacy_filter``,
                ``filter_action``, ``filter_options``, ``per_sample_loss``, ...).

        Returns:
            ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion, data_loader)``
            with ``grad_sample_mode="ghost"`` (as Opacus).
        """
        refuse_opacus_options(
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            rand_on_empty=rand_on_empty,
            batch_first=batch_first,
            **kwargs,
        )
        opts = dict(
            criterion=criterion,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            users=users,
            **kwargs,
        )
        n = self._units(data_loader, users)
        q = self._sample_rate(data_loader, n, sample_rate)
        spe = steps_per_epoch_for(q)
        if noise_multiplier is not None and budgets is not None:  # σ given: each group's q_p or c_p solved
            return self._private_for_noise_multiplier(
                module, optimizer, data_loader, budgets, method, target_delta, epochs, steps, max_grad_norm,
                noise_multiplier, n, q, spe, opts,
            )  # fmt: skip
        if noise_multiplier is not None:  # Opacus's make_private: one σ for everyone, no budget
            if method is not None:
                raise InvalidParameterError(
                    "method",
                    method,
                    "is calibrated from budgets; with noise_multiplier and no budgets "
                    "every example has the one σ, rate and clip norm (leave method out)",
                )
            planned = None if epochs is None and steps is None else self._planned_steps(epochs, steps, spe)
            if opts.get("privacy_filter") is not None:
                raise InvalidParameterError(
                    "privacy_filter",
                    opts["privacy_filter"],
                    "needs budgets to filter against; give budgets= (or leave privacy_filter out)",
                )
            opts["privacy_filter"] = None
            check_positive(max_grad_norm, "max_grad_norm")
            return self.make_private_with_parameters(
                module=module,
                optimizer=optimizer,
                data_loader=data_loader,
                budgets=None,
                target_delta=target_delta,
                sample_rates=np.full(n, q),
                clip_norms=np.full(n, float(max_grad_norm)),
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                steps=planned,
                steps_per_epoch=spe,
                **opts,
            )
        method = "sample" if method is None else method
        if method not in METHODS:
            raise InvalidParameterError("method", method, f"must be one of {', '.join(METHODS)}")
        if budgets is None:
            raise InvalidParameterError(
                "budgets",
                None,
                "give per-example budgets (a Budgets or an array with "
                "target_delta), or noise_multiplier= for one σ (Opacus's make_private), or "
                "use make_private_with_epsilon for one target epsilon",
            )
        budgets = self._budgets(budgets, target_delta, n)
        planned = self._planned_steps(epochs, steps, spe)
        a = assign(budgets, method, q, planned, max_grad_norm, self.accountant_name)
        return self._make_private_assigned(a, module, optimizer, data_loader, budgets, planned, spe, opts)

    def _make_private_assigned(self, a, module, optimizer, data_loader, budgets, planned, spe, opts):
        """Set up with an assignment's per-example rates, clip norms and σ (kept as ``self.assignment``)."""
        self.assignment = a
        return self.make_private_with_parameters(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            budgets=budgets,
            sample_rates=a.sample_rates,
            clip_norms=a.clip_norms,
            noise_multiplier=a.noise_multiplier,
            max_grad_norm=a.clip_norm,
            steps=planned,
            steps_per_epoch=spe,
            **opts,
        )

    def _private_for_noise_multiplier(
        self, module, optimizer, data_loader, budgets, method, target_delta, epochs, steps, max_grad_norm,
        noise_multiplier, n, q, spe, opts,
    ):  # fmt: skip
        """``make_private(noise_multiplier=σ, budgets=B, epochs=E)``: with σ fixed, each group's sampling
        rate (``sample``, the default) or clip norm (``scale``) is solved so that the planned steps spend
        its budget (:func:`~idpsgd.assignment.methods.assign_for_noise_multiplier`)."""
        from ..assignment.methods import assign_for_noise_multiplier

        budgets = self._budgets(budgets, target_delta, n)
        if epochs is None and steps is None:
            raise InvalidParameterError(
                "epochs",
                None,
                "give epochs= or steps= with budgets and noise_multiplier: each privacy group's sampling rate "
                "(method 'sample') or clip norm ('scale') is solved so that it spends its budget in that many "
                "steps at this noise_multiplier; or calibrate the noise multiplier too with "
                "make_private_with_epsilon(budgets=..., epochs=...)",
            )
        planned = self._planned_steps(epochs, steps, spe)
        check_positive(max_grad_norm, "max_grad_norm")
        _check_noise(noise_multiplier, max_grad_norm, 1.0)
        a = assign_for_noise_multiplier(
            budgets,
            "sample" if method is None else method,
            float(noise_multiplier),
            q,
            planned,
            float(max_grad_norm),
            self.accountant_name,
        )
        return self._make_private_assigned(a, module, optimizer, data_loader, budgets, planned, spe, opts)

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
        n = self._units(data_loader, kwargs.get("users"))  # users at user level
        if budgets is None:
            if target_epsilon is None:
                raise InvalidParameterError("target_epsilon", None, "is required (or give per-example budgets=)")
            if target_delta is None:
                raise InvalidParameterError("target_delta", None, "is required with target_epsilon")
            eps = check_epsilon(target_epsilon, "target_epsilon")
            budgets = Budgets.from_array(np.full(n, float(eps)), target_delta)
            method = "uniform" if method is None else method
        else:
            budgets = self._budgets(budgets, target_delta, n)
            if target_epsilon is not None and float(target_epsilon) < float(budgets.epsilons.max()) * (1 - 1e-12):
                raise InvalidParameterError(
                    "target_epsilon",
                    target_epsilon,
                    f"is below the largest budget "
                    f"{budgets.epsilons.max():g}: with budgets= every example spends its own "
                    "budget, so target_epsilon (if given) must be >= every budget",
                )
        if epsilon_tolerance is not None:
            tol = float(epsilon_tolerance)
            if not tol >= 1e-4 * float(budgets.epsilons.max()):
                raise InvalidParameterError(
                    "epsilon_tolerance",
                    epsilon_tolerance,
                    "must be >= 1e-4 x the target (the calibration lands within [(1 - 1e-4) target, target])",
                )
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            budgets=budgets,
            method=method,
            epochs=epochs,
            steps=steps,
            max_grad_norm=max_grad_norm,
            sample_rate=sample_rate,
            criterion=criterion,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            **kwargs,
        )

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

        ``privacy_filter="individual"`` attaches the individual Rényi filter (:mod:`.filter`; options
        ``filter_options``, a :class:`~idpsgd.engine.filter.FilterOptions`; ``per_sample_loss(module,
        batch)`` for its norm passes): ``steps`` is then the run's fixed length, and each example
        leaves training when its own budget is spent.

        ``budgets=None`` (with ``privacy_filter=None``): one σ without budgets, as Opacus — ε is
        accounted (``target_delta`` the default δ of :meth:`get_epsilon`), nothing is filtered.
        The plan (``steps``, or one step without it) is checked against the budgets, including what
        earlier phases spent: a plan that would take a group over its budget is refused here
        (:class:`PrivacyBudgetExceeded`, or a warning with ``filter_action="warn"``).
        ``noise_multiplier`` must be > 0 (σ = 0 is no privacy; it is refused).
        """
        n = self._units(data_loader, users)
        budgets = self._budgets(budgets, target_delta, n, allow_none=True)
        q = check_sample_rate(np.asarray(sample_rates, dtype=float).ravel(), "sample_rates", allow_zero=True)
        c = np.asarray(clip_norms, dtype=float).ravel()
        for name, arr in (("sample_rates", q), ("clip_norms", c)):
            if arr.size != n:
                raise InvalidParameterError(
                    name, f"{arr.size} values", f"need one per example of the data loader's dataset ({n})"
                )
        if not np.any(q > 0):
            raise InvalidParameterError("sample_rates", "all 0", "at least one example must have a rate > 0")
        if grad_sample_mode not in ENGINE_MODES:
            raise InvalidParameterError(
                "grad_sample_mode", grad_sample_mode, f"must be one of {', '.join(ENGINE_MODES)}"
            )
        if privacy_filter not in FILTERS:
            raise InvalidParameterError("privacy_filter", privacy_filter, "must be 'group', 'individual' or None")
        if budgets is None and privacy_filter is not None:
            raise InvalidParameterError(
                "privacy_filter",
                privacy_filter,
                "needs budgets to filter against; give budgets= or privacy_filter=None",
            )
        if self.filter is not None:
            raise InvalidParameterError(
                "privacy_filter",
                privacy_filter,
                "this engine's individual filter supports one-phase runs; use a new IndividualizedPrivacyEngine",
            )
        if filter_action not in FILTER_ACTIONS:
            raise InvalidParameterError("filter_action", filter_action, "must be 'raise' or 'warn'")
        if loss_reduction not in ("mean", "sum"):
            raise InvalidParameterError("loss_reduction", loss_reduction, "must be mean or sum")
        if noise_generator is not None and self.secure_mode:
            raise InvalidParameterError("noise_generator", "a generator", "must not be given in secure mode")
        self._check_optimizer(module, optimizer)
        release_hooks(self.module, module)  # an earlier wrap_model=False phase's hooks on this module
        check_wrappable(module, grad_sample_mode, batch_first, loss_reduction, wrap_model)
        if self._sampler_rng is None and self._follow_torch:
            self._loader_generator = data_loader.generator  # the sampler follows it, as Opacus's DPDataLoader
        check_user_level(self, users, privacy_filter)
        sharded = fsdp.is_sharded(module)  # FSDP2 (engine/fsdp.py), or DPDDP/DDP: (rank, W)
        ranks = (fsdp.setup if sharded else distributed.setup)(self, module, grad_sample_mode, privacy_filter, users)
        if users is not None and ranks is not None and (privacy_filter == "individual" or self.individual is not None):
            raise InvalidParameterError(
                "users",
                repr(users),
                "the individual filter and individual accounting at user level run on one rank only (their "
                "per-user norm passes are not sharded yet)",
            )
        check_positive_array(c, "clip_norms")
        if self.accountant is not None and (
            (self.budgets is None) != (budgets is None)
            or (budgets is not None and not np.array_equal(self.budgets.epsilons, budgets.epsilons))
        ):
            raise InvalidParameterError(
                "budgets",
                repr(budgets),
                "differ from this engine's earlier phases; use a new IndividualizedPrivacyEngine for other budgets",
            )

        device = _device_of(module)
        _check_noise(
            noise_multiplier, max_grad_norm, float(q.sum()) if expected_batch_size is None else expected_batch_size
        )
        if privacy_filter == "individual":  # orders, RDP budgets, checks (engine/filter.py)
            from .filter import prepare_filter

            new_filter = prepare_filter(
                self, data_loader, filter_options, per_sample_loss, budgets, q, c, noise_multiplier, max_grad_norm
            )
        accountant = (
            self.accountant
            if self.accountant is not None
            else GroupAccountant(
                budgets, self.accountant_name, num_examples=n, delta=target_delta if budgets is None else None
            )
        )
        accountant.begin_phase(q, c, noise_multiplier, max_grad_norm)
        fresh = self.accountant is None
        try:
            if privacy_filter == "group":  # the plan against the budgets, earlier phases included: here, not at step 1
                self._check_plan(accountant, steps, filter_action)
            # the engine's state changes from here on (undone below if the set-up fails)
            if self.accountant is None:
                self.budgets = budgets
                self.accountant = accountant
                self._sampler_rng = self._new_sampler_rng()
            if noise_generator is not None:
                self._noise = noise_generator
            elif self._noise is None or (hasattr(self._noise, "device") and self._noise.device != device):
                self._noise = self._new_noise_generator(device)

            queue = BatchIndexQueue(strict=getattr(data_loader, "num_workers", 0) == 0)  # workers prefetch batches
            self.clipping = PerExampleClipping(c, queue) if users is None else UnitClipping(c, queue, users)
            wrapped = wrap_module(module, grad_sample_mode, self.clipping, batch_first, loss_reduction, wrap_model)
            wrapped.forbid_grad_accumulation()
            if sharded:
                wrapped = fsdp.check_wrapped(wrapped, grad_sample_mode)
            spe = int(steps_per_epoch) if steps_per_epoch is not None else steps_per_epoch_for(q)
            sampler = (
                PoissonBatchSampler(q, spe, self._sampler_rng, queue)
                if users is None
                else UserPoissonBatchSampler(q, spe, self._sampler_rng, queue, users)
                if ranks is None
                else DistributedUserPoissonBatchSampler(q, spe, self._sampler_rng, queue, users, *ranks)
            )  # user level on several ranks: users routed to ranks, whole (units.py)
            sampler = (
                sampler
                if ranks is None or users is not None
                else distributed.DistributedPoissonBatchSampler(q, spe, self._sampler_rng, queue, *ranks)
            )
            loader = PrivateDataLoader(data_loader, sampler, batch_first)
            if sharded:  # every rank runs forward/backward (FSDP2's collectives): a phantom row for an empty draw
                fsdp.phantom_batches(loader, batch_first)
            base = optimizer.original_optimizer if hasattr(optimizer, "original_optimizer") else optimizer
            ebs = _expected_batch_size(q) if expected_batch_size is None else float(expected_batch_size)
            dp_opt = (OPTIMIZERS if ranks is None else fsdp.OPTIMIZERS if sharded else distributed.OPTIMIZERS)[
                grad_sample_mode
            ](
                base,
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                clipping=self.clipping,
                expected_batch_size=ebs if ranks is None else ebs / ranks[1],
                loss_reduction=loss_reduction,
                generator=self._noise,
                secure_mode=self.secure_mode,
            )  # per rank Σq/W, as Opacus (engine/distributed.py)
        except BaseException:  # a refused or failed set-up leaves no phase (and no new accountant)
            accountant.discard_phase()
            if fresh:
                self.budgets = self.accountant = None
            raise

        self.privacy_filter, self.filter_action, self._warned = privacy_filter, filter_action, False
        raw = raw_module(wrapped)  # un-noised writes to the released model are refused (.integrity)
        self._writes, self._trainable = WriteGuard.attach(raw), trainable_names(raw)
        # its state is released with the model in checkpoints and feeds later updates; the wrappers' own
        # forward pre-hooks run before the model's: both are watched from the step's first call
        self._writes.optimizer, self._writes.scope = dp_opt.original_optimizer, wrapped
        self._writes.arm()
        dp_opt.write_guard = self._writes  # DPDDP: a write found on another rank marks this replica too
        dp_opt.post_step_hooks.append(lambda _opt: self._writes.arm())
        dp_opt.refusal_hooks.append(self._after_refusal)
        dp_opt.guard = self._guard
        if grad_sample_mode == "bk":
            dp_opt.keeper = wrapped.keeper  # book-keeping: the clipped sum comes from the model's keeper
            wrapped.keeper.user_level = BookKeepingUsers(self.clipping) if users is not None else None
        dp_opt.attach_step_hook(lambda _opt: self.accountant.step())
        self.parameters = {
            "sample_rates": q,
            "clip_norms": c,
            "noise_multiplier": float(noise_multiplier),
            "max_grad_norm": float(max_grad_norm),
            "steps": None if steps is None else int(steps),
            "steps_per_epoch": spe,
            "expected_batch_size": ebs,
            "grad_sample_mode": grad_sample_mode,
            "privacy_unit": "example" if users is None else "user",
            "max_rows_per_user": None if users is None else users.k,
        }
        self.users = users
        self.module, self.optimizer, self.data_loader = wrapped, dp_opt, loader
        if self.individual is not None:
            self.individual.attach(self)
        if privacy_filter == "individual":
            self.filter = new_filter.attach(self)
        if grad_sample_mode == "ghost":
            from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

            crit = criterion if criterion is not None else torch.nn.CrossEntropyLoss(reduction=loss_reduction)
            self.criterion = DPLossFastGradientClipping(wrapped, dp_opt, crit, loss_reduction)
            return wrapped, dp_opt, self.criterion, loader
        return wrapped, dp_opt, loader

    # --- the filter -----------------------------------------------------------------------
    @staticmethod
    def _check_plan(accountant: GroupAccountant, steps, filter_action: str) -> None:
        """Refuse (or warn about) a phase whose plan — ``steps``, or one step without a plan — would
        take a group over its budget given what the earlier phases spent; the admitted steps are then
        cached, so the filter passes them cheaply."""
        planned = 1 if steps is None else int(steps)
        if accountant.prime(planned):
            return
        fits = accountant.max_admissible_steps(planned)
        before = accountant.group_epsilons(extra_steps=0)
        what = f"the plan of {planned} steps" if steps is not None else "a step"
        msg = (
            f"{what} would take a privacy group over its budget (budgets {accountant.values.tolist()}, spent "
            f"before this phase {np.round(before, 4).tolist()}); at most {fits} steps of this phase fit"
        )
        if filter_action == "raise":
            raise PrivacyBudgetExceeded(
                msg + ": plan at most that many steps (steps=/epochs=), add noise, or use "
                "a new IndividualizedPrivacyEngine for a new run"
            )
        warnings.warn(
            msg + "; continuing because filter_action='warn' (the reported epsilon will exceed the budget)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _guard(self, _optimizer) -> None:
        """Before the noise of each logical step: refuse un-noised writes to the released model and
        parameters made trainable since make_private (:mod:`.integrity`), then the privacy filter."""
        self._writes.check()
        check_no_new_trainable(raw_module(self.module), self._trainable, self.parameters["grad_sample_mode"])
        self._admit(_optimizer)

    def _after_refusal(self, _optimizer) -> None:
        """A step refused anywhere in ``optimizer.step()`` (the guard, the book-keeper, Opacus): its
        forward/backward pass is checked for writes (it may have been refused before the guard
        compared), then the next call of the model starts the next step — so writes between steps
        after a refused step are not taken for writes in it."""
        if self._writes.tainted is None:
            self._writes.check()
            self._writes.arm()

    def _admit(self, _optimizer) -> None:
        if self.filter is not None:
            return self.filter.guard(_optimizer)
        if self.privacy_filter is None or self.accountant.can_step():
            return
        eps_now = self.accountant.group_epsilons()
        msg = (
            f"privacy filter: step {self.steps + 1} would take a privacy group over its budget "
            f"(budgets {self.accountant.values.tolist()}, spent so far {np.round(eps_now, 4).tolist()})"
        )
        if self.filter_action == "raise":
            raise PrivacyBudgetExceeded(msg + "; the step was not taken")
        if not self._warned:
            warnings.warn(
                msg + "; continuing because filter_action='warn' (the reported ε will exceed the budget)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned = True

    # --- checks -----------------------------------------------------------------------------
    @staticmethod
    def _budgets(budgets, target_delta, n: int | None = None, allow_none: bool = False) -> Budgets | None:
        if budgets is None:
            if allow_none:
                return None
            raise InvalidParameterError("budgets", None, "give a Budgets object or an array of per-example epsilons")
        if isinstance(budgets, Budgets):
            if target_delta is not None and float(target_delta) != budgets.delta:
                raise InvalidParameterError("target_delta", target_delta, f"differs from budgets.delta={budgets.delta}")
        else:
            if target_delta is None:
                raise InvalidParameterError("target_delta", None, "is required when budgets is an array")
            budgets = Budgets.from_array(np.asarray(budgets, dtype=float).ravel(), target_delta)
        if n is not None and len(budgets) != n:
            hint = ""
            if len(budgets) < n and budgets.values.size == len(budgets) and len(budgets) <= 20:
                shown = ", ".join(f"{v:g}" for v in budgets.epsilons)
                hint = (
                    f"; for one budget per privacy group use Budgets.from_groups([{shown}], fractions, {n}, "
                    "delta) (or Budgets.from_class_map / from_csv)"
                )
            raise InvalidParameterError(
                "budgets", f"{len(budgets)} values", f"need one per example of the data loader's dataset ({n}){hint}"
            )
        return budgets

    def _units(self, data_loader, users) -> int:
        """The number of privacy units: users (user level) or the dataset's examples."""
        n = self._dataset_size(data_loader)
        if users is None:
            return n
        from ..users import Users

        if not isinstance(users, Users):
            raise InvalidParameterError("users", type(users).__name__, "must be an idpsgd.Users (user id per row, k)")
        if users.num_rows != n:
            raise InvalidParameterError(
                "users", repr(users), f"must give a user for each of the data loader's {n} examples"
            )
        return users.num_users

    @staticmethod
    def _dataset_size(data_loader) -> int:
        if not isinstance(data_loader, DataLoader):
            raise InvalidParameterError(
                "data_loader", type(data_loader).__name__, "must be a torch.utils.data.DataLoader"
            )
        ds = data_loader.dataset
        if isinstance(ds, IterableDataset):
            raise InvalidParameterError(
                "data_loader",
                f"a DataLoader over {type(ds).__name__}",
                "must be over a map-style Dataset (with __len__ and __getitem__): Poisson "
                "sampling needs to pick examples by index",
            )
        try:
            n = len(ds)
        except TypeError:
            raise InvalidParameterError("data_loader", type(ds).__name__, "its dataset must have a length") from None
        if n < 1:
            raise InvalidParameterError("data_loader", "an empty dataset", "need at least one example")
        return n

    @staticmethod
    def _sample_rate(data_loader, n: int, sample_rate) -> float:
        """The mean sampling rate: ``sample_rate``, else Opacus's ``1 / len(data_loader)`` (so an
        epoch is ``len(data_loader)`` steps of expected size ``len(dataset) / len(data_loader)``)."""
        if sample_rate is not None:
            return float(check_sample_rate(sample_rate))
        try:
            batches = len(data_loader)
        except TypeError:
            raise InvalidParameterError(
                "sample_rate", None, "is required when the data loader has no length (a batch_sampler without __len__)"
            ) from None
        if batches < 1:
            raise InvalidParameterError(
                "data_loader",
                f"{batches} batches",
                f"need at least one batch per epoch (a batch_size above the {n} examples with drop_last=True?)",
            )
        return 1.0 / batches

    @staticmethod
    def _planned_steps(epochs, steps, steps_per_epoch: int) -> int:
        if (epochs is None) == (steps is None):
            raise InvalidParameterError("epochs", epochs, "give exactly one of epochs and steps")
        if steps is not None:
            if int(steps) != steps or int(steps) < 1:
                raise InvalidParameterError("steps", steps, "must be an integer >= 1")
            return int(steps)
        if int(epochs) != epochs or int(epochs) < 1:
            raise InvalidParameterError("epochs", epochs, "must be an integer >= 1")
        return int(epochs) * steps_per_epoch

    @staticmethod
    def _check_optimizer(module, optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidParameterError("optimizer", type(optimizer).__name__, "must be a torch.optim.Optimizer")
        owned = {id(p) for p in raw_module(module).parameters()}
        params = list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))
        foreign = sum(id(p) not in owned for p in params)
        if foreign:
            raise InvalidParameterError(
                "optimizer",
                type(optimizer).__name__,
                f"{OPACUS_PARAMETER_MISMATCH}: {foreign} of its parameter(s) are not the "
                "module's; build it over module.parameters() (after get_compatible_module / "
                "ModuleValidator.fix, which copy the module)",
            )
        # a trainable parameter outside the noisy optimizer keeps an un-noised gradient in .grad after each
        # step (the un-clipped sum in hooks/functorch mode, the clipped sum without noise in ghost mode);
        # another optimizer that applies it writes the released model between steps, unseen (.integrity)
        mine = {id(p) for p in params}
        left = [n for n, p in raw_module(module).named_parameters() if p.requires_grad and id(p) not in mine]
        if left:
            shown = ", ".join(repr(n) for n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            raise InvalidParameterError(
                "optimizer",
                type(optimizer).__name__,
                f"leaves out the module's trainable parameter(s) {shown}: their gradients would be formed without "
                "noise, and an update that applies them (a second optimizer) would write the released model "
                "outside the privacy accounting; build the optimizer over every trainable parameter (parameter "
                "groups for other learning rates) or freeze them (requires_grad_(False))",
            )

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
        cls._validate_module(fixed)
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
        self._validate_module(module)

    @staticmethod
    def _validate_module(module: torch.nn.Module) -> None:
        from opacus.validators import ModuleValidator

        from .opacus_compat import UnsupportedModuleError

        errors = ModuleValidator.validate(module, strict=False)
        if errors:
            raise UnsupportedModuleError(
                "module",
                type(module).__name__,
                "cannot be trained privately by Opacus: " + "; ".join(str(e) for e in errors),
            )

    # --- checkpoints ----------------------------------------------------------------------
    def _plan(self) -> dict:
        p = self.parameters
        return {
            "steps": p["steps"],
            "steps_per_epoch": p["steps_per_epoch"],
            "noise_multiplier": p["noise_multiplier"],
            "max_grad_norm": p["max_grad_norm"],
            "sample_rate": float(np.mean(p["sample_rates"])),
            "expected_batch_size": p["expected_batch_size"],
        }

    def state_dict(self) -> dict:
        """Seed, accountant, sampler and noise-generator states and the phase's plan (plain types and
        tensors; in secure mode the generators' states are not saved: a resumed secure run draws
        fresh entropy)."""
        self._require()
        self._draw_sampler_seed(), self._draw_seed()  # a seed followed from torch is drawn by now
        state = {
            "seed": self.seed,
            "sampler_seed": self.sampler_seed,
            "secure_mode": self.secure_mode,
            "accountant": self.accountant.state_dict(),
            "accountant_name": self.accountant_name,
            "plan": self._plan(),
        }
        if not self.secure_mode:
            state["sampler"] = self.data_loader.poisson_sampler.state_dict()
            state["noise"] = self._noise.get_state()
        if self.individual is not None:
            state["individual"] = self.individual.state_dict()
        if self.filter is not None:
            state["filter"] = self.filter.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore after :meth:`make_private` set up the same phase as at saving time.

        An engine created with ``seed=None`` continues with the state's seed (the sampler and noise
        generators are restored from the state either way); one created with another explicit seed,
        or set up with another plan (other epochs, batch size, clip norm, budgets), is refused with
        what to change.  Nothing is changed when the state is refused."""
        self._require()
        if bool(state.get("secure_mode")) != self.secure_mode:
            raise ValueError(
                f"the state was saved with secure_mode={bool(state.get('secure_mode'))}: create the "
                f"engine with secure_mode={bool(state.get('secure_mode'))} to resume it"
            )
        saved_seed = state.get("seed")
        if not self.secure_mode and saved_seed != self.seed and self._seed_given:
            raise ValueError(
                "the state was saved by an engine with another seed than the one this engine was "
                "created with: create it with the run's seed, or with seed=None (the checkpoint's "
                "seed is then used). The seeds are not printed: a seed replays the run's randomness "
                "and is private"
            )
        saved_name = state.get("accountant_name", state["accountant"].get("accountant"))
        if saved_name != self.accountant_name:
            raise ValueError(
                f"the state was saved with accountant={saved_name!r}, this engine uses "
                f"{self.accountant_name!r}: create it with accountant={saved_name!r} to resume"
            )
        try:
            self.accountant.load_state_dict(state["accountant"])
        except ValueError:
            raise ValueError(self._plan_mismatch(state.get("plan"))) from None
        if not self.secure_mode and saved_seed != self.seed:
            self._adopt_seed(int(saved_seed))
        if not self.secure_mode and not self._seed_given:
            self.sampler_seed = state.get("sampler_seed", self.seed)
        if not self.secure_mode:
            self.data_loader.poisson_sampler.load_state_dict(state["sampler"])
            self._noise.set_state(state["noise"])
        if self.individual is not None and state.get("individual") is not None:
            self.individual.load_state_dict(state["individual"])
        if self.filter is not None:
            self.filter.load_state_dict(state["filter"])

    def _plan_mismatch(self, saved: dict | None) -> str:
        now = self._plan()

        def show(p):
            return (
                f"{p['steps']} planned steps ({p['steps_per_epoch']} per epoch), noise multiplier "
                f"{p['noise_multiplier']:.6g}, mean sample rate {p['sample_rate']:.6g}, clip norm "
                f"{p['max_grad_norm']:g}"
            )

        what = (
            f" (saved: {show(saved)}; now: {show(now)})"
            if isinstance(saved, dict) and saved.get("steps_per_epoch") is not None
            else ""
        )
        return (
            "cannot resume: the saved state is for other sampling rates, clip norms, noise or examples than the "
            f"phase make_private set up{what}. Set up make_private exactly as the run that saved it (the same "
            "budgets, epochs or steps, batch size and max_grad_norm); to train longer than its plan, keep its "
            "epochs: the privacy filter then admits further steps only while every budget holds"
        )

    def _adopt_seed(self, seed: int) -> None:
        """Continue with a checkpoint's seed (this engine's own seed was drawn, not given)."""
        self.seed = seed
        t = self.individual
        if t is not None and getattr(self, "_individual_seed_follows", False) and t.seed != seed:
            from .individual import IndividualTracker  # its validation subset is drawn from the seed

            if t._after_step in self.optimizer.post_step_hooks:
                self.optimizer.post_step_hooks.remove(t._after_step)
            self.individual = IndividualTracker(t.options, t.per_sample_loss, seed)
            self.individual.attach(self)

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
        """Opacus's ``save_checkpoint``, with Opacus's keys: ``module_state_dict`` (the module
        unwrapped, so it loads into the wrapped or the plain module), ``optimizer_state_dict``,
        ``privacy_accountant_state_dict`` (:meth:`GroupAccountant.state_dict`, Opacus's ``history``
        and ``mechanism`` included), your ``checkpoint_dict`` entries (plain types and tensors), and
        ``privacy_engine_state_dict``: the rest of :meth:`state_dict` (seed, sampler and noise
        generators, individual accounting or filter).  ``path``: a file path — written atomically
        with mode 0600, since it holds training state — or a binary file object (``io.BytesIO``, as
        Opacus's ``BinaryIO``), written in place.  Loadable with ``weights_only=True``."""
        self._require()
        refuse_opacus_options(noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler)
        if torch_save_kwargs:
            raise InvalidParameterError(
                "torch_save_kwargs",
                sorted(torch_save_kwargs),
                "are not supported: the checkpoint is written by idpsgd.io.save_torch (atomic, mode 0600)",
            )
        ckpt = dict(checkpoint_dict or {})
        ckpt["module_state_dict"] = raw_module(module).state_dict(**(module_state_dict_kwargs or {}))
        if optimizer is not None:
            ckpt["optimizer_state_dict"] = optimizer.state_dict()
        state = self.state_dict()
        ckpt["privacy_accountant_state_dict"] = state.pop("accountant")
        ckpt["privacy_engine_state_dict"] = state
        _write_checkpoint(path, ckpt)

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
        """Opacus's ``load_checkpoint``, after :meth:`make_private` set up the run as when it was
        saved: restores the engine (with the checkpoint's seed when this engine was created with
        ``seed=None``), the module and the optimizer, and returns what Opacus returns — the
        checkpoint without the optimizer's state: ``module_state_dict``,
        ``privacy_accountant_state_dict`` and your ``checkpoint_dict`` entries.

        Also loads a checkpoint written by **Opacus's** ``save_checkpoint`` into an engine set up
        with ``make_private(noise_multiplier=...)`` (no budgets): its accountant history becomes the
        earlier steps (:meth:`GroupAccountant.load_state_dict`); the sampler and noise continue from
        this engine's generators (Opacus saves none).  ``path``: a file path or a binary file
        object.  Loads with ``weights_only=True``: nothing in the file can run code.  A checkpoint
        of another plan or seed is refused before anything changes."""
        from ..io import CheckpointError

        self._require()
        refuse_opacus_options(noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler)
        if torch_load_kwargs:
            raise InvalidParameterError(
                "torch_load_kwargs",
                sorted(torch_load_kwargs),
                "are not supported: the checkpoint loads with weights_only=True onto the CPU, then into the module",
            )
        ckpt = _read_checkpoint(path)
        name = path if isinstance(path, (str, os.PathLike)) else type(path).__name__
        if (
            not isinstance(ckpt, dict)
            or "module_state_dict" not in ckpt
            or not ("privacy_engine_state_dict" in ckpt or "privacy_accountant_state_dict" in ckpt)
        ):
            raise CheckpointError(
                f"{name} is not a privacy engine checkpoint (write it with engine.save_checkpoint "
                "or Opacus's PrivacyEngine.save_checkpoint)"
            )
        state = ckpt.pop("privacy_engine_state_dict", None)
        if state is not None:
            state = dict(state)
            state.setdefault("accountant", ckpt.get("privacy_accountant_state_dict"))  # older checkpoints: inside
            self.load_state_dict(state)
        else:  # Opacus's checkpoint: its accountant history only
            self.accountant.load_state_dict(ckpt["privacy_accountant_state_dict"])
        raw_module(module).load_state_dict(_unwrapped(ckpt["module_state_dict"]), **(module_load_dict_kwargs or {}))
        opt_state = ckpt.pop("optimizer_state_dict", None)
        if optimizer is not None and opt_state:
            optimizer.load_state_dict(opt_state)
        elif (optimizer is not None) != bool(opt_state):
            warnings.warn(
                f"the checkpoint {'has' if opt_state else 'has no'} optimizer state but optimizer is "
                f"{'not ' if optimizer is None else ''}given",
                UserWarning,
                stacklevel=2,
            )
        for key in ("noise_scheduler_state_dict", "grad_clip_scheduler_state_dict"):  # Opacus pops them too
            ckpt.pop(key, None)
        return ckpt


def _unwrapped(state: dict) -> dict:
    """A module state dict without the ``_module.`` prefix of Opacus's wrapper (Opacus saves the
    wrapped module's state; the engine's checkpoints hold the plain module's)."""
    prefix = "_module."
    if state and all(k.startswith(prefix) for k in state):
        return type(state)((k[len(prefix) :], v) for k, v in state.items())
    return state


def _write_checkpoint(path, ckpt: dict) -> None:
    """A path: atomically, mode 0600 (:func:`idpsgd.io.save_torch`); a binary file object: in place."""
    from ..io import save_torch, to_plain

    if isinstance(path, (str, os.PathLike)):
        save_torch(path, ckpt, private=True)
    elif hasattr(path, "write"):
        torch.save(to_plain(ckpt), path)
    else:
        raise InvalidParameterError(
            "path", type(path).__name__, "must be a file path or a binary file object (e.g. io.BytesIO)"
        )


def _read_checkpoint(path):
    """Load with ``weights_only=True`` from a path (:func:`idpsgd.io.load_torch`) or a file object."""
    import pickle

    from ..io import CheckpointError, load_torch

    if isinstance(path, (str, os.PathLike)):
        return load_torch(path)
    if not hasattr(path, "read"):
        raise InvalidParameterError(
            "path", type(path).__name__, "must be a file path or a binary file object (e.g. io.BytesIO)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"the {type(path).__name__} does not hold a readable checkpoint ({first[:200]})"
        ) from None


__all__ = ["GUARANTEE", "GroupEpsilons", "IndividualizedPrivacyEngine", "PrivacyBudgetExceeded", "steps_per_epoch_for"]
