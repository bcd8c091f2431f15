"""The per-instance runner (Thudi et al. §4): R training runs from one initialisation, per-step
per-instance RDP of chosen points at checkpoints, composed by Thm. 3.3.

For each run (uniform DP-SGD at ``epsilon`` on the whole training set X' ∋ x*; same initial
model, different sampling and noise), before every ``checkpoint_every``-th step the runner records

* ``sum`` rule (DP-SGD as implemented): the clipped gradient norm ‖g(x*)‖ of each target point,
  whose per-step divergence is Thm. 3.2 at each step's composition order;
* ``mean`` rule: every training example's clipped gradient, from which Thm. 3.6 is estimated
  with ``samples`` = (outer, inner) sampled mini-batches in both directions, noise std σc/(qN)
  (the sum rule's noise over the expected batch size), at the largest order the checkpoint's
  steps need.

A checkpoint's value stands for the steps up to the next checkpoint.  Expectations over the
chain are means over the R runs on X' (the paper's Fig. 1a direction, D(Train(X') ‖ Train(X)));
the other direction would need R runs on X \\ {x*} per point.  All results are **estimates** of
the theorems' expectations.  NPIU (§5.4) treats the points, in order, as deletion requests and
uses the sum-rule per-instance divergences at the orders it needs.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from ..accounting import compute_rdp
from ..accounting.per_instance import (composition_bound, corollary_3_1, exponents_to_bound, fact_3_5_samples,
                                       npiu_decisions, step_orders, sum_rule_step_rdp, tuple_exponents)
from ..assignment import Budgets
from ..io import atomic_open, write_csv, write_json
from ..validation import InvalidParameterError
from .engine import Trainer, TrainConfig
from .norms import per_example_grad_norms


def per_example_clipped_grads(model, x, y, clip: float, batch_size: int = 256) -> torch.Tensor:
    """(n × d) per-example gradients clipped to ``clip`` (through Opacus hooks, eval mode)."""
    from opacus import GradSampleModule
    import torch.nn.functional as F

    from .norms import _clear, eval_mode_with_hooks
    gsm = model if isinstance(model, GradSampleModule) else GradSampleModule(model)
    params = [p for p in gsm.parameters() if p.requires_grad]
    out = []
    try:
        with eval_mode_with_hooks(gsm._module):
            for i in range(0, len(x), batch_size):
                xb, yb = x[i:i + batch_size], y[i:i + batch_size]
                _clear(gsm)
                F.cross_entropy(gsm(xb), yb).backward()
                g = torch.cat([p.grad_sample.reshape(len(xb), -1) for p in params], dim=1)
                factor = (clip / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)
                out.append((g * factor[:, None]).detach())
    finally:
        _clear(gsm)
        if gsm is not model:
            gsm._close()
    return torch.cat(out).double()


class _MeanRuleEstimator:
    """Thm. 3.6 for many target points from one pool of sampled batches (Gram-matrix form).

    Every batch update is μ = (S_b − m_b g + I g)/(n_b − m_b + I): pool batch b of the full
    training set with x* removed (m_b: x* was in it) and, for X', x* added with probability q.
    Inner products then come from the pool's Gram matrix, ⟨S_b, g⟩ and ‖g‖².
    """

    def __init__(self, grads: torch.Tensor, q: float, outer: int, inner: int, order: int, rng):
        n = grads.shape[0]
        self.outer, self.inner, self.order, self.q, self.rng = outer, inner, order, q, rng
        size = outer + outer * inner * order
        self.mask = rng.random((size, n)) < q
        m = torch.from_numpy(self.mask.astype(np.float64))
        self.sums = m @ grads                                  # (P, d)
        self.counts = self.mask.sum(axis=1).astype(float)
        self.gram = (self.sums @ self.sums.T).numpy()
        self.grads = grads

    def bounds(self, point: int, noise_std: float) -> tuple[float, float]:
        """(bound on D(M(X') ‖ M(X)), bound on D(M(X) ‖ M(X'))) for target ``point``."""
        o, k, a = self.outer, self.inner, self.order
        forward = self.direction(point, noise_std, self.rng.random((o, k, a)) < self.q, np.zeros(o, bool))
        backward = self.direction(point, noise_std, np.zeros((o, k, a), bool), self.rng.random(o) < self.q)
        return forward, backward

    def direction(self, point: int, noise_std: float, inc_t, inc_o) -> float:
        """Thm. 3.6 with given inclusion bits of x* in the tuple batches (o, k, α) and outer batches (o,)."""
        g = self.grads[point]
        h = (self.sums @ g).numpy()
        gg = float(g @ g)
        mb = self.mask[:, point].astype(float)
        o, k, a = self.outer, self.inner, self.order
        idx_outer = np.arange(o)
        tb = (o + np.arange(o * k * a)).reshape(o, k, a)

        def coef(b, inc):
            size = np.maximum(self.counts[b] - mb[b] + inc, 1.0)
            return 1.0 / size, (inc.astype(float) - mb[b]) / size

        at, bt = coef(tb, inc_t)                       # tuple members: μ = a·S_b + β·g
        ao, bo = coef(idx_outer, inc_o)
        gram_tt = (at[..., :, None] * at[..., None, :] * self.gram[tb[..., :, None], tb[..., None, :]]
                   + at[..., :, None] * bt[..., None, :] * h[tb][..., :, None]
                   + at[..., None, :] * bt[..., :, None] * h[tb][..., None, :]
                   + bt[..., :, None] * bt[..., None, :] * gg)
        ob = idx_outer[:, None, None]
        aoo, boo = ao[:, None, None], bo[:, None, None]
        gram_tw = at * aoo * self.gram[tb, ob] + at * boo * h[tb] + aoo * bt * h[ob] + bt * boo * gg
        norm_w = (ao ** 2 * self.gram[idx_outer, idx_outer] + 2 * ao * bo * h[idx_outer] + bo ** 2 * gg)[:, None]
        return exponents_to_bound(tuple_exponents(gram_tt, gram_tw, norm_w, a), a, noise_std)


def run_per_instance(dataset, points, runs: int = 3, alpha: int = 8, update_rule: str = "sum",
                     config: TrainConfig | None = None, epsilon: float = 3.0, delta: float = 1e-5,
                     checkpoint_every: int | None = None, samples=(20, 20), p: float | None = None,
                     unlearning_beta: float | None = None, out_dir=None) -> dict:
    """Train ``runs`` runs and bound the per-instance RDP of each point in ``points`` (training indices)."""
    if update_rule not in ("sum", "mean"):
        raise InvalidParameterError("update_rule", update_rule, "must be sum or mean")
    if int(runs) < 1:
        raise InvalidParameterError("runs", runs, "must be an integer >= 1")
    alpha = int(alpha)
    if alpha < 2 or alpha != float(alpha):
        raise InvalidParameterError("alpha", alpha, "must be an integer >= 2")
    n_train = len(dataset.y_train)
    points = np.asarray(points, dtype=np.int64)
    if points.size == 0 or points.min() < 0 or points.max() >= n_train or np.unique(points).size != points.size:
        raise InvalidParameterError("points", points.tolist(), f"must be distinct indices in [0, {n_train})")
    config = config or TrainConfig()
    if update_rule == "mean":   # every clipped per-example gradient, and the pooled batch sums, in memory
        from ..models import DEFAULT_MODEL, create_model
        d = sum(p.numel() for p in create_model(config.model or DEFAULT_MODEL.get(dataset.name, "mlp"),
                                                dataset.input_shape, dataset.num_classes).parameters())
        pool = samples[0] * (1 + samples[1] * 2 * alpha)
        need = 8 * d * (n_train + pool) / 2 ** 30
        if need > 4:
            raise InvalidParameterError("update_rule", "mean", f"needs about {need:.0f} GiB here ({n_train} examples x "
                                        f"{d} parameters); use a smaller dataset or model, or --samples")
    budgets = Budgets.from_array(np.full(n_train, float(epsilon)), delta)
    x_pts, y_pts = dataset.x_train[points], dataset.y_train[points]
    sens, mean_fwd, mean_bwd, correct, steps_total, ckpts = [], [], [], [], None, None
    for r in range(int(runs)):
        cfg = dataclasses.replace(config, method="uniform", seed=config.seed + 7919 * (r + 1),
                                  init_seed=config.seed, individual_accounting=False)
        trainer = Trainer(dataset, budgets, cfg)
        phase = trainer.plan.phases[0]
        a = phase.assignment
        q, c, sigma = a.sample_rate, a.clip_norm, a.noise_multiplier
        n = trainer.plan.steps
        every = int(checkpoint_every or phase.steps_per_epoch)
        orders = step_orders(alpha, n, p)
        rec_s, rec_f, rec_b, rec_t = [], [], [], []
        rng = np.random.default_rng([config.seed, r, 17])

        def hook(tr, model, step, rec_s=rec_s, rec_f=rec_f, rec_b=rec_b, rec_t=rec_t, rng=rng):
            if step % every:
                return
            rec_t.append(step)
            norms, _ = per_example_grad_norms(model, x_pts, y_pts)
            rec_s.append(np.minimum(norms, c))
            if update_rule == "mean":
                grads = per_example_clipped_grads(model, dataset.x_train, dataset.y_train, c)
                order = int(orders[step:min(step + every, n)].max())
                est = _MeanRuleEstimator(grads, q, samples[0], samples[1], order, rng)
                noise = sigma * c / (q * n_train)
                fb = [est.bounds(int(j), noise) for j in points]
                rec_f.append([v[0] for v in fb])
                rec_b.append([v[1] for v in fb])

        trainer.step_hooks.append(hook)
        trainer.run()
        steps_total, ckpts = n, np.asarray(rec_t)
        expand = np.searchsorted(ckpts, np.arange(n), side="right") - 1     # checkpoint standing for each step
        sens.append(np.asarray(rec_s)[expand])                               # (n, points)
        if update_rule == "mean":
            mean_fwd.append(np.asarray(rec_f)[expand])
            mean_bwd.append(np.asarray(rec_b)[expand])
        module = getattr(trainer.model, "_module", trainer.model)
        module.eval()
        with torch.no_grad():
            correct.append((module(x_pts).argmax(1) == y_pts).numpy())
    sens = np.stack(sens)                                                    # (runs, n, points)
    n = steps_total
    sum_base_step = float(np.ravel(compute_rdp(q, sigma, [float(alpha)]))[0])
    base_step = sum_base_step if update_rule == "sum" else float(np.ravel(compute_rdp(
        q, sigma / (q * n_train), [float(alpha)]))[0])   # mean rule: noise σc/(qN), worst sensitivity c

    def sum_rule_bound(j, order):
        o = step_orders(order, n, p)
        d = np.empty((sens.shape[0], n))
        for val in np.unique(o):
            cols = o == val
            d[:, cols] = sum_rule_step_rdp(q, sens[:, cols, j], sigma * c, int(val))
        return composition_bound(d, order, p)

    per_point, step_rows = [], []
    late = slice(n // 2, n)
    for k, j in enumerate(points):
        if update_rule == "sum":
            res = sum_rule_bound(k, alpha)
            contrib = res["contributions"]
            detail = {}
        else:
            fwd = composition_bound(np.stack(mean_fwd)[:, :, k], alpha, p)
            bwd = composition_bound(np.stack(mean_bwd)[:, :, k], alpha, p)
            res = fwd if fwd["bound"] >= bwd["bound"] else bwd
            contrib = res["contributions"]
            detail = {"bound_forward": fwd["bound"], "bound_backward": bwd["bound"]}
        bound = res["bound"]
        eps = bound + math.log(1 / delta) / (alpha - 1)
        base = n * base_step
        cor = corollary_3_1(q, sens[:, -1, k], sigma * c, delta, delta, 2.0 * n) if update_rule == "sum" else None
        ratio = contrib / base_step
        per_point.append({
            "point": int(j), "label": int(y_pts[k]), "correct_fraction": float(np.mean([cr[k] for cr in correct])),
            "rdp": bound, "epsilon": eps, "baseline_rdp": base, "baseline_epsilon": base + math.log(1 / delta) / (alpha - 1),
            "ratio_to_baseline": bound / base, "late_mean_step_ratio": float(np.mean(ratio[late])),
            "late_share_steps_below_baseline": float(np.mean(ratio[late] < 1)),
            "corollary_3_1_last_step": {"epsilon": cor[0], "delta": cor[1]} if cor else None, **detail})
        step_rows += [(int(j), t + 1, float(contrib[t]), base_step, float(ratio[t])) for t in range(n)]

    summary = {
        "kind": "estimate", "definition": "per-instance Renyi DP of DP-SGD for X, X' = X + {x*} (Thudi et al. "
        "Thm. 3.2/3.6 per step, Thm. 3.3 composition; expectations estimated over runs)",
        "update_rule": update_rule, "alpha": alpha, "p": float(3 * n if p is None else p), "runs": int(runs),
        "steps": n, "checkpoints": int(ckpts.size), "sample_rate": q, "noise_multiplier": sigma, "clip_norm": c,
        "training_epsilon": float(epsilon), "delta": delta, "samples": list(samples) if update_rule == "mean" else None,
        "baseline_step_rdp": base_step,
        "fact_3_5_log10_runs_for_10pct": fact_3_5_samples(alpha, sum_base_step, float(np.ravel(compute_rdp(
            q, sigma, [2.0 * alpha]))[0]), n, 0.1, 0.05),
        "share_points_below_baseline_late": float(np.mean([pp["late_mean_step_ratio"] < 1 for pp in per_point])),
        "points": per_point,
    }
    correct_mask = np.array([pp["correct_fraction"] >= 0.5 for pp in per_point])
    summary["correct_vs_incorrect"] = {
        "correct_mean_ratio": float(np.mean([pp["ratio_to_baseline"] for pp in per_point if pp["correct_fraction"] >= 0.5]))
        if correct_mask.any() else None,
        "incorrect_mean_ratio": float(np.mean([pp["ratio_to_baseline"] for pp in per_point if pp["correct_fraction"] < 0.5]))
        if (~correct_mask).any() else None,
        "correct": int(correct_mask.sum()), "incorrect": int((~correct_mask).sum())}
    beta = float(unlearning_beta if unlearning_beta is not None else n * sum_base_step)
    divergence = [lambda order, k=k: sum_rule_bound(k, int(math.ceil(order)))["bound"] for k in range(points.size)]
    summary["unlearning"] = {"beta": beta, "alpha": alpha, "requests": [
        {**d, "point": int(points[d["request"]])} for d in npiu_decisions(divergence, alpha, beta)]}
    if out_dir is not None:
        out = Path(out_dir)
        keys = ["point", "label", "correct_fraction", "rdp", "epsilon", "baseline_rdp", "baseline_epsilon",
                "ratio_to_baseline", "late_mean_step_ratio", "late_share_steps_below_baseline"]
        write_csv(out / "per_instance.csv", keys, [[pp[kk] for pp in per_point] for kk in keys], private=True)
        cols = list(zip(*step_rows))
        write_csv(out / "per_instance_steps.csv", ["point", "step", "contribution", "baseline", "ratio"], cols,
                  private=True)
        write_json(out / "per_instance.json", summary, private=True)
        summary["plot"] = _plot(out, step_rows, points, n)
    return summary


def _plot(out: Path, rows, points, n) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arr = np.array([r[4] for r in rows]).reshape(len(points), n)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for k, j in enumerate(points):
        ax.plot(np.arange(1, n + 1), arr[k], lw=0.6, alpha=0.5)
    ax.plot(np.arange(1, n + 1), arr.mean(axis=0), color="k", lw=1.5, label="mean over points")
    ax.axhline(1.0, color="tab:red", ls="--", label="data-independent baseline")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("per-step contribution / baseline")
    ax.legend(fontsize=8)
    with atomic_open(out / "per_instance.png", "wb", private=True) as fh:
        fig.savefig(fh, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return "per_instance.png"
