"""The Python state a model's forward can branch on besides its tensors: its modules' own attributes.

A forward's path — which layers run, whether rows of the batch are mixed — can depend on a flag that is neither a
parameter, a buffer, a submodule nor the training flag: ``self.mix = True`` set on a module after a warm-up, or a
field of the configuration object the modules hold (``self.config.output_attentions``).  The checks that are made
once per model state and then trusted — book-keeping's replayed attribution (:mod:`..per_example.bk.replay`) and
the batch-independence probe (:mod:`.batch_independence`) — must see such a flag change, or a forward that mixes
the examples' rows takes the place of one that did not, silently.  :func:`attribute_state` is that state:

* each module's attributes outside torch's own (:data:`TORCH_KEYS`: parameters, buffers, submodules, hooks and the
  training flag, which the callers read themselves) and outside idpsgd's own objects kept on the model
  (``_idpsgd_*``);
* one level into the plain objects they hold (a configuration, a ``SimpleNamespace`` of options): their attributes.

Values that are plain (``None``, booleans, numbers, strings, dtypes, devices, enum members, tuples of those)
are taken by value, a tensor by its shape, dtype, device and ``requires_grad`` (as a forward's tensor arguments
are); any other object by its type and identity, its state not looked into (a list mutated in place, an object
two levels down, a tensor's values: not seen).  An identity is an object's only while it lives,
so a caller that keeps the state across forwards keeps the objects too (``keep``: :func:`..per_example.bk.replay.held`).
What no state of the model holds — Python's ``random``, a global, a closure — is not seen either (docs/guarantees.md).
"""

from __future__ import annotations

import enum
import types
from itertools import chain
from operator import is_, itemgetter

import torch
from torch import nn

#: the attributes torch gives every module (parameters, buffers, submodules, hooks, the training flag): the
#: callers read what they need of them themselves
TORCH_KEYS = frozenset(vars(nn.Module()))
#: idpsgd's own objects kept on a model (``integrity.per_model``): the book-keeper, the write guard, the checks
OURS = "_idpsgd_"
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
#: objects whose ``__dict__`` is not state a forward branches on
_OPAQUE = (nn.Module, torch.Tensor, types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)


_KINDS: dict = {}  # type -> how its values are taken: "plain", "tuple" (plain if its items are), "object"


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
        else:
            kind = "opaque" if issubclass(t, _OPAQUE) else "object"
        _KINDS[t] = kind
    return kind


def _value(v, keep: list | None):
    """A plain value as itself, a tuple of plain values as itself; any other object by (type, identity)."""
    t = type(v)
    kind = _KINDS.get(t) or _kind(t)
    if kind == "plain" or (kind == "tuple" and all(type(x) in _PLAIN for x in v)):
        return v
    if kind == "tensor":  # as the inputs are taken (a forward's path sees its shape; its values only through a
        # read into Python, which a trace marks)
        return (t.__qualname__, tuple(v.shape), v.dtype, v.device, v.requires_grad)
    if keep is not None:
        keep.append(v)
    return (t.__qualname__, id(v))


def _held_objects(values, deep: dict) -> None:
    """The plain objects among ``values`` whose attributes are looked into (one level: :func:`attribute_state`):
    id → (the object, its ``__dict__``)."""
    for v in values:
        t = type(v)
        if (_KINDS.get(t) or _kind(t)) == "object" and id(v) not in deep:
            d = getattr(v, "__dict__", None)
            if type(d) is dict:
                deep[id(v)] = (v, d)


def attribute_state(modules, keep: list | None = None) -> tuple:
    """The attributes of ``modules`` (in order) and of the plain objects they hold, as a hashable value that is
    equal for two forwards exactly when every plain attribute is equal and every other attribute is the same
    object (module docstring).  ``keep``: a list that receives the objects taken by identity."""
    out, deep = [], {}
    for i, m in enumerate(modules):
        d = m.__dict__
        keys = d.keys() - TORCH_KEYS
        if not keys:
            continue
        own = [k for k in keys if not k.startswith(OURS)]
        if own:
            out.append((i, frozenset((k, _value(d[k], keep)) for k in own)))
            _held_objects((d[k] for k in own), deep)
    for _, d in deep.values():
        out.append(frozenset((k, _value(v, keep)) for k, v in d.items()))
    return tuple(out)


def argument_state(v, keep: list | None = None):
    """A forward's argument that is not a tensor: a plain value as itself (:func:`attribute_state`'s rule), any
    other object by (type, identity) and, where it has attributes, with them (one level: an options object whose
    flag is flipped in place between two calls)."""
    got = _value(v, keep)
    if got is v or (_KINDS.get(type(v)) or _kind(type(v))) != "object":
        return got
    d = getattr(v, "__dict__", None)
    if type(d) is not dict:
        return got
    return (*got, frozenset((k, _value(x, keep)) for k, x in d.items()))


def _one(key):
    return lambda d: (d[key],)


def _none(d):
    return ()


class AttributeWatch:
    """:func:`attribute_state` of one model's modules across its forwards, read again only where an attribute may
    have changed.  The last reading is kept with what it was read from; a forward whose modules' attributes are
    the same keys, each value the same object, and whose held plain objects have the same keys and values, gets
    it again.  It holds the values, not the modules themselves.  About a tenth of :func:`attribute_state`'s cost
    (GPT-2 small: 164 modules, two configurations).  Exact but for one case: a module that loses one of torch's
    own attributes (:data:`TORCH_KEYS`, without which it no longer runs) and gains another in the same step."""

    def __init__(self):
        self._last = None  # (attribute counts, getters, values, [(held object, its dict, keys, values)], state)

    def state(self, modules: list, keep: list | None = None) -> tuple:
        """:func:`attribute_state` of ``modules`` (``keep``: as there; a caller that asks for the objects gets a
        fresh reading)."""
        last = self._last
        if keep is None and last is not None and self._same(modules, last):
            return last[-1]
        state = attribute_state(modules, keep)
        dicts = list(map(vars, modules))
        getters = []
        deep: dict = {}
        for d in dicts:
            keys = tuple(d.keys() - TORCH_KEYS)
            getters.append(itemgetter(*keys) if len(keys) > 1 else _one(keys[0]) if keys else _none)
            _held_objects((d[k] for k in keys if not k.startswith(OURS)), deep)
        self._last = (
            list(map(len, dicts)),
            getters,
            list(chain.from_iterable(map(_call, getters, dicts))),
            [(obj, d, list(d), list(d.values())) for obj, d in deep.values()],
            state,
        )
        return state

    @staticmethod
    def _same(modules, last) -> bool:
        counts, getters, values, held, _ = last
        dicts = list(map(vars, modules))
        if list(map(len, dicts)) != counts:  # also another number of modules
            return False
        try:  # a key gone (and another come: the same count) raises KeyError
            now = list(chain.from_iterable(map(_call, getters, dicts)))
        except KeyError:
            return False
        if len(now) != len(values) or not all(map(is_, now, values)):
            return False
        return all(
            getattr(obj, "__dict__", None) is d
            and len(d) == len(keys)
            and all(map(is_, d, keys))
            and all(map(is_, d.values(), vals))
            for obj, d, keys, vals in held
        )


def _call(getter, d) -> tuple:
    return getter(d)
