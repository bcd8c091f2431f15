"""What every rule shares: the :class:`Rule` interface, float32 accumulation of half-precision values
(:func:`acc`), autocast's input casts (:func:`autocast_input`), chunks of examples bounded in memory
(:data:`CHUNK_FLOATS`), the Gram-matrix ghost norm, and the code comparison that matches transformers'
layers by what their forward computes (:func:`same_code`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: floats held at once by a chunk of per-example temporaries (unfolded patches, Gram matrices)
CHUNK_FLOATS = 1 << 23

HALF = (torch.float16, torch.bfloat16)


def acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` ready for accumulation: float32 if it is half precision (kept under autocast), else as is."""
    return t.float() if t.dtype in HALF else t


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in HALF else dtype


#: (operation, device type, autocast dtype, input dtype, weight dtype) -> the dtype autocast computes in
_AUTOCAST_DTYPE: dict = {}
_PROBES = {  # each layer's own operation on one-element tensors of the input's and the weight's dtypes
    "linear": lambda x, w: F.linear(x.new_ones(1, 1), w.new_ones(1, 1)),
    "addmm": lambda x, w: torch.addmm(w.new_ones(1), x.new_ones(1, 1), w.new_ones(1, 1)),
    "conv1d": lambda x, w: F.conv1d(x.new_ones(1, 1, 1), w.new_ones(1, 1, 1)),
    "conv2d": lambda x, w: F.conv2d(x.new_ones(1, 1, 1, 1), w.new_ones(1, 1, 1, 1)),
    "layer_norm": lambda x, w: F.layer_norm(x.new_ones(1, 2), (2,), w.new_ones(2), w.new_ones(2)),
    "group_norm": lambda x, w: F.group_norm(x.new_ones(1, 2, 1), 1, w.new_ones(2), w.new_ones(2)),
    "instance_norm": lambda x, w: F.instance_norm(x.new_ones(1, 1, 2), weight=w.new_ones(1), bias=w.new_ones(1)),
}


def autocast_input(x: torch.Tensor, op: str, weight: torch.Tensor) -> torch.Tensor:
    """``x`` cast to the dtype ``torch.autocast`` runs ``op`` in for inputs like ``x`` and ``weight``
    (unchanged outside autocast).  Autocast's lists differ by device (CPU keeps ``layer_norm`` in
    the input's dtype, CUDA runs it in float32; both run ``linear`` in the autocast dtype), so the
    dtype is read off the operation itself, once per (device, dtypes).  The cast is an ordinary
    differentiable one, applied before the book-kept operation: autograd casts the input gradient
    back, as autocast's own casts do."""
    if not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        return x
    device = x.device.type
    key = (op, device, torch.get_autocast_dtype(device), x.dtype, weight.dtype)
    dtype = _AUTOCAST_DTYPE.get(key)
    if dtype is None:
        with torch.no_grad():
            dtype = _AUTOCAST_DTYPE[key] = _PROBES[op](x.detach(), weight.detach()).dtype
    return x if dtype == x.dtype else x.to(dtype)


def same_code(fn, reference, names=("torch",)) -> bool:
    """``fn`` compiles to the same code as ``reference`` (a verbatim copy of a known forward) and sees
    the same objects under the global ``names`` it uses: it computes exactly what ``reference`` does."""
    code, want = getattr(fn, "__code__", None), reference.__code__
    if code is None or getattr(fn, "__closure__", None) or getattr(fn, "__defaults__", None) != reference.__defaults__:
        return False
    fields = (
        "co_code",
        "co_consts",
        "co_names",
        "co_varnames",
        "co_argcount",
        "co_posonlyargcount",
        "co_kwonlyargcount",
    )
    return all(getattr(code, f) == getattr(want, f) for f in fields) and all(
        fn.__globals__.get(n) is reference.__globals__[n] for n in names
    )


def chunks(n: int, per_example: int):
    """Slices of at most CHUNK_FLOATS / per_example examples (at least one)."""
    step = max(1, CHUNK_FLOATS // max(1, int(per_example)))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def rows(t: torch.Tensor, s: slice) -> torch.Tensor:
    """``t``'s examples in the chunk ``s`` of :func:`chunks`: ``t`` itself when the chunk holds all of them (the
    common case: no view to dispatch, issue 50's host work per step)."""
    return t if s.start == 0 and s.stop >= t.shape[0] else t[s]


def joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """A layer's uses' tensors joined along ``dim`` (the positions): the one use's own tensor, however strided,
    when the layer was called once (the common case) — a concatenation of one tensor is a copy (of the unfolded
    patches, transposed: about half of a ghost norm's time on the CIFAR CNN's 8×8 convolutions)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def gram_norm_sq(a: torch.Tensor, b: torch.Tensor, bias: float = 0.0) -> torch.Tensor:
    """Σ_{t,t'} (a_t·a_t' + bias)(b_t·b_t') per example (and per group): a (..., T, d), b (..., T, p).  ``bias`` 1
    adds the squared norm of a bias's per-example gradient Σ_t b_t (a weight on a constant input 1)."""
    if a.shape[-2] == 1:
        return ((a * a).sum((-2, -1)) + bias) * (b * b).sum((-2, -1))
    grams = torch.matmul(a, a.transpose(-1, -2))
    if bias:
        grams += bias
    return (grams * torch.matmul(b, b.transpose(-1, -2))).sum((-2, -1))


class Rule:
    """A layer type's book-keeping formulas (stateless; see the module docstring)."""

    #: ghost-capable (keeps (a, b) when the ghost norm is cheaper) or always per-sample
    ghost_capable = False
    #: a ghost-capable layer that always takes the ghost norm (its ``per_sample``, if any, serves only
    #: the cross terms of tied parameters, :mod:`.tied`)
    always_ghost = False
    #: the names of the layer's own parameters the rule trains (any other trainable parameter the
    #: layer owns is refused by the planner: it would get noise only)
    parameters: tuple[str, ...] = ("weight", "bias")

    @staticmethod
    def covers(module: nn.Module) -> bool:
        raise NotImplementedError

    def trailing(self, module) -> int | None:
        """How many trailing dimensions the layer's operation acts on (a row-wise layer: any dimensions
        before them are rows, wherever the batch dimension is among them); None when the operation
        needs the batch as its leading dimension (convolutions, group normalisation)."""
        return None

    def prepare(self, module, x):
        """Differentiable preprocessing outside the book-kept operation (default: none)."""
        return x

    def forward(self, module, x):
        """(output, tensors to keep for backward)."""
        raise NotImplementedError

    def backward_input(self, module, saved, g, need_input: bool):
        raise NotImplementedError

    def batch_size(self, saved) -> int:
        return int(saved[0].shape[0])

    # --- one backward pass ------------------------------------------------------------------
    def prefers_ghost(self, module, uses) -> bool:
        return False

    def per_sample(self, module, saved, g) -> dict[str, torch.Tensor]:
        """{parameter name: (B, *shape)} per-example gradients of this use (trainable parameters)."""
        raise NotImplementedError

    def ghost_norm_sq(self, module, uses) -> torch.Tensor:
        raise NotImplementedError

    def ghost_clipped_sum(self, module, uses, w) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def add_into(total: dict, parts: dict) -> None:
    for k, v in parts.items():
        total[k] = v if k not in total else total[k] + v


def trainable(module, name) -> bool:
    p = getattr(module, name, None)
    return isinstance(p, nn.Parameter) and p.requires_grad


def own_forward(module, base) -> bool:
    """The module's forward is ``base``'s (a subclass that keeps the layer's semantics, e.g. Opacus's RNNLinear)."""
    return isinstance(module, base) and type(module).forward is base.forward
