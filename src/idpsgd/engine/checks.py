"""The set-up's checks: what ``make_private`` refuses before anything changes, and the plan's sizes.

Each function checks one input of ``IndividualizedPrivacyEngine.make_private*`` and either returns
it normalised or raises :class:`~idpsgd.validation.InvalidParameterError` naming the value, why,
and what is allowed: the budgets (one per privacy unit, Boenisch et al. 2023 eq. 3), the data
loader (map-style, non-empty), the sampling rate (Opacus's default ``1/len(data_loader)``), the
planned length, the optimizer (over every trainable parameter of the module, and nothing else) and
the noise (σ > 0).  :func:`steps_per_epoch_for` and :func:`expected_batch_size_of` are the plan's two
derived sizes.  Kept out of ``privacy_engine.py`` so that the engine reads as check → plan → build
→ wire.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..assignment import Budgets
from ..validation import InvalidParameterError, check_positive, check_positive_array, check_sample_rate
from . import distributed
from .clipping.users import check_user_level
from .distributed import fsdp
from .noise.optimizer import check_noise
from .noise.randomness import RunSeeds
from .opacus_compat import OPACUS_PARAMETER_MISMATCH
from .options import SetupOptions
from .per_example.unwrap import raw_module
from .per_example.wrap import check_wrappable


def steps_per_epoch_for(sample_rates) -> int:
    """Batches per pass: round(n / Σ q_i) over the examples with q_i > 0 (round(1/q) for one rate q,
    as Opacus's ``len(DPDataLoader)``), at least 1."""
    q = np.asarray(sample_rates, dtype=float).ravel()
    active = q > 0
    total = float(q[active].sum())
    return max(1, int(round(active.sum() / total))) if total > 0 else 1


def expected_batch_size_of(sample_rates: np.ndarray) -> float | int:
    """Σ q_i, the noisy sum's divisor; an integer when it is one up to float rounding (100 × 0.1 sums to
    9.999999999999998: 10, as Opacus's ``int(len(dataset) · q)``)."""
    total = float(np.sum(sample_rates))
    near = round(total)
    return int(near) if near >= 1 and abs(total - near) <= 1e-9 * near else total


def device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    raise InvalidParameterError("module", type(module).__name__, "has no parameters to train")


def check_budgets(budgets, target_delta, n: int | None = None, allow_none: bool = False) -> Budgets | None:
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


def count_units(data_loader, users) -> int:
    """The number of privacy units: users (user level) or the dataset's examples."""
    n = dataset_size(data_loader)
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


def dataset_size(data_loader) -> int:
    if not isinstance(data_loader, DataLoader):
        raise InvalidParameterError("data_loader", type(data_loader).__name__, "must be a torch.utils.data.DataLoader")
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


def mean_sample_rate(data_loader, n: int, sample_rate) -> float:
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


def planned_steps(epochs, steps, steps_per_epoch: int) -> int:
    if (epochs is None) == (steps is None):
        raise InvalidParameterError("epochs", epochs, "give exactly one of epochs and steps")
    if steps is not None:
        if int(steps) != steps or int(steps) < 1:
            raise InvalidParameterError("steps", steps, "must be an integer >= 1")
        return int(steps)
    if int(epochs) != epochs or int(epochs) < 1:
        raise InvalidParameterError("epochs", epochs, "must be an integer >= 1")
    return int(epochs) * steps_per_epoch


def check_optimizer(module, optimizer) -> None:
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


def per_example_parameters(sample_rates, clip_norms, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, c) as flat float arrays, one per privacy unit, at least one rate > 0 (c is checked > 0
    later, after the distributed set-up, as before)."""
    q = check_sample_rate(np.asarray(sample_rates, dtype=float).ravel(), "sample_rates", allow_zero=True)
    c = np.asarray(clip_norms, dtype=float).ravel()
    for name, arr in (("sample_rates", q), ("clip_norms", c)):
        if arr.size != n:
            raise InvalidParameterError(
                name, f"{arr.size} values", f"need one per example of the data loader's dataset ({n})"
            )
    if not np.any(q > 0):
        raise InvalidParameterError("sample_rates", "all 0", "at least one example must have a rate > 0")
    return q, c


def check_same_budgets(earlier: Budgets | None, budgets: Budgets | None) -> None:
    """A later phase of an engine keeps its budgets (the ledger composes phases against them)."""
    if (earlier is None) != (budgets is None) or (
        budgets is not None and not np.array_equal(earlier.epsilons, budgets.epsilons)
    ):
        raise InvalidParameterError(
            "budgets",
            repr(budgets),
            "differ from this engine's earlier phases; use a new IndividualizedPrivacyEngine for other budgets",
        )


@dataclass(frozen=True)
class Counted:
    """What a ``make_private*`` entry point already checked, so that no check runs twice: the privacy
    units counted (:func:`count_units`), the budgets checked against them (:func:`check_budgets`) and
    whether σ and c were (:func:`~.noise.optimizer.check_noise`, before a calibration at that σ)."""

    units: int
    budgets: Budgets | None
    noise: bool = False


@dataclass(frozen=True)
class CheckedPhase:
    """What the check stage of ``make_private_with_parameters`` found usable."""

    units: int
    budgets: Budgets | None
    sample_rates: np.ndarray
    clip_norms: np.ndarray
    options: SetupOptions
    ranks: tuple[int, int] | None  # (rank, world size) with data parallelism
    seeds: RunSeeds  # the run's seeds (every rank shares rank 0's at build: distributed.shared_seeds)
    device: torch.device
    individual_filter: object = None  # the prepared IndividualFilter with privacy_filter="individual"
    sharded: bool = False  # a fully_shard (FSDP2) model: engine/distributed/fsdp.py's optimizer and phantom rows


def check_phase(
    engine, *, module, optimizer, data_loader, budgets, target_delta, sample_rates, clip_norms, noise_multiplier,
    max_grad_norm, options: SetupOptions, counted: Counted | None = None,
) -> CheckedPhase:  # fmt: skip
    """Every check of a phase's set-up, in order, each once (``counted``: what the entry point checked
    already).  Pure: the engine, the module, the seeds and the process group are read, never written —
    what changes them (an earlier ``wrap_model=False`` phase's hooks released, FSDP2's reduction
    settings, the seeds shared by the ranks) is the build stage's, under its rollback."""
    if counted is None:
        n = count_units(data_loader, options.users)
        budgets = check_budgets(budgets, target_delta, n, allow_none=True)
    else:
        n, budgets = counted.units, counted.budgets
    q, c = per_example_parameters(sample_rates, clip_norms, n)
    opts = options.validate(engine.secure_mode, budgets is not None, engine.filter is not None)
    check_optimizer(module, optimizer)
    check_wrappable(
        module, opts.grad_sample_mode, opts.batch_first, opts.loss_reduction, opts.wrap_model, previous=engine.module
    )
    first = engine.accountant is None  # the sampler follows the loader's generator, as Opacus's DPDataLoader
    seeds = engine.seeds.following(data_loader.generator) if first else engine.seeds
    check_user_level(engine, opts.users)
    sharded = fsdp.is_sharded(module)  # FSDP2 (engine/distributed/fsdp.py), or DPDDP/DDP: (rank, W)
    if sharded:
        ranks = fsdp.check(engine, module, opts.mode, opts.privacy_filter, opts.users)
    else:
        ranks = distributed.check(engine, module, opts.mode, opts.privacy_filter)
    check_positive_array(c, "clip_norms")
    if not first:
        check_same_budgets(engine.budgets, budgets)
    device = device_of(module)
    normaliser = float(q.sum()) if opts.expected_batch_size is None else opts.expected_batch_size
    if counted is not None and counted.noise:  # σ and c checked before the calibration at that σ
        check_positive(normaliser, "expected_batch_size")
    else:
        check_noise(noise_multiplier, max_grad_norm, normaliser)
    new_filter = None
    if opts.privacy_filter == "individual":  # orders, RDP budgets, checks (engine/budget/filter.py)
        from .budget.filter import prepare_filter

        new_filter = prepare_filter(
            engine, data_loader, opts.filter_options, opts.per_sample_loss, budgets, q, c, noise_multiplier,
            max_grad_norm,
        )  # fmt: skip
    return CheckedPhase(n, budgets, q, c, opts, ranks, seeds, device, new_filter, sharded)


__all__ = [
    "CheckedPhase",
    "Counted",
    "check_budgets",
    "check_optimizer",
    "check_phase",
    "check_same_budgets",
    "count_units",
    "dataset_size",
    "device_of",
    "expected_batch_size_of",
    "mean_sample_rate",
    "per_example_parameters",
    "planned_steps",
    "steps_per_epoch_for",
]
