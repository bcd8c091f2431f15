"""Refusals only for a true reason (book-keeping): models whose examples do not interact — each example's loss
in the batch is its loss alone (:func:`support.independence_gap`) — and that book-keeping refused,
now exact against a float64 one-backward-per-example reference (norms and clipped sums), at T ≠ B, T = B
and on a right-padded batch with its mask; a model whose examples interact (batch statistics) stays refused.

The lifted uses: a layer's weight used directly in a functional operation (``F.conv1d(x, conv.weight)``,
``F.linear(x, lin.weight)``), a parameter in an elementwise operation other than + − × ÷ (``torch.maximum``),
``einsum`` with a relative-position kernel, ``nn.LayerNorm.forward(self, x)`` called by name, a LayerNorm with
an offset weight (``weight + 1``), a relative attention bias expanded to the batch and made contiguous (MPNet),
and position tables looked up at each example's own positions (``index_select``, indexing).  Small modules,
no transformers; MPNet and BEiT from tiny configs at the end.  Each runs through the harness of
``hf_architectures.py`` (registered in its table for the test: :func:`~hf_architectures.check`, float64, the
padded batch's ``attention_mask``).  Opacus's per-layer modes (hooks, ghost) on the same models: exact, or
refused naming the use they cannot attribute (:mod:`idpsgd.engine.guards.layer_inputs`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_architectures as harness
from hf_architectures import SHAPES, Case
from support import independence_gap

D, C, T_MAX = 4, 3, 8


def _pool(h, mask):
    """The mean over each example's own tokens (all of them without a mask)."""
    if mask is None:
        return h.mean(1)
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1)


class FunctionalConv(nn.Module):
    """``F.conv1d`` with a Conv1d layer's own weight and bias (the layer itself never called)."""

    def __init__(self):
        super().__init__()
        self.inp, self.conv, self.head = nn.Linear(D, D), nn.Conv1d(D, D, 3, padding=1), nn.Linear(D, C)

    def forward(self, x, mask=None):
        h = F.conv1d(self.inp(x).transpose(1, 2), self.conv.weight, self.conv.bias, padding=1)
        return self.head(_pool(torch.tanh(h.transpose(1, 2)), mask))


class FunctionalLinear(nn.Module):
    """``F.linear`` with a Linear layer's weight only (its bias unused)."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x, mask=None):
        return self.head(_pool(torch.tanh(F.linear(x, self.lin.weight)), mask))


class Decay(nn.Module):
    """A parameter in ``torch.maximum`` with the batch's rows (a floor on a decay rate)."""

    def __init__(self):
        super().__init__()
        self.decay = nn.Parameter(torch.linspace(-0.5, 0.5, D))
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x, mask=None):
        return self.head(_pool(torch.maximum(self.decay, self.lin(x)), mask))


class RelativeKernel(nn.Module):
    """Attention scores from ``einsum`` of the queries with a relative-position kernel parameter (T, T, d)."""

    def __init__(self):
        super().__init__()
        self.q, self.head = nn.Linear(D, D), nn.Linear(D, C)
        self.kernel = nn.Parameter(0.3 * torch.randn(T_MAX, T_MAX, D))

    def forward(self, x, mask=None):
        t = x.shape[1]
        scores = torch.einsum("bld,lrd->blr", self.q(x), self.kernel[:t, :t])
        if mask is not None:
            scores = scores + (mask[:, None, :].to(scores.dtype) - 1) * 1e4
        return self.head(_pool(torch.softmax(scores, -1) @ x, mask))


class BaseForwardNorm(nn.LayerNorm):
    """A LayerNorm subclass calling the base forward by name (not ``super()``)."""

    def forward(self, x):
        return nn.LayerNorm.forward(self, x) * 2.0


class OffsetNorm(nn.LayerNorm):
    """A LayerNorm whose weight is offset by one (weight 0 is the identity scale)."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class Normed(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(D, D), norm, nn.Linear(D, C)
        with torch.no_grad():
            self.norm.weight.normal_(0, 0.3)
            self.norm.bias.normal_(0, 0.3)

    def forward(self, x, mask=None):
        return self.head(_pool(self.norm(self.lin(x)), mask))


class RelativeBias(nn.Module):
    """MPNet's relative attention bias: an Embedding of (T, T) buckets shared by the batch, permuted, expanded
    to the batch and made contiguous, then added in place to every example's scores."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, C)
        self.relative_attention_bias = nn.Embedding(2 * T_MAX, 2)

    def forward(self, x, mask=None):
        b, t = x.shape[:2]
        pos = torch.arange(t)
        buckets = pos[None, :] - pos[:, None] + T_MAX
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)
        bias = bias.expand((b, -1, t, t)).contiguous()
        q, k = self.q(x).view(b, t, 2, D // 2).transpose(1, 2), self.k(x).view(b, t, 2, D // 2).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)
        scores += bias
        if mask is not None:
            scores = scores + (mask[:, None, None, :].to(scores.dtype) - 1) * 1e4
        h = (torch.softmax(scores, -1) @ x.view(b, t, 2, D // 2).transpose(1, 2)).transpose(1, 2).reshape(b, t, D)
        return self.head(_pool(h, mask))


def _positions(x, mask):
    """fairseq's positions: counted from 1 over each example's own tokens (0 at its pads)."""
    m = torch.ones(x.shape[:2], dtype=torch.long) if mask is None else mask.long()
    return torch.cumsum(m, dim=1) * m


class SinusoidalPositions(nn.Module):
    """fairseq's (M2M100, XGLM) sinusoidal table, a buffer, gathered with ``index_select`` at positions counted
    per example."""

    def __init__(self):
        super().__init__()
        angles = torch.arange(T_MAX + 1)[:, None] / 10 ** (torch.arange(D)[None, :] / D)
        self.register_buffer("weights", torch.where(torch.arange(D) % 2 == 0, angles.sin(), angles.cos()))
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x, mask=None):
        pos = _positions(x, mask)
        table = self.weights.index_select(0, pos.view(-1)).view(*pos.shape, -1)
        return self.head(_pool(torch.tanh(self.lin(x) + table), mask))


class LearnedPositions(nn.Module):
    """A learned position table (an Embedding's weight) looked up by indexing at positions counted per
    example."""

    def __init__(self):
        super().__init__()
        self.pos, self.lin, self.head = nn.Embedding(T_MAX + 1, D), nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x, mask=None):
        return self.head(_pool(torch.tanh(self.lin(x) + self.pos.weight[_positions(x, mask)]), mask))


LIFTED = {
    "F.conv1d with a layer's weight": FunctionalConv,
    "F.linear with a layer's weight": FunctionalLinear,
    "torch.maximum with a parameter": Decay,
    "einsum with a relative-position kernel": RelativeKernel,
    "nn.LayerNorm.forward(self, x)": lambda: Normed(BaseForwardNorm(D)),
    "LayerNorm with weight + 1": lambda: Normed(OffsetNorm(D)),
    "relative attention bias expanded to the batch": RelativeBias,
    "sinusoidal table index_select": SinusoidalPositions,
    "learned table indexed per example": LearnedPositions,
}


def _factory(make):
    """The harness's form of a small model: ``factory(B, T)`` -> :class:`~hf_architectures.Case` (features x of
    (B, T, D), labels y; the loss reads the padded batch's ``attention_mask`` when the harness adds one)."""

    def factory(B, T):
        g = torch.Generator().manual_seed(1)
        inputs = {"x": torch.randn((B, T, D), generator=g), "y": torch.randint(0, C, (B,), generator=g)}

        def loss(m, inp):
            return F.cross_entropy(m(inp["x"], inp.get("attention_mask")), inp["y"], reduction="none")

        return Case(make(), inputs, loss, T)

    return factory


@pytest.fixture
def registered(monkeypatch):
    """Register a factory in the harness's table for the test: ``registered(name, factory)`` -> the name."""

    def register(name, factory):
        monkeypatch.setitem(harness.ALL, name, factory)
        return name

    return register


def _gap(name, B, T, mask) -> float:
    case = harness.build(name, B, T, mask=mask)
    return independence_gap(case.model, case.inputs, case.loss)


@pytest.mark.parametrize("mask", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(LIFTED))
def test_an_independent_model_is_exact(registered, name, shape, mask):
    key = registered(name, _factory(LIFTED[name]))
    assert _gap(key, *SHAPES[shape], mask) < 1e-12  # each example's loss is its own: a refusal would be false
    outcome = harness.check(key, *SHAPES[shape], mask=mask)
    assert outcome.status == "exact", str(outcome)


class BatchStatistics(nn.Module):
    """Batch normalisation in training (statistics of the whole batch) before a layer's weight used in
    ``F.linear``: every example's loss depends on the others."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x, mask=None):
        h = F.batch_norm(self.inp(x).transpose(1, 2), None, None, training=True).transpose(1, 2)
        return self.head(_pool(F.linear(h, self.lin.weight), mask))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_model_whose_examples_interact_stays_refused(registered, shape):
    key = registered("batch statistics", _factory(BatchStatistics))
    assert _gap(key, *SHAPES[shape], False) > 1e-3  # the examples really interact
    outcome = harness.check(key, *SHAPES[shape])
    assert outcome.status == "refused" and "batch_norm" in outcome.detail, str(outcome)


class LookupOfMixedPositions(nn.Module):
    """A table looked up at positions computed from the whole batch (a cumulative sum down the batch
    dimension): the lookup follows the indices' rows, which mix the examples."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Embedding(64, D), nn.Linear(D, C)

    def forward(self, x, mask=None):
        pos = (x[..., 0] > 0).long().cumsum(0)
        return self.head(_pool(torch.tanh(x + self.pos.weight[pos]), mask))


def test_a_lookup_at_positions_that_mix_the_examples_is_refused(registered):
    key = registered("mixed positions", _factory(LookupOfMixedPositions))
    assert _gap(key, *SHAPES["T!=B"], False) > 1e-3
    outcome = harness.check(key, *SHAPES["T!=B"])
    assert outcome.status == "refused" and "cumsum" in outcome.detail, str(outcome)


# --- tiny transformers models --------------------------------------------------------------------
def _mpnet(B, T):
    t = harness._tf()
    return harness._encoder(t.MPNetForSequenceClassification(t.MPNetConfig(**harness._BERTLIKE)), B, T)


def _beit(B, T):
    t = harness._tf()
    cfg = t.BeitConfig(
        num_hidden_layers=2,
        hidden_size=harness.H,
        num_attention_heads=2,
        intermediate_size=37,
        image_size=8,
        patch_size=4,
        num_labels=harness.LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        use_relative_position_bias=True,
        use_mean_pooling=True,
    )
    return harness._image(t.BeitForImageClassification(cfg), B, 5)


@pytest.mark.parametrize(
    ("make", "B", "T", "mask"),
    [
        (_mpnet, *SHAPES["T!=B"], False),
        (_mpnet, *SHAPES["T=B"], False),
        (_mpnet, *SHAPES["T!=B"], True),
        (_mpnet, *SHAPES["T=B"], True),
        (_beit, 3, 5, False),
        (_beit, 5, 5, False),  # BEiT's sequence: 4 patches and the class token
    ],
)
def test_tiny_transformers_models(registered, make, B, T, mask):
    """MPNet (a relative attention bias expanded to the batch and made contiguous: refused before) and BEiT
    (LayerNorms after blocks with a relative position bias, mean pooling)."""
    pytest.importorskip("transformers")
    key = registered(make.__name__, make)
    assert _gap(key, B, T, mask) < 1e-12
    outcome = harness.check(key, B, T, mask=mask)
    assert outcome.status == "exact", str(outcome)


# --- Opacus's per-layer modes on the same models: exact, or refused for a true reason ---------------------
def _engine_step(case: Case, mode: str, clips: torch.Tensor):
    """(norms, update Σ_i min(1, c_i/‖g_i‖) g_i) of one private step in ``mode`` over the whole batch (q = 1,
    summed loss, noise σ = 1e-9: the update is the clipped sum to 1e-9)."""
    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    from idpsgd.engine.privacy_engine import IndividualizedPrivacyEngine

    model, (x, y) = case.model, (case.inputs["x"], case.inputs["y"])
    B = len(x)
    before = [p.detach().clone() for p in model.parameters()]
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=3)
    ghost = {"criterion": nn.CrossEntropyLoss(reduction="sum")} if mode == "ghost" else {}
    out = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        budgets=np.full(B, 1e4),
        target_delta=1e-5,
        sample_rates=np.ones(B),
        clip_norms=clips.numpy(),
        noise_multiplier=1e-9,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        privacy_filter=None,
        loss_reduction="sum",
        **ghost,
    )
    module, optimizer, loader = (out[0], out[1], out[3]) if ghost else out
    criterion = out[2] if ghost else nn.CrossEntropyLoss(reduction="sum")
    for xb, yb in loader:
        optimizer.zero_grad()
        criterion(module(xb), yb).backward()
        optimizer.step()
    order = np.argsort(engine.clipping.last_indices.numpy())
    norms = torch.as_tensor(engine.clipping.last_norms.numpy()[order])
    return norms, torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)])


def _per_layer_outcome(name: str, shape: str, mode: str) -> str:
    """ "exact", "refused: <message>" (the engine's LayerAttributionError) or "WRONG ..."/"crash ..."."""
    from idpsgd.engine.guards.layer_inputs import LayerAttributionError

    case = harness.build(name, *SHAPES[shape])
    _, grads = harness.reference(case)
    ref_norms = grads.norm(dim=1)
    clips = ref_norms * torch.linspace(0.3, 1.5, len(ref_norms), dtype=ref_norms.dtype)
    factors = torch.clamp(clips / (ref_norms + 1e-6), max=1.0)
    try:
        norms, update = _engine_step(case, mode, clips)
    except LayerAttributionError as exc:
        return f"refused: {exc}"
    except Exception as exc:  # any other error: not a refusal with a reason of the per-layer modes
        return f"crash: {type(exc).__name__}: {exc}"
    expected = (factors[:, None] * grads).sum(0)
    norm_err = float(((norms - ref_norms).abs() / ref_norms).max())
    sum_err = float((update - expected).norm() / expected.norm())
    return "exact" if norm_err < 1e-6 and sum_err < 1e-6 else f"WRONG norms {norm_err:.1e}, sum {sum_err:.1e}"


#: what Opacus's per-layer modes can do with each lifted model (bk is exact on all of them)
PER_LAYER = {
    "F.conv1d with a layer's weight": "is used outside its layer's forward",
    "F.linear with a layer's weight": "is used outside its layer's forward",
    "torch.maximum with a parameter": "exact",
    "einsum with a relative-position kernel": "exact",
    "nn.LayerNorm.forward(self, x)": "exact",
    "LayerNorm with weight + 1": "exact",
    "relative attention bias expanded to the batch": "leading dimension is not the batch's",
    "sinusoidal table index_select": "exact",
    "learned table indexed per example": "is used outside its layer's forward",
}


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(PER_LAYER))
def test_per_layer_modes_are_exact_or_refuse_for_a_true_reason(registered, name, shape, mode):
    """Opacus's hooks and ghost clipping take a layer's gradient from the layer's own calls and the leading
    dimension of its input for the examples: a relative bias table fed (T, T) buckets was silently wrong at
    T = B (norms 3e-3 off) and a weight used only in a functional op crashed ghost mode; both are refused
    now, naming book-keeping, which is exact on them."""
    outcome = _per_layer_outcome(registered(name, _factory(LIFTED[name])), shape, mode)
    want = PER_LAYER[name]
    if want == "exact":
        assert outcome == "exact", outcome
    else:
        assert outcome.startswith("refused") and want in outcome and "grad_sample_mode='bk'" in outcome, outcome


def test_a_copy_of_a_model_with_a_fallback_layer_runs_plain():
    """A deep copy of a book-kept model (the reference's, a checkpoint's) copies a fallback layer's hooks without
    their keeper: the copy runs plain (it crashed in its forward: BiT at T = B, found by the survey)."""
    import copy

    from idpsgd.engine.per_example.bk.keeper import BookKeeper

    class Scaled(nn.Module):  # no rule, no Opacus grad sampler: a fallback unit
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.linspace(0.5, 1.5, D))

        def forward(self, x):
            return torch.tanh(x * self.a)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), Scaled(), nn.Linear(D, C)).double()
    keeper = BookKeeper.attach(model)
    keeper.active = True
    x, y = torch.randn(5, D, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
    F.cross_entropy(model(x), y).backward()
    keeper.norms()
    keeper.clear()
    twin = copy.deepcopy(model)
    F.cross_entropy(twin(x), y).backward()
    assert twin[1].a.grad is not None


# --- found by the survey on the merged engine: Youtu's filled keys, LFM2's recurrent mask -------------------
class _FilledKeys(nn.Module):
    """Youtu's attention: keys built in a ``new_empty`` filled by two ``copy_`` of batch rows into its slices."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 3), nn.Linear(4, 2), nn.Linear(5, 3)

    def forward(self, x):
        h1, h2 = self.a(x), self.b(x)
        k = h1.new_empty(*h1.shape[:-1], 5)
        k[..., :3].copy_(h1)
        k[..., 3:].copy_(h2)
        return self.out(torch.tanh(k @ k.transpose(1, 2)) @ k).mean(1)


def test_batch_rows_copied_into_a_new_empty_are_the_examples_rows():
    """bk attributes a tensor filled by ``copy_`` of batch rows into its slices (it was refused: "matmul with a
    batch-independent operand whose rows differ")."""
    from test_bookkeeping import _check_equal, _data

    x, y = _data((5, 4))
    _check_equal(_FilledKeys().double(), x, y, opacus=False)


@pytest.mark.filterwarnings("ignore")
def test_lfm2s_recurrent_mask_fast_path_is_allowed_and_exact():
    """transformers' ``create_recurrent_attention_mask`` reads ``torch.all(mask == 1)`` of the whole batch to skip
    a masking multiply by ones (LFM2): an allowed mask fast path, bk exact on a padded batch."""
    pytest.importorskip("transformers")
    import hf_enumeration as en

    classes = {(t, task): cls for t, task, cls in en.architectures()}
    record = en.survey_one("lfm2", "causal-lm", classes["lfm2", "causal-lm"], ("bk",))
    assert en.outcome(record, "bk")[0] == "exact", en.outcome(record, "bk")
