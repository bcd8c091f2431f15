"""The per-instance runner (Thudi et al. §3.2, §4): per-instance Rényi DP of DP-SGD in both directions.

A per-instance RDP guarantee for X and X' = X ∪ {x*} is the maximum of D_α(Train(X') ‖ Train(X))
and D_α(Train(X) ‖ Train(X')) (§3.2, Thm. 3.6, Fig. 1c, Fig. 4a–b).  Thm. 3.3 bounds each direction
by expectations over the Markov chain of its *first* argument, so this module trains on both
datasets (``target_set="test"``: x* from the test set, X the training set; ``"train"``: x* from the
training set, X = X' \\ {x*}), every run the same public algorithm (uniform DP-SGD, one
initialisation, sampling and noise per run), records x*'s sensitivity every ``checkpoint_every``
steps (``sum`` rule: ‖g(x*)‖, Thm. 3.2; ``mean`` rule: Thm. 3.6 from sampled mini-batches, the runs
trained with the mean rule) and composes them into plug-in estimates and Hoeffding upper bounds
(:mod:`idpsgd.accounting.per_instance`).  The upper values are bounds only with
``checkpoint_every=1`` (:func:`upper_kind`), and their failure probability is per point
(:data:`FAILURE_SCOPE`).  User guide, with every reported field: ``docs/per-instance.md``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..accounting import compute_rdp, epsilon_sgm
from ..accounting.neighbouring import neighbouring
from ..accounting.per_instance import (
    SumRuleTable,
    best_composition_order,
    best_order,
    composition_bound,
    corollary_3_1,
    epsilon_at_order,
    exponents_to_bound,
    exponents_to_upper,
    fact_3_5_samples,
    npiu_decisions,
    same_composition_rdp,
    step_orders,
    tuple_exponents,
)
from ..assignment import Budgets
from ..engine.noise.randomness import randomness_note
from ..engine.per_example.norms import per_example_grad_norms
from ..models import DEFAULT_MODEL, create_model
from ..validation import InvalidParameterError
from .loop import TrainConfig, Trainer, training_budgets
from .per_instance_outputs import PUBLIC_KEYS as PUBLIC_KEYS  # re-exported
from .per_instance_outputs import public_summary as public_summary  # re-exported
from .per_instance_runs import parallel_chains, supports
from .plans import build_plan

TARGET_SETS = ("test", "train")
UPDATE_RULES = ("sum", "mean")
#: What the ``failure`` probability of the confidence bounds covers (stated in every summary).
FAILURE_SCOPE = (
    "per point: each point's confidence bounds (*_upper, guarantee_*) hold with probability >= "
    "1 - failure for that point; there is no union bound over the points (all of them at once: "
    ">= 1 - points x failure)"
)


def upper_kind(checkpoint_every: int, steps: int) -> str:
    """What the ``*_upper`` values are: ``"confidence upper bound"`` when every step's sensitivity was
    measured (``checkpoint_every=1`` or a one-step run), else ``"estimate"`` (between checkpoints a
    step reuses the last measured sensitivity, which need not bound its own)."""
    return "confidence upper bound" if int(checkpoint_every) == 1 or int(steps) <= 1 else "estimate"


def per_example_clipped_grads(model, x, y, clip: float, batch_size: int = 256) -> torch.Tensor:
    """(n × d) per-example gradients of the cross-entropy, clipped to ``clip`` (Opacus's factor
    min(1, C/(‖g‖ + 1e-6))), at the model's current parameters in eval mode.

    Computed with ``torch.func`` on a copy of the user's module (inside any Opacus or engine wrapper),
    so the training engine's hooks and per-step book-keeping never see these extra passes.
    """
    import copy

    from torch.func import functional_call, grad, vmap

    from ..engine.per_example.unwrap import raw_module

    net = copy.deepcopy(raw_module(model)).eval()
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in net.named_buffers()}
    device = next(iter(params.values())).device

    def loss_one(p, xi, yi):
        return torch.nn.functional.cross_entropy(
            functional_call(net, {**p, **buffers}, (xi.unsqueeze(0),)), yi.unsqueeze(0)
        )

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    out = []
    for i in range(0, len(x), batch_size):
        g = per_example(params, x[i : i + batch_size].to(device), y[i : i + batch_size].to(device))
        g = torch.cat([t.reshape(t.shape[0], -1) for t in g.values()], dim=1)
        factor = (clip / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)
        out.append((g * factor[:, None]).detach().cpu())
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

    def __init__(
        self, grads: torch.Tensor, q: float, outer: int, inner: int, order: int, rng, n_pool: int | None = None
    ):
        n = grads.shape[0] if n_pool is None else int(n_pool)
        self.outer, self.inner, self.order, self.q, self.rng, self.n_pool = outer, inner, order, q, rng, n
        size = outer + outer * inner * order
        self.mask = rng.random((size, n)) < q
        m = torch.from_numpy(self.mask.astype(np.float64))
        self.sums = m @ grads[:n]  # (P, d)
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
        return (
            exponents_to_bound(delta, a, noise_std),
            exponents_to_upper(delta, a, noise_std, np.sqrt(np.maximum(norm_w[:, 0], 0.0)), clip, failure),
        )

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

        at, bt = coef(tb, inc_t)  # tuple members: μ = a·S_b + β·g
        ao, bo = coef(idx_outer, inc_o)
        gram_tt = (
            at[..., :, None] * at[..., None, :] * self.gram[tb[..., :, None], tb[..., None, :]]
            + at[..., :, None] * bt[..., None, :] * h[tb][..., :, None]
            + at[..., None, :] * bt[..., :, None] * h[tb][..., None, :]
            + bt[..., :, None] * bt[..., None, :] * gg
        )
        ob = idx_outer[:, None, None]
        aoo, boo = ao[:, None, None], bo[:, None, None]
        gram_tw = at * aoo * self.gram[tb, ob] + at * boo * h[tb] + aoo * bt * h[ob] + bt * boo * gg
        norm_w = (ao**2 * self.gram[idx_outer, idx_outer] + 2 * ao * bo * h[idx_outer] + bo**2 * gg)[:, None]
        return tuple_exponents(gram_tt, gram_tw, norm_w, a), norm_w


def _public_plan(plan, n_examples: int, delta: float):
    """``plan``'s one phase (q, σ, c, steps) run on a dataset of ``n_examples`` (X or X').

    The runner also keeps the normaliser of the noisy sum at the training set's q·N (the trainer's
    ``expected_batch_size``), so X and X' see the same public algorithm.
    """
    phase = plan.phases[0]
    a = dataclasses.replace(phase.assignment, example_group=np.zeros(n_examples, dtype=np.int64))
    budgets = Budgets.from_array(np.full(n_examples, float(plan.budgets.epsilons[0])), delta)
    return dataclasses.replace(
        plan, budgets=budgets, phases=(dataclasses.replace(phase, indices=np.arange(n_examples), assignment=a),)
    )


class _Handles:
    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _install_mean_rule(optimizer: torch.optim.Optimizer, normaliser: float, module: torch.nn.Module):
    """Make the DP-SGD update the mean rule: mean of the realised batch's clipped gradients + N(0, (σc/(qN))²).

    The DP optimizer leaves p.grad = (Σ clipped + noise)/(qN) and the clipped sum in p.summed_grad
    before it calls the wrapped optimizer's ``step`` (every ``grad_sample_mode``); this pre-hook on the
    wrapped optimizer replaces the sum's share Σ/(qN) by Σ/|B|, with |B| the realised batch size that
    a forward pre-hook on ``module`` (the user's module) recorded in training mode (an empty batch
    contributes 0).  Returns a handle whose ``remove()`` takes both hooks off.
    """
    from ..engine.per_example.unwrap import raw_module

    seen: dict = {}

    def forward_pre_hook(mod, args):
        if mod.training and args and torch.is_tensor(args[0]):
            seen["size"] = int(args[0].shape[0])

    def pre_hook(opt, _args, _kwargs):
        size = seen.pop("size", None)
        if size is None:
            raise RuntimeError("mean-rule training: no training forward pass before the parameter update")
        share = (1.0 / size if size else 0.0) - 1.0 / normaliser
        for group in opt.param_groups:
            for p in group["params"]:
                summed = getattr(p, "summed_grad", None)
                if p.grad is None or summed is None:
                    raise RuntimeError(
                        "mean-rule training needs the DP optimizer's clipped sum (p.summed_grad) at "
                        "the parameter update"
                    )
                p.grad.add_(summed.view_as(p.grad), alpha=share)

    return _Handles(
        raw_module(module).register_forward_pre_hook(forward_pre_hook), optimizer.register_step_pre_hook(pre_hook)
    )


def run_per_instance(
    dataset,
    points=None,
    runs: int = 3,
    alpha: float | None = None,
    update_rule: str = "sum",
    config: TrainConfig | None = None,
    epsilon: float = 10.0,
    delta: float = 1e-5,
    checkpoint_every: int | None = None,
    samples=(20, 20),
    p: float | None = None,
    unlearning_beta: float | None = None,
    out_dir=None,
    target_set: str = "test",
    failure: float = 0.05,
    file_prefix: str = "",
    figures: bool = True,
) -> dict:
    """Train runs on X and X' = X ∪ {x*} and bound the per-instance RDP of each target in both directions.

    Args:
        dataset: the data; ``points`` are indices into its test set (``target_set="test"``) or
            training set (``"train"``).
        runs: runs per chain (the shared dataset, and each target's modified one).
        alpha: Rényi order of the per-instance guarantee.  ``None`` (default): the order at which the
            data-independent ε of the composition the analysis uses — Thm. 3.3 with sensitivity C at
            every step — is smallest (:func:`~idpsgd.accounting.per_instance.best_composition_order`;
            an integer for the mean rule), not a fixed order: at the paper's settings (q ≈ 0.002,
            ε = 10, σ ≈ 0.48) order 8 is far past the sampled Gaussian's phase transition (the run's
            RDP at order 8 is about 5·10⁴), and at ε = 1 even the run's own best order (11.6,
            reported as ``best_order_data_independent``) pushes the composition's higher orders past
            it.  The paper's α = 8 stays available.  The sum rule takes real orders (Thm. 3.2 holds
            at every real α > 1); the mean rule integers (Thm. 3.6).
        update_rule: ``sum`` (DP-SGD as implemented; Thm. 3.2) or ``mean`` (trained and analysed
            with the mean rule; Thm. 3.6).
        config: training hyperparameters (the paper's: clip norm 1, expected batch 128).
        epsilon, delta: the data-independent (ε, δ) the runs' noise is calibrated to (paper: ε = 10).
        checkpoint_every: steps between recorded sensitivities (default one epoch); a checkpoint's
            value stands for the steps up to the next one (1: every step's own value — needed for
            ``*_upper`` and ``guarantee_*`` to be confidence bounds; otherwise they are estimates and
            the data-independent bound, see the module doc).
        samples: (outer, inner) mini-batch samples for Thm. 3.6.
        p: Hölder exponent of Thm. 3.3 (default 3n, Fact 3.4).
        failure: J of the confidence upper bounds (each point's ``rdp_upper`` holds w.p. ≥ 1 − J for
            that point, with ``checkpoint_every=1``; no union bound over the points).
        out_dir: folder for per_instance.csv/.json, per_instance_steps.csv, per_instance_curves.csv
            and the plots (all private, 0600) and settings.json (public).
        file_prefix: put before every file name (several analyses in one folder).
        figures: with ``out_dir``, also draw per_instance.png (Fig. 1) and per_instance_stages.png (Fig. 2/4).

    Sum-rule runs of a plain ``nn.Sequential`` model train together
    (:class:`~idpsgd.training.per_instance_runs.ParallelRuns`); the mean rule and other
    architectures train one :class:`~idpsgd.training.loop.Trainer` per run (the same algorithm).
    """
    if update_rule not in UPDATE_RULES:
        raise InvalidParameterError("update_rule", update_rule, "must be sum or mean")
    if target_set not in TARGET_SETS:
        raise InvalidParameterError("target_set", target_set, "must be test or train")
    if int(runs) != runs or int(runs) < 1:
        raise InvalidParameterError("runs", runs, "must be an integer >= 1")
    if alpha is not None:
        a = float(alpha)
        if update_rule == "mean" and (a != int(a) or a < 2):
            raise InvalidParameterError("alpha", alpha, "must be an integer >= 2 for the mean rule (Thm. 3.6)")
        if not (a > 1 and math.isfinite(a)):
            raise InvalidParameterError("alpha", alpha, "must be a Rényi order > 1")
    if not 0 < failure < 1:
        raise InvalidParameterError("failure", failure, "must be in (0, 1)")
    if len(samples) != 2 or min(int(v) for v in samples) < 1:
        raise InvalidParameterError("samples", samples, "must be (outer, inner) with both >= 1")
    if checkpoint_every is not None and (int(checkpoint_every) != checkpoint_every or int(checkpoint_every) < 1):
        raise InvalidParameterError("checkpoint_every", checkpoint_every, "must be an integer >= 1")
    runs = int(runs)
    x_set, y_set = (dataset.x_test, dataset.y_test) if target_set == "test" else (dataset.x_train, dataset.y_train)
    points = np.asarray([] if points is None else points, dtype=np.int64)
    if points.size == 0 or points.min() < 0 or points.max() >= len(y_set) or np.unique(points).size != points.size:
        raise InvalidParameterError(
            "points", points.tolist(), f"must be distinct indices into the {target_set} set [0, {len(y_set)})"
        )
    config = config or TrainConfig()
    if getattr(config, "secure_mode", False):
        raise InvalidParameterError(
            "secure_mode",
            True,
            "per-instance analysis trains every run from one recorded "
            "initialisation and seeds; it cannot run in secure mode",
        )
    if update_rule == "mean" and getattr(config, "grad_sample_mode", "hooks") == "ghost":
        raise InvalidParameterError(
            "grad_sample_mode", "ghost", "the mean rule needs materialised per-sample gradients (hooks or functorch)"
        )
    config.validate()
    from ..engine.noise.randomness import resolve_seed

    seed = resolve_seed(config.seed, False)  # a fresh seed is drawn and recorded when none is given
    config = dataclasses.replace(config, seed=seed)
    n_train = len(dataset.y_train)
    model_name = config.model or DEFAULT_MODEL.get(dataset.name, "mlp")
    if update_rule == "mean":  # every clipped per-example gradient, and the pooled batch sums, in memory
        d = sum(v.numel() for v in create_model(model_name, dataset.input_shape, dataset.num_classes).parameters())
        pool = samples[0] * (1 + samples[1] * 2 * int(alpha if alpha is not None else 8))
        need = 8 * d * (n_train + points.size + pool) / 2**30
        if need > 4:
            raise InvalidParameterError(
                "update_rule",
                "mean",
                f"needs about {need:.0f} GiB here ({n_train} examples x "
                f"{d} parameters); use a smaller dataset or model, or --samples",
            )
    # the public algorithm: one plan (q, σ, C, steps) for X and X'
    pre = getattr(dataset, "preprocessing", None) or {}
    budgets = training_budgets(
        Budgets.from_array(np.full(n_train, float(epsilon)), delta),
        float(pre.get("epsilon", 0.0)),
        float(pre.get("delta", 0.0)),
    )
    plan = build_plan(budgets, "uniform", config.batch_size, config.epochs, config.clip_norm, config.accountant)
    assignment = plan.phases[0].assignment
    q, c, sigma, n = (
        float(assignment.sample_rate),
        float(assignment.clip_norm),
        float(assignment.noise_multiplier),
        int(plan.steps),
    )
    normaliser = float(assignment.expected_batch_size)
    every = int(checkpoint_every or plan.phases[0].steps_per_epoch)
    integer = update_rule == "mean"
    alpha_rule = "given"
    plain_best = best_order(q, sigma, n, budgets.delta, integer=integer)
    if alpha is None:
        alpha = best_composition_order(q, sigma, n, budgets.delta, p, integer=integer)
        alpha_rule = (
            "the integer order" if integer else "the order"
        ) + " minimising the data-independent epsilon of Thm. 3.3 at sensitivity C (the same composition)"
    alpha = float(alpha)
    if integer:
        alpha = float(int(alpha))
    x_pts, y_pts = x_set[points], y_set[points]
    shared_dir = "remove" if target_set == "test" else "add"  # the shared chain: the training set
    other_dir = "add" if shared_dir == "remove" else "remove"
    torch.manual_seed(seed)  # the shared initialisation (as the Trainer's)
    model = create_model(model_name, dataset.input_shape, dataset.num_classes)
    if update_rule == "sum" and supports(model):
        from .device import resolve_device

        res = parallel_chains(
            dataset,
            x_pts,
            y_pts,
            points,
            target_set,
            runs,
            model,
            q,
            sigma,
            c,
            normaliser,
            n,
            every,
            config.lr,
            config.momentum,
            seed,
            resolve_device(config.device),
            config.progress,
        )
        ckpts = res["checkpoints"]
        expand = np.searchsorted(ckpts, np.arange(n), side="right") - 1  # checkpoint standing for each step
        chains = {
            shared_dir: {"sens": res["shared"]["sens"][:, expand, :], "correct": res["shared"]["correct"]},
            other_dir: {"sens": res["own"]["sens"][:, expand, :], "correct": res["own"]["correct"]},
        }
        test_acc, engine = res["test_accuracy_runs"], "parallel"
    else:
        chains, test_acc, ckpts = _trainer_chains(
            dataset,
            budgets,
            plan,
            config,
            x_pts,
            y_pts,
            points,
            target_set,
            runs,
            alpha,
            p,
            every,
            update_rule,
            samples,
            failure,
            shared_dir,
            epsilon,
            delta,
        )
        engine = "trainer"
    return _analyse(
        dict(
            chains=chains,
            test_acc=test_acc,
            ckpts=ckpts,
            q=q,
            c=c,
            sigma=sigma,
            n=n,
            normaliser=normaliser,
            alpha=alpha,
            alpha_rule=alpha_rule,
            plain_best=plain_best,
            integer=integer,
            p=p,
            update_rule=update_rule,
            points=points,
            y_pts=y_pts,
            runs=runs,
            delta=budgets.delta,
            failure=failure,
            epsilon=epsilon,
            config=config,
            seed=seed,
            target_set=target_set,
            samples=samples,
            unlearning_beta=unlearning_beta,
            engine=engine,
            model=model_name,
            every=every,
            accountant=config.accountant,
        ),
        out_dir,
        file_prefix,
        figures,
    )


def _trainer_chains(
    dataset,
    budgets,
    plan,
    config,
    x_pts,
    y_pts,
    points,
    target_set,
    runs,
    alpha,
    p,
    every,
    update_rule,
    samples,
    failure,
    shared_dir,
    epsilon,
    delta,
):
    """One :class:`Trainer` per run (the mean rule, and architectures :class:`ParallelRuns` does not take)."""
    n_train = len(dataset.y_train)
    other_dir = "add" if shared_dir == "remove" else "remove"
    assignment = plan.phases[0].assignment
    q, c, sigma, n = assignment.sample_rate, assignment.clip_norm, assignment.noise_multiplier, plan.steps
    normaliser = assignment.expected_batch_size
    orders = step_orders(alpha, n, p, integer=True)

    def one_run(data, run_idx, targets, direction):
        cfg = dataclasses.replace(
            config, method="uniform", seed=config.seed + 7919 * (run_idx + 1), init_seed=config.seed, progress=False
        )
        b = Budgets.from_array(np.full(len(data.y_train), float(epsilon)), delta)  # before any preprocessing
        trainer = Trainer(
            data,
            b,
            cfg,
            plan=_public_plan(plan, len(data.y_train), budgets.delta),  # one public
            expected_batch_size=normaliser,
        )  # plan of X and X'; the public q·N on X and X' alike
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
                order = int(orders[step : min(step + every, n)].max())
                est = _MeanRuleEstimator(grads, q, samples[0], samples[1], order, rng, n_pool=n_train)
                checkpoints = -(-n // every)
                rec_m.append(
                    [
                        est.bound(int(r), sigma * c / normaliser, direction, c, failure / 4 / (runs * checkpoints))
                        for r in rows
                    ]
                )

        handle = _install_mean_rule(trainer.optimizer, normaliser, trainer.model) if update_rule == "mean" else None
        trainer.step_hooks.append(hook)
        try:
            report = trainer.run()
        finally:
            if handle is not None:
                handle.remove()
        ckpts = np.asarray(rec_t)
        expand = np.searchsorted(ckpts, np.arange(n), side="right") - 1  # checkpoint standing for each step
        module = getattr(trainer.model, "_module", trainer.model)
        module.eval()
        device = next(module.parameters()).device
        with torch.no_grad():
            correct = (module(xt.to(device)).argmax(1).cpu() == yt).numpy()
        out = {
            "sens": np.asarray(rec_s)[expand],
            "checkpoints": ckpts,
            "correct": correct,
            "test_accuracy": report["test_accuracy"],
        }
        if update_rule == "mean":
            m = np.asarray(rec_m)  # (ckpts, targets, 2)
            out["mean_est"], out["mean_upper"] = m[expand, :, 0], m[expand, :, 1]
        return out

    k_all = np.arange(points.size)
    shared = [one_run(dataset, r, k_all, shared_dir) for r in range(runs)]
    own = []
    for k, j in enumerate(points):
        if target_set == "test":
            data_k = dataclasses.replace(
                dataset,
                x_train=torch.cat([dataset.x_train, x_pts[k : k + 1]]),
                y_train=torch.cat([dataset.y_train, y_pts[k : k + 1]]),
            )
        else:
            keep = np.ones(n_train, bool)
            keep[j] = False
            data_k = dataclasses.replace(dataset, x_train=dataset.x_train[keep], y_train=dataset.y_train[keep])
        own.append([one_run(data_k, r, np.array([k]), other_dir) for r in range(runs)])
    skip = ("checkpoints", "test_accuracy")
    chains = {shared_dir: {key: np.stack([run[key] for run in shared]) for key in shared[0] if key not in skip}}
    chains[other_dir] = {
        key: np.stack([np.concatenate([run[key] for run in [own[k][r] for k in k_all]], axis=-1) for r in range(runs)])
        for key in own[0][0]
        if key not in skip
    }
    return chains, [run["test_accuracy"] for run in shared], shared[0]["checkpoints"]


def _analyse(s: dict, out_dir, file_prefix: str, figures: bool = True) -> dict:
    """Thm. 3.2/3.6 per step and Thm. 3.3 per point from the chains' recordings; the report and its files."""
    chains, q, c, sigma, n = s["chains"], s["q"], s["c"], s["sigma"], s["n"]
    alpha, p, integer, update_rule, runs = s["alpha"], s["p"], s["integer"], s["update_rule"], s["runs"]
    points, y_pts, delta, failure, normaliser = s["points"], s["y_pts"], s["delta"], s["failure"], s["normaliser"]
    ckpts = s["ckpts"]
    mean_sigma_eff = sigma / normaliser  # mean rule: noise σc/(qN), worst sensitivity c
    base_sigma = sigma if update_rule == "sum" else mean_sigma_eff
    rdp_cache: dict = {}

    def worst_rdp(orders) -> np.ndarray:
        """The data-independent per-step bound ρ_o(C) at each of ``orders`` (cached)."""
        need = [float(o) for o in np.unique(orders) if float(o) not in rdp_cache]
        if need:
            rdp_cache.update(zip(need, np.ravel(compute_rdp(q, base_sigma, need)), strict=True))
        return np.array([rdp_cache[float(o)] for o in np.ravel(orders)])

    base_step = float(worst_rdp([alpha])[0])  # Mironov et al. §3.3: one step at α, sensitivity C
    thm32 = SumRuleTable(q, sigma * c, c)  # Thm. 3.2, sensitivities rounded up to a fine grid
    sum_base_step = float(np.ravel(compute_rdp(q, sigma, [alpha]))[0])

    def step_divergences(direction, k, order=alpha):
        """(runs, n) per-step divergences of point k on its chain, at the orders Thm. 3.3 needs."""
        o = step_orders(order, n, p, integer)
        ch = chains[direction]
        if update_rule == "sum":
            sens = ch["sens"][:, :, k]
            d = np.empty_like(sens)
            for val in np.unique(o):
                cols = o == val
                d[:, cols] = thm32(sens[:, cols], float(val))
            return d, d
        return ch["mean_est"][:, :, k], np.minimum(ch["mean_upper"][:, :, k], worst_rdp(o)[None, :])

    def bound(direction, k, order=alpha):
        d, d_up = step_divergences(direction, k, order)
        worst = worst_rdp(step_orders(order, n, p, integer))
        est = composition_bound(d, order, p)
        comp_failure = failure / 2 if update_rule == "sum" else failure / 4
        up = composition_bound(d_up, order, p, worst_step_rdp=worst, failure=comp_failure)
        return est, up

    same = same_composition_rdp(q, base_sigma, alpha, n, p, integer)
    base = n * base_step  # the data-independent RDP of the run at α
    data_independent_eps = float(epsilon_sgm(q, base_sigma, n, delta, s["accountant"]))
    base_eps = float(epsilon_at_order(base, alpha, delta))
    late = slice(n // 2, n)
    bounds_kind = upper_kind(s["every"], n)
    measured = bounds_kind != "estimate"  # every step's own sensitivity: *_upper are confidence bounds
    per_point, step_rows, ratios_by_dir, thm32_by_dir = [], [], {"add": [], "remove": []}, {"add": [], "remove": []}
    for k, j in enumerate(points):
        res = {dn: bound(dn, k) for dn in ("add", "remove")}
        rdp_add, rdp_remove = res["add"][0]["bound"], res["remove"][0]["bound"]
        up_add, up_remove = res["add"][1]["upper"], res["remove"][1]["upper"]
        rdp, rdp_up = max(rdp_add, rdp_remove), max(up_add, up_remove)
        ratios = {dn: res[dn][0]["contributions"] / base_step for dn in res}
        stats = {}
        for dn, ratio in ratios.items():
            ratios_by_dir[dn].append(ratio)
            stats.update(
                {
                    f"step_ratio_{dn}_mean": float(np.mean(ratio)),
                    f"step_ratio_{dn}_p10": float(np.percentile(ratio, 10)),
                    f"step_ratio_{dn}_late_mean": float(np.mean(ratio[late])),
                }
            )
            if update_rule == "sum":  # Thm. 3.2 at α and the measured sensitivity, mean over the runs (no composition)
                alone = thm32(chains[dn]["sens"][:, late, k], alpha).mean(axis=0) / base_step
                thm32_by_dir[dn].append(float(np.mean(alone)))
                stats[f"late_thm32_ratio_{dn}"] = float(np.mean(alone))
        step_ratio = np.maximum(ratios["add"], ratios["remove"])
        cor = (
            corollary_3_1(q, chains["add"]["sens"][:, -1, k], sigma * c, delta, delta, 2.0 * n)
            if update_rule == "sum"
            else None
        )
        eps_est, eps_up = (float(v) for v in epsilon_at_order([rdp, rdp_up], alpha, delta))
        per_point.append(
            {
                "point": int(j),
                "label": int(y_pts[k]),
                "correct_fraction": float(np.mean(chains["add"]["correct"][:, k])),
                "rdp_add": rdp_add,
                "rdp_remove": rdp_remove,
                "rdp": rdp,
                "rdp_add_upper": up_add,
                "rdp_remove_upper": up_remove,
                "rdp_upper": rdp_up,
                "epsilon": eps_est,
                "epsilon_upper": eps_up,
                "baseline_rdp": base,
                "baseline_epsilon": base_eps,
                "ratio_to_baseline": rdp / base,
                "ratio_upper_to_baseline": rdp_up / base,
                "same_composition_rdp": same["rdp"],
                "ratio_to_same_composition": rdp / same["rdp"],
                "guarantee_rdp": min(rdp_up, base) if measured else base,
                "guarantee_epsilon": min(eps_up, data_independent_eps) if measured else data_independent_eps,
                "estimate_min_epsilon": min(eps_est, data_independent_eps),
                **stats,
                "late_mean_step_ratio": float(np.mean(step_ratio[late])),
                "late_share_steps_below_baseline": float(np.mean(step_ratio[late] < 1)),
                "corollary_3_1_last_step": {"epsilon": cor[0], "delta": cor[1]} if cor else None,
            }
        )
        step_rows += [
            (
                int(j),
                t + 1,
                float(res["add"][0]["contributions"][t]),
                float(res["remove"][0]["contributions"][t]),
                base_step,
                float(ratios["add"][t]),
                float(ratios["remove"][t]),
            )
            for t in range(n)
        ]

    # per-step guarantee at order α per checkpoint (Fig. 2 / Fig. 4), mean over each chain's runs
    stage_values = {}
    for dn in ("add", "remove"):
        ch = chains[dn]
        at_ckpt = ch["sens"][:, ckpts, :] if update_rule == "sum" else ch["mean_est"][:, ckpts, :]
        if update_rule == "sum":
            at_ckpt = thm32(at_ckpt, alpha)
        stage_values[dn] = at_ckpt.mean(axis=0) / base_step  # (checkpoints, points)
    curves = {
        dn: {"mean": np.mean(ratios_by_dir[dn], axis=0), "p10": np.percentile(ratios_by_dir[dn], 10, axis=0)}
        for dn in ratios_by_dir
    }

    def median(key):
        return float(np.median([pp[key] for pp in per_point]))

    ratios_all = np.array([pp["ratio_to_baseline"] for pp in per_point])
    config, test_acc = s["config"], s["test_acc"]
    late_orders = step_orders(alpha, n, p, integer)[late]
    summary = {
        "kind": "estimate",
        "definition": "per-instance Renyi DP of DP-SGD: max(D(Train(X')||Train(X)), D(Train(X)||Train(X'))) with "
        "X' = X + {x*} (Thudi et al. Thm. 3.2/3.6 per step, Thm. 3.3 composition; expectations "
        "estimated over runs on each chain; *_upper: Hoeffding confidence upper bounds when every "
        "step's sensitivity is measured, else estimates)",
        "upper_kind": bounds_kind,
        "failure_scope": FAILURE_SCOPE,
        "guarantee_rule": (
            "per point min(epsilon_upper, data_independent_epsilon): a confidence bound (probability "
            ">= 1 - failure per point)"
            if measured
            else f"data_independent_epsilon only: sensitivities were measured every {s['every']} steps and "
            "reused in between, so *_upper are estimates (checkpoint_every=1 makes them confidence "
            "bounds)"
        ),
        "target_set": s["target_set"],
        "update_rule": update_rule,
        "alpha": alpha,
        "alpha_rule": s["alpha_rule"],
        "best_order_data_independent": s["plain_best"],
        "p": float(3 * n if p is None else p),
        "runs": runs,
        "runs_trained": runs * (1 + points.size),
        "steps": n,
        "checkpoints": int(ckpts.size),
        "checkpoint_every": s["every"],
        "sample_rate": q,
        "batch_size": config.batch_size,
        "noise_multiplier": sigma,
        "clip_norm": c,
        "lr": config.lr,
        "momentum": config.momentum,
        "epochs": config.epochs,
        "model": s["model"],
        "seed": s["seed"],
        "secure_mode": False,
        "randomness": randomness_note(False, f"private/{file_prefix}seed.json" if out_dir is not None else None),
        **neighbouring(),
        "engine": s["engine"],
        "training_epsilon": float(s["epsilon"]),
        "training_epsilon_rule": "sum (the calibration of the noise)",
        "delta": delta,
        "failure": failure,
        "samples": list(s["samples"]) if update_rule == "mean" else None,
        "test_accuracy": float(np.mean(test_acc)),
        "test_accuracy_runs": list(test_acc),
        "baseline_step_rdp": base_step,
        "baseline_rdp": base,
        "baseline_epsilon_at_alpha": base_eps,
        "data_independent_epsilon": data_independent_eps,
        "same_composition_rdp": same["rdp"],
        "same_composition_epsilon": float(epsilon_at_order(same["rdp"], alpha, delta)),
        "same_composition_late_step_ratio": float(np.mean(worst_rdp(late_orders)) / base_step),
        "median_ratio_to_baseline": float(np.median(ratios_all)),
        "p10_ratio_to_baseline": float(np.percentile(ratios_all, 10)),
        "median_ratio_to_same_composition": median("ratio_to_same_composition"),
        "median_upper_ratio_to_baseline": median("ratio_upper_to_baseline"),
        "median_late_step_ratio": median("late_mean_step_ratio"),
        "median_late_step_ratio_add": median("step_ratio_add_late_mean"),
        "median_late_step_ratio_remove": median("step_ratio_remove_late_mean"),
        "median_late_thm32_ratio": (
            {dn: float(np.median(v)) for dn, v in thm32_by_dir.items()} if update_rule == "sum" else None
        ),
        "share_guarantee_below_data_independent": float(
            np.mean([pp["guarantee_epsilon"] < data_independent_eps for pp in per_point])
        ),
        "fact_3_5_log10_runs_for_10pct": fact_3_5_samples(
            alpha, sum_base_step, float(np.ravel(compute_rdp(q, sigma, [2.0 * alpha]))[0]), n, 0.1, 0.05
        ),
        "share_points_below_baseline_late": float(np.mean([pp["late_mean_step_ratio"] < 1 for pp in per_point])),
        "points": per_point,
    }
    correct_mask = np.array([pp["correct_fraction"] >= 0.5 for pp in per_point])
    summary["correct_vs_incorrect"] = {
        "correct_mean_ratio": float(ratios_all[correct_mask].mean()) if correct_mask.any() else None,
        "incorrect_mean_ratio": float(ratios_all[~correct_mask].mean()) if (~correct_mask).any() else None,
        "correct": int(correct_mask.sum()),
        "incorrect": int((~correct_mask).sum()),
    }
    if update_rule == "sum":
        beta = float(s["unlearning_beta"] if s["unlearning_beta"] is not None else base)
        divergence = [lambda order, k=k: bound("add", k, order)[0]["bound"] for k in range(points.size)]
        summary["unlearning"] = {
            "beta": beta,
            "alpha": alpha,
            "direction": "add",
            "requests": [{**d, "point": int(points[d["request"]])} for d in npiu_decisions(divergence, alpha, beta)],
        }
    else:
        summary["unlearning"] = None  # NPIU's divergences at doubled orders come from Thm. 3.2 (sum rule)
    summary["curves"] = {dn: {key: v.tolist() for key, v in cv.items()} for dn, cv in curves.items()}
    if out_dir is not None:
        from .per_instance_outputs import write_outputs

        summary["plots"] = write_outputs(out_dir, summary, step_rows, curves, stage_values, ckpts, file_prefix, figures)
    return summary
