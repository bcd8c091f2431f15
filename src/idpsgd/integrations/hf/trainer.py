"""``IndividualizedTrainer``: Hugging Face's ``transformers.Trainer`` with a privacy budget per example.

Individualized DP-SGD (Boenisch et al. 2023, IDP-SGD *Sample* / *Scale*, Alg. 1–3) on the Trainer
people fine-tune with (anchor: dp-transformers' ``OpacusDPTrainer``).  This module owns the mapping
of the Trainer's machinery onto :class:`~idpsgd.engine.IndividualizedPrivacyEngine`, which owns
everything private: the engine's Poisson sampler replaces the Trainer's loader, its clipping
optimizer wraps the Trainer's optimizer, one optimizer step is one DP-SGD step over a logical batch
processed in physical batches, each example's loss is its own (:mod:`.losses`), and only public
values reach the logs, ``TrainOutput`` and saved state (the rest goes to the run folder's private
part).  Checkpoints are :mod:`.checkpoints`'; options the analysis does not cover are refused
(:func:`~.arguments.check_training_arguments`).  Guarantee: data-independent individual
(ε_p, δ)-DP for every example of privacy group p (Boenisch et al. eq. 3).

User guide — what each ``TrainingArguments`` option becomes, logs, outputs, checkpoints,
``torchrun``, gradient checkpointing, fp16/bf16, refusals: ``docs/huggingface.md``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import secrets
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from ...assignment import Budgets
from ...engine import IndividualizedPrivacyEngine, distributed, steps_per_epoch_for
from ...engine.guards.batch_independence import declare_padding
from ...engine.per_example.unwrap import raw_module
from ...io import signature_differences
from ...runfolder import RunFolder
from ...validation import InvalidParameterError
from . import checkpoints as ckpts
from . import sharding
from .arguments import PrivacyArguments, check_training_arguments
from .losses import PerExampleLoss
from .padding import PublicPadding, check_lengths

#: ``resume_from_checkpoint`` as the Trainer's epoch loop sees it while a private checkpoint is resumed
_RESUMING = "<idpsgd private checkpoint>"

#: log keys that the guarantee covers (besides eval_*/test_* metrics on held-out data and epsilon*);
#: the throughput is recomputed from public values (:meth:`IndividualizedTrainer.public_speed`)
PUBLIC_LOG_KEYS = frozenset(
    {"learning_rate", "epoch", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
)


def is_public_key(key: str) -> bool:
    """Whether a logged or saved metric is covered by the guarantee: the keys of
    :data:`PUBLIC_LOG_KEYS`, metrics on held-out data (``eval_*``, ``test_*``) and ``epsilon*``."""
    return key in PUBLIC_LOG_KEYS or key.startswith(("eval_", "test_", "epsilon"))


def resolve_users(privacy: PrivacyArguments, dataset):
    """(training set without the user column, :class:`~idpsgd.users.Users` or None): user level."""
    from ...users import Users

    col = privacy.user_column
    if col is None or isinstance(col, Users):
        return dataset, col
    columns = getattr(dataset, "column_names", None)
    if not isinstance(col, str) or columns is None or col not in columns:
        raise InvalidParameterError(
            "user_column", col, f"must be a column of the datasets.Dataset train_dataset ({columns}) or an idpsgd.Users"
        )
    users = Users(np.asarray(dataset[col], dtype=object), privacy.max_rows_per_user)
    return dataset.remove_columns([col]), users  # private: never a model input, never collated


def resolve_budgets(privacy: PrivacyArguments, dataset, users=None):
    """(training set without the budget column, :class:`~idpsgd.assignment.Budgets`); with ``users``
    one budget per user (a per-row column read per user)."""
    b = privacy.budgets
    if isinstance(b, str):
        columns = getattr(dataset, "column_names", None)
        if columns is None:
            raise InvalidParameterError(
                "budgets",
                b,
                "a column name needs a datasets.Dataset; give an array of "
                "per-example epsilons (or an idpsgd.Budgets) for other datasets",
            )
        if b not in columns:
            raise InvalidParameterError(
                "budgets", b, f"is not a column of train_dataset (columns: {', '.join(columns)})"
            )
        try:
            values = np.asarray(dataset[b], dtype=float)
        except (TypeError, ValueError):
            raise InvalidParameterError("budgets", b, "the column must hold numbers (each example's epsilon)") from None
        dataset = dataset.remove_columns([b])  # private: never a model input, never collated
    else:
        values = b
    if isinstance(values, Budgets):
        if privacy.delta is not None and float(privacy.delta) != values.delta:
            raise InvalidParameterError("delta", privacy.delta, f"differs from budgets.delta={values.delta}")
        budgets = values
    else:
        if privacy.delta is None:
            raise InvalidParameterError("delta", None, "is required (the global delta of the budgets)")
        arr = np.asarray(values, dtype=float)
        if arr.ndim != 1:
            raise InvalidParameterError(
                "budgets", f"array of shape {arr.shape}", "must hold one epsilon per training example"
            )
        budgets = Budgets.from_array(arr, privacy.delta)
    try:
        n = len(dataset)
    except TypeError:
        raise InvalidParameterError(
            "train_dataset",
            type(dataset).__name__,
            "must be a map-style dataset with a length (Poisson sampling picks examples by index)",
        ) from None
    if users is not None:
        if users.num_rows != n:
            raise InvalidParameterError("user_column", repr(users), f"must give a user for each of the {n} rows")
        if len(budgets) == n and users.num_users != n:  # a per-row column: one budget per user
            budgets = users.budgets_from_rows(budgets.epsilons, budgets.delta)
        n = users.num_users
    if len(budgets) != n:
        what = "user" if users is not None else "training example"
        raise InvalidParameterError("budgets", f"{len(budgets)} values", f"need one per {what} ({n})")
    return dataset, budgets


def check_class_ids(loss, dataset, label_name: str, flag: str) -> None:
    """The integer labels of a single-label classifier's ``datasets.Dataset`` are class ids of the
    model's classes (0..num_labels-1, from its config: public; -100 is ignored), refused with the row
    and value otherwise — a label outside them is never a new class (the class set comes from public
    information only)."""
    import datasets

    if not isinstance(loss, PerExampleLoss) or loss.family == "token" or loss.num_labels < 2:
        return
    if loss.problem_type not in (None, "single_label_classification"):
        return
    if not isinstance(dataset, datasets.Dataset) or label_name not in dataset.column_names:
        return
    k = loss.num_labels
    values = dataset[label_name]
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return  # not class ids (float or list labels: regression or multi-label by their dtype)
    for row, value in enumerate(values):
        if not (0 <= value < k or value == -100):
            raise InvalidParameterError(
                flag,
                f"row {row}: {label_name} {value!r}",
                f"labels are the class ids 0..{k - 1} of the model's config (num_labels={k}, id2label); "
                "a label outside them is refused, never a new class: map the data to the model's "
                "classes, or build the model with the public class set",
            )


def public_padding(collator, model, privacy: PrivacyArguments, tokenizer) -> PublicPadding:
    """The Trainer's collator wrapped so that no example's length moves another's computation
    (:mod:`.padding`): padded on the right, ``pad_to_length`` tokens when asked."""
    if isinstance(collator, PublicPadding):
        return collator
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return PublicPadding(collator, pad_to_length=privacy.pad_to_length, pad_token_id=pad)


def privacy_seed(privacy: PrivacyArguments) -> int | None:
    """The engine's seed: the given one, or a fresh one from OS entropy (None in secure mode).

    Never the engine's default of following torch's global RNG: the Trainer seeds that generator
    with ``TrainingArguments.seed`` (public, 42 by default), so noise drawn from it could be
    replayed by anyone."""
    if privacy.secure_mode or privacy.seed is not None:
        return privacy.seed
    return secrets.randbits(63)


def batch_size_of(inputs) -> int:
    """Rows of a collated batch (the first dimension of its tensors)."""
    for v in inputs.values():
        if torch.is_tensor(v) and v.dim() >= 1:
            return int(v.shape[0])
    raise ValueError("the batch holds no tensor with a batch dimension")


def physical_batches(inputs, n: int, size: int) -> list:
    """The batch as consecutive parts of at most ``size`` rows (tensors with ``n`` rows are sliced)."""
    if n <= size:
        return [inputs]
    return [
        {
            k: v[s : s + size] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n else v
            for k, v in inputs.items()
        }
        for s in range(0, n, size)
    ]


def equal_parts(inputs, n: int, parts: int) -> list:
    """The batch as exactly ``parts`` consecutive parts whose sizes differ by at most one row (the first
    ones larger); an empty part is None (with fsdp: a phantom row, so that every rank runs the same passes)."""
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    out, start = [], 0
    for size in sizes:
        if size == 0:
            out.append(None)
        elif size == n:
            out.append(inputs)
        else:
            out.append(
                {
                    k: v[start : start + size] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n else v
                    for k, v in inputs.items()
                }
            )
        start += size
    return out


def epsilon_logs(engine: IndividualizedPrivacyEngine) -> dict:
    """``epsilon`` (the loosest group's ε, a bound for every example) and ``epsilon_group_<budget>``."""
    eps = engine.get_epsilon()
    out = {"epsilon": eps.loosest}
    out.update({f"epsilon_group_{b:g}": float(e) for b, e in zip(engine.group_budgets, eps.per_group, strict=True)})
    return out


def checkpointing_setup(args, inner, model, grad_sample_mode: str) -> bool:
    """Gradient (activation) checkpointing, asked for by ``TrainingArguments.gradient_checkpointing`` /
    ``activation_checkpointing`` or by ``model.gradient_checkpointing_enable()`` beforehand: the
    checkpointed blocks run with ``torch.utils.checkpoint``'s *reentrant* variant, whose first forward
    runs without gradients — the engine records nothing then — and whose recompute, inside the backward
    pass, is recorded once and consumed by that backward (per-example norms and clipped sums equal
    those without checkpointing).  The non-reentrant variant is refused: its first forward runs with
    gradients, so every layer's input would be recorded twice and the first copy held until the end of
    the backward pass.  ``functorch`` is refused: Opacus's torch.func replay of each layer cannot run
    inside the recompute.  Returns whether checkpointing is on."""
    on = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    flag = "activation_checkpointing" if getattr(args, "activation_checkpointing", False) else "gradient_checkpointing"
    flagged = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else None
    from_model = not on and bool(getattr(model, flagged or "is_gradient_checkpointing", False))
    if not (on or from_model):
        return False
    if grad_sample_mode == "functorch":
        raise InvalidParameterError(
            flag if on else "model",
            True if on else "gradient checkpointing enabled",
            "is not supported with grad_sample_mode='functorch' (Opacus's torch.func replay of each layer cannot "
            "run inside the checkpoint's recompute); use bk or hooks",
        )
    if grad_sample_mode == "ghost":
        raise InvalidParameterError(
            flag if on else "model",
            True if on else "gradient checkpointing enabled",
            "is not supported with grad_sample_mode='ghost': its second backward pass would run through the "
            "reentrant checkpoints again, whose recompute is consumed by the first (retain_graph does not keep "
            "it); use bk, which needs one backward pass",
        )
    raw = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)
    kwargs = dict(raw or {}) if not isinstance(raw, str) else {}
    if kwargs.get("use_reentrant") is False:
        raise InvalidParameterError(
            f"{flag}_kwargs",
            kwargs,
            "use_reentrant=False is not supported: its first forward runs with gradients, so the per-example "
            "machinery would record every layer's input twice (and hold the first copy through the backward "
            "pass); leave use_reentrant unset (the Trainer uses the reentrant variant)",
        )
    if kwargs.get("offload"):
        raise InvalidParameterError(
            f"{flag}_kwargs",
            kwargs,
            "offload=True (activations moved to the CPU) is not supported with per-example clipping",
        )
    kwargs["use_reentrant"] = True
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if hasattr(inner, name):
            setattr(inner, name, dict(kwargs))
    if from_model:  # enabled by the model's owner: again, with the reentrant variant
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": True})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if hasattr(model, "enable_input_require_grads"):  # reentrant blocks need an input that requires grad
        model.enable_input_require_grads()  # (frozen embeddings, LoRA): else their parameters get no gradient
    return True


def open_run_folder(path, overwrite: bool) -> RunFolder:
    """The run folder ``output_dir``: a new one, or (``overwrite``) a replaced one, or one that holds a
    run with private checkpoints (to be resumed: ``train(resume_from_checkpoint=...)``; training it
    afresh is refused in :meth:`IndividualizedTrainer.train`)."""
    try:
        return RunFolder(path, flag="output_dir", overwrite=overwrite)
    except InvalidParameterError:
        if overwrite or not ckpts.checkpoints_in(path):
            raise
        return RunFolder(path, flag="output_dir", resume=True)


class _OtherRanksFolder:
    """The run folder as ranks other than 0 see it: rank 0 alone checks and writes it."""

    created = False

    def __init__(self, path):
        from pathlib import Path

        self.path = Path(path)
        self.manifest: dict = {}

    def discard_if_unused(self) -> None:
        return None

    def __getattr__(self, name):
        raise RuntimeError(f"only rank 0 writes the run folder (RunFolder.{name} called on another rank)")


def _continue_where_saved(dataloader, num_batches=0):
    """Resuming in the middle of an epoch: the private loader's remaining batches of that epoch, drawn
    by its Poisson sampler from the saved state — nothing is drawn and discarded, and no batch beyond
    the epoch is drawn ahead (data-loader workers prefetch: a pass of the full epoch's length would
    draw the next epoch's first batches and shift them)."""
    remaining = len(dataloader) - int(num_batches)
    return DataLoader(
        dataloader.dataset,
        batch_sampler=_FirstBatches(dataloader.batch_sampler, remaining),
        collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        **(
            {"prefetch_factor": dataloader.prefetch_factor, "persistent_workers": False}
            if dataloader.num_workers > 0
            else {}
        ),
    )


class _FirstBatches:
    """The first ``n`` batches of a (lazy) batch sampler's pass."""

    def __init__(self, sampler, n: int):
        self.sampler, self.n = sampler, max(int(n), 0)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.n == 0:
            return
        for k, batch in enumerate(self.sampler, start=1):
            yield batch
            if k == self.n:
                return


class _PrivacyCallback(TrainerCallback):
    """After every DP-SGD step: the private ledger row, and a stop before a step the filter refuses."""

    def __init__(self, trainer: IndividualizedTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.after_private_step(state.global_step, state.max_steps):
            control.should_training_stop = True  # (how a Hugging Face callback stops the loop)
        return control


class IndividualizedTrainer(Trainer):
    """``transformers.Trainer`` for individualized DP-SGD (see the module docstring for what each
    Trainer option becomes).

    Args:
        model, args, train_dataset, **kwargs: as for ``transformers.Trainer`` (``eval_dataset``,
            ``data_collator``, ``processing_class``, ``callbacks``, ``optimizers``, ...;
            ``args.output_dir`` is the run folder).
        privacy: the budgets and the engine's options (:class:`~.arguments.PrivacyArguments`).
        per_example_loss: ``fn(outputs, labels) -> (B,)`` one loss per example; default: the model's
            task's (:class:`~.losses.PerExampleLoss`).
        dataset_name: the training data's name in the report (default: its class name).
        data_source: a public description of the data for the report (files, columns).
    """

    def __init__(
        self,
        model=None,
        args=None,
        train_dataset=None,
        *,
        privacy: PrivacyArguments,
        per_example_loss=None,
        dataset_name: str | None = None,
        data_source: dict | None = None,
        **kwargs,
    ):
        if not isinstance(privacy, PrivacyArguments):
            raise InvalidParameterError("privacy", type(privacy).__name__, "must be a PrivacyArguments")
        check_training_arguments(args)
        for name in ("model_init", "compute_loss_func"):
            if kwargs.get(name) is not None:
                why = (
                    "the model is wrapped for per-example gradients once"
                    if name == "model_init"
                    else "give per_example_loss=fn(outputs, labels) returning one loss per example"
                )
                raise InvalidParameterError(name, type(kwargs[name]).__name__, f"is not supported: {why}")
        if not isinstance(model, torch.nn.Module):
            raise InvalidParameterError("model", type(model).__name__, "must be a transformers model (nn.Module)")
        if train_dataset is None:
            raise InvalidParameterError("train_dataset", None, "is required: the examples the budgets belong to")
        if isinstance(train_dataset, torch.utils.data.IterableDataset):
            raise InvalidParameterError(
                "train_dataset",
                type(train_dataset).__name__,
                "must be map-style (Poisson sampling picks examples by index)",
            )
        if privacy.fsdp:  # sharded (FSDP2): what the sharded engine cannot honour is refused first
            sharding.check_fsdp(privacy, args, model, kwargs)
        train_dataset, self.users = resolve_users(privacy, train_dataset)
        train_dataset, self.budgets = resolve_budgets(privacy, train_dataset, self.users)
        self.privacy = privacy
        self.physical_batch_size = int(args.per_device_train_batch_size)
        self.world_size = max(int(getattr(args, "world_size", 1) or 1), 1)
        if self.users is not None:  # a user's rows are clipped as one unit: the logical batch is not split
            self.physical_batch_size = 2**62
        # fsdp: every rank runs exactly this many passes per step (FSDP2's all-gathers and reduce-scatters
        # need every rank in each pass, while the ranks' Poisson shares differ in size)
        self.passes_per_step = 1 if self.users is not None else int(args.gradient_accumulation_steps)
        self.expected_batch_size = int(
            args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size
        )
        if self.expected_batch_size > len(self.budgets):
            raise InvalidParameterError(
                "per_device_train_batch_size",
                args.per_device_train_batch_size,
                f"times gradient_accumulation_steps{' times the processes' if self.world_size > 1 else ''} "
                f"({self.expected_batch_size}) is the expected "
                f"batch size and must be <= the {len(self.budgets)} training examples",
            )
        if per_example_loss is not None and not callable(per_example_loss):
            raise InvalidParameterError(
                "per_example_loss",
                type(per_example_loss).__name__,
                "must be a function (outputs, labels) -> one loss per example",
            )
        self.per_example_loss = per_example_loss if per_example_loss is not None else PerExampleLoss.for_model(model)
        self.label_name = (args.label_names or ["labels"])[0]
        check_class_ids(self.per_example_loss, train_dataset, self.label_name, "train_dataset")
        check_class_ids(self.per_example_loss, kwargs.get("eval_dataset"), self.label_name, "eval_dataset")
        self.dataset_name = dataset_name or type(train_dataset).__name__
        self.data_source = data_source
        self.user_args = args
        inner = copy.copy(args)  # the Trainer's loop sees one batch per step (the engine splits it)
        inner.gradient_accumulation_steps = 1
        self.activation_checkpointing = checkpointing_setup(args, inner, model, privacy.grad_sample_mode)
        if getattr(args, "fp16", False) and args.device.type != "cuda":
            raise InvalidParameterError(
                "fp16",
                True,
                f"on {args.device.type}: accelerate runs neither float16 autocast nor a GradScaler there (the run "
                "would silently be float32); use bf16=True on the CPU, fp16 on a CUDA device",
            )
        if getattr(args, "fp16", False) and privacy.grad_sample_mode != "bk":
            raise InvalidParameterError(
                "fp16",
                True,
                f"needs grad_sample_mode='bk' (not {privacy.grad_sample_mode!r}): with Opacus's per-sample "
                "gradients the GradScaler checks the summed, un-clipped gradient for overflow and adapts its "
                "scale to it, so the scale would depend on the private data; use bk, or bf16=True",
            )
        self.engine = IndividualizedPrivacyEngine(
            accountant=privacy.accountant, secure_mode=privacy.secure_mode, seed=privacy_seed(privacy)
        )
        self._attach_journal(args)
        self.model_config_digest = ckpts.model_config_digest(model)  # before the Trainer aligns special tokens
        self.run_folder = (
            open_run_folder(args.output_dir, privacy.overwrite)
            if args.process_index == 0
            else _OtherRanksFolder(args.output_dir)
        )
        self._holds_checkpoints = (  # (every rank decides alike: with overwrite, rank 0 is clearing them)
            not privacy.overwrite and not self.run_folder.created and bool(ckpts.checkpoints_in(args.output_dir))
        )
        try:
            super().__init__(model=model, args=inner, train_dataset=train_dataset, **kwargs)
        except BaseException:
            self.run_folder.discard_if_unused()
            raise
        self.add_callback(_PrivacyCallback(self))
        # training batches: right padding, pad_to_length; evaluation (public data): the same
        # without the fixed length, so that held-out rows longer than it are evaluated, not refused
        self.train_collator = public_padding(self.data_collator, model, privacy, kwargs.get("processing_class"))
        self.data_collator = self.train_collator.without_length()
        check_lengths(self.train_dataset, privacy.pad_to_length)
        self.dp_optimizer = None
        self.planned_steps: int | None = None
        self.stopped_early = False
        self.last_batch_size = 0
        self.ledger_rows: list[list] = []  # private: step, real batch size, ε per group
        self.private_logs: list[dict] = []  # private: training losses and other uncovered values
        self.layer_paths: dict = {}  # public: the static rule per layer
        self.layer_paths_taken: dict = {}  # private: the paths taken (depend on the batches' shapes)
        self.private_flos = 0.0  # private: FLOPs of the real Poisson batches (state.total_flos stays 0)
        self.private_metrics: dict = {}  # private: train_loss, total_flos, ... of the last train()
        self.report: dict | None = None
        self._resume: dict | None = None  # the private checkpoint being resumed (train(resume_from_checkpoint))
        self._pending_sampler_states: collections.deque = collections.deque()  # drawn, not yet trained on
        self._data_digest: str | None = None
        self._engine_module = None  # the engine's wrapper of the model (make_private)
        self._dp_module = None  # the DPDDP wrapper of the model under torch.distributed (engine/distributed.py)
        self._resume_path = None  # the checkpoint being resumed (a sharded one is loaded after sharding)

    def _attach_journal(self, args) -> None:
        """Every noise draw of the run is recorded in ``private/drawn_steps.jsonl`` (rank 0) before it is
        drawn; a resume charges the draws its checkpoint does not cover (:mod:`idpsgd.engine.budget.journal`)."""
        from pathlib import Path

        from ...engine.budget.journal import JOURNAL

        self.engine.attach_journal(Path(args.output_dir) / ckpts.PRIVATE / JOURNAL, writer=args.process_index == 0)

    def _refuse_a_resume_past_the_budgets(self) -> None:
        """After a resume charged an earlier attempt's draws: if not one more step fits the budgets, the
        resume is refused, naming what was charged (nothing is trained or written; the run's outputs stand)."""
        acc = self.engine.accountant
        if not acc.extra or self.engine.can_step():
            return
        eps = np.round(self.engine.get_epsilon().per_group, 4).tolist()
        raise InvalidParameterError(
            "resume_from_checkpoint",
            str(self._resume_path),
            f"keeps {acc.steps} steps, but earlier attempts of this run drew {acc.released_steps + acc.pending_steps} "
            f"more steps after it ({'secure mode: fresh noise on every draw, and ' if self.engine.secure_mode else ''}"
            "their outputs may have left the process: logs, evaluations, checkpoints, the published model), which "
            f"are charged: {acc.charged_steps} steps charged spend the budgets {acc.values.tolist()} (epsilon per "
            f"group {eps}), so no further step fits; the run's outputs stand. Resume from the latest checkpoint "
            "(resume_from_checkpoint=True), or start a new run",
        )

    # --- the private step ---------------------------------------------------------------------
    def get_train_dataloader(self):
        """The engine's private loader (Poisson batches of expected size B), set up with the
        optimizer and the calibration on first use."""
        if self.dp_optimizer is not None:
            raise RuntimeError(
                "an IndividualizedTrainer trains once (its budgets are spent by that run); "
                "create a new one for a new run"
            )
        import datasets

        ds, collate = self.train_dataset, self.train_collator
        if isinstance(ds, datasets.Dataset):
            ds = self._remove_unused_columns(ds, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        a = self.args
        extra = (
            {"prefetch_factor": a.dataloader_prefetch_factor, "persistent_workers": a.dataloader_persistent_workers}
            if a.dataloader_num_workers > 0
            else {}
        )
        loader = DataLoader(
            ds,
            batch_size=self.expected_batch_size,
            collate_fn=collate,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory,
            **extra,
        )
        n = len(ds) if self.users is None else self.users.num_users
        rate = self.expected_batch_size / n
        planned = self.planned_steps_for(steps_per_epoch_for(rate))
        # the engine's check is told how every batch is padded (the collator guarantees it: .padding)
        declare_padding(raw_module(self.model), self.data_collator.side, self.privacy.pad_to_length)
        if self.privacy.fsdp:  # each block and the root sharded before the optimizer sees the parameters
            sharding.shard_model(self.model, self.args.device)
        self.create_optimizer()
        self.model.train()  # from_pretrained returns a model in eval mode
        module = self.model
        if self.privacy.fsdp:
            if self._resume is not None:  # the shards of model and optimizer, the RNG states
                sharding.load(self, self._resume_path)
        elif distributed.is_distributed():  # each rank samples its share (rank_balance); noise once, on rank 0
            module = self._dp_module = distributed.wrap_model(self.model)
        made = self.engine.make_private(
            module=module,
            optimizer=self.optimizer,
            data_loader=loader,
            budgets=self.budgets,
            method=self.privacy.method,
            steps=planned,
            max_grad_norm=a.max_grad_norm,
            sample_rate=rate,
            grad_sample_mode=self.privacy.grad_sample_mode,
            loss_reduction="mean",
            users=self.users,
        )
        # (ghost: (module, optimizer, criterion, loader); the Trainer wraps its own per-example losses)
        wrapped, self.dp_optimizer, private = made[0], made[1], made[-1]
        self.optimizer = self.dp_optimizer
        self._engine_module = wrapped  # (ghost: its clip factors between the two backward passes)
        if self.privacy.fsdp:  # the engine's wrapper runs the steps (never accelerate's DDP around the model)
            self._dp_module = wrapped
            self.dp_optimizer.declare_equal_passes()  # every rank: passes_per_step passes per step (training_step)
        self.planned_steps = planned
        self._record_sampler_states(private)
        if self._resume is not None:  # accountant history, filter, sampler and noise generators; earlier draws
            self.engine.load_state_dict(self._resume["engine"])
            self._refuse_a_resume_past_the_budgets()
        return private

    def _record_sampler_states(self, loader) -> None:
        """Keep the Poisson sampler's generator state before each draw until that batch is trained on:
        a checkpoint saves the state before the first batch not yet trained on, so batches that
        data-loader workers drew ahead are drawn again (and identically) by the resumed run."""
        sampler = getattr(loader, "poisson_sampler", None)
        bit_generator = getattr(getattr(sampler, "rng", None), "bit_generator", None)
        if bit_generator is None:  # secure mode: no state to save
            return
        pending = self._pending_sampler_states
        sampler.before_each_draw(lambda: pending.append(copy.deepcopy(bit_generator.state)))

    def _wrap_model(self, model, training=True, dataloader=None):
        """Under ``torch.distributed`` the engine's ``DPDDP`` wrapper (its optimizer all-reduces the
        clipped, noised sums once per step); never accelerate's ``DistributedDataParallel``, whose
        all-reduce of autograd's gradients would bypass the per-example clipping.  Evaluation runs
        the plain model."""
        if self._dp_module is None:
            return super()._wrap_model(model, training, dataloader)
        if training:
            if self._dp_module not in self.accelerator._models:
                self.accelerator._models.append(self._dp_module)  # accelerate wraps no other copy for eval
            return self._dp_module
        return self.model

    def report_eval_dataloader(self):
        """The whole ``eval_dataset`` in order, unsharded (the report's test metrics, computed by rank 0
        alone under torch.distributed; one process: the same batches as the Trainer's eval loader)."""
        import datasets

        ds, collate = self.eval_dataset, self.data_collator
        if isinstance(ds, datasets.Dataset):
            ds = self._remove_unused_columns(ds, description="evaluation")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="evaluation")
        return DataLoader(ds, batch_size=self.args.per_device_eval_batch_size, collate_fn=collate, shuffle=False)

    def after_private_step(self, step: int, max_steps: int) -> bool:
        """After every DP-SGD step (:class:`_PrivacyCallback`): the private ledger row; True (and
        ``stopped_early``) when the filter refuses a step before ``max_steps``."""
        self.ledger_rows.append([step, self.real_batch_size(), *self.engine.accountant.grid_epsilon()])
        if step < max_steps and not self.engine.can_step():
            self.stopped_early = True
            return True
        return False

    def real_batch_size(self) -> int:
        """The last step's real (Poisson) batch size over all processes, in rows as in one process (private:
        the ledger's).  Every rank calls it (at user level on several ranks: one all-reduce of the rows, as
        the optimizer counts the drawn users)."""
        global_size = getattr(self.dp_optimizer, "last_global_batch_size", None)
        if self._dp_module is None or global_size is None:
            return self.last_batch_size
        return distributed.sum_over_ranks(self.last_batch_size) if self.users is not None else int(global_size)

    def planned_steps_for(self, per_epoch: int) -> int:
        """The steps the budgets are calibrated for: ``max_steps``, or ``num_train_epochs`` passes of
        ``per_epoch`` steps (rounded up, as the Trainer counts them)."""
        a = self.args
        planned = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * per_epoch)
        if planned < 1:
            raise InvalidParameterError("num_train_epochs", a.num_train_epochs, "plans no step")
        return planned

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One logical batch: its physical parts' clipped gradients accumulate in the engine's
        optimizer (the Trainer then takes the noisy step); an empty batch runs no forward pass."""
        opt = self.dp_optimizer
        model.train()
        inputs = self._prepare_inputs(inputs)
        n = batch_size_of(inputs)
        self.last_batch_size = n
        if self._pending_sampler_states:
            self._pending_sampler_states.popleft()  # this batch is trained on
        opt.zero_grad(set_to_none=True)
        if self.privacy.fsdp:  # the same passes on every rank: the rank's share in passes_per_step parts
            parts = equal_parts(inputs, n, self.passes_per_step)
        elif n == 0:  # the step is noise only (engine: no backward pass needed)
            return torch.zeros((), device=self.args.device)
        else:
            parts = physical_batches(inputs, n, self.physical_batch_size)
        total = torch.zeros((), device=self.args.device)
        for k, part in enumerate(parts):
            if part is None:  # an empty part (fsdp): the engine's phantom row, to which the optimizer gives no weight
                from ...engine.distributed.fsdp import mark_phantom_pass

                mark_phantom_pass(opt.clipping)
                self._backward(model, sharding.phantom(inputs))
            else:
                total = total + self._backward(model, part) * batch_size_of(part)
            if k < len(parts) - 1:  # clip and keep this part's gradients, no step yet
                opt.signal_skip_step(do_skip=True)
                self._clip_part(opt)
                opt.zero_grad(set_to_none=True)
        return total / max(n, 1)

    def _backward(self, model, part) -> torch.Tensor:
        """One physical batch's forward and backward pass(es); returns its mean loss (detached).  Ghost
        clipping runs its two backward passes through Opacus's ``DPTensorFastGradientClipping`` on the
        per-example losses (the first gives the norms, the second the clipped sum)."""
        if self.privacy.grad_sample_mode == "ghost":
            from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

            with self.compute_loss_context_manager():
                losses = self.per_example_losses(model, part)
            DPTensorFastGradientClipping(self._engine_module, self.dp_optimizer, losses, "mean").backward()
            return losses.detach().mean()
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, part)
        self.accelerator.backward(loss)
        return loss.detach()

    def _clip_part(self, opt) -> None:
        """Clip and accumulate one physical batch (no step).  With fp16's GradScaler the part's loss was
        scaled: the scale is handed to the private optimizer as ``GradScaler.step`` hands it over at the
        step (the amp-scaling protocol), so it divides the scale out of each example's gradient before
        clipping; the scale itself changes only with the step count (the scaler never sees a private
        gradient), and an example whose gradient overflowed is clipped to zero."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            opt.step()
            return
        opt.grad_scale = scaler._get_scale_async()
        opt.found_inf = torch.zeros((), device=opt.grad_scale.device)
        try:
            opt.step()
        finally:
            opt.__dict__.pop("grad_scale", None)
            opt.__dict__.pop("found_inf", None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training: the mean over the examples of each example's own loss (:mod:`.losses`);
        evaluation: the model's own loss (as the Trainer computes it)."""
        if not model.training:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        loss = self.per_example_losses(model, inputs, return_outputs=return_outputs)
        return (loss[0].mean(), loss[1]) if return_outputs else loss.mean()

    def per_example_losses(self, model, inputs, return_outputs=False):
        """Training: one loss per example (:mod:`.losses`), shape (B,) (with ``return_outputs``: and the
        model's outputs)."""
        if self.label_name not in inputs:
            raise ValueError(
                f"the training batch has no {self.label_name!r} (its keys: {', '.join(inputs)}); the "
                "per-example loss needs labels (e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False) "
                "for a causal LM)"
            )
        inputs = dict(inputs)
        labels = inputs.pop(self.label_name)
        outputs = model(**inputs)
        losses = self.per_example_loss(outputs, labels)
        if not torch.is_tensor(losses) or losses.shape != (labels.shape[0],):
            raise ValueError(
                f"per_example_loss must return one loss per example, shape ({labels.shape[0]},); got "
                f"{tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__}"
            )
        return (losses, outputs) if return_outputs else losses

    def floating_point_ops(self, inputs) -> int:
        """0: the FLOPs of a real Poisson batch are a function of its size (private); they are counted
        in :attr:`private_flos`, never in ``state.total_flos`` (saved by ``save_state``)."""
        real = super().floating_point_ops(inputs)
        if isinstance(real, (int, float)):
            self.private_flos += float(real)
        return 0

    def _clip_grad_norm(self, model):  # each example is clipped by the engine; no clipping of the sum
        return None

    def _get_grad_norm(self, model, grad_norm=None):  # the un-noised gradient's norm is not logged
        return None

    # --- logs -------------------------------------------------------------------------------------
    def split_metrics(self, metrics: dict) -> tuple[dict, dict]:
        """(public, private) parts of a metrics dict: public are the keys :func:`is_public_key`
        admits, with the throughput recomputed from public values (:meth:`public_speed`)."""
        public = {k: v for k, v in metrics.items() if is_public_key(k)}
        private = {k: v for k, v in metrics.items() if k not in public}
        return self.public_speed(public), private

    def public_speed(self, metrics: dict) -> dict:
        """``train_samples_per_second`` and ``train_steps_per_second`` from public values only: the
        expected batch size, the logical steps taken and ``train_runtime``."""
        runtime = metrics.get("train_runtime")
        if runtime is None:
            return metrics
        out = {k: v for k, v in metrics.items() if k not in ("train_samples_per_second", "train_steps_per_second")}
        steps = self.state.global_step - getattr(self, "_initial_global_step", 0)
        if runtime > 0:
            out["train_samples_per_second"] = round(self.expected_batch_size * steps / runtime, 3)
            out["train_steps_per_second"] = round(steps / runtime, 3)
        return out

    def log(self, logs: dict, start_time=None) -> None:
        """ε per group joins the logs; values the guarantee does not cover go to the private log."""
        public, private = self.split_metrics(logs)
        if private:
            self.private_logs.append({"step": self.state.global_step, **private})
        if self.engine.accountant is not None:
            public.update(epsilon_logs(self.engine))
        super().log(public, start_time)

    def save_state(self) -> None:
        """``trainer_state.json`` in the run folder (public: the state holds the public log history,
        ``total_flos`` 0 and the step counts; nothing of the real batches)."""
        if not self.is_world_process_zero():
            return
        state = dataclasses.asdict(self.state)
        if state.get("total_flos") or state.get("num_input_tokens_seen"):  # never: floating_point_ops is 0
            raise RuntimeError("the Trainer state holds counts of the real batches; it is not saved")
        self.run_folder.write_json(
            "trainer_state.json",
            state,
            "public",
            "the Hugging Face Trainer's state: step counts and the public log history (epsilon per group)",
        )

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """``<split>_results.json`` (and ``all_results.json`` with ``combined``) with the public keys
        of ``metrics``; any other key (``train_loss``, memory figures, ...) goes to
        ``private/<split>_results.json`` (mode 0600)."""
        import json

        if not self.is_world_process_zero():
            return
        public, private = self.split_metrics(dict(metrics))
        rf = self.run_folder
        rf.write_json(f"{split}_results.json", public, "public", f"public {split} metrics (Trainer.save_metrics)")
        if combined:
            path = rf.path / "all_results.json"
            merged = json.loads(path.read_text()) if path.is_file() else {}
            merged.update(public)
            rf.write_json("all_results.json", merged, "public", "public metrics of every split (Trainer.save_metrics)")
        if private:
            rf.write_json(
                f"{split}_results.json",
                private,
                "private",
                f"{split} metrics the guarantee does not cover (training loss on the private batches and the like)",
            )

    # --- the run --------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """Train with the budgets, then write the run folder (:meth:`save_run`); returns the Trainer's
        ``TrainOutput`` with public values only: ``training_loss`` is None and ``metrics`` holds
        ``train_runtime`` and the public throughput (the real training loss and FLOPs, private, are
        in :attr:`private_metrics`).

        ``resume_from_checkpoint``: ``True`` (the latest private checkpoint of ``output_dir``) or the
        path of one (:mod:`.checkpoints`): the run continues exactly where it was saved — the same
        batches and noise, every step charged once — after its configuration, budgets and data are
        checked against the checkpoint's."""
        if trial is not None:
            raise InvalidParameterError(
                "trial",
                type(trial).__name__,
                "hyper-parameter search spends the budgets once per trial; it is not supported",
            )
        try:
            if resume_from_checkpoint not in (None, False):
                self._start_resume(resume_from_checkpoint)
            elif self._holds_checkpoints:
                raise InvalidParameterError(
                    "output_dir",
                    str(self.run_folder.path),
                    "holds a run with checkpoints: train(resume_from_checkpoint=True) (finetune --resume) "
                    "continues it, PrivacyArguments(overwrite=True) (--overwrite) replaces it; or use a new folder",
                )
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*Full backward hook.*")
                warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
                out = super().train(**kwargs)
            out = self._public_output(out)
            if self.privacy.fsdp:  # every rank gives its shards; rank 0's model becomes the whole, plain one
                full = sharding.full_state(self.model)
                if self.is_world_process_zero():
                    self.model = sharding.plain_copy(self.model, full)
            if self.is_world_process_zero():  # rank 0 writes the run folder
                self.save_run()
        except BaseException:
            self.run_folder.discard_if_unused()
            raise
        finally:
            self._resume = None
            self._release_model()
        return out

    # --- checkpoints and resume (private: :mod:`.checkpoints`) ------------------------------------
    def data_digest(self) -> str:
        """SHA-256 of the training data (private; a checkpoint of other data is refused)."""
        if self._data_digest is None:
            self._data_digest = ckpts.data_digest(self.train_dataset)
        return self._data_digest

    def _save_checkpoint(self, model, trial) -> None:
        """``private/checkpoint-<step>.pt`` (mode 0600, atomic), then the oldest ones beyond
        ``save_total_limit`` are removed.  Nothing is written to the public part of the run folder."""
        if self.dp_optimizer is None:
            return
        if self._dp_module is not None:  # every rank holds the same ledger (the state rank 0 saves)
            distributed.check_replicated(
                "privacy ledger", [self.state.global_step, self.engine.steps, *self.engine.accountant.grid_epsilon()]
            )
        if not self.is_world_process_zero() and not self.privacy.fsdp:
            return
        step = int(self.state.global_step)
        engine = self.engine.state_dict()
        if not self.engine.secure_mode and self._pending_sampler_states:
            engine["sampler"] = {"bit_generator": self._pending_sampler_states[0]}
        s = self.state
        state = {
            "format": ckpts.FORMAT,
            "signature": ckpts.signature(self),
            "trainer_state": {
                "global_step": s.global_step,
                "epoch": s.epoch,
                "log_history": [dict(h) for h in s.log_history],
                "best_metric": s.best_metric,
                "best_global_step": s.best_global_step,
            },
            "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "engine": engine,
            "rng": ckpts.rng_state(),
            "ledger_rows": self.ledger_rows,
            "private_logs": self.private_logs,
            "private_flos": self.private_flos,
            "stopped_early": self.stopped_early,
        }
        limit = self.user_args.save_total_limit
        if self.privacy.fsdp:  # every rank: its shards and its state (sharding.py); the config for export
            state["model_config"] = raw_module(self.model).config.to_dict()
            state.update(sharding.peft_layout(self.model))
            sharding.save(self, self.run_folder.path / ckpts.PRIVATE, step, state, limit or None)
            return
        state.update(model=raw_module(self.model).state_dict(), optimizer=self.dp_optimizer.state_dict())
        self.run_folder.save_torch(
            ckpts.checkpoint_name(step),
            state,
            "private",
            "checkpoint: model, optimizer, schedule, privacy engine (accountant, filter, sampler and noise "
            "states, seed), RNG states, private logs; train(resume_from_checkpoint=True) continues it",
        )
        if limit:
            for _, path in ckpts.checkpoints_in(self.run_folder.path)[:-limit]:
                self.run_folder.remove(path.name, "private")

    def _start_resume(self, resume_from_checkpoint) -> None:
        """Load a private checkpoint (refused if another configuration, budget set or data set wrote
        it); the model's state now, the engine's when :meth:`get_train_dataloader` sets it up."""
        if self.dp_optimizer is not None:
            raise RuntimeError("an IndividualizedTrainer trains once; create a new one to resume a run")
        path = ckpts.find_checkpoint(self.run_folder.path, resume_from_checkpoint)
        if sharding.is_sharded_checkpoint(path) != bool(self.privacy.fsdp):
            raise InvalidParameterError(
                "resume_from_checkpoint",
                str(path),
                f"was written by a run {'with' if not self.privacy.fsdp else 'without'} fsdp: resume it "
                f"{'with' if not self.privacy.fsdp else 'without'} fsdp (--fsdp), as it was written",
            )
        state = sharding.read_rank_state(path) if self.privacy.fsdp else ckpts.read_checkpoint(path)
        differences = signature_differences(state["signature"], ckpts.signature(self))
        if differences:
            raise InvalidParameterError(
                "resume_from_checkpoint",
                str(path),
                "was written by a run with other settings or data (" + "; ".join(differences[:4]) + "): resume "
                "with the same training data, budgets and arguments, or start a new run",
            )
        saved_seed = state["engine"].get("seed")
        if self.privacy.secure_mode:
            warnings.warn(
                "secure mode: the resumed run draws fresh OS entropy for Poisson sampling and noise (no "
                "generator state is saved), so it is not bit-equal to an uninterrupted run; the accounting "
                "continues from the checkpoint's steps, and the steps earlier attempts drew after it are charged "
                "too (private/drawn_steps.jsonl)",
                UserWarning,
                stacklevel=3,
            )
        elif self.privacy.seed is not None and self.privacy.seed != saved_seed:
            raise InvalidParameterError(
                "seed",
                "(not shown: private)",
                "differs from the seed of the run that wrote the checkpoint: give the run's seed, or seed=None "
                "(the checkpoint's seed is then used)",
            )
        else:  # continue with the checkpoint's seed (a fresh one was drawn for this trainer)
            with warnings.catch_warnings():  # the trainer's own engine said "Secure RNG turned off" already
                warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
                self.engine = IndividualizedPrivacyEngine(
                    accountant=self.privacy.accountant, secure_mode=False, seed=saved_seed
                )
            self._attach_journal(self.user_args)
        if "model" in state:  # a sharded checkpoint's shards load after sharding (get_train_dataloader)
            raw_module(self.model).load_state_dict(state["model"])
        self._resume_path = path
        self.ledger_rows = [list(r) for r in state["ledger_rows"]]
        self.private_logs = [dict(h) for h in state["private_logs"]]
        self.private_flos = float(state["private_flos"])
        self.stopped_early = bool(state["stopped_early"])
        self._resume = state

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        """The Trainer's state, from the private checkpoint when resuming (step, epoch, public log)."""
        out = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        if self._resume is None:
            return out
        for key, value in self._resume["trainer_state"].items():
            setattr(self.state, key, value)
        step = int(self.state.global_step)
        return step // num_update_steps_per_epoch, step % num_update_steps_per_epoch

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, loader = super()._prepare_for_training(max_steps, train_dataloader, None)
        if self._resume is not None:
            sharded = "optimizer" not in self._resume  # (sharded: loaded with the shards, before the schedule)
            if not sharded:
                self.dp_optimizer.load_state_dict(self._resume["optimizer"])
            if self._resume.get("scheduler") is not None:
                self.lr_scheduler.load_state_dict(self._resume["scheduler"])
                if sharded:  # creating the schedule reset the learning rate the optimizer's state held
                    for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
                        group["lr"] = lr
        return model, loader

    def _run_epoch(self, **kwargs):
        """The Trainer's epoch; when resuming, its first epoch continues after the steps already taken:
        the Poisson sampler continues from its saved state (the Trainer's own fast-forward, which would
        draw and discard batches, is replaced by nothing) and the RNG states are the checkpoint's."""
        if self._resume is None:
            return super()._run_epoch(**kwargs)
        import transformers.trainer as hf_trainer

        kwargs["resume_from_checkpoint"] = _RESUMING
        skip = hf_trainer.skip_first_batches
        hf_trainer.skip_first_batches = _continue_where_saved
        try:
            return super()._run_epoch(**kwargs)
        finally:
            hf_trainer.skip_first_batches = skip

    def _load_rng_state(self, checkpoint) -> None:
        if checkpoint == _RESUMING:
            if self._resume is not None:
                ckpts.set_rng_state(self._resume["rng"])
            return
        super()._load_rng_state(checkpoint)

    def _public_output(self, out):
        """The ``TrainOutput`` with its private values (training loss, FLOPs of the real batches,
        memory figures) moved to :attr:`private_metrics` and the private log."""
        from transformers.trainer_utils import TrainOutput

        public, private = self.split_metrics(dict(out.metrics))
        private.update(train_loss=out.training_loss, total_flos=self.private_flos)
        self.private_metrics = private
        self.private_logs.append({"step": self.state.global_step, **private})
        return TrainOutput(out.global_step, None, public)

    def _release_model(self) -> None:
        """Detach the engine's per-example machinery: the model is a plain model again."""
        module = self.engine.module
        if module is not None:
            if self.engine.accountant is not None and not self.layer_paths:
                self.layer_paths, self.layer_paths_taken = self.engine.layer_paths, self.engine.layer_paths_taken
            module.remove_hooks()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``save_pretrained`` of the model (and tokenizer) into ``output_dir``; by default into the run
        folder's public ``model/``."""
        if output_dir is not None:
            return super().save_model(output_dir, _internal_call)
        if not self.is_world_process_zero():
            return None
        from .outputs import save_model_folder

        save_model_folder(self)

    def save_run(self) -> dict:
        """Write the run folder: public model/, report.json, report.html; private/ per-example budgets
        and ε, ledger, private logs, the privacy seed.  Returns the report (with its private part)."""
        from .outputs import write_run

        self.layer_paths, self.layer_paths_taken = self.engine.layer_paths, self.engine.layer_paths_taken
        self.report = write_run(self)
        return self.report
