"""One Poisson sampler with grouping (users) and sharding (ranks) as parameters draws, for the same seed,
bit for bit what the four sampler classes it replaces drew (examples or users, one process or a rank's
shard; the references below are their ``sample`` methods as they were)."""

import numpy as np
import pytest

from idpsgd.engine.noise.randomness import SecureUniform
from idpsgd.engine.sampling.rank_balance import rank_owners, rank_shard
from idpsgd.engine.sampling.sampler import PoissonBatchSampler
from idpsgd.users import Users


def _examples(rng, q):
    return np.flatnonzero(rng.random(q.size) < q)


def _examples_on_rank(rng, q, rank, world):
    shard = rank_shard(q, rank, world)
    u = rng.random(shard.size) if isinstance(rng, SecureUniform) else rng.random(q.size)[shard]
    return shard[u < q[shard]]


def _users(rng, q, users):
    chosen = np.flatnonzero(rng.random(q.size) < q)
    return users.draw_rows(chosen, rng)


def _users_on_rank(rng, q, users, rank, world):
    owners = rank_owners(q, world)
    shard = np.flatnonzero(owners == rank).astype(np.int64)
    if isinstance(rng, SecureUniform):
        chosen = shard[rng.random(shard.size) < q[shard]]
        return users.draw_rows(chosen, rng)
    chosen = np.flatnonzero(rng.random(q.size) < q)
    rows = users.draw_rows(chosen, rng)
    return rows[owners[users.unit_of_row[rows]] == rank]


def _rates(n, seed):
    return np.random.default_rng(seed).choice([0.0, 0.05, 0.2, 0.6], size=n)


def _draws(sampler, steps=6):
    return [sampler.sample() for _ in range(steps)]


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_examples_and_shards_bit_identical(seed):
    q = _rates(97, seed)
    ref = np.random.default_rng(seed)
    got = _draws(PoissonBatchSampler(q, 1, np.random.default_rng(seed)))
    for batch in got:
        expected = _examples(ref, q)
        assert batch.dtype == expected.dtype and np.array_equal(batch, expected)
    for world in (2, 3):
        for rank in range(world):
            ref = np.random.default_rng(seed)
            got = _draws(PoissonBatchSampler(q, 1, np.random.default_rng(seed), ranks=(rank, world)))
            for batch in got:
                assert np.array_equal(batch, _examples_on_rank(ref, q, rank, world))


@pytest.mark.parametrize("seed", [0, 5])
def test_users_and_user_shards_bit_identical(seed):
    gen = np.random.default_rng(seed + 100)
    ids = gen.integers(0, 30, size=160)
    ids[:30] = np.arange(30)  # every user has a row
    users = Users(ids, k=3)
    q = _rates(users.num_users, seed)
    ref = np.random.default_rng(seed)
    for batch in _draws(PoissonBatchSampler(q, 1, np.random.default_rng(seed), users=users)):
        assert np.array_equal(batch, _users(ref, q, users))
    for world in (2, 3):
        for rank in range(world):
            ref = np.random.default_rng(seed)
            sampler = PoissonBatchSampler(q, 1, np.random.default_rng(seed), users=users, ranks=(rank, world))
            for batch in _draws(sampler):
                assert np.array_equal(batch, _users_on_rank(ref, q, users, rank, world))


def test_secure_mode_draws_only_the_shards_uniforms():
    """Secure mode: a rank draws its own shard's uniforms (as many as its units), from OS entropy."""

    class Counting(SecureUniform):
        drawn = 0

        def random(self, size):
            Counting.drawn += size
            return super().random(size)

    q = _rates(50, 1)
    sampler = PoissonBatchSampler(q, 1, Counting(), ranks=(1, 2))
    sampler.sample()
    assert Counting.drawn == rank_shard(q, 1, 2).size
