"""Opacus 1.6's contract on the engine: the one table of refused Opacus options, and Opacus's errors.

A script written for ``opacus.PrivacyEngine`` runs on :class:`~.privacy_engine.IndividualizedPrivacyEngine`
unchanged except where it asks for something the engine refuses on purpose.  :data:`REFUSALS` lists
each such option with the reason, the error it raises and a pattern of that error's message; the
engine builds its refusal messages from this table (:func:`refuse_opacus_options`), the Opacus-suite
harness (``tests/opacus_suite``) classifies a failed Opacus test as *refused* when its error matches
an entry, and the documentation lists the same table.

:class:`UnsupportedModuleError` is raised for a model Opacus cannot train privately: it is both
``opacus.validators.errors.UnsupportedModuleError`` (what Opacus raises, so ``except`` clauses written
for Opacus catch it) and :class:`~idpsgd.validation.InvalidParameterError` (a ``ValueError``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from opacus.validators.errors import UnsupportedModuleError as _OpacusUnsupportedModuleError

from ..validation import InvalidParameterError
from .budget.accountant import PrivacyBudgetExceeded
from .sampling.sampler import BatchMismatchError


class UnsupportedModuleError(InvalidParameterError, _OpacusUnsupportedModuleError):
    """A module Opacus (and so the engine) cannot train privately, e.g. one with BatchNorm
    (``opacus.validators.ModuleValidator.fix`` / ``engine.get_compatible_module`` replace it)."""


#: Opacus's wording for an optimizer over other parameters than the module's (tests match it).
OPACUS_PARAMETER_MISMATCH = "Module parameters are different than optimizer Parameters"


@dataclass(frozen=True)
class Refusal:
    """One Opacus option the engine refuses.

    Attributes:
        option: the option as a user writes it (``poisson_sampling=False``).
        reason: why the engine cannot honour it (privacy first; where the reason is only that it is
            not implemented, it says so).
        pattern: a regular expression that the refusal's message matches (``re.search``).
        error: the exception class raised.
    """

    option: str
    reason: str
    pattern: str
    error: type = InvalidParameterError

    def matches(self, crash: str) -> bool:
        """Whether an error line ``[module.]Type: message`` (pytest's crash line) is this refusal."""
        m = re.match(r"^\s*(?:E\s+)?([\w.]+):\s(.*)", crash, re.S)
        if m is None:
            return False
        names = {c.__name__ for c in _with_subclasses(self.error)}
        return m.group(1).rsplit(".", 1)[-1] in names and re.search(self.pattern, m.group(2)) is not None


def _with_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_with_subclasses(sub))
    return out


POISSON = (
    "the privacy accounting (the engine's and Opacus's: amplification by subsampling) holds for Poisson "
    "batches only; the engine always draws them, with per-example rates q_i — batches from your loader's "
    "own sampler (fixed size, shuffled or sequential) would not be covered by the epsilon reported"
)
FLAT = (
    "each example is clipped at one flat norm c_i over all parameters, the sensitivity the per-example "
    "accounting and Scale's per-group clip norms rest on; per-layer clipping is not implemented, and adaptive "
    "clipping (Andrew et al. 2021) spends privacy on a noisy quantile estimate that the accountant does not "
    "charge"
)
WRAP = (
    "Opacus 1.6's unwrapped hooks (your module, hooks attached) are supported with grad_sample_mode 'hooks', "
    "'functorch' and 'no_op'; in 'ghost' and 'bk' mode each example's clip norm c_i enters through the engine's "
    "own wrapper (its clip factors, its book-keeper), which has no unwrapped form, and Opacus has none for 'ew' "
    "— use the returned module there, and for a data-parallel (DPDDP/DDP) module (not implemented, no privacy "
    "reason)"
)
EMPTY = (
    "an empty Poisson batch keeps your batch structure with zero rows (a noise-only step); filling it with "
    "random inputs is not implemented (it would change no privacy, only the shapes your model sees)"
)
NO_NOISE = "noise_multiplier=0 adds no noise: no privacy, and no epsilon to report"
SCHEDULES = (
    "the engine's plan fixes sigma and the clip norms for the run's budgets (calibration, the privacy "
    "filter and the reported epsilon assume it); to change them start a new phase with "
    "make_private_with_parameters, which composes with the earlier ones"
)
SAVE_KWARGS = (
    "checkpoints are written atomically with mode 0600 (they hold the sampler and noise state) and "
    "loaded with weights_only=True (nothing in the file can run code); other torch.save/torch.load "
    "arguments would undo that"
)
SECURE_SEED = (
    "secure_mode=True draws every privacy-relevant random number from OS entropy; a seed or a noise "
    "generator would make the sampling or the noise predictable"
)
WHOLE_BATCHES = (
    "each example's clip norm and its privacy charge belong to the Poisson batch it was drawn in: a "
    "step must train on the drawn batch, whole, with one per-sample gradient per example; per-sample "
    "gradients of other units (batch_first=True on batch-second data: positions instead of examples, "
    "which Opacus clips and accounts as if they were examples), a partial batch or several batches "
    "in one step are refused before the noise"
)
BATCH_SECOND = (
    "per-sample gradients must be taken along the batch dimension of each layer's input; with batch-second "
    "(T, B, ...) inputs the engine knows it from the loader (batch_first=False) and proves it for every "
    "trainable layer by provenance (bk: any layout, row by row; hooks, functorch and ghost: Opacus takes it "
    "at dimension 1 of every layer but its RNN cells, so a layer that gets the batch elsewhere is refused, "
    "since when the drawn batch size equals T Opacus would clip the wrong units); 'ew' and 'no_op' cannot be "
    "checked so and refuse it; give batch-first (B, T, ...) inputs there (x.transpose(0, 1) in your collate)"
)
MIXING = (
    "per-example clipping bounds an example's influence only when every other example's gradient does not "
    "depend on it; a model that mixes the examples of a batch (BatchNorm in training mode, x - x.mean(0), "
    "attention over the batch dimension) makes every gradient a function of the whole batch, and the "
    "sensitivity exceeds the clip norm (Opacus trains it silently); the engine checks the model on a "
    "synthetic batch at its first forward pass and refuses it before any noisy step, as it refuses a model the "
    "check cannot run (no per-example output, a forward that fails on the synthetic batch)"
)
BUDGET = (
    "the privacy filter refuses the step (or, at make_private, the plan) that would take a privacy group "
    "over its budget, before its noise is drawn (filter_action='warn' warns instead); Opacus would train "
    "on and report the larger epsilon"
)

#: Every Opacus option the engine refuses, with why (the documentation prints this table).
REFUSALS: tuple[Refusal, ...] = (
    Refusal("poisson_sampling=False", POISSON, r"^poisson_sampling=False is invalid"),
    Refusal('clipping="per_layer" / "adaptive"', FLAT, r"^clipping='(per_layer|adaptive)' is invalid"),
    Refusal('wrap_model=False with grad_sample_mode="ghost"/"bk"/"ew"', WRAP, r"^wrap_model=False is invalid"),
    Refusal("rand_on_empty=True", EMPTY, r"^rand_on_empty=True is invalid"),
    Refusal("noise_multiplier=0", NO_NOISE, r"^noise_multiplier=0(\.0*)? is invalid"),
    Refusal(
        "noise_scheduler= / grad_clip_scheduler=",
        SCHEDULES,
        r"^(noise_scheduler|grad_clip_scheduler)=\S+ is invalid: is not supported",
    ),
    Refusal("torch_save_kwargs= / torch_load_kwargs=", SAVE_KWARGS, r"^torch_(save|load)_kwargs=.* is invalid"),
    Refusal(
        "secure_mode=True with a seed or noise_generator",
        SECURE_SEED,
        r"^(seed|noise_generator)=.* is invalid: must not be given in secure mode",
    ),
    Refusal(
        "per-sample gradients that are not the drawn batch's examples (wrong batch_first, partial batches)",
        WHOLE_BATCHES,
        r"(trained on only part of a drawn batch|trained on a batch while|clipped more per-sample "
        r"gradients than drawn examples)",
        BatchMismatchError,
    ),
    Refusal("batch_first=False", BATCH_SECOND, r"^batch_first=False is invalid"),
    Refusal(
        "a model that mixes examples within a batch (or that the check cannot run)",
        MIXING,
        r"mixes examples within the batch|each example's output depends on that example alone",
        UnsupportedModuleError,
    ),
    Refusal(
        "a step or plan beyond a budget", BUDGET, r"would take a privacy group over its budget", PrivacyBudgetExceeded
    ),
)

#: Opacus keywords with one honourable value: name -> (that value, the refusal's reason).
OPACUS_ONLY = {
    "poisson_sampling": (True, POISSON),
    "clipping": ("flat", FLAT),
    "rand_on_empty": (False, EMPTY),
}


def refuse_opacus_options(**given) -> None:
    """Raise the :data:`REFUSALS` error for an Opacus keyword the engine cannot honour."""
    for name, (allowed, why) in OPACUS_ONLY.items():
        if name in given and given[name] != allowed:
            raise InvalidParameterError(name, given[name], f"only {allowed!r} is supported: {why}")
    for name in ("noise_scheduler", "grad_clip_scheduler"):
        if given.get(name) is not None:
            raise InvalidParameterError(name, type(given[name]).__name__, f"is not supported: {SCHEDULES}")


def validate_module(module, *, first_with_fix: bool = False) -> None:
    """Raise :class:`UnsupportedModuleError` when Opacus's ``ModuleValidator`` finds ``module``
    cannot be trained privately: every reason (Opacus's ``validate``), or with ``first_with_fix``
    the first one and the fix (``make_private``'s message)."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(module, strict=False)
    if not errors:
        return
    if first_with_fix:
        why = (
            f"{errors[0]} (IndividualizedPrivacyEngine.get_compatible_module, i.e. "
            "opacus.validators.ModuleValidator.fix, replaces e.g. BatchNorm by GroupNorm)"
        )
    else:
        why = "; ".join(str(e) for e in errors)
    raise UnsupportedModuleError("module", type(module).__name__, "cannot be trained privately by Opacus: " + why)


def refusal_for(error: BaseException) -> Refusal | None:
    """The :data:`REFUSALS` entry an exception is, or None."""
    line = f"{type(error).__name__}: {error}"
    return next((r for r in REFUSALS if r.matches(line)), None)


__all__ = [
    "OPACUS_PARAMETER_MISMATCH",
    "REFUSALS",
    "Refusal",
    "UnsupportedModuleError",
    "refusal_for",
    "refuse_opacus_options",
    "validate_module",
]
