"""Individual accounting's ``kind`` (engine/budget/individual.py, engine/budget/sensitivity_check.py).

"guarantee" only when the charged sensitivities bound what training adds (issue 29), and the label is
public (issue 35), so it is a function of the options alone: with individual clipping, or
norms of every step with exact/ceil rounding, every example is clipped at its charge (enforced) and
the ε are a guarantee; otherwise an estimate.  The comparison of training's norms with the norm
pass's stays in the private record (it used to decide the label: one data-dependent bit)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd.assignment import Budgets
from idpsgd.engine import IndividualAccountingOptions, IndividualizedPrivacyEngine
from support import file_mode

N, STEPS_PER_EPOCH, DELTA = 120, 10, 1e-5


def _mlp(dropout: float = 0.0):
    layers = [nn.Linear(10, 16), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def _train(
    model, *, mode="hooks", steps=8, run=None, clip=1.0, train_loss=F.cross_entropy, per_sample_loss=None, **options
):
    """An engine run planned for ``steps`` logical steps (``run`` of them taken, default all) with
    individual accounting; returns the engine."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 10, generator=g), torch.randint(0, 3, (N,), generator=g)
    opts = {"refreshes_per_epoch": STEPS_PER_EPOCH, "rounding": "ceil", "validate_subset": 0, **options}
    engine = IndividualizedPrivacyEngine(seed=3, accountant="rdp")  # the test is about the kind, not the accountant
    engine.enable_individual_accounting(IndividualAccountingOptions(**opts), per_sample_loss=per_sample_loss)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=N // STEPS_PER_EPOCH),
        budgets=Budgets.from_groups([2.0, 4.0], [0.5, 0.5], N, DELTA, seed=0),
        method="sample",
        steps=steps,
        max_grad_norm=clip,
        grad_sample_mode=mode,
    )
    model, opt, loader = (out[0], out[1], out[3]) if mode == "ghost" else out
    crit = out[2] if mode == "ghost" else train_loss
    model.train()
    done, run = 0, steps if run is None else run
    while done < run:
        for xb, yb in loader:
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
            done += 1
            if done == run:
                break
    return engine


def _ce(module, batch):
    return F.cross_entropy(module(batch[0]), batch[1], reduction="none")


ENFORCED = "every example clipped at the sensitivity it is charged at"


def test_dropout_with_norms_every_step_is_enforced_a_guarantee():
    """Norms refreshed every step, ceil rounding, dropout in training (an estimate before issue 35: the
    eval-mode norm pass does not bound the random per-example gradient): each example is now clipped
    at its charge, so a guarantee, and get_individual_epsilons takes the output-specific ε.  The
    private record shows what enforcement did: norms that differed, clipped further."""
    engine = _train(_mlp(dropout=0.3), clip=50.0)  # clip above every norm: charges are the norms
    t = engine.individual
    assert t.every == 1 and t.accountant.rounding == "ceil" and t.enforces
    assert t.kind == "guarantee" and ENFORCED in t.kind_reason and "dropout" not in t.kind_reason
    chk = t.sensitivity_check()
    assert chk["steps"] == chk["enforced_steps"] == 8 and chk["enforced"] and chk["examples"] > 0
    assert chk["compared"] == chk["examples"] and chk["mismatched"] > 0 and chk["dropout"] == ["2"]
    assert chk["exceeded"] > 0 and chk["max_ratio"] > 1.01  # clipped further by the enforcement
    data_independent = engine.accountant.individual_epsilons(DELTA)
    np.testing.assert_array_equal(engine.get_individual_epsilons(), np.minimum(data_independent, t.epsilons(DELTA)))


def test_a_per_sample_loss_other_than_the_training_loss_is_enforced():
    """Training with label smoothing, norms of plain cross-entropy (the Quick start's set-up): the
    norm pass is not the training computation (recorded privately); the label does not say so."""

    def smoothed(logits, labels):
        return F.cross_entropy(logits, labels, label_smoothing=0.1)

    engine = _train(_mlp(), clip=50.0, train_loss=smoothed, per_sample_loss=_ce)
    t = engine.individual
    chk = t.sensitivity_check()
    assert t.kind == "guarantee" and ENFORCED in t.kind_reason
    assert chk["mismatched"] == chk["compared"] > 0 and chk["max_relative_mismatch"] > 1e-3 and not chk["dropout"]


def test_charges_below_the_training_norms_are_enforced_and_recorded_privately():
    """A norm pass that under-states the norms (a per-sample loss scaled by 0.1): the gradients clipped
    at the clip norm exceed their charges (all but the zero gradients of saturated examples), by 10×
    at most — enforcement clips them to the charges; the record has the counts."""
    engine = _train(_mlp(), clip=50.0, rounding="exact", per_sample_loss=lambda m, b: 0.1 * _ce(m, b))
    t = engine.individual
    chk = t.sensitivity_check()
    assert t.kind == "guarantee" and ENFORCED in t.kind_reason
    assert chk["examples"] // 2 < chk["exceeded"] == chk["mismatched"] and 9.0 < chk["max_ratio"] <= 10.0 + 1e-3


def test_individual_clipping_is_a_guarantee_even_with_dropout():
    """Alg. 3 enforces each charge (the example is clipped at it), whatever the gradient's randomness,
    refresh interval or rounding; the record counts the sampled examples it clipped further."""
    engine = _train(_mlp(dropout=0.3), clip=50.0, individual_clipping=True, rounding="nearest", refreshes_per_epoch=2)
    t = engine.individual
    chk = t.sensitivity_check()
    assert t.every == 5 and t.kind == "guarantee" and "individual clipping" in t.kind_reason
    assert chk["enforced"] and chk["enforced_steps"] == 8 and chk["exceeded"] > 0 and chk["dropout"] == ["2"]
    np.testing.assert_array_equal(
        engine.get_individual_epsilons(), np.minimum(engine.accountant.individual_epsilons(DELTA), t.epsilons(DELTA))
    )


@pytest.mark.parametrize(
    ("mode", "rounding"),
    [pytest.param("hooks", "exact", marks=pytest.mark.slow), ("ghost", "ceil"), ("bk", "ceil")],
)
def test_a_deterministic_model_with_the_training_loss_every_step_is_unchanged_by_enforcement(mode, rounding):
    """Norms every step, exact/ceil rounding, the training loss, no train-mode randomness: every
    trained example's norm equals the norm pass's (float tolerance), so clipping at the charges
    changes nothing beyond float tolerance (none exceeded) — a guarantee, and the engine's per-example
    ε is the smaller of it and the data-independent bound."""
    engine = _train(_mlp(), mode=mode, clip=50.0, rounding=rounding)
    t = engine.individual
    chk = t.sensitivity_check()
    assert t.kind == "guarantee" and ENFORCED in t.kind_reason
    assert chk["compared"] == chk["examples"] > 0 and chk["mismatched"] == chk["exceeded"] == 0
    assert chk["max_relative_mismatch"] < 1e-5 and chk["max_ratio"] <= 1 + 1e-5
    data_independent = engine.accountant.individual_epsilons(DELTA)
    eps = engine.get_individual_epsilons()
    np.testing.assert_array_equal(eps, np.minimum(data_independent, t.epsilons(DELTA)))
    assert np.any(eps < data_independent - 1e-3)


def test_refreshes_less_often_than_every_step_or_nearest_rounding_stay_estimates():
    """Without individual clipping nothing enforces a stale or rounded-down charge: estimates, and the
    clip norms stay the examples' own (training unchanged)."""
    t = _train(_mlp(), refreshes_per_epoch=2).individual
    assert t.kind == "estimate" and "every 5 steps" in t.kind_reason and not t.enforces
    t = _train(_mlp(), rounding="nearest").individual
    assert t.kind == "estimate" and "nearest rounding" in t.kind_reason and not t.enforces
    np.testing.assert_array_equal(t.phase.clipping.clip_norms.numpy(), t.accountant.clip_norms)
    assert t.sensitivity_check()["enforced_steps"] == 0


@pytest.mark.slow  # 17 s; the resume of individual accounting runs fast in test_individual.py
def test_the_record_survives_a_checkpoint_and_an_older_one_is_not_enforced():
    """state_dict carries the record, the enforced steps and the last norm pass (the first step after a
    resume is compared with it); a state from before enforcement at K = 1 (no ``enforced_steps``)
    leaves its steps unbounded by their charges: an estimate — except with individual clipping, which
    every version enforced."""
    engine = _train(_mlp(), run=4)
    state = engine.individual.state_dict()
    fresh = _train(_mlp(), run=0)
    fresh.individual.load_state_dict(state)
    assert fresh.individual.sensitivity_check() == engine.individual.sensitivity_check()
    assert fresh.individual._pass_at == engine.individual._pass_at == 4 and fresh.individual.kind == "guarantee"
    np.testing.assert_array_equal(fresh.clipping.clip_norms.numpy(), fresh.individual.accountant.sensitivity)
    old = {k: v for k, v in state.items() if k not in ("check", "pass_norms", "pass_at", "enforced_steps")}
    older = _train(_mlp(), run=0)
    older.individual.load_state_dict(old)
    assert older.individual.kind == "estimate" and "did not clip each example" in older.individual.kind_reason
    assert older.individual.kind_reason == "steps taken before a checkpoint of a version that did not clip each " + (
        "example at its charged sensitivity with norms of every step were not bounded by their charges"
    )
    clipped = _train(_mlp(), run=4, individual_clipping=True).individual.state_dict()
    resumed = _train(_mlp(), run=0, individual_clipping=True)
    resumed.individual.load_state_dict({k: v for k, v in clipped.items() if k != "enforced_steps"})
    assert resumed.individual.kind == "guarantee" and resumed.individual.enforced_steps == 4


def test_harness_reports_kind_reason_publicly_and_the_check_privately(tmp_path):
    """idpsgd.train with norms every step (ceil): an enforced guarantee; report.json says why, the
    check's statistics stay in private/; the norms file records the kind and the enforcement, so
    offline accounting of it is a guarantee with the run's rounding — not with another rounding (the
    run clipped at the ceil charges), another clip norm, nor for a file without the record."""
    from idpsgd.cli import main
    from idpsgd.data import Dataset
    from idpsgd.training import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g)
    y = (x[:, 0] > 0).long()
    data = Dataset("toy", x[:160], y[:160], x[160:], y[160:], 2)
    budgets = Budgets.from_array(np.full(160, 3.0), DELTA)
    cfg = TrainConfig(method="uniform", epochs=1, batch_size=20, clip_norm=6.0, progress=False, seed=0, model="mlp")
    opts = IndividualAccountingOptions(refreshes_per_epoch=8, rounding="ceil", validate_subset=0, record_norms=True)
    report = train(data, budgets, cfg, tmp_path / "run", individual=opts)
    public = json.loads((tmp_path / "run" / "report.json").read_text())["individual_privacy"]
    assert public["kind"] == "guarantee" and ENFORCED in public["kind_reason"]
    assert "sensitivity_check" not in public
    chk = report["private"]["individual_privacy"]["sensitivity_check"]
    assert chk["steps"] == report["steps"] and chk["mismatched"] == chk["exceeded"] == 0 and chk["examples"] > 0
    saved = json.loads((tmp_path / "run" / "private" / "individual_privacy.json").read_text())
    assert saved["sensitivity_check"] == chk
    norms = tmp_path / "run" / "private" / "norms.npz"
    base = ["account", "--norms", str(norms), "--delta", str(DELTA), "--json"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "account.json").read_text())["kind"] == "guarantee"
    assert main([*base, "--clip-norm", "6", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "account.json").read_text())["kind"] == "estimate"
    # another rounding than the run's ceil: nearest (exact would build an RDP table, seconds, for the same branch)
    assert main([*base, "--rounding", "nearest", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "account.json").read_text())["kind"] == "estimate"
    with np.load(norms) as z:
        np.savez(
            tmp_path / "bare.npz",
            **{k: z[k] for k in z.files if k not in ("accounting_kind", "individual_clipping", "enforced")},
        )
    assert main([*base[:2], str(tmp_path / "bare.npz"), *base[3:], "--out", str(tmp_path / "c")]) == 0
    out = json.loads((tmp_path / "c" / "account.json").read_text())
    assert out["kind"] == "estimate" and "does not record" in out["kind_reason"]
    # a file of a version that labelled K = 1 runs by a check (no 'enforced'): its label depended on
    # the data, so the offline kind does not follow it (changed in issue 35: a guarantee before)
    with np.load(norms) as z:
        np.savez(tmp_path / "checked.npz", **{k: z[k] for k in z.files if k != "enforced"})
    assert main([*base[:2], str(tmp_path / "checked.npz"), *base[3:], "--out", str(tmp_path / "d")]) == 0
    out = json.loads((tmp_path / "d" / "account.json").read_text())
    assert out["kind"] == "estimate" and "its label depended on the data" in out["kind_reason"]


class _ClampInTraining(nn.Module):
    """Clamps its inputs in training mode only: the eval-mode norm pass sees an outlier's raw input."""

    def forward(self, x):
        return x.clamp(-3.0, 3.0) if self.training else x


def _outlier_data(with_outlier: bool):
    g = torch.Generator().manual_seed(100)
    x, y = torch.randn(40, 5, generator=g).clamp(-2.5, 2.5), torch.randint(0, 2, (40,), generator=g)
    if with_outlier:  # z: far outside the clamp; its training gradient is not its norm pass's
        z = torch.full((1, 5), 0.05)
        z[0, 0] = 40.0
        x, y = torch.cat([x, z]), torch.cat([y, torch.tensor([1])])
    return x, y


def _clamp_run(seed: int, with_outlier: bool):
    """The review's set-up: a model that clamps its inputs in training only, norms refreshed every
    step, validate_subset=0 (ceil rounding: the RDP table of exact rounding is slower to build, and
    the rule is the same)."""
    x, y = _outlier_data(with_outlier)
    n = len(x)
    torch.manual_seed(seed)
    model = nn.Sequential(_ClampInTraining(), nn.Linear(5, 2))
    engine = IndividualizedPrivacyEngine(seed=seed, accountant="rdp")
    opts = IndividualAccountingOptions(refreshes_per_epoch=2, rounding="ceil", validate_subset=0)
    engine.enable_individual_accounting(opts)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=21),  # 2 steps per epoch with z or without
        budgets=Budgets.from_array(np.full(n, 3.0), DELTA),
        method="uniform",
        steps=6,
        max_grad_norm=5.0,
    )
    done = 0
    while done < 6:
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            done += 1
            if done == 6:
                break
    return engine.individual


def test_an_outliers_membership_does_not_change_the_public_kind():
    """The label is public (issue 35): with the outlier z (its training norm differs from the norm pass's whenever it
    is sampled) and without it, over 6 seeds: the same kind and kind_reason (before the fix: estimate
    with z, guarantee without, in 6 of 6 seeds).  The difference stays in the private record."""
    for seed in range(6):
        with_z, without_z = _clamp_run(seed, True), _clamp_run(seed, False)
        assert with_z.every == without_z.every == 1
        assert (with_z.kind, with_z.kind_reason) == (without_z.kind, without_z.kind_reason), seed
        assert with_z.kind == "guarantee" and ENFORCED in with_z.kind_reason
        assert with_z.sensitivity_check()["mismatched"] > 0 == without_z.sensitivity_check()["mismatched"], seed


def test_an_outliers_membership_leaves_the_public_report_unchanged(tmp_path):
    """The same set-up through idpsgd.train: report.json's individual_privacy (but the privately
    released statistics, noisy by design, and the example count) and the train text's kind line are
    the same with z and without; the record that tells them apart is in private/ (0600)."""
    from idpsgd.cli.train_commands import _train_text
    from idpsgd.data import Dataset
    from idpsgd.training import TrainConfig, train

    seed, public, lines, private = 0, {}, {}, {}
    for with_z in (True, False):
        x, y = _outlier_data(with_z)
        data = Dataset("toy", x, y, x[:8], y[:8], 2)
        torch.manual_seed(seed)
        model = nn.Sequential(_ClampInTraining(), nn.Linear(5, 2))
        cfg = TrainConfig(method="uniform", epochs=3, batch_size=21, clip_norm=5.0, lr=0.5, progress=False, seed=seed)
        opts = IndividualAccountingOptions(refreshes_per_epoch=2, rounding="ceil", validate_subset=0)
        out = tmp_path / f"z{with_z}"
        report = train(data, Budgets.from_array(np.full(len(x), 3.0), DELTA), cfg, out, model=model, individual=opts)
        ip = json.loads((out / "report.json").read_text())["individual_privacy"]
        public[with_z] = {k: v for k, v in ip.items() if k not in ("released", "examples")}
        text = _train_text({**report, "out": str(out)})
        lines[with_z] = [line for line in text.splitlines() if line.startswith("  guarantee")]
        private[with_z] = json.loads((out / "private" / "individual_privacy.json").read_text())["sensitivity_check"]
        assert file_mode(out / "private" / "individual_privacy.json") == 0o600
    assert public[True] == public[False] and public[True]["kind"] == "guarantee"
    assert lines[True] == lines[False] and len(lines[True]) == 1
    assert private[True]["mismatched"] > 0 == private[False]["mismatched"]


class _AmplifyInTraining(nn.Module):
    """×3 in training mode only: every training gradient is about 3× the norm pass's."""

    def forward(self, x):
        return 3 * x if self.training else x


@pytest.mark.parametrize(
    ("mode", "rounding"),
    [("hooks", "ceil"), ("functorch", "ceil"), ("ew", "ceil"), ("ghost", "ceil"), ("bk", "ceil"), ("bk", "exact")],
)
def test_enforcement_caps_every_contribution_at_its_charge(mode, rounding):
    """Each example's own contribution to the clipped sum, measured: one-hot inputs into a bias-free
    linear layer, so example i's gradient lives in column i of the weight alone and column i of the
    step's clipped sum (before the noise) is what training added for i.  Sample rate 1 (every example
    in every step), float64, training gradients ~3× the norm pass's: every contribution is at most the
    charge min(c_i, rounded norm) to 1e-9, those the enforcement cut are at it, the clip norms were
    the charges, and the accountant composed exactly those charges."""
    from idpsgd.accounting.rdp import compute_rdp
    from idpsgd.engine.per_example.wrap import raw_module

    n, steps = 12, 3
    torch.manual_seed(0)
    model = nn.Sequential(_AmplifyInTraining(), nn.Linear(n, 3, bias=False)).double()
    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")
    t = engine.enable_individual_accounting(
        IndividualAccountingOptions(refreshes_per_epoch=1, rounding=rounding, validate_subset=0)
    )
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(torch.eye(n, dtype=torch.float64), torch.arange(n) % 3), batch_size=n),
        budgets=Budgets.from_array(np.full(n, 8.0), DELTA),
        method="uniform",
        steps=steps,
        max_grad_norm=5.0,
        grad_sample_mode=mode,
    )
    model, opt, crit, loader = out if mode == "ghost" else (out[0], out[1], F.cross_entropy, out[2])
    assert t.every == 1 and t.enforces and np.all(engine.parameters.sample_rates == 1.0)
    weight = raw_module(model)[1].weight
    seen, add_noise = [], opt.add_noise

    def record():  # the step's clipped sum, its charges and its clip norms, before the noise
        seen.append((weight.summed_grad.detach().clone(), t.accountant.sensitivity.copy(), opt.clip_norms.clone()))
        return add_noise()

    opt.add_noise = record
    for _ in range(steps):
        xb, yb = next(iter(loader))
        assert len(xb) == n
        opt.zero_grad()
        crit(model(xb), yb).backward()
        opt.step()
    assert len(seen) == steps and t.steps == steps
    cut = 0
    expected = np.zeros_like(t.accountant.rdp())
    for summed, charged, clip_norms in seen:
        np.testing.assert_array_equal(clip_norms.numpy(), charged)
        assert np.all(charged <= 5.0) and np.all(charged > 0)
        contribution = summed.norm(dim=0).numpy()  # column i: example i's clipped gradient
        assert np.all(contribution <= charged * (1 + 1e-9)), (contribution / charged).max()
        cut += int(np.sum(np.abs(contribution - charged) <= 1e-5 * charged))
        expected += compute_rdp(np.ones(n), t.accountant.sigma * t.accountant.c / charged, t.accountant.ledger.orders)
    assert cut >= n  # the enforcement did clip (the training gradients are ~3× the charges)
    assert t.sensitivity_check()["exceeded"] >= cut
    rtol = 1e-12 if rounding == "ceil" else 1e-3  # exact: the interpolated RDP, an upper bound
    np.testing.assert_array_less(expected * (1 - 1e-12), t.accountant.rdp())
    np.testing.assert_allclose(t.accountant.rdp(), expected, rtol=rtol)
