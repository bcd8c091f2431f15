"""Model registry: the papers' architectures, all Opacus-compatible (no BatchNorm).

* ``digits_cnn`` — a small CNN for 8×8 digits (the default).
* ``tramer_boneh_mnist`` / ``tramer_boneh_cifar10`` — the tanh CNNs of Tramèr & Boneh 2021
  ("Differentially private learning needs better features"), used by IDP-SGD (Boenisch et al.).
* ``lenet5`` — LeNet-5 with tanh and average pooling (used by Thudi et al.).
* ``heo_svhn`` / ``heo_mnist`` — the PDP-SGD CNNs (Heo et al., App. C.2, Tables 4–5).
* ``resnet20`` — ResNet-20 (He et al. 2016) with GroupNorm instead of BatchNorm (Yu et al.).
* ``wrn16_4`` — WideResNet-16-4 with GroupNorm (De et al. 2022's CIFAR-10 model; :func:`wide_resnet`
  builds other depths and widths).
* ``mlp`` — a two-layer perceptron for tabular (CSV) data.

:class:`TransformerClassifier` (not in the registry: it takes token ids, which no bundled dataset
has) is a small transformer-encoder text classifier for the library and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .validation import InvalidParameterError

MODELS: dict[str, Callable[..., nn.Module]] = {}


def register(name: str):
    def deco(fn):
        MODELS[name] = fn
        return fn

    return deco


def create_model(name: str, input_shape: tuple, num_classes: int) -> nn.Module:
    """Build a registered model for inputs of ``input_shape`` (C, H, W) or (features,).

    A shape the architecture cannot take (too small for its convolutions and poolings, or not an
    image) is an :class:`InvalidParameterError` naming the model and the shape, never a torch error.
    """
    if name not in MODELS:
        raise InvalidParameterError("model", name, f"must be one of {sorted(MODELS)}")
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        raise InvalidParameterError("input_shape", input_shape, "must be a tuple of positive integers") from None
    if not shape or min(shape) < 1:
        raise InvalidParameterError("input_shape", input_shape, "must be a tuple of positive integers")
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or int(num_classes) < 2:
        raise InvalidParameterError("num_classes", num_classes, "must be an integer >= 2")
    if name not in FLAT_INPUT_MODELS and len(shape) != 3:
        raise InvalidParameterError(
            "model",
            name,
            f"takes images (channels, height, width); the dataset's inputs have shape {shape} (use 'mlp' for tables)",
        )
    try:
        return MODELS[name](shape, int(num_classes))
    except (RuntimeError, ValueError) as exc:
        need = _smallest_side(name, shape, num_classes)
        allowed = (
            f"needs images of at least {need}x{need} pixels"
            if need
            else f"cannot take this input ({str(exc).splitlines()[0]})"
        )
        raise InvalidParameterError("model", name, f"{allowed}; the dataset's input shape is {shape}") from None


def _smallest_side(name: str, shape: tuple, num_classes: int, limit: int = 256) -> int | None:
    """The smallest square image side the model accepts with ``shape``'s channels (error messages only)."""
    for side in range(max(shape[1:]) + 1, limit + 1):
        try:
            MODELS[name]((shape[0], side, side), int(num_classes))
            return side
        except (RuntimeError, ValueError):
            continue
    return None


def _flat_size(body: nn.Module, input_shape) -> int:
    with torch.no_grad():
        return int(body(torch.zeros(1, *input_shape)).numel())


def _cnn(body: nn.Sequential, head: list, input_shape) -> nn.Sequential:
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), *[n if m is None else m for m in head])


@register("digits_cnn")
def digits_cnn(input_shape, num_classes):
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
    )
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 64), nn.Tanh(), nn.Linear(64, num_classes))


@register("tramer_boneh_mnist")
def tramer_boneh_mnist(input_shape, num_classes):
    # Tramèr & Boneh 2021, MNIST CNN (their models.py: cfg [(16, 8, 2, 2), 'M', (32, 4, 2, 0), 'M'],
    # MaxPool2d(2, stride=1), classifier Linear(32*4*4, 32) -> Tanh -> Linear(32, 10)); on 28x28:
    # 28 -conv-> 13 -pool-> 12 -conv-> 5 -pool-> 4.
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 8, stride=2, padding=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
    )
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 32), nn.Tanh(), nn.Linear(32, num_classes))


@register("tramer_boneh_cifar10")
def tramer_boneh_cifar10(input_shape, num_classes):
    layers, c = [], input_shape[0]
    for width in (32, 64, 128):
        layers += [
            nn.Conv2d(c, width, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.Tanh(),
            nn.MaxPool2d(2),
        ]
        c = width
    body = nn.Sequential(*layers)
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 128), nn.Tanh(), nn.Linear(128, num_classes))


@register("lenet5")
def lenet5(input_shape, num_classes):
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 6, 5, padding=2),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.Tanh(),
        nn.AvgPool2d(2),
    )
    n = _flat_size(body, input_shape)
    return nn.Sequential(
        *body, nn.Flatten(), nn.Linear(n, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, num_classes)
    )


@register("heo_svhn")
def heo_svhn(input_shape, num_classes):
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)
    )
    n = _flat_size(body, input_shape)
    return nn.Sequential(
        *body, nn.Flatten(), nn.Linear(n, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes)
    )


@register("heo_mnist")
def heo_mnist(input_shape, num_classes):
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 8, stride=2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
    )
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 32), nn.ReLU(), nn.Linear(32, num_classes))


class _BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(min(16, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(min(16, cout), cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(min(16, cout), cout))
        self.act = nn.ReLU()

    def forward(self, x):
        out = self.act(self.gn1(self.conv1(x)))
        return self.act(self.gn2(self.conv2(out)) + self.short(x))


@register("resnet20")
def resnet20(input_shape, num_classes):
    layers = [nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False), nn.GroupNorm(16, 16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for b in range(3):
            layers.append(_BasicBlock(cin, cout, stride if b == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


class _WideBlock(nn.Module):
    """Pre-activation wide residual block (Zagoruyko & Komodakis 2016) with GroupNorm."""

    def __init__(self, cin, cout, stride, groups):
        super().__init__()
        self.gn1 = nn.GroupNorm(min(groups, cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn2 = nn.GroupNorm(min(groups, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.short = None if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride, bias=False)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.act(self.gn1(x))
        out = self.conv2(self.act(self.gn2(self.conv1(h))))
        return out + (x if self.short is None else self.short(h))


def wide_resnet(input_shape, num_classes, depth: int = 16, width: int = 4, groups: int = 16) -> nn.Sequential:
    """WRN-depth-width (Zagoruyko & Komodakis 2016) with GroupNorm of ``groups`` groups instead of
    BatchNorm, as De et al. 2022 train on CIFAR-10 with DP-SGD (they add weight standardisation,
    which this model leaves out: plain convolutions)."""
    if (depth - 4) % 6 or depth < 10:
        raise InvalidParameterError("depth", depth, "must be 6k + 4 >= 10 (10, 16, 22, 28, ...)")
    blocks = (depth - 4) // 6
    layers, cin = [nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False)], 16
    for stage, cout in enumerate((16 * width, 32 * width, 64 * width)):
        for b in range(blocks):
            layers.append(_WideBlock(cin, cout, 2 if stage and not b else 1, groups))
            cin = cout
    layers += [
        nn.GroupNorm(min(groups, cin), cin),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(cin, num_classes),
    ]
    return nn.Sequential(*layers)


@register("wrn16_4")
def wrn16_4(input_shape, num_classes):
    return wide_resnet(input_shape, num_classes, 16, 4)


class SelfAttention(nn.Module):
    """Multi-head self-attention on batch-first (B, T, d) inputs, built from ``nn.Linear`` layers (so
    Opacus's per-sample gradients and the book-keeping rules cover it).  Not Opacus's
    ``DPMultiheadAttention``: with ``batch_first=True`` that layer (Opacus 1.6) merges the heads back
    in the wrong order and computes another function than ``nn.MultiheadAttention``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise InvalidParameterError("heads", heads, f"must divide the model dimension {dim}")
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape

        def split(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        h = torch.nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.out(h.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    """Pre-LayerNorm transformer-encoder block: x + attention(LN(x)), then + MLP(LN(·))."""

    def __init__(self, dim: int, heads: int, ff_dim: int):
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(dim), SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, ff_dim), nn.GELU(), nn.Linear(ff_dim, dim))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerClassifier(nn.Module):
    """Token ids (B, T) → class logits: token and position embeddings, ``layers`` pre-LayerNorm
    encoder blocks (:class:`EncoderBlock`), a final LayerNorm, mean pooling and a linear head."""

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        *,
        max_length: int = 128,
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        ff_dim: int = 256,
        padding_idx: int | None = None,
    ):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim, padding_idx=padding_idx)
        self.positions = nn.Embedding(max_length, dim)
        self.encoder = nn.Sequential(*[EncoderBlock(dim, heads, ff_dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)  # contiguous (Opacus views it)
        h = self.encoder(self.tokens(ids) + self.positions(pos))
        return self.head(self.norm(h).mean(1))


FLAT_INPUT_MODELS = {"mlp"}  # every other model takes (C, H, W) images


@register("mlp")
def mlp(input_shape, num_classes):
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, 64), nn.Tanh(), nn.Linear(64, num_classes))


DEFAULT_MODEL = {
    "digits": "digits_cnn",
    "mnist": "tramer_boneh_mnist",
    "fashion-mnist": "tramer_boneh_mnist",
    "cifar10": "tramer_boneh_cifar10",
    "svhn": "tramer_boneh_cifar10",
    "csv": "mlp",
}
