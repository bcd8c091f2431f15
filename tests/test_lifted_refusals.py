"""Refusals only for a true reason (book-keeping): models whose examples do not interact — each example's loss
in the batch is its loss alone (:func:`hf_architectures.independence_gap`) — and that book-keeping refused,
now exact against a float64 one-backward-per-example reference (norms and clipped sums), at T ≠ B, T = B
and on a right-padded batch with its mask; a model whose examples interact (batch statistics) stays refused.

The lifted uses: a layer's weight used directly in a functional operation (``F.conv1d(x, conv.weight)``,
``F.linear(x, lin.weight)``), a parameter in an elementwise operation other than + − × ÷ (``torch.maximum``),
``einsum`` with a relative-position kernel, ``nn.LayerNorm.forward(self, x)`` called by name, a LayerNorm with
an offset weight (``weight + 1``), a relative attention bias expanded to the batch and made contiguous (MPNet),
and position tables looked up at each example's own positions (``index_select``, indexing).  Small modules,
no transformers; MPNet and BEiT from tiny configs at the end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_architectures import SHAPES, Case, check_case, independence_gap, padding_mask

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


def _case(model: nn.Module, B: int, T: int, mask: bool) -> Case:
    g = torch.Generator().manual_seed(1)
    x = torch.randn((B, T, D), generator=g, dtype=torch.float64)
    inputs = {"x": x, "y": torch.randint(0, C, (B,), generator=g)}
    if mask:
        inputs["mask"] = padding_mask(B, T)

    def loss(m, inp):
        return F.cross_entropy(m(inp["x"], inp.get("mask")), inp["y"], reduction="none")

    return Case(model, inputs, loss, T)


def _built(make, B, T, mask) -> Case:
    torch.manual_seed(0)
    return _case(make().double().train(), B, T, mask)


@pytest.mark.parametrize("mask", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(LIFTED))
def test_an_independent_model_is_exact(name, shape, mask):
    case = _built(LIFTED[name], *SHAPES[shape], mask)
    assert independence_gap(case) < 1e-12  # each example's loss is its own: a refusal would be false
    outcome = check_case(case)
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
def test_a_model_whose_examples_interact_stays_refused(shape):
    case = _built(BatchStatistics, *SHAPES[shape], False)
    assert independence_gap(case) > 1e-3  # the examples really interact
    outcome = check_case(case)
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


def test_a_lookup_at_positions_that_mix_the_examples_is_refused():
    case = _built(LookupOfMixedPositions, *SHAPES["T!=B"], False)
    assert independence_gap(case) > 1e-3
    outcome = check_case(case)
    assert outcome.status == "refused" and "cumsum" in outcome.detail, str(outcome)


# --- tiny transformers models --------------------------------------------------------------------
def _mpnet(B, T, mask):
    from hf_architectures import _BERTLIKE, _encoder, _tf

    t = _tf()
    torch.manual_seed(0)
    case = _encoder(t.MPNetForSequenceClassification(t.MPNetConfig(**_BERTLIKE)), B, T)
    case.model.double().train()
    if mask:
        case.inputs["attention_mask"] = padding_mask(B, T)
    return case


def _beit(B, T, mask):
    from hf_architectures import LABELS, H, _image, _tf

    t = _tf()
    torch.manual_seed(0)
    cfg = t.BeitConfig(
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        intermediate_size=37,
        image_size=8,
        patch_size=4,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        use_relative_position_bias=True,
        use_mean_pooling=True,
    )
    case = _image(t.BeitForImageClassification(cfg), B, 5)
    case.model.double().train()
    case.inputs["pixel_values"] = case.inputs["pixel_values"].double()
    return case


@pytest.mark.parametrize(
    ("make", "shape", "mask"),
    [
        (_mpnet, "T!=B", False),
        (_mpnet, "T=B", False),
        (_mpnet, "T!=B", True),
        (_mpnet, "T=B", True),
        (_beit, "T!=B", False),
        (_beit, "T=B", False),
    ],
)
def test_tiny_transformers_models(make, shape, mask):
    """MPNet (a relative attention bias expanded to the batch and made contiguous) and BEiT (LayerNorms after
    blocks with a relative position bias, mean pooling)."""
    pytest.importorskip("transformers")
    B, T = SHAPES[shape]
    if make is _beit and shape == "T=B":
        B = T = 5  # BEiT's sequence: 4 patches and the class token
    case = make(B, T, mask)
    assert independence_gap(case) < 1e-12
    outcome = check_case(case)
    assert outcome.status == "exact", str(outcome)
