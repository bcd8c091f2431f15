"""Argument checks shared by the library and the CLI.

Every check raises :class:`InvalidParameterError` (a ``ValueError``) whose message names the
argument, the offending value and what is allowed, e.g.
``sample_rate=1.5 is invalid: must be in (0, 1]``.  The CLI prints that one line and exits 2.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class InvalidParameterError(ValueError):
    """A user-supplied value is outside its allowed range."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"{name}={shown_value(value)} is invalid: {allowed}")


class UnreachableTargetError(ValueError):
    """A calibration target cannot be met; the message says what is reachable."""


def shown_value(value: Any) -> str:
    """A value as an error message shows it: plain numbers (never ``np.float64(0.0)``), strings
    quoted, lists joined by commas, an array by its shape and range (never its entries)."""
    if isinstance(value, (list, tuple)):
        return ",".join(shown_value(v) for v in value)
    arr = np.asarray(value)
    if arr.ndim == 0:
        v = value.item() if hasattr(value, "item") else value
        return str(v) if isinstance(v, (int, float)) else repr(v)
    flat = arr.ravel()
    return (
        f"array(shape={arr.shape}, min={flat.min() if flat.size else 'n/a'}, max={flat.max() if flat.size else 'n/a'})"
    )


def refuse_where(name: str, arr: np.ndarray, bad: np.ndarray, allowed: str) -> None:
    if np.any(bad):
        if arr.ndim == 0:
            raise InvalidParameterError(name, arr.item(), allowed)
        first = float(arr.ravel()[np.flatnonzero(bad.ravel())[0]])
        raise InvalidParameterError(name, first, "every value " + allowed.removeprefix("every value "))


def check_sample_rate(value, name: str = "sample_rate", allow_zero: bool = False) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    lo_ok = arr >= 0 if allow_zero else arr > 0
    refuse_where(name, arr, ~(lo_ok & (arr <= 1)), "must be in [0, 1]" if allow_zero else "must be in (0, 1]")
    return arr


def check_noise_multiplier(value, name: str = "noise_multiplier", allow_inf: bool = True) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    ok = (arr > 0) & (np.isfinite(arr) | (allow_inf & (arr == np.inf)))
    refuse_where(name, arr, ~ok, "must be > 0" + (" (inf allowed)" if allow_inf else " and finite"))
    return arr


def check_delta(value, name: str = "delta") -> float:
    v = float(value)
    if not (0 < v < 1) or math.isnan(v):
        raise InvalidParameterError(name, value, "must be in (0, 1)")
    return v


def check_epsilon(value, name: str = "epsilon") -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    refuse_where(name, arr, ~((arr > 0) & np.isfinite(arr)), "must be > 0 and finite")
    return arr


def check_steps(value, name: str = "steps") -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, value, "must be an integer >= 1") from None
    if v != value and not (isinstance(value, float) and value.is_integer()):
        raise InvalidParameterError(name, value, "must be an integer >= 1")
    if v < 1:
        raise InvalidParameterError(name, value, "must be an integer >= 1")
    return v


def check_positive(value, name: str) -> float:
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise InvalidParameterError(name, value, "must be > 0 and finite")
    return v


def check_positive_array(value, name: str) -> np.ndarray:
    """Every value > 0 and finite (returns a float array)."""
    arr = np.asarray(value, dtype=float)
    refuse_where(name, arr, ~((arr > 0) & np.isfinite(arr)), "must be > 0 and finite")
    return arr


def check_orders(orders) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(orders, dtype=float))
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidParameterError("orders", orders, "must be a non-empty 1-D sequence")
    refuse_where("orders", arr, ~((arr > 1) & np.isfinite(arr)), "every order must be > 1 and finite")
    return arr
