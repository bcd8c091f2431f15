"""The record behind individual accounting's charged sensitivities: what training clipped against
what each example was charged (Yu et al. 2023, Thm. 3.3 and Alg. 3).

Thm. 3.3 makes the composed charge Z_i,t a guarantee when it bounds the clipped gradient training
adds for example i; :class:`SensitivityCheck` compares, at every step and for every sampled
example, the training norm ‖g_i‖ and clip norm c_i (:attr:`~..clipping.examples.PerExampleClipping.last_norms`)
with the charge and with the norm pass's norm: how many exceeded and mismatched, the largest
ratios, the steps seen and the active dropout modules.  Private statistics only: the public
``kind`` never depends on them (:mod:`.individual`).  With DPDDP the ranks' records are reduced
every step.  The fields in full: docs/individual-accounting.md.
"""

from __future__ import annotations

import numpy as np
import torch

#: Relative float tolerance of the comparisons: the same norm computed by the training step and by
#: the norm pass (other batch composition, ghost norms vs per-sample gradients, float32) differs by
#: far less: measured ≤ 5e-7 relative in every grad_sample_mode on MLPs, a CNN and a token-sequence
#: model, 3.5e-6 on the Quick start's model with label smoothing and momentum (measured for issue 29).
RTOL = 1e-4
#: Absolute tolerance, as a fraction of the largest clip norm: float32 gradients of a nearly
#: saturated loss (p ≈ target) lose ~1e-7 absolute per logit, so small norms carry an absolute
#: error of order 1e-7..1e-6 · c (measured: 2.8e-7 at c = 1 on the Quick start's model).
ATOL = 1e-5


def dropout_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every dropout module (``nn.Dropout*``, ``AlphaDropout``, ...) with p > 0."""
    from torch.nn.modules.dropout import _DropoutNd

    return [
        (name or type(m).__name__, m)
        for name, m in module.named_modules()
        if isinstance(m, _DropoutNd) and float(m.p) > 0
    ]


def active_dropout(modules) -> list[str]:
    """Names of the :func:`dropout_modules` in training mode (they draw random masks)."""
    return [name for name, m in modules if m.training]


class SensitivityCheck:
    """Charged sensitivities vs the clipped norms of each step's sampled examples (see the module doc).

    Args:
        clip_norm_max: the largest clip norm (scale of the absolute tolerance).
    """

    FIELDS = ("steps", "examples", "exceeded", "compared", "mismatched")
    MAXIMA = ("max_ratio", "max_relative_mismatch")

    def __init__(self, clip_norm_max: float):
        self.atol = ATOL * float(clip_norm_max)
        self.floor = self.atol / RTOL  # relative differences are taken against max(norm, floor)
        self.counts = dict.fromkeys(self.FIELDS, 0)
        self.maxima = dict.fromkeys(self.MAXIMA, 0.0)
        self.dropout: list[str] = []  # dropout modules seen active at some step (public: architecture)

    def observe(self, norms, indices, clip_norms, charged, pass_norms=None) -> None:
        """One logical step: ``norms`` the sampled examples' pre-clip gradient norms in training,
        ``indices`` their dataset indices, ``clip_norms``/``charged`` (all examples) the examples'
        own clip norms c_i (not the enforced charges) and the sensitivities the step is charged at;
        ``pass_norms`` (all examples) the norm pass's raw norms at the same parameters, or None when
        the step's norms were not refreshed at them."""
        step = dict.fromkeys(self.FIELDS, 0)
        step["steps"] = 1
        top = dict.fromkeys(self.MAXIMA, 0.0)
        if norms is not None and len(norms):
            raw = _numpy(norms)
            idx = _numpy(indices).astype(np.int64)
            clip, z = _take(clip_norms, idx), _take(charged, idx)
            clipped = raw * np.minimum(1.0, clip / (raw + 1e-6))  # Opacus's factor at the clip norm c_i
            over = clipped > z * (1 + RTOL) + self.atol
            step["examples"], step["exceeded"] = int(raw.size), int(over.sum())
            top["max_ratio"] = float(np.max(clipped / np.maximum(z, self.atol)))
            if pass_norms is not None:
                ref = _take(pass_norms, idx)
                diff = np.abs(raw - ref)
                scale = np.maximum(raw, ref)
                step["compared"] = int(raw.size)
                step["mismatched"] = int(np.sum(diff > RTOL * scale + self.atol))
                top["max_relative_mismatch"] = float(np.max(diff / np.maximum(scale, self.floor)))
        step, top = _reduce(step, top)
        for k in self.FIELDS:
            self.counts[k] += step[k]
        for k in self.MAXIMA:
            self.maxima[k] = max(self.maxima[k], top[k])

    def note_dropout(self, names) -> None:
        for name in names:
            if name not in self.dropout:
                self.dropout.append(name)

    def summary(self) -> dict:
        """The record (private statistics of the run's gradient norms, except ``steps`` and
        ``dropout``)."""
        return {**self.counts, **self.maxima, "dropout": list(self.dropout), "rtol": RTOL, "atol": self.atol}

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "maxima": dict(self.maxima), "dropout": list(self.dropout)}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore a record; ``None`` (a checkpoint of a version without the check) leaves the counts
        at 0."""
        if not state:
            return
        self.counts.update({k: int(state["counts"].get(k, 0)) for k in self.FIELDS})
        self.maxima.update({k: float(state["maxima"].get(k, 0.0)) for k in self.MAXIMA})
        self.dropout = [str(s) for s in state.get("dropout", [])]


def _numpy(t) -> np.ndarray:
    if torch.is_tensor(t):
        return t.detach().to("cpu", torch.float64).numpy().ravel()
    return np.asarray(t, dtype=np.float64).ravel()


def _take(values, idx: np.ndarray) -> np.ndarray:
    """``values[idx]`` as float64 numpy (a tensor is indexed before it is copied)."""
    if torch.is_tensor(values):
        return _numpy(values.detach().cpu()[torch.from_numpy(idx)])
    return np.asarray(values, dtype=np.float64)[idx]


def _reduce(counts: dict, maxima: dict) -> tuple[dict, dict]:
    """Counts summed and maxima taken over the ranks (identity without a process group); the step
    count stays 1 (every rank takes the same logical step)."""
    from ..distributed import is_distributed

    if not is_distributed():
        return counts, maxima
    import torch.distributed as dist

    from ..distributed import comm_device

    keys = [k for k in counts if k != "steps"]
    dev = comm_device()
    s = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64, device=dev)
    m = torch.tensor([float(maxima[k]) for k in maxima], dtype=torch.float64, device=dev)
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out = {"steps": counts["steps"], **{k: round(v) for k, v in zip(keys, s.cpu().tolist(), strict=True)}}
    return out, dict(zip(maxima, m.cpu().tolist(), strict=True))
