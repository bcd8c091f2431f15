"""Provenance once per signature: trace the attribution of a model's forward once, then replay it.

:class:`~.provenance.ProvenanceMode` intercepts every torch call of the forward in Python (2–10 µs each,
about 1,000 calls per GPT-2-small forward).  What book-keeping takes from it is small: the answers to the
*queries* of the book-kept layers and of the values shared by the batch (:mod:`.keeper`, :mod:`.shared`):
"which rows of which examples does this layer's input hold?", in the order the forward asks them.  Those
answers are a function of the sequence of operations and the tags' rules.  When the forward's Python path
cannot depend on tensor values, that sequence is a function of what :func:`signature` captures — the model's
structure (modules, their train/eval flags, their hooks by the handles' ids, parameters, their shapes, dtypes,
devices and ``requires_grad``), the Python state its forward can branch on (:mod:`...guards.module_state`: the
modules' other attributes and classes, what their classes hold, the hooks and what they hold, one level into the
objects all these hold — a flag set on a module, a configuration's fields, a method patched on a class — and
transformers' attention registries), the input signature (the shapes, dtypes and devices of the tensor arguments,
which of them are tagged as the batch, which is the same object as an earlier one, the plain values of the others,
another object by identity with its attributes), the batch size, grad and autocast state — and so are the answers.

:class:`Attribution` (one per book-keeper) therefore *traces* the first forward of each signature with a
:class:`TracingMode` (the provenance mode, which also records the queries with their answers and every
*decision* that makes a replay unsafe), and *replays* the recorded plan on later forwards of the same
signature with a :class:`ReplayMode`, which intercepts nothing: it answers each query from the plan after
checking that the query comes from the same place (function and layer) about a tensor of the same shape and
dtype, and that the forward asked every query of the plan.  A mismatch (:class:`ReplayDiverged`) refuses the
step and turns the replay off for the model: every later forward is traced.

A replay is never trusted, and every forward of that signature is traced (said once in the ``idpsgd`` log,
and in :attr:`Attribution.status`), when the trace saw a decision that could make a later forward of the
same signature take another path or get other answers:

* a read of any tensor's values into Python (``.item()``, ``bool(t)``, ``.tolist()``, ...: a branch, a
  length), the allowed reads of transformers' mask fast paths included;
* an operation whose result's size is a value (``nonzero``, ``torch.where(c)``, ``x[mask]``, ``unique``,
  ...: the data-dependent routing of a mixture of experts);
* a tag rule that compares values (a constant whose rows may differ along the batch, an index compared with
  ``arange``);
* a covered layer's weight met in a ``torch.nn.functional`` call (a routed layer) or a covered parameter used
  directly (a value shared by the batch made from it): both need the interception itself.

The first is no decision where FSDP2's own code takes its parameters' storage (sizes and addresses, to allocate and
free the unsharded parameters, at every forward of a sharded model).

What the signature cannot see — a forward whose path depends on Python state outside all this (a draw of Python's
``random``, a global variable, a registry other than transformers' attention functions, an object two levels
down) — is assumed away, as the batch-independence check's probe at the first forward assumes it; a path change
that changes any query is caught (:class:`ReplayDiverged`), and every :data:`RETRACE_EVERY`-th forward of a
signature is traced again and compared with the plan (a difference refuses the step and turns the replay off).

The signature names modules, parameters, buffers and the arguments that are not plain values by ``id()``, and an
id is an object's only while it lives: a plan keeps weak references to those objects (:func:`held`) and is dropped
when one has died (:func:`alive`), so a fresh argument object of each step, or a module swapped in for a freed one,
never matches a plan by taking a freed object's id.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref

import torch
from torch.utils._pytree import tree_flatten

from ...guards.integrity import trigger_hook_id
from ...guards.module_state import AttributeWatch, argument_state, attribute_state
from . import provenance
from .provenance import GETITEM, HOST_READS, ROUTABLE, SIZED_BY_VALUES, ProvenanceMode, Tags, op_name, writes_in_place

log = logging.getLogger("idpsgd")

#: every this many replays of a signature, its forward is traced again and compared with the plan
RETRACE_EVERY = 64
#: signatures kept per model (Poisson batches: one per batch size seen); the oldest plan is dropped beyond
MAX_PLANS = 256
#: a tensor's storage, which FSDP2 takes from the parameters at every forward to allocate, free and compare
#: (``untyped_storage().size()``, ``.data_ptr()``, ``.resize_``: sizes and addresses, not values): not a decision
#: when FSDP2's own code takes it
_STORAGE = frozenset({torch.Tensor.untyped_storage, torch.Tensor.storage, torch.Tensor._typed_storage})
_FSDP_FILES = os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp", "")  # FSDP2's source files
_PROVENANCE = provenance.__name__
_ROWS_OF = provenance.rows_of.__code__


class ReplayDiverged(RuntimeError):
    """A replayed forward asked other queries than its trace (its path depends on something the signature does
    not capture): the step is refused and the model's forwards are traced from then on."""


def _query_key(t) -> tuple:
    return (tuple(t.shape), t.dtype) if torch.is_tensor(t) else (type(t).__name__,)


def _answer(rows) -> tuple | None:
    return None if rows is None else rows.key


def _site(frame) -> tuple:
    """Where a query comes from: the asking function and the object it is a method of (a book-kept layer's
    forward: which layer asks)."""
    owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
    return (frame.f_code, id(owner))


def _label(frame) -> str:
    """A query's place in words (for a divergence's message): the function, and the layer that asks."""
    owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
    layer = getattr(owner, "layer", None) or getattr(owner, "unit", None)
    name = getattr(layer, "name", None)
    return f"{frame.f_code.co_name!r}" + (f" of layer {name!r}" if name is not None else "")


def _external() -> tuple | None:
    """The place (:func:`_site`) of the caller of ``Tags.get`` when it is a query from outside the provenance
    mode's own rules (the keeper, the shared values, ``provenance.rows_of``); None for the mode's rules."""
    frame = sys._getframe(2)
    if frame.f_globals.get("__name__") == _PROVENANCE and frame.f_code is not _ROWS_OF:
        return None
    return _site(frame)


class _RecordingTags(Tags):
    """The tracing mode's tags: also records each query from outside the mode's rules, with its answer."""

    __slots__ = ("queries",)

    def __init__(self):
        super().__init__()
        self.queries: list = []

    def get(self, t, default=None):
        got = Tags.get(self, t, default)
        site = _external()
        if site is not None:
            self.queries.append((site, _query_key(t), got, _label(sys._getframe(1))))
        return got


class TracingMode(ProvenanceMode):
    """The provenance mode of a traced forward: tags as :class:`~.provenance.ProvenanceMode` does, records the
    queries of the keeper and of the shared values with their answers (:attr:`tags`), and the decisions that
    make a replay of this forward unsafe (:attr:`decisions`, module docstring)."""

    def __init__(self, batch: int, signature: tuple | None = None, held: tuple = ()):
        super().__init__(batch)
        self.tags = _RecordingTags()
        self.decisions: list[str] = []
        self.signature = signature  # the forward's (:func:`signature`), under which its plan is kept
        self.held = held  # the objects whose ids the signature holds (:func:`held`), kept with the plan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        paused = self.paused
        if not self.decisions:  # also inside a fallback's forward (paused: its operations are not tagged)
            why = self._decision(func, args, kwargs)
            if why is not None:
                self.decisions.append(why)
        out = super().__torch_function__(func, types, args, kwargs)
        if not self.decisions and not paused and (self.routes or self.sources):
            why = self._interception(func, args, kwargs, out)
            if why is not None:
                self.decisions.append(why)
        return out

    def _decision(self, func, args, kwargs) -> str | None:
        """A decision on tensor values (module docstring), or None."""
        if func in _STORAGE and sys._getframe(2).f_code.co_filename.startswith(_FSDP_FILES):
            return None  # FSDP2 allocating and freeing the unsharded parameters: storage sizes and addresses
        if func in HOST_READS:
            return f"a read of tensor values into Python ({op_name(func)!r})"
        if func in SIZED_BY_VALUES:
            name = op_name(func)
            if name == "where" and len(args) + len(kwargs) > 1:
                return None  # torch.where(c, a, b): elementwise
            tensor_repeats = any(torch.is_tensor(a) for a in (*args[1:], *kwargs.values()))
            if name == "repeat_interleave" and not tensor_repeats and (len(args) != 1 or kwargs):
                return None  # repeats given as a Python int: sized by the shape
            return f"an operation whose result's size is a value ({name!r}: data-dependent routing)"
        if func in GETITEM and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in index):
                return "an index by a boolean mask (x[mask]: its size is a value)"
        return None

    def _interception(self, func, args, kwargs, out) -> str | None:
        """Where the mode itself acted on the operation (a routed layer, a covered parameter used directly and
        replaced by a value shared by the batch): a replay, which intercepts nothing, could not."""
        if self.routes and func in ROUTABLE:
            w = args[ROUTABLE[func]] if len(args) > ROUTABLE[func] else kwargs.get("weight")
            route = self.routes.get(id(w)) if isinstance(w, torch.nn.Parameter) else None
            if route is not None and route[0] is func and route[3] is w:
                return f"a covered layer's weight in {op_name(func)!r} (a routed layer: needs the interception)"
        tensors = torch.is_tensor(out) or (isinstance(out, (tuple, list)) and any(torch.is_tensor(o) for o in out))
        if self.sources and tensors and torch.is_grad_enabled() and not writes_in_place(func):
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.nn.Parameter) and id(a) in self.sources:
                    return f"a covered layer's parameter used directly in {op_name(func)!r} (needs the interception)"
        return None

    def use_routes(self, routes: dict, sources: dict, make_source) -> None:
        """As the provenance mode's, with the keeper's ``parameter_source`` recorded as a decision when the keeper
        calls it (a covered parameter fed to a layer becomes a value shared by the batch: a replay cannot)."""
        if make_source is None:
            super().use_routes(routes, sources, None)
            return

        def recorded(*args, **kwargs):
            # from the mode's own substitution: a decision only where the operation returns a tensor (_interception)
            if not self.decisions and sys._getframe(1).f_globals.get("__name__") != _PROVENANCE:
                self.decisions.append("a covered layer's parameter fed to a layer (needs the interception)")
            return make_source(*args, **kwargs)

        super().use_routes(routes, sources, recorded)

    def _rows_differ(self, t, d, group) -> bool:
        if not self.decisions:
            self.decisions.append("a tag rule that compares the values of a constant (rows that may differ)")
        return super()._rows_differ(t, d, group)

    def _per_row(self, x, idx) -> bool:
        if not self.decisions:
            self.decisions.append("a tag rule that compares an index with arange (by value)")
        return super()._per_row(x, idx)


class _ReplayTags:
    """A replayed forward's tags: each query answered from the plan, in order, after checking its place and key;
    writes are ignored (no rule runs)."""

    __slots__ = ("at", "owner", "plan")

    def __init__(self, plan: list, owner: Attribution):
        self.plan, self.at, self.owner = plan, 0, owner

    def get(self, t, default=None):
        frame = sys._getframe(1)
        site = _site(frame)
        at = self.at
        if at >= len(self.plan):
            self.owner.diverged(f"a query beyond the {len(self.plan)} of the trace, from {_label(frame)}")
        want_site, want_key, answer, where = self.plan[at]
        if want_site != site or want_key != _query_key(t):
            self.owner.diverged(
                f"query {at + 1} of {len(self.plan)} came from {_label(frame)} about {_query_key(t)}; the trace's "
                f"from {where} about {want_key}"
            )
        self.at = at + 1
        return default if answer is None else answer

    def __setitem__(self, t, rows):
        pass


class ReplayMode:
    """Stands in for the provenance mode on its stack (:func:`~.provenance.current`) during a replayed forward:
    intercepts no operation; answers the queries from the plan (:class:`_ReplayTags`)."""

    def __init__(self, batch: int, plan: list, owner: Attribution, signature: tuple | None = None):
        self.batch = batch
        self.routes: dict = {}  # no interception: a forward that needs it is traced (module docstring)
        self.sources: dict = {}
        self.make_source = None
        self.tags = _ReplayTags(plan, owner)
        self.signature = signature

    def tag(self, t, rows) -> None:
        pass

    def pause(self) -> None:  # as the provenance mode's: nothing is tagged anyway
        pass

    def resume(self) -> None:
        pass

    def __enter__(self):
        provenance._STACK.append(self)
        return self

    def __exit__(self, *exc):
        if provenance._STACK and provenance._STACK[-1] is self:
            provenance._STACK.pop()


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    return (type(v).__qualname__, id(v))  # another object: by identity (its state is not looked into)


def _ref(obj):
    """A weak reference to ``obj``, or ``obj`` itself where it takes none (kept alive with the plan)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj


def held(model: torch.nn.Module, args, kwargs) -> tuple:
    """References to the objects whose ids :func:`signature` records — the modules, parameters, buffers and the
    arguments keyed by identity (its own walk collects them) — kept with a traced plan. An id is an object's only
    while it lives: once one of these dies, a new object can take its id and the signature would match another
    model or argument (a module swapped in for a freed one, a fresh argument object of each step), so the plan is
    then dropped (:func:`alive`). Weak references where the object takes one, so a plan keeps nothing alive but
    such arguments."""
    keep: list = []
    signature(model, 0, args, kwargs, keep=keep)
    return tuple(_ref(o) for o in keep)


def alive(refs: tuple) -> bool:
    """Whether every object of :func:`held`'s references still lives (so each id in the signature is still its)."""
    return all(r() is not None for r in refs if type(r) is weakref.ref)


def signature(
    model: torch.nn.Module,
    batch: int,
    args,
    kwargs,
    batch_dim: int = 0,
    keep: list | None = None,
    watch: AttributeWatch | None = None,
) -> tuple:
    """What a forward's sequence of operations is a function of, when no decision depends on tensor values
    (module docstring): the model's structure and its modules' attributes (:mod:`...guards.module_state`), the
    inputs' signature (which of them hold the batch, at ``batch_dim``), the batch size, grad and autocast state.
    ``keep``: a list that receives every object the signature names by id (:func:`held`); ``watch``: the model's
    :class:`AttributeWatch`, which reads the attributes again only where one may have changed."""
    flat, spec = tree_flatten((args, kwargs))
    first: dict = {}  # a tensor argument that is another one (``context is x``): the index of the first
    inputs = tuple(
        (
            tuple(t.shape),
            t.dtype,
            t.device,
            t.requires_grad,
            t.dim() > batch_dim and int(t.shape[batch_dim]) == batch,
            first.setdefault(id(t), i),
        )
        if torch.is_tensor(t)
        else argument_state(t, keep)
        for i, t in enumerate(flat)
    )
    modules, params, buffers, seen_p, seen_b = [], [], [], {}, {}
    walked = list(model.modules())
    for m in walked:  # one walk: each module, then its parameters and buffers not met before (as
        # model.parameters() and model.buffers() list them)
        modules.append(  # the hooks by their handles' ids (a process-wide counter: never one id for two hooks)
            (
                id(m),
                m.training,
                tuple(m._forward_pre_hooks),
                tuple(m._forward_hooks),
                tuple(m._backward_pre_hooks),
                tuple(m._backward_hooks),
            )
        )
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_p:
                seen_p[id(p)] = p
                params.append((id(p), p.requires_grad, p.shape, p.dtype, p.device))
        for b in m._buffers.values():
            if b is not None and id(b) not in seen_b:
                seen_b[id(b)] = b
                buffers.append((id(b), b.shape, b.dtype))
    if keep is not None:  # the objects of the ids above
        keep.extend((*walked, *seen_p.values(), *seen_b.values()))
    attributes = attribute_state(walked, keep) if watch is None else watch.state(walked, keep)
    hooks, trigger = torch.nn.modules.module, trigger_hook_id()  # (the write guard's own global hook: left out)
    state = (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        tuple(k for k in hooks._global_forward_pre_hooks if k != trigger),
        tuple(hooks._global_forward_hooks),
        tuple(hooks._global_backward_pre_hooks),
        tuple(hooks._global_backward_hooks),
    )
    return (batch, batch_dim, str(spec), inputs, tuple(modules), tuple(params), tuple(buffers), attributes, state)


class Attribution:
    """One model's traced plans by signature, and whether to trace or replay its next forward (module docstring).

    :attr:`status` says what the last forward did (``traced``, ``replayed``) and, where a replay is not
    trusted for a signature or was turned off, why."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.plans: dict = {}  # signature -> [plan (list of (site, key, rows)), replays since traced, held refs]
        self.untrusted: dict = {}  # signature -> the decision that makes its replay unsafe
        self.off: str | None = None  # why replays are turned off for this model (a divergence)
        self.enabled = True  # False: trace every forward (as before replays existed)
        self.status = "none"
        self._said: set = set()
        self.watch = AttributeWatch()

    def open(self, batch: int, args, kwargs, batch_dim: int = 0):
        """The mode of a forward about to run: a :class:`ReplayMode` of its signature's plan, or a
        :class:`TracingMode` (the caller tags the batch's tensors, at ``batch_dim``, and gives it the keeper's
        routes)."""
        if not self.enabled or self.off is not None:
            return TracingMode(batch)
        key = signature(self.model, batch, args, kwargs, batch_dim, watch=self.watch)
        plan = self.plans.get(key)
        if plan is not None and not alive(plan[2]):  # an object of the signature died: its id may be another's
            del self.plans[key]
            plan = None
        if plan is not None and plan[1] < RETRACE_EVERY:
            plan[1] += 1
            return ReplayMode(batch, plan[0], self, key)
        return TracingMode(batch, key, held(self.model, args, kwargs) if plan is None else plan[2])

    def forget(self) -> None:
        """Drop every plan (the book-keeper planned its layers anew: the plans' query sites are the old layers')."""
        self.plans.clear()
        self.untrusted.clear()

    def close(self, mode) -> None:
        """After the forward (also after one that raised: then nothing is recorded): store the trace's plan, or
        check that the replay asked every query of its plan."""
        failed = sys.exc_info()[0] is not None
        key = mode.signature
        if isinstance(mode, ReplayMode):
            self.status = "replayed"
            if not failed and mode.tags.at != len(mode.tags.plan):
                self.diverged(f"{mode.tags.at} of the trace's {len(mode.tags.plan)} queries asked")
            return
        self.status = "traced" if self.off is None else f"traced (replay off: {self.off})"
        if failed or key is None:
            return
        held = self.plans.get(key)
        if held is not None and mode.decisions:  # a re-trace of a replayed signature took another path
            self.plans.clear()
            self.diverged(f"a re-trace of a replayed signature saw {mode.decisions[0]}")
        if mode.decisions:
            self.untrusted[key] = mode.decisions[0]
            self._say(
                f"book-keeping: the attribution of this model's forward is traced at every step, not replayed: its "
                f"trace saw {mode.decisions[0]}, which can change the path of a later forward of the same signature"
            )
            self.status = f"traced (not replayed: {mode.decisions[0]})"
            return
        plan = mode.tags.queries
        if held is not None:  # a scheduled re-trace: the same plan, or the replays so far were not proven
            if [(s, k, _answer(r)) for s, k, r, _ in held[0]] != [(s, k, _answer(r)) for s, k, r, _ in plan]:
                self.plans.clear()
                self.diverged("a re-trace of a replayed signature gave another plan")
            held[1] = 0
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = [plan, 0, mode.held]

    def diverged(self, what: str) -> None:
        """Refuse the step: the replay did not follow its trace; every later forward of the model is traced."""
        self.off = what
        self.status = f"traced (replay off: {what})"
        message = (
            f"grad_sample_mode='bk': the replayed attribution of this model's forward diverged from its trace "
            f"({what}): the forward's path depends on something its signature (structure, input shapes and dtypes, "
            "flags) does not capture. The step is refused (no noise drawn, nothing charged); every later forward of "
            "this model is traced"
        )
        self._say(message)
        raise ReplayDiverged(message)

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.info(message)


__all__ = ["RETRACE_EVERY", "Attribution", "ReplayDiverged", "ReplayMode", "TracingMode", "alive", "held", "signature"]
