"""Provenance in book-keeping: which tensors of the model's forward derive from the batch, and which of
their rows belong to which example.

Taking a tensor for the batch because its leading dimension equals the batch size B fails silently
(T5's (T, T) buckets at T = B, a constant bank of B scales, (T, B, d) with T = B, a batch-1 value
computed from the batch).  Here the batch dimension is a *fact*: :class:`ProvenanceMode`, a torch
function mode active during the model's forward, tags the forward's batch-first tensor arguments
with their :class:`Rows` and every result computed from them: operations known to act row by row
keep the rows, a ``view`` merging the batch with later dimensions groups them (row r of (B·T, d)
belongs to example r // T), and anything that mixes the rows, or has no rule, gives rows of no single
example (``Rows.mixed`` names the operation).  An untagged tensor is *shared* by the batch,
whatever its shape.  A trainable parameter meeting mixed rows (:mod:`.keeper`, :mod:`.shared`) is
refused, naming both operations; so is a read into Python (``.item()``, ``.tolist()``, ``bool(t)``, ...) of
such rows, where the value would leave the tags (but at transformers' mask fast paths, :data:`HOST_READ_SITES`).
Tags follow tensors by identity, and the memory that writes leave with batch values by address
(:mod:`.memory`): an alias the rules did not see reads that memory's rows.
The rule tables are checked against a perturbed example by ``tests/test_provenance_rules.py``.  Nothing is
tracked when B ≤ 1.

The operations and their rules, with what is refused: ``docs/performance.md`` (Provenance).
"""

from __future__ import annotations

import math
import sys
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .memory import TaggedMemory, WrittenMemory, storage_key

_T = torch.Tensor


class Rows:
    """Which example each row along a tensor's batch dimension belongs to.

    ``dim`` is the batch dimension; row r belongs to unit r // ``group`` (contiguous groups: a
    reshape that merged the batch with the next dimensions).  ``mixed`` (a string naming the
    operation) when the rows belong to no single example, or nobody knows: then ``dim`` is None."""

    __slots__ = ("dim", "group", "mixed")

    def __init__(self, dim: int | None, group: int = 1, mixed: str | None = None):
        self.dim, self.group, self.mixed = dim, group, mixed

    @property
    def known(self) -> bool:
        return self.mixed is None

    def moved(self, dim: int) -> Rows:
        return self if dim == self.dim else Rows(dim, self.group)

    def reshaped(self, shape_in, shape_out) -> Rows | None:
        """These rows of a tensor of ``shape_in`` after a reshape to ``shape_out`` (None: not one example per row)."""
        return _reshape_rows(shape_in, self, shape_out)

    @property
    def key(self) -> tuple:
        """What the rows say, comparable: (dim, group, mixed)."""
        return (self.dim, self.group, self.mixed)

    def __repr__(self):
        return f"Rows(mixed by {self.mixed})" if self.mixed else f"Rows(dim={self.dim}, group={self.group})"


BATCH = Rows(0, 1)
#: a rule's answer for a result that does not derive from the batch's values (a constant viewed as a batch tensor)
SHARED = Rows(None, 1, "shared")


def _mixed(why) -> Rows:
    return Rows(None, 1, why)


def op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property (Tensor.T, Tensor.mT; a Python property's getter)
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", None) or getattr(getattr(owner, "fget", None), "__name__", name)
    return name


_Parameter = torch.nn.Parameter


def _inplace(func) -> bool:
    name = getattr(func, "__name__", "").partition(".")[0]  # an aten overload: copy_.default
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def writes_in_place(func) -> bool:
    """Whether ``func`` writes its first argument in place (``add_``, ``__iadd__``)."""
    return _inplace(func)


_STACK: list[ProvenanceMode] = []


def current() -> ProvenanceMode | None:
    """The provenance mode of the model forward in progress (None outside one, or with B ≤ 1)."""
    return _STACK[-1] if _STACK else None


def rows_of(t) -> Rows | None:
    """The rows of ``t`` in the forward in progress (None: not derived from the batch, or no forward)."""
    mode = current()
    return None if mode is None or not torch.is_tensor(t) else mode.tags.get(t)


class RefusedRows(RuntimeError):
    """A trainable parameter met rows that belong to no single example."""


def host_read_refusal(op: str, rows: Rows, several: bool = False) -> RefusedRows:
    """The refusal of a read into Python of rows that mix examples, or (``several``) of several examples' rows."""
    if several:
        return RefusedRows(
            f"grad_sample_mode='bk': the model's forward reads into Python ({op!r}) the values of several examples "
            "of the batch at once (rows that are each one example's, but many of them): Python can combine them "
            "(a sum, a maximum, a branch, a length) and steer every example's computation with the result, which "
            "per-example clipping does not bound and book-keeping cannot follow outside tensors. Keep the "
            "computation in tensors row by row (torch.where, per-example masks), compute the value from public "
            "values (shapes, constants), or move it out of the model's forward"
        )
    return RefusedRows(
        f"grad_sample_mode='bk': the model's forward reads into Python ({op!r}) a tensor whose rows are not each "
        f"one example's: they come from {rows.mixed!r}, which reduces or mixes across the batch dimension; a "
        "Python value of the whole batch (a branch, a scale, a length) can steer every example's computation, "
        "which per-example clipping does not bound. Keep it a tensor per example (e.g. mask.all(dim=1) with "
        "torch.where, per-example lengths), compute it from public values (shapes, constants), or move it out "
        "of the model's forward"
    )


#: the standard replacement of an operation that mixes the examples of a batch by design
_REPLACEMENTS = {
    "batch_norm": "batch normalisation in training mode normalises each example by statistics of the whole batch, "
    "by design; replace it by GroupNorm (opacus.validators.ModuleValidator.fix, i.e. "
    "IndividualizedPrivacyEngine.get_compatible_module, does) or LayerNorm"
}


def refusal(where: str, rows: Rows) -> RefusedRows:
    instead = _REPLACEMENTS.get(rows.mixed or "")
    return RefusedRows(
        f"grad_sample_mode='bk': {where} meets a tensor whose rows are not each one example's: they come "
        f"from {rows.mixed!r}, which reduces, mixes or selects across the batch dimension (a reduction, sort, "
        "cumsum or product over it, a slice of it, batch_norm in training) or which book-keeping does not "
        "know to act row by row; per-example gradients are undefined there. "
        + (
            f"Here {instead}"
            if instead
            else "Keep such operations off the batch dimension, or use grad_sample_mode='hooks' for a model whose "
            "examples interact"
        )
    )


# --- the operations --------------------------------------------------------------------------------
def _fns(*names, modules=(torch, _T, F)):
    out = set()
    for name in names:
        for m in modules:
            f = getattr(m, name, None)
            # torch.float is a dtype, torch.cuda a module, torch.__eq__ the module's own (object) method
            if callable(f) and not isinstance(f, torch.dtype) and getattr(f, "__self__", None) is not m:
                out.add(f)
    return out


#: elementwise operations (with broadcasting): each tagged input's batch dimension, right-aligned
_POINTWISE_NAMES = """
add add_ __add__ __radd__ __iadd__ sub sub_ subtract __sub__ __rsub__ __isub__ rsub mul mul_
multiply __mul__ __rmul__ __imul__ div div_ divide true_divide __truediv__ __rtruediv__ __itruediv__
floor_divide __floordiv__ __rfloordiv__ remainder __mod__ fmod pow pow_ __pow__ __rpow__ neg __neg__
negative abs exp exp_ expm1 log log_ log1p log2 log10 sqrt rsqrt sin cos tan tanh tanh_ sigmoid
sigmoid_ erf erfc relu relu_ gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid
softplus softsign tanhshrink logsigmoid threshold relu6 sign sgn clamp clamp_ clip clamp_min
clamp_max maximum minimum where masked_fill masked_fill_ lerp addcmul addcdiv square reciprocal
floor ceil round trunc frac isnan isinf isfinite nan_to_num logical_not logical_and logical_or
logical_xor bitwise_not bitwise_and bitwise_or bitwise_xor __and__ __or__ __xor__ __invert__
__rand__ __ror__ __iand__ __ior__ eq ne lt le gt ge __eq__ __ne__ __lt__ __le__ __gt__ __ge__ eq_
ne_ float double half bfloat16 int long bool to type type_as contiguous clone detach detach_
requires_grad_ cpu cuda fill_ zero_ copy_ dropout dropout_ alpha_dropout feature_alpha_dropout
dropout1d dropout2d dropout3d atan2 hypot xlogy logaddexp heaviside sinh cosh asin acos atan asinh
acosh atanh deg2rad rad2deg digamma lgamma exp2 square_
abs_ acos_ acosh_ addcdiv_ addcmul_ asin_ asinh_ atan_ atan2_ atanh_ bitwise_and_ bitwise_not_ bitwise_or_
bitwise_xor_ ceil_ clamp_max_ clamp_min_ clip_ cos_ cosh_ deg2rad_ digamma_ divide_ erf_ erfc_ exp2_ expm1_ floor_
floor_divide_ fmod_ frac_ ge_ gt_ heaviside_ hypot_ le_ lerp_ lgamma_ log10_ log1p_ log2_ logical_and_ logical_not_
logical_or_ logical_xor_ lt_ multiply_ nan_to_num_ neg_ negative_ rad2deg_ reciprocal_ remainder_ round_ rsqrt_
sgn_ sign_ sin_ sinh_ sqrt_ subtract_ tan_ true_divide_ trunc_ xlogy_
""".split()  # noqa: SIM905  (the in-place forms after the first line's: the same rule, the target's values an operand)
POINTWISE = _fns(*_POINTWISE_NAMES)
#: operations along one dimension (``dim``): mixing when it is the batch dimension
ALONG_DIM = _fns(
    "softmax",
    "log_softmax",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "sort",
    "argsort",
    "topk",
    "kthvalue",
    "flip",
    "roll",
    "normalize",
    "glu",
    "softmin",
    "diff",
)
#: reductions (``dim`` an int, a sequence, or all)
REDUCTIONS = _fns(
    "sum",
    "mean",
    "nansum",
    "nanmean",
    "prod",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "std",
    "var",
    "var_mean",
    "std_mean",
    "norm",
    "logsumexp",
    "all",
    "any",
    "count_nonzero",
    "median",
    "nanmedian",
    "aminmax",
)
RESHAPES = _fns("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze")
EXPANDS = _fns("expand", "expand_as", "broadcast_to")
PERMUTES = _fns("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t")
SPLITS = _fns("split", "chunk", "unbind", "tensor_split", "narrow", "select", "index_select", "split_with_sizes")
JOINS = _fns("cat", "concat", "concatenate", "stack")
MATMULS = _fns("matmul", "__matmul__", "__rmatmul__", "bmm", "mm")
GETITEM = {_T.__getitem__}
#: the operations of covered layers' base forwards (the weight's position), routed for their subclasses
ROUTABLE = {F.linear: 1, F.embedding: 1, F.layer_norm: 2}
#: tensors of a tagged tensor's shape but not of its values: not derived from the batch's data
LIKE = _fns("new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "empty_like", "full_like")
#: factories whose result has the same values in every row (a fill value) or none yet (``empty``): a constant
#: made by one and written only with batch rows has rows that do not differ, without reading them
_UNIFORM_FACTORIES = _fns("zeros", "ones", "full", "empty") | (LIKE - _fns("new_tensor"))
#: a copy of its ``data`` argument (values, not only the shape): the rows of ``data``
NEW_TENSOR = _fns("new_tensor")
#: operations whose second tensor argument gives the result its dtype and device only (``type_as(other)``,
#: ``to(other)``): the result's values, and rows, are the first argument's
DTYPE_OF_OTHER = {_T.type_as, _T.to}


def dtype_donor(args, kwargs):
    """The tensor whose dtype and device ``type_as(other)`` / ``to(other)`` (or ``to(tensor=...)``) take, if any."""
    return args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("tensor"))


#: a CUDA tensor's address for cupy, numba (``torch.as_tensor`` of their array: a new tensor on the same memory)
_CUDA_ARRAY_INTERFACE = torch.Tensor.__dict__["__cuda_array_interface__"].__get__
#: reads of a tensor's values into Python (host values that no tag follows), by what they read: one value
#: (a 0-dim or one-element tensor), the rows as they are (a list, an array, a string), or one answer about every
#: row; each refused when the rows are mixed or more than one example's (:meth:`ProvenanceMode._host_read`)
HOST_SCALAR = _fns("item", "__bool__", "__int__", "__float__", "__complex__", "__index__", "is_nonzero")
HOST_ROWS = _fns(
    "tolist",
    "numpy",
    "__array__",
    "__format__",
    "__repr__",  # str(t), print, logging: torch formats the values with the modes off
    "untyped_storage",  # the bytes (storage.tolist(), bytes(storage), torch.frombuffer, set_)
    "storage",
    "_typed_storage",
    "__dlpack__",  # numpy.from_dlpack, torch.from_dlpack: a new tensor on the same memory, untagged
    "__reduce_ex__",  # pickle, torch.save, copy.copy: the values back as a new tensor, untagged
) | {_CUDA_ARRAY_INTERFACE}
#: the reads that give Python an alias of the tensor's memory (an array, a capsule, a storage): a tensor made on
#: it later (``torch.from_numpy``, ``from_dlpack``, ``set_``) reads the same values, so the memory is recorded
#: with the tensor's rows (:class:`~.memory.WrittenMemory`)
MEMORY_EXPORTS = _fns("numpy", "__array__", "__dlpack__", "untyped_storage", "storage", "_typed_storage") | {
    _CUDA_ARRAY_INTERFACE
}
HOST_WHOLE = _fns("equal", "allclose", "__contains__")
HOST_READS = HOST_SCALAR | HOST_ROWS | HOST_WHOLE
#: operations whose result's *size* is a value of their input (the count of nonzero entries, of distinct
#: values, of repeats): the size is read to the host (a Python int in ``.shape``), so one of a tensor of
#: more than one example's rows (``torch.nonzero(x.mean(0) > 0).shape[0]``, ``x[:, x.mean(0) > 0]``,
#: ``len(x[x > 0])``) is refused as a host read of the whole batch; ``where`` with the condition only
SIZED_BY_VALUES = _fns(
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave"
) | {torch.where, _T.to_sparse, torch._unique2, torch.unique_consecutive}
#: (module, function) of the host reads of mixed rows that are allowed: transformers' attention-mask fast
#: paths, which only choose whether to materialise a mask (``padding_mask.all()``: an explicit mask or
#: ``is_causal``/none, the same attention up to rounding) and whose two sides the batch-independence check
#: takes (its perturbed example's mask is 0, the others' 1), and a padding warning that only logs.  Every
#: other read of mixed rows is refused (docs/guarantees.md, "Values read into Python").
HOST_READ_SITES = frozenset(
    {
        ("transformers.masking_utils", "_ignore_causal_mask_sdpa"),
        ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa"),
        ("transformers.masking_utils", "flash_attention_mask"),
        ("transformers.masking_utils", "flex_attention_mask"),
        ("transformers.masking_utils", "find_packed_sequence_indices"),
        # an all-ones 2D mask returns None: the recurrent layers' masking multiply by ones skipped (LFM2, Mamba)
        ("transformers.masking_utils", "create_recurrent_attention_mask"),
        ("transformers.modeling_utils", "warn_if_padding_and_no_attention_mask"),
    }
)


def _reading_frame():
    """The frame of the code that made the host read in progress: the first caller outside torch and this package."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "torch" or module.startswith(("torch.", "idpsgd.engine.per_example.bk"))):
            return frame
        frame = frame.f_back
    return None


def _at_allowed_site() -> bool:
    """Whether the host read in progress is one of :data:`HOST_READ_SITES` called by transformers itself: the
    same function called by the model's own code (``_ignore_causal_mask_sdpa(x.mean(0) > 0, ...)`` in a
    branch) returns a Python value of a batch statistic of the model's choosing (3.37 × c, measured), not
    the choice of a mask."""
    frame = _reading_frame()
    if frame is None or (frame.f_globals.get("__name__", ""), frame.f_code.co_name) not in HOST_READ_SITES:
        return False
    caller = frame.f_back
    return caller is not None and caller.f_globals.get("__name__", "").startswith("transformers.")


SETITEM = {_T.__setitem__}
#: operations taking sizes (a shape, a length, a count): a tensor of the batch there is read as a Python int in
#: C++ (``torch.ones(mask.sum())``, ``x.narrow(1, 0, n)``), which no ``__index__`` shows: refused as a host read
_FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "logspace", "eye")
SIZE_TAKING = _fns(
    *_FACTORIES,
    *("narrow", "repeat", "tile", "expand", "view", "reshape", "new_ones", "new_zeros", "new_empty", "new_full"),
    *("topk", "kthvalue", "split", "tensor_split", "unflatten", "unfold", "multinomial", "diagonal", "diag"),
) | {F.pad}
_REPEAT_INTERLEAVE = _fns("repeat_interleave")
_TAKE_ALONG_DIM = _fns("take_along_dim")
PROPS = {_T.T.__get__, _T.mT.__get__}  # type: ignore[attr-defined]


def _out_tensors(kwargs) -> tuple:
    """The tensors an operation writes by ``out=`` (one, or a tuple: ``torch.max(x, 1, out=(v, i))``)."""
    o = kwargs.get("out")
    if o is None:
        return ()
    return tuple(t for t in (o if isinstance(o, (tuple, list)) else (o,)) if torch.is_tensor(t))


def _dims(d, nd):
    if d is None:
        return None
    if isinstance(d, (list, tuple)):
        return tuple(int(x) % nd for x in d) if nd else ()
    return (int(d) % nd,) if nd else ()


def _arg(args, kwargs, pos, name, default=None):
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _reshape_rows(shape_in, rows: Rows, shape_out) -> Rows | None:
    """Rows after a reshape from ``shape_in`` to ``shape_out`` (None: not one example per row)."""
    b = rows.dim
    before = math.prod(shape_in[:b])
    per_row = math.prod(shape_in[b + 1 :])
    block = rows.group * per_row  # numbers of one example, contiguous (given the dims before)
    k, acc = 0, 1
    while k < len(shape_out) and acc < before:
        acc *= shape_out[k]
        k += 1
    if acc != before:
        return None
    # the batch starts at dimension k, or after size-1 dimensions in front of it ((B, T, d).unsqueeze(0))
    while k < len(shape_out):
        rest = math.prod(shape_out[k + 1 :])
        if rest and block % rest == 0:
            return Rows(k, block // rest)
        if shape_out[k] != 1:
            return None
        k += 1
    return None


def _permute_rows(func, args, kwargs, nd, rows) -> Rows | None:
    name = op_name(func)
    d = rows.dim
    if name == "t":
        return rows.moved(nd - 1 - d) if nd == 2 else rows
    if name in ("transpose", "swapaxes", "swapdims"):
        a = int(_arg(args, kwargs, 1, "dim0")) % nd
        c = int(_arg(args, kwargs, 2, "dim1")) % nd
        return rows.moved(c if d == a else a if d == c else d)
    if name == "permute":
        dims = (
            args[1:]
            if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int))
            else _arg(args, kwargs, 1, "dims")
        )
        dims = [int(x) % nd for x in dims]
        return rows.moved(dims.index(d))
    if name in ("movedim", "moveaxis"):
        src = _dims(_arg(args, kwargs, 1, "source"), nd)
        dst = _dims(_arg(args, kwargs, 2, "destination"), nd)
        order = [i for i in range(nd) if i not in src]
        perm = [None] * nd
        for s, t in zip(src, dst, strict=True):
            perm[t] = s
        it = iter(order)
        perm = [p if p is not None else next(it) for p in perm]
        return rows.moved(perm.index(d))
    return None


class Tags:
    """Rows by tensor identity for one forward: ``id(t)`` → (a weak reference to ``t``, its rows); a reused
    id of a freed tensor is told apart by the reference (faster than a weak-keyed dictionary's lookups).
    With ``memory``, also the memory written with batch values (:class:`~.memory.WrittenMemory`): a tensor
    without a tag of its own that reads such memory (an alias made outside the rules) is of the batch, and
    every tensor reading memory a write left with rows of no single example has such rows."""

    __slots__ = ("_d", "memory", "storages")

    def __init__(self, memory: bool = True):
        self._d = {}
        self.memory = WrittenMemory(_mixed(_ALIAS)) if memory else None
        self.storages = TaggedMemory(_mixed(_UNSEEN)) if memory else None

    def get(self, t, default=None):
        memory = self.memory
        if memory is not None and memory.spoilt:
            spoilt = memory.spoilt_rows(t)
            if spoilt is not None:
                return spoilt
        e = self._d.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        if memory is not None:
            r = memory.rows(t)
            if r is None:
                r = self.storages.rows(t)
            if r is not None:
                return r
        return default

    def wrote(self, t, before) -> None:
        """``t`` was just written (in place, ``out=``, ``t[i] = v``), its rows ``before`` the write: recorded in
        :attr:`memory` when it now holds batch values with other rows, or with rows of no single example."""
        if self.memory is None:
            return
        after = self.get(t)
        if after is not None and (not after.known or before is None or before.key != after.key):
            self.memory.holds(t, after)

    def forget(self, t) -> None:
        """``t`` no longer holds what its tag says (``t.data = v`` of a value not from the batch)."""
        e = self._d.get(id(t))
        if e is not None and e[0]() is t:
            del self._d[id(t)]

    def __setitem__(self, t, rows):
        self._d[id(t)] = (weakref.ref(t), rows)
        if self.storages is not None:
            self.storages.holds(t, rows)

    def batch(self, t, rows) -> None:
        """``t`` is a tensor of the loader's batch: tagged, and its memory recorded even where it is a view."""
        self._d[id(t)] = (weakref.ref(t), rows)
        if self.storages is not None:
            self.storages.holds(t, rows, views=True)


_ALIAS = (
    "a tensor reading memory written with batch values in another layout (an alias made outside the rules: "
    ".detach() or .data of a tensor written later, a view made before the write, numpy or dlpack)"
)
_UNSEEN = (
    "a tensor sharing memory with a tensor of the batch in another layout (an alias made by a call the rules do "
    "not see: Tensor.set_, Tensor._make_subclass as nn.Parameter(t) calls it, as_subclass)"
)
#: ``t.data = v``: ``t`` then reads ``v``'s memory (the mode sees the descriptor's ``__set__``)
_DATA_SETTER = torch._C.TensorBase.__dict__["data"]


class ProvenanceMode(TorchFunctionMode):
    """Tags every tensor of the forward computed from the batch with its :class:`Rows` (module docstring).
    ``paused`` > 0 inside book-kept layers' own kernels (:meth:`pause`: their outputs are tagged by the layer)."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch
        self.tags = Tags()
        self.constants = Tags(memory=False)  # batch-independent operands checked for rows that differ
        self.paused = 0
        self.routes: dict = {}  # id(weight) -> (operation, weight position, book-kept forward)
        self.sources: dict = {}  # id(parameter) -> parameter (covered layers')
        self.make_source = None
        self._before = None  # an in-place operation's target before the write (:meth:`_positional`)
        self._uniform: dict = {}  # storage key -> its storage, weakly: made uniform by a factory, not written since

    def tag(self, t, rows: Rows | None) -> None:
        if rows is not None and torch.is_tensor(t):
            self.tags.batch(t, rows)

    def use_routes(self, routes: dict, sources: dict, make_source) -> None:
        """The book-keeper's interception for this forward (:meth:`.keeper.BookKeeper._enter`): ``routes``
        (id(weight) -> (operation, weight position, book-kept forward)) sends a covered layer's operation met
        outside its module to the layer's rule; ``sources`` (id(parameter) -> parameter) names the covered
        parameters that ``make_source(p, batch)`` replaces, used directly, by a value shared by the batch."""
        self.routes, self.sources, self.make_source = routes, sources, make_source

    def pause(self) -> None:
        """Tag nothing until :meth:`resume` (a book-kept layer's own kernels, a fallback's forward: the caller
        tags their outputs); nests.  Callers pair the two in ``try``/``finally`` (a generator context manager
        would cost several times the pair on every book-kept layer's forward)."""
        self.paused += 1

    def resume(self) -> None:
        """Undo one :meth:`pause`."""
        self.paused -= 1

    def __enter__(self):
        _STACK.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if _STACK and _STACK[-1] is self:
            _STACK.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if self.routes and func in ROUTABLE:
            w = _arg(args, kwargs, ROUTABLE[func], "weight")
            route = self.routes.get(id(w)) if isinstance(w, torch.nn.Parameter) else None
            if route is not None and route[0] is func and route[3] is w:  # the weight itself (held by the route)
                return route[2].apply(self, args[0])  # a covered layer's subclass: its rule, at its operation
        if self.sources:
            sources = self.sources
            for a in args if not kwargs else (*args, *kwargs.values()):
                if isinstance(a, _Parameter) and id(a) in sources:
                    if torch.is_grad_enabled() and not _inplace(func):
                        args, kwargs = self._substitute(args, kwargs)
                    break
        self._before = None
        tags = self.tags
        # a write: the target's rows before it (the memory written is recorded after it, :meth:`Tags.wrote`)
        target = args[0] if args and torch.is_tensor(args[0]) and (_inplace(func) or func in SETITEM) else None
        before = tags.get(target) if target is not None else None
        outs = _out_tensors(kwargs) if kwargs else ()
        if args and isinstance(args[0], (list, tuple)) and _inplace(func):  # _foreach_copy_([a, b], ...): each one
            outs = (*outs, *(t for t in args[0] if torch.is_tensor(t)))
        befores = [tags.get(o) for o in outs] if outs else ()  # (most operations write nothing: no list)
        # an in-place operation on a tensor not from the batch: its values before the write are an operand
        # (``buf.add_(h)``), compared row by row in :meth:`_positional`; ``copy_`` overwrites them
        if (
            target is not None
            and before is None
            and func not in SETITEM
            and op_name(func) != "copy_"
            and self._inputs(args[1:], kwargs)
        ):
            with torch.no_grad():
                self._before = target.detach().clone()
        out = func(*args, **kwargs)
        try:
            return self._tag_result(func, args, kwargs, out)
        finally:
            if target is not None:
                tags.wrote(target, before)
            for o, b in zip(outs, befores, strict=True):
                tags.wrote(o, b)
            if self._uniform:
                for t in (target, *outs) if target is not None else outs:
                    self._uniform.pop(storage_key(t), None)

    def _tag_result(self, func, args, kwargs, out):
        """Tags ``out = func(*args, **kwargs)`` (the operation has run) and applies the checks of its family."""
        if func is _T.copy_ and len(args) > 1:
            self._copy_into_constant(args[0], args[1])
        if func in SIZED_BY_VALUES or func in GETITEM:
            self._sized_by_values(func, args, kwargs)
        if func in SIZE_TAKING:
            self._size_arguments(func, args, kwargs)
        if func in SETITEM:
            self._setitem(args)
            return out
        if func in DTYPE_OF_OTHER and torch.is_tensor(dtype_donor(args, kwargs)):
            args, kwargs = args[:1], {}  # ``buffer.type_as(h)``, ``buffer.to(h)``: ``h`` gives a dtype and a device
        if (
            func in LIKE
            or func in NEW_TENSOR
            or not (torch.is_tensor(out) or (isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0])))
        ):
            if getattr(func, "__self__", None) is _DATA_SETTER and len(args) > 1:
                self._data_set(args[0], args[1])
                self._uniform.pop(storage_key(args[0]), None)
            elif func in HOST_READS:
                self._host_read(func, args, kwargs)
                if func in MEMORY_EXPORTS and args and torch.is_tensor(args[0]):  # written through the export, maybe
                    self._uniform.pop(storage_key(args[0]), None)
            elif func in LIKE or func in NEW_TENSOR:
                self._like(func, args, kwargs, out)
                if func in _UNIFORM_FACTORIES:
                    self._made_uniform(out)
            return out
        if func in _UNIFORM_FACTORIES:
            self._made_uniform(out)
        tags = self.tags
        found = None
        for a in args:
            if torch.is_tensor(a):
                r = tags.get(a)
                if r is not None:
                    found = True
                    break
            elif (
                isinstance(a, (list, tuple))
                and a
                and (torch.is_tensor(a[0]) or func in GETITEM)  # an index (0, ids): ids of the batch
                and any(tags.get(x) is not None for x in a if torch.is_tensor(x))
            ):
                found = True
                break
        if found is None and kwargs:
            for v in kwargs.values():
                if (torch.is_tensor(v) and tags.get(v) is not None) or (
                    isinstance(v, (list, tuple)) and any(torch.is_tensor(x) and tags.get(x) is not None for x in v)
                ):  # cat(tensors=[...])
                    found = True
                    break
        if found is None:
            return out
        rows = self._propagate(func, args, kwargs, out)
        if rows is SHARED:
            return out
        if not rows.known and torch.is_grad_enabled():
            self._check_parameters(func, args, kwargs, rows)
        for o in (out,) if torch.is_tensor(out) else out:
            if torch.is_tensor(o):
                tags[o] = rows
                if o._base is not None and tags.storages is not None:
                    self._hold_made_view(o, rows, args, kwargs)
            elif isinstance(o, (list, tuple)):  # histogramdd's (hist, [edges, ...]): the edges' range too
                for t in o:
                    if torch.is_tensor(t):
                        tags[t] = rows
        return out

    def _hold_made_view(self, view, rows, args, kwargs) -> None:
        """``view``, a result of the batch that is a view, is kept by storage (:class:`~.memory.TaggedMemory`) when
        its base is no operand's: a base the operation made and returned only a view of (``einsum``,
        ``tensordot``, ``max_pool1d``, ``bilinear``, a batch-first LSTM), which no other record covers; a view of
        an operand reads that operand's memory, recorded with it (or a constant's, whose values are of no
        example)."""
        base = view._base
        for a in (*args, *kwargs.values()) if kwargs else args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if torch.is_tensor(t) and (t is base or t._base is base):
                    return
        self.tags.storages.holds(view, rows, views=True)

    def result_rows(self, func, args, kwargs, out) -> Rows:
        """The rows of ``out = func(*args, **kwargs)`` by the rules (at least one argument of the batch)."""
        return self._propagate(func, args, kwargs, out)

    def _host_read(self, func, args, kwargs) -> None:
        """A read of tensor values into Python (``.item()``, ``.tolist()``, ``bool(t)``, ``if t:``, ...): the
        value leaves the tags, so one that mixes examples' rows (``bool(mask.all())``, ``x.mean().item()``)
        could steer every example's computation (a branch, a scale, a length) unseen; refused.  So is a read of
        several examples' rows, each one example's (``x.norm(dim=1).tolist()``): Python can combine them
        (``sum``, ``max``: 3.37 and 1.99 × c before), and no tag follows a Python value.  A read of an untagged
        value (public shapes, constants) is allowed."""
        for t, r in self._inputs(args, kwargs):
            several = r.known and t.dim() > r.dim and t.shape[r.dim] > r.group
            if (not r.known or several) and not _at_allowed_site():
                raise host_read_refusal(op_name(func), r, several=r.known)
            if func in MEMORY_EXPORTS and self.tags.memory is not None:
                self.tags.memory.holds(t, r)

    def _sized_by_values(self, func, args, kwargs) -> None:
        """An operation whose result's size is a value of its input (:data:`SIZED_BY_VALUES`; ``x[mask]`` with a
        boolean mask of the batch): a host read of the whole input, refused where that input holds more than
        one example's rows (:meth:`_host_read`)."""
        if func in GETITEM:
            index = args[1] if len(args) > 1 else None
            masks = [i for i in (index if isinstance(index, (tuple, list)) else (index,)) if torch.is_tensor(i)]
            sizing = [i for i in masks if i.dtype in (torch.bool, torch.uint8)]
        elif func is torch.where:
            sizing = list(args[:1]) if len(args) + len(kwargs) == 1 else []
        elif func in _REPEAT_INTERLEAVE:
            repeats = _arg(args, kwargs, 1, "repeats")
            one_argument = len(args) == 1 and not kwargs  # repeat_interleave(repeats)
            sizing = [repeats] if torch.is_tensor(repeats) else [args[0]] if one_argument else []
        elif op_name(func) == "masked_select":
            sizing = [_arg(args, kwargs, 1, "mask")]
        else:
            sizing = [_arg(args, kwargs, 0, "input")]
        for t in sizing:
            r = self.tags.get(t) if torch.is_tensor(t) else None
            if r is None:
                continue
            if (not r.known or t.shape[r.dim] > r.group) and not _at_allowed_site():  # > 1 example's
                raise host_read_refusal(f"the size of {op_name(func)}", r if not r.known else _mixed(op_name(func)))

    def _size_arguments(self, func, args, kwargs) -> None:
        """A one-element tensor of mixed rows given to :data:`SIZE_TAKING` as a size (not its data: the first
        argument of a method, a fill value): a Python int of the whole batch, refused (4.79 × c before, with
        ``len(torch.ones((x.mean(0) > 0).sum()))``)."""
        name = op_name(func)
        rest = list(args if name in _FACTORIES and func is getattr(torch, name, None) else args[1:])
        rest += [v for k, v in kwargs.items() if k not in ("fill_value", "out")]
        if name in ("full", "new_full"):
            rest = rest[:1]  # the size, not the fill value
        for a in rest:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                r = self.tags.get(t) if torch.is_tensor(t) else None
                if r is not None and not r.known and t.numel() == 1 and not _at_allowed_site():
                    raise host_read_refusal(f"a size of {name}", r)

    def _like(self, func, args, kwargs, out) -> None:
        """``new_tensor(data)`` copies ``data``: its rows; the ``*_like``/``new_*`` constructors take the
        template's shape only (untagged), unless a value of the batch is passed too (a tensor fill value)."""
        if func in NEW_TENSOR:
            data = _arg(args, kwargs, 1, "data")
            r = self.tags.get(data) if torch.is_tensor(data) else None
            if r is None and isinstance(data, (list, tuple)) and self._inputs(data, {}):
                r = _mixed("new_tensor of a list of tensors of the batch")
        else:
            r = _mixed(op_name(func)) if self._inputs(args[1:], kwargs) else None
        if r is not None and torch.is_tensor(out):
            if not r.known and torch.is_grad_enabled():
                self._check_parameters(func, args, kwargs, r)
            self.tags[out] = r

    def _made_uniform(self, out) -> None:
        """``out``, untagged, was made by :data:`_UNIFORM_FACTORIES`: every row the same (or uninitialised), until
        written (the key leaves at any write the mode sees to its storage, or an export of it)."""
        if torch.is_tensor(out) and self.tags.get(out) is None:
            key = storage_key(out)
            if key is not None:
                self._uniform[key] = weakref.ref(out.untyped_storage())

    def _uniform_rows(self, t) -> bool:
        """Whether ``t``'s storage was made uniform by a factory in this forward and not written since: its rows
        are the same without reading them (a values comparison would keep the plan from being replayed)."""
        ref = self._uniform.get(storage_key(t)) if self._uniform else None
        return ref is not None and ref() is t.untyped_storage()

    def _unwritten_rows_differ(self, target, write, d, group) -> bool:
        """Whether ``target``'s values other than those ``write(clone)`` overwrites differ along ``d`` (by
        ``group``-row blocks): batch rows written into part of a constant whose other rows differ would give each
        example the constant's row of its place in the batch (a fuzzer's).  A target a factory made uniform in this
        forward (BART's and T5's ``new_zeros``) is not read."""
        if self._uniform_rows(target):
            return False
        unwritten = target.detach().clone()
        write(unwritten)
        return self._rows_differ(unwritten, d, group)

    def _copy_into_constant(self, view, value) -> None:
        """``view.copy_(value)``: batch rows copied into a view of a tensor of no example (a ``new_empty`` being
        filled: ``key[..., :d].copy_(k_nope); key[..., d:].copy_(k_rot)``, Youtu's attention) give the base the
        rows too, as ``base[index] = value`` does (:meth:`_setitem`): row r of the base then holds example r's
        values and constants.  Only where the view spans the base's whole batch dimension, row r at row r (same
        size and stride there, a contiguous base, the view's offset at index 0 of that dimension)."""
        if not (torch.is_tensor(view) and torch.is_tensor(value)) or view._base is None:
            return
        base = view._base
        vr = self.tags.get(value)
        if vr is None or not vr.known or self.tags.get(view) is not None or self.tags.get(base) is not None:
            return
        k = vr.dim + view.dim() - value.dim()
        if not (0 <= k < view.dim() and view.dim() == base.dim() and base.is_contiguous()):
            return
        if value.shape[vr.dim] != view.shape[k] or view.shape[k] != base.shape[k] or view.stride(k) != base.stride(k):
            return
        offset = view.storage_offset() - base.storage_offset()
        if (offset // base.stride(k)) % base.shape[k] != 0:
            return
        if self._unwritten_rows_differ(
            base, lambda u: u.as_strided(view.shape, view.stride(), offset).zero_(), k, vr.group
        ):
            self.tags[base] = _mixed("copy_ of batch rows into a constant whose other rows differ along the batch")
            return
        self.tags[base] = Rows(k, vr.group)
        self.tags.wrote(base, None)  # an alias of the base made outside the rules reads it with these rows

    def _data_set(self, t, value) -> None:
        """``t.data = value``: ``t`` now reads ``value``'s memory, with its rows (or none)."""
        if not torch.is_tensor(value):
            return
        r = self.tags.get(value)
        if r is not None:
            self.tags[t] = r
        else:
            self.tags.forget(t)

    def _substitute(self, args, kwargs):
        """A covered layer's parameter used directly by an operation of the forward (outside its layer's
        own operation) becomes a value shared by the batch, whose per-example gradients go to the layer
        (:meth:`.keeper.BookKeeper.parameter_source`)."""
        sources = self.sources
        if any(isinstance(a, torch.nn.Parameter) and id(a) in sources for a in args):
            args = tuple(
                self.make_source(a, self.batch) if isinstance(a, torch.nn.Parameter) and id(a) in sources else a
                for a in args
            )
        if kwargs and any(isinstance(a, torch.nn.Parameter) and id(a) in sources for a in kwargs.values()):
            kwargs = {
                k: self.make_source(a, self.batch) if isinstance(a, torch.nn.Parameter) and id(a) in sources else a
                for k, a in kwargs.items()
            }
        return args, kwargs

    def _check_parameters(self, func, args, kwargs, rows):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.nn.Parameter) and a.requires_grad:
                raise refusal(f"a trainable parameter (shape {tuple(a.shape)}) in {op_name(func)!r}", rows)

    def _setitem(self, args):
        target, index, value = args[0], args[1], args[2] if len(args) > 2 else None
        tr = self.tags.get(target) if torch.is_tensor(target) else None
        vr = self.tags.get(value) if torch.is_tensor(value) else None
        ir = any(
            torch.is_tensor(i) and self.tags.get(i) is not None
            for i in (index if isinstance(index, tuple) else (index,))
        )
        if vr is None and not ir:
            if tr is None or not tr.known:
                return  # constants written into a constant (or into rows already mixed)
            # constants written into a tensor of the batch: its rows are unchanged if every row gets the same
            # (``h[:, 0] = 0``); not when only some batch rows are written (``h[0] = c``: whoever lands first)
            # or the constant's rows differ along the batch (``h[:, 0] = bank[:, 0]``): by place in the batch
            probe = self._index_rows(target, index, tr)
            if probe is not None:
                if not torch.is_tensor(value):
                    return
                d = probe.dim - (probe_rank(target, index) - value.dim())
                size = target.shape[tr.dim]
                if not (
                    0 <= d < value.dim()
                    and value.shape[d] == size
                    and size > 1
                    and value.stride(d) != 0
                    and self._rows_differ(value, d, probe.group)
                ):
                    return
            self.tags[target] = _mixed("__setitem__ of a batch-independent value into some batch rows only")
            return
        if not ir and vr is not None and vr.known and (tr is None or tr.known):
            # batch rows written into the same rows: into a tensor of the batch, or into a constant (BART's
            # shift_tokens_right: new_zeros(ids.shape)[:, 1:] = ids[:, :-1]), whose other rows stay constant
            rank = probe_rank(target, index)
            for d in [tr.dim] if tr is not None else range(target.dim()):
                group = vr.group if tr is None else tr.group
                probe = self._index_rows(target, index, Rows(d, group))
                if probe is None or rank - probe.dim != value.dim() - vr.dim or vr.group != probe.group:
                    continue
                if tr is None and target.shape[d] != value.shape[vr.dim]:
                    continue
                if tr is None:
                    if self._unwritten_rows_differ(target, lambda u: u.__setitem__(index, 0), d, group):
                        break  # the constant's other rows differ: each example would get its place's
                    self.tags[target] = Rows(d, group)
                return
        if vr is None and tr is not None and self._masked_constant(target, index, value, tr):
            return  # h[~mask] = 0: each example's rows written where its own mask says, with one value
        self.tags[target] = _mixed("__setitem__")

    def _masked_constant(self, target, index, value, tr) -> bool:
        """``target[mask] = value`` leaves ``target``'s rows each one example's: ``mask`` a boolean tensor of the
        batch with ``target``'s rows over ``target``'s leading dimensions (each example's elements chosen by its
        own mask rows), ``value`` one value for every chosen element (a number, or a batch-independent tensor
        that broadcasts over the trailing dimensions only).  A padded batch's ``h[~attention_mask.bool()] = 0``."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) == 2 and idx[1] is Ellipsis:
            idx = idx[:1]
        mask = idx[0] if len(idx) == 1 else None
        if not (torch.is_tensor(mask) and mask.dtype == torch.bool and tr.known):
            return False
        mr = self.tags.get(mask)
        k = mask.dim()
        if mr is None or not mr.known or (mr.dim, mr.group) != (tr.dim, tr.group) or tr.dim >= k:
            return False
        if tuple(mask.shape) != tuple(target.shape[:k]):
            return False
        return not torch.is_tensor(value) or value.dim() <= target.dim() - k

    # --- the rules ---------------------------------------------------------------------------
    def _inputs(self, args, kwargs):
        out = []
        for a in (*args, *kwargs.values()):
            if torch.is_tensor(a):
                r = self.tags.get(a)
                if r is not None:
                    out.append((a, r))
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if torch.is_tensor(x):
                        r = self.tags.get(x)
                        if r is not None:
                            out.append((x, r))
        return out

    def _propagate(self, func, args, kwargs, out) -> Rows:
        tagged = self._inputs(args, kwargs)
        name = op_name(func)
        for _, r in tagged:
            if not r.known:
                return r
        first = tagged[0][1]
        res = out if torch.is_tensor(out) else out[0]
        try:
            got = self._rule(func, name, args, kwargs, tagged, res)
            if got is not None and got.known and self._positional(func, name, args, kwargs, tagged, res, got):
                return _mixed(f"{name} with a batch-independent operand whose rows differ along the batch dimension")
        except (TypeError, ValueError, IndexError, AttributeError):
            got = None
        return got if got is not None else _mixed(name) if first.known else first

    def _positional(self, func, name, args, kwargs, tagged, res, got) -> bool:
        """Whether a tensor not derived from the batch meets the batch rows row by row with rows that differ
        (``x * bank`` with a constant (B, d) bank): example i would get row i's constant, so its gradient
        depends on its place in the batch, which the other examples decide (one example more or less shifts
        every later one); the sensitivity is then not one example's clipped gradient.  A constant the same
        for every row (size 1 or stride 0 there, or equal rows: rotary cos/sin tables made per row) is
        fine; for rows grouped by example (B·T rows) the B blocks must be equal."""
        if func in POINTWISE or name in _ALIGNED_OPERANDS:
            kind = "aligned"
        elif name == "scaled_dot_product_attention":  # a constant attn_mask of B rows that differ
            if got.dim >= res.dim() - 2:
                return False
            kind = "aligned"
        elif func in JOINS:
            kind = "join"
        elif func in MATMULS or name == "baddbmm":
            if got.dim >= res.dim() - 2:
                return False
            kind = "aligned"
        else:
            return False
        tagged_ids = {id(t) for t, _ in tagged}
        listed = args and isinstance(args[0], (list, tuple))  # cat([a, b]), broadcast_tensors([a, b]) (_VF, aten)
        operands = list(args[0]) if listed and (kind == "join" or name == "broadcast_tensors") else list(args)
        if _inplace(func) and operands and operands[0] is args[0]:  # its values before the write (or none)
            operands[0] = self._before
        if name == "addmm":  # the added input (B, out) only: mat1's rows are the batch's, mat2 is contracted
            operands = operands[:1]
        operands += [v for k, v in kwargs.items() if torch.is_tensor(v) and k != "out"]  # (out=: written, not read)
        n = res.dim()
        size = res.shape[got.dim]
        for t in operands:
            if not torch.is_tensor(t) or id(t) in tagged_ids or self.tags.get(t) is not None:
                continue
            if kind == "join" and name == "stack":
                d = got.dim - (got.dim > _arg(args, kwargs, 1, "dim", 0) % n)
            elif kind == "join":
                d = got.dim
            else:
                d = got.dim - (n - t.dim())
            if d < 0 or d >= t.dim() or t.shape[d] != size or size <= 1 or t.stride(d) == 0:
                continue
            if self._rows_differ(t, d, got.group):
                return True
        return False

    def _rows_differ(self, t, d, group) -> bool:
        key = (d, group)
        seen = self.constants.get(t)
        if seen is not None and key in seen:
            return seen[key]
        with torch.no_grad():
            blocks = t.unflatten(d, (-1, group))
            differ = not bool((blocks == blocks.narrow(d, 0, 1)).all())
        if seen is None:
            seen = {}
            self.constants[t] = seen
        seen[key] = differ
        return differ

    def _aligned(self, tagged, nd_out, res) -> Rows | None:
        dim = group = None
        for t, r in tagged:
            d = r.dim + nd_out - t.dim()
            if dim is not None and (d != dim or r.group != group):
                return None
            if t.shape[r.dim] != res.shape[d]:
                return None  # batch rows broadcast against each other
            dim, group = d, r.group
        return Rows(dim, group)

    def _rule(self, func, name, args, kwargs, tagged, res):
        """The rows of ``func``'s result: its family's handler (:data:`_FAMILY_RULES`), else the handler of its
        name (:data:`_NAMED_RULES`); None (not row by row) for an operation with neither."""
        handler = _FAMILY_RULES.get(func) or _NAMED_RULES.get(name)
        if handler is None:
            return None
        return handler(self, func, name, args, kwargs, tagged, res)

    def _scatter_into_constant(self, func, args, kwargs, x, r, res):
        """``t.scatter_(dim, index, src)`` into a tensor ``t`` not from the batch (Glm4-MoE's router:
        ``zeros_like(scores).scatter_(1, group_idx, 1)``; ``index_copy``/``index_copy_``/``index_add_`` alike, a
        preallocated cache filled at public positions) along another dimension than the batch's: row by row
        when ``t`` is the same in every row (its values before the write) and the batch's operands align."""
        target = args[0]
        dim = _arg(args, kwargs, 1, "dim")
        if not (torch.is_tensor(target) and isinstance(dim, int)) or target.dim() != x.dim() or dim % x.dim() == r.dim:
            return None
        before = self._before if self._before is not None else target
        size = target.shape[r.dim]
        if size != x.shape[r.dim]:
            return None
        if size > 1 and before.stride(r.dim) != 0 and self._rows_differ(before, r.dim, r.group):
            return None
        return self._aligned(self._inputs(args[1:], kwargs), res.dim(), res)

    def _diff(self, args, kwargs, res):
        """``diff(input, n=1, dim=-1, prepend=None, append=None)``: differences along ``dim`` of ``input``
        with ``prepend``/``append`` joined there: row-wise when ``dim`` is not the batch dimension and every
        operand of the batch has the same rows (a constant operand's rows must not differ along it)."""
        x = args[0]
        dim = _arg(args, kwargs, 2, "dim", -1)
        if not isinstance(dim, int) or not torch.is_tensor(x):
            return None
        operands = [x, _arg(args, kwargs, 3, "prepend"), _arg(args, kwargs, 4, "append")]
        operands = [t for t in operands if torch.is_tensor(t)]
        rows = None
        for t in operands:
            tr = self.tags.get(t)
            if tr is None:
                continue
            if t.dim() != x.dim() or (rows is not None and (tr.dim, tr.group) != (rows.dim, rows.group)):
                return None
            rows = tr
        if rows is None or dim % x.dim() == rows.dim or res.dim() != x.dim():
            return None
        size = res.shape[rows.dim]
        for t in operands:
            constant = self.tags.get(t) is None and t.dim() == x.dim() and t.shape[rows.dim] == size > 1
            if constant and t.stride(rows.dim) != 0 and self._rows_differ(t, rows.dim, rows.group):
                return None
        return rows

    def _matmul(self, args, res):
        a, b = args[0], args[1]
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return None
        if a.dim() >= 2 and b.dim() == 1 and self.tags.get(b) is None:  # (..., d) @ (d,): the last dimension goes
            rr = self.tags.get(a)
            return None if rr is None or rr.dim == a.dim() - 1 else Rows(rr.dim, rr.group)
        if a.dim() == 1 and b.dim() >= 2 and self.tags.get(a) is None:  # (d,) @ (..., d, p): b's dim -2 goes
            rr = self.tags.get(b)
            if rr is None or rr.dim == b.dim() - 2:
                return None
            return Rows(rr.dim - (rr.dim == b.dim() - 1), rr.group)
        if a.dim() < 2 or b.dim() < 2:
            return None
        ra, rb, n = a.dim(), b.dim(), res.dim()
        got = set()
        for t, rank, contracted, kept, out_kept in ((a, ra, ra - 1, ra - 2, n - 2), (b, rb, rb - 2, rb - 1, n - 1)):
            rr = self.tags.get(t)
            if rr is None:
                continue
            if rr.dim == contracted:
                return None
            got.add((out_kept if rr.dim == kept else n - rank + rr.dim, rr.group))
        return Rows(*got.pop()) if len(got) == 1 else None

    def _index_rows(self, x, index, r):
        idx = index if isinstance(index, tuple) else (index,)
        nd = x.dim()
        if any(i is Ellipsis for i in idx):
            k = idx.index(Ellipsis)
            used = sum(
                1
                for i in idx
                if i is not None and i is not Ellipsis and not (torch.is_tensor(i) and i.dtype == torch.bool)
            )
            idx = idx[:k] + (slice(None),) * (nd - used) + idx[k + 1 :]
        advanced = [i for i in idx if torch.is_tensor(i) or isinstance(i, list)]
        if advanced and r.dim == 0 and r.group == 1 and self._per_row(x, idx):
            return Rows(0, 1)  # x[arange(B), j] with j one index per example: row i is example i's
        if advanced:
            if any(torch.is_tensor(i) and self.tags.get(i) is not None for i in advanced):
                return None
            if any(torch.is_tensor(i) and i.dtype == torch.bool for i in advanced):
                return None
        pos_in = pos_out = 0
        adv_seen = False
        for i in idx:
            if i is None:
                pos_out += 1
                continue
            if pos_in == r.dim:
                if isinstance(i, slice) and i == slice(None):
                    if advanced and adv_seen:
                        return None  # advanced indices before the batch dim: torch moves dims around
                    return Rows(pos_out, r.group)
                if (
                    isinstance(i, slice)
                    and (i.start in (None, 0))
                    and i.step in (None, 1)
                    and (i.stop is None or i.stop >= x.shape[r.dim])
                ):
                    return Rows(pos_out, r.group)
                return None
            if isinstance(i, int):
                pos_in += 1
            elif torch.is_tensor(i) or isinstance(i, list):
                if adv_seen:
                    return None
                adv_seen = True
                k = torch.as_tensor(i).dim() if isinstance(i, list) else i.dim()
                pos_in += 1
                pos_out += k
            else:
                pos_in += 1
                pos_out += 1
        if pos_in <= r.dim:
            if advanced and adv_seen:
                return None
            return Rows(pos_out + (r.dim - pos_in), r.group)
        return None

    def _per_row(self, x, idx) -> bool:
        """``idx`` picks, for each batch row i, elements of row i only: an untagged ``arange(B)`` on the batch
        dimension (any shape (B, 1, ..., 1); compared by value: no example's data), the other indices
        broadcast against it — of the batch (tagged, B leading rows) or one for all rows (leading size 1).
        CLIP's ``h[arange(B), eos]``, transformers' ``mask[arange(B)[:, None, None, None], kv_idx]``."""
        first = idx[0]
        n = x.shape[0]
        if not (torch.is_tensor(first) and first.dim() >= 1 and first.shape[0] == n and not first.is_floating_point()):
            return False
        if first.numel() != n or self.tags.get(first) is not None:
            return False
        if not torch.equal(first.reshape(-1), torch.arange(n, device=first.device)):
            return False
        for i in idx[1:]:
            if torch.is_tensor(i):
                ri = self.tags.get(i)
                if ri is not None and not (ri.known and ri.dim == 0 and ri.group == 1 and i.dim() <= first.dim()):
                    return False
                if ri is None and i.dim() >= first.dim() and i.shape[i.dim() - first.dim()] != 1:
                    return False
            elif not isinstance(i, (int, slice)) or (isinstance(i, slice) and i != slice(None)):
                return False
        return True

    def _gather(self, func, args, kwargs, res):
        """``gather(input, dim, index)``: out[i][j] = input[i][index[i][j]] (for dim 1): rows follow the
        batch rows of either operand, along another dimension than ``dim``; a constant operand must be
        the same for every row (size 1, stride 0 or equal rows), else the result depends on an example's place."""
        inp = args[0]
        if func in _TAKE_ALONG_DIM:  # (input, indices, dim=None): without dim, the flattened input
            index, dim = _arg(args, kwargs, 1, "indices"), _arg(args, kwargs, 2, "dim")
        else:
            index, dim = _arg(args, kwargs, 2, "index"), _arg(args, kwargs, 1, "dim")
        if not (torch.is_tensor(inp) and torch.is_tensor(index) and isinstance(dim, int)):
            return None
        rx, ri = self.tags.get(inp), self.tags.get(index)
        rows = rx or ri
        if rx is not None and ri is not None and (rx.dim != ri.dim or rx.group != ri.group):
            return None
        if rows.dim == dim % inp.dim():
            return None
        if res.shape[rows.dim] != (inp if rx is not None else index).shape[rows.dim]:
            return None  # the result has the index's shape: a constant index of one row takes one example's
        for t, r in ((inp, rx), (index, ri)):
            shared = r is None and not (t.shape[rows.dim] == 1 or t.stride(rows.dim) == 0)
            if shared and self._rows_differ(t, rows.dim, rows.group):
                return None
        return rows

    def _lookup(self, table, index, ids, res) -> Rows | None:
        """``table[..., ids]`` (or ``table.index_select(dim, ids)``) of a constant table, not from the batch, at
        indices of the batch (the only tensor index; the other entries integers or full slices): the result's
        entries along the indexed dimensions follow the indices' rows — a table looked up per example
        (fairseq's sinusoidal positions: ``weights.index_select(0, position_ids.view(-1))`` with positions
        counted from each example's own padding; ``table[0, ids]``)."""
        r = self.tags.get(ids)
        if r is None or not r.known or ids.dtype in (torch.bool, torch.uint8) or len(index) > table.dim():
            return None
        if any(not (e is ids or isinstance(e, int) or (isinstance(e, slice) and e == slice(None))) for e in index):
            return None
        if sum(1 for e in index if e is ids) != 1:
            return None
        picked = [k for k, e in enumerate(index) if not isinstance(e, slice)]  # integers and the indices
        adjacent = picked == list(range(picked[0], picked[-1] + 1))
        d = (picked[0] if adjacent else 0) + r.dim  # torch puts non-adjacent indexed dimensions first
        return Rows(d, r.group) if d < res.dim() and res.shape[d] == ids.shape[r.dim] else None

    def _einsum(self, args, res):
        """``einsum(equation, *operands)``: the batch rows follow their subscript letter into the output when
        every operand of the batch has it at its batch dimension (one letter, one grouping) and the output keeps
        it (not summed over); a constant operand with that letter must be the same for every row (size 1 or
        equal rows), else an example's result would depend on its place in the batch."""
        if not args or not isinstance(args[0], str):
            return None
        operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        subscripts = _einsum_subscripts(args[0], [t.dim() for t in operands])
        if subscripts is None:
            return None
        inputs, output = subscripts
        letter = rows = None
        for t, sub in zip(operands, inputs, strict=True):
            r = self.tags.get(t)
            if r is None:
                continue
            if letter is not None and (sub[r.dim] != letter or r.group != rows.group):
                return None
            letter, rows = sub[r.dim], r
        if letter is None or letter not in output or res.dim() != len(output):
            return None
        size = res.shape[output.index(letter)]
        for t, sub in zip(operands, inputs, strict=True):
            if self.tags.get(t) is None and letter in sub:
                d = sub.index(letter)
                if t.shape[d] == size > 1 and t.stride(d) != 0 and self._rows_differ(t, d, rows.group):
                    return None
        return Rows(output.index(letter), rows.group)


def _einsum_subscripts(equation: str, ranks) -> tuple[list[str], str] | None:
    """(each operand's subscripts, the output's) of an einsum ``equation``, one character per dimension: an
    ellipsis becomes characters of its own, aligned from the right across operands (broadcast); an implicit
    output is the ellipsis and the letters used once, sorted.  None for an equation that does not parse."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    parts = lhs.split(",")
    if len(parts) != len(ranks):
        return None
    spans = [rank - len(p.replace("...", "")) for p, rank in zip(parts, ranks, strict=True)]
    most = max([0, *spans])
    fill = [chr(0x2460 + i) for i in range(most)]  # characters no equation uses
    inputs = []
    for p, span in zip(parts, spans, strict=True):
        if "..." in p:
            p = p.replace("...", "".join(fill[most - span :]))
        elif span:
            return None
        inputs.append(p)
    if arrow:
        output = rhs.replace("...", "".join(fill))
    else:
        letters = "".join(inputs)
        output = "".join(fill) + "".join(sorted(c for c in set(letters) if c.isalpha() and letters.count(c) == 1))
    return inputs, output


#: torch.fft's transforms (``__name__`` ``fft_<name>``) → the dimensions they transform by default: the last
#: (1-d), the last two (2-d), every dimension or the last ``len(s)`` (n-d); the shifts roll every dimension
FFT = {
    **{f"fft_{k}{n}": -1 for k in ("", "i", "r", "ir", "h", "ih") for n in ("fft",)},
    **{f"fft_{k}fft2": (-2, -1) for k in ("", "i", "r", "ir", "h", "ih")},
    **{f"fft_{k}fftn": None for k in ("", "i", "r", "ir", "h", "ih")},
    "fft_fftshift": None,
    "fft_ifftshift": None,
}


def _fft_rows(name, args, kwargs, nd, rows, res) -> Rows | None:
    """A Fourier transform (or shift) along some dimensions mixes the entries along those dimensions only:
    row by row when the batch dimension is not one of them (FNet's ``fftn(x, dim=(1, 2))`` over the tokens
    and the hidden units of (B, T, d)); ``dim`` (or numpy's ``axis``) the transformed dimensions, else the
    default of :data:`FFT` (an n-d transform without ``dim`` transforms the last ``len(s)``, or all)."""
    shift = name.endswith("shift")
    dim = kwargs.get("dim", kwargs.get("axis", _arg(args, kwargs, 1 if shift else 2, "dim", FFT[name])))
    if dim is None:
        s = None if shift else _arg(args, kwargs, 1, "s")
        dims = tuple(range(nd - len(s), nd)) if s is not None else tuple(range(nd))
    else:
        dims = _dims(dim, nd)
    if rows.dim in dims or res.dim() != nd:
        return None
    return rows


# --- the rules of the families of operations (:meth:`ProvenanceMode._rule`), one handler each (as
# tied.PAIR_RULES): handler(mode, func, name, args, kwargs, tagged, res) -> the result's rows (None: not
# row by row); ``tagged`` the (tensor, rows) of the operands derived from the batch, the first one first


def _first(tagged):
    """The first operand derived from the batch, its rows and its rank."""
    x, r = tagged[0]
    return x, r, x.dim()


def _pointwise(mode, func, name, args, kwargs, tagged, res):
    return mode._aligned(tagged, res.dim(), res)


def _property(mode, func, name, args, kwargs, tagged, res):  # Tensor.T, Tensor.mT
    _, r, nd = _first(tagged)
    if name == "T":
        return r.moved(nd - 1 - r.dim)
    return r.moved(2 * nd - 3 - r.dim) if r.dim >= nd - 2 else r


def _reshape(mode, func, name, args, kwargs, tagged, res):
    x = args[0]
    r = mode.tags.get(x)
    if r is None:  # a tensor not from the batch viewed as one from it
        return SHARED
    if not r.known:
        return r
    return _reshape_rows(tuple(x.shape), r, tuple(res.shape))


def _expand(mode, func, name, args, kwargs, tagged, res):
    x = args[0]
    r = mode.tags.get(x)
    if r is None:  # a tensor not from the batch expanded as one from it
        return SHARED
    if not r.known:
        return r
    d = r.dim + res.dim() - x.dim()
    return Rows(d, r.group) if res.shape[d] == x.shape[r.dim] else None


def _permute(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    return _permute_rows(func, args, kwargs, nd, r) if args[0] is x else None


def _along_dim(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if name == "diff":
        return mode._diff(args, kwargs, res)
    if args[0] is not x or len(tagged) > 1:
        return None
    dim = _arg(
        args,
        kwargs,
        1,
        "dim",
        -1
        if name in ("softmax", "log_softmax", "sort", "argsort", "topk", "normalize", "glu", "softmin", "diff")
        else None,
    )
    if name in ("topk", "kthvalue"):  # (input, k, dim=-1, ...)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
    if name in ("flip", "roll"):
        dims = _arg(args, kwargs, 2 if name == "roll" else 1, "dims")
        if name == "flip" and len(args) > 2:  # h.flip(1, 0): the dimensions as arguments (a fuzzer's: only 1 read)
            dims = list(args[1:])
        dims = _dims(dims, nd) if dims is not None else tuple(range(nd))
    elif name == "normalize":
        dims = _dims(kwargs.get("dim", args[2] if len(args) > 2 else 1), nd)
    else:
        dims = _dims(dim, nd) if isinstance(dim, (int, list, tuple)) else None
    if dims is None or r.dim in dims:
        return None
    if res.dim() == nd - 1 and name == "kthvalue":  # keepdim=False
        return r.moved(r.dim - (dims[0] < r.dim))
    return r if res.dim() == nd else None


def _reduction(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if args[0] is not x or len(tagged) > 1:
        return None
    dim = _arg(args, kwargs, 1, "dim")
    if name == "norm":
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    if dim is None or not isinstance(dim, (int, list, tuple)) or (isinstance(dim, (list, tuple)) and not dim):
        return None
    dims = _dims(dim, nd)
    if r.dim in dims:
        return None
    # keepdim's position differs (std's and var's third argument is ``unbiased``, norm's the dim):
    # read it off the result
    if res.dim() == nd:
        return r
    if res.dim() != nd - len(set(dims)):
        return None
    return r.moved(r.dim - sum(1 for d in set(dims) if d < r.dim))


def _split(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if name == "index_select" and mode.tags.get(args[0]) is None:
        ids = _arg(args, kwargs, 2, "index")
        dim = int(_arg(args, kwargs, 1, "dim")) % max(1, args[0].dim())
        return mode._lookup(args[0], (slice(None),) * dim + (ids,), ids, res) if ids is x else None
    if args[0] is not x or len(tagged) > 1:
        return None
    if name == "unbind":
        dim = int(_arg(args, kwargs, 1, "dim", 0)) % nd
        return None if dim == r.dim else r.moved(r.dim - (dim < r.dim))
    if name == "select":
        dim = int(_arg(args, kwargs, 1, "dim")) % nd
        return None if dim == r.dim else r.moved(r.dim - (dim < r.dim))
    if name == "index_select":
        dim = int(_arg(args, kwargs, 1, "dim")) % nd
        return None if dim == r.dim else r
    dim = (
        _arg(args, kwargs, 2, "dim", 0)
        if name in ("split", "chunk", "tensor_split", "split_with_sizes")
        else _arg(args, kwargs, 1, "dim")
    )
    dim = int(dim) % nd
    return None if dim == r.dim else r


def _join(mode, func, name, args, kwargs, tagged, res):
    _, _, nd = _first(tagged)
    tensors = args[0] if args else kwargs.get("tensors")
    dim = _arg(args, kwargs, 1, "dim", 0)
    if not isinstance(dim, int):
        return None
    rows = None
    for t in tensors:
        tr = mode.tags.get(t)
        if tr is None:
            continue
        if rows is not None and (tr.dim != rows.dim or tr.group != rows.group):
            return None
        rows = tr
    if name == "stack":
        d = dim % (nd + 1)
        return None if rows is None else rows.moved(rows.dim + (d <= rows.dim))
    return None if rows is None or dim % nd == rows.dim else rows


def _matmul(mode, func, name, args, kwargs, tagged, res):
    return mode._matmul(args, res)


def _getitem(mode, func, name, args, kwargs, tagged, res):
    x = tagged[0][0]
    r = mode.tags.get(args[0])
    if r is None:  # a constant (a position table) indexed by the batch's indices
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return mode._lookup(args[0], index, x, res) if len(tagged) == 1 else None
    return mode._index_rows(args[0], args[1], r)


# --- the rules of the other operations, by name (:meth:`ProvenanceMode._rule`): one handler for a name or a
# few (:func:`_named`), the same signature as the families'; a name without a handler is not row by row


def _named(*names):
    """Register the decorated handler as the rule of the operations named ``names`` (:data:`_NAMED_RULES`);
    a name ruled twice is a mistake of this module, refused at import."""

    def register(handler):
        for n in names:
            if n in _NAMED_RULES:
                raise ValueError(f"provenance: {n!r} has two rules ({_NAMED_RULES[n].__name__}, {handler.__name__})")
            _NAMED_RULES[n] = handler
        return handler

    return register


#: operation name -> its rows handler, for an operation in no family (:meth:`ProvenanceMode._rule`); read by
#: ``tests/test_provenance_rules.py``, which checks each such operation against a perturbed example
_NAMED_RULES: dict = {}


def _only_first(args, tagged, x):
    """Whether the batch reaches the operation through its first argument only."""
    return len(tagged) == 1 and args and args[0] is x


@_named("linear")
def _linear(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    return r if r.dim != nd - 1 else None


@_named("addmm")
def _addmm(mode, func, name, args, kwargs, tagged, res):  # input + mat1 @ mat2, the batch in mat1
    x, r, _ = _first(tagged)
    if len(args) > 1 and args[1] is x and len(tagged) == 1:
        return r if r.dim == 0 else None
    return None


@_named("baddbmm")
def _baddbmm(mode, func, name, args, kwargs, tagged, res):  # input + batch1 @ batch2 (a batch of products)
    got = None
    pair = (_arg(args, kwargs, 1, "batch1"), _arg(args, kwargs, 2, "batch2"))
    if mode.tags.get(pair[0]) is not None or mode.tags.get(pair[1]) is not None:
        got = mode._matmul(pair, res)
        if got is None:
            return None
    ri = mode.tags.get(args[0])
    if ri is not None:
        ra = mode._aligned([(args[0], ri)], res.dim(), res)
        if ra is None or (got is not None and (ra.dim, ra.group) != (got.dim, got.group)):
            return None
        got = got or ra
    return got


@_named("embedding")
def _embedding(mode, func, name, args, kwargs, tagged, res):
    x, r, _ = _first(tagged)
    return r if len(tagged) == 1 and args[0] is x else None


@_named("one_hot")
def _one_hot(mode, func, name, args, kwargs, tagged, res):
    x, r, _ = _first(tagged)
    return r if _only_first(args, tagged, x) else None


@_named("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
def _conv(mode, func, name, args, kwargs, tagged, res):
    x, r, _ = _first(tagged)
    return r if _only_first(args, tagged, x) and r.dim == 0 and r.group == 1 else None


@_named(
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "interpolate",
    "upsample",
    "fold",
)
def _pool(mode, func, name, args, kwargs, tagged, res):  # (N, C, *spatial): the batch first, unbatched refused
    x, r, nd = _first(tagged)
    return r if _only_first(args, tagged, x) and r.dim == 0 and r.group == 1 and nd >= 3 else None


def _pixels(x, r, nd, args, tagged):  # (N, C, H, W); 3-d: C is the batch
    return r if _only_first(args, tagged, x) and r.dim == 0 and r.group == 1 and nd == 4 else None


@_named("pixel_shuffle", "pixel_unshuffle")
def _pixel_shuffle(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    return _pixels(x, r, nd, args, tagged)


@_named("unfold")
def _unfold(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if func is F.unfold:  # im2col of (N, C, H, W), as pixel_shuffle
        return _pixels(x, r, nd, args, tagged)
    if not _only_first(args, tagged, x):
        return None
    # Tensor.unfold(dimension, size, step): windows along ``dimension``
    return None if int(_arg(args, kwargs, 1, "dimension")) % nd == r.dim else r


@_named("layer_norm", "rms_norm")
def _layer_norm(mode, func, name, args, kwargs, tagged, res):  # over the last len(normalized_shape) dimensions
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    shape = _arg(args, kwargs, 1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    return r if r.dim < nd - k else None


@_named("group_norm", "instance_norm")
def _group_norm(mode, func, name, args, kwargs, tagged, res):  # each sample of dimension 0 on its own
    x, r, _ = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    return r if r.dim == 0 and r.group == 1 else None


@_named("batch_norm")
def _batch_norm(mode, func, name, args, kwargs, tagged, res):  # row by row only with running statistics
    x, r, _ = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    training = _arg(args, kwargs, 5, "training", False)
    running = _arg(args, kwargs, 1, "running_mean")
    if training or running is None:
        return None
    return r if r.dim != 1 else None


@_named("scaled_dot_product_attention")
def _attention(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    return (
        mode._aligned(tagged, res.dim(), res)
        if all(t.dim() == res.dim() or t is not x for t, _ in tagged) and r.dim < nd - 2
        else None
    )


@_named("pad")
def _pad(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    pad = list(_arg(args, kwargs, 1, "pad"))
    k = nd - 1 - r.dim  # the pair of the batch dimension, counted from the last
    return r if len(pad) < 2 * k + 2 or pad[2 * k] == pad[2 * k + 1] == 0 else None


@_named("tril", "triu", "tril_", "triu_")
def _triangle(mode, func, name, args, kwargs, tagged, res):  # the last two dimensions
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    return r if r.dim < nd - 2 else None


@_named("diagonal")
def _diagonal(mode, func, name, args, kwargs, tagged, res):  # (input, offset=0, dim1=0, dim2=1): those two last
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    d1, d2 = (int(_arg(args, kwargs, k, n, k - 2)) % nd for k, n in ((2, "dim1"), (3, "dim2")))
    return None if r.dim in (d1, d2) else r.moved(r.dim - (d1 < r.dim) - (d2 < r.dim))


@_named("gather", "take_along_dim")
def _gather(mode, func, name, args, kwargs, tagged, res):
    return mode._gather(func, args, kwargs, res)


@_named("einsum")
def _einsum(mode, func, name, args, kwargs, tagged, res):
    return mode._einsum(args, res)


@_named(*FFT)
def _fft(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    return _fft_rows(name, args, kwargs, nd, r, res) if _only_first(args, tagged, x) else None


@_named("real", "imag", "conj", "conj_physical", "resolve_conj", "resolve_neg", "angle")
def _complex(mode, func, name, args, kwargs, tagged, res):  # elementwise on complex values (FNet: fftn(x).real)
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    return r if res.dim() == nd else None


#: operations (besides the elementwise family) whose constant operands are aligned with the result's batch rows:
#: a constant whose rows differ there is refused (:meth:`ProvenanceMode._positional`); the scatter family's
#: ``src``/``index`` and ``addmm``'s added input were not checked (a fuzzer's: example i got the constant's row i)
_ALIGNED_OPERANDS = frozenset(
    {"where", "masked_fill", "lerp", "addcmul", "addcdiv", "broadcast_tensors", "addmm", "scatter", "scatter_add"}
    | {"index_add", "index_copy", "scatter_", "scatter_add_", "index_copy_", "index_add_"}
)


def _index_of_the_batch(mode, args, kwargs) -> bool:
    """Whether ``index_add``/``index_copy``/``index_fill``'s index is of the batch: one index places the values of
    every row (the same positions for all), so an index computed from the examples lets each one move every
    other's values (an audit's: a (B,) index into a time-first (T, B) target was aligned with the batch's rows)."""
    index = _arg(args, kwargs, 2, "index")
    return torch.is_tensor(index) and mode.tags.get(index) is not None


@_named("scatter", "scatter_add", "index_add", "index_fill", "index_copy", "masked_scatter")
def _scatter(mode, func, name, args, kwargs, tagged, res):  # into the batch's tensor, along another dimension
    x, r, nd = _first(tagged)
    if name.startswith("index_") and _index_of_the_batch(mode, args, kwargs):
        return None
    if name == "index_copy" and args[0] is not x and mode.tags.get(args[0]) is None:  # into a constant (a cache)
        return mode._scatter_into_constant(func, args, kwargs, x, r, res)
    dim = int(_arg(args, kwargs, 1, "dim")) % nd
    if dim == r.dim or args[0] is not x:
        return None
    return mode._aligned(tagged, res.dim(), res)


@_named("scatter_", "scatter_add_", "index_copy_", "index_add_")
def _scatter_into(mode, func, name, args, kwargs, tagged, res):  # in place: into the batch's tensor, or a constant
    x, r, _ = _first(tagged)
    if name.startswith("index_") and _index_of_the_batch(mode, args, kwargs):
        return None
    if args[0] is x:
        return _scatter(mode, func, name, args, kwargs, tagged, res)
    if mode.tags.get(args[0]) is None:
        return mode._scatter_into_constant(func, args, kwargs, x, r, res)
    return None


@_named("broadcast_tensors")
def _broadcast_tensors(mode, func, name, args, kwargs, tagged, res):  # every output: the operands' rows, aligned
    return mode._aligned(tagged, res.dim(), res)  # (a constant whose rows differ: refused by _positional)


@_named("repeat_interleave")
def _repeat_interleave(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    return r if dim is not None and int(dim) % nd != r.dim and _only_first(args, tagged, x) else None


@_named("repeat")
def _repeat(mode, func, name, args, kwargs, tagged, res):
    x, r, nd = _first(tagged)
    if not _only_first(args, tagged, x):
        return None
    sizes = args[1:] if len(args) > 2 or isinstance(args[1], int) else args[1]
    sizes = list(sizes)
    d = r.dim + len(sizes) - nd
    return Rows(d, r.group) if sizes[d] == 1 else None


@_named(
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "smooth_l1_loss",
    "huber_loss",
)
def _loss(mode, func, name, args, kwargs, tagged, res):  # per example only unreduced, the batch first
    x, r, _ = _first(tagged)
    red = kwargs.get("reduction", "mean")
    if red != "none" or r.dim != 0:
        return None
    # a constant input or target (or a weight of the input's rank) whose rows differ: example i would get row i
    # (a fuzzer's)
    operands = [_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")]
    operands += [
        v for k, v in kwargs.items() if k not in ("input", "target") and torch.is_tensor(v) and v.dim() == x.dim()
    ]
    for t in operands:
        aligned = torch.is_tensor(t) and mode.tags.get(t) is None and t.dim() and t.shape[0] == res.shape[0] > 1
        if aligned and t.stride(0) != 0 and mode._rows_differ(t, 0, r.group):
            return None
    return r


#: the families of operations by function, in the order they are tried (a function in two families
#: takes the first), then the handler of each: :data:`_FAMILY_RULES`
_FAMILIES = (
    (POINTWISE, _pointwise),
    (PROPS, _property),
    (RESHAPES, _reshape),
    (EXPANDS, _expand),
    (PERMUTES, _permute),
    (ALONG_DIM, _along_dim),
    (REDUCTIONS, _reduction),
    (SPLITS, _split),
    (JOINS, _join),
    (MATMULS, _matmul),
    (GETITEM, _getitem),
)
#: function -> its rows handler (:meth:`ProvenanceMode._rule`); an operation in no family is ruled by its
#: name (:data:`_NAMED_RULES`).  Private: ``tests/test_provenance_rules.py`` checks every public
#: table of functions, and these are the families' tables above.
_FAMILY_RULES: dict = {f: handler for funcs, handler in reversed(_FAMILIES) for f in funcs}  # the first family wins


def probe_rank(target, index) -> int:
    with torch.no_grad():
        return target[index].dim()


def enter(batch: int) -> ProvenanceMode:
    mode = ProvenanceMode(batch)
    mode.__enter__()
    return mode


__all__ = ["BATCH", "ProvenanceMode", "RefusedRows", "Rows", "current", "enter", "op_name", "refusal", "rows_of"]
