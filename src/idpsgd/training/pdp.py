"""PDP-SGD and its baselines (Heo et al., Alg. 1–2, 4, App. B): personalized sampling before DP-SGD.

Each round R: pick a threshold τ_R from the remaining budgets (eq. 6 or 7), sample every example
with π_{i,R} (eq. 4), run DP-SGD on the sample with a noise multiplier calibrated for the round,
and charge the round's cost.  Methods: ``pdp-sgd`` (Alg. 1, ``rounds`` rounds continuing one
model), ``pdp-sampling`` (App. B.1, Jorgensen et al.: one round) and ``adapdp`` (App. B.2, Niu et
al.: a fresh model per round, predictions combined with weights τ_T·E|D_T|); options in
:class:`PdpOptions`, the accounting in :mod:`idpsgd.accounting.pdp`.  Where the paper is ambiguous
or its bookkeeping is not backed by its theorems, this module follows the theorems: every example
is charged every round (Thm. 4.2), round parameters are public (expected sample sizes, never
|D_R|; an empty sample still runs its noise-only steps), δ is the total the user asked for, and
with ``noise_history`` the guarantee is :func:`~idpsgd.accounting.pdp.history_guarantee`.

Our reading point by point, and what was measured: ``docs/pdp-sgd.md``.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from ..accounting import SampledGaussianEvent, epsilon_sgm
from ..accounting.neighbouring import neighbouring
from ..accounting.pdp import (
    THRESHOLD_LOSSES,
    calibrate_round_noise,
    compose,
    composed_epsilon,
    history_guarantee,
    sampling_guarantee,
    sampling_probabilities,
    select_threshold,
)
from ..analysis.metrics import accuracies
from ..assignment import Budgets
from ..data import Dataset
from ..engine import steps_per_epoch_for
from ..models import DEFAULT_MODEL, create_model
from ..names import INDIVIDUAL_ACCOUNTANTS, one_of
from ..names import PDP_METHODS as PDP_METHODS  # re-exported
from ..validation import InvalidParameterError, check_delta, check_positive

log = logging.getLogger("idpsgd")

DEFAULT_W1 = {"pdp-sgd": 0.7, "pdp-sampling": 0.7, "adapdp": 0.2}  # Heo et al. App. C.2
GUARANTEE = (
    "(Phi, Delta)-personalized DP (Heo et al. Thm. 4.2-4.4): every example i gets "
    "(epsilon_i, delta_i) with epsilon_i <= its budget; delta_i = sum over rounds of pi_i,R * delta_R"
)
GUARANTEE_HISTORY = (
    "(Phi, Delta)-personalized DP with the rounds composed by the accountant (Alg. 4, our "
    "reading): epsilon_i = ln sum_m P_i(last round sampled = m) exp(E_m) <= its budget, "
    "delta_i = P_i(ever sampled) * delta"
)


@dataclass(frozen=True)
class PdpOptions:
    """Options of PDP-SGD and its baselines (Heo et al.).

    Attributes:
        threshold_loss: ``fixed`` (eq. 6, weights w1, 1 − w1) or ``adaptive`` (eq. 7, our reading).
        w1: weight of the unsampled waste in the fixed loss (default: 0.7, adapdp 0.2; App. C.2).
        rounds: rounds of pdp-sgd and adapdp (pdp-sampling always runs one).
        noise_history: calibrate σ_R on the composed history of rounds 1..R within the cumulative
            thresholds (Alg. 4, our reading; see the module docstring).
        per_round_delta: give every round the full δ (the paper's Thm. 4.5, δ_i ≤ rounds·δ) instead
            of δ/rounds (δ_i ≤ δ, the default).  Moot with ``noise_history``: the composed history is
            calibrated at δ and every example gets δ_i ≤ δ.
    """

    threshold_loss: str = "fixed"
    w1: float | None = None
    rounds: int = 3
    noise_history: bool = False
    per_round_delta: bool = False

    def validate(self) -> PdpOptions:
        if self.threshold_loss not in THRESHOLD_LOSSES:
            raise InvalidParameterError("threshold_loss", self.threshold_loss, "must be fixed or adaptive")
        if self.w1 is not None and not (0 <= float(self.w1) <= 1):
            raise InvalidParameterError("w1", self.w1, "must be in [0, 1] (w2 = 1 - w1)")
        if int(self.rounds) != self.rounds or int(self.rounds) < 1:
            raise InvalidParameterError("rounds", self.rounds, "must be an integer >= 1")
        return self

    def weight(self, method: str) -> float:
        return DEFAULT_W1[method] if self.w1 is None else float(self.w1)

    @classmethod
    def from_config(cls, config) -> PdpOptions:
        """The options kept on a ``TrainConfig`` (until they move out of it)."""
        d = cls()
        return cls(
            **{
                k: getattr(config, k, getattr(d, k))
                for k in ("threshold_loss", "w1", "rounds", "noise_history", "per_round_delta")
            }
        )


def run_dp_round(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    sampled,
    *,
    budgets: Budgets,
    noise_multiplier: float,
    sample_rate: float,
    clip_norm: float,
    steps: int,
    steps_per_epoch: int,
    expected_batch_size: float,
    seed: int | None,
    secure_mode: bool = False,
    noise_generator: torch.Generator | None = None,
    grad_sample_mode: str = "hooks",
    progress: bool = False,
    desc: str = "",
) -> torch.nn.Module:
    """One round of DP-SGD on the sampled examples, through the engine, with explicit public parameters.

    ``data`` = (x, y) is the whole training set; the examples in ``sampled`` get rate
    ``sample_rate``, all others rate 0 (never drawn, not charged by the engine — the round's
    privacy is accounted by Thm. 4.2/Alg. 4 above).  Every step clips at ``clip_norm``, adds noise
    of std ``noise_multiplier``·``clip_norm`` and divides by ``expected_batch_size`` (public:
    q·E|D_R|, never the realised size).  An empty sample runs noise-only steps.  Returns the model to
    continue with (the engine's wrapper around ``model``).
    """
    from ..engine import IndividualizedPrivacyEngine
    from ..engine.noise.randomness import gaussian_like
    from ..engine.per_example.norms import to_device

    x, y = data
    device = next(model.parameters()).device
    if len(sampled) == 0:  # the round still releases its noisy steps (the engine needs a rate > 0)
        params = [p for p in model.parameters() if p.requires_grad]
        for _ in range(int(steps)):
            for p in params:
                p.grad = (
                    gaussian_like(noise_multiplier * clip_norm, p.detach(), noise_generator, secure_mode)
                    / expected_batch_size
                )
            optimizer.step()
        return model
    rates = np.zeros(len(y))
    rates[sampled] = sample_rate
    engine = IndividualizedPrivacyEngine(accountant="rdp", secure_mode=secure_mode, seed=seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook.*")
        out = engine.make_private_with_parameters(
            module=model,
            optimizer=optimizer,
            data_loader=DataLoader(TensorDataset(x, y), batch_size=1),
            budgets=budgets,
            sample_rates=rates,
            clip_norms=np.full(len(y), clip_norm),
            noise_multiplier=noise_multiplier,
            max_grad_norm=clip_norm,
            steps=int(steps),
            steps_per_epoch=steps_per_epoch,
            expected_batch_size=float(expected_batch_size),
            privacy_filter=None,
            noise_generator=None if secure_mode else noise_generator,
            grad_sample_mode=grad_sample_mode,
        )
        if grad_sample_mode == "ghost":
            gsm, dp_opt, criterion, loader = out
        else:
            (gsm, dp_opt, loader), criterion = out, torch.nn.CrossEntropyLoss()
        gsm.train()
        bar = tqdm(total=int(steps), disable=None if progress else True, desc=desc, leave=False)
        while engine.steps < steps:
            for xb, yb in loader:
                dp_opt.zero_grad(set_to_none=True)
                criterion(gsm(to_device(xb, device)), to_device(yb, device)).backward()
                dp_opt.step()
                bar.update(1)
                if engine.steps >= steps:
                    break
        bar.close()
    return gsm


@functools.lru_cache(maxsize=512)
def _round_sigma(tau: float, delta: float, q: float, steps: int, accountant: str) -> float:
    """σ making one round alone (τ, δ)-DP (cached: seeds of one budget distribution repeat it)."""
    return calibrate_round_noise(tau, delta, q, steps, accountant)


def _predict(models_weights, x, batch_size: int = 1024) -> torch.Tensor:
    """Weighted sum of the models' softmax outputs (in batches)."""
    probs = 0
    with torch.no_grad():
        for model, w in models_weights:
            m = getattr(model, "_module", model)
            m.eval()
            device = next(m.parameters()).device
            probs = probs + w * torch.cat(
                [F.softmax(m(x[i : i + batch_size].to(device)), dim=1).cpu() for i in range(0, len(x), batch_size)]
            )
    return probs


def _check_hyper(config) -> None:
    if int(config.batch_size) != config.batch_size or int(config.batch_size) < 1:
        raise InvalidParameterError("batch_size", config.batch_size, "must be an integer >= 1")
    if int(config.epochs) != config.epochs or int(config.epochs) < 1:
        raise InvalidParameterError("epochs", config.epochs, "must be an integer >= 1")
    check_positive(config.lr, "lr")
    check_positive(config.clip_norm, "clip_norm")
    if not 0 <= config.momentum < 1:
        raise InvalidParameterError("momentum", config.momentum, "must be in [0, 1)")
    if config.accountant not in INDIVIDUAL_ACCOUNTANTS:  # the PDP rounds' accountants
        raise InvalidParameterError("accountant", config.accountant, f"must be {one_of(INDIVIDUAL_ACCOUNTANTS)}")
    # options of the shared config the PDP rounds cannot honour yet (they arrive with the engine)


def plan_rounds(budgets: Budgets, config, options: PdpOptions | None = None, *, population=1.0) -> list[dict]:
    """The public parameters of every round of ``config.method``: threshold τ_R, rate q_R =
    B / E|D_R|, epochs, steps, σ_R, δ_R (and, with ``noise_history``, the composed ε).

    They follow from the budgets alone, never from the secret sampling: every example is charged
    every round (reading 1), so the remaining budgets after each round are known in advance.
    ``population`` is each example's probability of being in the run (a number or one per
    example; E|D_R| = Σ_i population_i·π_i,R): a plan made once for the expected subset (the
    audit's models, each on about half of the examples: 0.5) and run on any subset
    (:func:`train_pdp`'s ``plan``) gives every run the same public parameters.
    """
    method = config.method
    opts = (options or PdpOptions.from_config(config)).validate()
    _check_hyper(config)
    w1 = opts.weight(method)
    delta, B = check_delta(budgets.delta), int(config.batch_size)
    rounds = 1 if method == "pdp-sampling" else int(opts.rounds)
    history_mode = bool(opts.noise_history) and rounds > 1
    # δ of each round's calibration: the composed history is calibrated at δ itself (δ_i ≤ δ);
    # separate rounds at δ/rounds (default) or δ (per_round_delta, Thm. 4.5)
    delta_round = delta if (history_mode or opts.per_round_delta) else delta / rounds
    remaining = budgets.epsilons.copy()
    plan, events = [], []
    first_tau, cumulative = None, 0.0
    for r in range(rounds):
        active = remaining > 1e-9 * budgets.epsilons.max()
        if not active.any():
            break
        tau = select_threshold(remaining[active], opts.threshold_loss, w1, 1 - w1)
        b = np.where(active, remaining, 0.0)
        pi = sampling_probabilities(b, tau)
        expected = float(np.sum(pi * population))
        if expected < 1:
            log.warning("round %d: expected sample size %.2f < 1; stopping", r + 1, expected)
            break
        q = min(1.0, B / expected)
        spe = steps_per_epoch_for(q)
        first_tau = first_tau or tau
        scale = min(1.0, tau / first_tau) ** 2 if method == "pdp-sgd" else 1.0  # adapdp: fresh models
        epochs = max(1, round(int(config.epochs) * scale))
        steps = epochs * spe
        cumulative += tau
        if history_mode:
            sigma = calibrate_round_noise(cumulative, delta, q, steps, config.accountant, events)
        else:
            sigma = _round_sigma(tau, delta_round, q, steps, config.accountant)
        round_eps = float(epsilon_sgm(q, sigma, steps, delta_round, config.accountant))
        events.append(SampledGaussianEvent(q, sigma, steps))
        info = {
            "round": r + 1,
            "threshold": tau,
            "noise_multiplier": sigma,
            "sample_rate": q,
            "expected_sample_size": expected,
            "epochs": epochs,
            "steps": steps,
            "steps_per_epoch": spe,
            "delta_round": delta_round,
            "epsilon_round": round_eps,
        }
        if history_mode:
            info.update(
                cumulative_threshold=cumulative, epsilon_composed=composed_epsilon(events, delta, config.accountant)
            )
        plan.append(info)
        spent, _ = sampling_guarantee(b, tau, delta_round)  # Thm. 4.2, for every example
        remaining = np.maximum(remaining - spent, 0.0)
    return plan


def train_pdp(
    dataset: Dataset,
    budgets: Budgets,
    config,
    out_dir=None,
    options: PdpOptions | None = None,
    *,
    plan: list[dict] | None = None,
) -> dict:
    """Run ``config.method`` in :data:`PDP_METHODS`; returns the report (and writes it to ``out_dir``).

    Args:
        dataset, budgets: the data and one budget per training example; ``budgets.delta`` is the
            total δ per example unless ``options.per_round_delta``.
        config: the shared hyperparameters (a ``TrainConfig``: method, epochs, batch_size, lr,
            momentum, clip_norm, accountant, model, seed, progress).
        options: the method's options (default: read from ``config``'s PDP fields).
        plan: the rounds' public parameters (:func:`plan_rounds`), made by the caller for another
            population (e.g. the audit's one plan for every model); default: planned for this data.
            Every example's sampling probability and charge follow from its own budget and the
            plan's thresholds; the guarantee is checked against its budget either way.
    """
    method = config.method
    if method not in PDP_METHODS:
        raise InvalidParameterError("method", method, f"must be one of {', '.join(PDP_METHODS)}")
    opts = (options or PdpOptions.from_config(config)).validate()
    _check_hyper(config)
    x, y, n = dataset.x_train, dataset.y_train, len(dataset.y_train)
    if len(budgets) != n:
        raise InvalidParameterError("budgets", f"{len(budgets)} values", f"need one per training example ({n})")
    delta, B, c = check_delta(budgets.delta), int(config.batch_size), float(config.clip_norm)
    w1 = opts.weight(method)
    rounds = 1 if method == "pdp-sampling" else int(opts.rounds)
    history_mode = bool(opts.noise_history) and rounds > 1
    if plan is None:
        plan = plan_rounds(budgets, config, opts)
    elif len(plan) > rounds or any(not isinstance(p, dict) or ("epsilon_composed" in p) != history_mode for p in plan):
        raise InvalidParameterError(
            "plan",
            f"{len(plan)} rounds",
            f"must be a plan of at most {rounds} {method} rounds with these options (plan_rounds)",
        )
    from ..engine.noise.randomness import noise_generator as make_noise
    from ..engine.noise.randomness import randomness_note, resolve_seed, sampler_rng
    from .device import resolve_device

    secure = bool(getattr(config, "secure_mode", False))
    seed = resolve_seed(config.seed, secure)  # a fresh seed is drawn and recorded (privately) when none is given
    device = resolve_device(getattr(config, "device", "cpu"))
    rng = sampler_rng(seed, secure)  # the per-round personalized sampling (secret)
    seeds = np.random.default_rng(seed) if not secure else None
    noise = make_noise(device, seed, secure)
    model_name = config.model or DEFAULT_MODEL.get(dataset.name, "mlp")

    def new_model(k):
        if seed is None:  # secure mode: the initialisation is not privacy-relevant, nor recorded
            torch.seed()
        else:
            torch.manual_seed(seed + k)
        m = create_model(model_name, dataset.input_shape, dataset.num_classes).to(device)
        return m, torch.optim.SGD(m.parameters(), lr=config.lr, momentum=config.momentum)

    model, opt = new_model(0)
    remaining = budgets.epsilons.copy()
    charges, pis, composed, rounds_info, ensemble = [], [], [], [], []
    total_steps, t0 = 0, time.perf_counter()
    first_tau = plan[0]["threshold"] if plan else None
    for r, round_plan in enumerate(plan):
        info = {k: v for k, v in round_plan.items() if k != "steps_per_epoch"}
        tau, q, sigma, steps, expected = (
            round_plan[k] for k in ("threshold", "sample_rate", "noise_multiplier", "steps", "expected_sample_size")
        )
        active = remaining > 1e-9 * budgets.epsilons.max()
        b = np.where(active, remaining, 0.0)
        pi = sampling_probabilities(b, tau)
        if history_mode:
            composed.append(round_plan["epsilon_composed"])
        spent, dl = sampling_guarantee(b, tau, round_plan["delta_round"])  # Thm. 4.2, for every example
        charges.append((spent, dl))
        pis.append(pi)
        remaining = np.maximum(remaining - spent, 0.0)
        sampled = np.flatnonzero(rng.random(n) < pi)  # secret: never reported
        if method == "adapdp" and r > 0:
            model, opt = new_model(r)
        elif r > 0:  # continuing one model: smaller steps as the thresholds shrink (μ_R of Alg. 1)
            for grp in opt.param_groups:
                grp["lr"] = config.lr * min(1.0, tau / first_tau)
        model = run_dp_round(
            model,
            opt,
            (x, y),
            sampled,
            budgets=budgets,
            noise_multiplier=sigma,
            sample_rate=q,
            clip_norm=c,
            steps=steps,
            steps_per_epoch=round_plan["steps_per_epoch"],
            expected_batch_size=q * expected,
            seed=int(seeds.integers(2**62)) if seeds is not None else None,
            secure_mode=secure,
            noise_generator=noise,
            grad_sample_mode=getattr(config, "grad_sample_mode", "hooks"),
            progress=config.progress,
            desc=f"{method} round {r + 1}",
        )
        total_steps += steps
        info["test_accuracy_round_model"] = accuracies(
            _predict([(model, 1.0)], dataset.x_test).argmax(1), dataset.y_test, dataset.num_classes
        )["accuracy"]
        rounds_info.append(info)
        if method == "adapdp":
            ensemble.append((model, tau * expected))
    final = ensemble if method == "adapdp" else [(model, 1.0)]
    wsum = sum(w for _, w in final)
    test = accuracies(
        _predict([(m, w / wsum) for m, w in final], dataset.x_test).argmax(1), dataset.y_test, dataset.num_classes
    )
    if not charges:
        eps_i, delta_i = np.zeros(n), np.zeros(n)
    elif history_mode:
        eps_i, delta_i = history_guarantee(np.stack(pis), composed, delta)
    else:
        eps_i, delta_i = compose(charges)
    if np.any(eps_i > budgets.epsilons * (1 + 1e-9) + 1e-12):
        raise RuntimeError("internal error: a (Phi, Delta)-PDP guarantee exceeds a budget")
    values, counts, inverse = budgets.groups()
    groups = [
        {
            "budget": float(v),
            "count": int(k),
            "epsilon_spent": float(eps_i[inverse == g].max()),
            "delta": float(delta_i[inverse == g].max()),
            # π of the group's *remaining* budget in each round (all members share it)
            "mean_sampling_probability": [float(np.mean(p[inverse == g])) for p in pis],
        }
        for g, (v, k) in enumerate(zip(values, counts, strict=True))
    ]
    report = {
        "method": method,
        "dataset": dataset.name,
        "model": model_name,
        "accountant": config.accountant,
        "guarantee": GUARANTEE_HISTORY if history_mode else GUARANTEE,
        **neighbouring(),
        "delta": delta,
        "delta_mode": "per-round" if opts.per_round_delta and not history_mode else "total",
        "max_delta": float(delta_i.max()),
        "test_accuracy": test["accuracy"],
        "per_class_accuracy": test["per_class_accuracy"],
        "noise_multiplier": [ri["noise_multiplier"] for ri in rounds_info],
        "steps": total_steps,
        "rounds": rounds_info,
        "threshold_loss": opts.threshold_loss,
        "w1": w1,
        "noise_history": history_mode,
        "epochs_per_round": config.epochs,
        "batch_size": B,
        "lr": config.lr,
        "clip_norm": c,
        "wall_seconds": time.perf_counter() - t0,
        "models": len(final),
        "groups": groups,
    }
    report["secure_mode"] = secure
    report["randomness"] = randomness_note(secure, "private/seed.json" if out_dir is not None else None)
    report["device"] = str(device)
    if out_dir is not None:
        from ..analysis.report import write_report
        from ..runfolder import RunFolder

        rf = out_dir if isinstance(out_dir, RunFolder) else RunFolder(out_dir, resume=True)
        rf.write_csv(
            "pdp_guarantees.csv",
            ["index", "label", "budget", "epsilon", "delta"],
            [np.arange(n), y.numpy(), budgets.epsilons, eps_i, delta_i],
            "private",
            "every example's (epsilon_i, delta_i) and budget (personal data)",
        )
        if seed is not None:
            rf.record_seed(
                seed,
                "the run's seed: the per-round sampling, every round's Poisson batches and noise, "
                "the initialisation; --seed with it replays the run",
            )
        rf.save_torch(
            "model.pt",
            [getattr(m, "_module", m).state_dict() for m, _ in final],
            "public",
            "the trained model(s): a list of state_dicts (adapdp: the ensemble, weights in report.json)",
        )
        rf.file("report.html", "public", "the run's readable report")
        rf.file("report.json", "public", "the run's report")
        report["files"] = {k: v["kind"] for k, v in rf.files().items()}
        rf.write_json(
            "report.json",
            report,
            "public",
            "the run's report: (Phi, Delta)-PDP guarantee per group, rounds, test metrics, hyper-parameters",
        )
        write_report(rf)
    if seed is not None:
        report["private"] = {"seed": seed}  # not in report.json; on stdout only with --show-private
    return report
