"""Hugging Face integration: fine-tune ``transformers`` models with a privacy budget per example
(``pip install idpsgd[hf]``: transformers, peft, datasets, accelerate).

* :class:`IndividualizedTrainer` — ``transformers.Trainer`` on the privacy engine, with
  :class:`PrivacyArguments` (budgets from a ``datasets.Dataset`` column or an array);
* :class:`PerExampleLoss` — the per-example loss convention of private fine-tuning;
* :func:`finetune` — a local model folder and a local text file (JSONL/CSV) to a run folder (the
  ``idpsgd finetune`` command); :func:`load_text_data` reads the text file.

Imported lazily: ``import idpsgd`` never imports transformers.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "IndividualizedTrainer": "trainer",
    "PrivacyArguments": "arguments",
    "PerExampleLoss": "losses",
    "check_training_arguments": "arguments",
    "finetune": "finetune",
    "FinetuneOptions": "finetune",
    "load_text_data": "text_data",
    "TextData": "text_data",
    "export_checkpoint": "sharding",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'idpsgd.integrations.hf' has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] in ("transformers", "datasets", "accelerate", "peft"):
            raise ImportError(f"idpsgd.integrations.hf.{name} needs {exc.name}: pip install 'idpsgd[hf]'") from exc
        raise
    return getattr(module, name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FinetuneOptions",
    "IndividualizedTrainer",
    "PerExampleLoss",
    "PrivacyArguments",
    "TextData",
    "check_training_arguments",
    "export_checkpoint",
    "finetune",
    "load_text_data",
]
