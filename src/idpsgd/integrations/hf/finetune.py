"""Fine-tune a local Hugging Face model on a local text file with per-example budgets (``idpsgd
finetune``): a library function over :class:`~.trainer.IndividualizedTrainer`.

* the model folder is what ``save_pretrained`` writes (``config.json`` and the weights) plus the
  tokenizer's files; nothing is downloaded (``local_files_only=True``);
* with a label column the model is loaded as a sequence classifier (a new classification head when
  the folder holds a language model), without one as a causal language model;
* the classes (their names, number and order: the head's rows and the public ``model/config.json``'s
  ``id2label``) come from public information only: the model's config when it names its classes,
  else ``labels`` or ``num_classes`` (:func:`~.text_data.public_classes`); never from the training
  rows, whose label set is private.  A row whose label is outside that set is refused (file, line,
  value, the allowed classes);
* texts are tokenized with the folder's tokenizer, truncated to ``max_length`` tokens and padded per
  batch on the right, whatever side the tokenizer pads (a tokenizer without a padding token pads
  with its end-of-text token), so that no example's length moves another's positions;
  ``pad_to_length`` N pads every batch to exactly N tokens (:mod:`.padding`);
* ``lora_r > 0`` trains LoRA adapters of rank r (PEFT's default target modules for the model type)
  on the frozen model; ``model/`` then holds the adapter.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...assignment import Budgets
from ...validation import InvalidParameterError, check_positive
from .arguments import PrivacyArguments
from .text_data import TextData, check_num_classes, label_ids, model_classes, parse_labels, public_classes

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class FinetuneOptions:
    """Hyper-parameters of :func:`finetune` (privacy: method, accountant, mode, seed; training: the rest)."""

    method: str = "scale"
    epochs: float = 3.0
    batch_size: int = 16  # expected (Poisson) batch size B
    physical_batch_size: int | None = None  # at most this many examples per forward pass (default B)
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # every example's clip norm (the reference c of Scale)
    max_length: int = 128
    lora_r: int = 0
    grad_sample_mode: str = "bk"
    accountant: str = "rdp"
    seed: int | None = None
    secure_mode: bool = False
    device: str = "cpu"
    progress: bool = False  # a progress bar on stderr with each group's ε spent so far
    gradient_checkpointing: bool = False  # reentrant activation checkpointing (the Trainer's option)
    save_every: int | None = None  # a private checkpoint every this many steps (resume=True continues it)
    nproc: int = 1  # data-parallel processes (the engine's DPDDP; gloo on CPU, one GPU each with cuda)
    fsdp: bool = False  # shard the model with FSDP2 (each block and the root; bk or ghost): torchrun or nproc
    # the public class set of a classifier (one of them, unless the model's config names its classes):
    labels: tuple[str, ...] | None = None  # class names; their order gives the class ids
    num_classes: int | None = None  # K: integer labels 0..K-1
    pad_to_length: int | None = None  # every batch exactly this many tokens (>= max_length; None: the longest row's)

    def __post_init__(self):
        if self.labels is not None:
            object.__setattr__(self, "labels", tuple(parse_labels(self.labels)))
        if self.num_classes is not None:
            object.__setattr__(self, "num_classes", check_num_classes(self.num_classes))
        if self.labels is not None and self.num_classes is not None:
            raise InvalidParameterError(
                "num_classes", self.num_classes, "give the classes one way: labels (class names) or num_classes"
            )
        for name in ("batch_size", "max_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise InvalidParameterError(name, v, "must be an integer >= 1")
        pb = self.physical_batch_size
        if pb is not None:
            if isinstance(pb, bool) or int(pb) != pb or pb < 1:
                raise InvalidParameterError("physical_batch_size", pb, "must be an integer >= 1")
            if self.batch_size % pb:
                raise InvalidParameterError(
                    "physical_batch_size",
                    pb,
                    f"must divide --batch-size={self.batch_size} "
                    "(the expected batch is that many physical batches' worth)",
                )
        if isinstance(self.nproc, bool) or int(self.nproc) != self.nproc or self.nproc < 1:
            raise InvalidParameterError("nproc", self.nproc, "must be an integer >= 1")
        if self.fsdp is not False and self.fsdp is not True:
            raise InvalidParameterError("fsdp", self.fsdp, "must be True or False")
        physical_per_process(self, self.nproc)  # under torchrun (nproc 1): checked again in finetune()
        if self.fsdp and self.grad_sample_mode not in ("bk", "ghost"):
            raise InvalidParameterError(
                "grad_sample_mode",
                self.grad_sample_mode,
                "with fsdp only bk and ghost are supported (the sharded engine's clipped sums; Opacus's per-sample "
                "gradients of parameters FSDP2 frees after each block's pass are not)",
            )
        n = self.pad_to_length
        if n is not None:
            if isinstance(n, bool) or int(n) != n or n < 1:
                raise InvalidParameterError("pad_to_length", n, "must be an integer >= 1 (tokens per batch)")
            if n < self.max_length:
                raise InvalidParameterError(
                    "pad_to_length",
                    n,
                    f"must be >= --max-length={self.max_length} (texts are truncated to --max-length tokens, then "
                    "every batch is padded to --pad-to-length): lower --max-length or raise --pad-to-length",
                )
            object.__setattr__(self, "pad_to_length", int(n))
        se = self.save_every
        if se is not None and (isinstance(se, bool) or int(se) != se or se < 1):
            raise InvalidParameterError("save_every", se, "must be an integer >= 1 (steps between checkpoints)")
        if isinstance(self.lora_r, bool) or int(self.lora_r) != self.lora_r or self.lora_r < 0:
            raise InvalidParameterError("lora_r", self.lora_r, "must be an integer >= 0 (0: full fine-tuning)")
        check_positive(self.epochs, "epochs")
        check_positive(self.lr, "lr")
        check_positive(self.max_grad_norm, "max_grad_norm")
        if not self.weight_decay >= 0:
            raise InvalidParameterError("weight_decay", self.weight_decay, "must be >= 0")
        if self.device not in DEVICES:
            raise InvalidParameterError("device", self.device, f"must be one of {', '.join(DEVICES)}")


def torchrun_world() -> int:
    """The processes ``torchrun`` started (its WORLD_SIZE) when this process is one of them, else 0."""
    import os

    from ...engine import distributed

    if distributed.is_distributed() or "TORCHELASTIC_RUN_ID" not in os.environ:
        return 0
    return int(os.environ.get("WORLD_SIZE", "1"))


def physical_per_process(options: FinetuneOptions, procs: int) -> int:
    """The examples of one forward pass on each of ``procs`` processes: ``physical_batch_size``, by
    default the process's share ``batch_size / procs`` of the expected batch (one pass per step; with
    fsdp every rank runs ``share / physical_batch_size`` passes, an empty part as a phantom row).

    Each process takes an equal share of the expected batch in whole physical batches, so
    ``batch_size`` must be a multiple of ``procs`` and ``physical_batch_size`` must divide the share;
    a refusal names the value to change and suggests one that works."""
    b, pb = options.batch_size, options.physical_batch_size
    if procs == 1:
        return pb or b
    if b % procs:
        raise InvalidParameterError(
            "batch_size",
            b,
            f"must be a multiple of the {procs} processes (--nproc, or torchrun's --nproc-per-node): each process "
            f"takes an equal share of the expected batch (e.g. --batch-size {-(-b // procs) * procs})",
        )
    share = b // procs
    if pb is not None and share % pb:
        fits = max(d for d in range(1, min(pb, share) + 1) if share % d == 0)
        raise InvalidParameterError(
            "physical_batch_size",
            pb,
            f"must divide each process's share of the expected batch, --batch-size / {procs} processes = {share} "
            f"(e.g. --physical-batch-size {fits})",
        )
    return pb or share


def check_model_folder(path) -> Path:
    """A local model folder: ``config.json``, weights and a tokenizer (refused with what is missing)."""
    p = Path(path)
    if not p.is_dir():
        raise InvalidParameterError(
            "model",
            str(path),
            "not found: give a local folder as save_pretrained writes "
            "it (config.json, model.safetensors, tokenizer files)"
            if not p.exists()
            else "is not a folder (give the folder save_pretrained wrote)",
        )
    if not (p / "config.json").is_file():
        raise InvalidParameterError(
            "model",
            str(path),
            "is not a model folder: it has no config.json (save the model with model.save_pretrained(folder))",
        )
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise InvalidParameterError("model", str(path), f"has no weights ({' or '.join(WEIGHT_FILES[::2])})")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise InvalidParameterError(
            "model",
            str(path),
            "has no tokenizer (tokenizer.json or tokenizer_config.json): "
            "save it into the folder with tokenizer.save_pretrained(folder)",
        )
    return p


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


#: how a model folder is read: from its own files, and never its Python code (a config.json with an
#: ``auto_map`` would otherwise make transformers ask on stdin whether to run the folder's code)
LOCAL_FILES = {"local_files_only": True, "trust_remote_code": False}


def model_label2id(folder: Path) -> dict | None:
    """The ``label2id`` of the model's config (public: the model folder is an input, not data), or None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, **LOCAL_FILES)
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidParameterError(
            "model", str(folder), f"its config.json cannot be read ({_first_line(exc)})"
        ) from None
    return getattr(config, "label2id", None)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, **LOCAL_FILES)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InvalidParameterError(
            "model", str(folder), f"its tokenizer cannot be loaded ({_first_line(exc)})"
        ) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise InvalidParameterError(
                "model",
                str(folder),
                "its tokenizer has neither a padding token nor an "
                "end-of-text token to pad with; set tokenizer.pad_token and save it again",
            )
        tok.pad_token = tok.eos_token
    return tok


def load_model(folder: Path, task: str, id2label: dict | None, pad_token_id: int):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = dict(LOCAL_FILES)
    if task == "sequence_classification":
        cls = AutoModelForSequenceClassification
        kwargs.update(num_labels=len(id2label), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    else:
        cls = AutoModelForCausalLM
    try:
        model = cls.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        what = "a sequence classifier" if task == "sequence_classification" else "a causal language model"
        raise InvalidParameterError("model", str(folder), f"cannot be loaded as {what} ({_first_line(exc)})") from None
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad_token_id
    return model


def align_special_tokens_quietly(model, tokenizer) -> None:
    """Align the model's (and generation config's) PAD/BOS/EOS ids with the tokenizer's before the
    Trainer does: the Trainer's own alignment logs "The tokenizer has new PAD/BOS/EOS tokens ..." on
    every run where they differ (a tokenizer padding with its end-of-text token, a saved GPT-2 without a
    generation pad id), which this command arranges on purpose; after this the Trainer finds nothing to
    change and stays silent."""
    try:
        from transformers.trainer_utils import align_special_tokens
    except ImportError:  # an older transformers without the alignment: nothing to do
        return
    from transformers.utils import logging as hf_logging

    log = hf_logging.get_logger("transformers.trainer_utils")
    level = log.level
    log.setLevel(hf_logging.ERROR)
    try:
        align_special_tokens(model, tokenizer)
    finally:
        log.setLevel(level)


def with_lora(model, r: int, task: str):
    from peft import LoraConfig, get_peft_model

    kind = "SEQ_CLS" if task == "sequence_classification" else "CAUSAL_LM"
    try:
        return get_peft_model(model, LoraConfig(r=r, task_type=kind))
    except ValueError as exc:
        raise InvalidParameterError("lora_r", r, f"LoRA cannot be applied to this model ({_first_line(exc)})") from None


def tokenize(data: TextData, tokenizer, max_length: int, ids: list | None):
    import datasets

    enc = tokenizer(data.texts, truncation=True, max_length=max_length)
    columns = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if ids is not None:
        columns["labels"] = ids
    return datasets.Dataset.from_dict(columns)


def null_row_labels(dataset, null, pad_token_id):
    """``dataset`` with a ``labels`` column: each row's token ids (the padding token unlabelled, as
    the language-modelling collator labels them), and no label at all on the ``null`` rows — zero-out
    null rows (:mod:`idpsgd.accounting.neighbouring`): sampled and counted like any row, their loss
    is 0 (:class:`~.losses.PerExampleLoss`), so they add nothing to the clipped sum.  The canary
    audit's held-out canaries (:mod:`idpsgd.audit.canaries`)."""
    from .losses import IGNORE_INDEX

    null = np.asarray(null, dtype=bool)
    if null.shape != (len(dataset),):
        raise InvalidParameterError("null_rows", f"shape {null.shape}", f"need one flag per row ({len(dataset)})")
    labels = [
        [IGNORE_INDEX] * len(ids) if z else [IGNORE_INDEX if t == pad_token_id else t for t in ids]
        for ids, z in zip(dataset["input_ids"], null.tolist(), strict=True)
    ]
    return dataset.add_column("labels", labels)


def finetune(
    model_dir,
    train: TextData,
    budgets: Budgets,
    out,
    *,
    eval_data: TextData | None = None,
    options: FinetuneOptions = FinetuneOptions(),
    overwrite: bool = False,
    resume: bool = False,
    users=None,
    null_rows=None,
) -> dict:
    """Fine-tune the model in ``model_dir`` on ``train`` with one budget per row; returns the report
    (also in the run folder ``out``: public model/, report.json, report.html; private/).

    ``options.save_every``: a private checkpoint every that many steps (``private/checkpoint-<step>.pt``);
    ``resume``: continue the run in ``out`` from its latest checkpoint, exactly as if it had not been
    interrupted (same data, budgets and options; refused otherwise).  ``users`` (an
    :class:`idpsgd.Users` over ``train``'s rows): user-level privacy, one budget per user.
    ``null_rows`` (causal LM only; a bool per row): rows that are zero-out nulls (:func:`null_row_labels`)."""
    import torch
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ...engine import distributed
    from .trainer import IndividualizedTrainer

    torchrun = torchrun_world()
    if torchrun and options.nproc > 1:
        raise InvalidParameterError(
            "nproc",
            options.nproc,
            f"is given while torchrun already started {torchrun} processes: give one of them (torchrun "
            "--nproc-per-node N, or --nproc N without torchrun)",
        )
    procs = torchrun or options.nproc
    physical_per_process(options, procs)
    if resume:  # a folder without a checkpoint: a new run (as train(resume=True)); the CLI says so
        from .checkpoints import checkpoints_in

        resume = bool(checkpoints_in(out))
    if not isinstance(budgets, Budgets) or len(budgets) != (len(train) if users is None else users.num_users):
        raise InvalidParameterError(
            "budgets",
            f"{len(budgets) if isinstance(budgets, Budgets) else budgets!r}",
            f"need an idpsgd.Budgets with one budget per training row ({len(train)})",
        )
    if eval_data is not None and (eval_data.labels is None) != (train.labels is None):
        raise InvalidParameterError(
            "eval_data",
            eval_data.source.get("file"),
            "must have the label column exactly when the training data has one",
        )
    if train.labels is None and (options.labels is not None or options.num_classes is not None):
        flag = "labels" if options.labels is not None else "num_classes"
        raise InvalidParameterError(
            flag,
            ",".join(options.labels) if options.labels is not None else options.num_classes,
            "is for a sequence classifier: give the data's label column too (label_column / --label-column)",
        )
    units = len(train) if users is None else users.num_users
    if options.batch_size > units:
        raise InvalidParameterError(
            "batch_size",
            options.batch_size,
            f"must be <= the {units} training {'rows' if users is None else 'users'} (it is the expected Poisson "
            "batch size)",
        )
    folder = check_model_folder(model_dir)
    if options.device == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", "cuda", "no CUDA device is available here; use cpu or auto")
    if (options.nproc > 1 or options.fsdp) and not torchrun and not distributed.is_distributed():
        # the same finetune on N ranks (fsdp: a process group even for one), once the arguments are
        # checked here (a refusal in a rank costs the start of every rank); rank 0 reports
        return distributed.launch(
            finetune,
            options.nproc,
            (model_dir, train, budgets, out),
            dict(
                eval_data=eval_data,
                options=options,
                overwrite=overwrite,
                resume=resume,
                users=users,
                null_rows=null_rows,
            ),
            device="cuda"
            if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
            else "cpu",
        )
    tokenizer = load_tokenizer(folder)
    task = "causal_lm" if train.labels is None else "sequence_classification"
    if null_rows is not None and task != "causal_lm":
        raise InvalidParameterError(
            "null_rows", "given", "null rows are for causal language modelling (no label column)"
        )
    train_ids = eval_ids = id2label = None
    classes_source = None
    if task == "sequence_classification":
        label2id = model_label2id(folder)
        classes = public_classes(label2id, options.labels, options.num_classes)
        classes_source = (
            "the model's config"
            if model_classes(label2id) is not None
            else ("labels" if options.labels is not None else "num_classes")
        )
        train_ids = label_ids(train, classes, "data")
        eval_ids = label_ids(eval_data, classes, "eval_data") if eval_data is not None else None
        id2label = dict(enumerate(classes))
    # the model's seed (new head, LoRA init, dropout): its own stream, derived from --seed by a hash so
    # that nothing the model's randomness reveals leads back to the privacy seed
    init_seed = (
        int(np.random.SeedSequence([options.seed, 1]).generate_state(1)[0])
        if options.seed is not None
        else secrets.randbits(32)
    )
    torch.manual_seed(init_seed)  # a new classification head or LoRA adapter
    with _bars(options.progress):
        model = load_model(folder, task, id2label, tokenizer.pad_token_id)
    align_special_tokens_quietly(model, tokenizer)
    if options.lora_r:
        model = with_lora(model, options.lora_r, task)
    physical = physical_per_process(options, procs)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=physical,
        gradient_accumulation_steps=options.batch_size // (physical * procs),
        num_train_epochs=options.epochs,
        learning_rate=options.lr,
        weight_decay=options.weight_decay,
        max_grad_norm=options.max_grad_norm,
        optim="adamw_torch",
        save_strategy="steps" if options.save_every else "no",
        save_steps=options.save_every or 500,
        logging_strategy="epoch",
        report_to=[],
        disable_tqdm=True,  # the bar is EpsilonProgress's (below)
        **_checkpointing_argument(options.gradient_checkpointing),
        seed=init_seed,
        dataloader_pin_memory=False,
        use_cpu=options.device == "cpu" or (options.device == "auto" and not torch.cuda.is_available()),
    )
    collator = (
        DataCollatorForLanguageModeling(tokenizer, mlm=False)
        if task == "causal_lm"
        else DataCollatorWithPadding(tokenizer)
    )
    train_dataset = tokenize(train, tokenizer, options.max_length, train_ids)
    eval_dataset = tokenize(eval_data, tokenizer, options.max_length, eval_ids) if eval_data else None
    if null_rows is not None:  # labels of their own (nulls unlabelled), padded with "no label"
        from transformers import DataCollatorForSeq2Seq

        train_dataset = null_row_labels(train_dataset, null_rows, tokenizer.pad_token_id)
        if eval_dataset is not None:
            eval_dataset = null_row_labels(eval_dataset, np.zeros(len(eval_dataset), bool), tokenizer.pad_token_id)
        collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    privacy = PrivacyArguments(
        budgets=budgets,
        method=options.method,
        accountant=options.accountant,
        grad_sample_mode=options.grad_sample_mode,
        seed=options.seed,
        secure_mode=options.secure_mode,
        overwrite=overwrite,
        user_column=users,
        fsdp=options.fsdp,
        pad_to_length=options.pad_to_length,
    )
    trainer = IndividualizedTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        privacy=privacy,
        dataset_name=train.source.get("file"),
        data_source={
            "train": train.source,
            **({"test": eval_data.source} if eval_data else {}),
            "max_length": options.max_length,
            **({"pad_to_length": options.pad_to_length} if options.pad_to_length else {}),
            **({"classes": list(classes), "classes_from": classes_source} if classes_source else {}),
        },
    )
    EpsilonProgress = _epsilon_progress_class()
    trainer.remove_callback(PrinterCallback)  # nothing on stdout but the command's own output
    trainer.remove_callback(ProgressCallback)
    if options.progress:
        trainer.add_callback(EpsilonProgress(trainer))
    with _bars(options.progress):
        trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer.report


def _checkpointing_argument(on: bool) -> dict:
    """``TrainingArguments``' activation checkpointing flag under this transformers' name for it."""
    if not on:
        return {}
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": True}


@contextlib.contextmanager
def _bars(on: bool):
    """transformers' own progress bars (loading weights, writing shards) only when progress is on."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not on:
            hf_logging.enable_progress_bar()


def _epsilon_progress_class():
    from transformers import TrainerCallback

    class EpsilonProgress(TrainerCallback):
        """A progress bar on stderr (rank 0) whose postfix is each group's ε spent so far against its
        budget — public figures, the ones the report gives per group — after every step."""

        def __init__(self, trainer):
            self.trainer, self.bar = trainer, None

        def on_train_begin(self, args, state, control, **kwargs):
            from tqdm.auto import tqdm

            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="finetune", unit="step")

        def on_step_end(self, args, state, control, **kwargs):
            t = self.trainer
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)
                if t.ledger_rows:
                    spent = t.ledger_rows[-1][2:]  # each group's ε after this step (the ledger's grid)
                    self.bar.set_postfix_str(
                        "ε " + ", ".join(f"{e:.3g}/{b:g}" for e, b in zip(spent, t.engine.group_budgets, strict=True)),
                        refresh=False,
                    )

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return EpsilonProgress


def __getattr__(name):  # the callback class needs transformers: built on first use
    if name == "EpsilonProgress":
        return _epsilon_progress_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
