"""Values shared by the batch in book-keeping (``grad_sample_mode="bk"``): covered layers fed an input
of batch size 1, and parameters used directly in a module's forward.

A position-embedding table looked up with ``position_ids`` of shape (1, T) (BERT, GPT-2), or ViT's
class token and position embedding, is one value v broadcast over the batch.  Example i's gradient
of v is the loss gradient w.r.t. example i's copy of v where it is broadcast — which autograd never
exposes (the broadcast's backward already summed it).  This module owns that tracking: a value
computed from such *sources* without touching the batch is a :class:`SharedTensor`; where it meets
the batch it is replaced by ``v.expand(B, …)`` through :class:`_Broadcast`, whose backward receives
the per-example gradients (the forward values are unchanged); a batched vector-Jacobian product
carries them back to the sources; a covered layer with a batch-independent input is a source
itself.  Any other use of a shared value is refused, naming the operation, and a use it cannot see
(an in-place write, a custom ``autograd.Function``) is refused in the backward pass, where the
summed gradient of a source must equal the sum of its per-example ones (:func:`check_complete`).

User guide: ``docs/performance.md`` (Values shared by the batch).
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import provenance

_HALF = (torch.float16, torch.bfloat16)
BK_HINT = (
    "give the input a batch dimension of the step's batch size (e.g. position_ids expanded to (B, T)), "
    "or use grad_sample_mode='hooks'"
)


class Source:
    """Collects the per-example gradients (B, *shape) of one batch-independent value (and, for
    :func:`check_complete`, their sum and the sum of their absolute values)."""

    def __init__(self, name: str, batch: int, sink=None):
        self.name, self.batch, self.sink = name, batch, sink
        # the dtype autocast computed in when the value was made (its gradients rounded there), or None
        self.half = next(
            (torch.get_autocast_dtype(d) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)),
            None,
        )
        self.grad = None
        self.total = self.mass = None

    def add(self, g: torch.Tensor) -> None:
        wide = g.float() if g.dtype in _HALF else g  # half precision: the sums in float32
        total, mass = wide.sum(0), wide.abs().sum(0)
        self.total = total if self.total is None else self.total + total
        self.mass = mass if self.mass is None else self.mass + mass
        if self.sink is not None:
            self.sink(g)
        else:
            self.grad = g if self.grad is None else self.grad + g


#: the relative discrepancy (to the per-example gradients' absolute sum) above which part of a summed
#: gradient is taken to have bypassed the tracking (float rounding of the two sums is far below it; in
#: half precision, 8 units of rounding of the gradient's type are added)
INCOMPLETE = 1e-4


def check_complete(source: Source, g: torch.Tensor) -> None:
    """Refuse when autograd's summed gradient ``g`` of a batch-independent value is not the sum of the
    per-example gradients its source collected where it met the batch: part of it came through an
    operation ``__torch_function__`` does not see (``h[...] = v``, a custom ``autograd.Function``) and
    would be left out of every example's gradient, silently."""
    if g is None or not g.numel():
        return
    total = source.total.reshape(g.shape) if source.total is not None else torch.zeros_like(g)
    mass = float(source.mass.max()) if source.mass is not None else 0.0
    gap = float((g.to(total.dtype) - total).abs().max())
    if not (math.isfinite(gap) and math.isfinite(mass)):  # an overflow (autocast): those examples are left out
        return
    half = g.dtype if g.dtype in _HALF else source.half if source.half in _HALF else None
    rounding = 8 * torch.finfo(half).eps if half is not None else 0.0  # per-example and summed computations round apart
    if gap > (INCOMPLETE + rounding) * mass + torch.finfo(g.dtype).tiny:
        raise RuntimeError(
            f"grad_sample_mode='bk': part of the gradient of a value shared by the batch (from {source.name!r}) "
            "reached it through an operation book-keeping does not track (e.g. an assignment h[...] = value into a "
            "batch tensor, or a custom autograd.Function): its per-example gradients would be incomplete; combine "
            f"it with the batch by +, -, *, /, torch.where, matmul or torch.cat instead, or {BK_HINT}"
        )


def _describe(roots) -> str:
    names = sorted({src.name for _, src in roots})
    return ", ".join(repr(n) for n in names)


def distribute(tensor: torch.Tensor, roots, per_example: torch.Tensor) -> None:
    """Hand per-example gradients (B, *tensor.shape) of a batch-independent value to its sources: directly
    when it is a source's own tensor, else by one batched vector-Jacobian product through the
    batch-independent operations that derived it."""
    rest = []
    for root, src in roots:
        if root is tensor:
            src.add(per_example)
        else:
            rest.append((root, src))
    if not rest:
        return
    grads = torch.autograd.grad(
        tensor, [root for root, _ in rest], per_example, retain_graph=True, allow_unused=True, is_grads_batched=True
    )
    for (_, src), g in zip(rest, grads, strict=True):
        if g is not None:
            src.add(g)


class _Broadcast(torch.autograd.Function):
    """``base.expand(batch, …)`` for a batch-independent value with a leading dimension of 1; the
    backward hands the per-example gradients to the value's sources and returns their sum."""

    @staticmethod
    def forward(ctx, base, batch, info, group=1):
        ctx.batch, ctx.info, ctx.group = batch, info, group
        return base.expand((batch * group, *tuple(base.shape[1:])))

    @staticmethod
    def backward(ctx, g):
        tensor, roots = ctx.info
        if ctx.group != 1:  # rows grouped by example ((B·g, ...): Swin's windows): the sum over each group
            g = g.reshape((ctx.batch, ctx.group, *tuple(g.shape[1:]))).sum(1)
        distribute(tensor, roots, g.reshape((ctx.batch, *tuple(tensor.shape))))
        ctx.info = None
        return g.sum(0, keepdim=True), None, None, None


def broadcast(shared: SharedTensor, rank: int, group: int = 1) -> torch.Tensor:
    """The batch-independent value ``shared`` broadcast to the batch: a (B, …) tensor whose rows are its
    value, with the leading dimensions padded to ``rank`` (that of the operation where it meets the
    batch).  Refused unless its (padded) leading dimension is 1, or B with all rows one value by
    construction (stride 0: an ``expand`` to the batch, as ViT's class token)."""
    plain, batch = shared._plain, shared._batch
    if rank == 0:
        raise _refusal("a scalar", shared)
    tile = getattr(shared, "_tile", None)
    if tile is not None and plain.dim() == rank and tile[1] == group:
        return _TiledBroadcast.apply(tile[0], batch, (tile[0], shared._roots))
    padded = (1,) * (rank - plain.dim()) + tuple(plain.shape)
    view = plain.reshape(padded)
    if batch == 0 and padded[0] == 0:  # an empty batch: nothing to attribute
        return view
    if padded[0] == 1:
        return _Broadcast.apply(view, batch, (plain, shared._roots), group)
    if padded[0] == batch and view.stride(0) == 0:
        base = view.narrow(0, 0, 1)
        return _Broadcast.apply(base, batch, (base, shared._roots), group)
    raise _refusal(f"an operand of shape {tuple(plain.shape)} aligned row by row with the batch", shared)


def _refusal(what: str, shared: SharedTensor, op=None) -> RuntimeError:
    where = f" in {getattr(op, '__name__', op)}" if op is not None else ""
    return RuntimeError(
        f"grad_sample_mode='bk': a value shared by the batch (from {_describe(shared._roots)}) is used as {what}"
        f"{where}; book-keeping can attribute its gradient to examples only where it is broadcast over the batch "
        f"(+, -, *, /, torch.where, matmul, torch.cat along a non-batch dimension, or a covered layer); {BK_HINT}"
    )


def _names(*fns):
    return frozenset(fns)


_T = torch.Tensor
#: operations where a batch-independent value may meet the batch (broadcast over the batch dimension)
ELEMENTWISE = _names(
    torch.add,
    _T.add,
    _T.add_,
    _T.__add__,
    _T.__radd__,
    _T.__iadd__,
    torch.sub,
    torch.subtract,
    _T.sub,
    _T.sub_,
    _T.__sub__,
    _T.__rsub__,
    _T.__isub__,
    torch.rsub,
    torch.mul,
    torch.multiply,
    _T.mul,
    _T.mul_,
    _T.__mul__,
    _T.__rmul__,
    _T.__imul__,
    torch.div,
    torch.divide,
    torch.true_divide,
    _T.div,
    _T.div_,
    _T.__truediv__,
    _T.__rtruediv__,
    _T.__itruediv__,
    torch.where,
    _T.where,
)
#: attention: query, key, value and mask broadcast against each other over the leading dimensions
ATTENTION = _names(torch.nn.functional.scaled_dot_product_attention)
MATMUL = _names(torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.bmm, _T.bmm)
CAT = _names(torch.cat, torch.concat, torch.concatenate)
#: a loss that never met the batch: its gradient belongs to no example
BACKWARD = _names(_T.backward, torch.autograd.backward, torch.autograd.grad)


def _batch_group(t: torch.Tensor, rank: int, batch: int) -> int | None:
    """Rows per example when ``t``, aligned with ``rank`` dimensions, is the batch in its leading dimension
    (one example per row, or contiguous groups of rows: (B·g, ...)); None otherwise."""
    if provenance.current() is None:
        return 1 if t.dim() == rank and rank > 0 and t.shape[0] == batch else None
    rows = provenance.rows_of(t)
    ok = rows is not None and rows.known and rows.dim == 0 and t.dim() == rank and rank > 0
    return rows.group if ok else None


def same_rows(t: torch.Tensor, rank: int, batch: int) -> bool:
    """``t`` (aligned with ``rank`` dimensions) is a constant of B identical rows, not from the batch (the
    comparison reads no example's data)."""
    if t.requires_grad or t.dim() != rank or batch < 2 or t.shape[0] != batch or _from_batch(t, batch) is not None:
        return False
    return t.stride(0) == 0 or bool((t == t.narrow(0, 0, 1)).all())


def _from_batch(t: torch.Tensor, batch: int):
    """The rows of ``t`` when it derives from the batch (None: it does not; by its shape outside a forward)."""
    if provenance.current() is None:
        return provenance.BATCH if t.dim() > 0 and t.shape[0] == batch else None
    return provenance.rows_of(t)


class SharedTensor(torch.Tensor):
    """A batch-independent value during the forward (see the module docstring).  ``_plain`` is the tensor
    in the autograd graph, ``_roots`` its sources ((tensor, :class:`Source`) pairs), ``_batch`` the step's
    batch size.  Operations run on the plain tensors; their results are plain where the value meets
    the batch and batch-independent otherwise."""

    @staticmethod
    def wrap(plain: torch.Tensor, roots, batch: int) -> SharedTensor:
        shared = plain.as_subclass(SharedTensor)
        shared._plain, shared._roots, shared._batch = plain, tuple(roots), batch
        shared._tile = None
        return shared

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        donor = provenance.dtype_donor(args, kwargs) if func in provenance.DTYPE_OF_OTHER else None
        if torch.is_tensor(donor):  # ``weight.type_as(x)``, ``weight.to(x)``: x gives a dtype and a device, no values
            rest = {k: v for k, v in kwargs.items() if k not in ("other", "tensor")}
            return args[0].to(donor.device, donor.dtype, *args[2:], **rest)
        flat, spec = tree_flatten((args, kwargs))
        shared = [x for x in flat if isinstance(x, SharedTensor)]
        plain = [x._plain if isinstance(x, SharedTensor) else x for x in flat]
        with torch._C.DisableTorchFunctionSubclass():
            if not shared:
                return func(*args, **kwargs)
            first = shared[0]
            if func in BACKWARD:
                raise _refusal("a loss", first, func)
            partners = [
                x
                for x, orig in zip(plain, flat, strict=True)
                if torch.is_tensor(x) and not isinstance(orig, SharedTensor)
            ]
            for t in partners:
                rows = _from_batch(t, first._batch)
                if rows is not None and not rows.known:
                    raise provenance.refusal(
                        f"a value shared by the batch (from {_describe(first._roots)}) in {provenance.op_name(func)!r}",
                        rows,
                    )
            rank = _meeting_rank(func, args, kwargs, [x for x in plain if torch.is_tensor(x)])
            groups = {_batch_group(t, rank, first._batch) for t in partners} - {None} if rank is not None else set()
            if len(groups) == 1:
                group = groups.pop()
                if func in CAT and any(s._plain.shape[0] != s._batch for s in shared):
                    a, k = tree_unflatten(plain, spec)  # sizes that differ in the batch dimension: torch's error
                    return func(*a, **k)
                if func in MATMUL and rank == 2 and isinstance(flat[1], SharedTensor) and len(shared) == 1:
                    # (B, d) @ W: as (B, 1, d) @ (B, d, p), each example with its copy of W; rows grouped by
                    # example, (B·T, d) @ W: as (B, T, d) @ (B, d, p) (it crashed on a size error: a fuzzer's)
                    rows = plain[0].unsqueeze(1) if group == 1 else plain[0].unflatten(0, (-1, group))
                    out = func(rows, broadcast(flat[1], 3))
                    return out.squeeze(1) if group == 1 else out.flatten(0, 1)
                met = [broadcast(x, rank, group) if isinstance(x, SharedTensor) else x for x in flat]
                a, k = tree_unflatten(met, spec)
                return func(*a, **k)
            full = None
            if func in ELEMENTWISE and rank:
                # a constant of B identical rows (torch.ones(B, T) as a mask, arange(T).repeat(B, 1)): one
                # row of it, the result expanded back (stride 0: broadcast over the batch where it meets it)
                narrowed = [
                    x.narrow(0, 0, 1)
                    if torch.is_tensor(x) and not isinstance(orig, SharedTensor) and same_rows(x, rank, first._batch)
                    else x
                    for x, orig in zip(plain, flat, strict=True)
                ]
                if any(n is not x for n, x in zip(narrowed, plain, strict=True)):
                    full = torch.broadcast_shapes(*(tuple(x.shape) for x in plain if torch.is_tensor(x)))
                    plain = narrowed
            elif func is _T.__getitem__ and flat[0] is first and len(plain) > 1:
                # a table looked up at a constant index of B identical rows (positions arange(T) repeated for
                # every example): the lookup of one row, expanded back to the batch (stride 0, as above)
                index = plain[1]
                batch = first._batch
                if torch.is_tensor(index) and not index.is_floating_point() and same_rows(index, index.dim(), batch):
                    plain = [plain[0], index.narrow(0, 0, 1), *plain[2:]]
                    full = (first._batch,)
            a, k = tree_unflatten(plain, spec)
            out = func(*a, **k)
            if full is not None and torch.is_tensor(out):
                out = out.expand(full if len(full) == out.dim() else (*full, *tuple(out.shape[1:])))
            results = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
            if not results:  # metadata, comparisons, detach(), no_grad: nothing to attribute
                return out
            if any(_from_batch(t, first._batch) is not None for t in partners):
                # any other operation that keeps the examples' rows apart (F.conv1d or F.linear with a layer's
                # weight, torch.maximum with a parameter, einsum with a relative-position kernel): each example's
                # gradient by its own backward through the operation (:class:`_PerExample`)
                got = _per_example(func, flat, plain, spec, first)
                if got is not None:
                    return got
                raise _refusal("an operand together with the batch", first, func)
            if any(t.requires_grad for t in partners):
                raise _refusal(
                    "an operand together with a tensor that requires a gradient but has no batch "
                    "dimension (a reduction over the batch, or another module's parameter)",
                    first,
                    func,
                )
            roots = {}
            for s in shared:
                for root, src in s._roots:
                    roots[id(src)] = (root, src)
            roots = tuple(roots.values())
            wrapped = tree_map(
                lambda t: SharedTensor.wrap(t, roots, first._batch) if torch.is_tensor(t) and t.requires_grad else t,
                out,
            )
            if isinstance(wrapped, SharedTensor) and len(shared) == 1 and flat[0] is first:
                wrapped._tile = _tiled(func, first, plain, spec, wrapped)
            return wrapped


def _per_example(func, flat, plain, spec, first):
    """``func`` on the batch and values shared by it, attributed example by example (None: it is not an operation
    that keeps the examples apart, or no forward is in progress: the caller refuses).

    The operation runs as it is (the same values); provenance (:mod:`.provenance`) says where the result's rows
    are.  Where they are each one example's, example i's output depends on its own rows and on the shared
    values only, so its gradient of a shared value v is the vector-Jacobian product of example i's output
    alone with v: ``torch.func.vmap`` over the examples of ``torch.func.vjp`` of the operation, one copy of v
    per example (:class:`_PerExample`, in the backward pass) — the per-example backward that
    :class:`_Broadcast` gives for ``+``.  Rows that mix examples (or an operation without a provenance rule)
    are refused, naming the operation."""
    mode = provenance.current()
    if mode is None or provenance.writes_in_place(func) or "out" in kwargs_of(spec, plain):
        return None  # an in-place write (or into ``out=``) is not an operation on copies: refused as before
    batch = first._batch
    tagged, values = [], []
    for k, (x, orig) in enumerate(zip(plain, flat, strict=True)):
        if isinstance(orig, SharedTensor):
            values.append((k, orig._roots))
        elif torch.is_tensor(x):
            rows = mode.tags.get(x)
            if rows is not None:
                if not rows.known or x.shape[rows.dim] != batch * rows.group:
                    return None
                tagged.append((k, rows))
    if not tagged:
        return None
    info = _PerExampleInfo(func, spec, plain, tagged, values, batch)
    out = _PerExample.apply(info, *(plain[k] for k, _ in tagged), *(plain[k] for k, _ in values))
    if not torch.is_tensor(out) or not out.is_floating_point():
        return None
    a, kw = tree_unflatten(plain, spec)
    rows = mode.result_rows(func, a, kw, out)
    if not rows.known:
        raise provenance.refusal(
            f"a value shared by the batch (from {_describe(first._roots)}) in {provenance.op_name(func)!r}", rows
        )
    if rows is provenance.SHARED or rows.dim >= out.dim() or out.shape[rows.dim] != batch * rows.group:
        return None
    info.settle(rows)
    return out


def kwargs_of(spec, plain) -> dict:
    """The keyword arguments of a call flattened as ``plain`` with ``spec``."""
    return tree_unflatten(plain, spec)[1]


class _PerExampleInfo:
    """What :class:`_PerExample` needs: the call (``func``, its arguments flattened as ``plain`` with their
    ``spec``), the batch operands' (position, rows), the shared operands' (position, sources), the batch size
    and (known after the forward: :meth:`settle`) the result's rows."""

    def __init__(self, func, spec, plain, tagged, values, batch):
        self.func, self.spec, self.plain = func, spec, plain
        self.tagged, self.values, self.batch = tagged, values, batch
        self.rows = None

    def settle(self, rows) -> None:
        """The result's rows, once the forward ran (the backward reads each example's rows of its gradient there)."""
        self.rows = rows

    def call(self, leaves):
        a, kw = tree_unflatten(leaves, self.spec)
        return self.func(*a, **kw)


def _examples(t: torch.Tensor, rows, batch: int) -> torch.Tensor:
    """(B, k, ...) with example i's k rows of ``t`` (along ``rows.dim``, k = ``rows.group``) at [i]."""
    return t.movedim(rows.dim, 0).unflatten(0, (batch, rows.group))


class _PerExample(torch.autograd.Function):
    """An operation on the batch and values shared by it (:func:`_per_example`): the forward is the operation;
    the backward forms each example's gradients by its own vector-Jacobian product (vmap over the examples):
    the batch operands get theirs in place, each shared value's per-example gradients go to its sources
    (:func:`distribute`) and their sum to autograd (checked against them: :func:`check_complete`)."""

    @staticmethod
    def forward(ctx, info, *operands):
        ctx.info = info
        return info.call(info.plain)

    @staticmethod
    def backward(ctx, g):
        from torch.func import vjp, vmap

        info = ctx.info
        ctx.info = None
        batch, n_tagged = info.batch, len(info.tagged)
        need = ctx.needs_input_grad[1:]
        diff = [j for j in range(n_tagged) if need[j]]  # the batch operands that need a gradient
        rest = [j for j in range(n_tagged) if not need[j]]

        def call(d_in, r_in, v_in):
            leaves = list(info.plain)
            for j, x in (*zip(diff, d_in, strict=True), *zip(rest, r_in, strict=True)):
                k, r = info.tagged[j]
                leaves[k] = x.movedim(0, r.dim)  # example i's rows where the batch's were
            for (k, _), v in zip(info.values, v_in, strict=True):
                leaves[k] = v
            return info.call(leaves).movedim(info.rows.dim, 0)

        def one(d_in, r_in, v_in, g_i):
            _, pull = vjp(lambda d, v: call(d, r_in, v), d_in, v_in)
            return pull(g_i)

        def per(j):
            k, r = info.tagged[j]
            return _examples(info.plain[k].detach(), r, batch)

        shared_values = [info.plain[k].detach() for k, _ in info.values]
        v_in = [v.unsqueeze(0).expand((batch, *tuple(v.shape))) for v in shared_values]
        g_in = _examples(g, info.rows, batch)
        try:
            with torch.enable_grad():
                d_out, v_out = vmap(one)([per(j) for j in diff], [per(j) for j in rest], v_in, g_in)
        except RuntimeError as exc:
            raise RuntimeError(
                "grad_sample_mode='bk': the per-example gradients of a value shared by the batch through "
                f"{provenance.op_name(info.func)!r} could not be formed example by example ({exc}); {BK_HINT}"
            ) from exc
        grads = [None] * len(need)
        for j, d in zip(diff, d_out, strict=True):
            grads[j] = d.flatten(0, 1).movedim(0, info.tagged[j][1].dim)
        for i, ((k, roots), d) in enumerate(zip(info.values, v_out, strict=True)):
            distribute(info.plain[k], roots, d)
            grads[n_tagged + i] = d.sum(0)
        return (None, *grads)


#: operations that keep a tiled value's leading dimension (applied to its tile alike)
_KEEPS_ROWS = frozenset(
    {torch.Tensor.transpose, torch.transpose, torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.float}
    | {torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.div, torch.Tensor.__truediv__}
)


_EXPANDS = frozenset({torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to, torch.Tensor.broadcast_to})


def _tiled(func, first: SharedTensor, plain, spec, result):
    """(tile, rows) when ``result`` is B copies of a tile of ``rows`` rows stacked along its leading dimension —
    ``value.repeat(B, 1, ...)`` (DeBERTa's relative positions, repeated for a (B·H, ...) batch of heads),
    ``value.expand(B, ...)`` of a leading dimension of 1 (a tile of one row), or a row-keeping operation on such
    a value (applied to the tile: MPNet's ``.contiguous()`` after the expand, which loses the stride 0 that
    :func:`broadcast` reads); None otherwise."""
    flat_args = tree_unflatten(plain, spec)[0]
    batch = first._batch
    if func is torch.Tensor.repeat:
        sizes = flat_args[1:] if len(flat_args) > 2 or isinstance(flat_args[1], int) else tuple(flat_args[1])
        base = first._plain
        if len(sizes) == base.dim() and sizes[0] == batch and all(k == 1 for k in sizes[1:]) and base.dim() > 0:
            return base, base.shape[0]
        return None
    if func in _EXPANDS:  # value.expand(B, ...) of a leading dimension of 1 (MPNet's position bias, then .contiguous())
        base = first._plain
        if base.dim() == result.dim() > 0 and base.shape[0] == 1 and result.shape[0] == batch > 1:
            return base.expand((1, *tuple(result.shape[1:]))), 1
        return None
    if first._tile is not None and func in _KEEPS_ROWS:
        base, rows = first._tile
        if func in (torch.Tensor.transpose, torch.transpose) and 0 in {int(d) % base.dim() for d in flat_args[1:3]}:
            return None
        tile = func(base, *flat_args[1:])
        if torch.is_tensor(tile) and tile.shape[0] == rows and tuple(tile.shape[1:]) == tuple(result.shape[1:]):
            return tile, rows
    return None


class _TiledBroadcast(torch.autograd.Function):
    """``tile.repeat(B, 1, ...)`` met by the batch in rows grouped like its copies (example i's rows are copy
    i): the backward hands example i the gradient of its copy."""

    @staticmethod
    def forward(ctx, tile, batch, info):
        ctx.batch, ctx.info = batch, info
        return tile.repeat((batch,) + (1,) * (tile.dim() - 1))

    @staticmethod
    def backward(ctx, g):
        tile, roots = ctx.info
        per = g.reshape((ctx.batch, *tuple(tile.shape)))
        distribute(tile, roots, per)
        ctx.info = None
        return per.sum(0), None, None


def _meeting_rank(func, args, kwargs, tensors):
    """The rank at which the operands of a broadcasting operation are aligned (None: not one)."""
    if func in ELEMENTWISE or func in ATTENTION:
        return max(t.dim() for t in tensors)
    if func in MATMUL:
        return max(t.dim() for t in tensors) if len(tensors) == 2 and all(t.dim() >= 2 for t in tensors) else None
    if func in CAT:
        rank = tensors[0].dim()
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return rank if rank > 0 and isinstance(dim, int) and dim % rank != 0 else None
    return None


class _ParameterUse(torch.autograd.Function):
    """A parameter as used by its module's forward: the identity, whose backward gives autograd nothing
    for the parameter (its per-example gradients are collected instead).  With a batch of one
    example the summed gradient is that example's and is collected here; with more, the per-example
    gradients collected where the parameter met the batch must add up to it (:func:`check_complete`)."""

    @staticmethod
    def forward(ctx, param, source, shared):
        ctx.source, ctx.shared = source, shared
        return param.view_as(param)

    @staticmethod
    def backward(ctx, g):
        if ctx.source is not None:
            ctx.source.add(g.unsqueeze(0))
        else:
            check_complete(ctx.shared, g)
        ctx.source = ctx.shared = None
        return None, None, None


def parameter_use(param: torch.Tensor, name: str, batch: int, sink) -> torch.Tensor:
    """The tensor a module's forward uses for ``param`` (a direct unit's, :mod:`.keeper`): batch-independent
    (B ≠ 1) or, for a batch of one example, the parameter whose gradient is collected as it is."""
    if batch == 1 and provenance.current() is None:
        return _ParameterUse.apply(param, Source(name, 1, sink), None)
    source = Source(name, batch, sink)
    plain = _ParameterUse.apply(param, None, source)
    return SharedTensor.wrap(plain, ((plain, source),), batch)
