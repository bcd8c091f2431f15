"""Book-keeping clipping (``grad_sample_mode="bk"``): per-example clipped gradient sums in one backward
pass, with a clip norm per example.

Bu, Wang, Zha & Karypis 2023 ("Differentially private optimization on large model at small cost",
ICML, Alg. 1, *BK*) with Bu, Mao & Xu 2022's mixed ghost norms, generalised to a clip norm c_i per
example (IDP-SGD *Scale*'s c_p, Boenisch et al. 2023 §3.4; individual clipping, Yu et al. 2023
Alg. 3):

1. forward — every covered layer (:mod:`.bk_layers`: Linear, Conv1d/Conv2d, Embedding, GroupNorm,
   InstanceNorm, LayerNorm) runs through :class:`_BookKeptOp`, which computes the layer's output
   with PyTorch's own kernel and keeps its input;
2. one backward pass — each covered layer passes the input gradient on (PyTorch's kernel) and keeps,
   instead of letting autograd form the summed weight gradient, either (input, output gradient)
   (ghost layers) or the per-example gradients (per-sample layers; whichever is cheaper for its
   shapes, :meth:`~.bk_layers.Rule.prefers_ghost`).  A per-sample layer whose per-example
   gradients are larger than its input and output gradient keeps those instead and forms the
   per-example gradients after the backward pass, when the activations are freed (the same work,
   a lower memory peak);
3. :meth:`BookKeeper.norms` — ‖g_i‖² = Σ_layers ‖g_i^(l)‖² (ghost norms or per-sample norms);
4. :meth:`BookKeeper.clipped_sum` — Σ_i w_i g_i with w_i = min(1, c_i/‖g_i‖) from the engine's
   :class:`~.clipping.PerExampleClipping`, per layer from what step 2 kept.

A layer with trainable parameters that no rule covers (e.g. ``nn.Conv3d``, a custom module, an
Embedding with ``scale_grad_by_freq``, a layer with a parametrization such as
``torch.nn.utils.parametrizations.weight_norm``) is a *fallback unit*: Opacus's per-sample gradient
for that layer only (its registered grad sampler, or functorch for the whole module), kept like a
per-sample layer.  :attr:`BookKeeper.rules` says which path each layer takes, as a function of the
model only (public); :attr:`BookKeeper.paths` which it took (the ghost/per-sample choice of Linear
and convolution layers depends on the batch's shapes, e.g. its longest sequence: private).

No trainable parameter is left with noise only: a covered layer owning a trainable parameter its
rule does not train (``torch.nn.utils.weight_norm``'s ``weight_g``/``weight_v``) is refused when the
model is planned; a fallback unit that ran its forward in eval mode (Opacus captures no activations
there) or whose sampler gave no per-sample gradient for a trainable parameter is refused at the
step; a parameter made trainable after planning is planned anew by the next norm pass (and refused
by the engine's step until ``make_private`` is called again).

Nothing else changes: the batch, the loss, the user's loop.  A covered parameter used outside its
layer's forward (weight tying across layers, a functional call on ``layer.weight``) would receive an
un-clipped autograd gradient: that is detected (a gradient hook on the parameter) and refused, as are
parameters shared between layers (their per-example norm needs cross terms).
"""
from __future__ import annotations

import torch
from opacus.grad_sample import AbstractGradSampleModule, GradSampleModule
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import nn
from torch.nn.utils import parametrize

from ..validation import InvalidParameterError
from .bk_layers import Rule, _add_into, rule_for

GHOST, PER_SAMPLE, FALLBACK = "ghost norm", "per-sample gradient", "Opacus per-sample gradient (fallback)"
#: the public rule of a layer that takes the ghost norm or the per-sample gradient by its shapes
BY_SHAPES = f"{GHOST} or {PER_SAMPLE}, by the layer's input shapes in each step (ghost when 2T² < d·p)"
ACCUMULATION_ERROR = ("Poisson sampling is not compatible with gradient accumulation: call optimizer.step() after "
                      "every forward/backward pass, or use opacus.utils.batch_memory_manager.BatchMemoryManager")


class _BookKeptOp(torch.autograd.Function):
    """A covered layer's forward with its PyTorch kernel; its backward returns the input gradient
    only (None for the parameters: autograd never forms their summed gradient) and hands the output
    gradient to the layer's :class:`_Layer` record."""

    @staticmethod
    def forward(ctx, layer, x, *params):
        out, saved = layer.rule.forward(layer.module, x)
        ctx.layer = layer
        ctx.save_for_backward(*saved)
        layer.pending += 1
        return out

    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        saved = ctx.saved_tensors
        gx = layer.rule.backward_input(layer.module, saved, g, ctx.needs_input_grad[1])
        layer.record(saved, g)
        return (None, gx) + (None,) * (len(ctx.needs_input_grad) - 2)


class _BookKeptForward:
    """The covered module's ``forward`` while the book-keeper is attached: book-kept when the keeper
    is active and gradients are enabled, the module's own forward otherwise.  A deep copy (or a
    pickle) of the module gets its plain forward back."""

    def __init__(self, layer: "_Layer"):
        self.layer = layer

    def __call__(self, x, *args, **kwargs):
        layer = self.layer
        module = layer.module
        if args or kwargs or not (layer.keeper.active and torch.is_grad_enabled()):
            return type(module).forward(module, x, *args, **kwargs)
        if torch.is_tensor(x) and torch.is_autocast_enabled(x.device.type):
            raise RuntimeError("grad_sample_mode='bk' does not support autocast (mixed precision); use "
                               "grad_sample_mode='hooks', or train in one precision")
        x = layer.rule.prepare(module, x)
        return _BookKeptOp.apply(layer, x, *layer.params.values())

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
    """‖G_i‖² of each example's gradient (B, ...), without a squared copy of G."""
    flat = gs.reshape(gs.shape[0], 1, -1)
    return torch.bmm(flat, flat.transpose(1, 2)).reshape(-1)


class _Layer:
    """One covered layer: its rule, its trainable parameters, and what the current backward pass kept."""

    def __init__(self, keeper: "BookKeeper", name: str, module: nn.Module, rule):
        self.keeper, self.name, self.module, self.rule = keeper, name, module, rule
        self.params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        self.per_sample_size = sum(int(p.numel()) for p in self.params.values())   # numbers per example
        self.paths_taken: set[str] = set()
        self.clear()

    def clear(self) -> None:
        self.uses: list = []                 # (saved tensors, output gradient) kept for the ghost norm
        self.deferred: list = []             # (saved tensors, output gradient) of per-sample uses, for later
        self.grad_sample: dict = {}          # per-example gradients summed over the per-sample uses
        self.batch: int | None = None
        self.pending = self.completed = 0

    @property
    def recorded(self) -> bool:
        return self.batch is not None

    def record(self, saved, g) -> None:
        n = self.rule.batch_size(saved)
        if self.batch is not None and n != self.batch:
            raise ValueError(f"layer {self.name!r} saw batches of {self.batch} and {n} examples before "
                             f"optimizer.step(); {ACCUMULATION_ERROR}")
        self.batch = n
        self.pending -= 1
        if self.pending <= 0:
            self.pending = 0
            self.completed += 1
            if self.completed > 1 and self.keeper.forbid_accumulation:
                raise ValueError(ACCUMULATION_ERROR)
        if n == 0:                               # an empty Poisson batch: nothing to keep
            return
        if self.rule.ghost_capable and self.rule.prefers_ghost(self.module, [(saved, g)]):
            self.uses.append((saved, g.detach()))
        elif self.rule.ghost_capable and self._kept_size(saved, g) < self.per_sample_size:
            self.deferred.append((saved, g.detach()))   # the per-sample gradients are larger: form them at the end
        else:
            _add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))

    @staticmethod
    def _kept_size(saved, g) -> int:
        """Numbers per example of a use's input and output gradient."""
        return sum(int(t[0].numel()) for t in saved) + int(g[0].numel())

    def norm_sq(self) -> torch.Tensor:
        """Σ over this layer's parameters of ‖g_i‖² (un-scaled output gradients); settles the path."""
        for saved, g in self.deferred:              # per-sample gradients formed after the backward pass, when
            _add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))   # activations are freed
        self.deferred = []
        if self.uses and (self.grad_sample or not self.rule.prefers_ghost(self.module, self.uses)):
            for saved, g in self.uses:          # mixed shapes, or several uses past the ghost break-even
                _add_into(self.grad_sample, self.rule.per_sample(self.module, saved, g))
            self.uses = []
        if self.uses:                           # settled above: ghost uses, or per-sample gradients, not both
            self.paths_taken.add(GHOST)
            return self.rule.ghost_norm_sq(self.module, self.uses)
        if self.grad_sample:
            self.paths_taken.add(PER_SAMPLE)
            return sum(_row_norms_sq(gs) for gs in self.grad_sample.values())
        return None

    def clipped_sum(self, w: torch.Tensor) -> dict:
        out = self.rule.ghost_clipped_sum(self.module, self.uses, w) if self.uses else {}
        for name, gs in self.grad_sample.items():
            _add_into(out, {name: torch.einsum("b,b...->...", w.to(gs.dtype), gs)})
        return {self.params[k]: v for k, v in out.items() if k in self.params}


class _FallbackUnit:
    """A module no rule covers: Opacus's per-sample gradients for it (registered grad sampler for its
    own parameters, or functorch for the whole module), captured with forward/backward hooks as
    Opacus's ``GradSampleModule`` does.  Autograd also forms these parameters' summed gradients;
    the optimizer discards them."""

    def __init__(self, keeper: "BookKeeper", name: str, module: nn.Module):
        self.keeper, self.name, self.module = keeper, name, module
        self.sampler = GradSampleModule.GRAD_SAMPLERS.get(type(module))
        whole = self.sampler is None
        if whole:
            prepare_layer(module, batch_first=True)
            self.sampler = ft_compute_per_sample_gradient
        named = module.named_parameters() if whole else module.named_parameters(recurse=False)
        self.params = {n: p for n, p in named if p.requires_grad}
        self._names = {id(p): n for n, p in self.params.items()}
        self.activations: list = []
        self.handles = [module.register_forward_hook(self._capture),
                        module.register_full_backward_hook(self._backward)]
        self.clear()

    def clear(self) -> None:
        self.grad_sample: dict = {}
        self.batch: int | None = None
        self.activations = []
        self.eval_forwards = 0          # forwards in eval mode (no activations captured, as Opacus)
        self.untrained: str | None = None

    @property
    def recorded(self) -> bool:
        return self.batch is not None

    def _capture(self, module, inputs, _output):
        if self.keeper.active and torch.is_grad_enabled():
            if module.training:
                self.activations.append([t.detach() if torch.is_tensor(t) else t for t in inputs])
            else:
                self.eval_forwards += 1

    def _backward(self, module, _grad_input, grad_output):
        if not self.keeper.active:
            return
        if not self.activations:
            if self.eval_forwards and any(p.requires_grad for p in self.params.values()):
                self.untrained = ("ran its forward in eval mode, so Opacus's per-sample gradient (fallback) captured "
                                  "nothing and its parameters would receive noise only: call model.train() before "
                                  "training (Opacus refuses this too), or freeze its parameters")
            return
        g = grad_output[0].detach()
        if self.batch is not None and g.shape[0] != self.batch:
            raise ValueError(f"layer {self.name!r} saw batches of {self.batch} and {g.shape[0]} examples before "
                             f"optimizer.step(); {ACCUMULATION_ERROR}")
        self.batch = int(g.shape[0])
        activations = self.activations.pop()
        if self.batch == 0:
            return
        got = set()
        for p, gs in self.sampler(module, activations, g).items():
            if id(p) in self._names:
                got.add(self._names[id(p)])
                _add_into(self.grad_sample, {self._names[id(p)]: gs})
        missing = [n for n, p in self.params.items() if p.requires_grad and n not in got]
        if missing:
            self.untrained = (f"got no per-sample gradient from Opacus's grad sampler for {', '.join(missing)}: they "
                              "would receive noise only; use grad_sample_mode='hooks'")

    def norm_sq(self):
        if not self.grad_sample:
            return None
        return sum(_row_norms_sq(gs) for gs in self.grad_sample.values())

    def clipped_sum(self, w: torch.Tensor) -> dict:
        return {self.params[n]: torch.einsum("b,b...->...", w.to(gs.dtype), gs) for n, gs in self.grad_sample.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if hasattr(self.module, "ft_compute_sample_grad"):
            delattr(self.module, "ft_compute_sample_grad")


def _check_rule_parameters(name: str, module: nn.Module, rule) -> None:
    extra = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad and n not in rule.parameters]
    if extra:
        raise InvalidParameterError(
            "module", f"layer {name!r} ({type(module).__name__}) with trainable parameter(s) {', '.join(extra)}",
            f"grad_sample_mode='bk' trains only {', '.join(rule.parameters)} of this layer type, so they would "
            "receive noise only (e.g. the deprecated torch.nn.utils.weight_norm's weight_g/weight_v: use "
            "torch.nn.utils.parametrizations.weight_norm, which book-keeping trains as a fallback layer); or "
            "freeze them")


def _unit_params(module: nn.Module, rule) -> tuple[list, bool]:
    """(trainable parameters a layer or fallback unit owns, whether it owns its whole subtree)."""
    if rule is None and type(module) not in GradSampleModule.GRAD_SAMPLERS:
        return [p for p in module.parameters() if p.requires_grad], True       # functorch: the whole module
    return [p for p in module.parameters(recurse=False) if p.requires_grad], False


def plan_layers(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(name, module, rule or None for a fallback unit) for every module owning trainable parameters,
    as Opacus's ``GradSampleModule`` walks a model; a module with a parametrization
    (``torch.nn.utils.parametrize``, e.g. ``parametrizations.weight_norm``: its parameters live in
    ``parametrizations.<name>.original*``) is one fallback unit with its whole subtree.  Refuses
    parameters shared by two of them, and a covered layer owning a trainable parameter its rule does
    not train (it would get noise only)."""
    plan, owner = [], {}

    def walk(module, prefix):
        parametrized = parametrize.is_parametrized(module)
        if (any(p.requires_grad for p in module.parameters(recurse=False))
                or (parametrized and any(p.requires_grad for p in module.parameters()))):
            rule = None if parametrized else rule_for(module)
            name = prefix or type(module).__name__
            if rule is not None:
                _check_rule_parameters(name, module, rule)
            params, whole = _unit_params(module, rule)
            for p in params:
                if id(p) in owner:
                    raise InvalidParameterError(
                        "module", f"a parameter shared by {owner[id(p)]!r} and {name!r}",
                        "grad_sample_mode='bk' needs every parameter in one layer (shared weights need cross "
                        "terms in the per-example norm); use grad_sample_mode='hooks'")
                owner[id(p)] = name
            plan.append((name, module, rule))
            if whole:
                return
        for child_name, child in module.named_children():
            walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    walk(model, "")
    return plan


def check_batch_first(batch_first: bool) -> None:
    if not batch_first:
        raise InvalidParameterError("batch_first", batch_first, "grad_sample_mode='bk' needs batch-first inputs; "
                                    "use grad_sample_mode='hooks' for batch_first=False")


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
        self._leaked: set[str] = set()
        self._handles = []
        self._plan()

    def _trainable(self) -> frozenset:
        return frozenset(id(p) for p in self.model.parameters() if p.requires_grad)

    def _plan(self) -> None:
        self.planned = self._trainable()        # the trainable parameters the plan covers
        try:
            for name, module, rule in plan_layers(self.model):
                if rule is None:
                    self.units.append(_FallbackUnit(self, name, module))
                    continue
                layer = _Layer(self, name, module, rule)
                self.layers.append(layer)
                module.forward = _BookKeptForward(layer)
                for pname, p in layer.params.items():
                    self._handles.append(p.register_hook(self._leak_hook(f"{name}.{pname}")))
        except BaseException:
            self.detach()
            raise

    def _unplan(self) -> None:
        for layer in self.layers:
            layer.module.__dict__.pop("forward", None)
        for unit in self.units:
            unit.remove()
        for h in self._handles:
            h.remove()
        self.layers, self.units, self._handles = [], [], []

    def refresh(self) -> None:
        """Plan the model anew if its trainable parameters changed since it was planned (a layer
        unfrozen after the first norm pass would otherwise be left out of the norms)."""
        if self._trainable() != self.planned:
            self._unplan()
            self._leaked = set()
            self._plan()

    @classmethod
    def attach(cls, model: nn.Module) -> "BookKeeper":
        """The model's book-keeper, created on first use (kept as a plain attribute, not a submodule);
        planned anew when the model's trainable parameters changed."""
        keeper = model.__dict__.get("_idpsgd_bookkeeper")
        if keeper is None:
            keeper = cls(model)
            object.__setattr__(model, "_idpsgd_bookkeeper", keeper)
        else:
            keeper.refresh()
        return keeper

    def __deepcopy__(self, memo):      # a copied (or pickled) model gets its own book-keeper when it needs one
        return None

    def __reduce__(self):
        return type(None), ()

    def _leak_hook(self, qualified: str):
        def hook(grad):        # a covered parameter's autograd gradient is None unless it was used elsewhere
            if grad is not None and self.active:
                self._leaked.add(qualified)
        return hook

    def detach(self) -> None:
        """Remove the forward overrides and hooks (the model is plain again)."""
        self._unplan()
        if self.model.__dict__.get("_idpsgd_bookkeeper") is self:
            del self.model.__dict__["_idpsgd_bookkeeper"]

    # --- one backward pass --------------------------------------------------------------------
    @property
    def parts(self):
        return [*self.layers, *self.units]

    def _recorded(self):
        if self._leaked:
            names = sorted(self._leaked)
            self.clear()
            raise RuntimeError(f"parameter(s) {', '.join(names)} received an un-clipped gradient outside their "
                               "layer's forward (weight tying or a functional use of layer.weight): "
                               "grad_sample_mode='bk' cannot clip it; use grad_sample_mode='hooks'")
        untrained = [f"layer {u.name!r} ({type(u.module).__name__}) {u.untrained}" for u in self.units if u.untrained]
        if untrained:
            self.clear()
            raise RuntimeError("; ".join(untrained))
        new = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in self.planned]
        if new:
            self.clear()
            raise RuntimeError(f"parameter(s) {', '.join(new)} became trainable after book-keeping planned the model: "
                               "they have no per-example gradient and would receive noise only; call make_private "
                               "again after changing requires_grad")
        parts = [p for p in self.parts if p.recorded]
        batches = {p.batch for p in parts}
        if len(batches) > 1:
            self.clear()
            raise ValueError(f"layers saw different batch sizes {sorted(batches)} in one step; {ACCUMULATION_ERROR}")
        return parts, (batches.pop() if batches else None)

    def scale(self, batch: int) -> float:
        """Output gradients × scale = the per-example loss's gradients (Opacus's convention: a "mean"
        loss is divided by the batch size)."""
        return float(batch) if self.loss_reduction == "mean" else 1.0

    @torch.no_grad()
    def norms(self) -> torch.Tensor:
        """‖g_i‖ of every example of the current backward pass (in batch order)."""
        parts, batch = self._recorded()
        if batch is None:
            raise RuntimeError("no per-example gradients were recorded: call loss.backward() on the model's "
                               "output before optimizer.step()")
        if batch == 0:                           # an empty Poisson batch
            ref = next(iter(parts[0].params.values()))
            return torch.zeros(0, dtype=ref.dtype, device=ref.device)
        total = None
        for part in parts:
            sq = part.norm_sq()
            if sq is not None:
                total = sq if total is None else total + sq
        return total.clamp_min(0).sqrt() * self.scale(batch)

    @torch.no_grad()
    def clipped_sum(self, factors: torch.Tensor) -> dict:
        """{parameter: Σ_i factors_i · g_i} over the current backward pass (zero for parameters that
        received nothing); call after :meth:`norms`."""
        parts, batch = self._recorded()
        out = {}
        if batch:
            w = factors * self.scale(batch)
            for part in parts:
                out.update(part.clipped_sum(w))
        return out

    def clear(self) -> None:
        """Forget the current backward pass (after a step, or after a refused one)."""
        for part in self.parts:
            part.clear()
        self._leaked = set()

    @property
    def rules(self) -> dict[str, str]:
        """Layer name → how its per-example norms are computed, as a function of the model only
        (public): a ghost-capable layer that can also form per-sample gradients (Linear,
        convolutions) takes either by its input shapes in each step (:data:`BY_SHAPES`)."""
        out = {layer.name: _static_path(layer.rule) for layer in self.layers}
        out.update({unit.name: FALLBACK for unit in self.units})
        return out

    @property
    def paths(self) -> dict[str, str]:
        """Layer name → the paths its per-example norms took so far (:attr:`rules` for a layer that took
        none yet).  Private: with inputs padded per batch, the ghost/per-sample choice depends on the
        batch's longest sequence."""
        out = self.rules
        for layer in self.layers:
            if layer.paths_taken:
                out[layer.name] = " and ".join(sorted(layer.paths_taken))
        return out


def _static_path(rule) -> str:
    if not rule.ghost_capable:
        return PER_SAMPLE
    if type(rule).per_sample is Rule.per_sample:      # no per-sample gradients: always the ghost norm
        return GHOST
    return BY_SHAPES


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
    (:class:`~.optimizer.IndividualizedDPOptimizerBookKeeping`) reads the clipped sum from it."""

    def __init__(self, m: nn.Module, *, keeper: BookKeeper, batch_first: bool = True, loss_reduction: str = "mean"):
        check_batch_first(batch_first)
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self.keeper = keeper
        self.keeper.loss_reduction = loss_reduction
        self.keeper.active = True

    @property
    def layer_paths(self) -> dict[str, str]:
        """The paths the layers took (private; :attr:`layer_path_rules` for the public rule)."""
        return self.keeper.paths

    @property
    def layer_path_rules(self) -> dict[str, str]:
        return self.keeper.rules

    def forbid_grad_accumulation(self):
        self.keeper.forbid_accumulation = True

    def allow_grad_accumulation(self):
        self.keeper.forbid_accumulation = False

    def disable_hooks(self) -> None:
        self.keeper.active = False

    def enable_hooks(self) -> None:
        self.keeper.active = True

    def remove_hooks(self) -> None:
        self.keeper.detach()

    def zero_grad(self, set_to_none: bool = False):
        self.keeper.clear()
        super().zero_grad(set_to_none)
