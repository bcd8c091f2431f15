"""``IndividualizedTrainer``: Hugging Face's ``transformers.Trainer`` with a privacy budget per example.

Individualized DP-SGD (Boenisch et al. 2023, IDP-SGD *Sample* / *Scale*, Alg. 1–3) on the
Trainer people fine-tune with; anchor: dp-transformers' ``OpacusDPTrainer`` (Microsoft), here on
:class:`~idpsgd.engine.IndividualizedPrivacyEngine`, which owns everything private::

    trainer = IndividualizedTrainer(
        model=model, args=TrainingArguments(output_dir="runs/ft", save_strategy="no", ...),
        train_dataset=train,                      # a datasets.Dataset with a column "epsilon"
        eval_dataset=test, processing_class=tokenizer, data_collator=collator,
        privacy=PrivacyArguments(budgets="epsilon", delta=1e-5, method="scale"))
    trainer.train()      # logs epsilon per group; writes the run folder runs/ft

What the Trainer's machinery becomes:

* **data** — the Trainer's own sampler and ``accelerate`` loader are not used: the engine's Poisson
  sampler draws every batch with the examples' own rates (a ``DataLoader`` over the training set,
  with the Trainer's collator and worker options, wrapped by ``make_private``); an empty batch is a
  noise-only step (the model never sees zero rows);
* **optimizer** — the one ``TrainingArguments`` describes (``optim``, ``learning_rate``,
  ``weight_decay``, ...), wrapped by the engine's clipping optimizer; the ``lr_scheduler_type``
  schedule acts on its learning rate as usual;
* **batch size** — ``per_device_train_batch_size × gradient_accumulation_steps`` is the *expected*
  logical batch size B (mean sampling rate B/n); a Poisson batch is processed in physical batches
  of at most ``per_device_train_batch_size`` examples (their clipped gradients accumulate) and one
  optimizer step is taken per logical batch, so ``global_step`` counts DP-SGD steps;
* **length** — ``num_train_epochs`` (fractions allowed) or ``max_steps``: the planned steps the
  budgets are calibrated for; the privacy filter refuses any step beyond the budgets and the run
  stops (``stopped_early``) if one would exceed them;
* **clipping** — ``max_grad_norm`` is every example's clip norm (the reference c of Scale); the
  Trainer's own clipping of the summed gradient and its ``grad_norm`` log (a norm of the un-noised
  gradient) are switched off;
* **loss** — the mean over the batch's examples of each example's own loss (:mod:`.losses`): for
  language models ℓ_i is the mean over example i's tokens, not the Hugging Face mean over all the
  batch's tokens, whose per-example gradients depend on the other examples' lengths;
* **logs** — ``epsilon`` (the loosest group's ε) and ``epsilon_group_<budget>`` join every log;
  values that are not covered by the guarantee (training loss, token counts, FLOPs of the real
  batches) are kept out of the logs and go to the run folder's private part;
* **what the Trainer exposes and saves** — only public values: ``state.total_flos`` stays 0 (the
  FLOPs of the real Poisson batches are private: ``private_metrics["total_flos"]``), the
  ``TrainOutput`` of ``train()`` has ``training_loss=None`` and ``metrics`` with ``train_runtime``
  and the throughput computed from public values (``train_samples_per_second`` = expected batch size
  × steps taken / runtime, ``train_steps_per_second``); the real training loss and FLOPs are in
  ``trainer.private_metrics`` and the run folder's ``private/history.json``.  ``save_state()``
  writes the (public) state to ``trainer_state.json``, ``save_metrics(split, metrics)`` writes the
  public keys to ``<split>_results.json`` and any other key to ``private/<split>_results.json``
  (mode 0600), both through the run folder's manifest;
* **seed** — ``TrainingArguments.seed`` seeds the model as usual; the privacy randomness has its own
  seed (:class:`~.arguments.PrivacyArguments`), private;
* **outputs** — ``output_dir`` is a :class:`~idpsgd.runfolder.RunFolder`: at the end of ``train()``
  the public ``model/`` (``save_pretrained`` of the model and tokenizer), ``report.json`` and
  ``report.html`` (guarantee per group, test metrics on ``eval_dataset``), and private/ (mode 0600:
  per-example budgets and ε, the privacy seed, training losses, real batch sizes).

``bf16=True`` runs the forward under bfloat16 autocast (accelerate's); the engine keeps
per-example norms and clipped sums in float32 and the per-example loss is computed in float32.

Refused, with the reason (:func:`~.arguments.check_training_arguments`): ``fp16`` (its GradScaler
path through the physical batches), gradient checkpointing, compilation, intermediate checkpoints
and resuming from them, multi-device training, ``auto_find_batch_size``, label smoothing, NEFTune,
``model_init`` and ``compute_loss_func`` (give ``per_example_loss`` instead).

Guarantee: data-independent individual (ε_p, δ)-DP for every example of privacy group p (Boenisch
et al. eq. 3), ε_p from the run's accountant.
"""

from __future__ import annotations

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
from ...engine import IndividualizedPrivacyEngine, steps_per_epoch_for
from ...runfolder import RunFolder
from ...validation import InvalidParameterError
from .arguments import PrivacyArguments, check_training_arguments
from .losses import PerExampleLoss

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


def epsilon_logs(engine: IndividualizedPrivacyEngine) -> dict:
    """``epsilon`` (the loosest group's ε, a bound for every example) and ``epsilon_group_<budget>``."""
    eps = engine.get_epsilon()
    out = {"epsilon": eps.loosest}
    out.update({f"epsilon_group_{b:g}": float(e) for b, e in zip(engine.group_budgets, eps.per_group, strict=True)})
    return out


class _PrivacyCallback(TrainerCallback):
    """After every DP-SGD step: the private ledger row, and a stop before a step the filter refuses."""

    def __init__(self, trainer: IndividualizedTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        t.ledger_rows.append([state.global_step, t.last_batch_size, *t.engine.accountant.grid_epsilon()])
        if state.global_step < state.max_steps and not t.engine.can_step():
            t.stopped_early = True
            control.should_training_stop = True
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
        train_dataset, self.users = resolve_users(privacy, train_dataset)
        train_dataset, self.budgets = resolve_budgets(privacy, train_dataset, self.users)
        self.privacy = privacy
        self.physical_batch_size = int(args.per_device_train_batch_size)
        if self.users is not None:  # a user's rows are clipped as one unit: the logical batch is not split
            self.physical_batch_size = 2**62
        self.expected_batch_size = int(args.per_device_train_batch_size * args.gradient_accumulation_steps)
        if self.expected_batch_size > len(self.budgets):
            raise InvalidParameterError(
                "per_device_train_batch_size",
                args.per_device_train_batch_size,
                f"times gradient_accumulation_steps ({self.expected_batch_size}) is the expected "
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
        self.engine = IndividualizedPrivacyEngine(
            accountant=privacy.accountant, secure_mode=privacy.secure_mode, seed=privacy_seed(privacy)
        )
        self.run_folder = RunFolder(args.output_dir, flag="output_dir", overwrite=privacy.overwrite)
        try:
            super().__init__(model=model, args=inner, train_dataset=train_dataset, **kwargs)
        except BaseException:
            self.run_folder.discard_if_unused()
            raise
        self.add_callback(_PrivacyCallback(self))
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

        ds, collate = self.train_dataset, self.data_collator
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
        self.create_optimizer()
        self.model.train()  # from_pretrained returns a model in eval mode
        _, self.dp_optimizer, private = self.engine.make_private(
            module=self.model,
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
        self.optimizer = self.dp_optimizer
        self.planned_steps = planned
        return private

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
        opt.zero_grad(set_to_none=True)
        if n == 0:  # the step is noise only (engine: no backward pass needed)
            return torch.zeros((), device=self.args.device)
        parts = physical_batches(inputs, n, self.physical_batch_size)
        total = torch.zeros((), device=self.args.device)
        for k, part in enumerate(parts):
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, part)
            self.accelerator.backward(loss)
            total = total + loss.detach() * batch_size_of(part)
            if k < len(parts) - 1:  # clip and keep this part's gradients, no step yet
                opt.signal_skip_step(do_skip=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        return total / n

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training: the mean over the examples of each example's own loss (:mod:`.losses`);
        evaluation: the model's own loss (as the Trainer computes it)."""
        if not model.training:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
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
        loss = losses.mean()
        return (loss, outputs) if return_outputs else loss

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
        in :attr:`private_metrics`)."""
        if resume_from_checkpoint not in (None, False):
            raise InvalidParameterError(
                "resume_from_checkpoint",
                resume_from_checkpoint,
                "is not supported: Hugging Face checkpoints do not hold the privacy engine's state",
            )
        if trial is not None:
            raise InvalidParameterError(
                "trial",
                type(trial).__name__,
                "hyper-parameter search spends the budgets once per trial; it is not supported",
            )
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*Full backward hook.*")
                warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
                out = super().train(**kwargs)
            out = self._public_output(out)
            self.save_run()
        except BaseException:
            self.run_folder.discard_if_unused()
            raise
        finally:
            self._release_model()
        return out

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
        from .outputs import save_model_folder

        save_model_folder(self)

    def save_run(self) -> dict:
        """Write the run folder: public model/, report.json, report.html; private/ per-example budgets
        and ε, ledger, private logs, the privacy seed.  Returns the report (with its private part)."""
        from .outputs import write_run

        self.layer_paths, self.layer_paths_taken = self.engine.layer_paths, self.engine.layer_paths_taken
        self.report = write_run(self)
        return self.report
