"""Memory written with values of the batch, by address: provenance's tags follow tensors by identity, so a
tensor that shares memory with a written one without the rules seeing the alias would read as untagged.

:class:`~.provenance.ProvenanceMode` tags each tensor an operation returns.  An alias made outside its rules —
``t.detach()`` or ``t.data`` of a tensor not yet from the batch, a view made *before* batch values were written
into its base, a numpy or dlpack alias (``torch.from_numpy(t.numpy())``) — keeps the tag its tensor had, or none.
A write of batch values through such an alias (``side.detach().copy_(x[:, 0])``) then left ``side`` untagged,
and a read of it into Python that steers every example (``if (side > 0).any(): h = h * 2``) was not refused:
an audit found it (``tests/test_bk_provenance.py``).

:class:`WrittenMemory` records every write the mode sees (an in-place operation, ``out=``, ``t[i] = v``,
``t.data = v``, ``_foreach_`` lists) whose target holds values of the batch after it, and every export of a tagged
tensor's memory (numpy, dlpack, storages): the address span, shape, strides and rows.  A record lasts as long as
the memory: it holds a weak reference to the target's storage, whose Python object torch keeps exactly as long as
the memory's last user (:data:`WEAK_STORAGES`, checked at import), so a record of freed memory, whose address
another tensor may take, is never answered, and a scratch buffer is freed as without book-keeping; a target on
foreign memory (numpy, dlpack) is held until the forward ends.  A tensor without a tag of its own then asks here
(:meth:`WrittenMemory.rows`): if its elements may lie in written memory, it is of the batch — with the write's rows
when it reads exactly the written elements or whole rows of them (:func:`_read_rows`), else with rows of no single
example (a conservative answer: its layout is not known to keep each example's rows apart).  A write that left
rows of no single example *spoils* the memory: every tensor reading any of it, tagged or not, has rows of no single
example (:meth:`WrittenMemory.spoilt_rows`; ``h[0].copy_(h[1])`` spoils ``h``).

A tensor of the batch that was computed, not written, can be aliased too, by a call no ``__torch_function__``
receives (``Tensor.set_``, ``Tensor._make_subclass`` as ``nn.Parameter(t)`` and tensor-subclass wrappers call it,
``as_subclass``): the alias reads as untagged.  :class:`TaggedMemory` therefore keeps, by storage, every tagged
tensor that owns its memory, every tagged view of a base the operation made and returned only a view of
(``einsum``'s: :meth:`~.provenance.ProvenanceMode._hold_made_view`), and the loader's batch tensors, views or not,
unless broadcast over the batch (stride 0: no example's memory).  Another view reads its base's memory, whose
record covers it, or a constant's, whose values are of no example.  A tensor without a tag of its own that reads
a recorded storage's elements gets their rows by the same rules (:meth:`TaggedMemory.rows`).  A later
query answers from the span and rows the tensor had when it was tagged, for as long as its memory lives.
"""

from __future__ import annotations

import weakref

import torch

_no_function = torch._C.DisableTorchFunction


def _storages_preserved() -> bool:
    """Whether a tensor's storage object lives exactly as long as its memory's last user (torch keeps one Python
    object per storage: a weak reference to it is then a weak reference to the memory)."""
    t = torch.zeros(1)
    alias = t.detach()
    ref = weakref.ref(t.untyped_storage())
    kept = ref() is not None
    del t
    kept = kept and ref() is not None
    del alias
    return kept and ref() is None


#: weak references to written memory are sound (else every written tensor is held until the forward ends)
WEAK_STORAGES = _storages_preserved()


def _keeper(t):
    """A callable that returns something while ``t``'s memory lives: a weak reference to its storage where that is
    the memory's (an allocator's storage, torch keeping its Python object), so a scratch buffer autograd would free
    is freed; ``t`` itself held (until the forward ends) where the storage is made on foreign memory (numpy,
    dlpack, a buffer: it may die before the memory's owner) or not preserved."""
    if WEAK_STORAGES:
        with _no_function():
            try:
                storage = t.untyped_storage()
                if storage.resizable():
                    return weakref.ref(storage)
            except (RuntimeError, NotImplementedError, TypeError):  # no storage object
                pass
    return lambda: t


def storage_key(t) -> tuple | None:
    """(device, the first byte of ``t``'s storage): every tensor on the same storage has it, however it was made
    (``set_``, ``_make_subclass``, ``as_subclass`` share the storage); None for a tensor that reads no memory."""
    with _no_function():
        try:
            if t.layout is not torch.strided:
                return None
            start = t.untyped_storage().data_ptr()
            return (t.device, start) if start else None
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass or backend without storage
            return None


def _span(t) -> tuple | None:
    """(device, first byte, end byte, shape, strides, dtype) of the elements ``t`` reads; None for a tensor that
    reads no memory (no elements, a meta or sparse tensor)."""
    with _no_function():
        try:
            if t.numel() == 0 or t.layout is not torch.strided:
                return None
            start = t.data_ptr()
            if not start:
                return None
            shape, stride = tuple(t.shape), t.stride()
            size = t.element_size()
        except (RuntimeError, NotImplementedError):  # a tensor subclass or backend without storage
            return None
    reach = 1
    for n, s in zip(shape, stride, strict=True):
        reach += (n - 1) * s
    return (t.device, start, start + reach * size, shape, stride, t.dtype)


def _disjoint(a: tuple, b: tuple) -> bool:
    """Whether two spans of the same shape, strides and dtype read no common element: their offset in elements is
    no sum of ``k_i * stride_i`` with ``|k_i| < shape_i`` (:func:`_reachable`; "not disjoint" where unsure)."""
    size = a[5].itemsize
    diff = b[1] - a[1]
    if diff % size:
        return False  # not element-aligned: take it as overlapping
    dims = sorted(((n, s) for n, s in zip(a[3], a[4], strict=True) if s and n > 1), key=lambda e: -e[1])
    return not _reachable(diff // size, dims)


def _reachable(diff: int, dims: list) -> bool:
    """Whether ``diff = sum(k_i * s_i)`` for some integers ``|k_i| < n_i`` over ``dims`` [(n_i, s_i)], largest stride
    first: each ``k`` the remainder can still be made up by the smaller strides is tried; True (unsure) where more
    than a few are possible (strides that overlap each other)."""
    if not dims:
        return diff == 0
    (n, s), rest = dims[0], dims[1:]
    inner = sum((m - 1) * t for m, t in rest)  # the most the smaller strides reach either way
    lo, hi = max(-(n - 1), -((inner - diff) // s)), min(n - 1, (diff + inner) // s)
    if hi - lo > 3:
        return True
    return any(_reachable(diff - k * s, rest) for k in range(lo, hi + 1))


def _overlap(a: tuple, b: tuple) -> bool:
    if a[0] != b[0] or a[1] >= b[2] or b[1] >= a[2]:
        return False
    if a[3] == b[3] and a[4] == b[4] and a[5] == b[5] and a[1] != b[1]:
        return not _disjoint(a, b)
    return True


_PAGE = 16  # log2 of the bytes of a page of the records' index
_WIDE = 64  # a span over more pages than this is in every page's candidates


def _pages(span: tuple) -> range | None:
    """The index pages a span covers, or None for a wide one."""
    first, last = span[1] >> _PAGE, (span[2] - 1) >> _PAGE
    return None if last - first > _WIDE else range(first, last + 1)


class WrittenMemory:
    """Address spans written with values of the batch in one forward (module docstring).  ``alias`` is the
    answer for a tensor reading written memory with another layout than the write's (rows of no single example)."""

    __slots__ = ("_alias", "_by_page", "_misses", "_prune_at", "_spoils", "_wide", "_writes", "version")

    def __init__(self, alias):
        self._alias = alias
        self._writes: list = []  # (span, rows, alive: None once the span's memory was freed), in order
        self._spoils: list = []  # the writes that left rows of no single example
        self._misses: dict = {}  # id(t) -> (version, weak t): t read no written memory when last asked
        self.version = 0
        self._prune_at = 64  # records of freed memory are dropped when the list reaches this many
        self._by_page: dict = {}  # (device, page) -> the records whose span covers it (a fresh tensor: a few pages)
        self._wide: list = []  # records over more than _WIDE pages

    def holds(self, t, rows) -> None:
        """``t`` holds values of the batch with ``rows``: it was written, or its memory was exported (numpy, dlpack,
        a storage) and may be read or written by a tensor made on it."""
        span = _span(t)
        if span is None:
            return
        entry = (span, rows, _keeper(t))
        self._writes.append(entry)
        self._index(entry)
        if not rows.known:
            self._spoils.append(entry)
        self.version += 1
        if len(self._writes) >= self._prune_at:  # a loop writing fresh scratch buffers
            self._writes = [e for e in self._writes if e[2]() is not None]
            self._spoils = [e for e in self._spoils if e[2]() is not None]
            self._prune_at = max(64, 2 * len(self._writes))
            self._by_page, self._wide = {}, []
            for e in self._writes:
                self._index(e)

    def _index(self, entry) -> None:
        span = entry[0]
        pages = _pages(span)
        if pages is None:
            self._wide.append(entry)
        else:
            for p in pages:
                self._by_page.setdefault((span[0], p), []).append(entry)

    def _candidates(self, span: tuple) -> list:
        """The records that may overlap ``span``: those on its pages and the wide ones (every record for a wide
        span); a loop of fresh buffers asks about its own few pages, not every record of the forward."""
        pages = _pages(span)
        if pages is None:
            return self._writes
        found: dict = {}
        for p in pages:
            for e in self._by_page.get((span[0], p), ()):
                found[id(e)] = e
        return [*found.values(), *self._wide]

    @property
    def spoilt(self) -> bool:
        """Whether some write left rows of no single example (then :meth:`spoilt_rows` is asked at every query)."""
        return bool(self._spoils)

    def spoilt_rows(self, t):
        """The rows (of no single example) of the latest spoiling write into memory that ``t`` reads, or None."""
        span = _span(t) if torch.is_tensor(t) else None
        if span is not None:
            for s, rows, alive in reversed(self._spoils):
                if _overlap(s, span) and alive() is not None:
                    return rows
        return None

    def rows(self, t):
        """The rows of ``t``, a tensor without a tag, by the memory it reads: None when it reads no written memory;
        else the rows every write it overlaps gives it (:func:`_read_rows`), or ``alias`` (rows of no single
        example) when one gives none or two disagree."""
        if not self._writes or not torch.is_tensor(t):
            return None
        key = id(t)
        miss = self._misses.get(key)
        if miss is not None and miss[0] == self.version and miss[1]() is t:
            return None
        span = _span(t)
        found = None
        if span is not None:
            for s, rows, alive in self._candidates(span):
                if not _overlap(s, span) or alive() is None:  # (memory freed since: its address may be another's)
                    continue
                got = _read_rows(s, rows, span)
                if got is None or (found is not None and got.key != found.key):
                    return self._alias
                found = got
        if found is None:
            self._misses[key] = (self.version, weakref.ref(t))
        return found


def _reach(shape, stride, skip: int | None = None) -> int:
    """Elements from a tensor's first to its last, plus one, over its dimensions but ``skip``."""
    return 1 + sum((n - 1) * s for k, (n, s) in enumerate(zip(shape, stride, strict=True)) if k != skip)


def _contiguous(span: tuple) -> bool:
    expected = 1
    for n, stride in reversed(list(zip(span[3], span[4], strict=True))):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _read_rows(s: tuple, rows, t: tuple):
    """The rows of a tensor of span ``t`` reading memory that a write of span ``s`` left with ``rows``: the same rows
    when it reads exactly the write's elements; as a reshape gives them when both are contiguous over the same
    elements (a flat view made before the write: (B, d) → (B·d,), rows grouped by d); ``rows`` moved to its
    dimension k when each of its rows along k lies inside one row of the write — the write's rows are whole blocks
    of memory (the batch dimension outermost), and ``t`` has that block's stride and count along k, and its row i
    starts after the write's row i - 1 ends and ends before its row i + 1 starts (a half of a buffer filled row by
    row, the buffer of a half so filled, a [CLS | tokens] buffer's CLS slot made before its tokens were written);
    else None."""
    if s == t:
        return rows
    if not rows.known or s[5] != t[5]:
        return None
    if s[1:3] == t[1:3] and _contiguous(s) and _contiguous(t):  # the same elements, reshaped (a flat view)
        return rows.reshaped(s[3], t[3])
    d = rows.dim
    block = s[4][d]
    if block <= 0 or _reach(s[3], s[4], d) > block:
        return None
    size = s[5].itemsize
    delta = t[1] - s[1]
    if delta % size:
        return None
    delta //= size
    if delta < _reach(s[3], s[4], d) - block:  # its row i would reach back into the write's row i - 1
        return None
    for k, (n, stride) in enumerate(zip(t[3], t[4], strict=True)):
        if stride == block and n == s[3][d] and delta + _reach(t[3], t[4], k) <= block:
            return rows.moved(k)
    return None


class TaggedMemory:
    """The memory of tagged tensors, by storage (module docstring): a tensor without a tag of its own that shares a
    storage with one (an alias made by a call the mode does not see) reads its rows.  ``alias`` is the answer for a
    tensor that reads such memory with another layout (rows of no single example)."""

    __slots__ = ("_alias", "_by_storage")

    def __init__(self, alias):
        self._alias = alias
        self._by_storage: dict = {}  # storage key -> [(span, rows, alive)], the latest record of each span

    def holds(self, t, rows, views: bool = False) -> None:
        """``t`` was tagged with ``rows``: recorded where it owns its memory (or ``views``: the loader's batch,
        which may be a view of a tensor not from the batch).  One pass with the torch functions off: this runs at
        every tag of a traced forward."""
        with _no_function():
            try:
                if (not views and t._base is not None) or t.layout is not torch.strided:
                    return
                if views and rows.known and t.dim() > rows.dim and t.stride(rows.dim) == 0:
                    return  # broadcast over the batch (a buffer of positions expanded): no example's own memory
                start = t.data_ptr()
                if not start or not t.numel():
                    return
                shape, stride, size = tuple(t.shape), t.stride(), t.element_size()
                storage = t.untyped_storage()
                if not WEAK_STORAGES:
                    alive = weakref.ref(t)  # (an alias that outlives t is then not followed)
                elif storage.resizable():
                    alive = weakref.ref(storage)
                else:  # foreign memory (numpy, dlpack): its storage object may die before it
                    alive = lambda: t  # noqa: E731
                device, dtype = t.device, t.dtype
            except (RuntimeError, NotImplementedError, TypeError):  # a subclass or backend without storage
                return
        key = (device, storage.data_ptr())
        reach = 1
        for n, s in zip(shape, stride, strict=True):
            reach += (n - 1) * s
        span = (device, start, start + reach * size, shape, stride, dtype)
        entries = self._by_storage.get(key)
        if entries is None:
            self._by_storage[key] = [(span, rows, alive)]
        else:  # a span tagged again (in place) or whose memory was freed and taken again: the latest record
            entries[:] = [e for e in entries if e[0] != span and e[2]() is not None]
            entries.append((span, rows, alive))

    def rows(self, t):
        """The rows of ``t``, a tensor without a tag, by the tagged tensors whose storage it reads (as
        :meth:`WrittenMemory.rows`): None when it reads none of their elements."""
        entries = self._by_storage.get(storage_key(t)) if torch.is_tensor(t) else None
        if not entries:
            return None
        span = _span(t)
        found = None
        if span is not None:
            for s, rows, alive in entries:
                if not _overlap(s, span) or alive() is None:
                    continue
                if not rows.known:  # memory of rows of no single example: theirs, with the reason
                    return rows
                got = _read_rows(s, rows, span)
                if got is None or (found is not None and got.key != found.key):
                    return self._alias
                found = got
        return found
