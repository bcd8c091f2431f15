"""Book-keeping's units: what the book-keeper (:mod:`.keeper`) keeps per module in the one backward pass.

A *unit* is one of three kinds, each answering the :class:`Unit` protocol (``recorded``, ``norm_sq``,
``clipped_sum``, ``drop``, ``clear``, ``sink``): a covered :class:`Layer` (its rule, :mod:`.rules`: input and
output gradient kept for the ghost norm, or per-example gradients), a :class:`FallbackUnit` (a module no
rule covers: Opacus's grad sampler, or functorch over the whole module) and a :class:`DirectUnit` (a
module whose forward uses its own parameters directly, as values shared by the batch, :mod:`.shared`).
What the kinds share — per-example gradients, their norms, weighted sum and dropped rows — is
:class:`_PerExampleGradients`.  Path names (:data:`GHOST`, :data:`PER_SAMPLE`, ...) are what
:attr:`~.keeper.BookKeeper.rules` reports per unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from opacus.grad_sample import GradSampleModule
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..autograd import functorch_refuses, per_example_autograd
from ..machinery import guard
from ..output_hooks import first_needing_grad, own_output, refuse_later_outputs
from . import provenance
from .intercept import DirectForward, FallbackForward, override_forward, plain_forward
from .rules import acc, add_into
from .shared import BK_HINT

GHOST, PER_SAMPLE, FALLBACK = "ghost norm", "per-sample gradient", "Opacus per-sample gradient (fallback)"
DIRECT = "per-sample gradient (parameters used in forward)"
ACCUMULATION_ERROR = (
    "Poisson sampling is not compatible with gradient accumulation: call optimizer.step() after "
    "every forward/backward pass, or use opacus.utils.batch_memory_manager.BatchMemoryManager"
)


def _row_norms_sq(gs: torch.Tensor) -> torch.Tensor:
    """‖G_i‖² of each example's gradient (B, ...), without a squared copy of G (float32 for half G)."""
    flat = acc(gs).reshape(gs.shape[0], 1, -1)
    return torch.bmm(flat, flat.transpose(1, 2)).reshape(-1)


def _weighted_sum(w: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i G_i, accumulated in float32 for half G (the factors are never rounded to half precision)."""
    gs = acc(gs)
    return torch.matmul(w.to(gs.dtype), gs.reshape(gs.shape[0], -1)).reshape(gs.shape[1:])  # (an einsum's dispatch
    # costs about 10 µs more a call: 76 calls a step on GPT-2's twelve blocks)


def _drop_rows(t, mask: torch.Tensor):
    """``t`` with the rows of the examples in ``mask`` zeroed (a copy; floating tensors of that batch only)."""
    if not torch.is_tensor(t) or not t.is_floating_point() or t.dim() == 0 or t.shape[0] != mask.shape[0]:
        return t
    return t.masked_fill(mask.view((-1,) + (1,) * (t.dim() - 1)), 0)


class Unit(Protocol):
    """What the book-keeper (:class:`~.keeper.BookKeeper`) calls on each unit it keeps per module: a covered
    :class:`Layer`, a :class:`FallbackUnit` or a :class:`DirectUnit`."""

    name: str
    module: nn.Module
    params: dict  # parameter name -> the trainable parameter
    batch: int | None  # the examples of the current backward pass (None: nothing recorded)

    @property
    def recorded(self) -> bool: ...

    def clear(self) -> None:
        """Forget the current backward pass."""

    def sink(self, name: str) -> Callable[[torch.Tensor], None]:
        """Where the per-example gradients of parameter ``name`` used as a value shared by the batch go."""

    def norm_sq(self) -> torch.Tensor | None:
        """(B,) Σ over the unit's parameters of ‖g_i‖² (un-scaled), None when nothing was kept."""

    def clipped_sum(self, w: torch.Tensor) -> dict:
        """{parameter: Σ_i w_i g_i}."""

    def drop(self, mask: torch.Tensor) -> None:
        """Zero what the pass kept for the examples in ``mask`` (their gradients overflowed)."""

    def regroup(self, sum_rows: Callable, num_users: int, regroup_use: Callable | None = None) -> None:
        """What the pass kept, by user instead of by row (user level: ``engine/clipping/users.py``)."""


class _PerExampleGradients:
    """What the units share: per-example gradients kept as ``grad_sample`` {name: (B, *shape)}, their norms,
    weighted sum and dropped rows, and the sink of a parameter used as a value shared by the batch."""

    params: dict
    grad_sample: dict
    batch: int | None

    @property
    def recorded(self) -> bool:
        return self.batch is not None

    def sink(self, name: str):
        """Where the per-example gradients of parameter ``name`` go when it is used as a value shared by the
        batch (:meth:`~.keeper.BookKeeper.parameter_source`, :class:`~.intercept.FallbackForward`,
        :class:`~.intercept.DirectForward`): added into ``grad_sample`` (one batch size per step)."""

        def add(g):
            n = int(g.shape[0])
            if self.batch is not None and n != self.batch:
                raise ValueError(
                    f"layer {self.name!r} saw batches of different sizes (private: not shown) before "
                    f"optimizer.step(); {ACCUMULATION_ERROR}"
                )
            self.batch = n
            add_into(self.grad_sample, {name: g.reshape((n, *tuple(self.params[name].shape)))})

        return add

    def norm_sq(self):
        if not self.grad_sample:
            return None
        total = None
        for gs in self.grad_sample.values():
            total = _row_norms_sq(gs) if total is None else total + _row_norms_sq(gs)
        return total

    def clipped_sum(self, w: torch.Tensor) -> dict:
        return {self.params[n]: _weighted_sum(w, gs) for n, gs in self.grad_sample.items()}

    def drop(self, mask: torch.Tensor) -> None:
        self.grad_sample = {k: _drop_rows(v, mask) for k, v in self.grad_sample.items()}

    def regroup(self, sum_rows, num_users: int, regroup_use=None) -> None:
        """What the pass kept, by user instead of by row, in place (exact: a user's gradient is the sum of its
        rows'): the per-example gradients summed by ``sum_rows`` ((rows, ...) -> (users, ...)); ``num_users`` the
        batch from then on.  ``regroup_use`` is for a covered layer's ghost records (:meth:`Layer.regroup`)."""
        self.grad_sample = {k: sum_rows(acc(v)) for k, v in self.grad_sample.items()}
        self.batch = num_users


class Layer(_PerExampleGradients):
    """One covered layer: its rule, its trainable parameters, and what the current backward pass kept."""

    def __init__(self, keeper, name: str, module: nn.Module, rule):
        self.keeper, self.name, self.module, self.rule = keeper, name, module, rule
        self.params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        self.per_sample_size = sum(int(p.numel()) for p in self.params.values())  # numbers per example
        self.paths_taken: set[str] = set()
        self.cross_taken: dict[str, set[str]] = {}  # tied parameter's other layer -> how its cross term was computed
        self.clear()

    def clear(self) -> None:
        self.uses: list = []  # (saved tensors, output gradient) kept for the ghost norm
        self.deferred: list = []  # (saved tensors, output gradient) of per-sample uses, for later
        self.grad_sample: dict = {}  # per-example gradients summed over the per-sample uses
        self.batch: int | None = None
        self.pending = self.completed = 0

    def forwarded(self) -> None:
        """One more forward of the layer whose backward (:meth:`record`) is still to come."""
        self.pending += 1

    def record(self, saved, g) -> None:
        n = self.rule.batch_size(saved)
        if self.batch is not None and n != self.batch:
            raise ValueError(
                f"layer {self.name!r} saw batches of different sizes before optimizer.step() (the sizes are "
                f"private: not shown); {ACCUMULATION_ERROR}"
            )
        self.batch = n
        self.pending -= 1
        if self.pending <= 0:
            self.pending = 0
            self.completed += 1
            if self.completed > 1 and self.keeper.forbid_accumulation:
                raise ValueError(ACCUMULATION_ERROR)
        if n == 0:  # an empty Poisson batch: nothing to keep
            return
        if self.rule.ghost_capable and self.rule.prefers_ghost(self.module, [(saved, g)]):
            self.uses.append((saved, g.detach()))
        elif self.rule.ghost_capable and self._kept_size(saved, g) < self.per_sample_size:
            self.deferred.append((saved, g.detach()))  # the per-sample gradients are larger: form them at the end
        else:
            add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))

    @staticmethod
    def _kept_size(saved, g) -> int:
        """Numbers per example of a use's input and output gradient."""
        return sum(int(t[0].numel()) for t in saved) + int(g[0].numel())

    def norm_sq(self) -> torch.Tensor:
        """Σ over this layer's parameters of ‖g_i‖² (un-scaled output gradients); settles the path."""
        for saved, g in self.deferred:  # per-sample gradients formed after the backward pass, when
            add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))  # activations are freed
        self.deferred = []
        if self.uses and (self.grad_sample or not self.rule.prefers_ghost(self.module, self.uses)):
            for saved, g in self.uses:  # mixed shapes, or several uses past the ghost break-even
                add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))
            self.uses = []
        if self.uses:  # settled above: ghost uses, or per-sample gradients, not both
            self.paths_taken.add(GHOST)
            return self.rule.ghost_norm_sq(self.module, self.uses)
        if self.grad_sample:
            self.paths_taken.add(PER_SAMPLE)
        return super().norm_sq()

    def clipped_sum(self, w: torch.Tensor) -> dict:
        out = self.rule.ghost_clipped_sum(self.module, self.uses, w) if self.uses else {}
        for name, gs in self.grad_sample.items():
            add_into(out, {name: _weighted_sum(w, gs)})
        return {self.params[k]: v for k, v in out.items() if k in self.params}

    def drop(self, mask: torch.Tensor) -> None:
        """Zero what this pass kept for the examples in ``mask`` (their gradients overflowed)."""
        self.uses = [(tuple(_drop_rows(t, mask) for t in saved), _drop_rows(g, mask)) for saved, g in self.uses]
        super().drop(mask)

    def regroup(self, sum_rows, num_users: int, regroup_use=None) -> None:
        """As every unit's (:meth:`_PerExampleGradients.regroup`), its records first: with ``regroup_use``
        (Linear and Embedding on the ghost path: a user's rows become one longer sequence) each record, the
        deferred ones too, becomes a user's, so the ghost norm, the ghost cross terms of tied parameters and the
        ghost clipped sum apply to users as they are; without, every record becomes per-example gradients first."""
        if regroup_use is not None:
            records = [*self.uses, *self.deferred]
            self.uses = [regroup_use(saved, g) for saved, g in records]
            self.deferred = []
        else:
            for saved, g in self.deferred:
                add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))
            self.deferred = []
            for saved, g in self.uses:
                add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))
            self.uses = []
        super().regroup(sum_rows, num_users)


class FallbackUnit(_PerExampleGradients):
    """A module no rule covers: Opacus's per-sample gradients for it (registered grad sampler for its
    own parameters, or functorch for the whole module), captured with forward/backward hooks as
    Opacus's ``GradSampleModule`` does.  Autograd also forms these parameters' summed gradients;
    the optimizer discards them."""

    def __init__(self, keeper, name: str, module: nn.Module):
        self.keeper, self.name, self.module = keeper, name, module
        self.sampler = GradSampleModule.GRAD_SAMPLERS.get(type(module))
        whole = self.sampler is None
        self.whole = whole
        named = module.named_parameters() if whole else module.named_parameters(recurse=False)
        self.params = {n: p for n, p in named if p.requires_grad}
        self._names = {id(p): n for n, p in self.params.items()}
        self.activations: list = []
        self._skip_capture = False
        if whole:
            override_forward(module, FallbackForward(self))
        self.handles = [module.register_forward_hook(self._capture, with_kwargs=True)]
        self.clear()

    def clear(self) -> None:
        self.grad_sample: dict = {}
        self.batch: int | None = None
        self.activations = []
        self.eval_forwards = 0  # forwards in eval mode (no activations captured, as Opacus)
        self.untrained: str | None = None

    def skip_next_capture(self) -> None:
        """The next forward is a call on values shared by the batch (:class:`~.intercept.FallbackForward`):
        its forward hook captures nothing."""
        self._skip_capture = True

    def _capture(self, module, inputs, kwargs, _output):
        if self._skip_capture:  # a call on values shared by the batch (FallbackForward)
            self._skip_capture = False
            return
        # a deep copy of the model copies this hook with no keeper (BookKeeper.__deepcopy__): the copy is plain
        if self.keeper is not None and self.keeper.active and torch.is_grad_enabled():
            mode = provenance.current()
            if mode is not None:
                self.check_rows(mode, inputs, kwargs)
            if module.training:
                detach = lambda t: t.detach() if torch.is_tensor(t) else t  # noqa: E731
                batched = None
                if self.whole:  # which tensors are the batch's (per example), the rest passed whole
                    leaves = tree_flatten((inputs, kwargs))[0]
                    # rows per example of each leaf of the call (None: passed whole); of the output too
                    batched = [
                        _group(mode.tags.get(t))
                        if mode is not None
                        else (1 if t.dim() > 0 else None)
                        if torch.is_tensor(t)
                        else None
                        for t in leaves
                    ]
                    out = next((t for t in tree_flatten(_output)[0] if torch.is_tensor(t)), None)
                    out_group = _group(mode.tags.get(out)) if mode is not None and out is not None else 1
                    if out_group is None:
                        raise RuntimeError(
                            f"grad_sample_mode='bk': layer {self.name!r} ({type(module).__name__}) is a fallback whose "
                            "output is not batch-first rows of the examples (by provenance): its per-example "
                            "gradients cannot be formed; use grad_sample_mode='hooks'"
                        )
                    batched = (batched, out_group, mode.batch if mode is not None else None)
                self.activations.append(
                    ([detach(t) for t in inputs], {k: detach(v) for k, v in kwargs.items()}, batched)
                )
            else:
                self.eval_forwards += 1
            # the output's gradient, by a hook on the output tensor (no module backward hook, which an in-place
            # operation on the output, or an output shared by the batch, breaks; a view output copied, whose
            # hook an in-place write would skip: .output_hooks)
            first = first_needing_grad(_output)
            _output, out = own_output(_output)
            if out is not None:
                out.register_hook(lambda g: self._backward(module, None, (g,)))
                where = lambda: f"layer {self.name!r} ({type(module).__name__}, a fallback)"  # noqa: E731
                refuse_later_outputs(_output, first, (inputs, kwargs), self.params.values(), where, "bk")
            return _output
        return None

    def _backward(self, module, _grad_input, grad_output):
        with guard(lambda: f"layer {self.name!r} ({type(module).__name__}, a fallback), its per-sample gradient", "bk"):
            self._backward_unguarded(module, grad_output)

    def _backward_unguarded(self, module, grad_output):
        if self.keeper is None or not self.keeper.active:
            return
        if not self.activations:
            if self.eval_forwards and any(p.requires_grad for p in self.params.values()):
                self.untrained = (
                    "ran its forward in eval mode, so Opacus's per-sample gradient (fallback) captured "
                    "nothing and its parameters would receive noise only: call model.train() before "
                    "training (Opacus refuses this too), or freeze its parameters"
                )
            return
        g = grad_output[0].detach()
        activations, kwargs, batched = self.activations.pop()
        n = batched[2] if self.whole and batched[2] is not None else int(g.shape[0])  # examples (rows may be grouped)
        if self.batch is not None and n != self.batch:
            raise ValueError(
                f"layer {self.name!r} saw batches of different sizes (private: not shown) before "
                f"optimizer.step(); {ACCUMULATION_ERROR}"
            )
        self.batch = n
        if self.batch == 0:
            return
        got = set()
        if self.whole:
            grads = _functorch_per_sample(module, activations, kwargs, batched, g, self.params)
        else:
            grads = self.sampler(module, activations, g)
        for p, gs in grads.items():
            if id(p) in self._names:
                got.add(self._names[id(p)])
                add_into(self.grad_sample, {self._names[id(p)]: gs})
        missing = [n for n, p in self.params.items() if p.requires_grad and n not in got]
        if missing:
            self.untrained = (
                f"got no per-sample gradient from Opacus's grad sampler for {', '.join(missing)}: they "
                "would receive noise only; use grad_sample_mode='hooks'"
            )

    def check_rows(self, mode, inputs, kwargs) -> None:
        """A fallback's per-example gradients (functorch over the first dimension, or Opacus's grad sampler)
        need its batch inputs batch-first, one example per row: refused otherwise, by provenance."""
        rows = [mode.tags.get(t) for t in tree_flatten((inputs, kwargs))[0] if torch.is_tensor(t)]
        for r in rows:
            if r is not None and not r.known:
                raise provenance.refusal(f"layer {self.name!r} ({type(self.module).__name__}, a fallback)", r)
            if r is not None and not (r.dim == 0 and (self.whole or r.group == 1)):
                raise RuntimeError(
                    f"grad_sample_mode='bk': layer {self.name!r} ({type(self.module).__name__}) is a fallback "
                    f"(Opacus's per-sample gradient) and gets the batch in dimension {r.dim} (rows grouped by "
                    f"{r.group}); a fallback needs it as the leading dimension (one example per row, or a module no "
                    "grad sampler covers: contiguous rows of one example); use "
                    "grad_sample_mode='hooks'"
                )
        if not any(r is not None for r in rows):
            raise RuntimeError(
                f"grad_sample_mode='bk': layer {self.name!r} ({type(self.module).__name__}) is a fallback "
                "(Opacus's per-sample gradient) called on values that are not derived from the batch (shared "
                f"by it): its per-example gradients are not defined by its inputs' rows; {BK_HINT}"
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        plain_forward(self.module)


def _group(rows) -> int | None:
    """Rows per example of a tensor whose batch is its leading dimension (None: not one)."""
    return rows.group if rows is not None and rows.known and rows.dim == 0 else None


def _functorch_per_sample(module, args, kwargs, batched, g, params) -> dict:
    """{parameter: (B, *shape)} per-example gradients of a whole module (a fallback no rule or grad sampler
    covers): ``torch.func`` over the examples of its original call — every positional and keyword argument,
    tensors of the batch split per example (``batched``), everything else passed as it was."""
    from torch.func import grad, vmap
    from torch.nn.utils.stateless import _reparametrize_module

    groups, out_group, batch = batched
    batch = int(g.shape[0]) // out_group if batch is None else batch
    leaves, spec = tree_flatten((list(args), kwargs))
    trainable = {n: p.detach() for n, p in params.items()}
    frozen = {n: t for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in trainable}
    # each example's rows: (B·k, ...) → (B, k, ...), so that vmap hands example i its k rows (MoE experts
    # called on a decoder's (B·T, d) token rows: each example's tokens, with their routing)
    per = [t.reshape((batch, k, *tuple(t.shape[1:]))) for t, k in zip(leaves, groups, strict=True) if k is not None]

    def loss(tr, per_example, g_i):
        it = iter(per_example)
        filled = [next(it) if k is not None else t for t, k in zip(leaves, groups, strict=True)]
        a, kw = tree_unflatten(filled, spec)
        with _reparametrize_module(module, {**frozen, **tr}):
            out = module.forward(*a, **kw)  # the module's forward without its hooks (this unit's capture)
        out = out if torch.is_tensor(out) else next(t for t in tree_flatten(out)[0] if torch.is_tensor(t))
        return (out * g_i.to(out.dtype)).sum()

    g = g.reshape((batch, out_group, *tuple(g.shape[1:])))
    try:
        grads = vmap(grad(loss), in_dims=(None, 0, 0))(trainable, per, g)
    except RuntimeError as exc:  # data-dependent control flow (MoE routing): one example at a time
        if functorch_refuses(exc):  # an old-style autograd.Function: plain autograd, one example at a time
            grads = per_example_autograd(lambda i, tr: loss(tr, [t[i] for t in per], g[i]), trainable, batch)
            return {params[n]: gs for n, gs in grads.items()}
        if "vmap" not in str(exc):
            raise
        each = [grad(loss)(trainable, [t[i] for t in per], g[i]) for i in range(batch)]
        grads = {n: torch.stack([e[n] for e in each]) for n in trainable}
    return {params[n]: gs for n, gs in grads.items()}


class DirectUnit(_PerExampleGradients):
    """A module no rule covers, with trainable submodules, whose own parameters its forward uses directly
    (ViT's class token and position embedding, added to and concatenated with activations): during
    that forward each own parameter is replaced by a batch-independent value (:mod:`.shared`)
    whose per-example gradients are collected where it meets the batch.  Its submodules are layers
    of their own.  A use the book-keeper cannot attribute is refused in the forward."""

    def __init__(self, keeper, name: str, module: nn.Module):
        self.keeper, self.name, self.module = keeper, name, module
        self.params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        override_forward(module, DirectForward(self))
        self.clear()

    def clear(self) -> None:
        self.grad_sample: dict = {}
        self.batch: int | None = None

    def norm_sq(self):
        return super().norm_sq() if self.batch else None  # an empty batch's sink: nothing to norm

    def remove(self) -> None:
        plain_forward(self.module)
