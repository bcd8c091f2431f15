"""Opacus's per-sample-gradient hooks (``hooks``, ``functorch``, ``ghost``) made safe for what a model may
legally do, and netted (:mod:`.machinery`).

Opacus captures each layer's output gradient with a full backward hook (``register_full_backward_hook``).
torch implements it by passing the layer's outputs through an identity ``autograd.Function``, whose
outputs are views: a model that writes into a layer's output in place — ``q /= math.sqrt(d)``,
``q[..., :d] /= s``, ``h[~mask] = 0``, all legal autograd — then crashes in its forward
("Output 0 of BackwardHookFunction is a view and is being modified inplace").  Here the output gradient
is taken by a hook on the layer's output tensor instead, registered in the forward hook: a tensor hook
registered before an in-place write receives the gradient of the value the layer returned (torch's
documented semantics), which is what Opacus's grad samplers expect.  Opacus's own
``capture_activations_hook`` / ``capture_backprops_hook`` do the work unchanged, inside
:func:`~.machinery.guard`.

A layer whose per-example gradients come from ``torch.func`` and whose forward uses an old-style
``autograd.Function`` (no ``setup_context``) gets them from plain autograd, one example at a time
(:mod:`.per_example_autograd`).
"""

from __future__ import annotations

import contextlib
import inspect
from functools import partial

import torch
from opacus.grad_sample import GradSampleHooks, GradSampleModule
from opacus.grad_sample.functorch import prepare_layer
from opacus.layers import DPGRU, DPLSTM, DPRNN
from opacus.utils.module_utils import trainable_modules
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten

from ..opacus_compat import UnsupportedModuleError
from .autograd import functorch_refuses, per_example_autograd
from .machinery import MachineryRefusal, forward_net, guard, module_names


class _TolerantFunctorch:
    """A layer's ``ft_compute_sample_grad`` (Opacus's ``vmap(grad(...))``) that, where torch cannot transform
    an old-style ``autograd.Function`` in the layer's forward, computes the same per-example gradients with
    plain autograd (Opacus's loss: the layer on example i's activations, times its output gradient)."""

    def __init__(self, layer: torch.nn.Module, vmapped):
        self.layer, self.vmapped = layer, vmapped

    def __call__(self, parameters, activations, backprops):
        try:
            return self.vmapped(parameters, activations, backprops)
        except RuntimeError as exc:
            if not functorch_refuses(exc):
                raise
        layer = self.layer
        names = [n for n, _ in layer.named_parameters()]

        def loss_of(i, leaves):
            with _reparametrize_module(layer, leaves):
                out = layer.forward(activations[i].unsqueeze(0))  # the forward alone: no hooks of this engine
            return (out * backprops[i].unsqueeze(0).to(out.dtype)).sum()

        grads = per_example_autograd(loss_of, dict(zip(names, parameters, strict=True)), int(activations.shape[0]))
        return tuple(grads[n] for n in names)


def _in_order(module, kwargs) -> tuple:
    """The tensors of a call made with keyword arguments only, in the order of the layer's ``forward`` signature."""
    names = list(inspect.signature(module.forward).parameters)
    ordered = sorted(kwargs.items(), key=lambda kv: names.index(kv[0]) if kv[0] in names else len(names))
    return tuple(v for _, v in ordered if torch.is_tensor(v))


def first_needing_grad(output):
    """The first tensor of a layer's ``output`` that requires a gradient (None: none does)."""
    return next((t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad), None)


def own_output(output):
    """(the layer's output, its first tensor that requires a gradient), that tensor a copy when it is a view
    (``F.linear`` with a bias on (B, T, d): a view of its (B·T, p) result): a hook on a view does not fire
    after the view is written in place (autograd rebases the view onto its base), a copy's does.  Only a
    tensor or a tuple/list of them is copied; a view in another structure keeps its hook (written in place,
    the layer then has no per-sample gradient and the optimizer refuses the step)."""
    if torch.is_tensor(output):
        if not output.requires_grad:
            return output, None
        output = output.clone() if output._is_view() else output
        return output, output
    if isinstance(output, (tuple, list)) and type(output) in (tuple, list):
        k = next((i for i, t in enumerate(output) if torch.is_tensor(t) and t.requires_grad), None)
        if k is None:
            return output, None
        if output[k]._is_view():
            output = type(output)(t.clone() if i == k else t for i, t in enumerate(output))
        return output, output[k]
    return output, first_needing_grad(output)


def refuse_later_outputs(output, first, inputs, params, where, mode: str) -> None:
    """Refuse the backward pass that reaches a tensor of a layer's ``output`` other than its ``first`` (the one
    whose gradient forms the layer's per-sample gradients, :func:`own_output`, before any copy) when the layer's
    ``params`` reach that tensor other than through ``first``: the per-sample gradients would miss that share,
    silently (ZAYA's QK norm returns (queries, keys), its parameter acting on the keys only: per-example
    gradients of zero, found by the architecture survey).  A later output computed from ``first`` (a router's
    top-k weights from its logits) is fine: ``first``'s gradient already carries it.  The walk stops at
    ``first`` and at the layer's ``inputs`` (its own graph only); the refusal comes in the backward pass, before
    any noise, and only where the loss depends on such a tensor."""
    later = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad and t is not first]
    if not later:  # one output needing a gradient (every Linear, Conv, ...): nothing to walk
        return
    ids = {id(p) for p in params}
    if not ids:
        return
    # the nodes themselves, held: torch makes a node's Python object on access and frees it with its last
    # reference, so the id of a node not held can be reused by the next one made (a later output's node taken
    # for a stop, its parameter missed: seen on torch 2.11)
    stops = [t.grad_fn for t in (first, *tree_flatten(inputs)[0]) if torch.is_tensor(t) and t.grad_fn is not None]
    for t in later:
        if _reaches(t.grad_fn, stops, ids):
            t.register_hook(partial(_later_output_reached, where, mode))


def _reaches(fn, stops: list, ids: set) -> bool:
    """Whether the autograd graph from ``fn`` reaches a parameter of ``ids`` (the ids of tensors held alive by
    the caller) without passing a node of ``stops``. Nodes are compared by identity while every node met is held
    (``seen``), so no id is reused during the walk."""
    stop = {id(f) for f in stops}
    stack, seen = [fn], {}
    while stack:
        f = stack.pop()
        if f is None or id(f) in stop or id(f) in seen:
            continue
        seen[id(f)] = f
        if id(getattr(f, "variable", None)) in ids:
            return True
        stack.extend(n for n, _ in f.next_functions)
    return False


def _later_output_reached(where, mode: str, _grad):
    raise MachineryRefusal(
        f"grad_sample_mode={mode!r}: {where()} returns several tensors that require a gradient, and the loss "
        "depends on a later one that its parameters reach other than through the first; its per-example gradients "
        "are formed from the first one's gradient only, so they would miss that share: refused; make each output "
        "the result of its own layer, or freeze the layer's parameters"
    )


class OutputHooks:
    """Mixin for Opacus's hooks classes: the output gradient by a tensor hook on the layer's output (module
    docstring), every hook inside the net; ``output_hooks = False`` keeps Opacus's full backward hooks
    (FSDP2's ghost clipping, whose parameters are swapped in for the module's own backward)."""

    output_hooks = True
    #: the grad_sample_mode named in refusals
    mode_name = "hooks"

    def add_hooks(self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False):
        if not self.output_hooks:
            return super().add_hooks(
                loss_reduction=loss_reduction, batch_first=batch_first, force_functorch=force_functorch
            )
        if hasattr(self._module, "autograd_grad_sample_hooks"):  # as Opacus
            raise ValueError("Trying to add hooks twice to the same model")
        self._module.autograd_grad_sample_hooks = []
        self.autograd_grad_sample_hooks = self._module.autograd_grad_sample_hooks
        self._layer_names = module_names(self._module)
        for module in self.iterate_submodules(self._module):
            if type(module) in (DPRNN, DPLSTM, DPGRU):  # their RNNLinear layers carry the hooks (as Opacus)
                continue
            if force_functorch or self._get_module_type(module) not in self.GRAD_SAMPLERS:
                prepare_layer(module, batch_first=batch_first)
                module.ft_compute_sample_grad = _TolerantFunctorch(module, module.ft_compute_sample_grad)
            hook = partial(self._forward_hook, loss_reduction=loss_reduction, batch_first=batch_first)
            self.autograd_grad_sample_hooks.append(module.register_forward_hook(hook, with_kwargs=True))
        self.enable_hooks()

    def _where(self, module) -> str:
        return f"layer {self._layer_names.get(id(module), type(module).__name__)!r} ({type(module).__name__})"

    def _forward_hook(self, module, inputs, kwargs, output, *, loss_reduction, batch_first):
        if not inputs and kwargs:  # a layer called with keyword arguments only (self.proj(input=x)): Opacus reads
            inputs = _in_order(module, kwargs)  # its inputs positionally (an IndexError on none)
        # an index broadcast to the batch (BERT's token type ids: a (1, T) buffer expanded) kept contiguous:
        # Opacus's Embedding samplers view it (a copy of an integer index only where it is not contiguous)
        inputs = tuple(t.contiguous() if torch.is_tensor(t) and not t.is_floating_point() else t for t in inputs)
        other = next((a for a in inputs if not torch.is_tensor(a)), None)
        if other is not None and self.hooks_enabled and torch.is_grad_enabled() and module.training:
            raise MachineryRefusal(  # Opacus keeps the inputs as tensors ('int' object has no attribute 'detach')
                f"grad_sample_mode={self.mode_name!r}: {self._where(module)} is called with a positional argument "
                f"that is not a tensor ({type(other).__name__}): Opacus's per-sample gradients keep a layer's "
                "positional inputs as tensors and re-run a layer no grad sampler covers on its first input only; "
                "use grad_sample_mode='bk'"
            )
        with guard(lambda: self._where(module), self.mode_name):
            self.capture_activations_hook(module, inputs, output)
        if not torch.is_grad_enabled():
            return None
        first = first_needing_grad(output)
        output, out = own_output(output)
        if out is not None:
            out.register_hook(
                partial(self._backward_hook, module, loss_reduction=loss_reduction, batch_first=batch_first)
            )
            params = (p for p in module.parameters(recurse=False) if p.requires_grad)  # read only for a 2nd output
            refuse_later_outputs(output, first, (inputs, kwargs), params, lambda: self._where(module), self.mode_name)
        return output

    def _backward_hook(self, module, grad, *, loss_reduction, batch_first):
        with guard(lambda: self._where(module), self.mode_name):
            self.capture_backprops_hook(module, None, (grad,), loss_reduction, batch_first)

    @contextlib.contextmanager
    def _plain(self):
        """The model's forward without this engine's hooks (the net's second run, :func:`~.machinery.forward_net`)."""
        enabled = self.hooks_enabled
        self.hooks_enabled = False
        try:
            yield
        finally:
            self.hooks_enabled = enabled


def check_buffers(module: torch.nn.Module) -> None:
    """Refuse, before anything changes, a trainable layer with buffers in a mode on Opacus's hooks: Opacus's
    per-sample gradients do not support one (its functional copy of the layer drops the buffers) and its
    ``NotImplementedError`` escaped ``make_private`` as a crash (transformers' XIELU activation)."""
    for name, m in trainable_modules(module):
        if any(True for _ in m.buffers()):
            raise UnsupportedModuleError(
                "module",
                f"layer {name!r} ({type(m).__name__}) with trainable parameters and buffers",
                "Opacus's per-sample gradients (grad_sample_mode 'hooks', 'functorch', 'ghost') do not support a "
                "trainable layer with buffers; use grad_sample_mode='bk', or freeze the layer",
            )


class IndividualizedGradSampleModule(OutputHooks, GradSampleModule):
    """Opacus's ``GradSampleModule`` (``grad_sample_mode`` ``hooks`` and ``functorch``) with :class:`OutputHooks`
    and its forward netted (:func:`~.machinery.forward_net`)."""

    @property
    def mode_name(self) -> str:
        return "functorch" if self.force_functorch else "hooks"

    def forward(self, *args, **kwargs):
        return forward_net(self._module, self._plain, self._module, self.mode_name, args, kwargs)


class IndividualizedGradSampleHooks(OutputHooks, GradSampleHooks):
    """Opacus's ``GradSampleHooks`` (``wrap_model=False``) with :class:`OutputHooks`."""

    @property
    def mode_name(self) -> str:
        return "functorch" if self.force_functorch else "hooks"


__all__ = [
    "IndividualizedGradSampleHooks",
    "IndividualizedGradSampleModule",
    "OutputHooks",
    "check_buffers",
    "first_needing_grad",
    "own_output",
    "refuse_later_outputs",
]
