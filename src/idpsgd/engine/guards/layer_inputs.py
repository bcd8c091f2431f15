"""Opacus's per-layer modes attribute a layer's gradient to examples only where they can: refused otherwise.

``hooks``, ``functorch`` and ``ghost`` form each example's gradient (or norm) of a layer's parameters from
that layer's own input and output gradient, captured by hooks on the layer, and take the leading dimension
of its input for the examples.  Two uses break this, both independent of the data:

* a layer called on a tensor whose leading dimension is not the batch — a value shared by the batch (a
  (T, T) relative-position bucket index fed to an Embedding, T5's and MPNet's relative attention bias),
  or rows of several examples: its T rows are taken for examples — refused by Opacus's row count when
  T ≠ B (or a torch error in ghost mode), **silently wrong** when T = B (measured: norms 3e-3, clipped
  sum 2e-2 relative off per-example autograd on a tiny relative-bias model);
* a layer's parameter used only outside the layer's own forward, the layer never called
  (``F.conv1d(x, self.conv.weight)``, ``self.pos.weight[ids]``): its hooks never run, so the parameter has
  no per-example gradient (Opacus's "not initialized" error at the step, an ``AttributeError`` in ghost
  mode).  A layer that runs and whose weight is also used elsewhere is the decomposition check's
  (:mod:`.decomposition`).

Book-keeping (``grad_sample_mode="bk"``) attributes both by provenance (:mod:`.bk.provenance`), so the
refusal names it.  The check runs once per model, in the batch-independence check's synthetic pass
(:mod:`.batch_independence`: a public batch whose size B is a prime dividing no other dimension, so a
(T, T) input never has B rows): a forward pre-hook on every module owning trainable parameters records the
leading dimension of its first positional tensor input, and a torch function mode the operations that use
a parameter while its module's forward is not running.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode, resolve_name

from ..opacus_compat import UnsupportedModuleError

#: the modes whose per-example gradients come from each layer's own hooks (:mod:`.modes`)
PER_LAYER_MODES = frozenset({"hooks", "functorch", "ghost"})
#: layers whose input is not batch-first by design (their Opacus grad sampler reads the batch elsewhere)
_OWN_LAYOUT = (nn.EmbeddingBag,)


#: operations on a parameter through which no gradient reaches it
_NOT_A_USE = frozenset({torch.Tensor.detach, torch.detach, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel})


class LayerAttributionError(UnsupportedModuleError):
    """A layer whose per-example gradients the mode's per-layer hooks cannot form."""


class _ParameterUses(TorchFunctionMode):
    """Records ((its modules, parameter name), operation) for each operation using a trainable parameter outside
    its modules' forward (``active`` holds the modules whose forward is running)."""

    def __init__(self, owner: dict, active: list):
        super().__init__()
        self.owner, self.active, self.outside = owner, active, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _NOT_A_USE or not (torch.is_tensor(out) or isinstance(out, (tuple, list))):
            return out  # metadata (``weight.dtype``, ``weight.shape``), a detached copy: no gradient flows there
        for a in (*args, *kwargs.values()):
            hit = self.owner.get(id(a)) if torch.is_tensor(a) else None
            # a parameter tied between layers (an LM head and its embedding) is used inside any of them
            if hit is not None and not any(m in self.active for m in hit[0]):
                self.outside.append((hit, resolve_name(func) or getattr(func, "__name__", repr(func))))
                break
        return out


def layer_problem(model: nn.Module, args, kwargs, size: int, forward, batch_dim: int | None = 0) -> str | None:
    """What keeps the per-layer modes from attributing ``model``'s layers (None: nothing), from one pass of
    ``forward(args, kwargs)`` (the model's forward, as the batch-independence check runs it) on a synthetic
    batch of ``size`` examples, on copies of the trainable parameters, without gradients.  ``batch_dim``: the
    dimension the mode takes each layer's examples from; None where the batch-independence check proves each
    layer's batch dimension by provenance instead (batch-second inputs: ``batch_first=False``)."""
    named = dict(model.named_modules(remove_duplicate=False))
    owners = {name: m for name, m in named.items() if any(p.requires_grad for p in m.parameters(recurse=False))}
    copies, owner = {}, {}
    for mname, m in owners.items():
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                full = f"{mname}.{pname}" if mname else pname
                twin = copies.setdefault(id(p), p.detach().clone())
                owner.setdefault(id(twin), (set(), full))[0].add(id(m))
    params = {
        n: copies[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad and id(p) in copies
    }
    buffers = {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)}
    active: list = [id(model)]  # the root's forward is the pass itself (its own hooks are not called)
    rows: list = []  # (layer name, type, the batch dimension's size in its first tensor input)

    called: set = {id(model)}

    def enter(name):
        def hook(module, inputs):
            active.append(id(module))
            called.add(id(module))
            first = next((t for t in inputs if torch.is_tensor(t)), None)
            if first is not None and batch_dim is not None and not isinstance(module, _OWN_LAYOUT):
                lead = int(first.shape[batch_dim]) if first.dim() > batch_dim else None
                rows.append((name, type(module).__name__, lead))

        return hook

    def leave(module, _inputs, _output):
        if active and active[-1] == id(module):
            active.pop()

    handles = []
    uses = _ParameterUses(owner, active)
    try:
        for name, m in owners.items():
            if m is model:
                continue
            handles.append(m.register_forward_pre_hook(enter(name or type(m).__name__)))
            handles.append(m.register_forward_hook(leave, always_call=True))
        with torch.random.fork_rng(), contextlib.ExitStack() as stack:
            stack.enter_context(_reparametrize_module(model, {**params, **buffers}, strict=False))
            stack.enter_context(torch.no_grad())
            stack.enter_context(uses)
            forward(args, kwargs)
    finally:
        for h in handles:
            h.remove()
    for name, kind, lead in rows:
        if lead != size:
            return (
                f"layer {name!r} ({kind}) is called on a tensor whose leading dimension is not the batch's (a "
                "value shared by the batch, such as a (T, T) relative-position bucket index, or rows of several "
                "examples); the mode's per-layer hooks take that dimension for the examples, so its per-example "
                "gradients would be wrong (silently when it equals the batch size)"
            )
    # a parameter whose layer also runs and is used elsewhere (a hand-tied head ``h @ emb.weight.T``) is the
    # decomposition check's (.decomposition: its per-example gradients do not add up, refused at the step)
    never = [(param, op) for (modules, param), op in uses.outside if not modules & called]
    if never:
        param, op = never[0]
        return (
            f"parameter {param!r} is used outside its layer's forward (in {op}, e.g. F.conv1d(x, conv.weight) or "
            "table.weight[ids]) and its layer is never called; the mode's per-layer hooks see only the layer's own "
            "calls, so the parameter would have no per-example gradient"
        )
    return None


def check_layer_inputs(
    model: nn.Module, mode: str, args, kwargs, size: int, forward, batch_dim: int | None = 0
) -> None:
    """Raise :class:`LayerAttributionError` if ``mode`` (one of :data:`PER_LAYER_MODES`) cannot attribute one
    of ``model``'s layers (:func:`layer_problem`), naming ``grad_sample_mode='bk'``, which can."""
    problem = layer_problem(model, args, kwargs, size, forward, batch_dim)
    if problem is not None:
        raise LayerAttributionError(
            "module",
            type(model).__name__,
            f"cannot be trained with grad_sample_mode={mode!r}: {problem}; use grad_sample_mode='bk', which "
            "attributes such uses to examples by provenance",
        )
