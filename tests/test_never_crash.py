"""Never a crash: what a model may legally do works exactly in every mode, and a failure inside the engine's
own per-example machinery is a refusal with a one-line reason — never a torch traceback (issue 47).

The three crash mechanisms the held-out architecture survey found, each as a small model without
transformers: an old-style ``torch.autograd.Function`` (no ``setup_context``) in a layer that takes the
whole-module fallback (``torch.func`` raised); an in-place write into a layer's output or a slice of it
(``q /= math.sqrt(d)``: the output was a view made inside a custom Function, bk's or the full backward
hook's); a masked write ``h[~mask] = 0`` into a layer's output on a padded batch (the same, and provenance
took the write for a mix of rows).  Each is checked against one backward pass per example (float64), in
bk, hooks and ghost.  Then the net (``engine/per_example/machinery.py``) in both directions: the machinery's failures
become :class:`MachineryRefusal` (the CLI's exit 2) before anything is released or charged, while the
model's own errors propagate unchanged.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd.engine import IndividualizedPrivacyEngine
from idpsgd.engine.opacus_compat import UnsupportedModuleError
from idpsgd.engine.per_example.bk.provenance import RefusedRows
from idpsgd.engine.per_example.machinery import MachineryRefusal
from support import per_example_grads
from test_bookkeeping import N, _check_equal, _data

pytestmark = pytest.mark.filterwarnings("ignore:Secure RNG turned off")


# --- the three mechanisms, as small models ---------------------------------------------------------
class _OldStyleScale(torch.autograd.Function):
    """x · w with a hand-written backward, in the old style: ``forward(ctx, ...)``, no ``setup_context``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class _Scale(nn.Module):
    """A layer no rule or grad sampler covers: the whole-module fallback (``torch.func``) in every mode."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return _OldStyleScale.apply(x, self.w)


class _OldFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.s, self.b = nn.Linear(4, 5), _Scale(5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.s(self.a(x))))


class _InPlace(nn.Module):
    """``q = self.q(x)`` scaled in place, all of it or a slice (attention's ``q /= math.sqrt(d)``)."""

    def __init__(self, part: str):
        super().__init__()
        self.q, self.b, self.part = nn.Linear(4, 6), nn.Linear(6, 3), part

    def forward(self, x):
        q = self.q(x)
        if self.part == "slice":
            q[..., :3] /= math.sqrt(3)
        else:
            q /= math.sqrt(3)
        return self.b(torch.tanh(q)).mean(1)


class _Masked(nn.Module):
    """``h[~mask] = 0`` on a padded batch: the padding positions of a layer's output zeroed in place."""

    def __init__(self, flip: bool = False):
        super().__init__()
        self.lin, self.b, self.flip = nn.Linear(4, 6), nn.Linear(6, 3), flip

    def forward(self, x):
        mask = x[..., 0] > -0.5  # each example's own padding
        if self.flip:  # another example's mask (the batch reversed): its rows are not each one example's
            mask = mask.flip(0)
        h = self.lin(x)
        h[~mask] = 0
        return self.b(torch.tanh(h)).mean(1)


class _InPlaceFallback(nn.Module):
    """An in-place write into the output of a layer bk takes from Opacus's grad sampler (Conv3d: no bk rule)."""

    def __init__(self):
        super().__init__()
        self.conv, self.b = nn.Conv3d(1, 2, 2), nn.Linear(8, 3)

    def forward(self, x):
        h = self.conv(x)
        h[:, :1] *= 0.5
        return self.b(torch.tanh(h).flatten(1))


class _TiedLM(nn.Module):
    """Input and output embeddings tied (GPT-2, T5, ALBERT): one parameter in two layers."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb, self.mix, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids)))).mean(1)


def _model(make):
    torch.manual_seed(0)
    return make().double()


def _private_step(model, x, y, mode, clips=None):
    """(engine, module, optimizer, criterion, loader) over all N examples (q = 1, no filter), in any mode
    (ghost's make_private also returns Opacus's loss wrapper)."""
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=3)
    out = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=N),
        budgets=np.full(N, 1e4),
        target_delta=1e-5,
        sample_rates=np.ones(N),
        clip_norms=np.ones(N) if clips is None else clips,
        noise_multiplier=0.01,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        privacy_filter=None,
    )
    module, optimizer, criterion, data = out if mode == "ghost" else (*out[:2], nn.CrossEntropyLoss(), out[2])
    return engine, module, optimizer, criterion, data


def _steps(model, x, y, mode, clips):
    """Two private steps over all N examples (q = 1) in ``mode``: (the last step's norms, parameters after)."""
    model = copy.deepcopy(model)
    engine, module, optimizer, criterion, data = _private_step(model, x, y, mode, clips)
    for _ in range(2):
        for xb, yb in data:
            optimizer.zero_grad()
            criterion(module(xb), yb).backward()
            optimizer.step()
    order = np.argsort(engine.clipping.last_indices.numpy())
    return engine.clipping.last_norms.numpy()[order], [p.detach().clone() for p in model.parameters()]


def _exact_in_every_mode(model, x, y):
    """bk against one backward pass per example (norms and clipped sum) and two steps of bk == of hooks
    (``_check_equal``: norms and parameters); two steps of ghost == of hooks (the same seed draws the same
    batches and noise)."""
    _check_equal(model, x, y)
    norms = per_example_grads(copy.deepcopy(model), x, y).norm(dim=1).numpy()
    clips = np.where(np.arange(N) % 2 == 0, 0.3, 3.0) * norms
    ghost_norms, ghost_params = _steps(model, x, y, "ghost", clips)
    hooks_norms, hooks_params = _steps(model, x, y, "hooks", clips)
    np.testing.assert_allclose(ghost_norms, hooks_norms, rtol=1e-10, atol=1e-12)
    for a, b in zip(ghost_params, hooks_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_an_old_style_autograd_function_in_a_fallback_layer_is_exact_in_every_mode():
    x, y = _data((4,))
    _exact_in_every_mode(_model(_OldFunction), x, y)


@pytest.mark.parametrize("part", ["whole", "slice"])
def test_an_in_place_write_into_a_layer_output_is_exact_in_every_mode(part):
    x, y = _data((5, 4))
    _exact_in_every_mode(_model(lambda: _InPlace(part)), x, y)


def test_an_in_place_write_into_a_grad_sampler_layers_output_is_exact_in_every_mode():
    x, y = _data((1, 2, 3, 3))
    _exact_in_every_mode(_model(_InPlaceFallback), x, y)


def test_ghost_clipping_trains_tied_embeddings_exactly():
    """Opacus refuses parameter tying under ghost clipping (a NotImplementedError that escaped as a crash on
    every model with tied embeddings); the tied layers take the per-sample-gradient path instead."""
    x, y = _data((5,), classes=11, ids=11)
    _exact_in_every_mode(_model(_TiedLM), x, y)


def test_a_masked_write_into_a_layer_output_on_a_padded_batch_is_exact_in_every_mode():
    x, y = _data((5, 4))
    assert 0 < int((x[..., 0] <= -0.5).sum()) < x[..., 0].numel()  # a padded batch: some positions masked
    _exact_in_every_mode(_model(_Masked), x, y)
    # the mask must be each example's own: a mask of the batch reversed mixes examples, refused by provenance
    flipped = _model(lambda: _Masked(flip=True))
    _, module, _, _, data = _private_step(flipped, x, y, "bk")
    xb, _ = next(iter(data))
    with pytest.raises(RefusedRows, match="__setitem__"):
        module(xb)


# --- the net: the machinery's failures are refusals, the model's own errors are not ----------------
def _train_one_step(mode, model=None, x=None):
    """(engine, model, the error one private step raised or None, parameters before)."""
    model = model if model is not None else _model(lambda: _InPlace("whole"))
    x, y = _data((5, 4)) if x is None else x
    engine, module, optimizer, criterion, data = _private_step(model, x, y, mode)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        for xb, yb in data:
            optimizer.zero_grad()
            criterion(module(xb), yb).backward()
            optimizer.step()
    except Exception as exc:  # the test inspects it
        return engine, model, exc, before
    return engine, model, None, before


def _nothing_released(engine, model, before):
    """A refused step drew no noise and charged nothing: the parameters are as they were, no step counted."""
    assert engine.steps == 0
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a.detach(), b)


def _boom(*_args, **_kwargs):
    raise IndexError("boom in the machinery")


@pytest.mark.parametrize(
    ("mode", "patch", "where"),
    [
        (
            "bk",
            lambda mp: mp.setattr("idpsgd.engine.per_example.bk.units.Layer.record", _boom),
            "layer 'b' (Linear), its backward",
        ),
        (
            "bk",
            lambda mp: mp.setattr("idpsgd.engine.per_example.bk.provenance.ProvenanceMode._propagate", _boom),
            "layer",
        ),
        (
            "bk",
            lambda mp: mp.setattr("idpsgd.engine.per_example.bk.keeper.BookKeeper.norms", _boom),
            "per-example norm pass",
        ),
        ("hooks", lambda mp: mp.setitem(GradSampleModule.GRAD_SAMPLERS, nn.Linear, _boom), "layer 'b' (Linear)"),
        (
            "ghost",
            lambda mp: mp.setitem(GradSampleModuleFastGradientClipping.NORM_SAMPLERS, nn.Linear, _boom),
            "layer 'b' (Linear)",
        ),
    ],
    ids=["bk-backward", "bk-provenance", "bk-norms", "hooks-grad-sampler", "ghost-norm-sampler"],
)
def test_a_failure_inside_the_machinery_is_a_one_line_refusal_before_anything_is_released(
    monkeypatch, mode, patch, where
):
    patch(monkeypatch)
    engine, model, exc, before = _train_one_step(mode)
    assert isinstance(exc, MachineryRefusal), repr(exc)
    text = str(exc)
    assert "\n" not in text and where in text and "IndexError: boom in the machinery" in text
    assert text.startswith(f"grad_sample_mode={mode!r}: the engine's per-example machinery failed at")
    _nothing_released(engine, model, before)


def test_a_forward_failure_of_the_machinery_names_the_models_line(monkeypatch):
    monkeypatch.setattr("idpsgd.engine.per_example.bk.provenance.ProvenanceMode._propagate", _boom)
    _, _, exc, _ = _train_one_step("bk")
    assert isinstance(exc, MachineryRefusal)
    assert "test_never_crash.py:" in str(exc)  # the model's own line where the machinery failed


class _ActWithBuffer(nn.Module):
    """A trainable activation with a constant buffer (transformers' XIELU: its parameters and an eps)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(1))
        self.register_buffer("eps", torch.tensor(1e-3))

    def forward(self, x):
        return torch.tanh(x * self.a + self.eps)


class _Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act, self.b = nn.Linear(4, 5), _ActWithBuffer(), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(self.act(self.lin(x)))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_a_trainable_layer_with_buffers_is_refused_at_make_private_in_opacus_modes(mode):
    """Opacus's NotImplementedError ("Model contains a trainable layer with buffers") escaped make_private as
    a crash; it is a refusal naming the layer and the mode that trains it (bk: exact, below)."""
    x, y = _data((4,))
    with pytest.raises(UnsupportedModuleError, match=r"layer 'act' \(_ActWithBuffer\).*grad_sample_mode='bk'"):
        _private_step(_model(_Buffered), x, y, mode)
    _check_equal(_model(_Buffered), x, y, opacus=False)


class _Positions(nn.Module):
    """Token and position embeddings, the positions looked up with ids of shape (1, T) (GPT-2, BERT)."""

    def __init__(self, vocab=11, dim=6, length=8):
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(vocab, dim), nn.Embedding(length, dim), nn.Linear(dim, 3)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.out(torch.tanh(self.tok(ids) + self.pos(positions))).mean(1)


def test_ghost_refuses_a_layer_shared_by_the_batch_with_a_reason_not_a_stack_error():
    """A position embedding looked up with (1, T) ids gets one row of norms (its output is shared by the batch):
    ghost clipping crashed stacking the norms ("stack expects each tensor to be equal size"); refused now,
    naming the layer (the per-layer modes' layer-input check, or else the parameter's rows: BatchMismatchError).
    bk attributes it exactly."""
    from idpsgd.engine.guards.layer_inputs import LayerAttributionError
    from idpsgd.engine.sampling.sampler import BatchMismatchError

    engine, model, exc, before = _train_one_step("ghost", _model(_Positions), _data((5,), ids=11))
    assert isinstance(exc, (LayerAttributionError, BatchMismatchError)), repr(exc)
    assert "'pos" in str(exc) and "grad_sample_mode='bk'" in str(exc)
    _nothing_released(engine, model, before)
    x, y = _data((5,), ids=11)
    _check_equal(_model(_Positions), x, y, opacus=False)


class _TokenTypes(nn.Module):
    """Token type ids from a (1, T) buffer expanded to the batch (BERT): a stride-0 index."""

    def __init__(self):
        super().__init__()
        self.tok, self.typ, self.out = nn.Embedding(11, 6), nn.Embedding(2, 6), nn.Linear(6, 3)
        self.register_buffer("types", torch.zeros(1, 5, dtype=torch.long))

    def forward(self, ids):
        types = self.types[:, : ids.shape[1]].expand(ids.shape[0], -1)
        return self.out(torch.tanh(self.tok(ids) + self.typ(types))).mean(1)


def test_an_index_expanded_to_the_batch_is_exact_in_every_mode():
    """Opacus's ghost norm of an Embedding views its index: a stride-0 (expanded) one crashed it ("view size is
    not compatible with input tensor's size and stride", BERT's token type ids)."""
    x, y = _data((5,), ids=11)
    _exact_in_every_mode(_model(_TokenTypes), x, y)


class _Reused(nn.Module):
    """One Linear called twice in a forward: ghost clipping's norm of one use would miss the cross term."""

    def __init__(self):
        super().__init__()
        self.lin, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.lin(torch.tanh(self.lin(x))))).mean(1)


def test_an_error_opacus_raises_on_purpose_inside_the_machinery_is_a_refusal_of_both_classes():
    """Opacus's NotImplementedError for a layer reused under ghost clipping escaped as a crash; it is the
    engine's refusal now, naming the layer, and still a NotImplementedError for code written for Opacus."""
    engine, model, exc, before = _train_one_step("ghost", _model(_Reused))
    assert isinstance(exc, MachineryRefusal) and isinstance(exc, NotImplementedError), repr(exc)
    assert "layer 'lin' (Linear)" in str(exc) and "NotImplementedError: Parameter tying" in str(exc)
    _nothing_released(engine, model, before)


class _Broken(nn.Module):
    """A model with a bug of its own, once ``broken`` is set: a shape mismatch in its forward, with or without
    privacy (set after the first step: the batch-independence check runs the model at its first forward)."""

    def __init__(self):
        super().__init__()
        self.q, self.b, self.broken = nn.Linear(4, 6), nn.Linear(6, 3), False

    def forward(self, x):
        h = self.q(x)
        if self.broken:
            h = torch.cat([h, torch.ones(2, 6, dtype=x.dtype)], dim=1)
        return self.b(h).mean(1)


@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
def test_an_error_the_model_raises_on_its_own_is_not_relabelled(mode):
    model = _model(_Broken)
    x, y = _data((5, 4))
    engine, module, optimizer, criterion, data = _private_step(model, x, y, mode)
    for xb, yb in data:  # one step that works
        optimizer.zero_grad()
        criterion(module(xb), yb).backward()
        optimizer.step()
    model.broken = True
    alone_model = _model(_Broken)
    alone_model.broken = True
    with pytest.raises(RuntimeError) as alone:
        alone_model(x)  # the model alone, without the engine
    before = [p.detach().clone() for p in model.parameters()]
    for xb, yb in data:
        optimizer.zero_grad()
        with pytest.raises(RuntimeError) as private:
            criterion(module(xb), yb).backward()
    assert type(private.value) is type(alone.value) and str(private.value) == str(alone.value)
    assert engine.steps == 1
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a.detach(), b)


def test_the_cli_turns_the_refusal_into_exit_2_with_one_line(monkeypatch, capsys):
    import importlib

    cli = importlib.import_module("idpsgd.cli.main")
    from idpsgd.cli.registry import COMMANDS

    cli.build_parser()  # registers the commands
    help_text, add, _run = COMMANDS["demo"]

    def run(_args):
        raise MachineryRefusal("grad_sample_mode='bk': the engine's per-example machinery failed at layer 'x'")

    monkeypatch.setitem(COMMANDS, "demo", (help_text, add, run))
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err == "idpsgd demo: error: grad_sample_mode='bk': the engine's per-example machinery failed at layer 'x'\n"


# --- more mechanisms of the survey by enumeration ---------------------------------------------------
class _Unused(nn.Module):
    """A layer the forward never calls (a decoder's cross-attention without an encoder)."""

    def __init__(self):
        super().__init__()
        self.lin, self.spare, self.b = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.lin(x))).mean(1)


class _KeywordsOnly(nn.Module):
    """A layer called with keyword arguments only: Opacus's hooks saw no input (IndexError)."""

    def __init__(self):
        super().__init__()
        self.lin, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(input=torch.tanh(self.lin(input=x))).mean(1)


def test_an_unused_layer_is_exact_in_ghost_with_a_zero_norm():
    """Ghost clipping crashed on a parameter its first backward pass never reached ('Parameter' object has no
    attribute '_norm_sample'); its per-example gradient is 0."""
    x, y = _data((5, 4))
    clips = np.full(N, 0.5)
    ghost_norms, ghost_params = _steps(_model(_Unused), x, y, "ghost", clips)
    bk_norms, bk_params = _steps(_model(_Unused), x, y, "bk", clips)
    np.testing.assert_allclose(ghost_norms, bk_norms, rtol=1e-10, atol=1e-12)
    for a, b in zip(ghost_params, bk_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_layer_called_with_keyword_arguments_only_is_exact_in_every_mode():
    x, y = _data((5, 4))
    _exact_in_every_mode(_model(_KeywordsOnly), x, y)


class _Offset(nn.Embedding):
    """A learned position embedding called with an int offset (BART's ``embed_positions(ids, past_length)``)."""

    def forward(self, ids, offset):
        return super().forward(ids + offset)


class _WithOffset(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.out = _Offset(13, 6), nn.Linear(6, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.pos(ids, 2))).mean(1)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_layer_called_with_a_python_number_is_refused_with_a_reason_in_opacus_modes(mode):
    """Opacus's hooks crashed on a positional int ('int' object has no attribute 'detach'); a refusal naming the
    layer and the argument now, before anything is released.  bk trains it exactly."""
    x = _data((5,), ids=11)
    engine, model, exc, before = _train_one_step(mode, _model(_WithOffset), x)
    assert isinstance(exc, MachineryRefusal), repr(exc)
    assert "layer 'pos' (_Offset) is called with a positional argument that is not a tensor (int)" in str(exc)
    _nothing_released(engine, model, before)
    _check_equal(_model(_WithOffset), *x, opacus=False)


class _ChannelsLast(nn.Module):
    """ConvNeXt's block: a Linear on (B, H, W, C) rows (its pointwise convolutions)."""

    def __init__(self):
        super().__init__()
        self.conv, self.pw, self.b = nn.Conv2d(1, 4, 2), nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.pw(self.conv(x).permute(0, 2, 3, 1))
        return self.b(torch.tanh(h).mean((1, 2)))


def test_a_linear_on_four_dimensional_rows_is_exact_in_every_mode():
    """Opacus's ghost norm of a Linear returns nothing for a (B, H, W, C) input: ghost clipping crashed
    ('Parameter' object has no attribute '_norm_sample')."""
    x, y = _data((1, 4, 4))
    _exact_in_every_mode(_model(_ChannelsLast), x, y)


class _KeyScale(nn.Module):
    """ZAYA's QK norm: returns (queries, keys), its parameter acting on the keys (the second output) only."""

    def __init__(self):
        super().__init__()
        self.temp = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, q, k):
        return q * 2.0, k * self.temp


class _TwoOutputs(nn.Module):
    def __init__(self, use_keys=True):
        super().__init__()
        self.proj, self.norm, self.out = nn.Linear(4, 6), _KeyScale(), nn.Linear(3, 3)
        self.use_keys = use_keys

    def forward(self, x):
        q, k = self.proj(x).chunk(2, dim=-1)
        q, k = self.norm(q, k)
        return self.out(q + k if self.use_keys else q).mean(1)


@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost"])
def test_a_layer_whose_parameter_acts_on_a_later_output_is_refused_not_silently_wrong(mode):
    """A fallback layer's per-sample gradients come from its first output's gradient: one returning (q, k) with
    its parameter on k had per-example gradients of zero for it in bk (ZAYA, the survey's one silently wrong
    bk cell); the backward pass that reaches k is refused, before any noise, in every mode."""
    engine, model, exc, before = _train_one_step(mode, _model(_TwoOutputs), _data((5, 4)))
    assert isinstance(exc, MachineryRefusal), repr(exc)
    assert "several tensors" in str(exc) and "'norm'" in str(exc)
    _nothing_released(engine, model, before)


def test_the_later_output_walk_holds_the_nodes_it_compares():
    """The walk from a later output compares autograd nodes by id; torch makes a node's Python object on access and
    (torch 2.11) frees it with its last reference, so an id taken from a node not held was the next node's: the keys'
    node was taken for the queries' (a stop) and the refusal never came, in every one of these graphs. The walk now
    holds every node it compares (this test failed 50 of 50 on torch 2.11 before; torch 2.13 keeps the objects)."""
    from idpsgd.engine.per_example.output_hooks import refuse_later_outputs

    temp, lin = nn.Parameter(torch.full((1,), 0.5)), nn.Linear(4, 6)
    for _ in range(20):
        q, k = lin(torch.randn(5, 4)).chunk(2, dim=-1)
        out = (q * 2.0, k * temp)
        refuse_later_outputs(out, out[0], ((q, k), {}), [temp], lambda: "layer 'norm'", "bk")
        with pytest.raises(MachineryRefusal, match="several tensors"):
            (out[0] + out[1]).sum().backward()


def test_a_later_output_the_loss_does_not_use_is_fine():
    """Only a later output the loss depends on is refused: the same layer with its keys unused is exact."""
    x, y = _data((5, 4))
    model = _model(lambda: _TwoOutputs(use_keys=False))
    model.norm.temp.requires_grad_(False)  # no per-example gradient to form for it (the keys are unused)
    _exact_in_every_mode(model, x, y)


class _Router(nn.Module):
    """A router returning (logits, weights): the weights computed from the logits (Glm4-MoE's gate)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4) * 0.5)

    def forward(self, h):
        logits = F.linear(h, self.weight)
        return logits, logits.softmax(-1)


class _Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.out = _Router(), nn.Linear(3, 3)

    def forward(self, x):
        _, weights = self.gate(x)  # only the later output, computed from the first, reaches the loss
        return self.out(weights).mean(1)


def test_a_later_output_computed_from_the_first_is_exact_in_bk():
    """The first output's gradient carries what the loss takes through a later output computed from it: no
    refusal, bk's per-example gradients exact (a router's top-k weights from its logits, Glm4-MoE)."""
    x, y = _data((5, 4))
    _check_equal(_model(_Routed), x, y, opacus=False)


class _PaddedTable(nn.Module):
    """A token table with a padding row (the text table of Qwen2-Audio, Voxtral, ...), ids 0 at padded places."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(11, 6, padding_idx=0), nn.Linear(6, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids))).mean(1)


def test_ghost_norms_of_a_table_with_a_padding_row_leave_that_row_out():
    """Autograd gives the padding row no gradient; ghost clipping's Embedding norm counted the padding positions
    (norms up to 33 % high on padded batches of five audio language models in the survey): equal to hooks' and
    bk's now, which are checked against one backward pass per example."""
    x, y = _data((5,), ids=11)
    x[:, -2:] = 0  # padded ends
    _exact_in_every_mode(_model(_PaddedTable), x, y)
