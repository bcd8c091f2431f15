"""Budgets and the Uniform / Sample / Scale assignments (Boenisch et al. 2023)."""

import json

import numpy as np
import pytest

from idpsgd.assignment import Budgets, assign, group_counts
from idpsgd.cli import main
from idpsgd.validation import InvalidParameterError
from support import independent_epsilons

Q, T, C, DELTA = 0.02, 400, 1.0, 1e-5


@pytest.fixture(scope="module")
def budgets():
    return Budgets.from_groups([1.0, 2.0, 3.0], [0.34, 0.43, 0.23], 1000, DELTA, seed=3)


@pytest.mark.parametrize("method", ["uniform", "sample", "scale"])
def test_every_group_within_budget_by_an_independent_accountant(budgets, method):
    a = assign(budgets, method, Q, T, C)
    for g in a.groups:
        # the refined ε is tighter than dp_accounting's default-order grid; its RDP at our order agrees
        rdp_eps, pld_eps = independent_epsilons(g.sample_rate, g.noise_multiplier, T, DELTA)
        assert g.epsilon <= rdp_eps * (1 + 1e-9) and rdp_eps <= g.epsilon * (1 + 1e-4)
        assert rdp_eps <= g.budget * (1 + 1e-6) and pld_eps <= g.budget
        target = 1.0 if method == "uniform" else g.budget
        assert 0.99 * target <= g.epsilon <= target


def test_sample_keeps_mean_rate_and_scale_keeps_mean_clip(budgets):
    s = assign(budgets, "sample", Q, T, C)
    assert s.expected_batch_size / len(budgets) == pytest.approx(Q, rel=2e-4)
    assert s.expected_batch_size / len(budgets) <= Q
    assert np.all(np.diff([g.sample_rate for g in s.groups]) > 0)
    assert s.sample_rates.shape == (1000,) and np.all(s.clip_norms == C)
    sc = assign(budgets, "scale", Q, T, C)
    assert np.mean(sc.clip_norms) == pytest.approx(C, rel=1e-12)
    # σ_scale·c = σ_p·c_p for every group
    for g in sc.groups:
        assert sc.noise_multiplier * C == pytest.approx(g.noise_multiplier * g.clip_norm, rel=1e-12)
    u = assign(budgets, "uniform", Q, T, C)
    assert s.noise_multiplier < u.noise_multiplier and sc.noise_multiplier < u.noise_multiplier


def test_single_group_reduces_to_uniform_and_equal_budgets_agree():
    b = Budgets.from_array(np.full(50, 2.0), DELTA)
    params = [assign(b, m, Q, T, C) for m in ("uniform", "sample", "scale")]
    for a in params:
        assert a.noise_multiplier == pytest.approx(params[0].noise_multiplier, rel=1e-12)
        assert a.groups[0].sample_rate == pytest.approx(Q, rel=1e-12)
        assert a.groups[0].clip_norm == pytest.approx(C, rel=1e-12)


@pytest.mark.parametrize("distinct", [60, pytest.param(300, marks=pytest.mark.slow)])
def test_many_distinct_budgets_vectorized(distinct):
    """Every one of many distinct budgets is calibrated (one vectorized search per σ) within
    [0.99·budget, budget]; 60 in the default suite (~2 s of CPU), 300 (~10 s) marked slow."""
    rng = np.random.default_rng(0)
    b = Budgets.from_array(np.round(rng.uniform(1, 4, distinct), 3), DELTA)
    assert len(b.groups()[0]) >= 0.9 * distinct
    for method in ("sample", "scale"):
        a = assign(b, method, 0.01, 300, 1.0)
        eps = np.array([g.epsilon for g in a.groups])
        bud = np.array([g.budget for g in a.groups])
        assert np.all(eps <= bud) and np.all(eps >= 0.99 * bud)


def test_pld_needs_less_noise(budgets):
    r = assign(budgets, "scale", Q, T, C, accountant="rdp")
    p = assign(budgets, "scale", Q, T, C, accountant="pld")
    assert p.noise_multiplier < r.noise_multiplier
    for g in p.groups:
        assert 0.99 * g.budget <= g.epsilon <= g.budget


TABLE6 = {  # (N, B, steps, clip) and the printed Scale clip norms / Sample rates
    ("svhn", (0.34, 0.43, 0.23)): ((73257, 1024, 2146, 0.9), (0.561, 0.970, 1.270), (0.008, 0.015, 0.021), 1.667),
    ("svhn", (0.54, 0.37, 0.09)): ((73257, 1024, 2146, 0.9), (0.651, 1.125, 1.472), (0.009, 0.018, 0.025), 1.937),
    ("cifar10", (0.34, 0.43, 0.23)): ((50000, 1024, 1465, 0.4), (0.244, 0.430, 0.574), (0.012, 0.022, 0.031), 1.965),
    ("cifar10", (0.54, 0.37, 0.09)): ((50000, 1024, 1465, 0.4), (0.285, 0.502, 0.671), (0.014, 0.026, 0.037), 2.300),
}


@pytest.mark.parametrize("key", list(TABLE6))
def test_reproduces_table6(key):
    """Table 6 of Boenisch et al.: clip norms and rates within one unit of the last printed digit.

    The paper's σ values come from a search with ε tolerance 0.01 (Opacus get_noise_multiplier)
    and a σ ← 0.99·σ loop; our calibration is exact to 1e-4 in ε, so the last digit can differ.
    """
    (n, bsz, steps, clip), c_p, q_p, sigma_sample = TABLE6[key]
    b = Budgets.from_groups([1, 2, 3], list(key[1]), n, 1e-5)
    sc = assign(b, "scale", bsz / n, steps, clip)
    np.testing.assert_allclose([g.clip_norm for g in sc.groups], c_p, atol=1.0e-3)
    sa = assign(b, "sample", bsz / n, steps, clip)
    np.testing.assert_allclose([g.sample_rate for g in sa.groups], q_p, atol=1.0e-3)
    assert sa.noise_multiplier == pytest.approx(sigma_sample, abs=6e-3)


def test_group_counts_largest_remainder():
    assert group_counts([0.34, 0.43, 0.23], 10).tolist() == [4, 4, 2]  # remainders .4, .3, .3
    assert group_counts([1 / 3] * 3, 100).sum() == 100
    b = Budgets.from_groups([1, 2], [0.5, 0.5], 10, DELTA, seed=1)
    b2 = Budgets.from_groups([1, 2], [0.5, 0.5], 10, DELTA, seed=1)
    assert np.array_equal(b.epsilons, b2.epsilons) and (b.epsilons == 1).sum() == 5
    assert "epsilons" not in repr(b) and "1.0," not in repr(b)


def test_class_map_and_csv(tmp_path):
    b = Budgets.from_class_map(np.array([0, 1, 2, 1]), {0: 1.0, 1: 2.0, 2: 3.0}, DELTA)
    assert b.epsilons.tolist() == [1, 2, 3, 2]
    with pytest.raises(InvalidParameterError, match="class"):
        Budgets.from_class_map(np.array([0, 5]), {0: 1.0}, DELTA)
    f = tmp_path / "b.csv"
    f.write_text("id,eps\n0,1.5\n1,2.5\n")
    assert Budgets.from_csv(f, "eps", DELTA).epsilons.tolist() == [1.5, 2.5]
    with pytest.raises(InvalidParameterError, match="budget_column"):
        Budgets.from_csv(f, "nope", DELTA)
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        Budgets.from_csv(tmp_path / "missing.csv", "eps", DELTA)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(budgets=[1, 2], fractions=[0.5, 0.6]), "sum to 1"),
        (dict(budgets=[1, 2], fractions=[1.0]), "one entry per budget"),
        (dict(budgets=[1, 0], fractions=[0.5, 0.5]), "budgets"),
        (dict(budgets=[1, np.inf], fractions=[0.5, 0.5]), "budgets"),
        (dict(budgets=[1, 2], fractions=[1.2, -0.2]), "fraction"),
    ],
)
def test_bad_budgets(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        Budgets.from_groups(num_examples=100, delta=DELTA, **kwargs)
    with pytest.raises(InvalidParameterError, match="delta"):
        Budgets.from_array([1.0], 1.0)


def test_assign_cli_contract(capsys, tmp_path):
    argv = [
        "assign",
        "--method",
        "scale",
        "--budgets",
        "1,2,3",
        "--fractions",
        "0.34,0.43,0.23",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.02",
        "--steps",
        "400",
        "--clip-norm",
        "1.0",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"method", "accountant", "noise_multiplier", "sample_rate", "clip_norm", "groups"} <= set(out)
    assert [g["budget"] for g in out["groups"]] == [1, 2, 3]
    for g in out["groups"]:
        assert {"budget", "fraction", "sample_rate", "clip_norm", "noise_multiplier", "epsilon"} <= set(g)
    f = tmp_path / "b.csv"
    f.write_text("eps\n" + "\n".join(["1"] * 30 + ["3"] * 70) + "\n")
    assert (
        main(
            [
                "assign",
                "--method",
                "sample",
                "--budgets-file",
                str(f),
                "--budget-column",
                "eps",
                "--delta",
                "1e-5",
                "--sample-rate",
                "0.02",
                "--steps",
                "400",
                "--clip-norm",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [g["count"] for g in out["groups"]] == [30, 70]
    bad = list(argv)
    bad[bad.index("--fractions") + 1] = "0.5,0.6,0.2"
    assert main(bad) == 2
    assert "must sum to 1" in capsys.readouterr().err
