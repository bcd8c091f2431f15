"""Book-keeping with tied parameters (one parameter in several covered layers): per-example norms and
clipped sums equal per-example autograd in float64, with each pairwise cross-term rule (ghost,
ghost × per-sample, per-sample gradients formed), and one engine step equals Opacus's hooks mode."""

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

from idpsgd.engine.per_example.bk.keeper import BookKeeper
from idpsgd.engine.per_example.bk.plan import plan_layers
from idpsgd.engine.per_example.bk.tied import FORMED_CROSS, GHOST_CROSS, INNER_CROSS
from idpsgd.engine.per_example.bk.units import GHOST, PER_SAMPLE
from support import per_example_grads
from test_bookkeeping import N, _check_equal, _data, _private


class TiedLM(nn.Module):
    """An embedding and an output head sharing the V×d table (GPT-2's wte/lm_head), logits averaged over
    the positions."""

    def __init__(self, vocab, dim, bias=False, padding_idx=None, heads=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mid = nn.Linear(dim, dim)
        self.heads = nn.ModuleList(nn.Linear(dim, vocab, bias=bias) for _ in range(heads))
        for head in self.heads:
            head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return sum(head(h * (k + 1)) for k, head in enumerate(self.heads)).mean(1)


def _model(cls, *args, **kwargs):
    torch.manual_seed(0)
    return cls(*args, **kwargs).double()


def _cross_kinds(paths, name):
    return paths[name].split("cross term: ")[1:]


@pytest.mark.parametrize(
    ("vocab", "dim", "length", "head_path"),
    [
        (11, 5, 7, PER_SAMPLE),  # 2T² = 98 > V·d = 55: the head forms per-example gradients
        (40, 8, 3, GHOST),  # 2T² = 18 < V·d = 320: ghost head, the Embedding × Linear ghost cross term
    ],
)
@pytest.mark.parametrize(("bias", "padding_idx"), [(False, None), (True, 0)])
def test_embedding_and_linear_head(vocab, dim, length, head_path, bias, padding_idx):
    model = _model(TiedLM, vocab, dim, bias=bias, padding_idx=padding_idx)
    x, y = _data((length,), classes=vocab, ids=min(vocab, 6))  # few tokens: repeats within an example
    if padding_idx is not None:
        x[:, 0] = padding_idx
    # Opacus 1.6 ignores padding_idx in its embedding sampler: with one, the reference is autograd only
    paths = _check_equal(model, x, y, opacus=padding_idx is None)
    assert paths["emb"].startswith(GHOST) and paths["heads.0"].startswith(head_path)
    assert "tied with 'heads.0'" in paths["emb"] and "tied with 'emb'" in paths["heads.0"]
    assert _cross_kinds(paths, "emb") == [GHOST_CROSS + ")" if head_path == GHOST else INNER_CROSS + ")"]


class TiedLinear(nn.Module):
    def __init__(self, dim, first_bias_tied=False):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.b.weight = self.a.weight
        if first_bias_tied:
            self.b.bias = self.a.bias
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = self.b(h)
        return self.out(h.reshape(h.shape[0], -1, h.shape[-1]).mean(1))


@pytest.mark.parametrize(
    ("shape", "bias_tied", "expect"),
    [
        ((6,), False, GHOST_CROSS),  # T = 1: both ghost
        ((2, 12), True, GHOST_CROSS),  # ghost weights; the tied bias through formed per-example gradients
        ((9, 3), False, FORMED_CROSS),  # 2T² > d²: both per-sample
    ],
)
def test_linear_and_linear(shape, bias_tied, expect):
    model = _model(TiedLinear, shape[-1], first_bias_tied=bias_tied)
    paths = _check_equal(model, *_data(shape))
    assert expect in paths["a"] and "tied with 'b'" in paths["a"]
    if bias_tied:
        assert FORMED_CROSS in paths["a"]


class MixedLinear(nn.Module):
    """One weight used on a single position (ghost) and on a long sequence (per-sample)."""

    def __init__(self, dim=4):
        super().__init__()
        self.short = nn.Linear(dim, dim)
        self.long = nn.Linear(dim, dim, bias=False)
        self.long.weight = self.short.weight
        self.out = nn.Linear(dim, 3)

    def forward(self, x):  # x (B, T, d)
        return self.out(torch.tanh(self.short(x[:, 0])) + self.long(x).mean(1))


def test_ghost_with_per_sample_cross_term():
    paths = _check_equal(_model(MixedLinear), *_data((8, 4)))
    assert paths["short"].startswith(GHOST) and paths["long"].startswith(PER_SAMPLE)
    assert INNER_CROSS in paths["short"]


def test_a_table_tied_three_ways():
    model = _model(TiedLM, 30, 6, heads=2)
    paths = _check_equal(model, *_data((3,), classes=30, ids=8))
    assert paths["emb"].count("tied with") == 2 and paths["heads.0"].count("tied with") == 2


class TwoTables(nn.Module):
    """Encoder and decoder embeddings sharing one table, and a tied pair of LayerNorms."""

    def __init__(self, vocab=9, dim=5):
        super().__init__()
        self.enc = nn.Embedding(vocab, dim)
        self.dec = nn.Embedding(vocab, dim)
        self.dec.weight = self.enc.weight
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.n2.weight = self.n1.weight
        with torch.no_grad():
            self.n1.weight.uniform_(0.5, 1.5)
        self.out = nn.Linear(dim, 3)

    def forward(self, ids):  # first half encoder ids, second half decoder ids
        t = ids.shape[1] // 2
        return self.out(self.n1(self.enc(ids[:, :t])).mean(1) * self.n2(self.dec(ids[:, t:])).mean(1))


def test_embedding_pairs_and_per_sample_layers():
    paths = _check_equal(_model(TwoTables), *_data((8,), ids=4))
    assert GHOST_CROSS in paths["enc"] and FORMED_CROSS in paths["n1"]


class TiedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 3, 3, padding=1)
        self.c2.weight = self.c1.weight
        self.out = nn.Linear(3 * 5 * 5, 3)

    def forward(self, x):
        return self.out(self.c2(torch.tanh(self.c1(x))).flatten(1))


def test_a_pair_without_ghost_rule_forms_per_example_gradients():
    paths = _check_equal(_model(TiedConv), *_data((3, 5, 5)))
    assert FORMED_CROSS in paths["c1"]


def test_a_module_reached_twice_is_one_layer():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.block = nn.Sequential(self.inner, nn.Tanh())  # the same module under two names
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            return self.out(self.block(self.inner(x)))

    model = _model(Twice)
    assert [name for name, _, _ in plan_layers(model)] == ["inner", "out"]
    # Opacus 1.6's hooks mode hooks such a module once per name (its per-sample gradients come out
    # wrong): the reference is the example-by-example backward pass
    _check_equal(model, *_data((4,)), opacus=False)


def test_a_tied_parameter_used_outside_the_covered_layers_is_exact():
    # issue 36: a functional use of the table inside the forward (refused before) is a value shared by
    # the batch whose per-example gradients join the layer's (provenance)
    class Leaky(TiedLM):
        def forward(self, ids):
            h = torch.tanh(self.mid(self.emb(ids)))
            return (self.heads[0](h) + h @ self.emb.weight.t()).mean(1)  # a functional use of the table

    _check_equal(_model(Leaky, 11, 5), *_data((4,), classes=11, ids=11), opacus=False)


def test_the_clipped_sum_of_a_tied_parameter_is_its_layers_sum():
    """Only the tied table and nothing else: the clipped sum is the sum of both layers' contributions."""
    model = _model(TiedLM, 11, 5)
    model.mid.requires_grad_(False)
    x, y = _data((4,), classes=11, ids=11)
    keeper = BookKeeper.attach(model)
    keeper.active = True
    nn.functional.cross_entropy(model(x), y).backward()
    keeper.norms()
    sums = keeper.clipped_sum(torch.ones(N, dtype=torch.float64))
    assert list(sums) == [model.emb.weight]
    keeper.detach()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    # Σ_i g_i of the per-example losses = N × the gradient of the mean loss
    torch.testing.assert_close(sums[model.emb.weight] / N, model.emb.weight.grad, rtol=1e-12, atol=1e-14)


def test_engine_layer_paths_name_the_tie():
    model = _model(TiedLM, 40, 8)
    x, y = _data((3,), classes=40, ids=10)
    _, module, _, _ = _private(model, x, y, "bk")
    assert "tied with" in module.layer_paths["emb"]


# --- ties and shared positions together, against per-example autograd ----------------------------------------
class TinyGPT(nn.Module):
    """GPT-2's structure in small: token embedding tied with the head, a position embedding looked up with
    ids of batch 1 (shared by the batch) and tied with a second head over the positions, padding_idx."""

    def __init__(self, vocab=13, dim=6, length=5):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim, padding_idx=0)
        self.wpe = nn.Embedding(length, dim)
        self.ln = nn.LayerNorm(dim)
        self.mid = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.pos_head = nn.Linear(dim, length, bias=False)
        self.pos_head.weight = self.wpe.weight

    def forward(self, ids):
        pid = torch.arange(ids.shape[1]).unsqueeze(0)
        h = torch.tanh(self.mid(self.ln(self.wte(ids) + self.wpe(pid))))
        return self.lm_head(h).mean(1)[:, :3] + self.pos_head(h).mean(1)[:, :3]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_clip_norms_half_clipped_tied_and_shared(seed):
    """Per-example norms and the clipped sum equal per-example autograd in float64 with random clip norms,
    a random half of the examples clipped, on a model with two ties, one of them on the shared path."""
    model = _model(TinyGPT)
    x, y = _data((5,), ids=13, seed=seed)
    x[:, -1] = 0  # padding positions
    grads = per_example_grads(model, x, y)
    norms = grads.norm(dim=1)
    g = torch.Generator().manual_seed(seed)
    clipped = torch.randperm(N, generator=g)[: N // 2]
    ratio = torch.rand(N, generator=g, dtype=torch.float64) * 2.0 + 1.1  # not clipped: c_i > ‖g_i‖
    ratio[clipped] = torch.rand(N // 2, generator=g, dtype=torch.float64) * 0.8 + 0.1
    clips = ratio * norms
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    bk_norms = keeper.norms()
    torch.testing.assert_close(bk_norms, norms, rtol=1e-10, atol=1e-12)
    factors = (clips / (bk_norms + 1e-6)).clamp(max=1.0)
    assert int((factors < 1).sum()) == N // 2
    sums = keeper.clipped_sum(factors)
    flat = torch.cat([sums.get(p, torch.zeros_like(p)).reshape(-1) for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(flat, (factors[:, None] * grads).sum(0), rtol=1e-10, atol=1e-12)
    paths = keeper.paths
    assert "tied with 'lm_head'" in paths["wte"] and "tied with 'pos_head'" in paths["wpe"]
    keeper.clear()
    nn.functional.cross_entropy(model(x[:0]), y[:0], reduction="sum").backward()  # an empty batch
    assert keeper.norms().shape == (0,) and keeper.clipped_sum(torch.zeros(0, dtype=torch.float64)) == {}


def test_tied_parameters_under_batch_memory_manager_equal_one_batch():
    """Several physical batches per logical step: the tied table's clipped sums accumulate to the one-batch
    step (same seed: same batches, same noise)."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    x, y = _data((5,), ids=13)
    results = []
    for physical in (None, 5):
        model = _model(TinyGPT)
        engine, module, optimizer, loader = _private(
            model, x, y, "bk", clips=np.linspace(0.05, 2.0, N), rates=np.full(N, 0.7), steps=3
        )
        for _ in range(3):
            batches = (
                BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer)
                if physical
                else contextlib.nullcontext(loader)
            )
            with batches as data:
                for xb, yb in data:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(module(xb), yb).backward()
                    optimizer.step()
        assert engine.steps == 3
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
