"""Model registry: the papers' architectures, all Opacus-compatible (no BatchNorm).

* ``digits_cnn`` — a small CNN for 8×8 digits (the default).
* ``tramer_boneh_mnist`` / ``tramer_boneh_cifar10`` — the tanh CNNs of Tramèr & Boneh 2021
  ("Differentially private learning needs better features"), used by IDP-SGD (Boenisch et al.).
* ``lenet5`` — LeNet-5 with tanh and average pooling (used by Thudi et al.).
* ``heo_svhn`` / ``heo_mnist`` — the PDP-SGD CNNs (Heo et al., App. C.2, Tables 4–5).
* ``resnet20`` — ResNet-20 (He et al. 2016) with GroupNorm instead of BatchNorm (Yu et al.).
* ``mlp`` — a two-layer perceptron for tabular (CSV) data.
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
        raise InvalidParameterError("model", name, f"takes images (channels, height, width); the dataset's inputs "
                                    f"have shape {shape} (use 'mlp' for tables)")
    try:
        return MODELS[name](shape, int(num_classes))
    except (RuntimeError, ValueError) as exc:
        need = _smallest_side(name, shape, num_classes)
        allowed = (f"needs images of at least {need}x{need} pixels" if need
                   else f"cannot take this input ({str(exc).splitlines()[0]})")
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
    body = nn.Sequential(nn.Conv2d(input_shape[0], 16, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2))
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 64), nn.Tanh(), nn.Linear(64, num_classes))


@register("tramer_boneh_mnist")
def tramer_boneh_mnist(input_shape, num_classes):
    # Tramèr & Boneh 2021, MNIST CNN (their models.py: cfg [(16, 8, 2, 2), 'M', (32, 4, 2, 0), 'M'],
    # MaxPool2d(2, stride=1), classifier Linear(32*4*4, 32) -> Tanh -> Linear(32, 10)); on 28x28:
    # 28 -conv-> 13 -pool-> 12 -conv-> 5 -pool-> 4.
    body = nn.Sequential(nn.Conv2d(input_shape[0], 16, 8, stride=2, padding=2), nn.Tanh(), nn.MaxPool2d(2, 1),
                         nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1))
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 32), nn.Tanh(), nn.Linear(32, num_classes))


@register("tramer_boneh_cifar10")
def tramer_boneh_cifar10(input_shape, num_classes):
    layers, c = [], input_shape[0]
    for width in (32, 64, 128):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.Tanh(), nn.Conv2d(width, width, 3, padding=1),
                   nn.Tanh(), nn.MaxPool2d(2)]
        c = width
    body = nn.Sequential(*layers)
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 128), nn.Tanh(), nn.Linear(128, num_classes))


@register("lenet5")
def lenet5(input_shape, num_classes):
    body = nn.Sequential(nn.Conv2d(input_shape[0], 6, 5, padding=2), nn.Tanh(), nn.AvgPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2))
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh(),
                         nn.Linear(84, num_classes))


@register("heo_svhn")
def heo_svhn(input_shape, num_classes):
    body = nn.Sequential(nn.Conv2d(input_shape[0], 6, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))
    n = _flat_size(body, input_shape)
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(n, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                         nn.Linear(84, num_classes))


@register("heo_mnist")
def heo_mnist(input_shape, num_classes):
    body = nn.Sequential(nn.Conv2d(input_shape[0], 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True))
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


FLAT_INPUT_MODELS = {"mlp"}      # every other model takes (C, H, W) images


@register("mlp")
def mlp(input_shape, num_classes):
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, 64), nn.Tanh(), nn.Linear(64, num_classes))


DEFAULT_MODEL = {"digits": "digits_cnn", "mnist": "tramer_boneh_mnist", "fashion-mnist": "tramer_boneh_mnist",
                 "cifar10": "tramer_boneh_cifar10", "svhn": "tramer_boneh_cifar10", "csv": "mlp"}
