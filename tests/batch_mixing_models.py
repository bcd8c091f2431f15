"""Models for the batch-independence tests (issue 35): four that mix the examples of a batch (the privacy
review's), and accepted ones (MLP, CNN, tiny GPT-2 and BERT from configs, no download), each as a
:class:`sensitivity_harness.Case` in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from opacus.layers import DPMultiheadAttention
from torch import nn

from sensitivity_harness import Case

N, D, K = 6, 5, 3  # examples, features, classes


class Centered(nn.Module):
    """``x - x.mean(0)``: every example's input is centred by the batch mean."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, K)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x - x.mean(0))))


class FunctionalBatchNorm(nn.Module):
    """``F.batch_norm(training=True)``: batch statistics, no module for Opacus's validator to see."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, K)

    def forward(self, x):
        return self.fc2(torch.tanh(F.batch_norm(self.fc1(x), None, None, training=True)))


class BatchAttention(nn.Module):
    """Attention over the batch dimension (a sequence-first attention layer fed (B, 1, d))."""

    def __init__(self):
        super().__init__()
        self.fc1, self.attn, self.fc2 = nn.Linear(D, 8), DPMultiheadAttention(8, 2), nn.Linear(8, K)

    def forward(self, x):
        h = self.fc1(x).unsqueeze(1)
        h, _ = self.attn(h, h, h)
        return self.fc2(torch.tanh(h.squeeze(1)))


class _HiddenMean(nn.Module):
    def forward(self, h):
        return h + 0.25 * h.mean(0, keepdim=True)


class HiddenMean(nn.Module):
    """A mean over the batch of a hidden layer, inside a submodule (``block.mix``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, K)
        self.block = nn.Sequential()
        self.block.add_module("mix", _HiddenMean())

    def forward(self, x):
        return self.fc2(torch.tanh(self.block(self.fc1(x))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4 * 4 * 4, K)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


def _seeded(cls):
    def build():
        torch.manual_seed(0)
        return cls().double()

    return build


def _vector_case(cls, shape=(D,)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn((N, *shape), generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (N,), generator=g)

    def draw(gen):  # large inputs: ‖g_z‖ well above c, so a model without mixing gives exactly c
        return 20 * torch.randn(shape, generator=gen, dtype=torch.float64), torch.randint(0, K, (), generator=gen)

    return Case(_seeded(cls), x, y, draw)


MIXING = {
    "centered": (Centered, "torch.Tensor.mean"),
    "batch_norm": (FunctionalBatchNorm, "torch.nn.functional.batch_norm"),
    "batch_attention": (BatchAttention, "'attn' (DPMultiheadAttention)"),
    "hidden_mean": (HiddenMean, "'block.mix' (_HiddenMean)"),
}


def mixing_case(name: str) -> Case:
    return _vector_case(MIXING[name][0])


# --- accepted models ---------------------------------------------------------------------------------
T, V = 6, 31


def _gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=19, vocab_size=V,
        max_position_embeddings=16, num_labels=K, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def _positions(x):
    return torch.arange(x.shape[1]).repeat(x.shape[0], 1)  # per example (Opacus's hooks need the batch)


def _lm_loss(logits, y):
    tokens = F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="none")
    return tokens.view(len(y), -1).mean(1)


def _text_case(builder, lm: bool) -> Case:
    def build():
        torch.manual_seed(0)
        return builder().double().train()

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (N, T), generator=g)
    y = x.clone() if lm else torch.randint(0, K, (N,), generator=g)

    def draw(gen):
        ids = torch.randint(0, V, (T,), generator=gen)
        return ids, (ids.clone() if lm else torch.randint(0, K, (), generator=gen))

    def call(model, xb):
        return model(xb, position_ids=_positions(xb)).logits

    return Case(build, x, y, draw, call, _lm_loss if lm else _ce)


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def accepted_case(name: str) -> Case:
    if name == "mlp":
        return _vector_case(_MLP)
    if name == "cnn":
        return _vector_case(CNN, (1, 6, 6))
    if name == "gpt2":
        return _text_case(_gpt2, lm=True)
    if name == "bert":
        return _text_case(_bert, lm=False)
    raise KeyError(name)


class _MLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


ACCEPTED = ("mlp", "cnn", "gpt2", "bert")
