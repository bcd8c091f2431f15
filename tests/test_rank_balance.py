"""Ranks with balanced loads (engine/sampling/rank_balance.py, issue 51): the units (examples, users) are dealt to
ranks in snake order of their rates, so every rank's expected batch Σ q_i is equal to within one unit's
rate even when the budgets follow the row order; the union of the ranks' draws stays the one-process
draw of the same seed.  (The multi-process runs: test_distributed.py, test_fsdp.py; the bench:
bench/bench_rank_balance.py.)"""

import numpy as np
import pytest

from idpsgd.engine.sampling.rank_balance import expected_loads, rank_owners, rank_shard
from idpsgd.engine.sampling.sampler import PoissonBatchSampler
from idpsgd.users import Users


def _row_ordered_rates(n: int, kind: str) -> np.ndarray:
    i = np.arange(n)
    if kind == "alternating":  # two budgets by turns: i mod 2 gave one rank every high rate
        return np.where(i % 2 == 0, 0.02, 0.2)
    if kind == "blocks":  # budgets sorted by row: the first half low, the second high
        return np.where(i < n // 2, 0.01, 0.3)
    if kind == "ramp":
        return np.linspace(0.001, 0.5, n)
    return np.random.default_rng(0).choice([0.01, 0.05, 0.4], size=n)


@pytest.mark.parametrize("kind", ["alternating", "blocks", "ramp", "random"])
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_expected_loads_are_equal_to_within_one_rate(kind, world):
    for n in (world, 97, 1000):
        q = _row_ordered_rates(n, kind)
        owners = rank_owners(q, world)
        loads = expected_loads(q, world)
        assert loads.max() - loads.min() <= q.max() + 1e-12, (n, loads)
        counts = np.bincount(owners, minlength=world)
        assert counts.max() - counts.min() <= 1  # and the numbers of units by at most one
        shards = [rank_shard(q, r, world) for r in range(world)]  # a partition of the units, each ascending
        assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(n))
        assert all(np.all(np.diff(s) > 0) for s in shards)
        assert np.array_equal(owners, rank_owners(q.copy(), world))  # deterministic: no seed


def test_i_mod_w_would_not_be_balanced():
    """What the assignment fixes: with alternating budgets i mod 2 gives rank 1 ten times rank 0's load."""
    q = _row_ordered_rates(1000, "alternating")
    by_mod = [q[r::2].sum() for r in range(2)]
    assert by_mod[1] / by_mod[0] == pytest.approx(10.0)
    loads = expected_loads(q, 2)
    assert loads[0] == pytest.approx(loads[1])


def test_refusals():
    with pytest.raises(ValueError, match="world_size"):
        rank_owners([0.1, 0.2], 0)
    with pytest.raises(ValueError, match="rank"):
        rank_shard([0.1, 0.2], 2, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_samplers_are_balanced_and_their_union_is_the_one_process_draw(world):
    q = _row_ordered_rates(400, "alternating")
    one = PoissonBatchSampler(q, 5, np.random.default_rng(7))
    ranks = [PoissonBatchSampler(q, 5, np.random.default_rng(7), None, ranks=(r, world)) for r in range(world)]
    loads = [s.expected_batch_size for s in ranks]
    assert max(loads) - min(loads) <= q.max() + 1e-12
    for _ in range(5):
        want = np.sort(one.sample())
        got = [s.sample() for s in ranks]
        assert np.array_equal(np.sort(np.concatenate(got)), want)
        assert all(np.all(rank_owners(q, world)[g] == r) for r, g in enumerate(got))


def test_user_level_samplers_are_balanced_and_their_union_is_the_one_process_draw():
    ids = np.repeat(np.arange(60), 3)  # 60 users of 3 rows, budgets alternating by user
    users = Users(ids, 2)
    q = _row_ordered_rates(60, "alternating")
    one = PoissonBatchSampler(q, 4, np.random.default_rng(3), None, users=users)
    ranks = [PoissonBatchSampler(q, 4, np.random.default_rng(3), None, users=users, ranks=(r, 2)) for r in range(2)]
    loads = [s.expected_batch_size for s in ranks]
    assert abs(loads[0] - loads[1]) <= q.max() + 1e-12
    for _ in range(4):
        want = np.sort(one.sample())
        got = [s.sample() for s in ranks]
        assert np.array_equal(np.sort(np.concatenate(got)), want)
        for r, rows in enumerate(got):  # every user's rows on its one rank
            assert np.all(ranks[0].owners[users.unit_of_row[rows]] == r)
