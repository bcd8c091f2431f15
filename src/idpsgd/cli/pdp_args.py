"""Flags of PDP-SGD and its baselines (Heo et al.), and the :class:`~idpsgd.training.pdp.PdpOptions` they make."""

from __future__ import annotations


def add_pdp_arguments(p) -> None:
    """Add the PDP flags to a parser or an argument group (defaults: :class:`PdpOptions`'s)."""
    from ..training.pdp import DEFAULT_W1, PdpOptions

    d = PdpOptions()
    p.add_argument(
        "--threshold-loss",
        choices=["fixed", "adaptive"],
        default=d.threshold_loss,
        help="threshold of each round: minimise the fixed-weight loss (eq. 6) or take the adaptive "
        "loss's AM-GM equality point waste_u = waste_s (eq. 7) (default %(default)s)",
    )
    p.add_argument(
        "--w1",
        type=float,
        help="weight of the unsampled waste in the fixed loss, in [0, 1]; w2 = 1 - w1 "
        f"(default {DEFAULT_W1['pdp-sgd']:g}, adapdp {DEFAULT_W1['adapdp']:g})",
    )
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds of pdp-sgd and adapdp (default %(default)s)")
    p.add_argument(
        "--noise-history",
        action="store_true",
        help="Alg. 4: calibrate each round's noise on the composed history of rounds 1..R within the "
        "cumulative thresholds; every example then gets delta_i <= --delta",
    )
    p.add_argument(
        "--per-round-delta",
        action="store_true",
        help="give every round the full --delta (the paper's Thm. 4.5: delta_i <= rounds x delta); "
        "default: --delta is the total per example (each round gets delta/rounds)",
    )


def pdp_options_from_args(args):
    """:class:`PdpOptions` from parsed arguments (validated: a bad value names its flag)."""
    from ..training.pdp import PdpOptions

    return PdpOptions(
        threshold_loss=args.threshold_loss,
        w1=args.w1,
        rounds=args.rounds,
        noise_history=bool(args.noise_history),
        per_round_delta=bool(getattr(args, "per_round_delta", False)),
    ).validate()
