"""Accounting commands: ``epsilon``, ``noise-multiplier``, ``assign`` and ``account``.

Every error names the flag the user typed and its value (``--sample-rate=1.5 is invalid: …``);
work whose memory or time would explode (PLD grids, rounding tables) is sized first and refused.
"""

from __future__ import annotations

import numpy as np

from ..accounting import calibrate_noise_multiplier, epsilon_sgm, rdp_epsilon
from ..accounting.events import SampledGaussianEvent
from ..names import IDP_METHODS, INDIVIDUAL_ACCOUNTANTS
from ..validation import (
    InvalidParameterError,
    UnreachableTargetError,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_positive,
    check_sample_rate,
    check_steps,
)
from .budget_args import CommandSeed, accountant_arg, budget_source_args, budgets_from_args, group_spec
from .registry import arguments, command, register_text


def _flagged(exc: UnreachableTargetError, names: dict) -> UnreachableTargetError:
    """The same message with library argument names (``budgets=``) replaced by the flags (``--budgets=``)."""
    msg = str(exc)
    for name, flag in names.items():
        if msg.startswith(f"{name}="):
            msg = flag + msg[len(name) :]
            break
    return UnreachableTargetError(msg)


def _sgm_args(p, with_sigma=True):
    p.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q in (0, 1]")
    if with_sigma:
        p.add_argument("--noise-multiplier", type=float, required=True, help="noise multiplier σ > 0")
    p.add_argument("--steps", type=int, required=True, help="number of steps (>= 1)")
    p.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    accountant_arg(p)


@command("epsilon", "ε spent by DP-SGD (Poisson-subsampled Gaussian) after a number of steps")
@arguments(_sgm_args)
def epsilon_cmd(args):
    q = float(check_sample_rate(args.sample_rate))
    s = float(check_noise_multiplier(args.noise_multiplier, allow_inf=False))
    steps = check_steps(args.steps)
    delta = check_delta(args.delta)
    out = {"accountant": args.accountant, "delta": delta}
    if args.accountant == "rdp":
        eps, order = rdp_epsilon([SampledGaussianEvent(q, s, steps)], delta)  # adaptive orders
        out.update(epsilon=float(eps), order=float(order))
    else:
        out.update(epsilon=float(epsilon_sgm(q, s, steps, delta, args.accountant)))
    return {"epsilon": out.pop("epsilon"), **out}


def _nm_args(p):
    p.add_argument("--epsilon", type=float, required=True, help="target ε > 0")
    _sgm_args(p, with_sigma=False)


@command("noise-multiplier", "noise multiplier σ that spends a target ε (never above it)")
@arguments(_nm_args)
def noise_multiplier_cmd(args):
    q = float(check_sample_rate(args.sample_rate))
    steps = check_steps(args.steps)
    delta = check_delta(args.delta)
    check_epsilon(args.epsilon, "epsilon")
    try:
        sigma = calibrate_noise_multiplier(args.epsilon, delta, q, steps, args.accountant, name="--epsilon")
    except InvalidParameterError as exc:  # a PLD grid guard met while searching σ: not the user's σ
        raise UnreachableTargetError(
            f"--epsilon={args.epsilon!r} cannot be calibrated with the {args.accountant} accountant: {exc}"
        ) from None
    achieved = float(epsilon_sgm(q, sigma, steps, delta, args.accountant))
    return {"noise_multiplier": float(sigma), "epsilon": achieved, "accountant": args.accountant}


def _assign_args(p):
    p.add_argument("--method", choices=IDP_METHODS, required=True)
    budget_source_args(p)
    p.add_argument("--delta", type=float, required=True, help="global δ in (0, 1)")
    p.add_argument("--sample-rate", type=float, required=True, help="requested (mean) sampling rate q")
    p.add_argument("--steps", type=int, required=True, help="planned number of steps")
    p.add_argument("--clip-norm", type=float, required=True, help="requested (mean) clip norm c")
    p.add_argument(
        "--num-examples", type=int, help="dataset size: group sizes by largest remainder (default: exact fractions)"
    )
    accountant_arg(p)


def _assign_text(r):
    lines = [
        f"method={r['method']} accountant={r['accountant']} noise_multiplier={r['noise_multiplier']:.6g} "
        f"sample_rate={r['sample_rate']:.6g} clip_norm={r['clip_norm']:.6g}",
        f"{'budget':>8} {'fraction':>9} {'sample_rate':>12} {'clip_norm':>10} {'sigma_eff':>10} {'epsilon':>9}",
    ]
    for g in r["groups"]:
        lines.append(
            f"{g['budget']:>8.4g} {g['fraction']:>9.4f} {g['sample_rate']:>12.6f} "
            f"{g['clip_norm']:>10.5f} {g['noise_multiplier']:>10.5f} {g['epsilon']:>9.5f}"
        )
    return "\n".join(lines)


@command("assign", "per-group DP-SGD parameters for individualized budgets (IDP-SGD Sample/Scale)")
@arguments(_assign_args)
def assign_cmd(args):
    from ..assignment import Budgets, assign

    if args.budgets_per_class:
        raise InvalidParameterError(
            "budgets_per_class", args.budgets_per_class, "needs labels: use it with 'idpsgd train'"
        )
    check_delta(args.delta)
    check_sample_rate(args.sample_rate)
    check_steps(args.steps)
    check_positive(args.clip_norm, "clip_norm")
    if args.num_examples is not None and args.num_examples < 1:
        raise InvalidParameterError("num_examples", args.num_examples, "must be an integer >= 1")
    weights = None
    if args.budgets_file or args.num_examples or args.budget_distribution:
        budgets = budgets_from_args(args, args.num_examples, seed=CommandSeed.of(args))
    else:  # no dataset size: the groups are weighted by their exact fractions
        values, fractions = group_spec(args)
        order = np.argsort(values)
        budgets = Budgets.from_array(values, check_delta(args.delta))
        weights = np.asarray(fractions)[order]
    try:
        result = assign(
            budgets, args.method, args.sample_rate, args.steps, args.clip_norm, args.accountant, group_weights=weights
        ).summary()
    except UnreachableTargetError as exc:
        raise _flagged(exc, {"budgets": "--budgets", "sample_rate": "--sample-rate"}) from None
    if weights is not None:  # no dataset size: groups are fractions, not counts
        for g in result["groups"]:
            g.pop("count")
    return result


register_text(assign_cmd, _assign_text)


def _account_args(p):
    p.add_argument(
        "--norms",
        required=True,
        help="npz with 'norms' (refreshes x examples) and 'steps' (steps covered by each refresh); "
        "optional 'sample_rates', 'clip_norms' (per example), 'noise_multiplier', 'clip_norm', "
        "'rounding', 'rounding_step' (as 'idpsgd train --save-norms' writes them to "
        "OUT/private/norms.npz) fill in the flags below; the result is a guarantee only for a file "
        "whose 'accounting_kind' (written by the run) is guarantee, with the run's own parameters and rounding",
    )
    p.add_argument("--sample-rate", type=float, help="Poisson sampling rate q in (0, 1] (default: the file's)")
    p.add_argument("--noise-multiplier", type=float, help="noise multiplier σ > 0 (default: the file's)")
    p.add_argument("--clip-norm", type=float, help="clip norm C > 0 (default: the file's)")
    p.add_argument("--delta", type=float, required=True, help="δ in (0, 1)")
    p.add_argument(
        "--rounding",
        choices=["exact", "ceil", "nearest"],
        help="rounding of norms (default: the file's 'rounding', else nearest)",
    )
    p.add_argument(
        "--rounding-step",
        type=float,
        help="rounding step r (default: the file's 'rounding_step', else 0.01 x clip norm)",
    )
    p.add_argument(
        "--accountant",
        choices=INDIVIDUAL_ACCOUNTANTS,
        default="rdp",
        help="rdp: per-example RDP (adaptive orders); pld: per-example PLD as well (needs rounding "
        "ceil or nearest), each example's ε the smaller bound",
    )
    p.add_argument(
        "--out",
        required=True,
        help="run folder: public account.json (settings, data-independent worst "
        "case); private/individual_epsilons.csv (mode 0600)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier result in --out")


def read_norms_file(path):
    """(norms (refreshes × examples), steps (per refresh)) from an npz, or a one-line error naming --norms."""
    import zipfile
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(
            "norms",
            str(path),
            "is a folder; give the npz file"
            if path.is_dir()
            else "not found (expected an npz with arrays 'norms' and 'steps', e.g. "
            "RUN/private/norms.npz from 'idpsgd train --save-norms')",
        )
    if not zipfile.is_zipfile(path):
        raise InvalidParameterError(
            "norms",
            str(path),
            "is not an npz file (not a zip archive; write it with numpy.savez(path, norms=..., steps=...))",
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise InvalidParameterError(
            "norms",
            str(path),
            f"is not a readable npz file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'truncated or corrupt'})",
        ) from None
    missing = [k for k in ("norms", "steps") if k not in arrays]
    if missing:
        raise InvalidParameterError("norms", str(path), f"the npz lacks {missing} (has {sorted(arrays)})")
    norms, steps = arrays["norms"], arrays["steps"]
    for key in ("sample_rates", "clip_norms", "noise_multiplier", "clip_norm"):
        if key in arrays and not (
            np.issubdtype(arrays[key].dtype, np.integer) or np.issubdtype(arrays[key].dtype, np.floating)
        ):
            raise InvalidParameterError(
                "norms", str(path), f"array '{key}' must be numeric (it has dtype {arrays[key].dtype})"
            )
    extras = {k: arrays[k] for k in ("sample_rates", "clip_norms", "noise_multiplier", "clip_norm") if k in arrays}
    if "rounding_step" in arrays:
        step = arrays["rounding_step"]
        if not (np.issubdtype(step.dtype, np.floating) or np.issubdtype(step.dtype, np.integer)) or step.size != 1:
            raise InvalidParameterError("norms", str(path), "array 'rounding_step' must be one number")
        extras["rounding_step"] = step
    if "rounding" in arrays:
        mode = arrays["rounding"]
        if mode.dtype.kind != "U" or mode.size != 1 or str(mode.ravel()[0]) not in ("exact", "ceil", "nearest"):
            raise InvalidParameterError("norms", str(path), "array 'rounding' must be one of exact, ceil, nearest")
        extras["rounding"] = str(mode.ravel()[0])
    if "accounting_kind" in arrays:
        kind = arrays["accounting_kind"]
        if kind.dtype.kind != "U" or kind.size != 1 or str(kind.ravel()[0]) not in ("guarantee", "estimate"):
            raise InvalidParameterError("norms", str(path), "array 'accounting_kind' must be guarantee or estimate")
        extras["accounting_kind"] = str(kind.ravel()[0])
    for flag in ("individual_clipping", "enforced"):
        if flag not in arrays:
            continue
        ic = arrays[flag]
        if ic.dtype != np.bool_ or ic.size != 1:
            raise InvalidParameterError("norms", str(path), f"array '{flag}' must be one boolean")
        extras[flag] = bool(ic.ravel()[0])
    for key, arr in (("norms", norms), ("steps", steps)):
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise InvalidParameterError("norms", str(path), f"array '{key}' must be numeric (it has dtype {arr.dtype})")
        if arr.size == 0:
            raise InvalidParameterError("norms", str(path), f"array '{key}' is empty")
    if norms.ndim == 1:
        norms = norms[None, :]
    if norms.ndim != 2:
        raise InvalidParameterError(
            "norms", str(path), f"array 'norms' must be 2-D (refreshes x examples); it has shape {norms.shape}"
        )
    norms = norms.astype(float)
    bad = ~(np.isfinite(norms) & (norms >= 0))
    if bad.any():
        r, i = (int(v[0]) for v in np.nonzero(bad))
        raise InvalidParameterError(
            "norms",
            str(path),
            f"array 'norms' must hold finite values >= 0; refresh {r}, example {i} is {norms[r, i]!r}",
        )
    steps = np.ravel(steps).astype(float)
    if steps.size not in (1, norms.shape[0]):
        raise InvalidParameterError(
            "norms",
            str(path),
            f"array 'steps' needs 1 value or one per refresh ({norms.shape[0]}); it has {steps.size}",
        )
    if not np.all(np.isfinite(steps) & (steps >= 0) & (steps == np.round(steps))):
        raise InvalidParameterError("norms", str(path), "array 'steps' must hold integers >= 0")
    if steps.sum() < 1:
        raise InvalidParameterError("norms", str(path), "array 'steps' covers no step")
    for key in ("sample_rates", "clip_norms"):
        if key in extras and extras[key].size not in (1, norms.shape[1]):
            raise InvalidParameterError(
                "norms",
                str(path),
                f"array '{key}' needs one value per example ({norms.shape[1]}); it has {extras[key].size}",
            )
    return norms, np.broadcast_to(steps, (norms.shape[0],)).astype(np.int64), extras


@command("account", "offline individual privacy accounting (Yu et al.) from recorded gradient norms")
@arguments(_account_args)
def account_cmd(args):

    from ..accounting import account_from_norms
    from ..accounting.neighbouring import neighbouring
    from ..accounting.output_specific import DEFAULT_ROUNDING_FRACTION, offline_kind
    from ..runfolder import RunFolder

    delta = check_delta(args.delta)
    for name in ("sample_rate", "noise_multiplier", "clip_norm"):
        value = getattr(args, name)
        if value is not None:
            (check_sample_rate if name == "sample_rate" else check_positive)(value, name)
    if args.rounding_step is not None:
        check_positive(args.rounding_step, "rounding_step")
    if args.accountant == "pld" and args.rounding == "exact":
        raise InvalidParameterError(
            "rounding",
            "exact",
            "cannot be used with --accountant pld: per-example PLD "
            "needs rounded sensitivity levels (use --rounding ceil or nearest)",
        )
    norms, steps, extras = read_norms_file(args.norms)
    folder = RunFolder(args.out, overwrite=args.overwrite)
    rounding = args.rounding or extras.get("rounding", "nearest")
    if args.accountant == "pld" and rounding == "exact":
        raise InvalidParameterError(
            "rounding",
            "exact",
            "(recorded in --norms) cannot be used with --accountant "
            "pld: per-example PLD needs rounded sensitivity levels (use --rounding ceil or "
            "nearest)",
        )
    rounding_step = args.rounding_step
    if rounding_step is None and "rounding_step" in extras and args.clip_norm is None:
        rounding_step = check_positive(float(np.ravel(extras["rounding_step"])[0]), "rounding_step")
    q = args.sample_rate if args.sample_rate is not None else extras.get("sample_rates")
    sigma = args.noise_multiplier if args.noise_multiplier is not None else extras.get("noise_multiplier")
    clip = args.clip_norm if args.clip_norm is not None else extras.get("clip_norm")
    for name, value in (("sample_rate", q), ("noise_multiplier", sigma), ("clip_norm", clip)):
        if value is None:
            raise InvalidParameterError(name, None, "is required (the norms file does not record it)")
    q = np.broadcast_to(check_sample_rate(q, "sample_rate"), (norms.shape[1],)).astype(float)
    sigma = float(check_noise_multiplier(np.ravel(sigma)[0], allow_inf=False))
    clip = check_positive(float(np.ravel(clip)[0]), "clip_norm")
    clip_norms = None
    if "clip_norms" in extras and args.clip_norm is None:
        clip_norms = np.broadcast_to(extras["clip_norms"].astype(float), (norms.shape[1],))
    report, worst = account_from_norms(
        norms,
        steps,
        q,
        sigma,
        clip,
        delta,
        rounding,
        rounding_step,
        clip_norms=clip_norms,
        accountant=args.accountant,
        report=True,
    )
    eps = report.epsilon
    recorded_step = float(np.ravel(extras["rounding_step"])[0]) if "rounding_step" in extras else None
    step_used = (
        rounding_step
        if rounding_step is not None
        else DEFAULT_ROUNDING_FRACTION * float(np.max(clip_norms if clip_norms is not None else clip))
    )
    kind, reason = offline_kind(
        extras.get("accounting_kind"),
        extras.get("individual_clipping", False),
        extras.get("rounding"),
        recorded_step,
        rounding,
        step_used,
        overridden=any(getattr(args, k) is not None for k in ("sample_rate", "noise_multiplier", "clip_norm")),
        enforced=extras.get("enforced"),
    )
    header = (
        ["index", "epsilon", "source", "rdp_epsilon"]
        + (["pld_epsilon"] if report.pld is not None else [])
        + ["worst_case_epsilon"]
    )
    cols = (
        [np.arange(eps.size), eps, report.source, report.rdp]
        + ([report.pld] if report.pld is not None else [])
        + [worst]
    )
    csv_path = folder.write_csv(
        "individual_epsilons.csv",
        header,
        cols,
        "private",
        "every example's epsilon, the bound it came from and its worst case; personal data",
    )
    exact = {
        "about": "exact statistics of per-example epsilons (private: not covered by any guarantee)",
        "mean": float(eps.mean()),
        "max": float(eps.max()),
        "quantiles": {f"{p:g}": float(np.quantile(eps, p)) for p in (0.1, 0.25, 0.5, 0.75, 0.9)},
        "source_counts": report.counts(),
        "mean_rdp": float(report.rdp.mean()),
        **({"mean_pld": float(report.pld.mean())} if report.pld is not None else {}),
    }
    result = {
        "epsilons": str(csv_path),
        "accountant": args.accountant,
        "private": exact,
        "worst_case_epsilon": float(worst.max()),
        "worst_case_accountant": "pld" if args.accountant == "pld" else "rdp",
        "examples": int(eps.size),
        "steps": int(steps.sum()),
        "rounding": rounding,
        "kind": kind,
        "kind_reason": reason,
        **neighbouring(),
    }
    folder.write_json(
        "account.json",
        {k: v for k, v in result.items() if k != "private"},
        "public",
        "settings of the offline accounting and the data-independent worst-case epsilon",
    )
    return result
