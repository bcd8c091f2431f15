"""Per-example RDP ledger: an (examples × orders) array composed step by step.

RDP composes additively (Mironov 2017, Prop. 1), so each example's guarantee after any sequence
of steps — with its own sampling rate and effective noise multiplier at each step — is the row
sum of per-step RDP.  This one structure serves assigned guarantees, output-specific accounting
(Yu et al. 2023, Alg. 2), privacy filters and reports.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import write_npz
from ..validation import check_orders
from .conversion import rdp_to_epsilon
from .orders import chord_refined_epsilon
from .rdp import DEFAULT_ORDERS, compute_rdp


class RdpLedger:
    """Accumulated RDP for ``num_examples`` examples at a fixed vector of orders."""

    def __init__(self, num_examples: int, orders=DEFAULT_ORDERS):
        if int(num_examples) < 0:
            raise ValueError(f"num_examples={num_examples!r} is invalid: must be >= 0")
        self.orders = check_orders(orders)
        self.rdp = np.zeros((int(num_examples), self.orders.size))
        self.steps = 0

    @property
    def num_examples(self) -> int:
        return self.rdp.shape[0]

    def add(self, rdp, indices=None, counts=None) -> None:
        """Add per-step RDP to the selected rows.

        Args:
            rdp: shape ``(orders,)`` (same for every selected row) or ``(rows, orders)``.
            indices: rows to update (default: all). Repeated indices accumulate.
            counts: how many times each row's step is composed (scalar or per row).
        """
        rdp = np.asarray(rdp, dtype=float)
        if rdp.shape[-1] != self.orders.size:
            raise ValueError(f"rdp has {rdp.shape[-1]} orders, the ledger has {self.orders.size}")
        if np.any(rdp < 0) or np.any(np.isnan(rdp)):
            raise ValueError("per-step RDP must be >= 0 (and not NaN)")
        if counts is not None:
            counts = np.asarray(counts, dtype=float)
            if np.any(counts < 0):
                raise ValueError("counts must be >= 0")
            rdp = rdp * (counts[..., None] if counts.ndim else counts)
        if indices is None:
            self.rdp += rdp
        else:
            idx = np.asarray(indices, dtype=np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= self.num_examples):
                raise IndexError(f"indices must lie in [0, {self.num_examples})")
            np.add.at(self.rdp, idx, np.broadcast_to(rdp, (idx.size, self.orders.size)))

    def add_block(self, rows: slice, rdp: np.ndarray) -> None:
        """Add ``rdp`` (rows × orders) to the contiguous rows ``rows`` in place, without :meth:`add`'s checks:
        the block path of an accountant that computes the RDP itself, from threads that fill disjoint blocks
        (:class:`~idpsgd.accounting.output_specific.IndividualAccountant`)."""
        self.rdp[rows] += rdp

    def count_steps(self, n: int = 1) -> None:
        """``n`` more steps composed into the rows (their RDP added by :meth:`add`, or in blocks by the caller)."""
        if int(n) < 0:
            raise ValueError(f"n={n!r} is invalid: a step count only grows (n >= 0)")
        self.steps += int(n)

    def add_step(self, sample_rate, noise_multiplier, indices=None, counts=None) -> None:
        """Add one SGM step with per-row (or shared) q and effective σ (distinct pairs deduplicated)."""
        self.add(compute_rdp(sample_rate, noise_multiplier, self.orders), indices, counts)
        self.steps += 1

    def epsilon(self, delta: float, refine: bool = True):
        """(ε, order) per example for a δ, by the improved RDP conversion.

        ``refine`` (default) also converts between the grid orders through the chord bound of the
        convex (α − 1)·r(α) (:func:`~idpsgd.accounting.orders.chord_refined_epsilon`): a valid
        bound, never above the grid's; ``refine=False`` gives the grid's (ε, best grid order).
        """
        if refine and np.all(np.diff(self.orders) > 0):
            return chord_refined_epsilon(self.rdp, self.orders, delta)
        return rdp_to_epsilon(self.rdp, self.orders, delta)

    def state_dict(self) -> dict:
        return {"rdp": self.rdp.copy(), "orders": self.orders.copy(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        rdp, orders = np.asarray(state["rdp"], float), np.asarray(state["orders"], float)
        if rdp.ndim != 2 or rdp.shape[1] != orders.size:
            raise ValueError(f"ledger state has rdp {rdp.shape} for {orders.size} orders")
        self.orders, self.rdp, self.steps = orders, rdp.copy(), int(state.get("steps", 0))

    def save(self, path) -> Path:
        """Write the ledger as npz (atomic; mode 0600 — per-example privacy data is personal)."""
        return write_npz(path, private=True, rdp=self.rdp, orders=self.orders, steps=np.asarray(self.steps))

    @classmethod
    def load(cls, path) -> RdpLedger:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ledger file not found: {path}")
        with np.load(path, allow_pickle=False) as data:  # arrays only: an object array (a pickle) is refused
            ledger = cls(data["rdp"].shape[0], data["orders"])
            ledger.load_state_dict({k: data[k] for k in data.files})
        return ledger
