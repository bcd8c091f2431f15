"""User-level membership inference: is a whole user (all of their rows) in the training data?

The audit of a user-level run: every user is included independently with probability 1/2
— all of their rows in, or all out — by **zero-out**, the relation the guarantee is stated for
(:mod:`idpsgd.accounting.neighbouring`): a user who is out stays in the data and is sampled as
usual, but its rows' losses are multiplied by 0, so it adds nothing to the clipped sum.  The model's
public parameters (σ, the per-user rates and clip norms, the steps) are therefore the same whoever is
in.  One target model is trained with the engine at user level (:mod:`idpsgd.engine.clipping.users`); a user's
score is minus the mean loss of its rows; per privacy group the loss-threshold attack's AUC, an
empirical ε lower bound (threshold chosen on a random half of the group's users, Clopper–Pearson
bound on the other half) and the one-run bound of Steinke, Nasr & Jagielski 2023 (the users'
inclusion coins are independent fair coins) are compared with the user-level ε the run reports.  A
bound above the reported ε is a FAILED audit (each bound at level (1 − confidence)/tests, Bonferroni).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ..assignment import Budgets
from ..users import Users
from . import bounds


def audit_users(
    dataset,
    users: Users,
    budgets: Budgets,
    *,
    method: str = "sample",
    epochs: int = 10,
    users_per_step: float = 32.0,
    clip_norm: float = 1.0,
    lr: float = 0.5,
    model: str | None = None,
    grad_sample_mode: str = "bk",
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Train one target at user level with random user membership (zero-out) and attack it per group.

    Returns the audit (aggregates per group: public) and, under ``"private"``, the inclusion of every
    user and their scores (private: write them only to a 0600 file)."""
    from ..engine import IndividualizedPrivacyEngine
    from ..models import DEFAULT_MODEL, create_model

    rng = np.random.default_rng(seed)
    member = rng.random(users.num_users) < 0.5  # all of a user's rows in, or all out
    row_in = torch.from_numpy(member[users.unit_of_row].astype(np.float32))
    torch.manual_seed(seed)
    net = create_model(model or DEFAULT_MODEL.get(dataset.name, "mlp"), dataset.input_shape, dataset.num_classes)
    loader = DataLoader(TensorDataset(dataset.x_train, dataset.y_train, row_in), batch_size=64)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=seed)
    module, opt, loader = engine.make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=lr),
        data_loader=loader,
        budgets=budgets,
        method=method,
        epochs=epochs,
        sample_rate=min(1.0, float(users_per_step) / users.num_users),
        max_grad_norm=clip_norm,
        users=users,
        grad_sample_mode=grad_sample_mode,
    )
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    for _ in range(epochs):
        for xb, yb, inb in loader:
            opt.zero_grad()
            (loss_fn(module(xb), yb) * inb).sum().backward()  # zero-out: a user who is out adds nothing
            opt.step()
    reported = engine.get_epsilon()
    net.eval()
    with torch.no_grad():
        row_loss = (
            torch.cat(
                [
                    loss_fn(net(dataset.x_train[i : i + 2048]), dataset.y_train[i : i + 2048])
                    for i in range(0, len(dataset.y_train), 2048)
                ]
            )
            .double()
            .numpy()
        )
    score = -np.bincount(users.unit_of_row, weights=row_loss) / users.rows_per_user  # minus the mean loss
    values, _, group_of = budgets.groups()
    tests = 2 * values.size
    conf = 1 - (1 - confidence) / tests
    split = rng.random(users.num_users) < 0.5  # the threshold's selection half
    groups = []
    for g, value in enumerate(values):
        mask = group_of == g
        s, m = score[mask], member[mask]
        row = {"budget": float(value), "reported_epsilon": float(reported.per_group[g]), "delta": budgets.delta}
        row["users"] = int(mask.sum())
        if m.all() or not m.any():
            row.update(auc=None, epsilon_lower_bound=None, one_run_bound=None, verdict="not enough users")
            groups.append(row)
            continue
        row["auc"] = bounds.auc(s, m)
        sel = split[mask]
        lb = None
        if m[sel].any() and (~m[sel]).any() and m[~sel].any() and (~m[~sel]).any():
            t = bounds.choose_threshold(s[sel], m[sel], int(m[~sel].sum()), int((~m[~sel]).sum()), budgets.delta, conf)
            tp, fp = bounds.threshold_counts(s[~sel], m[~sel], [t])
            lb = bounds.epsilon_from_counts(
                int(tp[0]), int(m[~sel].sum()), int(fp[0]), int((~m[~sel]).sum()), budgets.delta, conf
            )["lower"]
        one = bounds.one_run_audit(s, m, budgets.delta, conf)
        row["epsilon_lower_bound"] = lb
        row["one_run_bound"] = float(one["epsilon"])
        worst = max(lb or 0.0, row["one_run_bound"])
        row["verdict"] = "FAILED" if worst > row["reported_epsilon"] else "passed"
        groups.append(row)
    return {
        "privacy_unit": "user",
        "max_rows_per_user": users.k,
        "attack": "loss threshold on each user's mean loss (zero-out membership of whole users)",
        "confidence": confidence,
        "groups": groups,
        "verdict": "FAILED" if any(r["verdict"] == "FAILED" for r in groups) else "passed",
        "private": {"member": member, "score": score},
    }
