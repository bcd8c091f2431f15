"""Checkpoints of a privacy engine: what a run needs to resume, and Opacus's checkpoint format.

The engine's state is the accountant's ledger (every step charged so far: the privacy state that
must never be lost or forked), the seeds and the sampler and noise generators (so that a resumed
run continues the same randomness), individual accounting's or the individual filter's state, and
which noise draws of the run folder's journal the ledger covers (:mod:`.budget.journal`: on load, the
draws it does not cover — an abandoned attempt's — are charged).
A checkpoint is refused before anything changes when it is of another plan, seed, accountant or
secure mode: resuming it would compose other mechanisms than the ledger records.  Files are
written atomically with mode 0600 (:func:`idpsgd.io.save_torch`; they hold private state) and read
with ``weights_only=True``.  Opacus's ``save_checkpoint``/``load_checkpoint`` keys are kept, and
Opacus's own checkpoints load into an engine set up without budgets.  User guidance:
docs/opacus.md.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from ..validation import InvalidParameterError
from .opacus_compat import refuse_opacus_options
from .per_example.unwrap import raw_module


def plan_of(engine) -> dict:
    """The phase's plan as a checkpoint records it (public values)."""
    p = engine.parameters
    return {
        "steps": p.steps,
        "steps_per_epoch": p.steps_per_epoch,
        "noise_multiplier": p.noise_multiplier,
        "max_grad_norm": p.max_grad_norm,
        "sample_rate": float(np.mean(p.sample_rates)),
        "expected_batch_size": p.expected_batch_size,
    }


def state_dict(engine) -> dict:
    """Seed, accountant, sampler and noise-generator states and the phase's plan (plain types and
    tensors; in secure mode the generators' states are not saved: a resumed secure run draws
    fresh entropy)."""
    engine.seeds.draw_sampler(), engine.seeds.draw()  # a seed followed from torch is drawn by now
    state = {
        "seed": engine.seed,
        "sampler_seed": engine.sampler_seed,
        "secure_mode": engine.secure_mode,
        "accountant": engine.accountant.state_dict(),
        "accountant_name": engine.accountant_name,
        "plan": plan_of(engine),
    }
    if not engine.secure_mode:
        state["sampler"] = engine.data_loader.poisson_sampler.state_dict()
        state["noise"] = engine.noise_source.get_state()
    if engine.individual is not None:
        state["individual"] = engine.individual.state_dict()
    if engine.filter is not None:
        state["filter"] = engine.filter.state_dict()
    if engine.journal is not None:  # the draws this ledger covers, kept or charged (engine/budget/journal.py)
        state["journal"] = engine.journal.state_dict()
    return state


def load_state_dict(engine, state: dict, resume_seeds) -> None:
    """Restore after :meth:`make_private` set up the same phase as at saving time.

    An engine created with ``seed=None`` continues with the state's seed (the sampler and noise
    generators are restored from the state either way); one created with another explicit seed,
    or set up with another plan (other epochs, batch size, clip norm, budgets), is refused with
    what to change.  Nothing is changed when the state is refused.  ``resume_seeds(state)``: the
    engine's own step that continues with the state's seeds (after the ledger, before the generators)."""
    if bool(state.get("secure_mode")) != engine.secure_mode:
        raise ValueError(
            f"the state was saved with secure_mode={bool(state.get('secure_mode'))}: create the "
            f"engine with secure_mode={bool(state.get('secure_mode'))} to resume it"
        )
    saved_seed = state.get("seed")
    if not engine.secure_mode and saved_seed != engine.seed and engine.seeds.given:
        raise ValueError(
            "the state was saved by an engine with another seed than the one this engine was "
            "created with: create it with the run's seed, or with seed=None (the checkpoint's "
            "seed is then used). The seeds are not printed: a seed replays the run's randomness "
            "and is private"
        )
    saved_name = state.get("accountant_name", state["accountant"].get("accountant"))
    if saved_name != engine.accountant_name:
        raise ValueError(
            f"the state was saved with accountant={saved_name!r}, this engine uses "
            f"{engine.accountant_name!r}: create it with accountant={saved_name!r} to resume"
        )
    try:
        engine.accountant.load_state_dict(state["accountant"])
    except ValueError:
        raise ValueError(plan_mismatch(engine, state.get("plan"))) from None
    if not engine.secure_mode:
        resume_seeds(state)
    if not engine.secure_mode:
        engine.data_loader.poisson_sampler.load_state_dict(state["sampler"])
        engine.noise_source.set_state(state["noise"])
    if engine.individual is not None and state.get("individual") is not None:
        engine.individual.load_state_dict(state["individual"])
    if engine.filter is not None:
        engine.filter.load_state_dict(state["filter"])
    if engine.journal is not None:  # the run folder's draws the state does not cover are charged now
        engine.journal.reconcile(engine, state.get("journal"), checkpoint=True)


def plan_mismatch(engine, saved: dict | None) -> str:
    """Why a checkpoint of another plan cannot be resumed, with both plans."""
    now = plan_of(engine)

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


def save_checkpoint(
    engine,
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
    state = engine.state_dict()
    ckpt["privacy_accountant_state_dict"] = state.pop("accountant")
    ckpt["privacy_engine_state_dict"] = state
    _write_checkpoint(path, ckpt)


def load_checkpoint(
    engine,
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
        engine.load_state_dict(state)
    else:  # Opacus's checkpoint: its accountant history only
        engine.accountant.load_state_dict(ckpt["privacy_accountant_state_dict"])
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

    from ..io import CheckpointError, load_torch, torch_load_problem

    if isinstance(path, (str, os.PathLike)):
        return load_torch(path)
    if not hasattr(path, "read"):
        raise InvalidParameterError(
            "path", type(path).__name__, "must be a file path or a binary file object (e.g. io.BytesIO)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"the {type(path).__name__} does not hold a readable checkpoint ({torch_load_problem(exc)})"
        ) from None


__all__ = ["load_checkpoint", "load_state_dict", "plan_of", "save_checkpoint", "state_dict"]
