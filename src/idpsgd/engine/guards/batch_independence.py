"""Each example's output depends on that example alone: models that mix examples within a batch are refused.

DP-SGD's sensitivity bound (Abadi et al. 2016; Boenisch et al. 2023, Alg. 1) clips each example's
gradient at c_i, which bounds one example's influence only if no other example's gradient depends
on it.  At the model's first forward with gradients (a training step or a norm pass) the model is
run twice on a public synthetic batch, the second time with its middle example replaced, and every
other example's outputs must stay within float rounding; otherwise :class:`BatchMixingError` names
the first mixing operation.  Data-independent, once per model and training-flag combination, and
free of side effects (copies of buffers and trainable parameters, the RNG restored).  A batch of
token ids with an attention mask (Hugging Face's ``input_ids`` / ``attention_mask`` keywords) is also
re-padded (:mod:`.padding_check`): every example padded further, one example made longer than the
rest, and each example's outputs on its real tokens must not move — the batch's length is set by its
longest row, so a model that pools over pads or counts positions from the batch's start would let one
example's length move every other example's gradient.  What it cannot see (mixing in the loss or a
custom backward, inputs it cannot interpret) and what it costs: docs/guarantees.md.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name

from ..opacus_compat import UnsupportedModuleError
from .integrity import extra_state_digests, local_tensor, per_model
from .layer_inputs import LayerWatch, check_layer_inputs
from .padding_check import Padding, padding_problem

#: candidate synthetic batch sizes (primes: the first dividing no trailing dimension is used)
_SIZES = (5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97)
#: how much an output row may move (relative to the output's largest magnitude) and still be unchanged
RTOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
RTOL_DEFAULT = 1e-4
_SEED = 0x1D95_6D  # the fixed seed of the synthetic values and of the passes' RNG state


class BatchMixingError(UnsupportedModuleError):
    """A model whose output for one example depends on other examples of the batch."""


def _leaves(obj, out: list) -> list:
    """The tensors of a nested output (tensor, tuple, list, dict, ``ModelOutput``), in order."""
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict of its non-None fields
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)
    return out


def _map(obj, fn):
    """``obj`` with every tensor t replaced by fn(t) (tuples, namedtuples, lists, dicts)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return (
            {k: _map(v, fn) for k, v in obj.items()}
            if type(obj) is dict
            else type(obj)((k, _map(v, fn)) for k, v in obj.items())
        )
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _batch_dim_of(args, kwargs, bd: int = 0) -> int | None:
    first = next((t for t in _leaves((args, kwargs), []) if t.dim() > bd), None)
    return None if first is None else int(first.shape[bd])


def synthetic_batch_size(args, kwargs, bd: int = 0) -> int:
    """The synthetic batch's size: the first of 5, 7, 11, … dividing no other dimension than the batch
    dimension ``bd`` of the call's tensor arguments (a public function of the shapes, never the drawn
    batch size), so that the batch dimension of the model's outputs and intermediates is recognisable by
    its size."""
    dims = {int(d) for t in _leaves((args, kwargs), []) for i, d in enumerate(t.shape) if i != bd and int(d) > 0}
    for size in _SIZES:
        if not any(d % size == 0 for d in dims):
            return size
    return _SIZES[-1]


class _Synthetic:
    """The synthetic batch: its base values and those with the middle example perturbed (the batch at
    dimension ``bd`` of the call's tensors: 0, or 1 for batch-second inputs)."""

    def __init__(self, args, kwargs, bd: int = 0):
        self.bd = bd
        self.real = _batch_dim_of(args, kwargs, bd)
        self.size = synthetic_batch_size(args, kwargs, bd)
        self.mid = self.size // 2
        self.generator = torch.Generator().manual_seed(_SEED)
        self._made: set[int] = set()  # ids of the synthetic tensors (kept alive by self.base)
        self.base = _map((args, kwargs), self._base)
        self.perturbed = _map(self.base, self._perturb)

    def _is_example(self, t: torch.Tensor) -> bool:
        return self.real is not None and t.dim() > self.bd and int(t.shape[self.bd]) == self.real

    def _base(self, t: torch.Tensor) -> torch.Tensor:
        if not self._is_example(t):
            return t
        shape = list(t.shape)
        shape[self.bd] = self.size
        if t.is_floating_point() or t.is_complex():
            out = torch.randn(shape, generator=self.generator, dtype=torch.float64).to(t.dtype).to(t.device)
        else:
            out = torch.ones(shape, dtype=t.dtype, device=t.device)
        self._made.add(id(out))
        return out

    def _perturb(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self._made:
            return t
        out = t.clone()
        target = out.select(self.bd, self.mid)
        if t.is_floating_point() or t.is_complex():
            row = 10 * torch.randn(tuple(target.shape), generator=self.generator, dtype=torch.float64)
            target.copy_(row.to(t.dtype).to(t.device))
        else:
            target.fill_(0)
        return out


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` differs from ``a`` beyond float rounding (NaNs in the same places agree)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return not torch.equal(a, b)
    tol = RTOL.get(a.dtype, RTOL_DEFAULT)
    a, b = a.detach(), b.detach()
    if torch.equal(a, b):  # the usual case, cheap
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    same_nan = torch.isnan(a) == torch.isnan(b)
    if not bool(same_nan.all()) or not a.numel():
        return not bool(same_nan.all())
    a, b = torch.nan_to_num(a.double(), nan=0.0), torch.nan_to_num(b.double(), nan=0.0)
    scale = float(torch.maximum(a.abs().max(), b.abs().max()))  # relative to the output's own scale
    return bool(((a - b).abs() > tol * scale).any())


def _others(t: torch.Tensor, size: int, mid: int) -> torch.Tensor | None:
    """The rows of ``t`` that belong to other examples than ``mid`` (None: no batch layout seen)."""
    dims = [d for d in range(t.dim()) if int(t.shape[d]) == size]
    if len(dims) == 1:
        d = dims[0]
        return torch.cat([t.narrow(d, 0, mid), t.narrow(d, mid + 1, size - mid - 1)], d)
    if not dims and t.dim() > 0 and int(t.shape[0]) > 0 and int(t.shape[0]) % size == 0:  # (B·T, ...) flattened
        rows = t.reshape(size, -1)
        return torch.cat([rows[:mid], rows[mid + 1 :]])
    return None


def _outputs_mix(a, b, size: int, mid: int, bd: int = 0) -> bool | None:
    """Whether any batched output tensor's other rows differ (None: no output has the batch dimension):
    the batch leading, or for batch-second inputs (``bd``) at that dimension (a (T, B, V) output)."""
    la, lb = _leaves(a, []), _leaves(b, [])
    if len(la) != len(lb):
        return True
    seen = False
    for x, y in zip(la, lb, strict=True):
        if bd and x.dim() > bd and int(x.shape[bd]) == size and (int(x.shape[0]) % size or not int(x.shape[0])):
            if x.shape != y.shape:
                return True
            x, y = x.movedim(bd, 0), y.movedim(bd, 0)
        if x.dim() == 0 or int(x.shape[0]) == 0 or int(x.shape[0]) % size:
            continue
        if x.shape != y.shape:
            return True
        if int(x.shape[0]) != size:  # (B·T, ...) flattened batch-first (a language model's logits.view(-1, V))
            x, y = x.reshape(size, -1), y.reshape(size, -1)
        seen = True
        if _differs(x[:mid], y[:mid]) or _differs(x[mid + 1 :], y[mid + 1 :]):
            return True
    return False if seen else None


class _Recorder(TorchFunctionMode):
    """Records every top-level torch function call: (name, module path, input tensors, output tensors)."""

    def __init__(self, stack: list, skip: set[int]):
        super().__init__()
        self.stack, self.calls, self.skip = stack, [], skip  # skip: the model's own tensors (not recorded)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "dim", "size", "numel", "__len__"):
            return func(*args, **kwargs)
        # the inputs as they were before the call (an in-place update changes them)
        ins = [t.detach().clone() for t in _leaves((args, kwargs), []) if id(t) not in self.skip]
        out = func(*args, **kwargs)
        try:
            name = resolve_name(func) or getattr(func, "__qualname__", repr(func))
        except Exception:
            name = repr(func)
        outs = [t.detach().clone() for t in _leaves(out, [])]
        self.calls.append((name, self.stack[-1] if self.stack else ("", None), ins, outs))
        return out


def _locate(calls_a, calls_b, size: int, mid: int) -> tuple[str, str, str] | None:
    """(operation, module path, module type) of the first call whose inputs' other rows agree but whose
    output's other rows differ, or whose floating-point output lost the batch dimension and changed."""
    for (name, where, ins_a, outs_a), (name_b, _, ins_b, outs_b) in zip(calls_a, calls_b, strict=False):
        if name != name_b or len(ins_a) != len(ins_b) or len(outs_a) != len(outs_b):
            return None  # the passes took other paths: no operation can be named
        clean, batched = True, False
        for x, y in zip(ins_a, ins_b, strict=True):
            rx, ry = _others(x, size, mid), _others(y, size, mid)
            if rx is not None and ry is not None and rx.shape == ry.shape:
                batched = True
                clean = clean and not _differs(rx, ry)
            else:
                clean = clean and not _differs(x, y)
            if not clean:
                break
        if not clean or not batched:
            continue
        for x, y in zip(outs_a, outs_b, strict=True):
            rx, ry = _others(x, size, mid), _others(y, size, mid)
            if rx is not None and ry is not None and rx.shape == ry.shape:
                mixed = _differs(rx, ry)
            else:
                mixed = x.is_floating_point() and _differs(x, y)  # a reduction over the batch
            if mixed:
                path, module = where
                return name, path, type(module).__name__ if module is not None else ""
    return None


class BatchIndependence:
    """The check attached to one model (:meth:`attach`): a forward pre-hook on its root module, and
    on a training wrapper that calls it through other parameters (``grad_sample_mode="ew"``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.passed: set[tuple] = set()  # the training-flag signatures checked
        self.running = self.in_wrapper = False
        self._handles = [model.register_forward_pre_hook(_Hook(self), with_kwargs=True, prepend=True)]
        self._wrappers: weakref.WeakSet = weakref.WeakSet()
        self._outer: list = []  # weak references to the training wrappers around the model (their user hooks)
        self.padding = Padding()  # how the run pads token batches (public; declare_padding)
        #: the mode whose per-layer hooks must be able to attribute every layer (:mod:`.layer_inputs`), if any
        self.per_layer_mode: str | None = None
        #: where the loader's batch is in the model's tensor arguments: 0, or 1 for batch-second inputs
        #: (``batch_first=False``, the user's declaration; the engine's norm passes read it too)
        self.batch_dim = 0
        #: Opacus's modes with batch-second inputs: the dimension Opacus takes each layer's batch from (1),
        #: proven by provenance at the check (:func:`_layer_layout_problem`); None: nothing to prove (bk)
        self.per_layer_dim: int | None = None

    @classmethod
    def attach(cls, model: nn.Module) -> BatchIndependence:
        return per_model(model, "_idpsgd_batch_independence", cls)

    def watch_wrapper(self, wrapper: nn.Module) -> None:
        """Check at ``wrapper``'s forward, before it calls the model with other parameters (PyTorch's
        ExpandedWeights); the model's own hook stays out while the wrapper's forward runs."""
        if wrapper not in self._wrappers:
            self._wrappers.add(wrapper)
            self._handles.append(wrapper.register_forward_pre_hook(_Hook(self, True), with_kwargs=True, prepend=True))
            self._handles.append(wrapper.register_forward_hook(_Hook(self, False), always_call=True))

    def declare_padding(self, padding: Padding) -> None:
        """How every token batch of the run is padded (:func:`declare_padding`: public facts the caller
        guarantees), read by the re-padding probe."""
        self.padding = padding

    def declare_layout(self, batch_dim: int, per_layer_dim: int | None, per_layer_mode: str | None) -> None:
        """Where the loader's batch is in the model's tensor arguments (``batch_dim``: 0, or 1 for batch-second
        inputs), the dimension Opacus's modes take each layer's batch from when it must be proven
        (``per_layer_dim``), and the mode whose per-layer hooks must attribute every layer (``per_layer_mode``,
        :mod:`.layer_inputs`); public facts of the run, set by the wrapper's build (``per_example/wrap.py``)."""
        self.batch_dim, self.per_layer_dim, self.per_layer_mode = batch_dim, per_layer_dim, per_layer_mode

    def wrapped_by(self, wrapper: nn.Module) -> None:
        """``wrapper`` (the module ``make_private`` returns) calls the model: the user's hooks on it are part
        of the model's forward and run in the synthetic passes, outside the model's own."""
        if wrapper is not self.model and all(ref() is not wrapper for ref in self._outer):
            self._outer.append(weakref.ref(wrapper))

    def outer(self) -> tuple:
        return tuple(w for w in (ref() for ref in self._outer) if w is not None)

    def __deepcopy__(self, memo):  # a copied (or pickled) model gets its own check when it needs one
        return None

    def __reduce__(self):
        return type(None), ()

    def enter_wrapper(self, args, kwargs) -> None:
        """A watched wrapper's forward starts (:meth:`watch_wrapper`): check its call, then keep the
        model's own hook out until :meth:`leave_wrapper`."""
        self.before_forward(args, kwargs)
        self.in_wrapper = True

    def leave_wrapper(self) -> None:
        """A watched wrapper's forward ended (its forward hook, called even when the forward raised)."""
        self.in_wrapper = False

    def model_called(self, args, kwargs) -> None:
        """The model's forward pre-hook: check the call unless a watched wrapper's forward checked it."""
        if not self.in_wrapper:
            self.before_forward(args, kwargs)

    def _signature(self) -> tuple:
        return tuple(m.training for m in self.model.modules())

    def before_forward(self, args, kwargs) -> None:
        if self.running or not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
            # under vmap/grad the call is a per-sample computation (the user's own in no_op mode, Opacus's
            # functorch per-layer pass): its inputs are not a batch, and the normal forward was checked
            return
        key = (self._signature(), self.per_layer_mode)
        if key in self.passed:
            return
        self.running = True
        # the per-layer modes' attribution check watches the first synthetic pass (.layer_inputs); batch-second
        # layers are left to the provenance proof (_refuse_layout)
        per_layer = None if self.per_layer_dim is not None else 0
        watch = LayerWatch(self.model, per_layer) if self.per_layer_mode is not None else None
        try:
            result = _probe(self.model, args, kwargs, self.outer(), self.batch_dim, watch)
            if not result.written:
                _refuse(self.model, result, self.outer())  # mixing first: the truer reason
                if self.per_layer_dim is not None:
                    _refuse_layout(self.model, result.synthetic, self.per_layer_dim, self.outer())
        finally:
            self.running = False
        if result.written:
            # a forward that writes the model (on the check's copies: the model is unchanged) is the write
            # guard's (.integrity): it refuses the step or norm pass before any noise, and every later one
            return
        _check_padding(self.model, args, kwargs, self.padding, self.outer(), self.batch_dim)
        if watch is not None:
            check_layer_inputs(self.model, self.per_layer_mode, watch, result.synthetic.size)
        self.passed.add(key)


class _Hook:
    """The model's forward pre-hook; on a wrapper (``wrapper`` True/False) its pre-hook and its hook."""

    def __init__(self, check: BatchIndependence | None, wrapper: bool | None = None):
        self.check, self.wrapper = check, wrapper

    def __call__(self, _module, args, *rest):
        if self.check is None:
            return
        if self.wrapper is False:  # the wrapper's forward ended
            self.check.leave_wrapper()
        elif self.wrapper:
            self.check.enter_wrapper(args, rest[0])
        else:
            self.check.model_called(args, rest[0])

    def __deepcopy__(self, memo):
        return _Hook(None, self.wrapper)

    def __reduce__(self):
        return _Hook, (None, self.wrapper)


class _Copies:
    """The tensors a synthetic pass runs on: copies of the buffers and of the trainable parameters (tied
    ones stay tied), so that a forward that writes the model writes the copies; frozen parameters are
    used as they are (no copy of a large frozen base model) and watched by their version counters."""

    def __init__(self, model: nn.Module):
        self.originals, self.copies, made = {}, {}, {}
        named = [*model.named_buffers(remove_duplicate=False)]
        # FSDP2's sharded (DTensor) parameters are not copied: the forward runs on the unsharded tensors
        # FSDP2 gathers from them and frees after it; their local shards are watched as frozen ones are
        named += [
            (n, p)
            for n, p in model.named_parameters(remove_duplicate=False)
            if p.requires_grad and p is local_tensor(p)
        ]
        for name, t in named:
            if id(t) not in made:
                made[id(t)] = t.detach().clone()
            self.originals[name], self.copies[name] = t, made[id(t)]
        self.frozen = [
            (n, local_tensor(p), local_tensor(p)._version)
            for n, p in model.named_parameters()
            if not p.requires_grad or p is not local_tensor(p)
        ]
        self.ids = {id(t) for t in made.values()} | {id(p) for _, p, _ in self.frozen}
        # modules' extra state (state_dict's _extra_state): saved, compared and put back after the pass
        self.extra = [
            (m, copy.deepcopy(m.get_extra_state()))
            for m in model.modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state
        ]
        self.extra_digests = extra_state_digests(model) if self.extra else {}

    def restore_extra(self, model: nn.Module) -> list[str]:
        """Put every module's extra state back; the names of those the pass changed."""
        if not self.extra:
            return []
        now = extra_state_digests(model)
        for m, state in self.extra:
            m.set_extra_state(copy.deepcopy(state))
        return [name for name in now if now[name] != self.extra_digests.get(name)]

    def written(self, model: nn.Module) -> list[str]:
        """What the pass wrote (called inside it): a copy rebound, written in place or through ``.data``."""
        out = []
        for name, twin in self.copies.items():
            owner, _, attr = name.rpartition(".")
            now = getattr(model.get_submodule(owner), attr, None)
            if now is not twin or not torch.equal(twin, self.originals[name].detach()):
                out.append(name)
        return out + [n for n, p, v in self.frozen if p._version != v]


def _is_library_hook(hook) -> bool:
    """Whether a hook is the library's or Opacus's own (the check, the write guard, the book-keeper,
    Opacus's per-sample-gradient hooks): those stay out of the synthetic passes."""
    fn = getattr(hook, "func", hook)  # functools.partial
    name = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return name.split(".")[0] in ("idpsgd", "opacus")


def _forward(model: nn.Module, args, kwargs, outer: tuple = ()):
    """``model(*args, **kwargs)`` as ``Module.__call__`` runs it — the global and the root's own forward
    pre-hooks and forward hooks around ``forward`` — but without the library's hooks (the check itself,
    the write guard, the book-keeper): a user's hook on the root that mixes the batch (``x - x.mean(0)``
    in a pre-hook, a batch-centred output in a forward hook) is part of the model the check must see."""
    from torch.nn.modules import module as _m

    if outer:  # a training wrapper's user hooks around the model's (its forward calls the model)
        return _hooked(outer[0], args, kwargs, lambda a, k: _forward(model, a, k, outer[1:]), _m)
    return _hooked(model, args, kwargs, lambda a, k: model.forward(*a, **k), _m)


def _hooked(module: nn.Module, args, kwargs, forward, _m):
    for hid, hook in (*_m._global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()):
        if _is_library_hook(hook):
            continue
        if hid in module._forward_pre_hooks_with_kwargs:
            res = hook(module, args, kwargs)
            if res is not None:
                args, kwargs = res
        else:
            res = hook(module, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    out = forward(args, kwargs)
    for hid, hook in (*_m._global_forward_hooks.items(), *module._forward_hooks.items()):
        if _is_library_hook(hook):
            continue
        if hid in module._forward_hooks_with_kwargs or hid in _m._global_forward_hooks_with_kwargs:
            res = hook(module, args, kwargs, out)
        else:
            res = hook(module, args, out)
        if res is not None:
            out = res
    return out


def _run(model: nn.Module, args, kwargs, record: list | None = None, outer: tuple = (), within=None, watch=None):
    """One synthetic pass: (output, names written) from the same state each time — fresh copies, the RNG
    at the fixed seed (the global RNG state restored afterwards), no gradients; ``within``: a context
    manager the pass runs in (a torch function mode)."""
    from torch.nn.utils.stateless import _reparametrize_module

    copies = _Copies(model)
    devices = sorted({t.device.index or 0 for t in copies.originals.values() if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), _reparametrize_module(model, copies.copies, strict=False):
        torch.manual_seed(_SEED)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if record is not None:
                record.append(stack.enter_context(_Recorder(record.pop(), copies.ids)))
            if within is not None:
                stack.enter_context(within)
            if watch is not None:  # the per-layer modes' attribution check (.layer_inputs), on the copies
                stack.enter_context(watch)
            try:
                out = _forward(model, args, kwargs, outer)  # the user's root hooks run; the library's stay out
            finally:
                changed = copies.restore_extra(model)
        return out, copies.written(model) + changed


@dataclass
class _Result:
    synthetic: _Synthetic | None
    mixes: bool | None  # None: no output with the batch dimension
    written: list[str]


def _probe(model: nn.Module, args, kwargs, outer: tuple = (), bd: int = 0, watch=None) -> _Result:
    synth = _Synthetic(args, kwargs, bd)
    name = type(model).__name__
    if synth.real is None:
        raise BatchMixingError(
            "module",
            name,
            "was called without a tensor argument: the check that each example's output depends on that example "
            "alone needs the batch as tensor arguments of the model's forward",
        )
    (a_args, a_kwargs), (b_args, b_kwargs) = synth.base, synth.perturbed
    try:
        out_a, written = _run(model, a_args, a_kwargs, outer=outer, watch=watch)
        out_b, written_b = _run(model, b_args, b_kwargs, outer=outer)
        mixes = _outputs_mix(out_a, out_b, synth.size, synth.mid, bd)
    except BatchMixingError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise BatchMixingError(
            "module",
            name,
            f"could not be run on a synthetic batch of {synth.size} examples of the call's shapes (values from a fixed "
            f"generator; integer inputs 1, one example 0) to check that each example's output depends on that "
            f"example alone: {type(exc).__name__}: {first}",
        ) from exc
    return _Result(synth, mixes, sorted(set(written) | set(written_b)))


def _refuse(model: nn.Module, result: _Result, outer: tuple = ()) -> None:
    name = type(model).__name__
    if result.mixes is None:
        raise BatchMixingError(
            "module",
            name,
            "returns no tensor whose leading dimension is the batch (nor, with batch-second inputs, its second): the "
            "check that each example's output depends "
            "on that example alone compares per-example outputs; return them (e.g. the logits) and compute the loss "
            "outside the model",
        )
    if result.mixes:
        where = _localise(model, result.synthetic, outer)
        if where is None:
            culprit = "the operation could not be localised"
        else:
            op, path, kind = where
            culprit = f"first at {op} in module {path or '(root)'!r} ({kind})"
        raise BatchMixingError(
            "module",
            name,
            f"mixes examples within the batch ({culprit}): changing one example of a synthetic batch changed the "
            "outputs of the others, so each example's gradient depends on the whole batch and per-example clipping "
            "bounds no example's influence (batch normalisation in training mode, statistics or attention over the "
            "batch dimension); use per-example layers (GroupNorm, LayerNorm; get_compatible_module, i.e. "
            "opacus.validators.ModuleValidator.fix, replaces BatchNorm by GroupNorm), or batch_first=False for "
            "batch-second (T, B, ...) inputs",
        )


def check_batch_independence(
    model: nn.Module, args, kwargs, padding: Padding | None = None, batch_dim: int = 0
) -> None:
    """Raise :class:`BatchMixingError` if ``model``'s output rows for one example depend on another
    example of the batch, for a call ``model(*args, **kwargs)`` (module docstring: the synthetic batch,
    what is compared, what is not seen; ``padding``: how the run pads its token batches; ``batch_dim``:
    1 for batch-second inputs).  Writes nothing to the model and restores the global RNG."""
    _refuse(model, _probe(model, args, kwargs, bd=batch_dim))
    _check_padding(model, args, kwargs, padding or Padding(), batch_dim=batch_dim)


def _check_padding(model: nn.Module, args, kwargs, padding: Padding, outer: tuple = (), batch_dim: int = 0) -> None:
    """The re-padding probe (:mod:`.padding_check`) over the value probe's synthetic batch and passes:
    refused when one example's length moves another example's outputs on its real tokens."""
    if not isinstance(kwargs, dict) or "input_ids" not in kwargs:
        return
    if batch_dim:
        raise BatchMixingError(
            "module",
            type(model).__name__,
            "was called with input_ids in a batch-second layout (batch_first=False): the re-padding probe, which "
            "checks that one example's length does not move the others' outputs, pads token batches (B, T) along "
            "their second dimension; give batch-first token batches (batch_first=True)",
        )
    synth = _Synthetic(args, kwargs)
    base_args, base_kwargs = synth.base
    config = getattr(model, "config", None)

    def outputs(call_kwargs: dict) -> list:
        try:
            with _dropout_off(model, outer):
                return _leaves(_run(model, base_args, call_kwargs, outer=outer)[0], [])
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise BatchMixingError(
                "module",
                type(model).__name__,
                f"could not be run on a re-padded synthetic token batch (the call's layout, other lengths) to check "
                f"that one example's length does not move the others' outputs: {type(exc).__name__}: {first}",
            ) from exc

    problem = padding_problem(
        kwargs, base_kwargs, synth.size, padding, outputs, _differs, getattr(config, "pad_token_id", None)
    )
    if problem is not None:
        raise BatchMixingError("module", type(model).__name__, problem)


@contextlib.contextmanager
def _dropout_off(model: nn.Module, outer: tuple = ()):
    """Every module in evaluation mode for the re-padding passes (their flags restored): dropout draws
    its masks for the batch's shape, so batches of other lengths get other masks — masks independent
    per element, not a dependence on other examples, which the value probe (same shapes, same masks)
    checks in training mode."""
    flags = {m: m.training for root in (model, *outer) for m in root.modules()}
    try:
        for m in flags:
            m.training = False
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def declare_padding(model: nn.Module, side: str | None = None, length: int | None = None) -> None:
    """Tell ``model``'s check how every token batch of the run is padded (public facts the caller
    guarantees): ``side`` ``"right"`` or ``"left"`` (default: as the checked call's attention mask
    shows, both sides when it shows none), ``length`` a fixed number of tokens of every batch (the
    length can then not vary: the re-padding probe is replaced by a check of the call's length)."""
    BatchIndependence.attach(model).declare_padding(Padding(side, length))


def _layer_layout_problem(model: nn.Module, synth: _Synthetic, dim: int, outer: tuple = ()) -> str | None:
    """Where a trainable layer does not get the batch at ``dim`` (Opacus's per-layer assumption for
    batch-second inputs; its RNN cells, :class:`opacus.layers.dp_rnn.RNNLinear`, take it first): the base
    synthetic pass again under book-keeping's provenance (:mod:`.bk.provenance`), which knows each
    tensor's batch dimension from the inputs, never from a shape; None when every such layer's batch
    inputs have it there, one example per row."""
    from opacus.layers.dp_rnn import RNNLinear

    from ..per_example.bk import provenance

    mode = provenance.ProvenanceMode(synth.size)
    args, kwargs = synth.base
    for t in _leaves((args, kwargs), []):
        if synth._is_example(t) or id(t) in synth._made:
            mode.tags[t] = provenance.Rows(synth.bd)
    problems: list[str] = []

    def check(path):
        def hook(module, a, kw):
            want = 0 if isinstance(module, RNNLinear) else dim
            rows = [(t, mode.tags.get(t)) for t in _leaves((a, kw), [])]
            tagged = [(t, r) for t, r in rows if r is not None]
            # a value not from the batch, the same in each of its B rows (an RNN's initial state): per row, exact
            constant = all(
                t.dim() > want and int(t.shape[want]) == synth.size and bool((t == t.narrow(want, 0, 1)).all())
                for t, r in rows
                if r is None
            )
            if not tagged and not (rows and constant):
                problems.append(
                    f"layer {path!r} ({type(module).__name__}) gets no input derived from the batch, nor one value "
                    f"for every example along dimension {want}"
                )
            for t, r in tagged:
                if not r.known or r.dim != want or r.group != 1:
                    where = f"the batch at dimension {r.dim}" if r.known else f"rows of no single example ({r.mixed})"
                    if r.known and r.group != 1:
                        where += f" (rows grouped by {r.group})"
                    problems.append(
                        f"layer {path!r} ({type(module).__name__}) gets an input of shape {tuple(t.shape)} with "
                        f"{where}, where Opacus takes it at dimension {want}"
                    )
                    break

        return hook

    handles = [
        m.register_forward_pre_hook(check(path), with_kwargs=True)
        for path, m in model.named_modules()
        if path and any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    if any(p.requires_grad for p in model.parameters(recurse=False)):  # the root's pre-hooks do not run here
        check(type(model).__name__)(model, args, kwargs)
    try:
        _run(model, args, kwargs, outer=outer, within=mode)
    except provenance.RefusedRows as exc:
        problems.append(str(exc).split(": ", 1)[-1])
    finally:
        for h in handles:
            h.remove()
    return problems[0] if problems else None


def _refuse_layout(model: nn.Module, synth: _Synthetic, dim: int, outer: tuple = ()) -> None:
    """Refuse batch-second inputs where Opacus would take a layer's per-sample gradients along another
    dimension than its batch (:func:`_layer_layout_problem`): with the drawn batch size equal to T it
    would clip positions as examples."""
    from ...validation import InvalidParameterError
    from ..opacus_compat import BATCH_SECOND

    problem = _layer_layout_problem(model, synth, dim, outer)
    if problem is not None:
        raise InvalidParameterError(
            "batch_first",
            False,
            f"is not supported for this model in grad_sample_mode 'hooks', 'functorch' or 'ghost': {problem}; use "
            "grad_sample_mode='bk' (which takes every layer's batch where it is), or batch-first inputs. "
            + BATCH_SECOND,
        )


def _localise(model: nn.Module, synth: _Synthetic, outer: tuple = ()) -> tuple[str, str, str] | None:
    """Both passes again under a :class:`_Recorder`, with the module stack from forward hooks."""
    stack: list = []
    handles = []

    def enter(path):
        def hook(module, _args):
            stack.append((path, module))

        return hook

    def leave(*_):
        stack.pop()

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    stack.append(("", model))  # model.forward is called directly: its own hooks do not run
    try:
        calls = []
        for args, kwargs in (synth.base, synth.perturbed):
            record = [stack]
            _run(model, args, kwargs, record, outer)
            calls.append(record[0].calls)
    finally:
        for h in handles:
            h.remove()
    return _locate(calls[0], calls[1], synth.size, synth.mid)


__all__ = [
    "BatchIndependence",
    "BatchMixingError",
    "Padding",
    "check_batch_independence",
    "declare_padding",
    "synthetic_batch_size",
]
