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
writes the staging rows, the only pass over the data) and reduced by one ``torch.mv`` per chunk.  A chunk
is 2 MiB on a CPU and 32 MiB on an accelerator (both stay in cache; about 90 chunks for a GPT-2-small
model with Adam's state, where the chunks of 2 MiB per large tensor used before launched about 3,000
kernels); the block sums (8 bytes per 1024 entries) are kept.

What it misses: in one block, a change Δ with Σ_k u_k·Δ_k = 0 exactly — never a change of one entry
(a one-ulp write included: u_k·Δ_k ≠ 0), a swap of two entries (the u are distinct) nor the sign flips of
one or two entries (±2³¹·u_k), but possibly changes of three or more entries of one block by a few units
in the last place that cancel for these random u.  Blocks are compared one by one (no cross-block
cancellation, which the weighted sum over blocks used before allowed with probability about 2⁻³²).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

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


def block_sums(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(the block sums of the tensors, all on one device, in order: float64 [Σ blocks]; each tensor's first
    block).  One read of each tensor (module docstring)."""
    device = tensors[0].device
    inner = _inner(device)
    rows = _ROWS.get(device.type, _ACCELERATOR_ROWS)
    bits = [_bits(t) for t in tensors]
    starts, total = [], 0
    for b in bits:
        starts.append(total)
        total += -(-b.numel() // _BLOCK)  # (a chunk holds whole blocks: a tensor's blocks never straddle two)
    sums = torch.empty(total, dtype=torch.float64, device=device)
    stage = torch.empty(min(rows, total) * _BLOCK, dtype=torch.float64, device=device)
    zeros = torch.zeros(_BLOCK, dtype=torch.int8, device=device)
    pieces, filled, done = [], 0, 0  # pieces of the chunk being filled; its entries; the blocks reduced

    def reduce():
        nonlocal pieces, filled, done
        n = filled // _BLOCK
        chunk = stage[:filled]
        torch.cat(pieces, out=chunk) if len(pieces) > 1 else chunk.copy_(pieces[0])
        torch.mv(chunk.view(n, _BLOCK), inner, out=sums[done : done + n])
        pieces, filled, done = [], 0, done + n

    capacity = stage.numel()
    for b in bits:
        n = b.numel()
        pad = -n % _BLOCK
        if filled + n + pad <= capacity:  # the whole tensor fits in the chunk being filled (most of them)
            pieces.append(b)
            if pad:
                pieces.append(zeros[:pad])
            filled += n + pad
            if filled == capacity:
                reduce()
            continue
        at = 0
        while at < n:
            take = min(n - at, capacity - filled)
            pieces.append(b[at : at + take])
            at, filled = at + take, filled + take
            if filled == capacity:
                reduce()
        if pad:
            pieces.append(zeros[:pad])
            filled += pad
            if filled == capacity:
                reduce()
    if pieces:
        reduce()
    return sums, starts


@dataclass
class Fingerprint:
    """The block sums of each device's fingerprintable tensors: device → (indices into the tensor list,
    block sums, each indexed tensor's first block)."""

    groups: dict

    @classmethod
    def take(cls, tensors: list[torch.Tensor]) -> Fingerprint:
        by_device: dict = {}
        for i, t in enumerate(tensors):
            if fingerprintable(t):
                by_device.setdefault(t.device, []).append(i)
        with torch.no_grad():
            return cls({d: (idx, *block_sums([tensors[i] for i in idx])) for d, idx in by_device.items()})

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
