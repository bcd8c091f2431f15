"""Poisson sampler statistics, the indexed loader, per-example clipping and the noise scale."""
import numpy as np
import pytest
import torch
from torch import nn

from idpsgd import InvalidParameterError
from idpsgd.assignment import Budgets, assign
from idpsgd.training import IndexedLoader, IndividualizedDPOptimizer, PoissonSampler, make_private_individualized


def test_inclusion_frequencies_match_rates():
    rates = np.repeat([0.0, 0.05, 0.2, 0.6, 1.0], 40)
    sampler = PoissonSampler(rates, steps_per_epoch=1, seed=3)
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


def test_sampler_is_seeded_and_resumable():
    rates = np.full(50, 0.3)
    a, b = PoissonSampler(rates, 5, seed=7), PoissonSampler(rates, 5, seed=7)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    state = a.state_dict()
    after = [a.sample() for _ in range(3)]
    c = PoissonSampler(rates, 5, seed=99)
    c.load_state_dict(state)
    assert all(np.array_equal(x, c.sample()) for x in after)
    assert not np.array_equal(PoissonSampler(rates, 1, seed=8).sample(), PoissonSampler(rates, 1, seed=7).sample())
    assert len(a) == 5


def test_sampler_rejects_bad_rates():
    with pytest.raises(InvalidParameterError, match="sample_rates=1.5 is invalid"):
        PoissonSampler([0.1, 1.5], 1)
    with pytest.raises(InvalidParameterError, match="steps_per_epoch"):
        PoissonSampler([0.1], 0)


def test_loader_yields_indexed_batches_and_empty_ones():
    x = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    y = torch.arange(10)
    seen = []
    loader = IndexedLoader(x, y, PoissonSampler(np.full(10, 0.05), 200, seed=1), on_batch=seen.append)
    sizes = []
    for xb, yb, idx in loader:
        assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx])
        assert xb.shape[1:] == (2,)
        sizes.append(len(idx))
    assert len(seen) == 200 and 0 in sizes and max(sizes) >= 1
    with pytest.raises(InvalidParameterError, match="equal lengths"):
        IndexedLoader(x, y[:5], PoissonSampler(np.full(10, 0.5), 1))


class _Sum(nn.Module):
    """Linear map whose per-example gradient (for loss = mean of outputs) is exactly x_i."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        return self.lin(x)


def _wrapped(d, clip_norms, sigma, ebs, c=1.0, seed=0):
    from opacus import GradSampleModule
    model = GradSampleModule(_Sum(d))
    opt = IndividualizedDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=sigma,
                                    max_grad_norm=c, clip_norms=clip_norms, expected_batch_size=ebs,
                                    generator=torch.Generator().manual_seed(seed))
    return model, opt


def test_per_example_clipping_uses_each_examples_clip_norm():
    x = torch.tensor([[0.3, 0.4], [0.0, 2.0], [4.0, 0.0], [3.0, 4.0]])   # norms 0.5, 2, 4, 5
    clip = torch.tensor([1.0, 1.0, 2.0, 9.0, 10.0])                        # by dataset index
    model, opt = _wrapped(2, clip, sigma=0.0, ebs=2.5)
    idx = torch.tensor([0, 1, 2, 4])                                       # dataset indices of the rows
    opt.set_batch_indices(idx)
    model(x).mean().backward()
    opt.step()
    expected = (x[0] + x[1] * (1 / 2) + x[2] * (2 / 4) + x[3]) / 2.5      # 5 < 10: unclipped
    assert torch.allclose(model._module.lin.weight.grad.ravel(), expected, atol=1e-5)
    assert torch.allclose(opt.last_norms, torch.tensor([0.5, 2.0, 4.0, 5.0]), atol=1e-5)
    assert torch.equal(opt.last_indices, idx)


def test_noise_std_is_sigma_times_reference_clip_over_expected_batch():
    d, sigma, c, ebs = 20000, 1.7, 0.8, 5.0
    model, opt = _wrapped(d, torch.full((3,), 0.1), sigma=sigma, ebs=ebs, c=c)
    opt.set_batch_indices(torch.zeros(0, dtype=torch.long))                 # empty batch: noise only
    model(torch.zeros(0, d)).mean().backward()
    opt.step()
    g = model._module.lin.weight.grad.ravel()
    assert abs(float(g.mean())) < 5 * sigma * c / ebs / np.sqrt(d)
    assert float(g.std()) == pytest.approx(sigma * c / ebs, rel=0.03)


def test_optimizer_needs_matching_indices():
    model, opt = _wrapped(2, torch.ones(4), sigma=1.0, ebs=1.0)
    model(torch.ones(2, 2)).mean().backward()
    with pytest.raises(RuntimeError, match="set_batch_indices"):
        opt.step()
    opt.zero_grad()
    opt.set_batch_indices([0, 1, 2])
    model(torch.ones(2, 2)).mean().backward()
    with pytest.raises(RuntimeError, match="2 per-sample gradients but 3 indices"):
        opt.step()
    with pytest.raises(InvalidParameterError, match="clip_norms=-1.0 is invalid"):
        _wrapped(2, torch.tensor([1.0, -1.0]), sigma=1.0, ebs=1.0)


def test_make_private_individualized_wires_rates_and_clip_norms():
    n = 300
    budgets = Budgets.from_groups([1, 3], [0.5, 0.5], n, 1e-5, seed=0)
    a = assign(budgets, "scale", 0.1, 50, 1.0)
    x, y = torch.randn(n, 4), torch.randint(0, 2, (n,))
    model, opt, loader = make_private_individualized(nn.Sequential(nn.Linear(4, 2)), torch.optim.SGD(
        nn.Linear(4, 2).parameters(), lr=0.1), (x, y), a, seed=0)
    assert np.allclose(loader.sampler.sample_rates, a.sample_rates)
    assert torch.allclose(opt.clip_norms, torch.as_tensor(a.clip_norms, dtype=torch.float32))
    assert opt.expected_batch_size == pytest.approx(a.expected_batch_size)
    assert opt.noise_multiplier == a.noise_multiplier and opt.max_grad_norm == a.clip_norm
    assert len(loader) == 10
    with pytest.raises(InvalidParameterError, match="data"):
        make_private_individualized(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1),
                                    (x[:10], y[:10]), a)
    with pytest.raises(InvalidParameterError, match="not Opacus-compatible"):
        bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        make_private_individualized(bn, torch.optim.SGD(bn.parameters(), lr=0.1), (x, y), a)
