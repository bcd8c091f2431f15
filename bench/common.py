"""Shared helpers of the benchmarks: the registry (``@bench``), timing and the digits set-up."""

from __future__ import annotations

import time

BENCHES = {}


def bench(fn):
    BENCHES[fn.__name__.removeprefix("bench_")] = fn
    return fn


def resolve_device(name: str) -> str:
    """``cpu``, ``cuda``, or ``auto`` (cuda when available) -> the device a benchmark runs on; refused
    with the reason otherwise."""
    import torch

    from idpsgd.validation import InvalidParameterError

    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    if device not in ("cpu", "cuda"):
        raise InvalidParameterError("device", name, "must be cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", name, "CUDA is not available on this machine (use cpu)")
    return device


def parse_models(text: str, known) -> tuple[str, ...]:
    """A comma-separated subset of ``known`` (refused with the allowed names otherwise)."""
    from idpsgd.validation import InvalidParameterError

    models = tuple(m for m in text.split(",") if m)
    if not models or any(m not in known for m in models):
        raise InvalidParameterError("models", text, f"must be a comma-separated subset of {','.join(known)}")
    return models


def _timed(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _digits_setup():
    from idpsgd.data import load_dataset

    data = load_dataset("digits")
    return data, _demo_budgets(len(data.y_train), seed=0)


def _demo_budgets(n, seed):
    from idpsgd.cli.train_commands import demo_budgets

    return demo_budgets(n, 1e-5, seed)


def _opacus_epochs(data, sigma, cfg, epochs):
    """Plain Opacus DP-SGD (PrivacyEngine, Poisson DataLoader) on the same model, data and loop."""
    import warnings

    import torch
    import torch.nn.functional as F
    from opacus import PrivacyEngine

    from idpsgd.models import create_model
    from idpsgd.training import evaluate

    torch.manual_seed(cfg.seed)
    model = create_model("digits_cnn", data.input_shape, data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data.x_train, data.y_train), batch_size=cfg.batch_size
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma, max_grad_norm=cfg.clip_norm
        )
        t = time.perf_counter()
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            evaluate(model, data.x_test, data.y_test, data.num_classes)
    return time.perf_counter() - t
