"""Public batch shapes for the Trainer and ``idpsgd finetune``: one example's length never moves another's
computation.

A collator pads each batch to its longest row, so the batch's length is a function of every example
in it.  Each example's computation must not depend on it (the privacy review measured 2.81 × c for a
left-padded GPT-2 without ``position_ids``: one long example shifted everyone's positions).
:class:`PublicPadding` wraps any collator (Hugging Face's, or the user's) and makes each collated
batch of token ids (``input_ids`` with an ``attention_mask``) such that:

* **every batch is padded on the right**: a left-padded batch (a decoder's tokenizer often pads
  left) is re-laid, each row's real tokens moved to its start, so that the positions any model counts
  from the batch's start (GPT-2, Llama without ``position_ids``), or from its mask or pads (OPT,
  RoBERTa), are the example's own.  Per-example ``position_ids`` with left padding (dp-transformers'
  choice) are not enough: a causal language model's loss predicts each row's first token from the
  pad before it, whose output depends on how many pads there are (a tiny GPT-2 in ``finetune`` with
  mask-derived ``position_ids`` and left padding: 1.26 × c; right padding: 1.0000).  With right
  padding they are not needed (they would equal the default positions on every real token), and
  none are added: a per-example position table lookup is a different per-example computation for
  the engine (GPT-J's ``embed_positions[position_ids]`` is refused by book-keeping);
* with ``pad_to_length`` N every batch has exactly N tokens (a public length: then even a model that
  pools over pads computes each example from that example alone); a row longer than N is refused.

The engine's batch-independence check is told the same
(:func:`~idpsgd.engine.guards.batch_independence.declare_padding`), and refuses a model whose outputs still
move with the padding (a mean over every position, pads included). Batches it cannot interpret (no
``input_ids``/``attention_mask``, per-token tensors of other names) pass unchanged unless a fixed length was
asked for (then refused): docs/guarantees.md says what that leaves to the user.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...engine.guards.padding_check import IGNORE_INDEX
from ...validation import InvalidParameterError

#: per-token keys and the value of a pad (a collator's own position_ids are not re-laid: refused when they would be)
PAD_VALUES = {"attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0, "special_tokens_mask": 1}


class PublicPadding:
    """A collator whose token batches are padded on the right and, on request, to a fixed length.

    Args:
        collator: the collator it wraps (called first).
        pad_to_length: every batch's number of tokens (None: the longest row's).
        pad_token_id: the id a pad token gets (needed with ``pad_to_length``).
    """

    def __init__(self, collator, *, pad_to_length: int | None = None, pad_token_id: int | None = None):
        self.collator = collator
        self.pad_to_length, self.pad_token_id = pad_to_length, pad_token_id
        if pad_to_length is not None and pad_token_id is None:
            raise InvalidParameterError(
                "pad_to_length",
                pad_to_length,
                "needs a padding token id: give the Trainer a processing_class (tokenizer) with a pad_token, or "
                "set model.config.pad_token_id",
            )

    #: the padding side every batch has (declared to the engine's check)
    side = "right"

    def without_length(self) -> PublicPadding:
        """The same collator without the fixed length (evaluation on public data: rows may be longer)."""
        return PublicPadding(self.collator, pad_token_id=self.pad_token_id)

    def __call__(self, features):
        return self.apply(self.collator(features))

    def apply(self, batch):
        """The collated ``batch`` with public shapes (module docstring)."""
        if not isinstance(batch, Mapping):
            return self._uninterpreted(batch, "is not a mapping of named tensors")
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        if not (torch.is_tensor(ids) and torch.is_tensor(mask) and ids.dim() == 2 and mask.shape == ids.shape):
            return self._uninterpreted(batch, "has no input_ids with an attention_mask of the same shape")
        per_token = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and v.shape[:2] == ids.shape]
        unknown = [k for k in per_token if k not in ("input_ids", *PAD_VALUES)]
        out = dict(batch)
        real = mask != 0
        lead = (real.long().cumsum(1) == 0).sum(1)  # pads before each row's first real token
        if bool((lead > 0).any()):
            self._refuse_unknown(unknown, "re-lay the left-padded batch on the right")
            T = ids.shape[1]
            index = (torch.arange(T, device=ids.device)[None, :] + lead[:, None]) % T
            for k in per_token:
                v = out[k]
                out[k] = v.gather(1, index.view(*index.shape, *([1] * (v.dim() - 2))).expand_as(v))
            real = out["attention_mask"] != 0
        if bool((real[:, 1:] & ~real[:, :-1]).any()):
            raise InvalidParameterError(
                "data_collator",
                "a batch whose rows have pads between their tokens",
                "each row's tokens must be one run of real tokens padded on one side (the batch's length "
                "must not move the positions each example's tokens get)",
            )
        if self.pad_to_length is not None:
            out = self._to_length(out, per_token, unknown)
        return out

    def _uninterpreted(self, batch, why: str):
        if self.pad_to_length is None:
            return batch
        raise InvalidParameterError(
            "pad_to_length",
            self.pad_to_length,
            f"cannot fix the length of this collator's batches: the batch {why} (Hugging Face's convention); "
            "pad in the collator (e.g. DataCollatorWithPadding(tokenizer, padding='max_length', max_length=N)) "
            "and leave pad_to_length unset",
        )

    def _refuse_unknown(self, unknown: list[str], what: str) -> None:
        if unknown:
            raise InvalidParameterError(
                "data_collator",
                f"per-token input {unknown[0]!r}",
                f"has no known padding value, so idpsgd cannot {what}; give the model input_ids, attention_mask, "
                "labels, token_type_ids (Hugging Face's names), or pad on the right in the collator",
            )

    def _to_length(self, out: dict, per_token: list[str], unknown: list[str]) -> dict:
        n, T = self.pad_to_length, out["input_ids"].shape[1]
        if n < T:
            raise InvalidParameterError(
                "pad_to_length",
                n,
                "is shorter than a row of a training batch: truncate every text to at most this many tokens "
                "(idpsgd finetune: --max-length <= --pad-to-length; tokenizer(..., truncation=True, max_length=N))",
            )
        if n == T:
            return out
        self._refuse_unknown(unknown, f"pad the batch to pad_to_length={n}")
        for k in per_token:
            v = out[k]
            fill = self.pad_token_id if k == "input_ids" else PAD_VALUES.get(k, 0)
            extra = v.new_full((v.shape[0], n - T, *v.shape[2:]), fill)
            out[k] = torch.cat([v, extra], 1)
        return out


def check_lengths(dataset, pad_to_length: int | None) -> None:
    """With ``pad_to_length``: every row of a ``datasets.Dataset``'s ``input_ids`` fits in it (refused
    before training otherwise; a row is not named: its length is private)."""
    import datasets

    if pad_to_length is None or not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return
    if any(len(row) > pad_to_length for row in dataset["input_ids"]):
        raise InvalidParameterError(
            "pad_to_length",
            pad_to_length,
            "is shorter than some training rows: truncate the texts to at most this many tokens "
            "(tokenizer(..., truncation=True, max_length=N); idpsgd finetune: --max-length <= --pad-to-length)",
        )


__all__ = ["PublicPadding", "check_lengths"]
