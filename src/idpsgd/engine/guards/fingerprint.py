"""The write guard's value fingerprint: exact, position-weighted sums of a tensor list's bit patterns,
one read of each tensor per fingerprint, on the tensors' device (:mod:`.integrity` takes one at the step's
first forward and compares one before the noise).

Each tensor's entries, read as signed integers of their width (8-byte types as pairs of int32, bool as
int8), are cut into blocks of 1024, the last one padded with zeros; a block's sum is Σ_k u_k·b_k with
u distinct integers in [1, 4095] drawn once per process from OS entropy (model code cannot aim a change
at a collision).  |Σ| ≤ 2³¹·2¹²·2¹⁰ = 2⁵³, so every partial sum is an integer that float64 holds exactly:
the sums are exact and the same in any reduction order, on every device, and two fingerprints are
compared block by block with ``torch.equal``.

How one fingerprint reads the tensors: the blocks of every tensor on a device are packed, in order, into
chunks of a float64 staging buffer by one ``torch.cat(..., out=)`` per chunk (it reads the pieces and
writes the staging rows, the only pass over the data) and reduced by one ``torch.mv`` per chunk.  On a CPU,
a chunk of several pieces (tensors smaller than a chunk, their zero padding) is first packed by a ``cat``
into an int32 staging buffer (the pieces widened exactly) and then converted by one copy, in cache: a ``cat``
that converts takes a slow path per piece, about 2 µs each, where a ``cat`` of one dtype takes 0.2 µs
(issue 50; GPT-2's 12 blocks at width 64, one fingerprint: 1.18 → 0.92 ms with SGD, 4.2 → 2.9 ms with
Adam's state; at width 768, where a chunk is mostly one slice of a large tensor, the same).  A chunk
is 2 MiB on a CPU and 32 MiB on an accelerator (both stay in cache; about 90 chunks for a GPT-2-small
model with Adam's state, where the chunks of 2 MiB per large tensor used before launched about 3,000
kernels); the block sums (8 bytes per 1024 entries) are kept.  The packing (each tensor's bit view, the
pieces of each chunk) is built once and reused by the next fingerprint of the same tensors while each tensor's
geometry — dtype, shape, strides, device, storage and offset — is unchanged (:class:`_Layout`): a fingerprint's
Python work is then one geometry read per tensor, its data work the same single pass.

What it misses: in one block, a change Δ with Σ_k u_k·Δ_k = 0 exactly — never a change of one entry
(a one-ulp write included: u_k·Δ_k ≠ 0), a swap of two entries (the u are distinct) nor the sign flips of
one or two entries (±2³¹·u_k), but possibly changes of three or more entries of one block by a few units
in the last place that cancel for these random u.  Blocks are compared one by one (no cross-block
cancellation, which the weighted sum over blocks used before allowed with probability about 2⁻³²).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import torch

#: integer type of the same width, to read a tensor's bit patterns (8-byte types as pairs of int32)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_BLOCK = 1024
#: staging rows (of _BLOCK float64) per chunk: 2 MiB on a CPU, 32 MiB on an accelerator (in an H100's L2 cache)
_ROWS = {"cpu": 256}
_ACCELERATOR_ROWS = 4096
_INNER: dict = {}  # device -> the in-block weights [_BLOCK] float64


def _inner(device: torch.device) -> torch.Tensor:
    """The in-block weights on ``device``: 1024 distinct integers in [1, 4095], drawn once per process."""
    have = _INNER.get(device)
    if have is None:
        cpu = _INNER.get(torch.device("cpu"))
        if cpu is None:
            rng = np.random.default_rng(secrets.randbits(128))
            cpu = _INNER[torch.device("cpu")] = torch.from_numpy(rng.choice(4095, _BLOCK, replace=False) + 1.0)
        have = _INNER[device] = cpu.to(device)
    return have


def fingerprintable(t: torch.Tensor) -> bool:
    """Whether the value fingerprint can read ``t`` (a strided, materialised, non-quantized tensor)."""
    return t.layout == torch.strided and not t.is_meta and not t.is_quantized and t.numel() > 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's entries as flat signed integers of their width (8-byte types as pairs of int32)."""
    t = t.detach()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    bits = _BITS[flat.element_size()]
    return flat if flat.dtype == bits else flat.view(bits)


def _geometry(t: torch.Tensor) -> tuple:
    """What a cached read of ``t`` depends on: its layout, device, dtype, shape, strides, storage (the C++ storage
    object's address) and offset in it.  Equal geometry means the cached bit view (:class:`_Layout`) is a view of
    the same storage at the same place, so it reads what ``t`` holds now: the view keeps that storage object alive,
    so no other storage object can have its address, and it follows the storage's memory wherever it moves
    (``resize_``)."""
    if t.layout != torch.strided:
        return (t.layout, t.device, t.dtype, t.shape)
    return (t.device, t.dtype, t.shape, t.stride(), t.untyped_storage()._cdata, t.storage_offset())


class _Layout:
    """How one list of tensors (all on one device) is read: each chunk's pieces (bit views of the tensors, zero
    padding), each tensor's first block, the staging buffer.  Built once and reused by later fingerprints of the
    same tensors while their geometry (:func:`_geometry`) is unchanged — the per-tensor Python work of a
    fingerprint (views, the chunk packing: 10–30 µs a tensor, about 450 tensors for GPT-2 small with Adam) is
    then one geometry read a tensor.  Not cached (``reusable`` False) when a tensor is not contiguous: its bits
    are a copy, not a view."""

    __slots__ = ("chunks", "device", "packed", "reusable", "stage", "starts", "total")

    def __init__(self, tensors: list[torch.Tensor]):
        device = self.device = tensors[0].device
        rows = _ROWS.get(device.type, _ACCELERATOR_ROWS)
        bits = [_bits(t) for t in tensors]
        self.reusable = all(t.is_contiguous() for t in tensors)
        starts, total = [], 0
        for b in bits:
            starts.append(total)
            total += -(-b.numel() // _BLOCK)  # (a chunk holds whole blocks: a tensor's blocks never straddle two)
        self.starts, self.total = starts, total
        self.stage = torch.empty(min(rows, total) * _BLOCK, dtype=torch.float64, device=device)
        # the int32 staging of a CPU chunk of several pieces (module docstring); the padding is int32 zeros there
        cpu = device.type == "cpu"
        self.packed = torch.empty(self.stage.numel(), dtype=torch.int32, device=device) if cpu else None
        zeros = torch.zeros(_BLOCK, dtype=torch.int8 if self.packed is None else torch.int32, device=device)
        capacity = self.stage.numel()
        self.chunks: list = []  # (pieces, entries) per chunk, in order
        pieces, filled = [], 0

        def full():
            nonlocal pieces, filled
            if filled == capacity:
                self.chunks.append((pieces, filled))
                pieces, filled = [], 0

        for b in bits:
            n = b.numel()
            pad = -n % _BLOCK
            if filled + n + pad <= capacity:  # the whole tensor fits in the chunk being filled (most of them)
                pieces.append(b)
                if pad:
                    pieces.append(zeros[:pad])
                filled += n + pad
                full()
                continue
            at = 0
            while at < n:
                take = min(n - at, capacity - filled)
                pieces.append(b[at : at + take])
                at, filled = at + take, filled + take
                full()
            if pad:
                pieces.append(zeros[:pad])
                filled += pad
                full()
        if pieces:
            self.chunks.append((pieces, filled))

    def read(self) -> torch.Tensor:
        """The block sums now: one ``torch.cat(..., out=)`` into the staging buffer and one ``torch.mv`` per chunk
        (the only pass over the data)."""
        inner = _inner(self.device)
        sums = torch.empty(self.total, dtype=torch.float64, device=self.device)
        done = 0
        for pieces, filled in self.chunks:
            n = filled // _BLOCK
            chunk = self.stage[:filled]
            if len(pieces) == 1:
                chunk.copy_(pieces[0])
            elif self.packed is None:
                torch.cat(pieces, out=chunk)
            else:  # the pieces packed at their width (widened to int32 exactly), then converted at once
                chunk.copy_(torch.cat(pieces, out=self.packed[:filled]))
            torch.mv(chunk.view(n, _BLOCK), inner, out=sums[done : done + n])
            done += n
        return sums


def block_sums(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(the block sums of the tensors, all on one device, in order: float64 [Σ blocks]; each tensor's first
    block).  One read of each tensor (module docstring)."""
    layout = _Layout(tensors)
    return layout.read(), layout.starts


@dataclass
class Fingerprint:
    """The block sums of each device's fingerprintable tensors: device → (indices into the tensor list,
    block sums, each indexed tensor's first block); ``layouts``: how they were read (device → :class:`_Layout`)
    and the tensors' geometry then, for the next fingerprint of the same list (:meth:`take`'s ``like``)."""

    groups: dict
    layouts: dict = field(default_factory=dict, repr=False)
    geometry: list | None = field(default=None, repr=False)

    @classmethod
    def take(cls, tensors: list[torch.Tensor], like: Fingerprint | None = None) -> Fingerprint:
        """The fingerprint of ``tensors`` now; ``like``: an earlier fingerprint of the same list, whose layouts
        are reused where every tensor's geometry is unchanged (else rebuilt)."""
        geometry = [_geometry(t) for t in tensors]
        with torch.no_grad():
            if like is not None and like.geometry == geometry and like.layouts:
                layouts = like.layouts
            else:
                by_device: dict = {}
                for i, t in enumerate(tensors):
                    if fingerprintable(t):
                        by_device.setdefault(t.device, []).append(i)
                layouts = {d: (idx, _Layout([tensors[i] for i in idx])) for d, idx in by_device.items()}
            groups = {d: (idx, layout.read(), layout.starts) for d, (idx, layout) in layouts.items()}
        reusable = all(layout.reusable for _, layout in layouts.values())
        return cls(groups, layouts if reusable else {}, geometry if reusable else None)

    def changed(self, now: Fingerprint) -> list[int]:
        """Indices of the tensors whose values differ between this fingerprint and ``now`` (of the same tensor
        list; one comparison per device)."""
        out: set[int] = set()
        for device, (idx, before, starts) in self.groups.items():
            after = now.groups.get(device)
            if after is None or after[0] != idx or after[1].shape != before.shape:
                continue  # the caller compares identities, versions and storages first
            if torch.equal(before, after[1]):
                continue
            blocks = torch.nonzero(before != after[1]).flatten().cpu()
            first = torch.as_tensor(starts, dtype=torch.int64)
            out.update(idx[j] for j in torch.searchsorted(first, blocks, right=True).sub_(1).unique().tolist())
        return sorted(out)


__all__ = ["Fingerprint", "block_sums", "fingerprintable"]
