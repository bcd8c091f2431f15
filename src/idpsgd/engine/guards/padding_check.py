"""The re-padding probe of the batch-independence check: one example's length must not move another's outputs.

A token batch is padded to its longest row, so its length is a function of every example in it.  If an
example's computation depends on that length — a mean over all positions, pads included; positions
counted from the batch's start while the batch is padded on the left (GPT-2 or Llama without
``position_ids``) — then adding one long example changes every other example's gradient, and
per-example clipping bounds nothing (the privacy review measured 1.60–2.03 × c for ``emb(ids).mean(1)``
on right-padded batches, 2.81 × c for a left-padded GPT-2).  The value probe of
:mod:`.batch_independence` cannot see it: it changes values, never lengths.

This probe builds public token batches of the call's layout (Hugging Face's conventions: integer
``input_ids`` (B, T) with an ``attention_mask`` of the same shape, optional per-token ``labels``
(-100 on pads), ``token_type_ids`` (0 on pads) and ``position_ids`` (then derived from the mask:
cumsum − 1, as the shipped collators give them)) and runs the model on three of them:

* P0: T − k positions, examples of different real lengths, padded on the run's side;
* P1: the same examples padded further, to T (k more masked positions each);
* P2: P1 with one example made longer than the rest (every position real).

Each example's outputs on its real tokens (every output dimension whose size is the batch's length is
indexed by the example's real positions; other dimensions compared whole) must agree between P0 and
P1, and, for the other examples, between P0 and P2.  The side is the one the run declares
(:class:`Padding`), else the one the call's mask shows, else both.  A run with a fixed public length
(``Padding.length``: ``--pad-to-length``) has nothing to vary; the call's length must then be it.

Not interpreted (the probe does not run; docs/guarantees.md says what that leaves to the user):
calls without ``input_ids`` and ``attention_mask`` keywords (plain tensors, a user's own batch layout),
per-token tensors of other names, and batches of one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...validation import InvalidParameterError

SIDES = ("right", "left")
#: per-token keywords whose padded value is known (the Hugging Face conventions); position_ids are derived
_KNOWN = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids")
IGNORE_INDEX = -100
WAY_OUT = (
    "pool over the real tokens only (a masked mean: (h * mask).sum(1) / mask.sum(1)), give position_ids "
    "derived from the attention mask or pad on the right, or fix the batch's length: idpsgd finetune "
    "--pad-to-length N (PrivacyArguments(pad_to_length=N); declare_padding(model, length=N))"
)


@dataclass(frozen=True)
class Padding:
    """How every token batch of a run is padded (public facts its data path guarantees).

    Attributes:
        side: ``"right"`` or ``"left"``; None: as the checked call's mask shows (both when it shows none).
        length: every batch's fixed number of tokens (``--pad-to-length``); None: the longest row's.
    """

    side: str | None = None
    length: int | None = None

    def __post_init__(self):
        if self.side not in (None, *SIDES):
            raise InvalidParameterError("padding_side", self.side, "must be 'right', 'left' or None")
        if self.length is not None and (
            isinstance(self.length, bool) or int(self.length) != self.length or self.length < 1
        ):
            raise InvalidParameterError("pad_to_length", self.length, "must be an integer >= 1 (tokens per batch)")


def token_inputs(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input_ids, attention_mask) of a call in Hugging Face's convention, or None."""
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if not (torch.is_tensor(ids) and torch.is_tensor(mask)) or ids.dim() != 2 or mask.shape != ids.shape:
        return None
    if ids.is_floating_point() or ids.is_complex():
        return None
    return ids, mask


def sides_shown(mask: torch.Tensor) -> tuple[str, ...]:
    """The padding sides a mask shows: a pad before a real token is left padding, one after it right
    padding; none or both: both sides are probed."""
    m = mask.detach().to("cpu") != 0
    seen = m.cumsum(1) > 0  # at or after the row's first real token
    after = (~m & seen).any().item()  # a pad after a real token
    before = (~m & ~seen & m.any(1, keepdim=True)).any().item()  # a pad before a real token
    if after and not before:
        return ("right",)
    if before and not after:
        return ("left",)
    return SIDES


def per_example_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position within its own example: cumsum of the mask − 1, clamped at 0 (pads before
    the first real token get 0).  The same for any padding and any batch length."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _layout(lengths: torch.Tensor, T: int, side: str) -> torch.Tensor:
    """The attention mask (B, T) of examples with ``lengths`` real tokens padded on ``side``."""
    j = torch.arange(T)[None, :]
    return (j < lengths[:, None]) if side == "right" else (j >= T - lengths[:, None])


def _real_positions(lengths: torch.Tensor, T: int, side: str) -> list[torch.Tensor]:
    return [torch.arange(int(n)) if side == "right" else torch.arange(T - int(n), T) for n in lengths]


class _Batches:
    """The three public token batches (P0, P1, P2) of one side, built over the value probe's base."""

    def __init__(self, base_kwargs: dict, size: int, T: int, side: str, pad_id: int, per_token: list[str]):
        self.size, self.side, self.mid = size, side, size // 2
        self.T0, self.T1 = T - max(1, T // 4), T
        i = torch.arange(size)
        self.lengths0 = (self.T0 - i % 3).clamp(min=1)
        self.lengths2 = self.lengths0.clone()
        self.lengths2[self.mid] = self.T1
        real = [t for t in (1, 2, 3) if t != pad_id][:2]
        self.real_ids, self.pad_id = real, pad_id
        self.base, self.per_token = base_kwargs, per_token

    def kwargs(self, lengths: torch.Tensor, T: int) -> dict:
        ref = self.base["input_ids"]
        mask = _layout(lengths, T, self.side)
        index = per_example_positions(mask)  # each real token's index within its example
        ids = torch.where(index % 2 == 0, self.real_ids[0], self.real_ids[-1])
        ids = torch.where(mask, ids, torch.full_like(ids, self.pad_id))
        values = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX)),
            "token_type_ids": torch.zeros_like(ids),
            "position_ids": index,
        }
        out = dict(self.base)
        for key in self.per_token:
            out[key] = values[key].to(dtype=self.base[key].dtype, device=ref.device)
        return out

    def positions(self, lengths: torch.Tensor, T: int) -> list[torch.Tensor]:
        return _real_positions(lengths, T, self.side)


def _on_real_tokens(x0, x1, T0: int, T1: int, size: int, rows0, rows1, examples, differs) -> bool | None:
    """Whether example outputs on their real tokens differ (None: this output cannot be compared)."""
    if x0.dim() == 0:
        return None
    if int(x0.shape[0]) == size * T0 and int(x1.shape[0]) == size * T1 and size * T0 != size:  # (B·T, ...) flattened
        x0, x1 = x0.reshape(size, T0, *x0.shape[1:]), x1.reshape(size, T1, *x1.shape[1:])
    if int(x0.shape[0]) != size or int(x1.shape[0]) != size or x0.dim() != x1.dim():
        return None
    dims = []
    for d in range(1, x0.dim()):
        a, b = int(x0.shape[d]), int(x1.shape[d])
        if a == T0 and b == T1 and T0 != T1:
            dims.append(d)
        elif a != b:
            return None
    for i in examples:
        a, b = x0[i], x1[i]
        for d in dims:
            a = a.index_select(d - 1, rows0[i].to(a.device))
            b = b.index_select(d - 1, rows1[i].to(b.device))
        if differs(a, b):
            return True
    return False


def padding_problem(
    kwargs: dict,
    base_kwargs: dict,
    size: int,
    padding: Padding,
    outputs: Callable[[dict], list],
    differs: Callable,
    pad_id: int | None,
) -> str | None:
    """What the re-padding probe found (module docstring), or None: nothing, or nothing it can run on.

    ``base_kwargs``: the value probe's synthetic keywords (``size`` rows); ``outputs(kwargs)``: the
    model's output tensors for a call with ``kwargs`` (the value probe's pass); ``differs(a, b)``: the
    value probe's float-rounding comparison."""
    found = token_inputs(kwargs)
    if found is None:
        return None
    ids, mask = found
    T = int(ids.shape[1])
    if padding.length is not None:
        if padding.length != T:
            return (
                f"was called with a batch of {T} tokens while the run fixes every batch's length at "
                f"{padding.length} (pad_to_length): pad every batch to that length"
            )
        return None
    per_token = [
        k for k, v in kwargs.items() if torch.is_tensor(v) and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(ids.shape)
    ]
    if T < 2 or any(k not in _KNOWN for k in per_token):
        return None  # one token, or a per-token input whose padding is unknown: not interpreted
    pad = int(pad_id) if isinstance(pad_id, int) and not isinstance(pad_id, bool) and pad_id >= 0 else 0
    sides = (padding.side,) if padding.side is not None else sides_shown(mask)
    for side in sides:
        b = _Batches(base_kwargs, size, T, side, pad, per_token)
        k0, k1, k2 = b.kwargs(b.lengths0, b.T0), b.kwargs(b.lengths0, b.T1), b.kwargs(b.lengths2, b.T1)
        out0, out1, out2 = outputs(k0), outputs(k1), outputs(k2)
        rows0, rows1 = b.positions(b.lengths0, b.T0), b.positions(b.lengths0, b.T1)
        everyone = range(size)
        others = [i for i in everyone if i != b.mid]
        for later, examples, what in (
            (out1, everyone, "padding every example further (more masked positions) changed the examples'"),
            (out2, others, "making one example longer than the rest changed the other examples'"),
        ):
            if len(out0) != len(later):
                changed = True
            else:
                verdicts = [
                    _on_real_tokens(x, y, b.T0, b.T1, size, rows0, rows1, examples, differs)
                    for x, y in zip(out0, later, strict=True)
                ]
                changed = any(v is True for v in verdicts)
            if changed:
                return (
                    f"lets one example's length move the other examples' outputs: with the batch padded on the "
                    f"{side}, {what} outputs on their own tokens, so each example's "
                    "gradient depends on the longest row of its batch and per-example clipping bounds no "
                    "example's influence (a mean or other pooling over every position, pads included; positions "
                    f"counted from the batch's start under left padding); {WAY_OUT}"
                )
    return None


__all__ = ["SIDES", "Padding", "padding_problem", "per_example_positions", "sides_shown", "token_inputs"]
