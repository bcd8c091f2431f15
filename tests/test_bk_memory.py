"""Book-keeping's record of memory written with batch values (:mod:`idpsgd.engine.per_example.bk.memory`): which
tensors read it, and with which rows.  The end-to-end cases (an alias written, then read into Python or met by a
layer) are in ``test_bk_provenance.py``."""

from __future__ import annotations

import itertools
import random

import torch

from idpsgd.engine.per_example.bk import memory as M
from idpsgd.engine.per_example.bk import provenance as P


def test_reachable_never_calls_overlapping_offsets_disjoint():
    """Against every choice of ``|k_i| < n_i`` (brute force): "disjoint" only when no element is shared (the unsafe
    answer, which would leave an alias untagged); "unsure" is allowed."""
    rng = random.Random(0)
    unsure = 0
    for _ in range(3000):
        dims = sorted(((rng.randint(2, 4), rng.randint(1, 12)) for _ in range(rng.randint(1, 3))), key=lambda e: -e[1])
        diff = rng.randint(-40, 40)
        ranges = [range(-(n - 1), n) for n, _ in dims]
        truth = any(sum(k * s for k, (_, s) in zip(ks, dims, strict=True)) == diff for ks in itertools.product(*ranges))
        got = M._reachable(diff, dims)
        assert got or not truth, (diff, dims)
        unsure += got and not truth
    assert unsure < 300  # exact for most layouts


def _memory():
    return M.WrittenMemory(P.Rows(None, 1, "alias"))


def test_views_of_written_memory_read_its_rows_or_none():
    wide = torch.zeros(6, 8)
    memory = _memory()
    left, right = wide[:, :4], wide[:, 4:]
    memory.holds(left, P.Rows(0, 1))
    assert M._overlap(M._span(left), M._span(right)) is False  # interleaved rows, no common element
    assert memory.rows(right) is None
    assert memory.rows(wide.detach()[:, :4]) is not None and memory.rows(wide.detach()[:, :4]).dim == 0
    assert memory.rows(wide).dim == 0  # each of its rows lies in one of the write's rows
    assert memory.rows(wide.t()).dim == 1
    assert not memory.rows(wide.view(8, 6)).known  # rows that straddle two examples'
    assert not memory.rows(wide.view(torch.int32)).known  # another dtype: not known to keep the rows apart
    flat = torch.zeros(6, 4)
    memory.holds(flat, P.Rows(0, 1))
    merged = memory.rows(flat.detach().view(-1))  # the same elements, contiguous: a reshape's rows
    assert (merged.dim, merged.group) == (0, 4)


def test_offsets_that_meet_with_a_negative_step_overlap():
    """Shape (2, 3), strides (4, 1), three elements apart: elements 4 and 5 are shared (1·4 − 1·1 = 3)."""
    base = torch.zeros(16)
    a, b = base.as_strided((2, 3), (4, 1), 0), base.as_strided((2, 3), (4, 1), 3)
    assert M._overlap(M._span(a), M._span(b))
    memory = _memory()
    memory.holds(a, P.Rows(0, 1))
    assert not memory.rows(b).known


def test_a_spoiling_write_spoils_every_tensor_reading_its_memory():
    h = torch.zeros(6, 4)
    memory = _memory()
    mixed = P.Rows(None, 1, "flip")
    memory.holds(h[0], mixed)
    assert memory.spoilt and memory.spoilt_rows(h) is mixed and memory.spoilt_rows(h.detach()) is mixed
    assert memory.spoilt_rows(h[1]) is None  # another row: its memory was not written


def test_a_record_lasts_as_long_as_its_memory():
    """A written scratch buffer is freed when its last user dies (the record holds its storage weakly), and a record
    of freed memory is never answered: another tensor may take the address."""
    import weakref

    assert M.WEAK_STORAGES  # torch keeps one Python object per storage (else the records hold their tensors)
    memory = _memory()
    scratch = torch.zeros(6, 4)
    alias = scratch.detach()
    gone = weakref.ref(scratch.untyped_storage())
    memory.holds(scratch, P.Rows(0, 1))
    del scratch
    assert memory.rows(alias).dim == 0  # an alias keeps the memory, and the record, alive
    span = M._span(alias)
    del alias
    assert gone() is None  # freed as without the record
    reuse = torch.empty(6, 4)
    assert M._span(reuse)[1] != span[1] or memory.rows(reuse) is None  # the same address, if taken: no answer


def test_a_record_on_foreign_memory_holds_its_tensor():
    """A tensor made on numpy's memory: its storage object may die before the array that owns the memory, so the
    record holds the tensor itself."""
    import numpy as np

    array = np.zeros((6, 4), dtype=np.float32)
    memory = _memory()
    memory.holds(torch.from_numpy(array), P.Rows(0, 1))  # the tensor is a temporary
    assert memory.rows(torch.from_numpy(array)).dim == 0


def test_the_page_index_finds_every_overlapping_record():
    """Records are indexed by 64 KiB page (a loop of fresh buffers asks about its own pages only): a narrow alias of a
    wide record (over 64 pages), and aliases on either side of a page boundary a record crosses, are all found."""
    memory = _memory()
    wide = torch.zeros(16, 2**17)  # 8 MiB: more than _WIDE pages
    memory.holds(wide, P.Rows(0, 1))
    assert M._pages(M._span(wide)) is None
    assert memory.rows(wide.detach()[3:4, 100:200]) is not None
    flat = torch.zeros(2**15)  # 128 KiB: at least two pages
    pages = M._pages(M._span(flat))
    boundary = ((pages[0] + 1) << M._PAGE) - M._span(flat)[1]  # bytes from flat's start to its first page boundary
    crossing = flat[boundary // 4 - 4 : boundary // 4 + 4].view(2, 4)
    memory.holds(crossing, P.Rows(0, 1))
    before, after = flat[boundary // 4 - 2 : boundary // 4], flat[boundary // 4 : boundary // 4 + 2]
    assert memory.rows(before) is not None and memory.rows(after) is not None  # (mixed: another layout)
    assert memory.rows(flat[: boundary // 4 - 8]) is None


def test_tagged_memory_answers_an_alias_the_mode_did_not_see():
    """:class:`~.memory.TaggedMemory`: a tagged tensor that owns its memory, by storage; a tensor sharing that storage
    gets its rows where its layout keeps them (the same elements, whole rows of them), else rows of no example."""
    memory = M.TaggedMemory(P.Rows(None, 1, "alias"))
    h = torch.randn(6, 8)
    memory.holds(h, P.Rows(0, 1))
    alias = torch.Tensor._make_subclass(torch.Tensor, h)  # (outside any mode: no __torch_function__ either way)
    assert memory.rows(alias).key == P.Rows(0, 1).key
    assert memory.rows(alias[:, 2:5]).dim == 0  # each row inside one example's row
    assert memory.rows(alias.t()).dim == 1
    assert not memory.rows(alias.view(8, 6)).known  # rows that straddle two examples'
    assert memory.rows(torch.zeros(6, 8)) is None  # other memory
    constant = torch.zeros(6, 8)
    memory.holds(constant[:, :4], P.Rows(0, 1))  # a view is not recorded: its base's record covers it, or a constant
    assert memory.rows(constant) is None
    memory.holds(constant[:, :4], P.Rows(0, 1), views=True)  # the loader's batch, a view or not
    assert memory.rows(constant.detach()[:, :4]).dim == 0
    memory.holds(h, P.Rows(None, 1, "retagged"))  # the same span tagged again: the latest record answers
    assert not memory.rows(alias).known


def test_a_tagged_memory_record_lasts_as_long_as_its_memory_not_its_tensor():
    memory = M.TaggedMemory(P.Rows(None, 1, "alias"))
    h = torch.randn(4, 3)
    memory.holds(h, P.Rows(0, 1))
    alias = h.detach().as_subclass(torch.Tensor)
    del h  # the tagged tensor dies; its memory lives in the alias
    assert memory.rows(alias).dim == 0
    key = M.storage_key(alias)
    del alias
    assert all(alive() is None for _, _, alive in memory._by_storage[key])  # freed: never answered again
