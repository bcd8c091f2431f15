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
refusal names it.  The check watches the batch-independence check's first synthetic pass
(:mod:`.batch_independence`: a public batch whose size B is a prime dividing no other dimension, so a
(T, T) input never has B rows; no pass of its own), once per model: a forward pre-hook on every module
owning trainable parameters records the leading dimension of its first positional tensor input, and a
torch function mode the operations that use a parameter while its module's forward is not running.
"""

from __future__ import annotations

import torch
from torch import nn
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


class LayerWatch:
    """Watches one synthetic pass of the model (the batch-independence check's first, on its copies of the
    trainable parameters: entered after they are swapped in) and says afterwards what keeps the per-layer
    modes from attributing the model's layers (:meth:`problem`)."""

    def __init__(self, model: nn.Module, batch_dim: int | None = 0):
        self.model = model
        #: where the mode takes each layer's examples from; None where the batch-independence check proves each
        #: layer's batch dimension by provenance instead (batch-second inputs, ``batch_first=False``)
        self.batch_dim = batch_dim
        named = dict(model.named_modules(remove_duplicate=False))
        #: (module name, module, its trainable parameters' names) of every module owning trainable parameters
        self.owners = [
            (name, m, [n for n, p in m.named_parameters(recurse=False) if p.requires_grad])
            for name, m in named.items()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self.active: list = [id(model)]  # the root's forward is the pass itself (its own hooks are not called)
        self.called: set = {id(model)}
        self.rows: list = []  # (layer name, type, its first tensor input's size along the batch dimension)
        self.uses: _ParameterUses | None = None
        self._handles: list = []

    def _enter_hook(self, name):
        def hook(module, inputs):
            self.active.append(id(module))
            self.called.add(id(module))
            first = next((t for t in inputs if torch.is_tensor(t)), None)
            bd = self.batch_dim
            if first is not None and bd is not None and not isinstance(module, _OWN_LAYOUT):
                self.rows.append((name, type(module).__name__, int(first.shape[bd]) if first.dim() > bd else None))

        return hook

    def _leave_hook(self, module, _inputs, _output):
        if self.active and self.active[-1] == id(module):
            self.active.pop()

    def __enter__(self):
        owner: dict = {}
        for mname, m, pnames in self.owners:
            for pname in pnames:
                t = getattr(m, pname)  # the pass's copy of the parameter
                owner.setdefault(id(t), (set(), f"{mname}.{pname}" if mname else pname))[0].add(id(m))
            if m is not self.model:
                self._handles.append(m.register_forward_pre_hook(self._enter_hook(mname or type(m).__name__)))
                self._handles.append(m.register_forward_hook(self._leave_hook, always_call=True))
        self.uses = _ParameterUses(owner, self.active)
        self.uses.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.uses.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
        return False

    def problem(self, size: int) -> str | None:
        """What keeps the per-layer modes from attributing the layers in the watched pass on a synthetic batch of
        ``size`` examples (None: nothing)."""
        for name, kind, lead in self.rows:
            if lead != size:
                return (
                    f"layer {name!r} ({kind}) is called on a tensor whose leading dimension is not the batch's (a "
                    "value shared by the batch, such as a (T, T) relative-position bucket index, or rows of several "
                    "examples); the mode's per-layer hooks take that dimension for the examples, so its per-example "
                    "gradients would be wrong (silently when it equals the batch size)"
                )
        # a parameter whose layer also runs and is used elsewhere (a hand-tied head ``h @ emb.weight.T``) is the
        # decomposition check's (.decomposition: its per-example gradients do not add up, refused at the step)
        never = [
            (param, op)
            for (modules, param), op in (self.uses.outside if self.uses else [])
            if not modules & self.called
        ]
        if never:
            param, op = never[0]
            return (
                f"parameter {param!r} is used outside its layer's forward (in {op}, e.g. F.conv1d(x, conv.weight) or "
                "table.weight[ids]) and its layer is never called; the mode's per-layer hooks see only the layer's own "
                "calls, so the parameter would have no per-example gradient"
            )
        return None


def check_layer_inputs(model: nn.Module, mode: str, watch: LayerWatch, size: int) -> None:
    """Raise :class:`LayerAttributionError` if ``mode`` (one of :data:`PER_LAYER_MODES`) cannot attribute one
    of ``model``'s layers in the pass ``watch`` watched (:meth:`LayerWatch.problem`), naming
    ``grad_sample_mode='bk'``, which can."""
    problem = watch.problem(size)
    if problem is not None:
        raise LayerAttributionError(
            "module",
            type(model).__name__,
            f"cannot be trained with grad_sample_mode={mode!r}: {problem}; use grad_sample_mode='bk', which "
            "attributes such uses to examples by provenance",
        )
