"""``IndividualizedPrivacyEngine``: Opacus's ``PrivacyEngine`` with a privacy budget per example.

One object owns the module, the optimizer, the data loader and the accountant, as in Opacus::

    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,     # any map-style Dataset / collate_fn
        budgets=Budgets.from_groups([1, 2, 3], [.34, .43, .23], n, delta=1e-5),
        method="sample", epochs=30, max_grad_norm=1.0)
    for batch in loader:                 # the user's batches, unchanged
        optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()
    engine.get_epsilon()                 # ε per privacy group; engine.get_individual_epsilons() per example

What it does (Boenisch et al. 2023, IDP-SGD, Alg. 1–3; the product guide's model of a step):

* **calibration** — from the budgets, the method (``uniform``, ``sample``, ``scale``; Boenisch et
  al. §3, :func:`idpsgd.assignment.assign`) and the planned steps, the per-example sampling rates
  q_i, clip norms c_i and the noise multiplier σ, as Opacus's ``make_private_with_epsilon`` does
  for one budget; or explicit per-example parameters (:meth:`make_private_with_parameters`);
* **sampling** — the loader's batch sampler becomes a Poisson sampler with per-example rates
  (:mod:`.sampler`); empty batches keep the structure of the user's batches;
* **clipping and noise** — example i is clipped at c_i (per-sample gradients, or ghost clipping
  with ``grad_sample_mode="ghost"``), the noise has std σ·c and the sum is divided by Σ q_i
  (:mod:`.optimizer`);
* **accounting and filter** — every step is charged to every example with q_i > 0; before the
  noise of each step the filter refuses (``PrivacyBudgetExceeded``) a step that would take any
  privacy group over its budget, or warns (``filter_action="warn"``) (:mod:`.accountant`); or,
  with ``privacy_filter="individual"``, each example leaves training when its own budget is spent
  (individual Rényi filter, Feldman & Zrnic 2021; :mod:`.filter`).

Privacy definition: data-independent individual (ε_p, δ)-DP for every example of privacy group p
(Boenisch et al. eq. 3), with ε from the accountant the run was calibrated with.
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..assignment import Budgets, assign
from ..validation import InvalidParameterError, check_positive_array, check_sample_rate
from .accountant import ACCOUNTANTS, GroupAccountant, PrivacyBudgetExceeded
from . import distributed
from .clipping import PerExampleClipping
from .optimizer import OPTIMIZERS, _check_noise
from .randomness import noise_generator as make_noise_generator, resolve_seed, sampler_rng
from .sampler import BatchIndexQueue, PoissonBatchSampler, PrivateDataLoader
from .wrap import GRAD_SAMPLE_MODES, check_wrappable, raw_module, wrap_module

FILTERS = ("group", "individual", None)   # individual: engine/filter.py (Feldman & Zrnic 2021)
FILTER_ACTIONS = ("raise", "warn")
METHODS = ("uniform", "sample", "scale")

GUARANTEE = ("data-independent individual (epsilon_p, delta)-DP for every example of group p "
             "(Boenisch et al. 2023, eq. 3)")


def steps_per_epoch_for(sample_rates) -> int:
    """Batches per pass: round(n / Σ q_i) over the examples with q_i > 0 (round(1/q) for one rate q,
    as Opacus's ``len(DPDataLoader)``), at least 1."""
    q = np.asarray(sample_rates, dtype=float).ravel()
    active = q > 0
    total = float(q[active].sum())
    return max(1, int(round(active.sum() / total))) if total > 0 else 1


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    raise InvalidParameterError("module", type(module).__name__, "has no parameters to train")


class IndividualizedPrivacyEngine:
    """Individualized DP-SGD for any model, data loader and device.

    Args:
        accountant: ``rdp`` (Rényi DP, adaptive orders) or ``pld`` (privacy loss distributions
            through dp_accounting); used for calibration, the filter and the reported ε.
        secure_mode: Opacus's secure mode: sampling and noise from OS entropy, secure noise
            sampling; a seed is refused.
        seed: seeds the Poisson sampler and the noise; ``None`` draws a fresh seed from OS entropy
            and records it as :attr:`seed` (so a run can be replayed).
    """

    def __init__(self, *, accountant: str = "rdp", secure_mode: bool = False, seed: int | None = None):
        if accountant not in ACCOUNTANTS:
            raise InvalidParameterError("accountant", accountant, f"must be one of {', '.join(ACCOUNTANTS)}")
        self.accountant_name = accountant
        self.secure_mode = bool(secure_mode)
        self.seed = resolve_seed(seed, self.secure_mode)
        self.accountant: GroupAccountant | None = None
        self.budgets: Budgets | None = None
        self.module = self.optimizer = self.data_loader = self.criterion = None
        self.clipping: PerExampleClipping | None = None
        self.parameters: dict | None = None      # the current phase's σ, c, q_i, c_i, planned steps
        self.individual = None                   # IndividualTracker when individual accounting is on
        self.filter = None                       # IndividualFilter with privacy_filter="individual"
        self.privacy_filter, self.filter_action = "group", "raise"
        self._sampler_rng = None
        self._noise = None
        self._warned = False

    # --- public state ---------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Logical DP-SGD steps taken so far (all phases)."""
        return self.accountant.steps if self.accountant is not None else 0

    @property
    def group_budgets(self) -> np.ndarray:
        """The privacy groups' budgets, ascending (the order of :meth:`get_epsilon`)."""
        return self.accountant.values if self.accountant is not None else np.zeros(0)

    def get_epsilon(self, delta: float | None = None) -> np.ndarray:
        """ε spent so far by each privacy group (ascending budgets), by the run's accountant."""
        self._require()
        if self.filter is not None:   # individual filter: min(data-independent ε, the filter's guarantee)
            return self._filter_group_max(np.minimum(self.accountant.individual_epsilons(delta),
                                                     self.filter.guarantee_epsilons(delta)))
        return self.accountant.get_epsilon(delta)

    def _filter_group_max(self, per_example: np.ndarray) -> np.ndarray:
        out = np.zeros(self.accountant.values.size)
        np.maximum.at(out, self.accountant.group_of, per_example)
        return out

    def get_individual_epsilons(self, delta: float | None = None) -> np.ndarray:
        """ε of every example: data-independent (its group's path); with individual accounting, the
        smaller of that and its output-specific ε (Yu et al. 2023), both valid bounds."""
        self._require()
        eps = self.accountant.individual_epsilons(delta)
        if self.filter is not None:   # individual filter: its realized ε at each example's order (≤ budget)
            return np.minimum(eps, self.filter.realized_epsilons(delta))
        if self.individual is not None:
            eps = np.minimum(eps, self.individual.epsilons(self.budgets.delta if delta is None else delta))
        return eps

    def privacy_groups(self, delta: float | None = None) -> list[dict]:
        """Per group: budget, examples, and the current phase's rate, clip norm and effective σ."""
        self._require()
        eps = self.get_epsilon(delta)
        p = self.parameters
        out = []
        for g, (value, count) in enumerate(zip(self.accountant.values, self.accountant.counts)):
            members = self.accountant.group_of == g
            q, c = p["sample_rates"][members], p["clip_norms"][members]
            out.append({"budget": float(value), "count": int(count), "sample_rate": float(q.max()),
                        "clip_norm": float(c.max()), "noise_multiplier": float(p["noise_multiplier"] * p["max_grad_norm"] / c.max()),
                        "epsilon": float(eps[g])})
        return out

    def enable_individual_accounting(self, options=None, per_sample_loss=None, seed: int | None = None):
        """Turn on individual accounting (Yu et al. 2023; :mod:`.individual`): call before or after
        ``make_private`` (one-phase runs).  ``per_sample_loss(module, batch)`` gives one loss per
        example (default: cross-entropy of ``(inputs, targets)`` batches).  Returns the tracker."""
        from .individual import IndividualTracker

        if self.filter is not None:
            raise InvalidParameterError("individual_accounting", True, "cannot be combined with the individual "
                                        "filter (the filter already accounts every example individually)")
        self.individual = IndividualTracker(options, per_sample_loss, self.seed if seed is None else seed)
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
        idx = np.arange(len(loader.dataset)) if indices is None else np.asarray(indices, dtype=np.int64)
        collate = getattr(loader.collate_fn, "collate_fn", loader.collate_fn)
        return distributed.sharded_grad_norms(self.module, loader.dataset, idx, collate, batch_size, per_sample_loss)

    def can_step(self) -> bool:
        """Whether the filter admits one more step (always True without a filter)."""
        self._require()
        if self.filter is not None:
            return self.filter.can_step()
        return self.privacy_filter is None or self.accountant.can_step()

    def _require(self):
        if self.accountant is None:
            raise RuntimeError("call make_private first")

    # --- make_private ---------------------------------------------------------------------
    def make_private(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     budgets, method: str = "sample", target_delta: float | None = None,
                     epochs: int | None = None, steps: int | None = None, max_grad_norm: float = 1.0,
                     sample_rate: float | None = None, **kwargs):
        """Calibrate per-example rates/clip norms and σ for ``budgets``, then wrap for training.

        Args:
            module, optimizer, data_loader: as for Opacus's ``make_private``; the loader may be over
                any map-style dataset (tuples, dicts, extra tensors, custom ``collate_fn``).
            budgets: a :class:`~idpsgd.assignment.Budgets`, or an array of per-example ε with
                ``target_delta``; one per example of ``data_loader.dataset``.
            method: ``uniform`` (every example at the smallest budget), ``sample`` (per-group
                rates, one σ) or ``scale`` (per-group clip norms) (Boenisch et al. §3).
            epochs / steps: the planned length (one of them); the calibration spends each group's
                budget exactly at that many steps.
            max_grad_norm: the (mean) clip norm c.
            sample_rate: the mean sampling rate; default ``data_loader.batch_size / len(dataset)``.
            **kwargs: see :meth:`make_private_with_parameters` (``grad_sample_mode``, ``criterion``,
                ``privacy_filter``, ``filter_action``, ``noise_generator``, ...).

        Returns:
            ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion, data_loader)``
            with ``grad_sample_mode="ghost"`` (as Opacus).
        """
        if method not in METHODS:
            raise InvalidParameterError("method", method, f"must be one of {', '.join(METHODS)}")
        budgets = self._budgets(budgets, target_delta)
        n = self._dataset_size(data_loader)
        q = self._sample_rate(data_loader, n, sample_rate)
        spe = steps_per_epoch_for(q)
        planned = self._planned_steps(epochs, steps, spe)
        if len(budgets) != n:
            raise InvalidParameterError("budgets", f"{len(budgets)} values",
                                        f"need one per example of the data loader's dataset ({n})")
        a = assign(budgets, method, q, planned, max_grad_norm, self.accountant_name)
        self.assignment = a
        return self.make_private_with_parameters(
            module=module, optimizer=optimizer, data_loader=data_loader, budgets=budgets,
            sample_rates=a.sample_rates, clip_norms=a.clip_norms, noise_multiplier=a.noise_multiplier,
            max_grad_norm=a.clip_norm, steps=planned, steps_per_epoch=spe, **kwargs)

    def make_private_with_parameters(
            self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
            budgets, sample_rates, clip_norms, noise_multiplier: float, max_grad_norm: float,
            steps: int | None = None, steps_per_epoch: int | None = None, target_delta: float | None = None,
            expected_batch_size: float | None = None, grad_sample_mode: str = "hooks", criterion=None,
            batch_first: bool = True, loss_reduction: str = "mean", privacy_filter: str | None = "group",
            filter_action: str = "raise", noise_generator=None, filter_options=None, per_sample_loss=None):
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
        """
        budgets = self._budgets(budgets, target_delta)
        n = self._dataset_size(data_loader)
        q = check_sample_rate(np.asarray(sample_rates, dtype=float).ravel(), "sample_rates", allow_zero=True)
        c = np.asarray(clip_norms, dtype=float).ravel()
        for name, arr in (("budgets", budgets.epsilons), ("sample_rates", q), ("clip_norms", c)):
            if arr.size != n:
                raise InvalidParameterError(name, f"{arr.size} values",
                                            f"need one per example of the data loader's dataset ({n})")
        if not np.any(q > 0):
            raise InvalidParameterError("sample_rates", "all 0", "at least one example must have a rate > 0")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise InvalidParameterError("grad_sample_mode", grad_sample_mode,
                                        f"must be one of {', '.join(GRAD_SAMPLE_MODES)}")
        if privacy_filter not in FILTERS:
            raise InvalidParameterError("privacy_filter", privacy_filter, "must be 'group', 'individual' or None")
        if self.filter is not None:
            raise InvalidParameterError("privacy_filter", privacy_filter, "this engine's individual filter supports "
                                        "one-phase runs; use a new IndividualizedPrivacyEngine")
        if filter_action not in FILTER_ACTIONS:
            raise InvalidParameterError("filter_action", filter_action, "must be 'raise' or 'warn'")
        if loss_reduction not in ("mean", "sum"):
            raise InvalidParameterError("loss_reduction", loss_reduction, "must be mean or sum")
        if noise_generator is not None and self.secure_mode:
            raise InvalidParameterError("noise_generator", "a generator", "must not be given in secure mode")
        self._check_optimizer(module, optimizer)
        check_wrappable(module, grad_sample_mode, batch_first, loss_reduction)
        ranks = distributed.setup(self, module, grad_sample_mode, privacy_filter)   # (rank, W) for DPDDP/DDP
        check_positive_array(c, "clip_norms")
        if self.budgets is not None and not np.array_equal(self.budgets.epsilons, budgets.epsilons):
            raise InvalidParameterError("budgets", repr(budgets), "differ from this engine's earlier phases; "
                                        "use a new IndividualizedPrivacyEngine for other budgets")

        device = _device_of(module)
        _check_noise(noise_multiplier, max_grad_norm, float(q.sum()) if expected_batch_size is None
                     else expected_batch_size)
        if privacy_filter == "individual":   # orders, RDP budgets, checks (engine/filter.py)
            from .filter import prepare_filter
            new_filter = prepare_filter(self, data_loader, filter_options, per_sample_loss, budgets, q, c,
                                        noise_multiplier, max_grad_norm)
        # everything that can refuse the input is above; the engine's state changes from here on
        if self.accountant is None:
            self.budgets = budgets
            self.accountant = GroupAccountant(budgets, self.accountant_name)
            self._sampler_rng = sampler_rng(self.seed, self.secure_mode)
        if noise_generator is not None:
            self._noise = noise_generator
        elif self._noise is None or (hasattr(self._noise, "device") and self._noise.device != device):
            self._noise = make_noise_generator(device, self.seed, self.secure_mode)

        queue = BatchIndexQueue(strict=getattr(data_loader, "num_workers", 0) == 0)   # workers prefetch batches
        self.clipping = PerExampleClipping(c, queue)
        wrapped = wrap_module(module, grad_sample_mode, self.clipping, batch_first, loss_reduction)
        wrapped.forbid_grad_accumulation()
        spe = int(steps_per_epoch) if steps_per_epoch is not None else steps_per_epoch_for(q)
        sampler = PoissonBatchSampler(q, spe, self._sampler_rng, queue) if ranks is None else \
            distributed.DistributedPoissonBatchSampler(q, spe, self._sampler_rng, queue, *ranks)
        loader = PrivateDataLoader(data_loader, sampler, batch_first)
        base = optimizer.original_optimizer if hasattr(optimizer, "original_optimizer") else optimizer
        ebs = float(q.sum()) if expected_batch_size is None else float(expected_batch_size)
        dp_opt = (OPTIMIZERS if ranks is None else distributed.OPTIMIZERS)[grad_sample_mode](
            base, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, clipping=self.clipping,
            expected_batch_size=ebs / (1 if ranks is None else ranks[1]), loss_reduction=loss_reduction,
            generator=self._noise, secure_mode=self.secure_mode)   # per rank Σq/W, as Opacus (engine/distributed.py)

        self.accountant.begin_phase(q, c, noise_multiplier, max_grad_norm)
        if steps is not None and privacy_filter == "group":
            self.accountant.prime(int(steps))     # checked once; beyond the budget the filter stops the run
        self.privacy_filter, self.filter_action, self._warned = privacy_filter, filter_action, False
        dp_opt.guard = self._guard
        dp_opt.attach_step_hook(lambda _opt: self.accountant.step())
        self.parameters = {"sample_rates": q, "clip_norms": c, "noise_multiplier": float(noise_multiplier),
                           "max_grad_norm": float(max_grad_norm), "steps": None if steps is None else int(steps),
                           "steps_per_epoch": spe, "expected_batch_size": ebs, "grad_sample_mode": grad_sample_mode}
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
    def _guard(self, _optimizer) -> None:
        if self.filter is not None:
            return self.filter.guard(_optimizer)
        if self.privacy_filter is None or self.accountant.can_step():
            return
        eps_now = self.accountant.get_epsilon()
        msg = (f"privacy filter: step {self.steps + 1} would take a privacy group over its budget "
               f"(budgets {self.accountant.values.tolist()}, spent so far {np.round(eps_now, 4).tolist()})")
        if self.filter_action == "raise":
            raise PrivacyBudgetExceeded(msg + "; the step was not taken")
        if not self._warned:
            warnings.warn(msg + "; continuing because filter_action='warn' (the reported ε will exceed the budget)",
                          RuntimeWarning, stacklevel=3)
            self._warned = True

    # --- checks -----------------------------------------------------------------------------
    @staticmethod
    def _budgets(budgets, target_delta) -> Budgets:
        if isinstance(budgets, Budgets):
            if target_delta is not None and float(target_delta) != budgets.delta:
                raise InvalidParameterError("target_delta", target_delta, f"differs from budgets.delta={budgets.delta}")
            return budgets
        if budgets is None:
            raise InvalidParameterError("budgets", None, "give a Budgets object or an array of per-example epsilons")
        if target_delta is None:
            raise InvalidParameterError("target_delta", None, "is required when budgets is an array")
        return Budgets.from_array(np.asarray(budgets, dtype=float), target_delta)

    @staticmethod
    def _dataset_size(data_loader) -> int:
        if not isinstance(data_loader, DataLoader):
            raise InvalidParameterError("data_loader", type(data_loader).__name__, "must be a torch.utils.data.DataLoader")
        ds = data_loader.dataset
        if isinstance(ds, IterableDataset):
            raise InvalidParameterError("data_loader", f"a DataLoader over {type(ds).__name__}",
                                        "must be over a map-style Dataset (with __len__ and __getitem__): Poisson "
                                        "sampling needs to pick examples by index")
        try:
            n = len(ds)
        except TypeError:
            raise InvalidParameterError("data_loader", type(ds).__name__, "its dataset must have a length") from None
        if n < 1:
            raise InvalidParameterError("data_loader", "an empty dataset", "need at least one example")
        return n

    @staticmethod
    def _sample_rate(data_loader, n: int, sample_rate) -> float:
        if sample_rate is not None:
            return float(check_sample_rate(sample_rate))
        b = data_loader.batch_size
        if b is None:
            raise InvalidParameterError("sample_rate", None, "is required when the data loader has no batch_size "
                                        "(a custom batch_sampler)")
        if b > n:
            raise InvalidParameterError("batch_size", b, f"must be <= the {n} examples of the dataset")
        return b / n

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
            raise InvalidParameterError("optimizer", type(optimizer).__name__,
                                        f"has {foreign} parameter(s) that are not the module's; build it over "
                                        "module.parameters()")

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Accountant, sampler and noise-generator states (plain types and tensors; in secure mode the
        generators' states are not saved: a resumed secure run draws fresh entropy)."""
        self._require()
        state = {"seed": self.seed, "secure_mode": self.secure_mode, "accountant": self.accountant.state_dict()}
        if not self.secure_mode:
            state["sampler"] = self.data_loader.poisson_sampler.state_dict()
            state["noise"] = self._noise.get_state()
        if self.individual is not None:
            state["individual"] = self.individual.state_dict()
        if self.filter is not None:
            state["filter"] = self.filter.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore after :meth:`make_private` for the same phase (as at saving time)."""
        self._require()
        if bool(state.get("secure_mode")) != self.secure_mode:
            raise ValueError("the state was saved with another secure_mode")
        if not self.secure_mode and state.get("seed") != self.seed:
            raise ValueError(f"the state was saved by an engine with seed {state.get('seed')}, this one has {self.seed}")
        self.accountant.load_state_dict(state["accountant"])
        if not self.secure_mode:
            self.data_loader.poisson_sampler.load_state_dict(state["sampler"])
            self._noise.set_state(state["noise"])
        if self.individual is not None and state.get("individual") is not None:
            self.individual.load_state_dict(state["individual"])
        if self.filter is not None:
            self.filter.load_state_dict(state["filter"])


__all__ = ["GUARANTEE", "IndividualizedPrivacyEngine", "PrivacyBudgetExceeded", "steps_per_epoch_for"]
