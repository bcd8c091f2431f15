"""Provenance once per signature (``idpsgd.engine.per_example.bk.replay``): a replayed forward gives book-keeping
the same attribution as its trace — the same per-example norms and clipped sums, bit for bit, and the brute-force ones —
for the surveyed architectures whose forward has no data-dependent decision (GPT-2, BERT, T5, Llama, GPT-2 with
LoRA); where the trace saw one (a mixture of experts' routing, a read of the mask into Python), the forward is
traced at every step and the log says why; a replay that does not follow its trace refuses the step."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hf_architectures as H
from idpsgd.engine import IndividualizedPrivacyEngine
from idpsgd.engine.per_example.bk import replay
from idpsgd.engine.per_example.bk.keeper import BookKeeper


def _result(case, inputs=None):
    """(norms, clipped sums by name, what the attribution did) of one book-kept backward pass on ``inputs``."""
    if inputs is not None:
        case = H.dataclasses.replace(case, inputs=inputs)
    norms, sums = H.engine_result(case, lambda n: torch.linspace(0.5, 1.0, n.numel(), dtype=n.dtype))
    return norms, sums, BookKeeper.attach(case.model).attribution.status


def _other_batch(case):
    g = torch.Generator().manual_seed(7)
    return {k: torch.randint(3, H.V, v.shape, generator=g) if k == "input_ids" else v for k, v in case.inputs.items()}


@pytest.mark.parametrize(
    ("name", "lora"), [("gpt2", False), ("bert", False), ("t5", False), ("gpt2", True), ("llama", False)]
)
def test_a_replay_gives_the_traced_attribution_bit_for_bit(name, lora):
    """Traced on one batch, replayed on another of the same signature, traced again on that batch (replay off): the
    same norms and clipped sums exactly, and the brute-force ones (one backward pass per example)."""
    case = H.build(name, 3, 7, lora=lora)
    _, grads = H.reference(case)  # (before the book-keeper is attached: the reference is a deep copy)
    _, _, first = _result(case, _other_batch(case))
    norms, sums, second = _result(case)
    BookKeeper.attach(case.model).attribution.enabled = False
    norms_traced, sums_traced, third = _result(case)
    assert (first, second, third) == ("traced", "replayed", "traced")
    assert torch.equal(norms, norms_traced) and sums.keys() == sums_traced.keys()
    assert all(torch.equal(sums[k], sums_traced[k]) for k in sums)
    assert torch.allclose(norms, grads.norm(dim=1), rtol=1e-8)


@pytest.mark.parametrize(
    ("name", "mask", "why"),
    [
        ("mixtral", False, "'nonzero': data-dependent routing"),
        ("qwen2_moe", False, "'nonzero': data-dependent routing"),
        ("gpt2", True, "a read of tensor values into Python"),  # transformers' mask fast path reads the mask
        ("deberta_v2", False, "compares an index with arange"),
    ],
)
def test_a_replay_is_not_trusted_where_the_trace_saw_a_decision(name, mask, why, caplog):
    case = H.build(name, 3, 7, mask=mask)
    _, grads = H.reference(case)
    with caplog.at_level(logging.INFO, logger="idpsgd"):
        statuses = [_result(case, _other_batch(case))[2], _result(case)[2]]
    assert all(s.startswith("traced (not replayed: ") and why in s for s in statuses), statuses
    assert not BookKeeper.attach(case.model).attribution.plans
    said = [r.getMessage() for r in caplog.records if "traced at every step, not replayed" in r.getMessage()]
    assert len(said) == 1 and why in said[0]
    norms, _, _ = _result(case)  # and the traced attribution is still the exact one
    assert torch.allclose(norms, grads.norm(dim=1), rtol=1e-8)


def test_a_new_signature_is_traced_and_a_scheduled_re_trace_is_compared(monkeypatch):
    monkeypatch.setattr(replay, "RETRACE_EVERY", 1)
    case = H.build("gpt2", 3, 7)
    statuses = [_result(case)[2] for _ in range(4)]
    assert statuses == ["traced", "replayed", "traced", "replayed"]  # the re-trace gave the same plan
    longer = H.build("gpt2", 3, 9).inputs
    assert _result(case, longer)[2] == "traced" and _result(case, longer)[2] == "replayed"
    case.model.transformer.h[1].attn.register_forward_hook(lambda m, a, out: None)  # the structure changed
    assert _result(case)[2] == "traced"


#: a switch outside the model (a global), which no signature sees
_SWITCH = {"use_b": True}


class _Switch(nn.Module):
    """Takes layer ``b`` or ``c`` (the same shapes) by a global switch, which the signature cannot see."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) if _SWITCH["use_b"] else self.c(h)


def test_a_replay_that_does_not_follow_its_trace_refuses_the_step(caplog, monkeypatch):
    torch.manual_seed(0)
    model = _Switch()
    n = 6
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    module, optimizer, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=n),
        budgets=np.full(n, 1e3),
        target_delta=1e-5,
        sample_rates=np.ones(n),
        clip_norms=np.ones(n),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="bk",
        privacy_filter=None,
    )

    def step():
        for xb, yb in loader:
            optimizer.zero_grad()
            F.cross_entropy(module(xb), yb).backward()
            optimizer.step()

    step()
    step()
    attribution = BookKeeper.attach(model).attribution
    assert attribution.status == "replayed" and engine.steps == 2
    monkeypatch.setitem(_SWITCH, "use_b", False)
    with (
        caplog.at_level(logging.INFO, logger="idpsgd"),
        pytest.raises(
            replay.ReplayDiverged,
            match=r"query 2 of 2 came from 'apply' of layer 'c'.*the trace's from 'apply' of layer 'b'",
        ),
    ):
        step()
    assert engine.steps == 2  # refused: no noise drawn, nothing charged
    assert any("diverged from its trace" in r.getMessage() for r in caplog.records)
    step()  # traced from now on
    assert attribution.status.startswith("traced (replay off: ") and engine.steps == 3


class _WeightAsInput(nn.Module):
    """Feeds a covered layer's weight to another covered layer (a value shared by the batch made by the keeper)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) + self.b(self.a.weight).sum(0))


def test_a_parameter_fed_to_a_layer_keeps_the_forward_traced():
    torch.manual_seed(0)
    model = _WeightAsInput()
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
    for _ in range(2):
        keeper.clear()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        assert keeper.norms().shape == (5,)
        why = "a covered layer's parameter fed to a layer (needs the interception)"
        assert keeper.attribution.status == f"traced (not replayed: {why})"
    keeper.clear()
    keeper.active = False


# --- identity: an id in a signature is its object's only while the object lives ------------------------------------
class _Ctl:
    """A plain Python argument of the forward (keyed by identity in the signature)."""

    def __init__(self, mix):
        self.mix = mix


class _Steered(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, ctl):
        h = torch.tanh(self.a(x))
        return self.head(h.roll(1, 0) if ctl.mix else h)  # mix: each row from another example


class _Roll(nn.Module):
    def forward(self, h):
        return h.roll(1, 0)


class _Swappable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.head = nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.act(self.a(x)))


def _pass(model, *args, extra=None):
    """One book-kept backward pass and its norms: the attribution's status, or the refusal's class. ``extra``: a
    function of the input giving the forward's other arguments (instead of ``args``)."""
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    keeper.clear()
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    if extra is not None:
        args = extra(x)
    try:
        F.cross_entropy(model(x, *args), y, reduction="sum").backward()
        keeper.norms()
        return keeper.attribution.status
    except Exception as exc:  # the refusal under test
        return type(exc).__name__
    finally:
        keeper.clear()
        keeper.active = False


def test_a_fresh_argument_object_with_a_freed_ones_id_is_traced():
    """A forward given a new Python object each step: once the traced step's object is freed, the next one often
    takes its id; the signature (which keys such an object by id) then matched, and the plan of a forward that did
    not mix the rows was replayed for one that did — no refusal (found by an audit). The plan now holds weak
    references to the signature's objects and is dropped when one dies."""
    model = _Steered()
    reused = 0
    for _ in range(20):
        calm = _Ctl(False)
        first, freed = _pass(model, calm), id(calm)
        del calm
        mixing = _Ctl(True)
        reused += id(mixing) == freed
        assert first in ("traced", "replayed") and _pass(model, mixing) == "RefusedRows"
        del mixing
    assert reused  # the case under test happened (CPython gives a freed object's memory to the next one)


def test_a_module_swapped_in_for_a_freed_one_is_traced():
    """A parameter-free submodule replaced (``model.act = None; model.act = Roll()``): the new module took the freed
    one's id, the signature (modules by id) matched and the old plan was replayed for a forward that mixes the rows."""
    model = _Swappable()
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    freed = id(model.act)
    model.act = None
    model.act = _Roll()
    if id(model.act) != freed:
        pytest.skip("the allocator gave the new module another address: the case under test did not happen")
    assert _pass(model) == "RefusedRows"


def test_a_re_planned_keeper_traces_instead_of_diverging():
    """A layer frozen and unfrozen between two make_private calls: the keeper plans its layers anew, and the plan of
    the first phase (whose query sites are the old layers' forwards) matched the signature again and diverged on
    replay — a refused step and replays off for good. Re-planning now drops the plans."""
    model = _Swappable()
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    keeper = BookKeeper.attach(model)
    model.a.requires_grad_(False)
    keeper.refresh()
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    model.a.requires_grad_(True)
    keeper.refresh()
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    assert keeper.attribution.off is None


# --- the modules' attributes: a flag that changes the path is part of the signature ---------------------------------
class _Flagged(nn.Module):
    """Mixes the rows (each from another example) when a flag says so: a plain attribute of the module itself
    (``where="module"``) or of a configuration object it holds (``where="config"``)."""

    def __init__(self, where):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.where = where
        self.mix = False
        self.config = types.SimpleNamespace(mix=False, hidden=4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        mix = self.mix if self.where == "module" else self.config.mix
        return self.head(h.roll(1, 0) if mix else h)

    def set_mix(self, on):
        if self.where == "module":
            self.mix = on
        else:
            self.config.mix = on


@pytest.mark.parametrize("where", ["module", "config"])
def test_a_flag_on_a_module_or_its_configuration_is_part_of_the_signature(where):
    """A module's plain attribute (a switch set after a warm-up) and a field of the configuration object it holds
    chose a forward that mixes the rows; the signature did not see them, and the plan of the non-mixing forward was
    replayed for the mixing one, with no refusal (every later step until the 64th re-trace). They are now part of
    the signature (``guards.module_state``): the mixing forward is traced and refused, and switching back replays
    the first plan."""
    model = _Flagged(where)
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    model.set_mix(True)
    assert [_pass(model), _pass(model)] == ["RefusedRows", "RefusedRows"]
    model.set_mix(False)
    assert _pass(model) == "replayed"
    assert len(BookKeeper.attach(model).attribution.plans) == 1


def test_a_tensor_attribute_is_taken_by_its_shape():
    """A module that keeps a fresh tensor as an attribute at each forward (an attention map for a plot) still
    replays: a tensor attribute is taken as the inputs are, by shape, dtype and device, not by identity."""

    class Keeps(_Swappable):
        def forward(self, x):
            out = super().forward(x)
            self.last = out.detach()
            return out

    model = Keeps()
    assert [_pass(model), _pass(model), _pass(model)] == ["traced", "traced", "replayed"]


def test_a_hook_swapped_for_another_is_part_of_the_signature():
    """A forward hook removed and another registered in its place: the signature counted the hooks, so the plan of
    the forward with the first (which scales) was replayed for the second (which mixes the rows), no refusal. The
    signature now holds the hooks' handle ids (never one id for two hooks in a process)."""
    model = _Swappable()
    handle = model.act.register_forward_hook(lambda module, args, out: out * 2)
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    handle.remove()
    model.act.register_forward_hook(lambda module, args, out: out.roll(1, 0))
    assert _pass(model) == "RefusedRows"


def test_an_argument_object_flipped_in_place_is_part_of_the_signature():
    """The same options object passed at every step, its flag flipped in place: the signature took the object by
    identity only, so the non-mixing plan was replayed for the mixing forward, no refusal. Its attributes are now
    part of the signature (one level)."""
    model = _Steered()
    ctl = _Ctl(False)
    assert [_pass(model, ctl), _pass(model, ctl)] == ["traced", "replayed"]
    ctl.mix = True
    assert _pass(model, ctl) == "RefusedRows"
    ctl.mix = False
    assert _pass(model, ctl) == "replayed"


# --- found by an audit: a class patched, a slotted or dict of options, a hook's own switch, an aliased input ----------
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class _Blocked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.blk, self.head = nn.Linear(4, 4), _Block(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blk(self.a(x)))


class _Options(nn.Module):
    """Centres the batch (mixes the rows) when its options say so: held as ``self.opts``."""

    def __init__(self, opts):
        super().__init__()
        self.a, self.head, self.opts = nn.Linear(4, 4), nn.Linear(4, 2), opts

    def forward(self, x):
        h = torch.tanh(self.a(x))
        mix = self.opts["mix"] if isinstance(self.opts, dict) else self.opts.mix
        return self.head(h - h.mean(0) if mix else h)


@dataclass(slots=True)
class _SlotOptions:
    mix: bool = False


class _HookSwitch:
    """A forward hook object (or its bound method) with a switch of its own."""

    def __init__(self):
        self.on = False

    def __call__(self, module, args, out):
        return out.roll(1, 0) if self.on else out

    def method(self, module, args, out):
        return self(module, args, out)


def _patch_class(model, monkeypatch):
    monkeypatch.setattr(_Block, "forward", lambda self, h: torch.tanh(self.lin(h)).roll(1, 0))


def _swap_class(model, monkeypatch):
    class Rolling(_Block):
        def forward(self, h):
            return torch.tanh(self.lin(h)).roll(1, 0)

    model.blk.__class__ = Rolling


def _hooked(kind):
    model, switch = _Swappable(), _HookSwitch()
    model.act.register_forward_hook(switch if kind == "object" else switch.method)
    return model, switch


_BEYOND = [
    ("class patched", _Blocked, _patch_class),
    ("instance's class swapped", _Blocked, _swap_class),
    ("slotted options", lambda: _Options(_SlotOptions()), lambda m, mp: setattr(m.opts, "mix", True)),
    ("dict of options", lambda: _Options({"mix": False}), lambda m, mp: m.opts.__setitem__("mix", True)),
    ("hook object's switch", lambda: _hooked("object"), lambda m, mp: setattr(m[1], "on", True)),
    ("hook method's owner's switch", lambda: _hooked("method"), lambda m, mp: setattr(m[1], "on", True)),
]


@pytest.mark.parametrize(("case", "build", "flip"), _BEYOND, ids=[c[0] for c in _BEYOND])
def test_what_a_forward_branches_on_beyond_the_instance_is_part_of_the_signature(case, build, flip, monkeypatch):
    """Each was replayed with the non-mixing plan after the switch (an audit's reproductions): a method patched on
    the module's class (as kernel libraries patch), an instance's class swapped, a slotted dataclass or a dict of
    options held by a module, a hook object's own switch, a hook that is a bound method whose object's switch
    flips."""
    built = build()
    model = built[0] if isinstance(built, tuple) else built
    assert [_pass(model), _pass(model)] == ["traced", "replayed"]
    flip(built, monkeypatch)
    assert _pass(model) == "RefusedRows", case


class _Context(nn.Module):
    """Mixes the rows when its context is not the input itself (``context is x``, as attention modules branch)."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, context):
        h = torch.tanh(self.a(x))
        return self.head(h if context is x else h + context.roll(1, 0))


def test_an_argument_that_is_another_is_part_of_the_signature():
    model = _Context()
    same, other = (lambda x: (x,)), (lambda x: (x.clone(),))
    assert [_pass(model, extra=same), _pass(model, extra=same), _pass(model, extra=other)] == [
        "traced",
        "replayed",
        "RefusedRows",
    ]


def test_a_function_registered_for_transformers_attention_is_part_of_the_signature(monkeypatch):
    """``AttentionInterface.register("sdpa", f)`` replaces, for every model of that implementation, the attention
    a forward calls: a registry outside the model, read (transformers' attention and mask registries only)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    case = H.build("gpt2", 3, 7)
    assert [_result(case, _other_batch(case))[2], _result(case)[2]] == ["traced", "replayed"]
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def rolling(module, query, *args, **kwargs):
        out, weights = sdpa(module, query, *args, **kwargs)
        return out.roll(1, 0), weights

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", rolling)
    with pytest.raises(Exception, match="rows|mix"):
        _result(case)
