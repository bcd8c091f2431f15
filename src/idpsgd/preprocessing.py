"""Input normalization that stays inside the privacy guarantee (issue 16, item 2).

Standardizing with the private training set's exact mean and std is a release the DP-SGD
guarantee does not cover.  The options here are the ones that are covered:

* ``none`` — the fixed, data-independent scaling only (pixels / 255, digits / 16, CSV as is);
* ``public`` — published constants per dataset (:data:`PUBLIC_CONSTANTS`, computed by others
  on the standard training sets long ago and printed in countless papers and code bases; we treat
  them as public knowledge, as the DP-SGD literature does);
* a user-given ``(mean, std)`` — the user's responsibility that it is public;
* ``private`` — a differentially private estimate of the per-channel (images) or per-feature
  (tables) mean and std: the Gaussian mechanism, calibrated exactly (analytic Gaussian mechanism,
  Balle & Wang 2018, Thm. 8, via :func:`idpsgd.accounting.release.analytic_gaussian_sigma`) on
  values clipped to a *public* range, for add/remove neighbours.  Its (ε, δ) is recorded so
  the training layer charges it to every example (basic composition).

The estimate's sensitivity and post-processing: :func:`private_mean_std`.  User guide:
``docs/guarantees.md``.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

from .validation import InvalidParameterError, check_delta, check_epsilon

MODES = ("none", "public", "private")

#: Published per-channel constants of the standard training sets, on pixels scaled to [0, 1].
PUBLIC_CONSTANTS: dict[str, dict] = {
    "mnist": {
        "mean": (0.1307,),
        "std": (0.3081,),
        "source": "MNIST training set, as published in the PyTorch MNIST example "
        "(pytorch/examples mnist/main.py: Normalize((0.1307,), (0.3081,)))",
    },
    "fashion-mnist": {
        "mean": (0.2860,),
        "std": (0.3530,),
        "source": "Fashion-MNIST training set (widely published values, e.g. "
        "chatflip/CalculationMeanStd: 0.2860, 0.3530)",
    },
    "cifar10": {
        "mean": (0.4914, 0.4822, 0.4465),
        "std": (0.2470, 0.2435, 0.2616),
        "source": "CIFAR-10 training set per channel: mean (0.49140, 0.48216, 0.44653), "
        "std (0.24703, 0.24349, 0.26159) (kuangliu/pytorch-cifar issues #8 and #19, "
        "MadryLab/robustness issue #70; pytorch/tutorials PR #2405)",
    },
    "svhn": {
        "mean": (0.4377, 0.4438, 0.4728),
        "std": (0.1980, 0.2010, 0.1970),
        "source": "SVHN training set per channel (widely published values, e.g. "
        "PatrickZH/DeepCore deepcore/datasets/svhn.py)",
    },
}

STD_FLOOR = 1e-3  # of the clipping range: the smallest std a private estimate can report
_COUNT_WEIGHT = 0.5  # weight of the count coordinate in the released vector
_ALLOWED = (
    "must be 'none', 'public' (mnist, fashion-mnist, cifar10, svhn), 'private', a (mean, std) "
    "pair (numbers, or one per channel/feature) or a recorded preprocessing dict"
)


def _values(value, k: int, name: str, shown, what: str) -> np.ndarray:
    """A scalar or k values, broadcast to shape (k,), all finite."""
    try:
        arr = np.asarray(value, dtype=float).reshape(-1)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, shown, f"{what} must be numbers") from None
    if arr.size not in (1, k) or not np.all(np.isfinite(arr)):
        raise InvalidParameterError(
            name, shown, f"{what} needs 1 or {k} finite values (one per channel of an image, or per feature of a table)"
        )
    return np.broadcast_to(arr, (k,)).astype(float)


def _layout(x: np.ndarray) -> tuple[int, str]:
    return x.shape[1], ("channel" if x.ndim == 4 else "feature")


def standardize(x: np.ndarray, mean, std) -> np.ndarray:
    """(x − mean) / std per channel (axis 1 of (n, C, H, W)) or per feature (axis 1 of (n, d)), float32."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    out = np.array(x, dtype=np.float32, copy=True)
    out -= np.asarray(mean, np.float32).reshape(shape)
    out /= np.asarray(std, np.float32).reshape(shape)
    return out


def moment_sums(x: np.ndarray, low, high) -> tuple[np.ndarray, np.ndarray]:
    """Σ_i m_i and Σ_i s_i per channel/feature (see the module docstring), in float64, in bounded chunks."""
    k, _ = _layout(x)
    lo, hi = np.broadcast_to(np.asarray(low, float), (k,)), np.broadcast_to(np.asarray(high, float), (k,))
    mid, width = (lo + hi) / 2, hi - lo
    flat = x.reshape(x.shape[0], k, -1)
    s1, s2 = np.zeros(k), np.zeros(k)
    chunk = max(1, 4_000_000 // max(1, flat.shape[1] * flat.shape[2]))
    for start in range(0, flat.shape[0], chunk):
        u = flat[start : start + chunk].astype(np.float64)
        np.clip(u, lo[:, None], hi[:, None], out=u)
        u -= mid[:, None]
        u /= width[:, None]
        s1 += u.mean(axis=2).sum(axis=0)
        s2 += ((u * u).mean(axis=2) - 0.125).sum(axis=0)
    return s1, s2


def add_remove_sensitivity(k: int) -> float:
    """L2 sensitivity of (Σm, Σs, ½·n) over k channels/features under adding or removing one example."""
    return math.sqrt(k * (0.25 + 1 / 64) + _COUNT_WEIGHT**2)


def private_mean_std(
    x: np.ndarray, low, high, epsilon: float, delta: float, rng: np.random.Generator | None = None
) -> dict:
    """(ε, δ)-DP per-channel/per-feature mean and std of ``x`` (add/remove neighbours).

    ``x`` is (n, C, H, W) or (n, d); ``low``/``high`` the public clipping range (scalars or one per
    channel/feature).  Returns the record: released ``mean``/``std`` plus the mechanism's
    parameters and its cost ``epsilon``/``delta``.  ``rng`` only for tests: by default the noise
    comes from OS entropy and is recorded nowhere.

    The private estimate releases one Gaussian-noised vector per dataset: with every value mapped
    to u = (clip(x, a, b) − (a+b)/2) / (b − a) ∈ [−½, ½], each example contributes, per channel c,
    its mean m_c = mean(u) ∈ [−½, ½] and its centred second moment s_c = mean(u²) − ⅛ ∈ [−⅛, ⅛],
    plus a count coordinate ½ (the number of examples is not public under add/remove).  Adding or
    removing one example changes the vector (Σm, Σs, ½·n) by at most

        Δ = sqrt(C·(¼ + 1/64) + ¼)        (both maxima are reached together, at u ≡ ±½),

    so N(0, σ²·I) noise with σ = analytic_gaussian_sigma(ε, δ, Δ) makes the release (ε, δ)-DP.
    mean = Σm/n̂, E[u²] = Σs/n̂ + ⅛ and var = E[u²] − mean² are post-processing, clamped to
    what values in [−½, ½] allow (std ≤ ½; a floor of 1e-3 keeps the division finite), then
    mapped back to the data's units.  The noise comes from OS entropy (never a recorded seed).
    """
    epsilon = float(check_epsilon(epsilon, "normalization_epsilon"))
    delta = check_delta(delta, "normalization_delta")
    k, per = _layout(x)
    lo = _values(low, k, "feature_range", low, "low")
    hi = _values(high, k, "feature_range", high, "high")
    if np.any(hi <= lo):
        raise InvalidParameterError("feature_range", (float(lo.min()), float(hi.max())), "needs low < high")
    from .accounting.release import analytic_gaussian_sigma

    n = x.shape[0]
    mid, width = (lo + hi) / 2, hi - lo
    s1, s2 = moment_sums(x, lo, hi)
    sensitivity = add_remove_sensitivity(k)
    try:
        sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    except InvalidParameterError:
        raise
    except (ValueError, OverflowError):  # outside the calibration's bracket, or exp(ε) overflows
        raise InvalidParameterError(
            "normalization_epsilon",
            epsilon,
            f"cannot be calibrated with "
            f"normalization_delta={delta:g} by the analytic Gaussian mechanism; use a "
            "value between 0.001 and 100",
        ) from None
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    z = rng.normal(0.0, sigma, size=2 * k + 1)
    n_hat = max((_COUNT_WEIGHT * n + z[-1]) / _COUNT_WEIGHT, 1.0)
    mu = np.clip((s1 + z[:k]) / n_hat, -0.5, 0.5)
    second = np.clip((s2 + z[k : 2 * k]) / n_hat + 0.125, 0.0, 0.25)
    std_u = np.sqrt(np.clip(second - mu * mu, STD_FLOOR**2, 0.25))
    return {
        "mode": "private",
        "per": per,
        "mean": (mid + width * mu).tolist(),
        "std": (width * std_u).tolist(),
        "epsilon": epsilon,
        "delta": delta,
        "source": "differentially private estimate on the training split (Gaussian mechanism, add/remove "
        "neighbours, values clipped to the public range)",
        "mechanism": "analytic Gaussian (Balle & Wang 2018) on (sum of means, sum of centred second "
        "moments, count), values mapped to [-1/2, 1/2]",
        "clip_range": [lo.tolist(), hi.tolist()],
        "sensitivity": sensitivity,
        "noise_std": sigma,
    }


def normalize(
    dataset: str,
    x_train: np.ndarray,
    x_test: np.ndarray,
    normalization=None,
    *,
    scaling: str,
    value_range=None,
    epsilon=None,
    delta=None,
    feature_range=None,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Apply one normalization mode to both splits with the same constants; return them and the record.

    ``normalization``: None (the dataset's default: ``public`` where :data:`PUBLIC_CONSTANTS` has
    the dataset, else ``none``), ``"none"``, ``"public"``, ``"private"``, a ``(mean, std)`` pair, or
    a record returned earlier (re-applied as is, e.g. on resume: its recorded cost stays).
    ``value_range``: the public range of the scaled values (images: (0, 1)); ``feature_range``:
    the user's public range for ``private`` on data without one (CSV).
    """
    k, per = _layout(x_train)
    if normalization is None:
        normalization = "public" if dataset in PUBLIC_CONSTANTS else "none"
    private = isinstance(normalization, str) and normalization == "private"
    if not private:
        for name, v in (
            ("normalization_epsilon", epsilon),
            ("normalization_delta", delta),
            ("feature_range", feature_range),
        ):
            if v is not None:
                raise InvalidParameterError(name, v, "only used with normalization='private'")
    base = {"scaling": scaling, "per": per}
    if isinstance(normalization, dict):
        record = _recorded(normalization, k)
        if record["mean"] is None:
            return x_train, x_test, record
    elif isinstance(normalization, str):
        if normalization == "none":
            return (
                x_train,
                x_test,
                {
                    "mode": "none",
                    **base,
                    "mean": None,
                    "std": None,
                    "source": "no standardization",
                    "epsilon": 0.0,
                    "delta": 0.0,
                },
            )
        if normalization == "public":
            if dataset not in PUBLIC_CONSTANTS:
                raise InvalidParameterError(
                    "normalization",
                    "public",
                    f"dataset {dataset!r} has no published constants: use 'none', 'private' or a (mean, std) pair",
                )
            c = PUBLIC_CONSTANTS[dataset]
            record = {
                "mode": "public",
                **base,
                "mean": list(c["mean"]),
                "std": list(c["std"]),
                "source": c["source"],
                "epsilon": 0.0,
                "delta": 0.0,
            }
            if len(c["mean"]) != k:
                raise InvalidParameterError(
                    "normalization",
                    "public",
                    f"the {dataset} constants have {len(c['mean'])} channel(s); the data has {k}",
                )
        elif normalization == "private":
            if epsilon is None or delta is None:
                raise InvalidParameterError(
                    "normalization_epsilon" if epsilon is None else "normalization_delta",
                    None,
                    "required with normalization='private'",
                )
            rng_range = value_range
            if feature_range is not None:
                if value_range is not None:
                    raise InvalidParameterError(
                        "feature_range",
                        feature_range,
                        f"not used for {dataset!r}: its values lie in the public range {tuple(value_range)}",
                    )
                rng_range = _pair(feature_range)
            if rng_range is None:
                raise InvalidParameterError(
                    "feature_range",
                    None,
                    "required with normalization='private' on "
                    f"{dataset} data: a public range (low, high) for the values, chosen "
                    "without looking at the private data",
                )
            record = {**private_mean_std(x_train, rng_range[0], rng_range[1], epsilon, delta, rng), **base}
        else:
            raise InvalidParameterError("normalization", normalization, _ALLOWED)
    elif isinstance(normalization, (tuple, list)) and len(normalization) == 2:
        mean = _values(normalization[0], k, "normalization", normalization, "mean")
        std = _values(normalization[1], k, "normalization", normalization, "std")
        if np.any(std <= 0):
            raise InvalidParameterError("normalization", normalization, "std must be > 0")
        record = {
            "mode": "user",
            **base,
            "mean": mean.tolist(),
            "std": std.tolist(),
            "source": "given by the user",
            "epsilon": 0.0,
            "delta": 0.0,
        }
    else:
        raise InvalidParameterError("normalization", normalization, _ALLOWED)
    return (
        standardize(x_train, record["mean"], record["std"]),
        standardize(x_test, record["mean"], record["std"]),
        record,
    )


def _pair(value) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise InvalidParameterError("feature_range", value, "must be a pair (low, high)")
    return value[0], value[1]


def _recorded(record: dict, k: int) -> dict:
    """Validate a preprocessing record given back (e.g. from a checkpoint)."""
    mode = record.get("mode")
    if mode not in ("none", "public", "user", "private"):
        raise InvalidParameterError("normalization", f"dict(mode={mode!r})", _ALLOWED)
    if mode == "none":
        return dict(record)
    _values(record.get("mean"), k, "normalization", f"dict(mode={mode!r})", "mean")
    std = _values(record.get("std"), k, "normalization", f"dict(mode={mode!r})", "std")
    if np.any(std <= 0) or len(record["mean"]) != k or len(record["std"]) != k:
        raise InvalidParameterError("normalization", f"dict(mode={mode!r})", f"needs {k} means and {k} stds > 0")
    for key in ("epsilon", "delta"):
        v = record.get(key)
        if not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
            raise InvalidParameterError("normalization", f"dict(mode={mode!r})", f"needs its recorded {key} >= 0")
    return dict(record)


def parse_normalization(text: str):
    """The CLI form: ``none``, ``public``, ``private`` or ``MEAN,STD`` (two numbers)."""
    t = str(text).strip()
    if t in MODES:
        return t
    parts = t.split(",")
    if len(parts) == 2:
        try:
            mean, std = float(parts[0]), float(parts[1])
        except ValueError:
            pass
        else:
            if math.isfinite(mean) and math.isfinite(std) and std > 0:
                return (mean, std)
    raise InvalidParameterError(
        "normalization", text, "must be none, public, private or MEAN,STD (two finite numbers, STD > 0)"
    )


def parse_feature_range(text: str) -> tuple[float, float]:
    """The CLI form ``A,B`` with A < B, both finite."""
    parts = str(text).split(",")
    try:
        a, b = (float(p) for p in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        a = b = math.nan
    if not (math.isfinite(a) and math.isfinite(b) and a < b):
        raise InvalidParameterError("feature_range", text, "must be A,B with A < B, both finite")
    return a, b
