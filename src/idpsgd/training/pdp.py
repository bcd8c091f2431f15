"""PDP-SGD and its baselines (Heo et al., Alg. 1–2, App. B): personalized sampling before DP-SGD.

Each round R: pick a threshold τ_R from the remaining budgets (eq. 6 or 7), sample every
example with π_{i,R} (eq. 4), run DP-SGD calibrated to (τ_R, δ)-DP on the sample, and charge the
round's cost.  Methods:

* ``pdp-sgd`` (Alg. 1) — ``rounds`` rounds continuing one model;
* ``pdp-sampling`` (App. B.1, Jorgensen et al.) — one round;
* ``adapdp`` (App. B.2, Niu et al.) — ``rounds`` rounds, a fresh model per round, predictions
  combined with weights τ_T·|D_T| (softmax outputs).

Our reading, where the paper is ambiguous or its bookkeeping is not backed by its theorems:

1. **Every example is charged every round**, sampled or not: by Thm. 4.2 round R is
   (min(b_i, τ_R), π_{i,R} δ)-PDP for *every* user i (b_i its remaining budget).  Alg. 1 charges
   only the sampled examples; then the next round's sampling rates depend on the secret
   sampling outcome, which Thm. 4.3 does not cover.  Totals follow Thm. 4.3: ε_i = Σ_R
   min(b_{i,R}, τ_R) ≤ its budget, δ_i = Σ_R π_{i,R} δ ≤ rounds·δ.
2. **Round parameters are public**: the sampling rate q_R = B / E|D_R| (E|D_R| = Σ_i π_{i,R}), the
   steps and the normalisation of the noisy sum use the expected sample size, never |D_R|, and
   AdaPDP's combination weights use E|D_T| instead of |D_T|.
3. **σ per round** (Alg. 4): calibrated so that the round's DP-SGD alone is (τ_R, δ)-DP, which is
   what Thm. 4.2 needs.  Alg. 4 composes the accountant history of earlier rounds into the target;
   ``noise_history=True`` reproduces that (more noise, still valid).
4. Epochs per round (Alg. 1 leaves n and μ_R per round open): for pdp-sgd ``--epochs`` in the
   first round, then E·(τ_R/τ_1)² (adapdp trains each fresh model for ``--epochs``) — for a fixed rate, ε grows about like √steps/σ, so this keeps the noise
   multiplier roughly constant across rounds; with a constant n the later, smaller thresholds
   need so much noise that they undo the first round (measured: 0.70 vs 0.82 after round 1).
   pdp-sgd's learning rate μ_R is scaled by τ_R/τ_1 for the same reason.
5. loss_a (eq. 7) is 0 whenever one waste is 0, so its minimum is the smallest remaining budget:
   with it, each round trains everyone left at the smallest remaining budget.
"""
from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..accounting import SampledGaussianEvent, calibrate_noise_multiplier, epsilon_sgm, rdp_epsilon, solve_monotone
from ..accounting.pdp import compose, sampling_guarantee, sampling_probabilities, select_threshold
from ..assignment import Assignment, Budgets, GroupParams
from ..data import Dataset
from ..io import atomic_open, write_csv, write_json
from ..models import DEFAULT_MODEL, create_model
from ..validation import InvalidParameterError
from .engine import accuracies
from .private import make_private_individualized, steps_per_epoch_for

log = logging.getLogger("idpsgd")

PDP_METHODS = ("pdp-sgd", "pdp-sampling", "adapdp")
DEFAULT_W1 = {"pdp-sgd": 0.7, "pdp-sampling": 0.7, "adapdp": 0.2}   # Heo et al. App. C.2
GUARANTEE = ("(Phi, Delta)-personalized DP (Heo et al. Thm. 4.2-4.4): every example i gets "
             "(epsilon_i, delta_i) with epsilon_i <= its budget and delta_i = sum over rounds of pi_i,R * delta")


def _round_sigma(tau, delta, q, steps, accountant, history):
    if not history:
        return float(calibrate_noise_multiplier(tau, delta, q, steps, accountant))
    # Alg. 4: the earlier rounds' events composed with this round's must stay within τ (RDP)
    def eps(s, _idx):
        return np.array([rdp_epsilon(history + [SampledGaussianEvent(q, float(s[0]), steps)], delta)[0]])
    return float(solve_monotone(eps, np.array([tau]), 1e-2, 1e6, increasing=False, rtol=1e-4)[0])


def _predict(models_weights, x, batch_size: int = 1024) -> torch.Tensor:
    """Weighted sum of the models' softmax outputs (in batches)."""
    probs = 0
    with torch.no_grad():
        for model, w in models_weights:
            m = getattr(model, "_module", model)
            m.eval()
            probs = probs + w * torch.cat([F.softmax(m(x[i:i + batch_size]), dim=1)
                                           for i in range(0, len(x), batch_size)])
    return probs


def train_pdp(dataset: Dataset, budgets: Budgets, config, out_dir=None) -> dict:
    """Run ``config.method`` in :data:`PDP_METHODS`; returns the report (and writes it to ``out_dir``)."""
    method = config.method
    if method not in PDP_METHODS:
        raise InvalidParameterError("method", method, f"must be one of {', '.join(PDP_METHODS)}")
    if int(config.rounds) < 1:
        raise InvalidParameterError("rounds", config.rounds, "must be an integer >= 1")
    w1 = DEFAULT_W1[method] if config.w1 is None else float(config.w1)
    if not 0 <= w1 <= 1:
        raise InvalidParameterError("w1", w1, "must be in [0, 1] (w2 = 1 - w1)")
    x, y, n = dataset.x_train, dataset.y_train, len(dataset.y_train)
    if len(budgets) != n:
        raise InvalidParameterError("budgets", f"{len(budgets)} values", f"need one per training example ({n})")
    delta, B, c = budgets.delta, int(config.batch_size), float(config.clip_norm)
    rounds = 1 if method == "pdp-sampling" else int(config.rounds)
    rng = np.random.default_rng(config.seed)
    noise = torch.Generator().manual_seed(config.seed)
    model_name = config.model or DEFAULT_MODEL.get(dataset.name, "mlp")

    def new_model(k):
        torch.manual_seed(config.seed + k)
        m = create_model(model_name, dataset.input_shape, dataset.num_classes)
        return m, torch.optim.SGD(m.parameters(), lr=config.lr, momentum=config.momentum)

    model, opt = new_model(0)
    remaining = budgets.epsilons.copy()
    charges, events, rounds_info, ensemble = [], [], [], []
    total_steps, t0 = 0, time.perf_counter()
    first_tau = None
    for r in range(rounds):
        active = remaining > 1e-9 * budgets.epsilons.max()
        if not active.any():
            break
        tau = select_threshold(remaining[active], config.threshold_loss, w1, 1 - w1)
        b = np.where(active, remaining, 0.0)
        pi = sampling_probabilities(b, tau)
        expected = float(pi.sum())
        if expected < 1:
            log.warning("round %d: expected sample size %.2f < 1; stopping", r + 1, expected)
            break
        q = min(1.0, B / expected)
        spe = steps_per_epoch_for(q)
        first_tau = first_tau or tau
        scale = min(1.0, tau / first_tau) ** 2 if method == "pdp-sgd" else 1.0   # adapdp: fresh models
        epochs = max(1, int(round(int(config.epochs) * scale)))
        steps = epochs * spe
        sigma = _round_sigma(tau, delta, q, steps, config.accountant, events if config.noise_history else None)
        round_eps = float(epsilon_sgm(q, sigma, steps, delta, config.accountant))
        spent, dl = sampling_guarantee(b, tau, delta)           # Thm. 4.2, for every example
        charges.append((spent, dl))
        remaining = np.maximum(remaining - spent, 0.0)
        events.append(SampledGaussianEvent(q, sigma, steps))
        sampled = np.flatnonzero(rng.random(n) < pi)             # secret: never reported
        if method == "adapdp" and r > 0:
            model, opt = new_model(r)
        elif r > 0:  # continuing one model: smaller steps as the thresholds shrink (μ_R of Alg. 1)
            for grp in opt.param_groups:
                grp["lr"] = config.lr * min(1.0, tau / first_tau)
        group = GroupParams(tau, int(sampled.size), 1.0, q, c, sigma, round_eps)
        assignment = Assignment("uniform", config.accountant, sigma, q, c, steps, delta, (group,),
                                np.zeros(sampled.size, dtype=np.int64))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook.*")
            gsm, dp_opt, loader = make_private_individualized(model, opt, (x[sampled], y[sampled]), assignment,
                                                              seed=rng, noise_generator=noise, steps_per_epoch=spe)
            dp_opt.expected_batch_size = q * expected            # public normalisation, not |D_R|
            model = gsm
            gsm.train()
            for _epoch in tqdm(range(epochs), disable=None if config.progress else True,
                               desc=f"{method} round {r + 1}", leave=False):
                for xb, yb, _ in loader:
                    dp_opt.zero_grad(set_to_none=True)
                    F.cross_entropy(gsm(xb), yb).backward()
                    dp_opt.step()
                    total_steps += 1
        acc = accuracies(_predict([(model, 1.0)], dataset.x_test).argmax(1), dataset.y_test,
                         dataset.num_classes)["accuracy"]
        rounds_info.append({"round": r + 1, "threshold": tau, "noise_multiplier": sigma, "sample_rate": q,
                            "expected_sample_size": expected, "epochs": epochs, "steps": steps, "epsilon_round": round_eps,
                            "test_accuracy_round_model": acc})
        if method == "adapdp":
            ensemble.append((model, tau * expected))
    final = ensemble if method == "adapdp" else [(model, 1.0)]
    wsum = sum(w for _, w in final)
    test = accuracies(_predict([(m, w / wsum) for m, w in final], dataset.x_test).argmax(1), dataset.y_test,
                      dataset.num_classes)
    eps_i, delta_i = compose(charges) if charges else (np.zeros(n), np.zeros(n))
    if np.any(eps_i > budgets.epsilons * (1 + 1e-12)):
        raise RuntimeError("internal error: a (Phi, Delta)-PDP charge exceeds a budget")
    values, counts, inverse = budgets.groups()
    groups = [{"budget": float(v), "count": int(k), "epsilon_spent": float(eps_i[inverse == g].max()),
               "delta": float(delta_i[inverse == g].max()),
               "mean_sampling_probability": [float(np.mean(sampling_probabilities(
                   np.full(1, v), ri["threshold"]))) for ri in rounds_info]}
              for g, (v, k) in enumerate(zip(values, counts))]
    report = {
        "method": method, "dataset": dataset.name, "model": model_name, "accountant": config.accountant,
        "guarantee": GUARANTEE, "delta": delta,
        "test_accuracy": test["accuracy"], "per_class_accuracy": test["per_class_accuracy"],
        "noise_multiplier": [ri["noise_multiplier"] for ri in rounds_info],
        "steps": total_steps, "rounds": rounds_info, "threshold_loss": config.threshold_loss, "w1": w1,
        "epochs_per_round": config.epochs, "batch_size": B, "lr": config.lr, "clip_norm": c, "seed": config.seed,
        "wall_seconds": time.perf_counter() - t0, "models": len(final), "groups": groups,
        "max_delta": float(delta_i.max()),
    }
    if out_dir is not None:
        from pathlib import Path
        out = Path(out_dir)
        write_csv(out / "pdp_guarantees.csv", ["index", "label", "budget", "epsilon", "delta"],
                  [np.arange(n), y.numpy(), budgets.epsilons, eps_i, delta_i], private=True)
        with atomic_open(out / "model.pt", "wb", private=True) as fh:
            torch.save([getattr(m, "_module", m).state_dict() for m, _ in final], fh)
        write_json(out / "report.json", report)
    return report
