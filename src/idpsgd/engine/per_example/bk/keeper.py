"""Book-keeping clipping (``grad_sample_mode="bk"``): per-example clipped gradient sums in one backward
pass, with a clip norm per example.

Bu, Wang, Zha & Karypis 2023 ("Differentially private optimization on large model at small cost",
ICML, Alg. 1, *BK*) with Bu, Mao & Xu 2022's mixed ghost norms, generalised to a clip norm c_i per
example (IDP-SGD *Scale*'s c_p, Boenisch et al. 2023 §3.4; individual clipping, Yu et al. 2023 Alg. 3).
This module owns the :class:`BookKeeper`: it plans the model (:mod:`.plan`), routes every covered
layer's forward through its rule (:mod:`.intercept`, :mod:`.rules`), keeps per layer either (input,
output gradient) or per-example gradients in the one backward pass (:mod:`.units`), and forms from them
the per-example norms (:meth:`BookKeeper.norms`) and the clipped sum Σ_i min(1, c_i/‖g_i‖) g_i
(:meth:`BookKeeper.clipped_sum`). Layers no rule covers are *fallback units* (Opacus's per-sample
gradient for that layer), modules using parameters directly in forward are *direct units*; tied
parameters (:mod:`.tied`) and values shared by the batch (:mod:`.shared`, :mod:`.provenance`) are kept
exactly. Every trainable parameter is either clipped per example or refused — never left with noise only
or an un-clipped gradient.

User guide (what is covered, refused and measured): ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...guards.integrity import per_model
from . import provenance, routing
from .intercept import BookKeptForward, override_forward, plain_forward
from .plan import DIRECT_UNIT, Routed, plan_layers
from .replay import Attribution
from .rules import Rule, add_into
from .shared import parameter_use
from .tied import cross_term
from .units import ACCUMULATION_ERROR, DIRECT, FALLBACK, GHOST, PER_SAMPLE, DirectUnit, FallbackUnit, Layer, Unit

#: the public rule of a layer that takes the ghost norm or the per-sample gradient by its shapes
BY_SHAPES = f"{GHOST} or {PER_SAMPLE}, by the layer's input shapes in each step (ghost when 2T² < d·p)"


class BookKeeper:
    """The book-keeping machinery attached to one model (one per model, shared by the training wrapper
    and the per-example norm passes; :meth:`attach`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.active = False
        self.loss_reduction = "mean"
        self.forbid_accumulation = False
        self.layers: list[Layer] = []
        self.units: list[FallbackUnit] = []
        self.direct: list[DirectUnit] = []
        self.tied: list[list[tuple[Layer, str]]] = []  # (layer, parameter name) of each tied parameter's uses
        self._batches: list[int | None] = []  # the batch size of each model forward in progress
        self._modes: list = []  # the provenance mode of each model forward in progress (None: none entered)
        self.attribution = Attribution(model)  # provenance traced once per signature, then replayed (.replay)
        self._routes: dict = {}  # id(weight) -> (functional operation, weight position, layer's forward, weight)
        self._sources: dict = {}  # id(parameter) -> the keeper's parameter_source (covered layers' parameters)
        self._owner: dict = {}  # id(parameter) -> (layer, name)
        self._leaked: set[str] = set()
        self._handles = []
        self._dropped: torch.Tensor | None = None
        self._settled = None  # (parts, batch) of the current pass as norms() checked them, for clipped_sum
        #: the modules' parameters as the rules see them after the backward pass (FSDP2 swaps the unsharded
        #: tensors back in: engine/distributed/fsdp.py, :meth:`view_parameters_with`); by default the model's own
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

    def view_parameters_with(self, view) -> None:
        """Have the rules read the modules' parameters after the backward pass inside ``view()`` (a context
        manager: FSDP2's unsharded tensors swapped in, ``UnshardedParameters`` of engine/distributed/fsdp.py)."""
        self.parameter_view = view

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
                    self.units.append(FallbackUnit(self, name, module))
                    continue
                if kind == DIRECT_UNIT:
                    unit = DirectUnit(self, name, module)
                    self.direct.append(unit)
                    params = unit.params
                else:
                    routed = kind if isinstance(kind, Routed) else None
                    layer = Layer(self, name, module, routed.rule if routed else kind)
                    self.layers.append(layer)
                    forward = BookKeptForward(layer)
                    if routed:  # its own forward runs; the rule applies at the base class's operation
                        # the weight held and compared: a frozen weight only its module holds can be replaced,
                        # and a new parameter can take the freed one's id
                        self._routes[id(module.weight)] = (routed.fn, routed.pos, forward, module.weight)
                    else:
                        override_forward(module, forward)
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
            plain_forward(layer.module)
        for unit in [*self.units, *self.direct]:
            unit.remove()
        for h in self._handles:
            h.remove()
        routing.remove(getattr(self, "_row_maps", ()))
        self.layers, self.units, self.direct, self.tied, self._handles = [], [], [], [], []
        self._routes, self._sources, self._owner = {}, {}, {}
        self.attribution.forget()  # the plans' query sites are the layers just dropped

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
            return per_model(model, "_idpsgd_bookkeeper", cls)
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
                            mode.tag(t, rows)
                    mode.use_routes(self._routes, self._sources, self.parameter_source)
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
    def parts(self) -> list[Unit]:
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
            self._settled = (parts, batch)
            ref = next(iter(parts[0].params.values()))
            return torch.zeros(0, dtype=ref.dtype, device=ref.device)
        if self.user_level is not None:  # user level: records regrouped, one "example" per user (..units)
            parts, batch = self.user_level.regroup(self, parts, batch)
        self._settled = (parts, batch)  # the checks of _recorded() (a walk over the parameters) once a step
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
        parts, batch = self._settled if self._settled is not None else self._recorded()
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
        self._settled = None

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

    def _ties(self, layer: Layer) -> list[str]:
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
