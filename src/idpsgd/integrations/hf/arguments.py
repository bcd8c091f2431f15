"""What the private Trainer takes beyond Hugging Face's ``TrainingArguments``, and which of those
arguments it honours, maps or refuses.

:class:`PrivacyArguments` — the budgets and the engine's options.  :func:`check_training_arguments`
— every ``TrainingArguments`` option the private run cannot honour is refused with the reason; the
ones it maps are documented on :class:`~.trainer.IndividualizedTrainer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...names import ACCOUNTANTS, IDP_METHODS
from ...validation import InvalidParameterError

#: the engine's modes the Trainer runs (ghost: two backward passes per physical batch, through Opacus's loss wrapper)
GRAD_SAMPLE_MODES = ("bk", "ghost", "hooks", "functorch")


@dataclass(frozen=True)
class PrivacyArguments:
    """The private part of a fine-tuning run (Boenisch et al. 2023, IDP-SGD).

    Args:
        budgets: where each training example's ε comes from: the name of a column of the
            ``datasets.Dataset`` (it is removed from the model's inputs), an array with one ε per
            training example, or an :class:`idpsgd.Budgets` (which carries δ).
        delta: the global δ (required unless ``budgets`` is a ``Budgets``).
        method: ``uniform`` (everyone at the smallest budget), ``sample`` (per-group sampling rates)
            or ``scale`` (per-group clip norms) (Boenisch et al. §3).
        accountant: ``rdp``, ``pld`` or ``prv`` (calibration, filter and the reported ε).
        grad_sample_mode: ``bk`` (book-keeping: one backward pass, near non-private cost), ``ghost``
            (Opacus's ghost clipping: two backward passes of each physical batch, which the Trainer
            runs through Opacus's ``DPTensorFastGradientClipping`` on the per-example losses; no tied
            parameters, no gradient checkpointing), ``hooks`` or ``functorch`` (Opacus's per-sample
            gradients).
        seed: seeds the privacy randomness — Poisson sampling and noise — and nothing else (the
            model's initialisation and dropout follow ``TrainingArguments.seed`` as usual).  ``None``
            (default): a fresh seed from OS entropy, recorded in the run folder's private part only —
            a public seed (such as ``TrainingArguments.seed``'s default 42) would make the noise
            predictable.
        secure_mode: Opacus's secure mode (sampling and noise from OS entropy; refuses ``seed``).
        overwrite: replace an earlier run in ``TrainingArguments.output_dir``.
        user_column: user-level privacy: the name of the ``datasets.Dataset`` column with each
            row's user (removed from the model's inputs), or an :class:`idpsgd.Users`; budgets are then
            per user (a budgets column must be constant within each user) and the expected batch size
            (``per_device_train_batch_size × gradient_accumulation_steps``) counts users.
        max_rows_per_user: k, the most rows of one user in one step (public; with ``user_column``).
        fsdp: shard the model with FSDP2 under ``torchrun``: each transformer block and
            the root are wrapped with ``fully_shard`` before ``make_private``; each rank runs its share of
            a step in exactly ``gradient_accumulation_steps`` passes (the same number on every rank: an
            empty part is the engine's phantom row); ``bk`` or ``ghost``; LoRA (a PEFT model: its frozen
            base sharded too) and user level (``bk``) are supported; no fp16 (refused with the reason);
            checkpoints are sharded folders (``private/checkpoint-<step>/``).
        pad_to_length: every batch padded to exactly this many tokens (a public length: no example's
            length moves another's computation, even in a model that pools over pads); rows must fit
            (refused otherwise).  Default None: each batch as long as its longest row, padded on the
            right (:mod:`.padding`).
    """

    budgets: Any
    delta: float | None = None
    method: str = "sample"
    accountant: str = "rdp"
    grad_sample_mode: str = "bk"
    seed: int | None = None
    secure_mode: bool = False
    overwrite: bool = False
    user_column: Any = None
    max_rows_per_user: int = 4
    fsdp: bool = False
    pad_to_length: int | None = None

    def __post_init__(self):
        if self.method not in IDP_METHODS:
            raise InvalidParameterError("method", self.method, f"must be one of {', '.join(IDP_METHODS)}")
        if self.accountant not in ACCOUNTANTS:
            raise InvalidParameterError("accountant", self.accountant, f"must be one of {', '.join(ACCOUNTANTS)}")
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise InvalidParameterError(
                "grad_sample_mode", self.grad_sample_mode, f"must be one of {', '.join(GRAD_SAMPLE_MODES)}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed):
            raise InvalidParameterError("seed", self.seed, "must be an integer or None")
        if self.fsdp is not False and self.fsdp is not True:
            raise InvalidParameterError("fsdp", self.fsdp, "must be True or False")
        n = self.pad_to_length
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InvalidParameterError("pad_to_length", n, "must be an integer >= 1 (tokens per batch) or None")


def _value(x):
    return getattr(x, "value", x)


#: TrainingArguments options the private run cannot honour: (name, test of the given value, why)
_REFUSED = (
    (
        "torch_compile",
        bool,
        "is not supported yet: torch.compile traces the forward into graphs that skip the module hooks "
        "through which the engine records each layer's input and output gradient (per-example norms and "
        "clipped sums); it needs per-example rules expressed as compilable operations, tested against "
        "the uncompiled ones",
    ),
    ("use_liger_kernel", bool, "Liger kernels replace the layers and the loss the engine clips"),
    (
        "auto_find_batch_size",
        bool,
        "the expected batch size is part of the privacy calibration (sampling rates, noise) and cannot change "
        "mid-run; and retrying after an out-of-memory error would make the number of attempts depend on the "
        "sampled batches. Set per_device_train_batch_size (the physical batch) to what fits: it changes no "
        "privacy parameter (gradient_accumulation_steps keeps the expected batch)",
    ),
    ("dataloader_drop_last", bool, "batches are Poisson samples with per-example rates (nothing to drop)"),
    ("push_to_hub", bool, "the run folder holds private files; publish its public model folder yourself"),
    (
        "load_best_model_at_end",
        bool,
        "choosing the final model among checkpoints by a metric is not supported: the checkpoints are "
        "private files the Trainer's best-model loader does not read, and the choice is covered by the "
        "guarantee only when the metric is on public held-out data; keep the last model",
    ),
    (
        "save_only_model",
        bool,
        "a checkpoint without the optimizer's and the privacy engine's state cannot be resumed (the private "
        "checkpoint always holds both)",
    ),
    (
        "neftune_noise_alpha",
        lambda v: v is not None,
        "NEFTune's embedding noise is not part of the privacy analysis; leave it unset",
    ),
    (
        "label_smoothing_factor",
        lambda v: v != 0,
        "the per-example loss is the plain cross-entropy (label smoothing is not implemented per example)",
    ),
    (
        "save_strategy",
        lambda v: _value(v) not in ("no", "steps", "epoch"),
        "must be 'no', 'steps' or 'epoch' (checkpoints are kept by age, save_total_limit; choosing them by "
        "a metric is not supported)",
    ),
    (
        "include_num_input_tokens_seen",
        lambda v: _value(v) not in ("no", False, None),
        "token counts of the private batches are not covered by the guarantee",
    ),
    ("train_sampling_strategy", lambda v: _value(v) != "random", "batches are Poisson samples with per-example rates"),
    (
        "deepspeed",
        bool,
        "DeepSpeed reduces autograd's summed gradients itself, past the per-example clipping and the noise; "
        "run several processes with torchrun instead (the engine's DPDDP: rank r clips its own examples, "
        "the noise is added once)",
    ),
    (
        "fsdp",
        bool,
        "FSDP shards and reduces autograd's summed gradients itself, past the per-example clipping and the "
        "noise; run several processes with torchrun instead: PrivacyArguments(fsdp=True) shards the model "
        "with FSDP2 under the engine's clipping and noise (or the engine's DPDDP without it)",
    ),
)


def check_training_arguments(args) -> None:
    """Refuse the ``TrainingArguments`` a private run cannot honour (one line: which, why)."""
    if args is None or not hasattr(args, "per_device_train_batch_size"):
        raise InvalidParameterError(
            "args",
            type(args).__name__,
            "give transformers.TrainingArguments(output_dir=RUN_FOLDER, save_strategy='no', ...)",
        )
    for name, refused, why in _REFUSED:
        if hasattr(args, name) and refused(getattr(args, name)):
            raise InvalidParameterError(name, _value(getattr(args, name)), why)
    if getattr(args, "n_gpu", 1) > 1:
        raise InvalidParameterError(
            "n_gpu",
            args.n_gpu,
            "one process driving several GPUs (torch.nn.DataParallel) is not supported: run one process per "
            "GPU with torchrun --nproc-per-node N (the engine's DPDDP), or CUDA_VISIBLE_DEVICES=0",
        )
    if not args.max_grad_norm > 0:
        raise InvalidParameterError(
            "max_grad_norm",
            args.max_grad_norm,
            "must be > 0: it is every example's clip norm (the reference clip norm c of Scale)",
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        v = getattr(args, name)
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise InvalidParameterError(name, v, "must be an integer >= 1")
    labels = args.label_names
    if labels is not None and len(labels) != 1:
        raise InvalidParameterError("label_names", labels, "the per-example loss takes one label field")
