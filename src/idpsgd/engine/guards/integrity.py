"""The released model holds only what the noisy step wrote: un-noised writes to it are refused.

DP-SGD's guarantee (Abadi et al. 2016; Boenisch et al. 2023, Alg. 3 line 9) covers the model as a
post-processing of the noisy updates: a forward pass that writes a parameter, buffer, extra state
or optimizer state from the batch releases that write without noise.  Refused in every
``grad_sample_mode`` and in the per-example norm passes (:mod:`..per_example.norms`): statically
(:func:`check_static_writes`: ``nn.Embedding(max_norm=...)``) and dynamically (:class:`WriteGuard`:
a change between the first call of the model's modules after a step and the next step's noise,
seen by version counters, identities, storage addresses and a value fingerprint); the step is not
taken (:class:`UnnoisedWriteError`) and the model is marked.  Writes between steps are allowed.
What is refused and why, how it is detected and what it costs: docs/guarantees.md.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils._expanded_weights.expanded_weights_impl import ExpandedWeight

from ...validation import InvalidParameterError
from .fingerprint import Fingerprint


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
    return _released_and_extra(module)[0]


def _released_and_extra(module: nn.Module) -> tuple[dict, list, list]:
    """(:func:`released_tensors`, the (name, module) pairs that define ``get_extra_state``, every module) in one
    walk over the modules (a snapshot needs all three: one walk instead of three, three snapshots a step)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    extra: list = []
    walked: list = []
    for prefix, m in module.named_modules(remove_duplicate=True):
        walked.append(m)
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            extra.append((prefix, m))
        dot = f"{prefix}." if prefix else ""
        for n, p in m._parameters.items():
            if p is not None:  # inside grad_sample_mode="ew"'s forward a parameter is an ExpandedWeight around it
                out[dot + n] = ("parameter", local_tensor(p.orig_weight if isinstance(p, ExpandedWeight) else p))
        for n, b in m._buffers.items():
            if b is not None:
                out[dot + n] = (
                    "non-persistent buffer" if n in m._non_persistent_buffers_set else "persistent buffer",
                    b,
                )
    return out, extra, walked


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (FSDP2's sharded parameters: each rank watches its shard;
    the tensor object itself, not a view), ``t`` otherwise.  (``DTensor.to_local()`` returns a fresh view
    of a parameter's local tensor at each call: its identity would change between snapshots.)"""
    if type(t).__name__ != "DTensor":
        return t
    return t._local_tensor


def per_model(model: nn.Module, key: str, factory):
    """The object stored on ``model`` under ``key`` (a plain attribute, not a submodule), made by
    ``factory(model)`` on first use: one write guard, one batch-independence check per model."""
    found = model.__dict__.get(key)
    if found is None:
        found = factory(model)
        object.__setattr__(model, key, found)
    return found


def extra_state_digests(module: nn.Module, modules: list | None = None) -> dict[str, bytes]:
    """Name → digest of ``get_extra_state()`` for the modules that define it (``state_dict`` releases
    it as ``<module>._extra_state``); ``modules``: those (name, module) pairs, already found."""
    out = {}
    if modules is None:
        modules = _released_and_extra(module)[1]
    for prefix, m in modules:
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


def _fingerprint(tensors: list[torch.Tensor], like: Fingerprint | None = None) -> Fingerprint:
    """The tensors' value fingerprint (:mod:`.fingerprint`): one read of each, on its device (``like``: an earlier
    fingerprint whose way of reading the tensors is reused while their geometry is unchanged)."""
    return Fingerprint.take(tensors, like=like)


def _optimizer_state(optimizer, parameter_names: dict[int, str]) -> dict:
    """(parameter name, key) → value of the optimizer's per-parameter state (``momentum_buffer``,
    Adam's ``exp_avg``, ``exp_avg_sq``, ``step``...), read without creating entries."""
    out: dict = {}
    if optimizer is None:
        return out
    state, seen = optimizer.state, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            entries = state.get(p)
            if entries:
                name = parameter_names.get(id(p), f"#{len(seen) - 1}")
                for key, value in entries.items():
                    out[(name, key)] = local_tensor(value) if torch.is_tensor(value) else value
    return out


def _what(module: nn.Module, name, kind: str, optimizer) -> str:
    """How a refusal names a watched entry: a parameter or buffer with its module, or an optimizer state."""
    if kind == "optimizer state":
        return f"optimizer state {name[1]!r} of parameter {name[0]!r} ({type(optimizer).__name__})"
    return f"{kind} {name!r}{_owner(module, name)}"


@dataclass
class _Snapshot:
    """What the released tensors were at one moment (references, version counters, storage
    addresses, and optionally the value fingerprint), and the optimizer's state."""

    names: dict  # name -> (kind, index into tensors); an optimizer state's name is (parameter name, key)
    tensors: list
    versions: list
    pointers: list
    fingerprint: Fingerprint | None
    extra: dict  # name -> digest of a module's extra state
    values: dict  # optimizer state that is not a tensor: (parameter name, key) -> a copy of the value
    modules: list  # every module of the model when it was taken (the trigger's watch list: WriteGuard.arm)

    @staticmethod
    def _read(module: nn.Module, optimizer) -> tuple[dict, dict, list, list]:
        """(released tensors, optimizer state) now: name -> (kind, tensor or value); the modules with extra
        state; every module (one walk)."""
        released, extra, walked = _released_and_extra(module)
        parameter_names: dict[int, str] = {}
        for name, (kind, t) in released.items():
            if kind == "parameter":
                parameter_names.setdefault(id(t), name)
        state = {k: ("optimizer state", v) for k, v in _optimizer_state(optimizer, parameter_names).items()}
        return released, state, extra, walked

    @classmethod
    def take(
        cls, module: nn.Module, fingerprint: bool, optimizer=None, like: Fingerprint | None = None, read=None
    ) -> _Snapshot:
        """The released tensors and the optimizer's state now; with ``fingerprint``, their values too (``like``:
        the guard's previous fingerprint, :func:`_fingerprint`); ``read``: what :meth:`_read` returned just now
        (the walk over the modules done once)."""
        names, tensors, index, values = {}, [], {}, {}
        released, state, extra, walked = cls._read(module, optimizer) if read is None else read
        for name, (kind, t) in [*released.items(), *state.items()]:
            if not torch.is_tensor(t):
                values[name] = copy.deepcopy(t)
                continue
            if id(t) not in index:
                index[id(t)] = len(tensors)
                tensors.append(t)
            names[name] = (kind, index[id(t)])
        return cls(
            names,
            tensors,
            [t._version for t in tensors],
            [_pointer(t) for t in tensors],
            _fingerprint(tensors, like) if fingerprint else None,
            extra_state_digests(module, extra),
            values,
            walked,
        )

    def rebound(self, now: dict) -> bool:
        """Whether a released tensor of the snapshot is now another tensor object (swapped in); ``now``: the
        released tensors now (:func:`released_tensors`)."""
        return any(
            kind != "optimizer state" and name in now and now[name][1] is not self.tensors[i]
            for name, (kind, i) in self.names.items()
        )

    def changes(self, module: nn.Module, optimizer=None) -> list[str]:
        """What changed since the snapshot, one phrase per parameter, buffer or optimizer state (empty:
        nothing)."""
        released, state, extra_modules, _ = self._read(module, optimizer)
        now = {**released, **state}
        before = {**{n: k for n, (k, _) in self.names.items()}, **dict.fromkeys(self.values, "optimizer state")}

        def what(name, kind):
            return _what(module, name, kind, optimizer)

        out = [f"{what(name, kind)} was removed" for name, kind in before.items() if name not in now]
        out += [
            f"{what(name, kind)} appeared (registered during the pass)"
            if kind != "optimizer state"
            else f"{what(name, kind)} appeared (written outside optimizer.step())"
            for name, (kind, _) in now.items()
            if name not in before
        ]
        for name, old in self.values.items():
            if name in now and not _same_value(old, now[name][1]):
                out.append(f"{what(name, 'optimizer state')} was changed outside optimizer.step()")
        for name, (kind, i) in self.names.items():
            if name not in now:
                continue
            t = now[name][1]
            old = self.tensors[i]
            if t is not old:
                out.append(f"{what(name, kind)} was replaced by another tensor (e.g. self.buf = self.buf + ...)")
            elif t._version != self.versions[i]:
                out.append(
                    f"{what(name, kind)} was written in place (e.g. Embedding(max_norm), a no_grad in-place "
                    "update, buf += ...)"
                )
            elif _pointer(t) != self.pointers[i]:
                out.append(f"{what(name, kind)} had its storage replaced (t.data = ...)")
        extra = extra_state_digests(module, extra_modules)
        out += [
            f"extra state {name!r}{_owner(module, name)} (get_extra_state(), in state_dict) changed"
            for name in sorted(set(extra) | set(self.extra))
            if extra.get(name) != self.extra.get(name)
        ]
        if self.fingerprint is not None and not out:
            by_index = {i: name for name, (_, i) in reversed(list(self.names.items()))}
            for j in self.fingerprint.changed(_fingerprint(self.tensors, self.fingerprint)):
                name = by_index[j]
                out.append(
                    f"{what(name, self.names[name][0])} had its values changed through .data (a write "
                    "autograd does not see)"
                )
        return out


def _same_value(a, b) -> bool:
    if torch.is_tensor(b):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value without a plain equality: compared by its text
        return repr(a) == repr(b)


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


# --- the trigger: the first call of any of the model's modules after arming ------------------------
#: id(module) -> weak references to the armed guards watching that module
_WAITING: dict[int, list] = {}
_HOOK: dict = {}  # "handle": the one global forward pre-hook, registered while a guard is armed


def _first_call(module, _args):
    """Global forward pre-hook (kept first of the global ones): a call of a watched module starts
    its guard's step."""
    refs = _WAITING.get(id(module))
    if refs is None:
        if not _WAITING and "handle" in _HOOK:  # the last guard was collected (:func:`_unwait`): idle, removed
            _HOOK.pop("handle").remove()  # (torch iterates a copy of the global hooks while calling them)
        return None
    for ref in list(refs):
        guard = ref()
        if guard is None:  # its model was collected (the finaliser normally does this)
            _unwait(ref, [id(module)])
        else:
            guard._first_forward()
    return None


def trigger_hook_id() -> int | None:
    """The handle id of the write guard's global forward pre-hook while one is registered (it starts a guard's
    step and changes nothing in the forward: the replay's signature leaves it out, since it comes and goes with
    the guards armed)."""
    handle = _HOOK.get("handle")
    return None if handle is None else handle.id


def _wait(ref, ids) -> None:
    """Watch the modules ``ids`` for ``ref``'s guard; register the global hook first of all."""
    for i in ids:
        refs = _WAITING.setdefault(i, [])
        if ref not in refs:
            refs.append(ref)
    if "handle" not in _HOOK:
        _HOOK["handle"] = torch.nn.modules.module.register_module_forward_pre_hook(_first_call)
    handle, hooks = _HOOK["handle"], torch.nn.modules.module._global_forward_pre_hooks
    if not isinstance(hooks, OrderedDict) or handle.id not in hooks:
        raise RuntimeError(
            "idpsgd.engine.guards.integrity: torch.nn.modules.module._global_forward_pre_hooks is not the ordered "
            "dict this version of the write guard expects; the snapshot cannot be placed before global "
            "forward pre-hooks"
        )
    hooks.move_to_end(handle.id, last=False)  # before the global hooks registered earlier (they may write)


def _unwait(ref, ids, drop_hook: bool = True) -> None:
    """Stop watching the modules ``ids`` for ``ref``'s guard; remove the global hook when nobody waits, unless
    ``drop_hook`` is False: a guard's finaliser runs at a garbage collection, which can come inside any code
    iterating torch's global hooks (the replay's signature does), and a removal there raises "mutated during
    iteration"; the idle hook then removes itself at its next call (:func:`_first_call`)."""
    for i in ids:
        refs = _WAITING.get(i)
        if refs is not None and ref in refs:
            refs.remove(ref)
            if not refs:
                del _WAITING[i]
    if drop_hook and not _WAITING and "handle" in _HOOK:
        _HOOK.pop("handle").remove()


def _around(scope: nn.Module, model: nn.Module) -> list:
    """The modules of ``scope`` (a wrapper) that are not inside ``model``: its walk stops at the model, whose
    modules the snapshot has just walked."""
    out, seen, todo = [], {id(model)}, [scope]
    while todo:
        m = todo.pop()
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
            todo.extend(c for c in m._modules.values() if c is not None)
    return out


class WriteGuard:
    """Watches one model's released tensors and its optimizer's state (one guard per model, shared by
    the training steps and the norm passes; :meth:`attach`).

    Training: :meth:`arm` after ``make_private`` and after every step; the first call of any of the
    model's modules (or of the wrappers in :attr:`scope`) after that takes the snapshot; :meth:`check`
    before the noise compares.  Norm passes: :meth:`watch`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.optimizer = None  # the optimizer whose state is watched too (:meth:`watch_too`)
        self.scope: nn.Module | None = None  # a wrapper around the model (make_private's module)
        self.tainted: str | None = None  # the first write found: the model holds it
        self._state: _Snapshot | None = None
        self._like = None  # the last value fingerprint taken (how its tensors were read: reused while unchanged)
        self._armed = False
        self._suspended = 0
        self._ref = weakref.ref(self)
        self._watched: list = []  # the modules the trigger waits for (kept alive: their ids stay theirs)
        self._ids: list[int] = []
        weakref.finalize(self, _unwait, self._ref, self._ids, False)

    def watch_too(self, optimizer, scope: nn.Module | None) -> None:
        """Watch ``optimizer``'s state with the model's tensors (it is released with the model in checkpoints and
        feeds later updates), and take the snapshot at the first call of ``scope`` (the wrapper around the
        model whose own forward pre-hooks run before the model's)."""
        self.optimizer, self.scope = optimizer, scope

    @classmethod
    def attach(cls, model: nn.Module) -> WriteGuard:
        """The model's guard, created on first use (a plain attribute, not a submodule)."""
        return per_model(model, "_idpsgd_write_guard", cls)

    def __deepcopy__(self, memo):  # a copied (or pickled) model gets its own guard when it needs one
        return None

    def __reduce__(self):
        return type(None), ()

    def detach(self) -> None:
        self._stop_waiting()
        self._armed = False
        self._like = None  # (its views and staging buffer)
        if self.model.__dict__.get("_idpsgd_write_guard") is self:
            del self.model.__dict__["_idpsgd_write_guard"]

    # --- training steps ------------------------------------------------------------------------
    def arm(self) -> None:
        """A step ended (or training is set up): the next call of any of the model's modules starts
        the next step."""
        self._state = _Snapshot.take(self.model, fingerprint=False, optimizer=self.optimizer)
        self._armed = True
        self._stop_waiting()
        modules = {id(m): m for m in self._state.modules}  # the model's modules, from the snapshot's walk
        if isinstance(self.scope, nn.Module):  # wrap_model=False returns hooks, not a module
            modules.update((id(m), m) for m in _around(self.scope, self.model))
        self._watched = list(modules.values())
        self._ids[:] = modules
        _wait(self._ref, self._ids)

    def _stop_waiting(self) -> None:
        _unwait(self._ref, self._ids)
        self._ids.clear()
        self._watched = []

    def _first_forward(self) -> None:
        if self._armed and not self._suspended:
            self._armed = False
            self._stop_waiting()
            read = _Snapshot._read(self.model, self.optimizer)  # one walk for the two uses below
            if self._state is not None and self._state.rebound(read[0]):
                # the call runs on tensors swapped in for it (torch.func.functional_call, e.g. per-sample
                # gradients for grad_sample_mode="no_op"): the state taken at the step's end stays the
                # reference (without the value fingerprint, as for a loop that calls none of the modules)
                return
            self._state = self._fingerprinted(read)

    def _fingerprinted(self, read=None) -> _Snapshot:
        """A snapshot with the value fingerprint, read the way the previous one was while the tensors' geometry is
        unchanged (:class:`~.fingerprint.Fingerprint`); ``read``: :meth:`_Snapshot._read`'s walk, just done."""
        state = _Snapshot.take(self.model, fingerprint=True, optimizer=self.optimizer, like=self._like, read=read)
        self._like = state.fingerprint
        return state

    def check(self, where: str = "the training step") -> None:
        """Raise :class:`UnnoisedWriteError` if a released tensor or the optimizer's state changed since
        the snapshot (or the model already holds such a write)."""
        self._refuse_if_tainted()
        if self._state is not None:
            self._compare(self._state, where, "The step was not taken: no noise was drawn and nothing was charged.")

    def mark(self, reason: str) -> None:
        """Mark the model as holding an un-noised write found elsewhere (another rank's replica)."""
        if self.tainted is None:
            self.tainted = reason

    # --- norm passes ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, where: str = "a per-example gradient norm pass"):
        """Snapshot now; yields a function that raises if anything changed since (call it after each
        batch).  The training snapshot is left alone meanwhile."""
        self._refuse_if_tainted()
        state = self._fingerprinted()
        self._suspended += 1
        try:
            yield lambda: self._compare(state, where, "The norm pass was stopped.")
        finally:
            self._suspended -= 1

    # --- the refusal ---------------------------------------------------------------------------
    def _compare(self, state: _Snapshot, where: str, outcome: str) -> None:
        changes = state.changes(self.model, self.optimizer)
        if not changes:
            return
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        self.tainted = (
            f"un-noised write to the released model during {where}: {shown}. The model's state_dict is released "
            "(and the optimizer's state with it in most checkpoints), "
            "and a write made by the forward or backward pass depends on the batch: it would be released without "
            "noise and outside the privacy accounting (a buffer or optimizer state the forward writes and a later "
            "step reads, persistent or not, makes later examples' gradients depend on this batch beyond their clip "
            "norms). Remove the write "
            "(leave out Embedding(max_norm); update no parameter, buffer, extra state or optimizer state in forward "
            "or backward: no running statistics of the data); writes between steps (load_state_dict, a projection "
            "after optimizer.step()) are allowed. This model "
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
    "local_tensor",
    "released_tensors",
    "trainable_names",
]
