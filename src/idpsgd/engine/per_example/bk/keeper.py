"""Book-keeping clipping (``grad_sample_mode="bk"``): per-example clipped gradient sums in one backward
pass, with a clip norm per example.

Bu, Wang, Zha & Karypis 2023 ("Differentially private optimization on large model at small cost",
ICML, Alg. 1, *BK*) with Bu, Mao & Xu 2022's mixed ghost norms, generalised to a clip norm c_i per
example (IDP-SGD *Scale*'s c_p, Boenisch et al. 2023 §3.4; individual clipping, Yu et al. 2023
Alg. 3).  This module owns the :class:`BookKeeper`: it routes every covered layer's forward through
its rule (:mod:`.rules`), keeps per layer either (input, output gradient) or per-example gradients
in the one backward pass, and forms from them the per-example norms (:meth:`BookKeeper.norms`) and
the clipped sum Σ_i min(1, c_i/‖g_i‖) g_i (:meth:`BookKeeper.clipped_sum`).  Layers no rule covers
are *fallback units* (Opacus's per-sample gradient for that layer), modules using parameters
directly in forward are *direct units*; tied parameters (:mod:`.tied`) and values shared by the
batch (:mod:`.shared`, :mod:`.provenance`) are kept exactly.  Every trainable parameter is either
clipped per example or refused — never left with noise only or an un-clipped gradient.

User guide (what is covered, refused and measured): ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib

import torch
from opacus.grad_sample import AbstractGradSampleModule, GradSampleModule
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten, tree_unflatten

from ....validation import InvalidParameterError
from ..autograd import functorch_refuses, per_example_autograd
from ..machinery import forward_net, guard
from ..output_hooks import own_output, refuse_later_outputs
from . import provenance, routing
from .replay import Attribution
from .rules import Rule, acc, add_into, routed_rule, rule_for
from .shared import BK_HINT, SharedTensor, Source, check_complete, distribute, parameter_use, same_rows
from .tied import cross_term

GHOST, PER_SAMPLE, FALLBACK = "ghost norm", "per-sample gradient", "Opacus per-sample gradient (fallback)"
DIRECT = "per-sample gradient (parameters used in forward)"
#: plan_layers' kind for a module whose own parameters are used directly in its forward (:class:`_DirectUnit`)
DIRECT_UNIT = "direct"
#: the public rule of a layer that takes the ghost norm or the per-sample gradient by its shapes
BY_SHAPES = f"{GHOST} or {PER_SAMPLE}, by the layer's input shapes in each step (ghost when 2T² < d·p)"
ACCUMULATION_ERROR = (
    "Poisson sampling is not compatible with gradient accumulation: call optimizer.step() after "
    "every forward/backward pass, or use opacus.utils.batch_memory_manager.BatchMemoryManager"
)


class _BookKeptOp(torch.autograd.Function):
    """A covered layer's forward with its PyTorch kernel; its backward returns the input gradient
    only (None for the parameters: autograd never forms their summed gradient) and hands the output
    gradient to the layer's :class:`_Layer` record."""

    @staticmethod
    def forward(ctx, layer, shared, x, *params):
        out, saved = layer.rule.forward(layer.module, x)  # under the caller's autocast state
        if out._is_view():  # F.linear's (B·T, p) result viewed as (B, T, p): a custom Function's output that is a
            out = out.detach()  # view cannot be written in place (q /= s, h[~mask] = 0: legal autograd); an alias
            # can (it shares the version counter; no rule keeps its output for backward)
        ctx.layer, ctx.shared = layer, shared
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        ctx.save_for_backward(*saved)
        layer.pending += 1
        return out

    @staticmethod
    def backward(ctx, g):
        layer, shared = ctx.layer, ctx.shared
        saved = ctx.saved_tensors
        rest = (None,) * (len(ctx.needs_input_grad) - 3)
        # the input gradient under the forward's autocast state (as torch.amp.custom_bwd): the module's own
        where = lambda: f"layer {layer.name!r} ({type(layer.module).__name__}), its backward rule"  # noqa: E731
        with (
            torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]) if ctx.autocast else contextlib.nullcontext(),
            guard(where, "bk"),
        ):
            return _BookKeptOp._backward(ctx, layer, shared, saved, g, rest)

    @staticmethod
    def _backward(ctx, layer, shared, saved, g, rest):
        layer.keeper.mark_for_grad_scaler()
        if shared is None:
            gx = layer.rule.backward_input(layer.module, saved, g, ctx.needs_input_grad[2])
            layer.record(saved, g)
            return (None, None, gx, *rest)
        # an input shared by the batch: the per-example output gradients came from where the output met
        # the batch (shared.py); the input is the same for every example
        ctx.shared = None
        batch, source = shared.source.batch, shared.source
        check_complete(source, g)  # no part of g came through an operation the tracking missed
        lead = tuple(g.shape) if shared.whole else tuple(g.shape[1:])
        gb = source.grad.reshape((batch, *lead)) if source.grad is not None else g.new_zeros((batch, *lead))
        if shared.whole:
            saved_b = tuple(t.unsqueeze(0).expand((batch, *tuple(t.shape))) if t.dim() else t for t in saved)
        else:
            saved_b = tuple(t.expand((batch, *tuple(t.shape[1:]))) if t.dim() and t.shape[0] == 1 else t for t in saved)
        layer.record(saved_b, gb)
        if not shared.roots:
            return (None, None, layer.rule.backward_input(layer.module, saved, g, ctx.needs_input_grad[2]), *rest)
        gx = layer.rule.backward_input(layer.module, tuple(t.contiguous() for t in saved_b), gb, True)
        if gx is None:
            return (None, None, None, *rest)
        distribute(shared.input, shared.roots, gx.reshape((batch, *tuple(shared.input.shape))))
        return (None, None, gx.sum(0) if shared.whole else gx.sum(0, keepdim=True), *rest)


class _SharedUse:
    """A covered layer's forward on an input shared by the batch: its output's :class:`~.shared.Source`,
    the input's sources when the input is itself batch-independent (per-example input gradients
    go to them), and whether the input is one value taken whole (``whole``: the examples' copies
    are stacked in a new leading dimension) or has a leading dimension of 1 that the batch replaces."""

    def __init__(self, source: Source, input_tensor, roots, whole: bool = False):
        self.source, self.input, self.roots, self.whole = source, input_tensor, roots, whole


class _BookKeptForward:
    """The covered module's ``forward`` while the book-keeper is attached: book-kept when the keeper
    is active and gradients are enabled, the module's own forward otherwise.  A deep copy (or a
    pickle) of the module gets its plain forward back."""

    def __init__(self, layer: _Layer):
        self.layer = layer

    def __call__(self, *args, **kwargs):
        layer = self.layer
        module = layer.module
        if not args and len(kwargs) == 1:  # the layer's one input by keyword (self.proj(input=x))
            args, kwargs = tuple(kwargs.values()), {}
        if not args:
            return type(module).forward(module, **kwargs)
        x, args = args[0], args[1:]
        if args or kwargs or not (layer.keeper.active and torch.is_grad_enabled()):
            return type(module).forward(module, x, *args, **kwargs)
        mode = provenance.current()
        if mode is None:  # outside the model's forward (a layer called on its own): as a batch
            x = layer.rule.prepare(module, x)
            return _BookKeptOp.apply(layer, None, x, *layer.params.values())
        return self.apply(mode, x)

    def apply(self, mode, x):
        """The layer on ``x`` inside the model's forward: book-kept as the provenance of ``x`` says."""
        layer = self.layer
        module = layer.module
        if isinstance(x, nn.Parameter) and id(x) in mode.sources:  # a covered parameter fed to a layer
            x = mode.make_source(x, mode.batch)
        rows = mode.tags.get(x) if torch.is_tensor(x) and not isinstance(x, SharedTensor) else None
        x = layer.rule.prepare(module, x)  # (under autocast: the input cast as autocast casts it)
        if isinstance(x, SharedTensor):
            return self._shared(x, mode)
        if rows is None:  # not derived from the batch: shared by it, whatever its shape
            return self._shared(x, mode)
        if not rows.known:
            raise provenance.refusal(f"layer {layer.name!r} ({type(module).__name__})", rows)
        mode.paused += 1
        try:
            if rows.dim == 0 and rows.group == 1:
                out = _BookKeptOp.apply(layer, None, x, *layer.params.values())
            else:
                out = self._rows(mode, x, rows)
        finally:
            mode.paused -= 1
        mode.tags[out] = rows
        return out

    def _rows(self, mode, x, rows):
        """A row-wise layer on batch rows that are not (B, ...) with one example per row: the batch
        dimension moved to the front and the rows of one example grouped, (B·T, d) → (B, T, d)."""
        layer = self.layer
        trailing = layer.rule.trailing(layer.module)
        if trailing is None or rows.dim >= x.dim() - trailing:
            raise RuntimeError(
                f"grad_sample_mode='bk': layer {layer.name!r} ({type(layer.module).__name__}) gets its input with "
                f"the batch in dimension {rows.dim} (rows grouped by {rows.group}); this layer type needs the "
                "batch as the leading dimension, one example per row: move it there (x.movedim(...)), or use "
                "grad_sample_mode='hooks'"
            )
        xb = x.movedim(rows.dim, 0)
        shape = tuple(xb.shape)
        if rows.group != 1:
            xb = xb.reshape((shape[0] // rows.group, rows.group, *shape[1:]))
        out = _BookKeptOp.apply(layer, None, xb, *layer.params.values())
        if rows.group != 1:
            out = out.reshape((shape[0], *tuple(out.shape[2:])))
        return out.movedim(0, rows.dim)

    def _shared(self, x, mode):
        """The layer on an input shared by the batch (not derived from it): a source of per-example
        gradients (:mod:`.shared`), its output batch-independent.  A row-wise layer takes the input
        whole, as one value (a (T, T) bucket index, a relative-position table); any other layer needs
        it with a leading dimension of 1."""
        layer = self.layer
        batch = mode.batch
        expand = False
        roots = ()
        if isinstance(x, SharedTensor):
            x, roots, batch = x._plain, x._roots, x._batch
            if batch == 0 and x.dim() > 0 and x.shape[0] == 0:  # an empty batch: nothing to attribute
                mode.paused += 1
                try:
                    return _BookKeptOp.apply(layer, None, x, *layer.params.values())
                finally:
                    mode.paused -= 1
            if x.dim() > 0 and x.shape[0] == batch and batch > 1 and x.stride(0) == 0:
                x, expand = x.narrow(0, 0, 1), True  # rows of one value (an expand to the batch)
        elif not x.requires_grad and same_rows(x, x.dim(), batch):
            x, expand = x.narrow(0, 0, 1), True  # B identical rows not from the batch (arange(T).repeat(B, 1))
        elif x.requires_grad:
            raise RuntimeError(
                f"grad_sample_mode='bk': layer {layer.name!r} ({type(layer.module).__name__}) got an input "
                "that requires a gradient but is not derived from the batch nor tracked as shared by it: it "
                "is computed from a parameter book-keeping does not track (a fallback layer's output, a "
                "parameter frozen in one place and used in another); per-example gradients are undefined "
                "there; use grad_sample_mode='hooks'"
            )
        trailing = layer.rule.trailing(layer.module)
        whole = trailing is not None and x.dim() > trailing
        if not whole and (x.dim() == 0 or x.shape[0] != 1):
            raise RuntimeError(
                f"grad_sample_mode='bk': layer {layer.name!r} ({type(layer.module).__name__}) got an input of "
                f"shape {tuple(x.shape)} that is not derived from the batch, without a leading dimension of 1; "
                f"{BK_HINT}"
            )
        source = Source(layer.name, batch)
        mode.paused += 1
        try:
            out = _BookKeptOp.apply(layer, _SharedUse(source, x, roots, whole), x, *layer.params.values())
        finally:
            mode.paused -= 1
        shared = SharedTensor.wrap(out, ((out, source),), batch)
        return shared.expand((batch, *tuple(out.shape[1:]))) if expand else shared

    def __deepcopy__(self, memo):
        return _PlainForward(memo.get(id(self.layer.module), self.layer.module))

    def __reduce__(self):
        return _PlainForward, (self.layer.module,)


class _PlainForward:
    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def _row_norms_sq(gs: torch.Tensor) -> torch.Tensor:
    """‖G_i‖² of each example's gradient (B, ...), without a squared copy of G (float32 for half G)."""
    flat = acc(gs).reshape(gs.shape[0], 1, -1)
    return torch.bmm(flat, flat.transpose(1, 2)).reshape(-1)


def _weighted_sum(w: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i G_i, accumulated in float32 for half G (the factors are never rounded to half precision)."""
    gs = acc(gs)
    return torch.einsum("b,b...->...", w.to(gs.dtype), gs)


def _drop_rows(t, mask: torch.Tensor):
    """``t`` with the rows of the examples in ``mask`` zeroed (a copy; floating tensors of that batch only)."""
    if not torch.is_tensor(t) or not t.is_floating_point() or t.dim() == 0 or t.shape[0] != mask.shape[0]:
        return t
    return t.masked_fill(mask.view((-1,) + (1,) * (t.dim() - 1)), 0)


def per_example_sink(part, name: str):
    """Where the per-example gradients (B, …) of ``part``'s parameter ``name`` go when it is used as a value
    shared by the batch: added into ``part.grad_sample`` (one batch size per step)."""

    def add(g):
        n = int(g.shape[0])
        if part.batch is not None and n != part.batch:
            raise ValueError(
                f"layer {part.name!r} saw batches of different sizes (private: not shown) before "
                f"optimizer.step(); {ACCUMULATION_ERROR}"
            )
        part.batch = n
        add_into(part.grad_sample, {name: g.reshape((n, *tuple(part.params[name].shape)))})

    return add


class _Layer:
    """One covered layer: its rule, its trainable parameters, and what the current backward pass kept."""

    def __init__(self, keeper: BookKeeper, name: str, module: nn.Module, rule):
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

    @property
    def recorded(self) -> bool:
        return self.batch is not None

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

    def sink(self, name: str):
        """Where the per-example gradients of parameter ``name`` used directly in the forward go (a value
        shared by the batch, :meth:`BookKeeper.parameter_source`)."""

        return per_example_sink(self, name)

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
            return sum(_row_norms_sq(gs) for gs in self.grad_sample.values())
        return None

    def clipped_sum(self, w: torch.Tensor) -> dict:
        out = self.rule.ghost_clipped_sum(self.module, self.uses, w) if self.uses else {}
        for name, gs in self.grad_sample.items():
            add_into(out, {name: _weighted_sum(w, gs)})
        return {self.params[k]: v for k, v in out.items() if k in self.params}

    def drop(self, mask: torch.Tensor) -> None:
        """Zero what this pass kept for the examples in ``mask`` (their gradients overflowed)."""
        self.uses = [(tuple(_drop_rows(t, mask) for t in saved), _drop_rows(g, mask)) for saved, g in self.uses]
        self.grad_sample = {k: _drop_rows(v, mask) for k, v in self.grad_sample.items()}


class _FallbackUnit:
    """A module no rule covers: Opacus's per-sample gradients for it (registered grad sampler for its
    own parameters, or functorch for the whole module), captured with forward/backward hooks as
    Opacus's ``GradSampleModule`` does.  Autograd also forms these parameters' summed gradients;
    the optimizer discards them."""

    def __init__(self, keeper: BookKeeper, name: str, module: nn.Module):
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
            module.forward = _FallbackForward(self)
        self.handles = [module.register_forward_hook(self._capture, with_kwargs=True)]
        self.clear()

    def clear(self) -> None:
        self.grad_sample: dict = {}
        self.batch: int | None = None
        self.activations = []
        self.eval_forwards = 0  # forwards in eval mode (no activations captured, as Opacus)
        self.untrained: str | None = None

    @property
    def recorded(self) -> bool:
        return self.batch is not None

    def _capture(self, module, inputs, kwargs, _output):
        if self._skip_capture:  # a call on values shared by the batch (_FallbackForward)
            self._skip_capture = False
            return
        # a deep copy of the model copies this hook with no keeper (BookKeeper.__deepcopy__): the copy is plain
        if self.keeper is not None and self.keeper.active and torch.is_grad_enabled():
            mode = provenance.current()
            if mode is not None:
                self._check_rows(mode, inputs, kwargs)
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
            first = next((t for t in tree_flatten(_output)[0] if torch.is_tensor(t) and t.requires_grad), None)
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

    def _check_rows(self, mode, inputs, kwargs) -> None:
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

    def norm_sq(self):
        if not self.grad_sample:
            return None
        return sum(_row_norms_sq(gs) for gs in self.grad_sample.values())

    def clipped_sum(self, w: torch.Tensor) -> dict:
        return {self.params[n]: _weighted_sum(w, gs) for n, gs in self.grad_sample.items()}

    def drop(self, mask: torch.Tensor) -> None:
        self.grad_sample = {k: _drop_rows(v, mask) for k, v in self.grad_sample.items()}

    def sink(self, name: str):
        """Where the per-example gradients of parameter ``name`` go when the module is called on values shared
        by the batch (its parameters then used as values shared by it, :class:`_FallbackForward`)."""

        return per_example_sink(self, name)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.module.__dict__.pop("forward", None)


class _FallbackForward:
    """A whole-module fallback's ``forward``: as it is on the batch; called on values shared by the batch only
    (Swin's relative-position bias module: a parameter table gathered by an index buffer, no input from the
    batch), its trainable parameters become values shared by the batch for the call (:func:`~.shared.parameter_use`),
    whose per-example gradients are collected where the output meets the batch."""

    def __init__(self, unit: _FallbackUnit):
        self.unit = unit

    def __call__(self, *args, **kwargs):
        unit = self.unit
        module = unit.module
        mode = provenance.current()
        if mode is None or not (unit.keeper.active and torch.is_grad_enabled()):
            return type(module).forward(module, *args, **kwargs)
        rows = [mode.tags.get(t) for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
        first = next((r for r in rows if r is not None), None)
        if first is not None:
            # on the batch: functorch re-runs the module per example (its rows), so its own operations are
            # not tracked; its output has the rows of its first batch input (the module acts per example
            # along its leading dimension: functorch's and Opacus's assumption for a module no rule covers)
            unit._check_rows(mode, args, kwargs)
            mode.paused += 1
            try:
                out = type(module).forward(module, *args, **kwargs)
            finally:
                mode.paused -= 1
            lead = next((t for t, r in zip(tree_flatten((args, kwargs))[0], rows, strict=False) if r is first), None)
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and lead is not None and t.dim() > 0 and t.shape[0] == lead.shape[0]:
                    mode.tags[t] = first
                elif _flattened(t, lead, first):  # (B, T, d) in, (B·T, E) out (a MoE router): each example's T rows
                    mode.tags[t] = provenance.Rows(0, first.group * (t.shape[0] // lead.shape[0]))
            return out
        from torch.nn.utils.stateless import _reparametrize_module

        shared = {n: parameter_use(p, f"{unit.name}.{n}", mode.batch, unit.sink(n)) for n, p in unit.params.items()}
        unit._skip_capture = True
        with _reparametrize_module(module, shared):
            return type(module).forward(module, *args, **kwargs)

    def __deepcopy__(self, memo):
        return _PlainForward(memo.get(id(self.unit.module), self.unit.module))

    def __reduce__(self):
        return _PlainForward, (self.unit.module,)


def _flattened(t, lead, rows) -> bool:
    """Whether a fallback's output ``t`` has its batch input's rows flattened with the next dimension:
    ``lead`` (B, k, ...) with one example per row in, ``t`` (B·k, ...) out."""
    return (
        torch.is_tensor(t)
        and lead is not None
        and rows.group == 1
        and lead.dim() > 1
        and t.dim() > 0
        and t.shape[0] == lead.shape[0] * lead.shape[1]
    )


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


class _DirectUnit:
    """A module no rule covers, with trainable submodules, whose own parameters its forward uses directly
    (ViT's class token and position embedding, added to and concatenated with activations): during
    that forward each own parameter is replaced by a batch-independent value (:mod:`.shared`)
    whose per-example gradients are collected where it meets the batch.  Its submodules are layers
    of their own.  A use the book-keeper cannot attribute is refused in the forward."""

    def __init__(self, keeper: BookKeeper, name: str, module: nn.Module):
        self.keeper, self.name, self.module = keeper, name, module
        self.params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        module.forward = _DirectForward(self)
        self.clear()

    def clear(self) -> None:
        self.grad_sample: dict = {}
        self.batch: int | None = None

    @property
    def recorded(self) -> bool:
        return self.batch is not None

    def sink(self, name: str):
        return per_example_sink(self, name)

    def norm_sq(self):
        if not self.grad_sample or not self.batch:
            return None
        return sum(_row_norms_sq(gs) for gs in self.grad_sample.values())

    def clipped_sum(self, w: torch.Tensor) -> dict:
        return {self.params[n]: _weighted_sum(w, gs) for n, gs in self.grad_sample.items()}

    def drop(self, mask: torch.Tensor) -> None:
        self.grad_sample = {k: _drop_rows(v, mask) for k, v in self.grad_sample.items()}

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


class _DirectForward:
    """A :class:`_DirectUnit` module's ``forward``: its own trainable parameters replaced, for the call, by
    the tensors :func:`~.shared.parameter_use` gives (plain forward when the keeper is inactive,
    gradients are off, or the call is not inside the model's forward)."""

    def __init__(self, unit: _DirectUnit):
        self.unit = unit

    def __call__(self, *args, **kwargs):
        unit = self.unit
        module = unit.module
        batch = unit.keeper.step_batch
        if batch is None or not (unit.keeper.active and torch.is_grad_enabled()):
            return type(module).forward(module, *args, **kwargs)
        own = module._parameters
        saved = {n: own[n] for n in unit.params}
        try:
            for n, p in unit.params.items():
                own[n] = parameter_use(p, f"{unit.name}.{n}", batch, unit.sink(n))
            return type(module).forward(module, *args, **kwargs)
        finally:
            own.update(saved)

    def __deepcopy__(self, memo):
        return _PlainForward(memo.get(id(self.unit.module), self.unit.module))

    def __reduce__(self):
        return _PlainForward, (self.unit.module,)


class Routed:
    """The plan of a covered layer's subclass whose own forward calls the base class's
    (:func:`~.rules.routed_rule`): its rule applies where that forward's operation meets the weight."""

    def __init__(self, rule, fn, pos):
        self.rule, self.fn, self.pos = rule, fn, pos

    def __repr__(self):
        return f"Routed({type(self.rule).__name__} at {getattr(self.fn, '__name__', self.fn)})"


_BASES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv1d, nn.Conv2d)


def _unit_kind(module: nn.Module, rule):
    """How a module owning trainable parameters is book-kept: its rule; ``DIRECT_UNIT`` when no rule and no
    Opacus grad sampler covers it, it has trainable submodules (functorch over the whole module would
    take them off their own rules), and each own trainable parameter has a leading dimension of 1 —
    shaped to broadcast over the batch, as ViT's class token (1, 1, d) and position embedding
    (1, N, d): own parameters tracked through its forward; else None (a fallback unit: Opacus's grad
    sampler, or functorch over the whole module, which any forward of independent examples allows)."""
    if rule is not None or type(module) in GradSampleModule.GRAD_SAMPLERS:
        return rule
    routed = routed_rule(module)
    if routed is not None:
        return Routed(*routed)
    if isinstance(module, _BASES) and type(module).forward not in {b.forward for b in _BASES}:
        return DIRECT_UNIT  # a layer's subclass with a forward of its own (FalconLinear: x @ W.T + b)
    mine = {id(p) for p in module.parameters(recurse=False)}
    if any(p.requires_grad and id(p) not in mine for p in module.parameters()):
        return DIRECT_UNIT  # own parameters used directly, trainable submodules on their own rules
    return None


def _check_rule_parameters(name: str, module: nn.Module, rule) -> None:
    extra = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad and n not in rule.parameters]
    if extra:
        raise InvalidParameterError(
            "module",
            f"layer {name!r} ({type(module).__name__}) with trainable parameter(s) {', '.join(extra)}",
            f"grad_sample_mode='bk' trains only {', '.join(rule.parameters)} of this layer type, so they would "
            "receive noise only (e.g. the deprecated torch.nn.utils.weight_norm's weight_g/weight_v: use "
            "torch.nn.utils.parametrizations.weight_norm, which book-keeping trains as a fallback layer); or "
            "freeze them",
        )


def _aliases_only(module: nn.Module) -> bool:
    """Whether every parameter ``module`` registers itself is also a parameter of one of its submodules (Opacus's
    ``RenameParamsMixin``: DPLSTM's ``weight_ih_l0`` is its cell's ``l0.ih.weight``, an RNNLinear): the module
    is a container whose submodules own the parameters (functorch over it would reparametrize the alias only,
    and the cells would keep the real ones: per-example gradients of zero)."""
    own = list(module.parameters(recurse=False))
    if not own:
        return False
    below = {id(p) for child in module.children() for p in child.parameters()}
    return all(id(p) in below for p in own)


def plan_layers(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(name, module, rule, ``DIRECT_UNIT`` or None for a fallback unit) for every module owning trainable
    parameters, as Opacus's ``GradSampleModule`` walks a model (a module reached twice is planned
    once); a module with a parametrization (``torch.nn.utils.parametrize``, e.g.
    ``parametrizations.weight_norm``: its parameters live in ``parametrizations.<name>.original*``)
    is one fallback unit with its whole subtree.  A parameter shared by covered layers is tied (cross
    terms, :mod:`.tied`); one shared with any other unit is refused, as is a covered layer owning
    a trainable parameter its rule does not train (it would get noise only)."""
    plan, owner, seen = [], {}, set()

    def walk(module, prefix):
        if id(module) in seen:
            return
        seen.add(id(module))
        parametrized = parametrize.is_parametrized(module)
        if not parametrized and _aliases_only(module):  # Opacus's DPLSTM/DPGRU/DPRNN: a container
            for child_name, child in module.named_children():
                walk(child, f"{prefix}.{child_name}" if prefix else child_name)
            return
        if any(p.requires_grad for p in module.parameters(recurse=False)) or (
            parametrized and any(p.requires_grad for p in module.parameters())
        ):
            rule = None if parametrized else rule_for(module)
            name = prefix or type(module).__name__
            if rule is not None:
                _check_rule_parameters(name, module, rule)
            kind = None if parametrized else _unit_kind(module, rule)
            if isinstance(kind, Routed):
                _check_rule_parameters(name, module, kind.rule)
            whole = kind is None and type(module) not in GradSampleModule.GRAD_SAMPLERS
            params = module.parameters(recurse=whole)
            covered = kind is not None and kind != DIRECT_UNIT
            for p in params:
                if not p.requires_grad:
                    continue
                if id(p) in owner and not (covered and owner[id(p)][1]):
                    raise InvalidParameterError(
                        "module",
                        f"a parameter shared by {owner[id(p)][0]!r} and {name!r}",
                        "grad_sample_mode='bk' ties parameters only between layers it covers (Linear, Embedding, "
                        "...); use grad_sample_mode='hooks'",
                    )
                owner.setdefault(id(p), (name, covered))
            plan.append((name, module, kind))
            if whole:
                return
        for child_name, child in module.named_children():
            walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    walk(model, "")
    return plan


class BookKeeper:
    """The book-keeping machinery attached to one model (one per model, shared by the training wrapper
    and the per-example norm passes; :meth:`attach`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.active = False
        self.loss_reduction = "mean"
        self.forbid_accumulation = False
        self.layers: list[_Layer] = []
        self.units: list[_FallbackUnit] = []
        self.direct: list[_DirectUnit] = []
        self.tied: list[list[tuple[_Layer, str]]] = []  # (layer, parameter name) of each tied parameter's uses
        self._batches: list[int | None] = []  # the batch size of each model forward in progress
        self._modes: list = []  # the provenance mode of each model forward in progress (None: none entered)
        self.attribution = Attribution(model)  # provenance traced once per signature, then replayed (.replay)
        self._routes: dict = {}  # id(weight) -> (functional operation, weight position, layer's forward)
        self._sources: dict = {}  # id(parameter) -> the keeper's parameter_source (covered layers' parameters)
        self._owner: dict = {}  # id(parameter) -> (layer, name)
        self._leaked: set[str] = set()
        self._handles = []
        self._dropped: torch.Tensor | None = None
        #: the modules' parameters as the rules see them after the backward pass (FSDP2 swaps the unsharded
        #: tensors back in: engine/distributed/fsdp.py); by default the model's own
        self.parameter_view = contextlib.nullcontext
        self.user_level = None  # user level: rows -> users, norms per user (:meth:`set_user_level`, ..units)
        #: the batch dimension of the model's tensor arguments: 0, or 1 for batch-second (T, B, ...) inputs
        #: (``batch_first=False``: what the loader yields, declared by the user, never read off the shapes)
        self.batch_dim = 0
        self._plan()

    def activate(self, loss_reduction: str | None = None) -> None:
        """Record in the coming forward and backward passes (the step's, not a norm pass's:
        :meth:`recording_sums`), with the optimizer's ``loss_reduction`` when given."""
        if loss_reduction is not None:
            self.loss_reduction = loss_reduction
        self.active = True

    def deactivate(self) -> None:
        """Record nothing until :meth:`activate` (the wrapper's hooks disabled)."""
        self.active = False

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside (the net's second, plain run of the model), then as before."""
        active = self.active
        self.active = False
        try:
            yield
        finally:
            self.active = active

    def forbid_accumulation_of_batches(self, forbid: bool) -> None:
        """Whether a second forward before the step is refused (Opacus's ``forbid_grad_accumulation``)."""
        self.forbid_accumulation = forbid

    def set_batch_dim(self, batch_dim: int) -> None:
        """Where the loader's batch is in the model's tensor arguments: 0, or 1 for batch-second (T, B, ...)
        inputs (``batch_first=False``, the user's declaration; provenance tags the batch there)."""
        self.batch_dim = batch_dim

    def set_user_level(self, user_level) -> None:
        """Rows to users for the coming passes (user level: ``BookKeepingUsers``, engine/clipping/users.py),
        or None."""
        self.user_level = user_level

    @contextlib.contextmanager
    def recording_sums(self):
        """A per-example norm pass (``engine/per_example/norms.py``): recording on, the "sum" loss reduction (each
        example's own loss gradient), accumulation allowed, no user level; the keeper's settings and an
        empty record after it."""
        saved = self.active, self.loss_reduction, self.forbid_accumulation, self.user_level
        self.active, self.loss_reduction, self.forbid_accumulation, self.user_level = True, "sum", False, None
        self.clear()
        try:
            yield self
        finally:
            self.clear()
            self.active, self.loss_reduction, self.forbid_accumulation, self.user_level = saved

    def _trainable(self) -> frozenset:
        return frozenset(id(p) for p in self.model.parameters() if p.requires_grad)

    def _plan(self) -> None:
        self.planned = self._trainable()  # the trainable parameters the plan covers
        try:
            uses: dict[int, list] = {}
            for name, module, kind in plan_layers(self.model):
                if kind is None:
                    self.units.append(_FallbackUnit(self, name, module))
                    continue
                if kind == DIRECT_UNIT:
                    unit = _DirectUnit(self, name, module)
                    self.direct.append(unit)
                    params = unit.params
                else:
                    routed = kind if isinstance(kind, Routed) else None
                    layer = _Layer(self, name, module, routed.rule if routed else kind)
                    self.layers.append(layer)
                    forward = _BookKeptForward(layer)
                    if routed:  # its own forward runs; the rule applies at the base class's operation
                        self._routes[id(module.weight)] = (routed.fn, routed.pos, forward)
                    else:
                        module.forward = forward
                    params = layer.params
                    for pname, p in params.items():
                        uses.setdefault(id(p), []).append((layer, pname))
                        if type(p).__name__ != "DTensor":  # FSDP2's forward uses the unsharded tensors, not p
                            self._sources[id(p)] = p
                        self._owner.setdefault(id(p), (layer, pname))
                for pname, p in params.items():
                    if len(uses.get(id(p), ())) <= 1:  # one leak hook per parameter
                        self._handles.append(p.register_hook(self._leak_hook(f"{name}.{pname}")))
            self.tied = [group for group in uses.values() if len(group) > 1]
            self._row_maps = routing.install(self, self.model)  # frozen MoE dispatches: row-by-row maps
            self._handles.append(self.model.register_forward_pre_hook(_BatchHook(self, True), with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(_BatchHook(self, False), always_call=True))
        except BaseException:
            self.detach()
            raise
        covered = [p for layer in self.layers for p in layer.params.values()]
        self._marker = min(covered, key=lambda p: p.numel()) if covered else None

    def _unplan(self) -> None:
        for layer in self.layers:
            layer.module.__dict__.pop("forward", None)
        for unit in [*self.units, *self.direct]:
            unit.remove()
        for h in self._handles:
            h.remove()
        routing.remove(getattr(self, "_row_maps", ()))
        self.layers, self.units, self.direct, self.tied, self._handles = [], [], [], [], []
        self._routes, self._sources, self._owner = {}, {}, {}

    def refresh(self) -> None:
        """Plan the model anew if its trainable parameters changed since it was planned (a layer
        unfrozen after the first norm pass would otherwise be left out of the norms)."""
        if self._trainable() != self.planned:
            self._unplan()
            self._leaked = set()
            self._plan()

    @classmethod
    def attach(cls, model: nn.Module) -> BookKeeper:
        """The model's book-keeper, created on first use (kept as a plain attribute, not a submodule);
        planned anew when the model's trainable parameters changed."""
        keeper = model.__dict__.get("_idpsgd_bookkeeper")
        if keeper is None:
            keeper = cls(model)
            object.__setattr__(model, "_idpsgd_bookkeeper", keeper)
        else:
            keeper.refresh()
        return keeper

    def __deepcopy__(self, memo):  # a copied (or pickled) model gets its own book-keeper when it needs one
        return None

    def __reduce__(self):
        return type(None), ()

    @property
    def step_batch(self) -> int | None:
        """The batch size of the model forward in progress: the batch dimension (:attr:`batch_dim`) of its
        first tensor argument that has one, None outside the model's forward."""
        return self._batches[-1] if self._batches else None

    def _enter(self, _module, args, kwargs):
        batch = None
        mode = None
        if self.active and torch.is_grad_enabled():
            bd = self.batch_dim
            leaves = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t) and t.dim() > bd]
            batch = int(leaves[0].shape[bd]) if leaves else None
            if batch is not None and provenance.current() is None:
                mode = self.attribution.open(batch, args, kwargs, bd)  # traced, or the signature's plan replayed
                if isinstance(mode, provenance.ProvenanceMode):
                    rows = provenance.BATCH if bd == 0 else provenance.Rows(bd)
                    for t in leaves:  # the loader's batch (batch-first, or batch-second): the tensors of B rows there
                        if int(t.shape[bd]) == batch:
                            mode.tags[t] = rows
                    mode.routes, mode.sources, mode.make_source = self._routes, self._sources, self.parameter_source
                mode.__enter__()
        self._batches.append(batch)
        self._modes.append(mode)

    def _exit(self, *output):
        if self._batches:
            self._batches.pop()
        mode = self._modes.pop() if self._modes else None
        if mode is not None:
            mode.__exit__(None, None, None)
            try:
                if output:  # an auxiliary loss of the whole batch among the outputs (a MoE's load balancing): refused
                    routing.refuse_mixed_outputs(mode, output[0])
            finally:
                self.attribution.close(mode)

    def parameter_source(self, p: torch.Tensor, batch: int) -> torch.Tensor:
        """The tensor an operation of the forward uses for a covered layer's parameter ``p`` used directly
        (outside its layer's own operation: DeBERTa's relative-position table fed to a LayerNorm): a value
        shared by the batch whose per-example gradients go to the layer's record (:func:`.shared.parameter_use`)."""
        layer, name = self._owner[id(p)]
        return parameter_use(p, f"{layer.name}.{name}", batch, layer.sink(name))

    def _leak_hook(self, qualified: str):
        def hook(grad):  # a covered parameter's autograd gradient is None unless it was used elsewhere
            if grad is not None and self.active:
                self._leaked.add(qualified)

        return hook

    def detach(self) -> None:
        """Remove the forward overrides and hooks (the model is plain again)."""
        self._unplan()
        if self.model.__dict__.get("_idpsgd_bookkeeper") is self:
            del self.model.__dict__["_idpsgd_bookkeeper"]

    # --- one backward pass --------------------------------------------------------------------
    def mark_for_grad_scaler(self) -> None:
        """Give the smallest covered parameter a zero ``.grad`` after a book-kept backward pass.

        ``torch.amp.GradScaler`` checks the optimizer's ``.grad`` tensors for inf/nan and refuses to
        ``update()`` when it found none to check; covered parameters get no autograd gradient.  The
        zeros are data-independent, so the scaler never sees an overflow of the private gradients
        (its scale must not depend on them; the private optimizer handles overflowed examples,
        :meth:`norms`).  Discarded by the optimizer step as every covered ``.grad``."""
        marker = self._marker
        if marker is not None and marker.grad is None:
            marker.grad = torch.zeros_like(marker)

    @property
    def parts(self):
        return [*self.layers, *self.units, *self.direct]

    def _recorded(self):
        if self._leaked:
            names = sorted(self._leaked)
            self.clear()
            raise RuntimeError(
                f"parameter(s) {', '.join(names)} received an un-clipped gradient outside the "
                "forward of the layers book-keeping covers (a functional use of layer.weight, or a "
                "module called outside the model's forward): grad_sample_mode='bk' cannot clip it; "
                "use grad_sample_mode='hooks'"
            )
        untrained = [f"layer {u.name!r} ({type(u.module).__name__}) {u.untrained}" for u in self.units if u.untrained]
        if untrained:
            self.clear()
            raise RuntimeError("; ".join(untrained))
        new = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in self.planned]
        if new:
            self.clear()
            raise RuntimeError(
                f"parameter(s) {', '.join(new)} became trainable after book-keeping planned the model: "
                "they have no per-example gradient and would receive noise only; call make_private "
                "again after changing requires_grad"
            )
        parts = [p for p in self.parts if p.recorded]
        batches = {p.batch for p in parts}
        if len(batches) > 1:
            self.clear()
            shared = (
                (
                    " (a layer fed an input of batch size 1, shared by the batch, is book-kept only inside the "
                    "model's forward, whose first tensor argument has the batch size)"
                )
                if 1 in batches
                else ""
            )
            accumulated = any(getattr(p, "completed", 0) > 1 for p in parts)  # two backward passes before a step
            raise ValueError(
                f"layers saw different batch sizes in one step (the sizes are private: not shown){shared}; "
                + (
                    ACCUMULATION_ERROR
                    if accumulated
                    else "a layer was called on rows of another batch than the model's forward (e.g. outside it)"
                )
            )
        return parts, (batches.pop() if batches else None)

    def scale(self, batch: int, loss_scale: float = 1.0) -> float:
        """Output gradients × scale = the per-example loss's gradients (Opacus's convention: a "mean"
        loss is divided by the batch size; a ``GradScaler``'s scaled loss by its ``loss_scale``)."""
        if self.user_level is not None:  # user level: the loss is a mean over the rows, not the users
            batch = self.user_level.rows_batch
        return (float(batch) if self.loss_reduction == "mean" else 1.0) / float(loss_scale)

    @torch.no_grad()
    def norms(self, loss_scale: float = 1.0) -> torch.Tensor:
        """‖g_i‖ of every example of the current backward pass (in batch order), of the loss before
        a ``GradScaler``'s scaling by ``loss_scale`` (so the scale changes no clipping decision).

        An example whose kept gradients overflowed (inf/nan: half precision under autocast) has norm
        inf; :meth:`clipped_sum` then leaves it out (its clip factor is 0), a function of that example
        alone, so the step's sensitivity bound holds and the step is taken and charged as any step.
        (Skipping the whole step, as ``GradScaler`` does, would reveal a data-dependent event that
        no privacy guarantee covers.)"""
        parts, batch = self._recorded()
        if batch is None:
            raise RuntimeError(
                "no per-example gradients were recorded: call loss.backward() on the model's "
                "output before optimizer.step()"
            )
        if batch == 0:  # an empty Poisson batch
            ref = next(iter(parts[0].params.values()))
            return torch.zeros(0, dtype=ref.dtype, device=ref.device)
        if self.user_level is not None:  # user level: records regrouped, one "example" per user (..units)
            parts, batch = self.user_level.regroup(self, parts, batch)
        total = None
        with self.parameter_view():
            for part in parts:
                sq = part.norm_sq()
                if sq is not None:
                    total = sq if total is None else total + sq
            for group in self.tied:  # 2 Σ_{l<m} ⟨G_i^(l), G_i^(m)⟩ of each tied parameter (bk_tied)
                for k, (x, name_x) in enumerate(group):
                    for y, name_y in group[k + 1 :]:
                        cross, how = cross_term(x, name_x, y, name_y, batch)
                        if cross is not None:
                            total = total + 2 * cross
                            x.cross_taken.setdefault(y.name, set()).add(how)
                            y.cross_taken.setdefault(x.name, set()).add(how)
        norms = total.clamp_min(0).sqrt() * self.scale(batch, loss_scale)
        finite = torch.isfinite(norms)
        self._dropped = None
        if not bool(finite.all()):
            self._dropped = ~finite
            norms = norms.masked_fill(self._dropped, float("inf"))
        return norms

    @torch.no_grad()
    def clipped_sum(self, factors: torch.Tensor, loss_scale: float = 1.0) -> dict:
        """{parameter: Σ_i factors_i · g_i} over the current backward pass (zero for parameters that
        received nothing; examples whose gradients overflowed left out); call after :meth:`norms`
        with the same ``loss_scale``."""
        parts, batch = self._recorded()
        out = {}
        if batch:
            w = factors * self.scale(batch, loss_scale)
            if self._dropped is not None:
                w = w.masked_fill(self._dropped, 0)
                for part in parts:
                    part.drop(self._dropped)
            with self.parameter_view():
                for part in parts:
                    add_into(out, part.clipped_sum(w))  # a tied parameter: the sum of its layers' contributions
        return out

    def clear(self) -> None:
        """Forget the current backward pass (after a step, or after a refused one)."""
        for part in self.parts:
            part.clear()
        self._leaked = set()
        self._dropped = None

    @property
    def rules(self) -> dict[str, str]:
        """Layer name → how its per-example norms are computed, as a function of the model only
        (public): a ghost-capable layer that can also form per-sample gradients (Linear,
        convolutions) takes either by its input shapes in each step (:data:`BY_SHAPES`); a tied
        parameter's layers name each other."""
        out = {
            layer.name: _static_path(layer.rule) + "".join(f"; tied with {other!r}" for other in self._ties(layer))
            for layer in self.layers
        }
        out.update({unit.name: FALLBACK for unit in self.units})
        out.update({unit.name: DIRECT for unit in self.direct})
        return out

    @property
    def paths(self) -> dict[str, str]:
        """Layer name → the paths its per-example norms took so far (:attr:`rules` for a layer that took
        none yet).  Private: with inputs padded per batch, the ghost/per-sample choice depends on the
        batch's longest sequence."""
        out = self.rules
        for layer in self.layers:
            if layer.paths_taken:
                out[layer.name] = " and ".join(sorted(layer.paths_taken)) + "".join(
                    f"; tied with {other!r}"
                    + (
                        f" (cross term: {' and '.join(sorted(layer.cross_taken[other]))})"
                        if layer.cross_taken.get(other)
                        else ""
                    )
                    for other in self._ties(layer)
                )
        return out

    def _ties(self, layer: _Layer) -> list[str]:
        """The other layers that share a parameter with ``layer``."""
        return [
            other.name
            for group in self.tied
            if any(x is layer for x, _ in group)
            for other, _ in group
            if other is not layer
        ]


def _static_path(rule) -> str:
    if not rule.ghost_capable:
        return PER_SAMPLE
    if rule.always_ghost or type(rule).per_sample is Rule.per_sample:  # never the per-sample path
        return GHOST
    return BY_SHAPES


class _BatchHook:
    """The model's forward pre-hook (``enter``) and hook: the keeper's :attr:`BookKeeper.step_batch`.  A
    deep copy (or a pickle) of the model gets a hook that does nothing."""

    def __init__(self, keeper: BookKeeper | None, enter: bool):
        self.keeper, self.enter = keeper, enter

    def __call__(self, module, args, *rest):
        if self.keeper is not None and self.enter:
            self.keeper._enter(module, args, rest[0])
        elif self.keeper is not None:
            self.keeper._exit(*rest[-1:])

    def __deepcopy__(self, memo):
        return _BatchHook(None, self.enter)

    def __reduce__(self):
        return _BatchHook, (None, self.enter)


def summarize_paths(paths: dict[str, str]) -> str:
    """One line: which layers take which path."""
    groups: dict[str, list[str]] = {}
    for name, path in paths.items():
        groups.setdefault(path, []).append(name)
    return "; ".join(f"{path}: {', '.join(names)}" for path, names in groups.items()) or "no trainable layers"


class BookKeepingModule(AbstractGradSampleModule):
    """The user's module for ``grad_sample_mode="bk"`` (an Opacus ``AbstractGradSampleModule``, so
    Opacus's utilities and DPDDP see the wrapper they expect).  Its forward is the user's module's;
    the book-keeper records during the backward pass, and the optimizer
    (:class:`~...noise.optimizer.IndividualizedDPOptimizerBookKeeping`) reads the clipped sum from it."""

    def __init__(self, m: nn.Module, *, keeper: BookKeeper, batch_first: bool = True, loss_reduction: str = "mean"):
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self.keeper = keeper
        keeper.set_batch_dim(0 if batch_first else 1)  # (T, B, ...) inputs: provenance tags the batch at dim 1
        self.keeper.activate(loss_reduction)

    def forward(self, *args, **kwargs):
        return forward_net(self._module, self._plain, self._module, "bk", args, kwargs)

    @contextlib.contextmanager
    def _plain(self):
        """The model's forward without book-keeping (the net's second run, :func:`~..machinery.forward_net`)."""
        with self.keeper.paused():
            yield

    @property
    def layer_paths(self) -> dict[str, str]:
        """The paths the layers took (private; :attr:`layer_path_rules` for the public rule)."""
        return self.keeper.paths

    @property
    def layer_path_rules(self) -> dict[str, str]:
        return self.keeper.rules

    def forbid_grad_accumulation(self):
        self.keeper.forbid_accumulation_of_batches(True)

    def allow_grad_accumulation(self):
        self.keeper.forbid_accumulation_of_batches(False)

    def disable_hooks(self) -> None:
        self.keeper.deactivate()

    def enable_hooks(self) -> None:
        self.keeper.activate()

    def remove_hooks(self) -> None:
        self.keeper.detach()

    def zero_grad(self, set_to_none: bool = False):
        self.keeper.clear()
        super().zero_grad(set_to_none)
