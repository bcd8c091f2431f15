"""The Python state a model's forward can branch on besides its tensors: its modules' attributes, classes and hooks.

A forward's path — which layers run, whether rows of the batch are mixed — can depend on a flag that is neither a
parameter, a buffer, a submodule nor the training flag: ``self.mix = True`` set on a module after a warm-up, a field
of the configuration object the modules hold, a method patched on a module's class (``GPT2MLP.forward = fused``, as
kernel libraries do), a hook object's own switch.  Book-keeping's replayed attribution (:mod:`..per_example.bk.replay`),
made once per model state and then trusted, must see such a change, or a forward that mixes the examples' rows
takes the place of one that did not, silently.  :func:`attribute_state` is that state:

* each module's attributes outside torch's own (:data:`TORCH_KEYS`: parameters, buffers, submodules, hooks and the
  training flag, which the signature reads itself) and outside idpsgd's own objects kept on the model
  (``_idpsgd_*``), and its class;
* what the modules' classes hold, along each class's MRO up to ``nn.Module`` (methods, class attributes);
* the modules' hooks (and torch's global module hooks): each hook, and what it holds — a function's closure cells,
  a bound method's object, a callable object, a ``functools.partial``'s arguments;
* transformers' attention and mask function registries (:data:`REGISTRIES`), where transformers is loaded;
* one level into the objects these hold (a configuration, a ``SimpleNamespace``, a slotted dataclass, a dict or a
  list of options): their attributes (``__dict__`` and ``__slots__``) or items (a dict or list of more than
  :data:`MAX_ITEMS` items, a vocabulary, by identity only).

Values that are plain (``None``, booleans, numbers, strings, dtypes, devices, enum members, tuples of those) are
taken by type and value (``1`` and ``1.0`` differ), a tensor by its shape, dtype, device and ``requires_grad`` (as
a forward's tensor arguments are); any other object by its type and identity, its state not looked into beyond the
one level (an object two levels down, a tensor's values: not seen; nor are idpsgd's and torch's own objects,
:data:`INTERNAL`, such as the book-keeper's forward of a covered layer or FSDP2's state and hooks).  An identity is
an object's only while it lives, so a caller that keeps the state across forwards keeps the objects too (``keep``:
:func:`..per_example.bk.replay.held`).  What no state of the model holds — Python's ``random``, a global variable,
another registry — is not seen (docs/guarantees.md).
"""

from __future__ import annotations

import enum
import functools
import sys
import types
from itertools import chain
from operator import is_, itemgetter

import torch
from torch import nn

#: the attributes torch gives every module (parameters, buffers, submodules, hooks, the training flag): the
#: signature reads what it needs of them itself
TORCH_KEYS = frozenset(vars(nn.Module()))
#: idpsgd's own objects kept on a model (``integrity.per_model``): the book-keeper, the write guard, the checks
OURS = "_idpsgd_"
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
#: objects not looked into: modules (walked themselves), tensors (by shape), classes, builtins
_OPAQUE = (nn.Module, torch.Tensor, types.BuiltinFunctionType, type)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_hooks_of = itemgetter(*_HOOK_DICTS)  # of a module's __dict__
_MISSING = object()  # an unset slot
#: a dict or list held with more items than this (a vocabulary) is taken by identity only, not read at each forward
MAX_ITEMS = 256

_KINDS: dict = {}  # type -> how its values are taken: "plain", "tuple" (plain if its items are), "tensor", "opaque",
# "function" (looked into: closure), "object" (looked into: attributes or items)
_SLOTS: dict = {}  # type -> the names of its slots along the MRO


#: packages whose objects are machinery, not switches a user sets: idpsgd's own (the book-keeper's forward of a
#: covered layer, the checks' hooks) and torch's (FSDP2's per-module state and its hooks, whose training state
#: moves within every step): taken by identity, not looked into
INTERNAL = frozenset({"idpsgd", "torch"})


def _ours(t: type) -> bool:
    return (getattr(t, "__module__", None) or "").split(".", 1)[0] in INTERNAL


def _kind(t: type) -> str:
    kind = _KINDS.get(t)
    if kind is None:  # by the type alone: isinstance would read a configuration's __class__ through its own
        # __getattribute__ (transformers': Python, per call)
        if t in _PLAIN or issubclass(t, enum.Enum):
            kind = "plain"
        elif t is tuple or t is torch.Size:
            kind = "tuple"
        elif issubclass(t, torch.Tensor):
            kind = "tensor"
        elif _ours(t) or issubclass(t, _OPAQUE):
            kind = "opaque"
        elif t is types.FunctionType or t is types.MethodType or t is functools.partial:
            kind = "function"
        else:
            kind = "object"
        _KINDS[t] = kind
    return kind


def _value(v, keep: list | None):
    """A plain value by type and value, a tuple of plain values likewise, a tensor by shape, dtype, device and
    ``requires_grad``; any other object by (type, identity), put in ``keep``."""
    t = type(v)
    kind = _KINDS.get(t) or _kind(t)
    if kind == "plain":
        return (t, v)
    if kind == "tuple" and all(type(x) in _PLAIN for x in v):
        return (t, tuple(map(type, v)), v)
    if kind == "tensor":  # as the inputs are taken (a forward's path sees its shape; its values only through a
        # read into Python, which a trace marks)
        return (t.__qualname__, tuple(v.shape), v.dtype, v.device, v.requires_grad)
    if keep is not None:
        keep.append(v)
    return (t.__qualname__, id(v))


def _slots(t: type) -> tuple:
    names = _SLOTS.get(t)
    if names is None:
        found = []
        for c in t.__mro__:
            s = c.__dict__.get("__slots__", ())
            found += [s] if isinstance(s, str) else [n for n in s if n not in ("__dict__", "__weakref__")]
        names = _SLOTS[t] = tuple(found)
    return names


def _read(v) -> tuple[list, list]:
    """(keys, values) of what ``v`` holds one level down: a dict's items, a list's items, a function's closure
    cells, a bound method's object, a partial's function and arguments, an object's ``__dict__`` and slots."""
    t = type(v)
    if t is dict:
        return list(v), list(v.values())
    if t is list or t is set:
        return list(range(len(v))), list(v)
    if t is types.FunctionType:
        cells = v.__closure__ or ()
        return list(range(len(cells))), [_cell(c) for c in cells]
    if t is types.MethodType:  # its function, its object, and what the object holds (a hook's owner's switch)
        owner = v.__self__
        keys, values = ["__func__", "__self__"], [v.__func__, owner]
        if (_KINDS.get(type(owner)) or _kind(type(owner))) == "object" and _foreign(owner):
            held_keys, held_values = _read(owner)
            keys += [("__self__", k) for k in held_keys]
            values += held_values
        return keys, values
    if t is functools.partial:
        return ["func", "args", "keywords"], [v.func, v.args, v.keywords]
    try:
        d = getattr(v, "__dict__", None)
        keys, values = (list(d), list(d.values())) if type(d) is dict else ([], [])
        for name in _slots(t):
            keys.append(name)
            values.append(getattr(v, name, _MISSING))
    except Exception:  # an object whose attribute access raises (a proxy): taken by identity only
        return [], []
    return keys, values


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _state(v, keep) -> frozenset:
    keys, values = _read(v)
    return frozenset(zip(keys, (_value(x, keep) for x in values), strict=True))


def _held(values, deep: dict) -> None:
    """The objects among ``values`` that are looked into one level (their kind "object" or "function", not idpsgd's
    own, not larger than :data:`MAX_ITEMS`): id → object."""
    for v in values:
        t = type(v)
        if (
            (_KINDS.get(t) or _kind(t)) in ("object", "function")
            and id(v) not in deep
            and _foreign(v)
            and not ((t is dict or t is list or t is set) and len(v) > MAX_ITEMS)
        ):
            deep[id(v)] = v


def _foreign(h) -> bool:
    """Not :data:`INTERNAL`: not a function or method defined in idpsgd or torch, nor bound to one of their objects
    (the book-keeper's and the checks' hooks, the write guard's global hook, which comes and goes with the guards
    armed, FSDP2's hooks)."""
    t = type(h)
    if t is types.MethodType:
        return not _ours(type(h.__self__)) and _foreign_code(h.__func__)
    if t is types.FunctionType:
        return _foreign_code(h)
    return not _ours(t)


def _foreign_code(f) -> bool:
    return (getattr(f, "__module__", None) or "").split(".", 1)[0] not in INTERNAL


def _hook_dicts(dicts) -> list:
    """The hook dicts of the modules whose ``__dict__`` are ``dicts`` (each module's four) and torch's global module
    hook dicts."""
    g = torch.nn.modules.module
    return [
        *chain.from_iterable(map(_hooks_of, dicts)),
        g._global_forward_pre_hooks,
        g._global_forward_hooks,
        g._global_backward_pre_hooks,
        g._global_backward_hooks,
    ]


def _hooks(hook_dicts) -> list:
    return [h for d in hook_dicts if d for h in d.values()]


#: registries outside the model that its forward reads by name: (module, class, instance) of transformers' attention
#: and mask functions (``AttentionInterface.register("sdpa", f)`` replaces what every model of that implementation
#: calls); their class-wide and instance mappings are read as held dicts
REGISTRIES = (
    ("transformers.modeling_utils", "AttentionInterface", "ALL_ATTENTION_FUNCTIONS"),
    ("transformers.masking_utils", "AttentionMaskInterface", "ALL_MASK_ATTENTION_FUNCTIONS"),
)


def _registries() -> list:
    """The mappings of :data:`REGISTRIES` whose modules are loaded (none without transformers)."""
    out = []
    for module, cls, instance in REGISTRIES:
        loaded = sys.modules.get(module)
        if loaded is None:
            continue
        for owner in (getattr(loaded, cls, None), getattr(loaded, instance, None)):
            for name in ("_global_mapping", "_local_mapping"):
                d = getattr(owner, "__dict__", {}).get(name)
                if type(d) is dict:
                    out.append(d)
    return out


def _classes(modules) -> dict:
    """id → class, for each module's class and its bases up to ``nn.Module`` (torch's own left out)."""
    out: dict = {}
    for t in set(map(type, modules)):
        for c in t.__mro__:
            if c is nn.Module or c is object:
                break
            out.setdefault(id(c), c)
    return out


def attribute_state(modules, keep: list | None = None) -> tuple:
    """The modules' attributes and classes, their classes' contents, the hooks and one level into what all these
    hold (module docstring), as a hashable value that is equal for two forwards exactly when every plain value is
    equal and every other object is the same.  ``keep``: a list that receives the objects taken by identity."""
    return _reading(modules, keep)[0]


def _reading(modules, keep: list | None) -> tuple:
    """(:func:`attribute_state`, and what it was read from: each module's ``__dict__`` and keys outside torch's,
    every hook (idpsgd's and torch's own too), the classes, the objects looked into one level)."""
    out, deep, dicts, extra = [], {}, list(map(vars, modules)), []
    for i, d in enumerate(dicts):
        keys = tuple(d.keys() - TORCH_KEYS)
        extra.append(keys)
        own = [k for k in keys if not k.startswith(OURS)]
        if own:
            out.append((i, frozenset((k, _value(d[k], keep)) for k in own)))
            _held((d[k] for k in own), deep)
    out.append(tuple(_value(type(m), keep) for m in modules))
    classes = sorted(_classes(modules).values(), key=id)
    for c in classes:
        out.append((_value(c, keep), frozenset((k, _value(v, keep)) for k, v in vars(c).items())))
    hooks = _hooks(_hook_dicts(dicts))
    foreign = [h for h in hooks if _foreign(h)]
    out.append(tuple(_value(h, keep) for h in foreign))
    _held(foreign, deep)
    _held(_registries(), deep)
    for v in deep.values():
        out.append((_value(v, keep), _state(v, keep)))
    return tuple(out), dicts, extra, hooks, classes, list(deep.values())


def argument_state(v, keep: list | None = None):
    """A forward's argument that is not a tensor: a plain value by type and value (:func:`attribute_state`'s rule),
    any other object by (type, identity) and, where it holds attributes or items, with them (one level: an options
    object whose flag is flipped in place between two calls)."""
    got = _value(v, keep)
    return (*got, _state(v, keep)) if (_KINDS.get(type(v)) or _kind(type(v))) in ("object", "function") else got


def _one(key):
    return lambda d: (d[key],)


def _none(d):
    return ()


def _call(getter, d) -> tuple:
    return getter(d)


def _same_items(old: tuple, new: tuple) -> bool:
    """Two (keys, values) readings hold the same objects in the same order."""
    return (
        len(old[0]) == len(new[0])
        and len(old[1]) == len(new[1])
        and all(map(is_, old[0], new[0]))
        and all(map(is_, old[1], new[1]))
    )


class AttributeWatch:
    """:func:`attribute_state` of one model's modules across its forwards, read again only where something may have
    changed.  The last reading is kept with what it was read from, and a forward whose modules' attributes are the
    same keys, each value the same object, whose modules are of the same classes, whose classes, hooks and held
    objects hold the same keys and objects, gets it again (it holds those objects, not the modules).  About a tenth
    of :func:`attribute_state`'s cost.  Exact but for one case: a module that loses one of torch's own attributes
    (:data:`TORCH_KEYS`, without which it no longer runs) and gains another in the same step."""

    def __init__(self):
        self._last = None

    def state(self, modules: list, keep: list | None = None) -> tuple:
        """:func:`attribute_state` of ``modules`` (``keep``: as there; a caller that asks for the objects gets a
        fresh reading)."""
        last = self._last
        if keep is None and last is not None and self._same(modules, last):
            return last[-1]
        state, dicts, extra, hooks, classes, deep = _reading(modules, keep)
        getters = [itemgetter(*keys) if len(keys) > 1 else _one(keys[0]) if keys else _none for keys in extra]
        self._last = (
            list(map(len, dicts)),
            getters,
            list(chain.from_iterable(map(_call, getters, dicts))),
            list(map(type, modules)),
            [(vars(c), len(vars(c)), list(vars(c)), list(vars(c).values())) for c in classes],
            hooks,
            [(v, _read(v)) for v in deep],
            state,
        )
        return state

    @staticmethod
    def _same(modules, last) -> bool:
        counts, getters, values, kinds, classes, hooks, held, _ = last
        dicts = list(map(vars, modules))
        if list(map(len, dicts)) != counts:  # also another number of modules
            return False
        try:  # a key gone (and another come: the same count) raises KeyError
            now = list(chain.from_iterable(map(_call, getters, dicts)))
        except KeyError:
            return False
        if len(now) != len(values) or not all(map(is_, now, values)):
            return False
        if not all(map(is_, map(type, modules), kinds)):
            return False
        if not all(
            len(d) == n and all(map(is_, d, keys)) and all(map(is_, d.values(), vals)) for d, n, keys, vals in classes
        ):
            return False
        now = _hooks(_hook_dicts(dicts))  # (which module holds a hook: the signature's handle ids)
        if len(now) != len(hooks) or not all(map(is_, now, hooks)):
            return False
        return all(_same_items(items, _read(v)) for v, items in held)
