"""The released model holds only what the noisy step wrote: un-noised writes to it are refused.

DP-SGD's guarantee (Abadi et al. 2016; Boenisch et al. 2023, Alg. 3 line 9) covers the model as a
post-processing of the noisy updates θ_{t+1} = θ_t − η·(Σ_i clip_{c_i}(g_i) + N(0, σ²c²I))/Σ_i q_i:
every value of the released ``state_dict`` must be a function of those updates and of public
values.  A forward pass that writes a parameter or a *persistent* buffer (one in ``state_dict``)
from the batch releases that write without noise, outside the accounting (issue 29: with
``nn.Embedding(max_norm=1)`` and the target the only holder of token 7, ‖row 7‖ is 1.00 with it
and 4.05 without, at a reported ε of 0.45).  The per-example norm passes (:mod:`.norms`: individual
accounting, the individual filter, per-instance bounds) run the forward over *every* example,
those with q_i = 0 and ε = 0 included, so a write there leaks even examples that never train.

Refused, in every ``grad_sample_mode`` and in the norm passes:

* **statically** (:func:`check_static_writes`, at ``make_private`` and at the entry of every norm
  pass): ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``max_norm`` — PyTorch renormalises the
  looked-up rows of the weight in place during the forward;
* **dynamically** (:class:`WriteGuard`): any parameter (trainable or frozen), buffer (persistent or
  not) or module extra state (``get_extra_state()``, released in ``state_dict`` as ``_extra_state``)
  of the model that changes between the first call of the model after a step (or after
  ``make_private``) and the next step's noise — an in-place write under ``torch.no_grad()``, a
  running statistic updated in forward (``self.count += 1``, ``self.mean = 0.9 * self.mean + …``), a
  write through ``.data`` — and any that changes during a norm pass.  The step is then not taken
  (no noise drawn, nothing charged; :class:`UnnoisedWriteError` names the parameter or buffer and
  its module), and the model is marked: it holds the write, so every later step or norm pass on it
  is refused too (train a fresh model without the write).

Non-persistent buffers are not released, but a forward that writes one from the batch and reads it
in a later step (a running mean of the inputs used to normalise them) makes every later example's
gradient a function of earlier examples: example j's influence on a later step is then bounded by
the sum of that step's clip norms, not by c_j, and the accountant charges j only for the steps
that sampled it (Abadi et al. 2016's analysis assumes each step depends on the data only through
its own batch and the previous noisy model).  The guard cannot tell whether a written buffer is
read later, so writes to any buffer are refused.

Allowed: writes *between* steps — ``load_state_dict``, ``engine.load_checkpoint``, a projection
after ``optimizer.step()`` — which do not go through the model's forward on the batch: the snapshot
is taken at the model's first call after each step (before the model's own forward pre-hooks), after
such writes.  (A loop that never calls the model's root module — only its submodules — is compared
against the state right after the step, without the value fingerprint: writes between steps are
then refused too, and ``.data`` writes are not seen; so is a step whose first call of the model runs
on tensors swapped in for it — ``torch.func.functional_call``, as per-sample gradients computed by
the user for ``grad_sample_mode="no_op"`` do.)  BatchNorm stays refused by Opacus's
validator.

How (cheap, no copy of the parameters): per tensor, its version counter (``t._version``, bumped by
every in-place operation on it or on a view or ``detach()`` of it, under ``no_grad`` too), its
identity (a rebinding ``self.buf = self.buf + 1``), its storage address (``p.data = …``) and its
name set (a tensor registered during the forward); and a value fingerprint for writes through
``p.data``, which has its own version counter that ``p`` does not see: the exact integer sum of each
tensor's bit patterns (one read per tensor; integer addition, so it is exact and independent of the
reduction order on every device).  Any change of one entry changes it, however small (a Euclidean
norm in float32 misses a change below its rounding: 1e-3 in one entry of a 50,000 × 64 table); it
misses only changes whose bit-pattern differences cancel exactly, e.g. a permutation of entries or
the sign flips of one positive and one negative entry.  Extra state is compared by a digest of its
serialisation (``torch.save``), for the modules that define ``get_extra_state``.
Cost per logical step: two reads of the parameters and buffers (at the first forward and before
the noise; the optimizer's update alone reads and writes them several times), one device
synchronisation, and a Python walk over the model's modules; per norm-pass batch one read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils._expanded_weights.expanded_weights_impl import ExpandedWeight

from ..validation import InvalidParameterError

#: integer type of the same width, to read a tensor's bit patterns (8-byte types as pairs of int32)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


class UnnoisedWriteError(RuntimeError):
    """A parameter, buffer or extra state of the model changed outside the optimizer's noisy
    step (during a training step's forward/backward pass, or during a per-example norm pass)."""


def check_static_writes(module: nn.Module) -> None:
    """Refuse layers whose forward writes the released model in place, whatever the data:
    ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``max_norm`` (the looked-up rows are renormalised in
    place, so the released table shows which tokens the batch held)."""
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise InvalidParameterError(
                "module",
                f"{name or '(root)'}: {type(m).__name__}(max_norm={m.max_norm:g})",
                "max_norm renormalises the looked-up rows of the weight in place during the forward, an "
                "un-noised write to the released model that depends on the batch (it shows which tokens were "
                "seen); refused in every grad_sample_mode and in the per-example norm passes. Leave max_norm "
                "out (DP-SGD's clipping already bounds each example's update)",
            )


def released_tensors(module: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Name → (kind, tensor) of the model's state that the forward must not write: every parameter
    (trainable or frozen) and every buffer — persistent ones are released by ``state_dict()``,
    non-persistent ones carry the batch into later steps (module docstring)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for prefix, m in module.named_modules(remove_duplicate=True):
        dot = f"{prefix}." if prefix else ""
        for n, p in m._parameters.items():
            if p is not None:  # inside grad_sample_mode="ew"'s forward a parameter is an ExpandedWeight around it
                out[dot + n] = ("parameter", p.orig_weight if isinstance(p, ExpandedWeight) else p)
        for n, b in m._buffers.items():
            if b is not None:
                out[dot + n] = (
                    "non-persistent buffer" if n in m._non_persistent_buffers_set else "persistent buffer",
                    b,
                )
    return out


def _extra_states(module: nn.Module) -> dict[str, bytes]:
    """Name → digest of ``get_extra_state()`` for the modules that define it (``state_dict`` releases
    it as ``<module>._extra_state``)."""
    out = {}
    for prefix, m in module.named_modules(remove_duplicate=True):
        if type(m).get_extra_state is nn.Module.get_extra_state:
            continue
        name = f"{prefix}._extra_state" if prefix else "_extra_state"
        buffer = io.BytesIO()
        try:
            torch.save(m.get_extra_state(), buffer)
        except Exception as e:
            raise InvalidParameterError(
                "module",
                f"{prefix or '(root)'}: {type(m).__name__}.get_extra_state()",
                f"cannot be serialised to check that the forward leaves it unchanged ({type(e).__name__}: {e}); "
                "state_dict releases it",
            ) from e
        out[name] = hashlib.sha256(buffer.getvalue()).digest()
    return out


def _fingerprintable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_meta and not t.is_quantized and t.numel() > 0


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The exact sum of the tensor's bit patterns read as integers (int64, no overflow below 2³²
    entries): changed by any change of one entry."""
    t = t.detach()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    bits = _BITS[flat.element_size()]
    return (flat if flat.dtype == bits else flat.view(bits)).sum(dtype=torch.int64)


def _fingerprint(tensors: list[torch.Tensor]) -> dict:
    """device → (indices, the tensors' bit-pattern sums): one read per tensor, compared exactly."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        if _fingerprintable(t):
            groups.setdefault(t.device, []).append(i)
    with torch.no_grad():
        return {device: (idx, torch.stack([_bit_sum(tensors[i]) for i in idx])) for device, idx in groups.items()}


@dataclass
class _Snapshot:
    """What the released tensors were at one moment (references, version counters, storage
    addresses, and optionally the value fingerprint)."""

    names: dict  # name -> (kind, index into tensors)
    tensors: list
    versions: list
    pointers: list
    fingerprint: dict | None
    extra: dict  # name -> digest of a module's extra state

    @classmethod
    def take(cls, module: nn.Module, fingerprint: bool) -> _Snapshot:
        names, tensors, index = {}, [], {}
        for name, (kind, t) in released_tensors(module).items():
            if id(t) not in index:
                index[id(t)] = len(tensors)
                tensors.append(t)
            names[name] = (kind, index[id(t)])
        return cls(
            names,
            tensors,
            [t._version for t in tensors],
            [_pointer(t) for t in tensors],
            _fingerprint(tensors) if fingerprint else None,
            _extra_states(module),
        )

    def rebound(self, module: nn.Module) -> bool:
        """Whether a released tensor of the snapshot is now another tensor object (swapped in)."""
        now = released_tensors(module)
        return any(name in now and now[name][1] is not self.tensors[i] for name, (_, i) in self.names.items())

    def changes(self, module: nn.Module) -> list[str]:
        """What changed since the snapshot, one phrase per parameter or buffer (empty: nothing)."""
        now = released_tensors(module)
        out = [
            f"{kind} {name!r}{_owner(module, name)} was removed"
            for name, (kind, _) in self.names.items()
            if name not in now
        ]
        out += [
            f"{kind} {name!r}{_owner(module, name)} appeared (registered during the pass)"
            for name, (kind, _) in now.items()
            if name not in self.names
        ]
        written = set()
        for name, (kind, i) in self.names.items():
            if name not in now:
                continue
            t = now[name][1]
            old = self.tensors[i]
            if t is not old:
                out.append(
                    f"{kind} {name!r}{_owner(module, name)} was replaced by another tensor (e.g. "
                    "self.buf = self.buf + ...)"
                )
            elif t._version != self.versions[i]:
                written.add(i)
                out.append(
                    f"{kind} {name!r}{_owner(module, name)} was written in place (e.g. Embedding(max_norm), "
                    "a no_grad in-place update, buf += ...)"
                )
            elif _pointer(t) != self.pointers[i]:
                written.add(i)
                out.append(f"{kind} {name!r}{_owner(module, name)} had its storage replaced (t.data = ...)")
        extra = _extra_states(module)
        out += [
            f"extra state {name!r}{_owner(module, name)} (get_extra_state(), in state_dict) changed"
            for name in sorted(set(extra) | set(self.extra))
            if extra.get(name) != self.extra.get(name)
        ]
        if self.fingerprint is not None and not out:
            now_fp = _fingerprint(self.tensors)
            by_index = {i: name for name, (_, i) in reversed(list(self.names.items()))}
            for key, (idx, before) in self.fingerprint.items():
                after = now_fp.get(key)
                if after is None or after[0] != idx:
                    continue
                same = before == after[1]
                if bool(same.all()):
                    continue
                for j in torch.nonzero(~same).flatten().tolist():
                    name = by_index[idx[j]]
                    out.append(
                        f"{self.names[name][0]} {name!r}{_owner(module, name)} had its values changed "
                        "through .data (a write autograd does not see)"
                    )
        return out


def _pointer(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() if t.layout == torch.strided else 0
    except (RuntimeError, NotImplementedError):
        return 0


def _owner(module: nn.Module, name: str) -> str:
    path = name.rpartition(".")[0]
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        return ""
    return f" (module {path or '(root)'!r}, {type(sub).__name__})"


class _SnapshotHook:
    """The forward pre-hook on the model's root module (a copied or pickled model gets an inert one)."""

    def __init__(self, guard: WriteGuard):
        self.guard = guard

    def __call__(self, _module, _args):
        self.guard._first_forward()

    def __deepcopy__(self, memo):
        return _InertHook()

    def __reduce__(self):
        return _InertHook, ()


class _InertHook:
    def __call__(self, _module, _args):
        return None


class WriteGuard:
    """Watches one model's released tensors (one guard per model, shared by the training steps and
    the norm passes; :meth:`attach`).

    Training: :meth:`arm` after ``make_private`` and after every step; the model's first call after
    that takes the snapshot; :meth:`check` before the noise compares.  Norm passes: :meth:`watch`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.tainted: str | None = None  # the first write found: the model holds it
        self._state: _Snapshot | None = None
        self._armed = False
        self._suspended = 0
        # first of the model's forward pre-hooks: a user's hook that writes the model runs after the snapshot
        self._handle = model.register_forward_pre_hook(_SnapshotHook(self), prepend=True)

    @classmethod
    def attach(cls, model: nn.Module) -> WriteGuard:
        """The model's guard, created on first use (a plain attribute, not a submodule)."""
        guard = model.__dict__.get("_idpsgd_write_guard")
        if guard is None:
            guard = cls(model)
            object.__setattr__(model, "_idpsgd_write_guard", guard)
        return guard

    def __deepcopy__(self, memo):  # a copied (or pickled) model gets its own guard when it needs one
        return None

    def __reduce__(self):
        return type(None), ()

    def detach(self) -> None:
        self._handle.remove()
        if self.model.__dict__.get("_idpsgd_write_guard") is self:
            del self.model.__dict__["_idpsgd_write_guard"]

    # --- training steps ------------------------------------------------------------------------
    def arm(self) -> None:
        """A step ended (or training is set up): the next call of the model starts the next step."""
        self._state = _Snapshot.take(self.model, fingerprint=False)
        self._armed = True

    def _first_forward(self) -> None:
        if self._armed and not self._suspended:
            if self._state is not None and self._state.rebound(self.model):
                # the call runs on tensors swapped in for it (torch.func.functional_call, e.g. per-sample
                # gradients for grad_sample_mode="no_op"): the state taken at the step's end stays the
                # reference (without the value fingerprint, as for a loop that never calls the root module)
                self._armed = False
                return
            self._state = _Snapshot.take(self.model, fingerprint=True)
            self._armed = False

    def check(self, where: str = "the training step") -> None:
        """Raise :class:`UnnoisedWriteError` if a released tensor changed since the snapshot (or the
        model already holds such a write)."""
        self._refuse_if_tainted()
        if self._state is not None:
            self._compare(self._state, where, "The step was not taken: no noise was drawn and nothing was charged.")

    # --- norm passes ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, where: str = "a per-example gradient norm pass"):
        """Snapshot now; yields a function that raises if anything changed since (call it after each
        batch).  The training snapshot is left alone meanwhile."""
        self._refuse_if_tainted()
        state = _Snapshot.take(self.model, fingerprint=True)
        self._suspended += 1
        try:
            yield lambda: self._compare(state, where, "The norm pass was stopped.")
        finally:
            self._suspended -= 1

    # --- the refusal ---------------------------------------------------------------------------
    def _compare(self, state: _Snapshot, where: str, outcome: str) -> None:
        changes = state.changes(self.model)
        if not changes:
            return
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        self.tainted = (
            f"un-noised write to the released model during {where}: {shown}. The model's state_dict is released, "
            "and a write made by the forward or backward pass depends on the batch: it would be released without "
            "noise and outside the privacy accounting (a buffer the forward writes and a later step reads, persistent "
            "or not, makes later examples' gradients depend on this batch beyond their clip norms). Remove the write "
            "(leave out Embedding(max_norm); update no parameter, buffer or extra state in forward: no running "
            "statistics of the data); writes between steps (load_state_dict, a projection after optimizer.step()) "
            "are allowed. This model "
            "now holds the write and must not be released: further steps and norm passes on it are refused; "
            "train a fresh model"
        )
        raise UnnoisedWriteError(f"{self.tainted}. {outcome}")

    def _refuse_if_tainted(self) -> None:
        if self.tainted is not None:
            raise UnnoisedWriteError(f"refused: earlier, {self.tainted}")


def trainable_names(module: nn.Module) -> dict[int, str]:
    """id → name of the module's parameters that require gradients now."""
    return {id(p): n for n, p in module.named_parameters() if p.requires_grad}


def check_no_new_trainable(module: nn.Module, planned: dict[int, str], grad_sample_mode: str) -> None:
    """Refuse parameters that became trainable after ``make_private`` set up the per-example
    clipping: Opacus's ghost clipping would leave them out of the per-example norm (their clipped
    sum unbounded), book-keeping would give them noise only, hooks mode has no per-sample gradient
    for them.  (Freezing a parameter later is harmless: it leaves the optimizer's step.)"""
    new = [n for i, n in trainable_names(module).items() if i not in planned]
    if new:
        raise RuntimeError(
            f"parameter(s) {', '.join(repr(n) for n in new[:5])}{' ...' if len(new) > 5 else ''} became trainable "
            f"(requires_grad=True) after make_private set up the per-example clipping (grad_sample_mode="
            f"{grad_sample_mode!r}) without them: their gradients would not be clipped per example. Call "
            "make_private again after changing requires_grad. The step was not taken: no noise was drawn and "
            "nothing was charged"
        )


__all__ = [
    "UnnoisedWriteError",
    "WriteGuard",
    "check_no_new_trainable",
    "check_static_writes",
    "released_tensors",
    "trainable_names",
]
