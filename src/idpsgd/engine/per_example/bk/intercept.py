"""Book-keeping's forward interception: what runs in place of a book-kept module's ``forward``.

A covered layer's forward (:class:`BookKeptForward`) runs its rule's kernel in one autograd
function (:class:`_BookKeptOp`) whose backward hands the output gradient to the layer's record
(:class:`~.units.Layer`) and returns the input gradient only; on an input shared by the batch it
becomes a source of per-example gradients (:mod:`.shared`).  A whole-module fallback
(:class:`FallbackForward`) and a module using its own parameters directly (:class:`DirectForward`)
get their own forwards.  Each is the plain forward when the keeper is inactive or gradients are off,
and a deep copy (or pickle) of the module gets the plain forward back (:class:`_PlainForward`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..machinery import guard
from . import provenance
from .shared import BK_HINT, SharedTensor, Source, check_complete, distribute, parameter_use, same_rows


def override_forward(module: nn.Module, forward) -> None:
    """Have ``module`` run ``forward`` in place of its class's ``forward``: an instance attribute, which
    ``nn.Module.__call__`` finds first, so the module keeps its class, hooks and state dict (torch's way to
    patch one module's forward; Opacus's own wrappers do the same).  Every book-kept forward is installed here
    and taken away by :func:`plain_forward`, so none is left behind."""
    module.forward = forward


def plain_forward(module: nn.Module, kind: type | None = None) -> None:
    """``module`` runs its class's ``forward`` again (:func:`override_forward`); with ``kind``, only when its
    override is a ``kind`` (another wrapper's override stays)."""
    if kind is None or isinstance(module.__dict__.get("forward"), kind):
        module.__dict__.pop("forward", None)


class _BookKeptOp(torch.autograd.Function):
    """A covered layer's forward with its PyTorch kernel; its backward returns the input gradient
    only (None for the parameters: autograd never forms their summed gradient) and hands the output
    gradient to the layer's :class:`Layer` record."""

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
        layer.forwarded()
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


class BookKeptForward:
    """The covered module's ``forward`` while the book-keeper is attached: book-kept when the keeper
    is active and gradients are enabled, the module's own forward otherwise.  A deep copy (or a
    pickle) of the module gets its plain forward back."""

    def __init__(self, layer):
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
        mode.pause()
        try:
            if rows.dim == 0 and rows.group == 1:
                out = _BookKeptOp.apply(layer, None, x, *layer.params.values())
            else:
                out = self._rows(mode, x, rows)
        finally:
            mode.resume()
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
                mode.pause()
                try:
                    return _BookKeptOp.apply(layer, None, x, *layer.params.values())
                finally:
                    mode.resume()
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
        mode.pause()
        try:
            out = _BookKeptOp.apply(layer, _SharedUse(source, x, roots, whole), x, *layer.params.values())
        finally:
            mode.resume()
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


class FallbackForward:
    """A whole-module fallback's ``forward``: as it is on the batch; called on values shared by the batch only
    (Swin's relative-position bias module: a parameter table gathered by an index buffer, no input from the
    batch), its trainable parameters become values shared by the batch for the call (:func:`~.shared.parameter_use`),
    whose per-example gradients are collected where the output meets the batch."""

    def __init__(self, unit):
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
            unit.check_rows(mode, args, kwargs)
            mode.pause()
            try:
                out = type(module).forward(module, *args, **kwargs)
            finally:
                mode.resume()
            lead = next((t for t, r in zip(tree_flatten((args, kwargs))[0], rows, strict=False) if r is first), None)
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and lead is not None and t.dim() > 0 and t.shape[0] == lead.shape[0]:
                    mode.tags[t] = first
                elif _flattened(t, lead, first):  # (B, T, d) in, (B·T, E) out (a MoE router): each example's T rows
                    mode.tags[t] = provenance.Rows(0, first.group * (t.shape[0] // lead.shape[0]))
            return out
        from torch.nn.utils.stateless import _reparametrize_module

        shared = {n: parameter_use(p, f"{unit.name}.{n}", mode.batch, unit.sink(n)) for n, p in unit.params.items()}
        unit.skip_next_capture()
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


class DirectForward:
    """A :class:`DirectUnit` module's ``forward``: its own trainable parameters replaced, for the call, by
    the tensors :func:`~.shared.parameter_use` gives (plain forward when the keeper is inactive,
    gradients are off, or the call is not inside the model's forward)."""

    def __init__(self, unit):
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
