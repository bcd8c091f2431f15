"""User-level individualized DP (issue 37): data model, ULS sampling, per-user clipping in every mode.

The replace-one-user test: with the noise off and every user sampled (rate 1, k at least the user's
rows), adding a user u changes the step's clipped sum by at most c_u — in hooks, functorch, ghost and
bk, on a CNN, a small transformer and GPT-2 from a config.  Per-row clipping would fail it: a user with
m rows whose row gradients all exceed the clip norm moves the sum by up to m·c.
"""

from __future__ import annotations

import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import IndividualizedPrivacyEngine, InvalidParameterError, Users
from idpsgd.engine.sampling.sampler import BatchIndexQueue, PoissonBatchSampler
from support import file_mode, launch

MODES = ("hooks", "functorch", "ghost", "bk")


# --- data model ------------------------------------------------------------------------------------
def test_users_codes_counts_and_repr_hides_them():
    u = Users(["b", "a", "b", "c", "b"], k=2)
    assert u.ids.tolist() == ["a", "b", "c"]
    assert u.unit_of_row.tolist() == [1, 0, 1, 2, 1]
    assert u.rows_per_user.tolist() == [1, 3, 1]
    assert repr(u) == "Users(max_rows_per_user=2)"


@pytest.mark.parametrize(
    ("ids", "k", "name"),
    [([], 1, "user_ids"), ([1.0, float("nan")], 1, "user_ids"), (["a", ""], 1, "user_ids"), ([1, 2], 0, "max_rows")],
)
def test_users_bad_input(ids, k, name):
    with pytest.raises(InvalidParameterError, match=name):
        Users(ids, k)


def test_budgets_per_user_from_rows_and_mapping():
    u = Users([3, 1, 3, 2], k=1)
    b = u.budgets_from_rows([2.0, 1.0, 2.0, 8.0], 1e-5)
    assert b.epsilons.tolist() == [1.0, 8.0, 2.0]
    with pytest.raises(InvalidParameterError, match="same value"):
        u.budgets_from_rows([2.0, 1.0, 3.0, 8.0], 1e-5)
    assert u.budgets_from_mapping({1: 1, 2: 8, 3: 2}, 1e-5).epsilons.tolist() == [1.0, 8.0, 2.0]
    with pytest.raises(InvalidParameterError, match="without a budget"):
        u.budgets_from_mapping({1: 1}, 1e-5)


def test_draw_rows_takes_min_k_rows_of_each_user_uniformly():
    ids = np.repeat(np.arange(4), [1, 3, 5, 10])
    u = Users(ids, k=3)
    rng = np.random.default_rng(0)
    seen = np.zeros(ids.size)
    for _ in range(3000):
        rows = u.draw_rows(np.arange(4), rng)
        assert np.bincount(ids[rows], minlength=4).tolist() == [1, 3, 3, 3]
        assert np.unique(rows).size == rows.size
        seen[rows] += 1
    freq = seen / 3000  # each of a user's n rows is chosen with probability min(k, n)/n
    expect = np.minimum(3, u.rows_per_user)[ids] / u.rows_per_user[ids]
    assert np.allclose(freq, expect, atol=0.04)


def test_user_sampler_poisson_over_users():
    ids = np.repeat(np.arange(50), 4)
    u = Users(ids, k=2)
    q = np.where(np.arange(50) < 25, 0.2, 0.6)
    s = PoissonBatchSampler(q, 10, np.random.default_rng(1), BatchIndexQueue(), users=u)
    hits = np.zeros(50)
    for _ in range(400):
        rows = s.sample()
        users = np.unique(ids[rows])
        assert np.bincount(ids[rows])[users].max() <= 2
        hits[users] += 1
    assert abs(hits[:25].mean() / 400 - 0.2) < 0.03 and abs(hits[25:].mean() / 400 - 0.6) < 0.03
    assert s.expected_batch_size == pytest.approx(q.sum())


# --- replace-one-user sensitivity ----------------------------------------------------------------
def _no_noise(std, reference, *args, **kwargs):
    return torch.zeros_like(reference)


class _Crit(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.loss, self.reduction = loss, "sum"

    def forward(self, out, y):
        per = self.loss(out, y)
        return per if self.reduction == "none" else per.sum()


def _ce(out, y):
    if out.dim() == 3:  # a language model: summed token losses per row
        return nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)
    return nn.functional.cross_entropy(out, y, reduction="none")


def _step_sum(build, x, y, uids, mode, clip, k, call=None):
    """The engine's clipped sum (noise 0, every user sampled) of one user-level step."""
    model = build()
    users = Users(uids, k)
    crit = _Crit(_ce)
    with warnings.catch_warnings(), mock.patch("idpsgd.engine.noise.optimizer.gaussian_like", _no_noise):
        for message in (
            "Secure RNG turned off",
            "Full backward hook is firing",
            "In CPU autocast, but the target dtype",
        ):
            warnings.filterwarnings("ignore", message, UserWarning)  # Opacus's and torch's notices
        engine = IndividualizedPrivacyEngine(seed=0)
        out = engine.make_private_with_parameters(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            budgets=None,
            privacy_filter=None,
            sample_rates=np.ones(users.num_users),
            clip_norms=clip[: users.num_users],
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            loss_reduction="sum",
            grad_sample_mode=mode,
            criterion=crit if mode == "ghost" else None,
            users=users,
        )
        module, opt, *rest = out
        loader = rest[-1]
        xb, yb = next(iter(loader))
        opt.zero_grad()
        o = module(xb) if call is None else call(module, xb)
        loss = rest[0](o, yb) if mode == "ghost" else _ce(o, yb).sum()
        loss.backward()
        opt.step()
    assert engine.steps == 1
    return torch.cat([p.grad.detach().reshape(-1) for p in opt.params]), engine


def _replace_one_user(build, draw, mode, sizes, call=None, base_users=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    base_sizes = rng.integers(1, 5, base_users)
    xs, ys = zip(*(draw(g, int(n)) for n in base_sizes), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    uids = np.repeat(np.arange(base_users), base_sizes)
    clip = rng.uniform(0.3, 2.0, base_users + 1)  # per-user clip norms c_u (Scale)
    k = int(max(*sizes, base_sizes.max()))
    s0, _ = _step_sum(build, x, y, uids, mode, clip, k, call)
    worst = []
    for m in sizes:
        xu, yu = draw(g, m)
        s1, _ = _step_sum(
            build,
            torch.cat([x, xu]),
            torch.cat([y, yu]),
            np.concatenate([uids, np.full(m, base_users)]),
            mode,
            clip,
            k,
            call,
        )
        worst.append(float((s1 - s0).norm()) / clip[base_users])
    return worst


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _draw_img(g, n):
    return torch.randn(n, 1, 8, 8, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


class _TinyTransformer(nn.Module):
    def __init__(self, v=11, d=16, t=5):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.pos = nn.Parameter(torch.zeros(1, t, d))
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.ln(self.emb(x))
        a = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / 4.0, -1) @ self.v(h)
        return self.out((h + a).mean(1))


def _transformer():
    torch.manual_seed(0)
    m = _TinyTransformer()
    m.pos.requires_grad_(False)
    return m


def _draw_tokens(g, n):
    return torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("build", "draw"), [(_cnn, _draw_img), (_transformer, _draw_tokens)], ids=["cnn", "transformer"]
)
def test_replace_one_user_moves_the_sum_by_at_most_its_clip_norm(mode, build, draw):
    worst = _replace_one_user(build, draw, mode, sizes=(1, 9, 30))
    assert max(worst) <= 1 + 1e-4, worst
    assert worst[-1] > 0.99  # a user of 30 rows is clipped (the bound is tight): per-row clipping would give ~30


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=29,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _draw_text(g, n):
    x = torch.randint(0, 29, (n, 6), generator=g)
    return x, x


def _logits(model, x):  # positions per row: Opacus's hooks need one per-sample gradient row per example
    return model(input_ids=x, position_ids=torch.arange(x.shape[1]).expand(x.shape[0], -1)).logits


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m in ("hooks", "functorch") else m for m in MODES]
)
def test_replace_one_user_gpt2(mode):
    worst = _replace_one_user(_gpt2, _draw_text, mode, sizes=(1, 12), call=_logits)
    assert max(worst) <= 1 + 1e-4, worst
    assert worst[-1] > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_replace_one_user_up_to_500_rows(mode):
    for build, draw, call in (
        (_cnn, _draw_img, None),
        (_transformer, _draw_tokens, None),
        (_gpt2, _draw_text, _logits),
    ):
        worst = _replace_one_user(build, draw, mode, sizes=(1, 57, 500), call=call, seed=3)
        assert max(worst) <= 1 + 1e-4, worst


@pytest.mark.parametrize("mode", MODES)
def test_user_norm_is_the_norm_of_the_summed_gradient(mode):
    """The engine's per-user norms equal ‖Σ_{i∈u} g_i‖ from per-example autograd (cross terms included)."""
    g = torch.Generator().manual_seed(1)
    x, y = _draw_tokens(g, 14)
    uids = np.array([0, 0, 1, 2, 2, 2, 3, 1, 0, 4, 4, 4, 4, 2])
    _, engine = _step_sum(_transformer, x, y, uids, mode, np.full(5, 1e6), k=10)
    norms = engine.clipping.last_norms.double()
    units = engine.clipping.last_indices
    model = _transformer()
    params = [p for p in model.parameters() if p.requires_grad]
    want = []
    for u in units.tolist():
        rows = np.flatnonzero(uids == u)
        grads = torch.autograd.grad(_ce(model(x[rows]), y[rows]).sum(), params)
        want.append(float(torch.cat([gr.reshape(-1) for gr in grads]).norm()))
    assert np.allclose(norms.numpy(), want, rtol=1e-4)


def test_batch_memory_manager_split_of_a_user_is_refused():
    from idpsgd.engine.clipping.examples import PerExampleClipping  # noqa: F401
    from idpsgd.engine.clipping.users import UserClipping
    from idpsgd.engine.sampling.sampler import BatchMismatchError

    q = BatchIndexQueue()
    u = Users([0, 0, 1, 1], k=2)
    c = UserClipping(np.ones(2), q, u)
    q.push(np.array([0, 2, 1, 3]))
    c.grouping(2)
    c.factors(torch.ones(2))
    c.grouping(2)
    with pytest.raises(BatchMismatchError, match="one unit"):
        c.factors(torch.ones(2))


def test_users_must_cover_the_dataset():
    x, y = _draw_img(torch.Generator().manual_seed(0), 5)
    model = _cnn()
    with pytest.raises(InvalidParameterError, match="users"):
        IndividualizedPrivacyEngine(seed=0).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=2),
            noise_multiplier=1.0,
            users=Users([0, 1, 1], k=1),
        )


# --- accounting ---------------------------------------------------------------------------------
def _dp_accounting_at(q, sigma, steps, delta, order):
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant([float(order)])
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def _dp_accounting_orders(q, sigma, steps, delta, orders):
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant([float(o) for o in orders])
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def _exact_rdp(q, s, a):
    """D_α((1−q)N(0,σ²) + qN(1,σ²) ‖ N(0,σ²)) by numerical integration (Mironov et al. 2019, §3)."""
    from scipy import integrate, stats

    def f(z):
        return stats.norm.pdf(z, 0, s) * ((1 - q) + q * np.exp((2 * z - 1) / (2 * s * s))) ** a

    val, _ = integrate.quad(f, -80, 80, epsabs=1e-14, epsrel=1e-13, limit=500)
    return np.log(val) / (a - 1)


def _dp_accounting_rdp_eps(q, sigma, steps, delta):
    """dp_accounting's RDP ε, minimised over the order (an independent reference)."""
    from dp_accounting import dp_event, rdp
    from scipy.optimize import minimize_scalar

    def eps(order):
        acc = rdp.RdpAccountant([float(order)])
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
        return acc.get_epsilon(delta)

    grid = np.exp(np.linspace(np.log(1.05), np.log(512), 200))
    a0 = grid[int(np.argmin([eps(a) for a in grid]))]
    res = minimize_scalar(eps, bounds=(a0 / 1.05, a0 * 1.05), method="bounded", options={"xatol": 1e-9})
    return min(res.fun, eps(a0))


@pytest.mark.parametrize("method", ["sample", "scale"])
def test_per_user_epsilon_equals_dp_accountings_sampled_gaussian(method):
    """Per-user ε at each group's (q_u, σ·c/c_u, T): the user-level sampled Gaussian, against dp_accounting."""
    from idpsgd import Budgets
    from idpsgd.accounting import SampledGaussianEvent, compute_rdp, rdp_epsilon

    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(60), rng.integers(1, 20, 60))
    users = Users(ids, k=4)
    budgets = Budgets.from_groups([1.0, 3.0], [0.5, 0.5], users.num_users, 1e-5, seed=0)
    x, y = _draw_img(torch.Generator().manual_seed(0), ids.size)
    model = _cnn()
    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=64),
        budgets=budgets,
        method=method,
        steps=40,
        sample_rate=0.2,
        users=users,
    )
    eps = engine.get_epsilon(steps=40).per_group
    a = engine.assignment
    for gi, value in enumerate(budgets.values):
        u = np.flatnonzero(budgets.epsilons == value)[0]
        sigma_eff = a.noise_multiplier * a.clip_norm / a.clip_norms[u]
        q_u, s_u = float(a.sample_rates[u]), float(sigma_eff)
        event = [SampledGaussianEvent(q_u, s_u, 40)]
        ours, order = rdp_epsilon(event, 1e-5)  # the user-level sampled Gaussian at (q_u, σ_u, T)
        assert eps[gi] == pytest.approx(ours, rel=1e-12)
        # dp_accounting on integer orders (where its RDP is exact): ours on the same orders, to 1e-5
        ints = np.arange(2, 257)
        assert rdp_epsilon(event, 1e-5, orders=ints, refine=False)[0] == pytest.approx(
            _dp_accounting_orders(q_u, s_u, 40, 1e-5, ints), rel=1e-5
        )
        # at our (fractional) order: our RDP is the exact Rényi divergence (numerical integration);
        # dp_accounting's fractional-order series is above it by up to ~1e-4 (conservative)
        assert compute_rdp(q_u, s_u, [order], steps=1)[0] == pytest.approx(_exact_rdp(q_u, s_u, order), rel=1e-9)
        at_order = _dp_accounting_at(q_u, s_u, 40, 1e-5, order)
        assert at_order * (1 - 1e-4) <= eps[gi] <= at_order
        assert eps[gi] <= value * (1 + 1e-9)


def test_els_group_privacy_conversion_against_dp_accounting():
    """ELS: k·ε_ex at a δ_ex with k·e^{(k−1)ε_ex}·δ_ex ≤ δ, ε_ex from dp_accounting's RDP."""
    from idpsgd.users import els_user_epsilon

    q, sigma, steps, k, delta = 0.01, 1.2, 500, 4, 1e-5
    got = els_user_epsilon(q, sigma, steps, k, delta, accountant="rdp")
    eps_ex = got / k
    # the δ_ex it implies, and dp_accounting's ε at that δ_ex: the same ε_ex
    from dp_accounting import dp_event, rdp

    orders = np.concatenate([np.linspace(1.01, 10, 500), np.linspace(10.1, 256, 2000)])
    acc = rdp.RdpAccountant(list(orders))
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    delta_ex = acc.get_delta(eps_ex)
    assert k * np.exp((k - 1) * eps_ex) * delta_ex <= delta * (1 + 1e-3)  # the group-privacy constraint holds
    # and the conversion is not loose: a 1 % smaller user ε violates it
    assert k * np.exp((k - 1) * 0.99 * eps_ex) * acc.get_delta(0.99 * eps_ex) > delta
    # k = 1 is the example-level ε (our order universe is spaced by ~1.1 %: within 1e-3 of dp_accounting's best order)
    one = els_user_epsilon(q, sigma, steps, 1, delta)
    assert one == pytest.approx(_dp_accounting_rdp_eps(q, sigma, steps, delta), rel=1e-3)
    from idpsgd import group_privacy

    e, d = group_privacy(1.0, 1e-6, 3)
    assert e == 3.0 and d == pytest.approx(3 * np.exp(2.0) * 1e-6)


# --- the train command ------------------------------------------------------------------------------
def _user_csv(folder, n_users=30, seed=0):
    """train.csv/test.csv with a user column: heavy-tailed rows per user, ids that are easy to search for."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    counts = np.minimum(1 + rng.zipf(1.8, n_users), 40)
    ids = np.repeat([f"person-{i:03d}-zq" for i in range(n_users)], counts)
    rng.shuffle(ids)
    for name, n in (("train", ids.size), ("test", 60)):
        y = np.arange(n) % 3
        x = rng.normal(size=(n, 4)) + y[:, None]
        head = "label,user," + ",".join(f"f{i}" for i in range(4))
        user = ids if name == "train" else np.array([f"t{i}" for i in range(n)])
        rows = [head] + [f"{y[i]},{user[i]}," + ",".join(f"{v:.4f}" for v in x[i]) for i in range(n)]
        (folder / f"{name}.csv").write_text("\n".join(rows) + "\n")
    return ["--dataset", "csv", "--num-classes", "3", "--data-dir", str(folder)], ids


def test_train_user_column_end_to_end_and_nothing_private_in_public_files(tmp_path, capsys):
    import json

    from idpsgd.cli import main

    data, _ids = _user_csv(tmp_path / "data")
    seed = 987654321
    out = tmp_path / "run"
    argv = ["train", "--method", "sample", "--budgets", "1,3", "--fractions", "0.5,0.5", *data]
    argv += ["--user-column", "user", "--max-rows-per-user", "3", "--epochs", "2", "--batch-size", "6"]
    argv += ["--no-progress", "--seed", str(seed), "--out", str(out), "--json"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["privacy_unit"] == "user" and report["max_rows_per_user"] == 3
    assert "user" in report["neighbouring"]
    assert [g["budget"] for g in report["groups"]] == [1.0, 3.0]
    assert all(g["epsilon_spent"] <= g["budget"] * (1 + 1e-9) for g in report["groups"])
    assert "user" not in report["data"]["feature_columns"]  # never a model input
    public = [p for p in out.rglob("*") if p.is_file() and "private" not in p.relative_to(out).parts]
    texts = [p.read_bytes() for p in public] + [(printed.out + printed.err).encode()]
    for blob in texts:
        assert b"person-" not in blob  # no user id
        assert str(seed).encode() not in blob
        assert b'"rows_per_user"' not in blob and b"num_rows" not in blob
    for p in out.rglob("*"):
        if "private" in p.relative_to(out).parts and p.is_file():
            assert file_mode(p) == 0o600
    # resume: the checkpoint's signature holds k (and the users' digest): another k is refused
    other = argv[: argv.index("--no-progress")]
    other[other.index("--max-rows-per-user") + 1] = "2"
    assert main([*other, "--no-progress", "--out", str(out), "--resume"]) == 2
    assert "users_k" in capsys.readouterr().err


def _individual_cli_run(tmp_path, nproc: int):
    """``idpsgd train --user-column ... --individual-accounting`` on ``nproc`` processes; returns the run folder."""
    from idpsgd.cli import main

    data, _ = _user_csv(tmp_path / f"data{nproc}")  # (the same rows for every nproc)
    out = tmp_path / f"ia{nproc}"
    argv = ["train", "--method", "sample", "--budgets", "1,3", "--fractions", "0.5,0.5", *data, "--user-column"]
    argv += ["user", "--max-rows-per-user", "3", "--epochs", "2", "--batch-size", "6", "--individual-accounting"]
    argv += ["--validate-subset", "0", "--no-progress", "--seed", "5", "--nproc", str(nproc), "--out", str(out)]
    assert main(argv) == 0
    return out


def _csv_columns(path) -> dict:
    import csv

    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return {k: np.array([float(r[k]) for r in rows if k != "source"]) for k in rows[0] if k != "source"}


def test_train_individual_accounting_at_user_level(tmp_path):
    """Individual accounting (Yu et al. 2023) with the user as the unit, from the command line: one ε per user,
    each within its budget, the user's final loss the mean over its rows."""
    import json

    out = _individual_cli_run(tmp_path, 1)
    report = json.loads((out / "report.json").read_text())
    assert report["privacy_unit"] == "user" and "individual_privacy" in report
    cols = _csv_columns(out / "private" / "individual_epsilons.csv")
    n_users = int(cols["rows"].size)
    assert n_users == len(set(_user_csv(tmp_path / "again")[1].tolist())) and cols["rows"].sum() > n_users
    assert np.all(cols["epsilon"] <= cols["budget"] * (1 + 1e-9)) and np.ptp(cols["epsilon"]) > 0
    assert np.all((cols["share_correct"] >= 0) & (cols["share_correct"] <= 1))


def test_train_individual_filter_at_user_level(tmp_path):
    """``idpsgd train --user-column ... --filter individual``: the filter with the user as the unit, one
    realized ε per user within its budget; full-batch DP-GD (--gd) is refused at user level."""
    import json

    from idpsgd.cli import main

    data, ids = _user_csv(tmp_path / "data")
    out = tmp_path / "f"
    argv = ["train", "--method", "uniform", "--budgets", "1,3", "--fractions", "0.5,0.5", *data, "--user-column"]
    argv += ["user", "--max-rows-per-user", "3", "--epochs", "2", "--batch-size", "6", "--filter", "individual"]
    assert main([*argv, "--no-progress", "--seed", "5", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["privacy_unit"] == "user" and "filter" in report
    cols = _csv_columns(out / "private" / "filter_epsilons.csv")
    assert cols["rows"].size == len(set(ids.tolist())) and cols["rows"].sum() == ids.size
    assert np.all(cols["epsilon"] <= cols["budget"] * (1 + 1e-9))
    assert main([*argv, "--gd", "--no-progress", "--out", str(tmp_path / "g")]) == 2


@pytest.mark.slow  # two spawned processes
def test_train_individual_accounting_at_user_level_on_two_processes(tmp_path):
    one, two = _individual_cli_run(tmp_path, 1), _individual_cli_run(tmp_path, 2)
    a, b = (_csv_columns(d / "private" / "individual_epsilons.csv") for d in (one, two))
    np.testing.assert_allclose(b["epsilon"], a["epsilon"], rtol=1e-6)  # the per-user norms: sharded, all-gathered
    assert (one / "private" / "ledger.csv").read_bytes() == (two / "private" / "ledger.csv").read_bytes()


def test_train_user_column_refusals(tmp_path):
    from idpsgd.cli import main

    data, _ = _user_csv(tmp_path / "data")
    base = ["train", "--method", "sample", *data, "--user-column", "user", "--epochs", "1", "--no-progress"]
    base += ["--out", str(tmp_path / "r")]
    assert main([*base, "--budgets-per-class", "0:1,1:2,2:3"]) == 2
    assert main([*base, "--budgets", "1,3", "--fractions", "0.5,0.5", "--feature-columns", "user,f0"]) == 2
    assert (
        main(
            [
                "train",
                "--method",
                "sample",
                "--budgets",
                "1",
                *data,
                "--user-column",
                "nope",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 2
    )


# --- the individual filter and individual accounting at user level ----------------------------------
def _user_setup(n_users=24, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(n_users), rng.integers(1, 12, n_users))
    x, y = _draw_img(torch.Generator().manual_seed(seed), ids.size)
    return ids, x, y


def test_per_user_norm_pass_matches_autograd():
    ids, x, y = _user_setup()
    users = Users(ids, k=3)
    model = _cnn()
    engine = IndividualizedPrivacyEngine(seed=0)
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
        noise_multiplier=1.0,
        users=users,
        grad_sample_mode="bk",
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng_copy = np.random.default_rng(0)
    engine._sampler_rng = np.random.default_rng(0)
    norms, losses = engine.per_example_grad_norms(indices=np.arange(users.num_users), batch_size=7)
    assert norms.shape == (users.num_users,)
    rows = users.draw_rows(np.arange(users.num_users), rng_copy)  # the same draw
    ref = _cnn()
    ref.load_state_dict(state)
    params = list(ref.parameters())
    for u in range(users.num_users):
        r = rows[ids[rows] == u]
        loss = nn.functional.cross_entropy(ref(x[r]), y[r], reduction="sum")
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        assert float(g.norm()) == pytest.approx(norms[u], rel=1e-4)
        assert float(loss.detach()) == pytest.approx(losses[u], rel=1e-5)


def test_individual_filter_at_user_level_keeps_every_user_within_budget():
    from idpsgd import Budgets

    ids, x, y = _user_setup()
    users = Users(ids, k=3)
    budgets = Budgets.from_groups([0.5, 2.0], [0.5, 0.5], users.num_users, 1e-5, seed=0)
    model = _cnn()
    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")
    module, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        budgets=budgets,
        steps=30,
        sample_rate=0.3,
        privacy_filter="individual",
        users=users,
        grad_sample_mode="bk",
    )
    while engine.can_step():
        for xb, yb in loader:
            if not engine.can_step():
                break
            opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            opt.step()
        if engine.steps >= 30:
            break
    eps = engine.get_individual_epsilons()
    assert eps.shape == (users.num_users,)
    assert np.all(eps <= budgets.epsilons * (1 + 1e-9))


def test_individual_accounting_at_user_level():
    ids, x, y = _user_setup()
    users = Users(ids, k=3)
    model = _cnn()
    from idpsgd import IndividualAccountingOptions

    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")
    engine.enable_individual_accounting(IndividualAccountingOptions(validate_subset=0))
    module, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.2,
        sample_rate=0.3,
        target_delta=1e-5,
        users=users,
        grad_sample_mode="bk",
    )
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(module(xb), yb).backward()
        opt.step()
    eps = engine.get_individual_epsilons()
    assert eps.shape == (users.num_users,)
    assert np.all(eps <= float(engine.get_epsilon()) * (1 + 1e-9)) and np.all(eps >= 0)


# --- audit, synthetic users -----------------------------------------------------------------------
def test_synthetic_users_are_heavy_tailed_and_cover_every_row():
    from idpsgd.users import synthetic_user_ids

    ids = synthetic_user_ids(5000, 200, seed=0)
    counts = np.bincount(ids)
    assert ids.size == 5000 and counts.size == 200 and counts.min() >= 1
    assert counts.max() > 8 * np.median(counts)  # a heavy tail
    assert np.array_equal(ids, synthetic_user_ids(5000, 200, seed=0))


def test_user_level_audit_runs_and_its_bounds_stay_below_the_reported_epsilon():
    from idpsgd import Budgets
    from idpsgd.audit.users import audit_users
    from idpsgd.data import load_dataset
    from idpsgd.users import synthetic_user_ids

    data = load_dataset("digits")
    ids = synthetic_user_ids(len(data.y_train), 300, seed=0)
    users = Users(ids, k=4)
    budgets = Budgets.from_groups([1.0, 4.0], [0.5, 0.5], users.num_users, 1e-5, seed=0)
    out = audit_users(data, users, budgets, epochs=3, users_per_step=30, seed=0, model="mlp")
    assert out["privacy_unit"] == "user" and len(out["groups"]) == 2
    for g in out["groups"]:
        assert g["auc"] is not None and 0 <= g["auc"] <= 1
        assert g["verdict"] == "passed"
        assert g["one_run_bound"] <= g["reported_epsilon"]
    assert out["private"]["member"].shape == (users.num_users,)


def test_els_noise_multiplier_meets_its_target():
    from idpsgd.users import els_noise_multiplier, els_user_epsilon

    sigma = els_noise_multiplier(0.05, 200, 4, 2.0, 1e-5)
    assert els_user_epsilon(0.05, sigma, 200, 4, 1e-5) <= 2.0
    assert els_user_epsilon(0.05, sigma * 0.99, 200, 4, 1e-5) > 2.0  # the smallest σ, to 1 %


@pytest.mark.slow
def test_reproduce_user_level_small(tmp_path):
    import json

    from idpsgd.cli import main

    out = tmp_path / "ul"
    argv = ["reproduce", "user-level", "--users", "24", "--epochs", "1", "--compute-factor", "2"]
    argv += ["--users-per-step", "8", "--seed", "5", "--no-progress", "--out", str(out), "--json"]
    assert main(argv) == 0
    r = json.loads((out / "user_level.json").read_text())
    assert r["privacy_unit"] == "user" and r["max_rows_per_user"] == 4
    methods = {x["method"] for x in r["results"]}
    assert methods == {"ELS (group privacy)", "ULS uniform", "ULS sample", "ULS scale"}
    for x in r["results"]:  # every group's user-level ε within its budget (uniform methods: the strictest)
        for g in x["groups"]:
            assert g["epsilon"] <= g["budget"] * (1 + 1e-6)
    assert set(r["finding_checked"]) == {"moderate", "large"}
    assert "private" not in r and b"5" not in json.dumps(r.get("randomness", "")).encode()


# --- two ranks ----------------------------------------------------------------------------------
def _user_ranks_trial(data_parallel=True, modes=("bk", "hooks")):
    """User-level training on DPDDP (users routed to ranks) or on one process: the same run.  A mode
    ``"<mode>+individual"`` adds individual accounting, ``"<mode>+filter"`` the individual filter (their
    per-user norm passes sharded over the ranks)."""
    from idpsgd import Budgets, IndividualAccountingOptions
    from idpsgd.engine import distributed
    from idpsgd.engine.per_example.wrap import raw_module

    out = {}
    for name in modes:
        mode, _, extra = name.partition("+")
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        ids = np.repeat(np.arange(30), rng.integers(1, 9, 30))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(ids.size, 10, generator=g), torch.randint(0, 3, (ids.size,), generator=g)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        if data_parallel:
            model = distributed.wrap_model(model)
        users = Users(ids, k=3)
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=7)
        if extra == "individual":  # every user's norm refreshed twice an epoch
            engine.enable_individual_accounting(IndividualAccountingOptions(validate_subset=0, refreshes_per_epoch=2.0))
        plan = (  # the filter: a fixed σ and as many steps as the budgets admit
            dict(privacy_filter="individual", noise_multiplier=1.0, steps=40)
            if extra == "filter"
            else dict(method="sample", epochs=2)
        )
        module, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
            budgets=Budgets.from_groups(
                [0.5 if extra == "filter" else 1.0, 3.0], [0.5, 0.5], users.num_users, 1e-5, seed=0
            ),
            sample_rate=0.3,
            users=users,
            grad_sample_mode=mode,
            **plan,
        )
        for _ in range(2):
            for xb, yb in loader:
                if not engine.can_step():
                    break
                opt.zero_grad()
                nn.functional.cross_entropy(module(xb), yb, reduction="sum").backward()
                opt.step()
        out[name] = {
            "steps": engine.steps,
            "eps": engine.get_epsilon().per_group,
            "params": [p.detach().clone() for p in raw_module(module).parameters()],
        }
        if extra:
            out[name]["individual"] = engine.get_individual_epsilons()
    return out


@pytest.mark.parametrize(
    "modes", [("bk", "bk+individual", "bk+filter"), pytest.param(("hooks", "functorch"), marks=pytest.mark.slow)]
)
def test_two_ranks_at_user_level_match_one_process(modes):
    """Users routed to ranks (each user's rows clipped as one unit on one rank): two gloo processes give
    the single-process run (same draws, same clipped sum, noise once); with individual accounting the
    per-user norm passes are sharded over the ranks and all-gathered: the same individual ε per user, and
    the individual filter lets the same users go at the same steps."""

    single = _user_ranks_trial(data_parallel=False, modes=modes)
    two = launch(_user_ranks_trial, 2, kwargs={"modes": modes}, timeout_s=240)
    for mode in modes:
        assert two[mode]["steps"] == single[mode]["steps"] > 0
        np.testing.assert_array_equal(two[mode]["eps"], single[mode]["eps"])
        for a, b in zip(two[mode]["params"], single[mode]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        if "individual" in single[mode]:  # the per-user norms (of the same rows) to float precision
            np.testing.assert_allclose(two[mode]["individual"], single[mode]["individual"], rtol=1e-6)
            assert np.ptp(single[mode]["individual"]) > 0  # output-specific: the users' ε differ


def test_make_private_with_epsilon_at_user_level():
    ids, x, y = _user_setup()
    users = Users(ids, k=2)
    model = _cnn()
    engine = IndividualizedPrivacyEngine(seed=0, accountant="rdp")
    engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        users=users,
    )
    assert engine.parameters.privacy_unit == "user" and engine.parameters.sample_rates.size == users.num_users
    assert float(engine.get_epsilon(steps=engine.parameters.steps)) <= 2.0 * (1 + 1e-9)


def test_gpt2_bk_user_norms_with_shared_positions_and_tied_embeddings():
    """GPT-2 in bk with its own position ids (a (1, T) input shared by the batch, bk_shared) and tied
    wte/lm_head (bk_tied): the per-user norms are those of the users' summed gradients by autograd."""

    def call(m, x):
        return m(input_ids=x).logits

    g = torch.Generator().manual_seed(1)
    x, y = _draw_text(g, 14)
    uids = np.array([0, 0, 1, 2, 2, 2, 3, 1, 0, 4, 4, 4, 4, 2])
    _, engine = _step_sum(_gpt2, x, y, uids, "bk", np.full(5, 1e6), k=10, call=call)
    model = _gpt2()
    params = [p for p in model.parameters() if p.requires_grad]
    for u, n in zip(engine.clipping.last_indices.tolist(), engine.clipping.last_norms.tolist(), strict=True):
        rows = np.flatnonzero(uids == u)
        grads = torch.autograd.grad(_ce(call(model, x[rows]), y[rows]).sum(), params)
        assert n == pytest.approx(float(torch.cat([t.reshape(-1) for t in grads]).norm()), rel=1e-4)
