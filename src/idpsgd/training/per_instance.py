"""The per-instance runner (Thudi et al. §3.2, §4): per-instance Rényi DP of DP-SGD in both directions.

A per-instance RDP guarantee for X and X' = X ∪ {x*} is the maximum of D_α(Train(X') ‖ Train(X))
and D_α(Train(X) ‖ Train(X')) (§3.2 "Applying to DP-SGD", Thm. 3.6, Fig. 1c, Fig. 4a–b).  Thm. 3.3
bounds each direction by expectations over the Markov chain of its *first* argument, so the runner
trains on both datasets:

* ``target_set="test"`` (Fig. 1a): x* from the test set, X = the training set, X' = X ∪ {x*}.
  ``runs`` runs on X are shared by all targets; each target gets ``runs`` runs on its X'.
* ``target_set="train"`` (Fig. 1c): x* from the training set, X' = the training set,
  X = X' \\ {x*}; ``runs`` shared runs on X', ``runs`` runs on each X.

Every run is the same public algorithm: uniform DP-SGD with the rate q = B/N, noise multiplier σ
calibrated to (``epsilon``, δ) on the training set (N examples), T steps and the noisy sum divided
by q·N — on X and X' alike (their sizes differ by one; the algorithm does not).  All runs start
from one initialisation; sampling and noise differ per run.

Before every ``checkpoint_every``-th step each run records, for its targets,

* ``sum`` rule (DP-SGD as implemented): the clipped gradient norm ‖g(x*)‖; the per-step
  divergence is Thm. 3.2 at each step's composition order (it bounds both directions);
* ``mean`` rule: Thm. 3.6 estimated from ``samples`` = (outer, inner) sampled mini-batches of
  every training example's clipped gradient, in the direction of the run's chain (runs on X':
  D(M(X') ‖ M(X)); runs on X: D(M(X) ‖ M(X'))), noise std σc/(qN), at the largest order the
  checkpoint's steps need.  These runs are *trained with the mean rule*: each update is the mean
  of the realised batch's clipped gradients plus N(0, (σc/(qN))²) — the mechanism analysed.

A checkpoint's value stands for the steps up to the next one.  Per point the report has
``rdp_add`` = D(Train(X') ‖ Train(X)) (chain X'), ``rdp_remove`` = D(Train(X) ‖ Train(X')) (chain
X) and ``rdp`` = their maximum.  These are **plug-in estimates** (the log of a sample mean is biased
low); ``*_upper`` are confidence upper bounds from the same samples (Hoeffding, Fact 3.5's
argument, with the data-independent per-step bound as the range), each holding with probability
≥ 1 − ``failure`` per point.  NPIU (§5.4, sum rule) treats the points, in order, as deletion
requests and uses the add direction, D(A(D ∪ {x*}) ‖ A(D)).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..accounting import compute_rdp
from ..accounting.per_instance import (
    composition_bound,
    corollary_3_1,
    exponents_to_bound,
    exponents_to_upper,
    fact_3_5_samples,
    npiu_decisions,
    step_orders,
    sum_rule_step_rdp,
    tuple_exponents,
)
from ..assignment import Budgets
from ..engine.norms import per_example_grad_norms
from ..validation import InvalidParameterError
from .loop import TrainConfig, Trainer

TARGET_SETS = ("test", "train")
UPDATE_RULES = ("sum", "mean")


def per_example_clipped_grads(model, x, y, clip: float, batch_size: int = 256) -> torch.Tensor:
    """(n × d) per-example gradients clipped to ``clip`` (through Opacus hooks, eval mode)."""
    import torch.nn.functional as F
    from opacus import GradSampleModule

    from ..engine.norms import _clear, eval_mode_with_hooks
    gsm = model if isinstance(model, GradSampleModule) else GradSampleModule(model)
    params = [p for p in gsm.parameters() if p.requires_grad]
    device = params[0].device
    out = []
    try:
        with eval_mode_with_hooks(gsm._module):
            for i in range(0, len(x), batch_size):
                xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
                _clear(gsm)
                F.cross_entropy(gsm(xb), yb).backward()
                g = torch.cat([p.grad_sample.reshape(len(xb), -1) for p in params], dim=1)
                factor = (clip / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)
                out.append((g * factor[:, None]).detach().cpu())
    finally:
        _clear(gsm)
        if gsm is not model:
            gsm._close()
    return torch.cat(out).double()


class _MeanRuleEstimator:
    """Thm. 3.6 for many target points from one pool of sampled batches (Gram-matrix form).

    ``grads`` holds the clipped gradients of the ``n_pool`` training examples, then of targets that
    are not in the training set.  Pool batch b is a Poisson sample (rate q) of the training
    examples.  For target x* every batch update is μ = (S_b − m_b g + I g)/(n_b − m_b + I): the pool
    batch with x* removed (m_b: x* was in it; 0 for a target outside the pool) and x* added when
    I = 1, so batches of X (= X' without x*) have I = 0 and batches of X' have I ~ Bernoulli(q).
    Inner products then come from the pool's Gram matrix, ⟨S_b, g⟩ and ‖g‖².  The mean of an
    empty batch is 0.
    """

    def __init__(self, grads: torch.Tensor, q: float, outer: int, inner: int, order: int, rng,
                 n_pool: int | None = None):
        n = grads.shape[0] if n_pool is None else int(n_pool)
        self.outer, self.inner, self.order, self.q, self.rng, self.n_pool = outer, inner, order, q, rng, n
        size = outer + outer * inner * order
        self.mask = rng.random((size, n)) < q
        m = torch.from_numpy(self.mask.astype(np.float64))
        self.sums = m @ grads[:n]                              # (P, d)
        self.counts = self.mask.sum(axis=1).astype(float)
        self.gram = (self.sums @ self.sums.T).numpy()
        self.grads = grads

    def bound(self, row: int, noise_std: float, direction: str, clip: float, failure: float) -> tuple[float, float]:
        """(plug-in estimate, confidence upper bound) of Thm. 3.6 for the target in row ``row``:
        ``add`` = D(M(X') ‖ M(X)) (tuples from X', outer batches from X), ``remove`` the reverse."""
        o, k, a = self.outer, self.inner, self.order
        if direction == "add":
            inc_t, inc_o = self.rng.random((o, k, a)) < self.q, np.zeros(o, bool)
        else:
            inc_t, inc_o = np.zeros((o, k, a), bool), self.rng.random(o) < self.q
        delta, norm_w = self._exponents(row, inc_t, inc_o)
        return (exponents_to_bound(delta, a, noise_std),
                exponents_to_upper(delta, a, noise_std, np.sqrt(np.maximum(norm_w[:, 0], 0.0)), clip, failure))

    def direction(self, point: int, noise_std: float, inc_t, inc_o) -> float:
        """Thm. 3.6's estimate with given inclusion bits of x* in the tuple batches (o, k, α) and outer batches (o,)."""
        delta, _ = self._exponents(point, inc_t, inc_o)
        return exponents_to_bound(delta, self.order, noise_std)

    def _exponents(self, point: int, inc_t, inc_o):
        g = self.grads[point]
        h = (self.sums @ g).numpy()
        gg = float(g @ g)
        mb = self.mask[:, point].astype(float) if point < self.n_pool else np.zeros(self.mask.shape[0])
        o, k, a = self.outer, self.inner, self.order
        idx_outer = np.arange(o)
        tb = (o + np.arange(o * k * a)).reshape(o, k, a)

        def coef(b, inc):
            size = self.counts[b] - mb[b] + inc
            nonempty = size > 0
            size = np.where(nonempty, size, 1.0)
            return np.where(nonempty, 1.0 / size, 0.0), np.where(nonempty, (inc.astype(float) - mb[b]) / size, 0.0)

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
        return tuple_exponents(gram_tt, gram_tw, norm_w, a), norm_w


def _public_plan(plan, n_examples: int, delta: float):
    """``plan``'s one phase (q, σ, c, steps) run on a dataset of ``n_examples`` (X or X').

    The runner also keeps the normaliser of the noisy sum at the training set's q·N (the trainer's
    ``expected_batch_size``), so X and X' see the same public algorithm.
    """
    phase = plan.phases[0]
    a = dataclasses.replace(phase.assignment, example_group=np.zeros(n_examples, dtype=np.int64))
    budgets = Budgets.from_array(np.full(n_examples, float(plan.budgets.epsilons[0])), delta)
    return dataclasses.replace(plan, budgets=budgets,
                               phases=(dataclasses.replace(phase, indices=np.arange(n_examples), assignment=a),))


def _install_mean_rule(optimizer: torch.optim.Optimizer, normaliser: float):
    """Make the DP-SGD update the mean rule: mean of the realised batch's clipped gradients + N(0, (σc/(qN))²).

    Opacus's DP optimizer leaves p.grad = (Σ clipped + noise)/(qN) and the clipped sum in
    p.summed_grad before it calls the wrapped optimizer's ``step``; this pre-hook on the wrapped
    optimizer replaces the sum's share Σ/(qN) by Σ/|B| (|B| the realised batch size, from the
    per-sample gradients; an empty batch contributes 0).  Returns the hook's handle.
    """
    def pre_hook(opt, _args, _kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                summed, gs = getattr(p, "summed_grad", None), getattr(p, "grad_sample", None)
                if p.grad is None or summed is None or gs is None:
                    raise RuntimeError("mean-rule training needs the DP optimizer's per-sample gradients "
                                       "(p.summed_grad, p.grad_sample) at the parameter update")
                size = sum(len(t) for t in gs) if isinstance(gs, (list, tuple)) else len(gs)
                share = (1.0 / size if size else 0.0) - 1.0 / normaliser
                p.grad.add_(summed.view_as(p.grad), alpha=share)
    return optimizer.register_step_pre_hook(pre_hook)


def run_per_instance(dataset, points=None, runs: int = 3, alpha: int = 8, update_rule: str = "sum",
                     config: TrainConfig | None = None, epsilon: float = 10.0, delta: float = 1e-5,
                     checkpoint_every: int | None = None, samples=(20, 20), p: float | None = None,
                     unlearning_beta: float | None = None, out_dir=None, target_set: str = "test",
                     failure: float = 0.05) -> dict:
    """Train runs on X and X' = X ∪ {x*} and bound the per-instance RDP of each target in both directions.

    Args:
        dataset: the data; ``points`` are indices into its test set (``target_set="test"``) or
            training set (``"train"``).
        runs: runs per chain (the shared dataset, and each target's modified one).
        alpha: integer Rényi order (the paper's 8).
        update_rule: ``sum`` (DP-SGD as implemented; Thm. 3.2) or ``mean`` (trained and analysed
            with the mean rule; Thm. 3.6).
        config: training hyperparameters (the paper's: clip norm 1, expected batch 128).
        epsilon, delta: the data-independent (ε, δ) the runs' noise is calibrated to (paper: ε = 10).
        checkpoint_every: steps between recorded checkpoints (default one epoch).
        samples: (outer, inner) mini-batch samples for Thm. 3.6.
        p: Hölder exponent of Thm. 3.3 (default 3n, Fact 3.4).
        failure: J of the confidence upper bounds (each point's ``rdp_upper`` holds w.p. ≥ 1 − J).
        out_dir: folder for per_instance.csv/.json, per_instance_steps.csv and the plots (all 0600).
    """
    if update_rule not in UPDATE_RULES:
        raise InvalidParameterError("update_rule", update_rule, "must be sum or mean")
    if target_set not in TARGET_SETS:
        raise InvalidParameterError("target_set", target_set, "must be test or train")
    if int(runs) != runs or int(runs) < 1:
        raise InvalidParameterError("runs", runs, "must be an integer >= 1")
    if float(alpha) != int(alpha) or int(alpha) < 2:
        raise InvalidParameterError("alpha", alpha, "must be an integer >= 2")
    if not 0 < failure < 1:
        raise InvalidParameterError("failure", failure, "must be in (0, 1)")
    if len(samples) != 2 or min(int(v) for v in samples) < 1:
        raise InvalidParameterError("samples", samples, "must be (outer, inner) with both >= 1")
    alpha, runs = int(alpha), int(runs)
    x_set, y_set = (dataset.x_test, dataset.y_test) if target_set == "test" else (dataset.x_train, dataset.y_train)
    points = np.asarray([] if points is None else points, dtype=np.int64)
    if points.size == 0 or points.min() < 0 or points.max() >= len(y_set) or np.unique(points).size != points.size:
        raise InvalidParameterError("points", points.tolist(), f"must be distinct indices into the {target_set} set "
                                    f"[0, {len(y_set)})")
    config = config or TrainConfig()
    if getattr(config, "secure_mode", False):
        raise InvalidParameterError("secure_mode", True, "per-instance analysis trains every run from one recorded "
                                    "initialisation and seeds; it cannot run in secure mode")
    if update_rule == "mean" and getattr(config, "grad_sample_mode", "hooks") == "ghost":
        raise InvalidParameterError("grad_sample_mode", "ghost", "the mean rule needs materialised per-sample "
                                    "gradients (hooks or functorch)")
    from ..engine.randomness import resolve_seed
    seed = resolve_seed(config.seed, False)     # a fresh seed is drawn and recorded when none is given
    config = dataclasses.replace(config, seed=seed)
    n_train = len(dataset.y_train)
    if update_rule == "mean":   # every clipped per-example gradient, and the pooled batch sums, in memory
        from ..models import DEFAULT_MODEL, create_model
        d = sum(v.numel() for v in create_model(config.model or DEFAULT_MODEL.get(dataset.name, "mlp"),
                                                dataset.input_shape, dataset.num_classes).parameters())
        pool = samples[0] * (1 + samples[1] * 2 * alpha)
        need = 8 * d * (n_train + points.size + pool) / 2 ** 30
        if need > 4:
            raise InvalidParameterError("update_rule", "mean", f"needs about {need:.0f} GiB here ({n_train} examples x "
                                        f"{d} parameters); use a smaller dataset or model, or --samples")
    x_pts, y_pts = x_set[points], y_set[points]
    budgets = Budgets.from_array(np.full(n_train, float(epsilon)), delta)
    # the shared chain: the training set (X for test targets, X' for training targets)
    shared_dir = "remove" if target_set == "test" else "add"
    other_dir = "add" if shared_dir == "remove" else "remove"
    plan = None
    state = {}

    def one_run(data, run_idx, targets, direction):
        nonlocal plan
        cfg = dataclasses.replace(config, method="uniform", seed=config.seed + 7919 * (run_idx + 1),
                                  init_seed=config.seed, progress=False)
        b = budgets if len(data.y_train) == n_train else Budgets.from_array(np.full(len(data.y_train),
                                                                                   float(epsilon)), delta)
        trainer = Trainer(data, b, cfg)
        if plan is None:
            plan = trainer.plan
        trainer.plan = _public_plan(plan, len(data.y_train), delta)
        a = plan.phases[0].assignment
        q, c, sigma, n = a.sample_rate, a.clip_norm, a.noise_multiplier, plan.steps
        normaliser = a.expected_batch_size
        trainer.expected_batch_size = normaliser   # the public q·N on X and X' alike (not Σ q_i of this run's data)
        every = int(checkpoint_every or plan.phases[0].steps_per_epoch)
        orders = step_orders(alpha, n, p)
        state.update(q=q, c=c, sigma=sigma, n=n, every=every, normaliser=normaliser)
        rec_t, rec_s, rec_m = [], [], []
        rng = np.random.default_rng([config.seed, run_idx, 17, int(targets[0]), direction == "add"])
        xt, yt = x_pts[targets], y_pts[targets]

        def hook(tr, model, step):
            if step % every:
                return
            rec_t.append(step)
            norms, _ = per_example_grad_norms(model, [(xt, yt)])
            rec_s.append(np.minimum(norms, c))
            if update_rule == "mean":
                pool_x, pool_y = dataset.x_train, dataset.y_train
                if target_set == "test":
                    grads = per_example_clipped_grads(model, torch.cat([pool_x, xt]), torch.cat([pool_y, yt]), c)
                    rows = n_train + np.arange(len(targets))
                else:
                    grads = per_example_clipped_grads(model, pool_x, pool_y, c)
                    rows = points[targets]
                order = int(orders[step:min(step + every, n)].max())
                est = _MeanRuleEstimator(grads, q, samples[0], samples[1], order, rng, n_pool=n_train)
                checkpoints = -(-n // every)
                rec_m.append([est.bound(int(r), sigma * c / normaliser, direction, c,
                                        failure / 4 / (runs * checkpoints)) for r in rows])

        handle = _install_mean_rule(trainer.optimizer, normaliser) if update_rule == "mean" else None
        trainer.step_hooks.append(hook)
        try:
            report = trainer.run()
        finally:
            if handle is not None:
                handle.remove()
        ckpts = np.asarray(rec_t)
        expand = np.searchsorted(ckpts, np.arange(n), side="right") - 1     # checkpoint standing for each step
        module = getattr(trainer.model, "_module", trainer.model)
        module.eval()
        device = next(module.parameters()).device
        with torch.no_grad():
            correct = (module(xt.to(device)).argmax(1).cpu() == yt).numpy()
        out = {"sens": np.asarray(rec_s)[expand], "checkpoints": ckpts, "correct": correct,
               "test_accuracy": report["test_accuracy"]}
        if update_rule == "mean":
            m = np.asarray(rec_m)                                            # (ckpts, targets, 2)
            out["mean_est"], out["mean_upper"] = m[expand, :, 0], m[expand, :, 1]
        return out

    k_all = np.arange(points.size)
    shared = [one_run(dataset, r, k_all, shared_dir) for r in range(runs)]
    own = []
    for k, j in enumerate(points):
        if target_set == "test":
            data_k = dataclasses.replace(dataset, x_train=torch.cat([dataset.x_train, x_pts[k:k + 1]]),
                                         y_train=torch.cat([dataset.y_train, y_pts[k:k + 1]]))
        else:
            keep = np.ones(n_train, bool)
            keep[j] = False
            data_k = dataclasses.replace(dataset, x_train=dataset.x_train[keep], y_train=dataset.y_train[keep])
        own.append([one_run(data_k, r, np.array([k]), other_dir) for r in range(runs)])

    q, c, sigma, n, normaliser = state["q"], state["c"], state["sigma"], state["n"], state["normaliser"]
    chains = {shared_dir: {key: np.stack([run[key] for run in shared])
                           for key in shared[0] if key not in ("checkpoints", "test_accuracy")}}
    chains[other_dir] = {key: np.stack([np.concatenate([run[key] for run in [own[k][r] for k in k_all]], axis=-1)
                                        for r in range(runs)])
                         for key in own[0][0] if key not in ("checkpoints", "test_accuracy")}
    ckpts = shared[0]["checkpoints"]
    orders_needed = step_orders(alpha, n, p)
    sum_base_step = float(np.ravel(compute_rdp(q, sigma, [float(alpha)]))[0])
    mean_sigma_eff = sigma / normaliser          # mean rule: noise σc/(qN), worst sensitivity c
    base_sigma = sigma if update_rule == "sum" else mean_sigma_eff
    base_step = float(np.ravel(compute_rdp(q, base_sigma, [float(alpha)]))[0])
    worst_by_order = {int(o): float(np.ravel(compute_rdp(q, base_sigma, [float(o)]))[0])
                      for o in np.unique(orders_needed)}

    def step_divergences(direction, k, order=alpha):
        """(runs, n) per-step divergences of point k on its chain, at the orders Thm. 3.3 needs."""
        o = step_orders(order, n, p)
        ch = chains[direction]
        if update_rule == "sum":
            s = ch["sens"][:, :, k]
            d = np.empty_like(s)
            for val in np.unique(o):
                cols = o == val
                d[:, cols] = sum_rule_step_rdp(q, s[:, cols], sigma * c, int(val))
            return d, d
        worst = np.array([worst_by_order.get(int(v), float(np.ravel(compute_rdp(q, base_sigma, [float(v)]))[0]))
                          for v in o])
        return ch["mean_est"][:, :, k], np.minimum(ch["mean_upper"][:, :, k], worst[None, :])

    def bound(direction, k, order=alpha):
        d, d_up = step_divergences(direction, k, order)
        o = step_orders(order, n, p)
        worst = np.array([worst_by_order.get(int(v), float(np.ravel(compute_rdp(q, base_sigma, [float(v)]))[0]))
                          for v in o])
        est = composition_bound(d, order, p)
        comp_failure = failure / 2 if update_rule == "sum" else failure / 4
        up = composition_bound(d_up, order, p, worst_step_rdp=worst, failure=comp_failure)
        return est, up

    per_point, step_rows, per_step_ratio = [], [], {"add": [], "remove": []}
    late = slice(n // 2, n)
    base = n * base_step
    log_term = math.log(1 / delta) / (alpha - 1)
    for k, j in enumerate(points):
        res = {dn: bound(dn, k) for dn in ("add", "remove")}
        rdp_add, rdp_remove = res["add"][0]["bound"], res["remove"][0]["bound"]
        up_add, up_remove = res["add"][1]["upper"], res["remove"][1]["upper"]
        rdp, rdp_up = max(rdp_add, rdp_remove), max(up_add, up_remove)
        ratios = {dn: res[dn][0]["contributions"] / base_step for dn in res}
        for dn, ratio in ratios.items():
            per_step_ratio[dn].append(ratio)
        step_ratio = np.maximum(ratios["add"], ratios["remove"])
        cor = (corollary_3_1(q, chains["add"]["sens"][:, -1, k], sigma * c, delta, delta, 2.0 * n)
               if update_rule == "sum" else None)
        per_point.append({
            "point": int(j), "label": int(y_pts[k]),
            "correct_fraction": float(np.mean(chains["add"]["correct"][:, k])),
            "rdp_add": rdp_add, "rdp_remove": rdp_remove, "rdp": rdp,
            "rdp_add_upper": up_add, "rdp_remove_upper": up_remove, "rdp_upper": rdp_up,
            "epsilon": rdp + log_term, "epsilon_upper": rdp_up + log_term,
            "baseline_rdp": base, "baseline_epsilon": base + log_term,
            "ratio_to_baseline": rdp / base, "ratio_upper_to_baseline": rdp_up / base,
            "late_mean_step_ratio": float(np.mean(step_ratio[late])),
            "late_share_steps_below_baseline": float(np.mean(step_ratio[late] < 1)),
            "corollary_3_1_last_step": {"epsilon": cor[0], "delta": cor[1]} if cor else None})
        step_rows += [(int(j), t + 1, float(res["add"][0]["contributions"][t]),
                       float(res["remove"][0]["contributions"][t]), base_step, float(ratios["add"][t]),
                       float(ratios["remove"][t])) for t in range(n)]

    # per-step guarantee at order α per checkpoint (Fig. 2 / Fig. 4), mean over each chain's runs
    stage_values = {}
    for dn in ("add", "remove"):
        ch = chains[dn]
        at_ckpt = ch["sens"][:, ckpts, :] if update_rule == "sum" else ch["mean_est"][:, ckpts, :]
        if update_rule == "sum":
            at_ckpt = sum_rule_step_rdp(q, at_ckpt, sigma * c, alpha)
        stage_values[dn] = at_ckpt.mean(axis=0) / base_step                        # (checkpoints, points)

    ratios_all = np.array([pp["ratio_to_baseline"] for pp in per_point])
    test_acc = [run["test_accuracy"] for run in shared]
    summary = {
        "kind": "estimate",
        "definition": "per-instance Renyi DP of DP-SGD: max(D(Train(X')||Train(X)), D(Train(X)||Train(X'))) with "
                      "X' = X + {x*} (Thudi et al. Thm. 3.2/3.6 per step, Thm. 3.3 composition; expectations "
                      "estimated over runs on each chain; *_upper: Hoeffding confidence upper bounds)",
        "target_set": target_set, "update_rule": update_rule, "alpha": alpha,
        "p": float(3 * n if p is None else p), "runs": runs, "runs_trained": runs * (1 + points.size), "steps": n,
        "checkpoints": int(ckpts.size), "sample_rate": q, "batch_size": config.batch_size, "noise_multiplier": sigma,
        "clip_norm": c, "lr": config.lr, "epochs": config.epochs, "seed": seed,
        "training_epsilon": float(epsilon), "training_epsilon_rule": "sum (the calibration of the noise)",
        "delta": delta, "failure": failure, "samples": list(samples) if update_rule == "mean" else None,
        "test_accuracy": float(np.mean(test_acc)), "test_accuracy_runs": test_acc,
        "baseline_step_rdp": base_step, "baseline_rdp": base,
        "median_ratio_to_baseline": float(np.median(ratios_all)),
        "p10_ratio_to_baseline": float(np.percentile(ratios_all, 10)),
        "median_upper_ratio_to_baseline": float(np.median([pp["ratio_upper_to_baseline"] for pp in per_point])),
        "fact_3_5_log10_runs_for_10pct": fact_3_5_samples(alpha, sum_base_step, float(np.ravel(compute_rdp(
            q, sigma, [2.0 * alpha]))[0]), n, 0.1, 0.05),
        "share_points_below_baseline_late": float(np.mean([pp["late_mean_step_ratio"] < 1 for pp in per_point])),
        "points": per_point,
    }
    correct_mask = np.array([pp["correct_fraction"] >= 0.5 for pp in per_point])
    summary["correct_vs_incorrect"] = {
        "correct_mean_ratio": float(ratios_all[correct_mask].mean()) if correct_mask.any() else None,
        "incorrect_mean_ratio": float(ratios_all[~correct_mask].mean()) if (~correct_mask).any() else None,
        "correct": int(correct_mask.sum()), "incorrect": int((~correct_mask).sum())}
    if update_rule == "sum":
        beta = float(unlearning_beta if unlearning_beta is not None else n * sum_base_step)
        divergence = [lambda order, k=k: bound("add", k, math.ceil(order))[0]["bound"]
                      for k in range(points.size)]
        summary["unlearning"] = {"beta": beta, "alpha": alpha, "direction": "add", "requests": [
            {**d, "point": int(points[d["request"]])} for d in npiu_decisions(divergence, alpha, beta)]}
    else:
        summary["unlearning"] = None   # NPIU's divergences at doubled orders come from Thm. 3.2 (sum rule)
    if out_dir is not None:
        from ..runfolder import RunFolder
        rf = out_dir if isinstance(out_dir, RunFolder) else RunFolder(out_dir, resume=True)
        keys = ["point", "label", "correct_fraction", "rdp_add", "rdp_remove", "rdp", "rdp_add_upper",
                "rdp_remove_upper", "rdp_upper", "epsilon", "epsilon_upper", "baseline_rdp", "baseline_epsilon",
                "ratio_to_baseline", "ratio_upper_to_baseline", "late_mean_step_ratio",
                "late_share_steps_below_baseline"]
        rf.write_csv("per_instance.csv", keys, [[pp[kk] for pp in per_point] for kk in keys], "private",
                     "per point: per-instance RDP estimates in both directions, upper bounds, ratios (estimates)")
        cols = list(zip(*step_rows))
        rf.write_csv("per_instance_steps.csv", ["point", "step", "contribution_add", "contribution_remove",
                                                "baseline", "ratio_add", "ratio_remove"], cols, "private",
                     "every step's per-instance contribution per point (estimates)")
        rf.write_json("per_instance.json", summary, "private", "the per-instance analysis: settings, per-point "
                      "estimates, NPIU decisions, test accuracy")
        rf.write_json("settings.json", public_summary(summary), "public", "the analysis' settings, the runs' test "
                      "accuracy and the data-independent RDP baseline (no per-point value)")
        summary["plots"] = [_plot_steps(rf, per_step_ratio, n), _plot_stages(rf, stage_values, ckpts, update_rule)]
    return summary


def _save(fig, rf, name: str, description: str) -> str:
    return rf.save_figure(name, fig, "private", description).name


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot_steps(out, ratios: dict, n: int) -> str:
    """Fig. 1a/1c (mean over points) and Fig. 1b (10th percentile) of the per-step contribution / baseline."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    steps = np.arange(1, n + 1)
    for dn, color in (("add", "tab:blue"), ("remove", "tab:orange")):
        arr = np.maximum(np.asarray(ratios[dn]), 1e-12)
        label = "D(Train(X')||Train(X))" if dn == "add" else "D(Train(X)||Train(X'))"
        axes[0].plot(steps, arr.mean(axis=0), color=color, lw=1.2, label=label)
        axes[1].plot(steps, np.percentile(arr, 10, axis=0), color=color, lw=1.2, label=label)
    for ax, title in zip(axes, ("mean over points (Fig. 1a, 1c)", "10th percentile over points (Fig. 1b)")):
        ax.axhline(1.0, color="tab:red", ls="--", label="data-independent baseline")
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("per-step contribution / baseline (estimate)")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "per_instance.png", "per-step contribution / baseline over training (Fig. 1)")


def _plot_stages(out, values: dict, ckpts, update_rule: str) -> str:
    """Fig. 2 (sum rule) / Fig. 4 (mean rule): distribution over points of the per-step guarantee at α,
    relative to the baseline, at the first, middle and last checkpoint (log axis)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    stages = {"initial": 0, "middle": len(ckpts) // 2, "final": len(ckpts) - 1}
    for ax, dn in zip(axes, ("add", "remove")):
        v = np.maximum(values[dn], 1e-12)
        lo, hi = float(np.log10(v.min())), float(np.log10(max(v.max(), 1.0)))
        bins = np.logspace(lo - 0.1, hi + 0.1, 30)
        for name, i in stages.items():
            ax.hist(v[i], bins=bins, alpha=0.5, label=f"{name} (step {int(ckpts[i]) + 1})")
        ax.axvline(1.0, color="tab:purple", ls="--", label="data-independent baseline")
        ax.set_xscale("log")
        ax.set_xlabel("per-step guarantee / baseline")
        ax.set_title(("D(M(X')||M(X))" if dn == "add" else "D(M(X)||M(X'))")
                     + f", {update_rule} rule (Thm. {'3.2' if update_rule == 'sum' else '3.6'})", fontsize=9)
    axes[0].set_ylabel("points")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "per_instance_stages.png", "distribution of per-step guarantees per stage (Fig. 2/4)")


#: Keys of the summary that are public: settings, test metrics of the DP-trained runs and the
#: data-independent baseline.  The per-point estimates and every statistic of them stay private.
PUBLIC_KEYS = ("kind", "definition", "alpha", "update_rule", "target_set", "runs", "runs_trained", "steps",
               "clip_norm", "sample_rate", "batch_size", "noise_multiplier", "lr", "epochs", "training_epsilon",
               "delta", "test_accuracy", "test_accuracy_runs", "baseline_rdp", "baseline_step_rdp", "failure",
               "seed", "secure_mode")


def public_summary(summary: dict) -> dict:
    """The public part of a :func:`run_per_instance` summary (see :data:`PUBLIC_KEYS`)."""
    return {k: summary[k] for k in PUBLIC_KEYS if k in summary}

