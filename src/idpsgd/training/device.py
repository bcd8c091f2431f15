"""The training device from its name (``cpu``, ``cuda``, ``auto``, a torch device string): one place,
below the training loop and the PDP methods that both use it."""

from __future__ import annotations

import torch

from ..validation import InvalidParameterError

DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` (refused when no GPU is visible), ``auto`` (cuda if available), or a torch
    device string such as ``cuda:1``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidParameterError(
            "device", device, f"must be one of {', '.join(DEVICES)} or a torch device"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", device, "no CUDA device is available here; use cpu or auto")
    return dev
