"""The modules' attributes a forward can branch on (``idpsgd.engine.guards.module_state``): what the state takes by
value and by identity, and that the watch's cached reading equals a fresh one after every kind of change."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from idpsgd.engine.guards.module_state import AttributeWatch, argument_state, attribute_state


class Kind(enum.Enum):
    A = 1
    B = 2


class Options:
    """A configuration object (its ``__dict__`` can be replaced, unlike a ``SimpleNamespace``'s)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@dataclass(slots=True)
class SlotOptions:
    mix: bool = False


class Switch:
    """A hook object with a switch of its own."""

    def __init__(self):
        self.on = False

    def __call__(self, module, args, out):
        return out


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.config = Options(mix=False, scale=1.0, kind=Kind.A)
        self.flag, self.shape, self.names = True, (3, 3), ["x"]
        self.slotted, self.opts = SlotOptions(), {"mix": False}


def _model():
    """Two blocks of a class of their own (a test may patch it) and a dropout."""
    block = type("Block", (_Block,), {})
    return nn.Sequential(block(), block(), nn.Dropout(0.1))


def test_what_is_taken_by_value_and_what_by_identity():
    model, switch = _model(), Switch()
    mods = list(model.modules())
    state = attribute_state(mods)
    for change, seen in [
        (lambda: setattr(model[0], "flag", False), True),  # a plain attribute of a module
        (lambda: setattr(model[1].config, "mix", True), True),  # a field of an object a module holds
        (lambda: setattr(model[0].config, "kind", Kind.B), True),  # an enum member
        (lambda: setattr(model[0], "shape", (3, 4)), True),  # a tuple of plain values
        (lambda: setattr(model[2], "p", 0.2), True),  # torch's own layers' attributes too
        (lambda: setattr(model[0], "names", ["x"]), True),  # another list: another object
        (lambda: setattr(model[0], "extra", None), True),  # a new attribute
        (lambda: setattr(model[0], "last", torch.zeros(2)), True),  # a tensor's shape ...
        (lambda: setattr(model[0], "last", torch.ones(2)), False),  # ... not its identity or values
        (lambda: model[0].names.append("y"), True),  # a list mutated in place: its items (one level)
        (lambda: setattr(model[0].config, "inner", Options(mix=True)), True),  # one level down ...
        (lambda: setattr(model[0].config.inner, "mix", False), False),  # ... and not two
        (lambda: setattr(model[0], "_idpsgd_bookkeeper", object()), False),  # idpsgd's own objects
        (lambda: model[0].lin.register_forward_hook(switch), True),  # a hook ...
        (lambda: setattr(switch, "on", True), True),  # ... and its own switch
        (lambda: setattr(model[0].slotted, "mix", True), True),  # a slotted object's field
        (lambda: model[0].opts.__setitem__("mix", True), True),  # a dict's item
        (lambda: setattr(type(model[0]), "mode", 2), True),  # a class attribute
        (lambda: setattr(type(model[0]), "forward", lambda self, x: x), True),  # a method patched on the class
        (lambda: setattr(model[1], "__class__", _Block), True),  # an instance's class swapped
    ]:
        change()
        now = attribute_state(mods)
        assert (now != state) == seen, change
        state = now


def test_the_objects_taken_by_identity_are_kept():
    model = _model()
    keep: list = []
    attribute_state(list(model.modules()), keep)
    assert {id(model[0].names), id(model[0].config), id(model[1].config)} <= {id(o) for o in keep}


def _mutations(model):
    """Every kind of change the watch must notice (and some it need not): (name, function)."""
    a, b = model[0], model[1]

    def swap_dict():
        a.config.__dict__ = dict(a.config.__dict__)  # the same contents in another dict

    def rename_deep():  # the same value under another key, in the last place: the same values in the same order
        d = a.config.__dict__
        last = list(d)[-1]
        d["renamed_" + last] = d.pop(last)

    def rename_module_attribute():  # one key gone, another come: the same count
        v = a.__dict__.pop("flag", True)
        a.__dict__["flag2" if "flag" not in a.__dict__ and "flag2" not in a.__dict__ else "flag"] = v

    switch, handles = Switch(), []

    def add_hook():
        handles.append(b.lin.register_forward_hook(switch if random.randrange(2) else switch.__call__))

    def remove_hook():
        if handles:
            handles.pop(random.randrange(len(handles))).remove()

    def move_hooks():  # every hook of one layer to the other: the same hooks in the same order, elsewhere
        src, dst = (a.lin, b.lin) if a.lin._forward_hooks else (b.lin, a.lin)
        dst._forward_hooks.update(src._forward_hooks)
        src._forward_hooks.clear()

    def swap_in_place():  # another function in a hook's entry (private API)
        for hooks in (a.lin._forward_hooks, b.lin._forward_hooks):
            for k in hooks:
                hooks[k] = random.choice((switch, switch.__call__))

    block, other = type(a), type("Other", (_Block,), {})
    methods = (lambda self, x: x, lambda self, x: -x)
    return [
        ("hook added", add_hook),
        ("hook removed", remove_hook),
        ("hooks moved", move_hooks),
        ("hook swapped in place", swap_in_place),
        ("hook's switch", lambda: setattr(switch, "on", not switch.on)),
        ("slotted field", lambda: setattr(a.slotted, "mix", not a.slotted.mix)),
        ("dict item", lambda: b.opts.__setitem__("mix", random.randrange(2) == 1)),
        ("class attribute", lambda: setattr(block, "mode", random.randrange(2))),
        ("class method", lambda: setattr(block, "forward", random.choice(methods))),
        ("class swapped", lambda: setattr(b, "__class__", random.choice((block, other)))),
        ("flag", lambda: setattr(a, "flag", not getattr(a, "flag", False))),
        ("same flag", lambda: setattr(a, "flag", getattr(a, "flag", True))),
        ("deep field", lambda: setattr(b.config, "mix", not b.config.mix)),
        ("deep float", lambda: setattr(b.config, "scale", b.config.scale + 0.5)),
        ("float equal, new object", lambda: setattr(b.config, "scale", float(str(b.config.scale)))),
        ("new config", lambda: setattr(a, "config", Options(**vars(a.config)))),
        ("shared config", lambda: setattr(b, "config", a.config)),
        ("swap dict", swap_dict),
        ("rename deep", rename_deep),
        ("rename attribute", rename_module_attribute),
        ("new attribute", lambda: setattr(a, f"x{random.randrange(3)}", random.randrange(2))),
        ("tensor", lambda: setattr(b, "t", torch.zeros(random.randrange(1, 3)))),
        ("list in place", lambda: a.names.append(1)),
        ("module swapped", lambda: model.__setitem__(2, nn.Dropout(random.choice([0.1, 0.2])))),
        ("nothing", lambda: None),
    ]


def test_the_watch_reads_what_a_fresh_reading_reads_after_any_change():
    """Random sequences of changes, each followed by the watch's reading (cached where it found nothing changed)
    and a fresh one: always equal."""
    rng = random.Random(0)
    random.seed(1)
    model = _model()
    watch = AttributeWatch()
    mutations = _mutations(model)
    fresh_reads = 0
    for _ in range(1000):
        name, change = rng.choice(mutations)
        change()
        mods = list(model.modules())
        before = watch._last
        got = watch.state(mods)
        fresh_reads += watch._last is not before
        assert got == attribute_state(mods), name
    assert 0 < fresh_reads < 1000  # the cache was used, and it was refreshed


@pytest.mark.parametrize("change", ["rename attribute", "rename deep", "swap dict"])
def test_the_watch_sees_a_renamed_key_with_the_same_values(change):
    model = _model()
    watch = AttributeWatch()
    mods = list(model.modules())
    first = watch.state(mods)
    dict(_mutations(model))[change]()
    got = watch.state(mods)
    assert got == attribute_state(mods)
    assert (got != first) == (change != "swap dict")


def test_an_argument_is_taken_with_its_attributes_one_level_down():
    options = Options(mix=False, inner=Options(mix=False))
    keep: list = []
    first = argument_state(options, keep)
    assert argument_state(int("300")) == argument_state(300) and argument_state(tuple(range(1, 3))) == argument_state(
        (1, 2)
    )
    assert argument_state(1) != argument_state(1.0) and argument_state(True) != argument_state(1)  # by type too
    assert {id(options), id(options.inner)} <= {id(o) for o in keep}
    options.inner.mix = True  # two levels down: not seen
    assert argument_state(options) == first
    options.mix = True
    assert argument_state(options) != first
    assert argument_state(Options(mix=True, inner=options.inner)) != argument_state(options)  # another object
