"""Command-line options of the individual Rényi filter (``idpsgd train --filter individual``).

Feldman & Zrnic 2021 with individualized budgets (Boenisch et al. 2023, §5, App. D.5); the filter
is :mod:`idpsgd.engine.budget.filter`, the recipes :mod:`idpsgd.training.filtered`.
"""

from __future__ import annotations

from ..engine.budget.filter import FilterOptions
from ..validation import InvalidParameterError


def add_filter_arguments(p) -> None:
    """Add the filter's flags to a parser or an argument group."""
    d = FilterOptions()
    p.add_argument(
        "--filter",
        choices=["individual"],
        help="individual Rényi filter (Feldman & Zrnic 2021): every example leaves training when its own "
        "budget is spent; the run lasts --filter-extend times the calibrated epochs (rdp accountant only)",
    )
    p.add_argument(
        "--filter-order",
        type=float,
        help="fixed Rényi order of every example's filter (> 1; default: per budget group, the order at "
        "which the worst case lasts longest)",
    )
    p.add_argument(
        "--gd",
        action="store_true",
        help="full-batch DP-GD (Feldman & Zrnic Alg. 3): every step uses all active examples, charged at "
        "their exact sensitivity min(c, |g_i|); one epoch is one step",
    )
    p.add_argument(
        "--filter-extend",
        type=float,
        default=d.extend,
        help=f"train for this many times the calibrated epochs (fixed in advance, >= 1; default {d.extend:g})",
    )
    p.add_argument(
        "--filter-refreshes-per-epoch",
        type=float,
        default=d.refreshes_per_epoch,
        help="DP-SGD with the filter: clip-bound refreshes per epoch (individual clipping; default "
        f"{d.refreshes_per_epoch:g})",
    )
    p.add_argument(
        "--filter-rounding-step",
        type=float,
        help="DP-SGD with the filter: clip bounds are norms rounded up to multiples of this step "
        "(default 0.01 x the clip norm)",
    )


def filter_options_from_args(args) -> FilterOptions | None:
    """The :class:`~idpsgd.engine.budget.filter.FilterOptions` of the flags, or None without ``--filter``."""
    if getattr(args, "filter", None) != "individual":
        for flag, value in (
            ("gd", getattr(args, "gd", False) or None),
            ("filter_order", getattr(args, "filter_order", None)),
            ("filter_rounding_step", getattr(args, "filter_rounding_step", None)),
        ):
            if value is not None:
                raise InvalidParameterError(flag, value, "needs --filter individual")
        return None
    if getattr(args, "accountant", "rdp") != "rdp":
        raise InvalidParameterError(
            "accountant",
            args.accountant,
            "is not supported with --filter individual: a "
            "Rényi filter composes RDP at a fixed order (Feldman & Zrnic 2021); use rdp",
        )
    return FilterOptions(
        order=args.filter_order,
        gd=bool(args.gd),
        extend=args.filter_extend,
        refreshes_per_epoch=args.filter_refreshes_per_epoch,
        rounding_step=args.filter_rounding_step,
    ).validate()
