"""Poisson batch sampler statistics, the index queue, per-example clipping and the noise scale."""

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from torch import nn

from idpsgd import InvalidParameterError
from idpsgd.engine import BatchIndexQueue, IndividualizedDPOptimizer, PoissonBatchSampler
from idpsgd.engine.clipping.examples import PerExampleClipping


def _sampler(rates, steps=1, seed=0, queue=None):
    return PoissonBatchSampler(rates, steps, np.random.default_rng(seed), queue)


def test_inclusion_frequencies_match_rates():
    rates = np.repeat([0.0, 0.05, 0.2, 0.6, 1.0], 40)
    sampler = _sampler(rates, seed=3)
    draws = 4000
    hits = np.zeros(rates.size)
    sizes = []
    for _ in range(draws):
        idx = sampler.sample()
        assert np.all(np.diff(idx) > 0)
        hits[idx] += 1
        sizes.append(idx.size)
    freq = hits / draws
    sd = np.sqrt(rates * (1 - rates) / draws)
    assert np.all(np.abs(freq - rates) <= 5 * sd + 1e-12)
    assert np.all(freq[rates == 0] == 0) and np.all(freq[rates == 1] == 1)
    # independent inclusions: batch size mean Σq and variance Σq(1-q)
    assert abs(np.mean(sizes) - rates.sum()) < 5 * np.sqrt(np.sum(rates * (1 - rates)) / draws)
    var = np.sum(rates * (1 - rates))
    assert abs(np.var(sizes) / var - 1) < 0.15


def test_secure_sampler_draws_from_os_entropy():
    from idpsgd.engine.noise.randomness import SecureUniform

    u = SecureUniform().random(200_000)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    rates = np.full(1000, 0.3)
    a, b = PoissonBatchSampler(rates, 1, SecureUniform()), PoissonBatchSampler(rates, 1, SecureUniform())
    assert not np.array_equal(a.sample(), b.sample())


def test_sampler_is_seeded_resumable_and_feeds_the_queue():
    rates = np.full(50, 0.3)
    queue = BatchIndexQueue()
    a, b = _sampler(rates, 5, seed=7, queue=queue), _sampler(rates, 5, seed=7)
    batches = list(a)
    assert all(x == y for x, y in zip(batches, b, strict=True)) and len(batches) == len(a) == 5
    assert len(queue) == sum(len(x) for x in batches)
    assert queue.pop(len(batches[0])).tolist() == batches[0]
    state = a.state_dict()
    after = [a.sample() for _ in range(3)]
    c = _sampler(rates, 5, seed=99)
    c.load_state_dict(state)
    assert all(np.array_equal(x, c.sample()) for x in after)
    assert a.sample_rate == pytest.approx(0.3) and a.expected_batch_size == pytest.approx(15)


def test_queue_pops_across_batches_and_refuses_to_overrun():
    q = BatchIndexQueue()
    q.push(np.array([1, 2, 3]))
    q.push(np.array([], dtype=int))
    q.push(np.array([7, 8]))
    assert q.pop(2).tolist() == [1, 2] and q.pop(0).tolist() == [] and q.pop(2).tolist() == [3, 7]
    with pytest.raises(RuntimeError, match="one backward pass and optimizer.step"):
        q.pop(2)


def test_sampler_rejects_bad_rates():
    with pytest.raises(InvalidParameterError, match="sample_rates=1.5 is invalid"):
        _sampler([0.1, 1.5])
    with pytest.raises(InvalidParameterError, match="steps_per_epoch"):
        _sampler([0.1], 0)


class _Sum(nn.Module):
    """Linear map whose per-example gradient (for loss = mean of outputs) is exactly x_i."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        return self.lin(x)


def _wrapped(d, clip_norms, sigma, ebs, c=1.0, seed=0):
    model = GradSampleModule(_Sum(d))
    queue = BatchIndexQueue()
    opt = IndividualizedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=sigma,
        max_grad_norm=c,
        clipping=PerExampleClipping(clip_norms, queue),
        expected_batch_size=ebs,
        generator=torch.Generator().manual_seed(seed),
    )
    return model, opt, queue


def test_per_example_clipping_uses_each_examples_clip_norm():
    x = torch.tensor([[0.3, 0.4], [0.0, 2.0], [4.0, 0.0], [3.0, 4.0]])  # norms 0.5, 2, 4, 5
    clip = torch.tensor([1.0, 1.0, 2.0, 9.0, 10.0])  # by dataset index
    model, opt, queue = _wrapped(2, clip, sigma=1e-9, ebs=2.5)  # noise negligible next to atol
    idx = np.array([0, 1, 2, 4])  # dataset indices of the rows
    queue.push(idx)
    model(x).mean().backward()
    opt.step()
    expected = (x[0] + x[1] * (1 / 2) + x[2] * (2 / 4) + x[3]) / 2.5  # 5 < 10: unclipped
    assert torch.allclose(model._module.lin.weight.grad.ravel(), expected, atol=1e-5)
    assert torch.allclose(opt.last_norms, torch.tensor([0.5, 2.0, 4.0, 5.0]), atol=1e-5)
    assert opt.last_indices.tolist() == idx.tolist()


def test_noise_std_is_sigma_times_reference_clip_over_expected_batch():
    d, sigma, c, ebs = 20000, 1.7, 0.8, 5.0
    model, opt, queue = _wrapped(d, torch.full((3,), 0.1), sigma=sigma, ebs=ebs, c=c)
    queue.push(np.zeros(0, dtype=int))  # empty batch: noise only
    model(torch.zeros(0, d)).mean().backward()
    opt.step()
    g = model._module.lin.weight.grad.ravel()
    assert abs(float(g.mean())) < 5 * sigma * c / ebs / np.sqrt(d)
    assert float(g.std()) == pytest.approx(sigma * c / ebs, rel=0.03)


def test_optimizer_needs_drawn_indices():
    model, opt, _queue = _wrapped(2, torch.ones(4), sigma=1.0, ebs=1.0)
    model(torch.ones(2, 2)).mean().backward()
    with pytest.raises(RuntimeError, match="more per-sample gradients than drawn examples are waiting"):
        opt.step()
    with pytest.raises(InvalidParameterError, match="clip_norms=-1.0 is invalid"):
        _wrapped(2, torch.tensor([1.0, -1.0]), sigma=1.0, ebs=1.0)
