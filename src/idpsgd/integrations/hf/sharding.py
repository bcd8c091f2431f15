"""``PrivacyArguments(fsdp=True)``: the private Trainer on a model sharded with FSDP2.

Under ``torchrun`` each transformer block (the model's ``_no_split_modules`` classes) and then the
root are wrapped with ``torch.distributed.fsdp.fully_shard`` before ``make_private`` (the engine's
sharded book-keeping or ghost clipping: :mod:`idpsgd.engine.distributed.fsdp`; a PEFT (LoRA) model's frozen base is
sharded with its adapters); each rank runs its Poisson share of a step in exactly
``gradient_accumulation_steps`` passes (FSDP2's all-gathers need the same passes on every rank, while
the shares differ in size; an empty part arrives as the engine's phantom row, which carries no weight;
at user level one pass, a user's rows being clipped as one unit).  Checkpoints are
:mod:`idpsgd.engine.distributed.sharded_checkpoint` folders ``private/checkpoint-<step>/`` (every rank writes its
shards; the Trainer's private state rides in each rank's ``extra``); the final public ``model/`` is
``save_pretrained`` of a plain copy rebuilt on rank 0 from the gathered full state dict.  What the
sharded engine cannot honour is refused here, with the reason.
"""

from __future__ import annotations

import torch

from ...engine import distributed
from ...engine.distributed import sharded_checkpoint as sc
from ...validation import InvalidParameterError


def check_fsdp(privacy, args, model, kwargs: dict) -> None:
    """Refuse what a sharded private run cannot honour (one line: which, why, what would be needed)."""
    if privacy.grad_sample_mode not in ("bk", "ghost"):
        raise InvalidParameterError(
            "grad_sample_mode",
            privacy.grad_sample_mode,
            "with fsdp=True only 'bk' and 'ghost' are supported (the sharded engine forms each rank's clipped sum "
            "by book-keeping, or by ghost clipping's second backward pass; Opacus's per-sample gradients of "
            "sharded parameters are not: FSDP2 frees the unsharded parameters after each block's pass)",
        )
    if privacy.user_column is not None and privacy.grad_sample_mode != "bk":
        raise InvalidParameterError(
            "user_column",
            privacy.user_column,
            "with fsdp=True user-level privacy needs grad_sample_mode='bk' (the sharded ghost wrapper forms "
            "per-row norms; a user's summed-gradient norm under FSDP2 would need the user-level ghost capture "
            "on the unsharded parameters)",
        )
    if getattr(args, "fp16", False):
        raise InvalidParameterError("fp16", True, "is not supported with fsdp=True (use bf16=True or float32)")
    if kwargs.get("optimizers", (None, None))[0] is not None:
        raise InvalidParameterError(
            "optimizers",
            type(kwargs["optimizers"][0]).__name__,
            "an optimizer made before sharding holds the unsharded parameters; with fsdp=True let the Trainer "
            "create it from TrainingArguments (optim, learning_rate, ...)",
        )
    if not distributed.is_distributed():
        raise InvalidParameterError(
            "fsdp",
            True,
            "needs a torch.distributed process group: launch with torchrun --nproc-per-node N (N >= 1)",
        )


def block_classes(model) -> set[str]:
    """The class names of the model's transformer blocks (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise InvalidParameterError(
            "model",
            type(model).__name__,
            "names no transformer blocks (_no_split_modules) to shard: fsdp=True wraps each block and the root",
        )
    return names


def shard_model(model: torch.nn.Module, device) -> torch.nn.Module:
    """``fully_shard`` each transformer block, then the root (in place; returns the model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (distributed.rank_and_world()[1],))
    blocks = block_classes(model)
    found = [m for m in model.modules() if type(m).__name__ in blocks]
    if not found:
        raise InvalidParameterError(
            "model", type(model).__name__, f"has no module of its block classes {sorted(blocks)} to shard"
        )
    for block in found:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model: torch.nn.Module) -> dict:
    """Every rank: the sharded model's whole state dict, on rank 0's CPU (empty elsewhere)."""
    return sc.full_model_state(model)


def plain_copy(model: torch.nn.Module, full_state: dict) -> torch.nn.Module:
    """A plain (unsharded) instance of the sharded model's class holding ``full_state`` (rank 0); a PEFT
    (LoRA) model becomes a plain base model with the same adapter (its ``save_pretrained`` writes the
    adapter, as in one process).  The global RNG states are left as they were."""
    if getattr(model, "peft_config", None):  # LoRA: a plain base model of the config, the same adapter, then the state
        import copy as copying

        from peft import get_peft_model

        base = model.get_base_model()
        cls = next(c for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))
        with torch.random.fork_rng(devices=[]):
            copy = get_peft_model(
                cls._from_config(base.config, dtype=next(iter(full_state.values())).dtype),
                copying.deepcopy(model.peft_config[model.active_adapter]),
            )
    else:
        cls = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
        with torch.random.fork_rng(devices=[]):
            copy = cls._from_config(model.config, dtype=next(iter(full_state.values())).dtype)
    copy.load_state_dict(full_state)
    copy.generation_config = getattr(model, "generation_config", None) or copy.generation_config
    return copy.train(model.training)


def phantom(inputs):
    """The engine's phantom row for a rank whose share of the draw is empty
    (:class:`idpsgd.engine.distributed.fsdp.PhantomCollate`: one row of zeros with the batch's structure, no
    example's values; the optimizer gives it no weight): every rank runs a forward and backward pass, as
    FSDP2's collectives need."""
    from ...engine.distributed.fsdp import PhantomCollate

    # a plain dict: the collators' BatchEncoding is no pytree container, so the phantom map would pass it unchanged
    return PhantomCollate(lambda _rows: dict(inputs))([])


# --- checkpoints ---------------------------------------------------------------------------------
def is_sharded_checkpoint(path) -> bool:
    from pathlib import Path

    return Path(path).is_dir() and (Path(path) / sc.STATE_FILE).is_file()


def read_rank_state(path) -> dict:
    """This rank's Trainer state in a sharded checkpoint (the ``extra`` it saved); another world size
    is refused (the Trainer's expected batch and sampling are per process count)."""
    state = sc.read_sharded_state(path)
    rank, world = distributed.rank_and_world()
    if int(state["world_size"]) != world:
        raise InvalidParameterError(
            "resume_from_checkpoint",
            str(path),
            f"was written by {state['world_size']} processes, this run has {world}: resume with torchrun "
            f"--nproc-per-node {state['world_size']}",
        )
    return dict(state["ranks"][rank]["extra"])


def save(trainer, folder, step: int, state: dict, keep: int | None) -> None:
    """Every rank: the model's and optimizer's shards and this rank's ``state`` (the Trainer's private
    state without the tensors) into ``folder/checkpoint-<step>/``; rank 0 lists it in the manifest."""
    before = {p.name for _, p in sc.sharded_checkpoints(folder)}
    path = sc.save_sharded_checkpoint(
        folder, step, module=trainer.model, optimizer=trainer.dp_optimizer, extra=state, keep=keep
    )
    if trainer.is_world_process_zero():
        trainer.run_folder.file(
            path.name,
            "private",
            "sharded checkpoint (torch.distributed.checkpoint): model and optimizer shards, every rank's privacy "
            "engine state (accountant, sampler and noise states, seed), RNG states, private logs",
        )
        kept = {p.name for _, p in sc.sharded_checkpoints(folder)}
        for name in before - kept:
            trainer.run_folder.remove(name, "private")


def export_checkpoint(checkpoint, out, *, tokenizer=None):
    """The model of a sharded Trainer checkpoint (a ``checkpoint-<step>/`` folder, or a run folder: its
    latest) as one ``save_pretrained`` folder ``out`` (one process, no ``torchrun``): the model is
    rebuilt from the configuration the run saved, its weights read from every rank's shards.  ``out``
    holds the model (and ``tokenizer``, e.g. ``AutoTokenizer.from_pretrained(model_dir)``) only: no
    optimizer, engine state, seed or RNG state.  Returns ``out``."""
    from pathlib import Path

    import transformers

    from .checkpoints import find_checkpoint

    path = Path(checkpoint)
    if not is_sharded_checkpoint(path):
        path = find_checkpoint(path, True)
    if not is_sharded_checkpoint(path):
        raise InvalidParameterError("checkpoint", str(checkpoint), "holds no sharded checkpoint (checkpoint-<step>/)")
    state = sc.read_sharded_state(path)
    extra = state["ranks"][0]["extra"]
    config, peft = extra.get("model_config"), extra.get("peft")
    name = peft["base_class"] if peft else state["layout"]["model"]
    cls = getattr(transformers, name, None)
    if config is None or cls is None:
        raise InvalidParameterError(
            "checkpoint", str(path), f"is not a Trainer checkpoint of a transformers model ({state['layout']['model']})"
        )
    config = transformers.AutoConfig.for_model(**config)
    with torch.random.fork_rng(devices=[]):
        model = cls._from_config(config)
        if peft:  # LoRA: the same adapter on the base model; the folder holds the adapter, as the run's model/
            import json

            from peft import PeftConfig, get_peft_model

            model = get_peft_model(model, PeftConfig.from_peft_type(**json.loads(peft["config"])))
    return sc.export_pretrained(path, model, out, tokenizer=tokenizer)


def peft_layout(model) -> dict:
    """``{"peft": ...}`` for a PEFT (LoRA) model's checkpoint — its base model's class and its adapter's
    configuration (JSON) — so that :func:`export_checkpoint` can rebuild it; ``{}`` for another model."""
    if not getattr(model, "peft_config", None):
        return {}
    import json

    base = model.get_base_model()
    cls = next(c for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))
    config = model.peft_config[model.active_adapter].to_dict()
    return {"peft": {"base_class": cls.__name__, "config": json.dumps(config, default=sorted, sort_keys=True)}}


def load(trainer, path) -> None:
    """Every rank, after sharding and creating the optimizer (before ``make_private``): the model's and
    optimizer's shards and this rank's RNG states."""
    sc.load_sharded_checkpoint(path, module=trainer.model, optimizer=trainer.optimizer)
