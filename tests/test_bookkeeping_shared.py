"""Book-keeping of values shared by the batch: covered layers fed an input of batch size 1 (position
embeddings looked up with position_ids of shape (1, T)) and parameters used directly in a module's
forward (a class token and a position embedding).  Per-example norms and clipped sums equal
per-example autograd in float64 however the shared value meets the batch; uses book-keeping cannot
attribute are refused.  (Opacus's hooks fail on batch-1 inputs: the reference is autograd.)"""

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from idpsgd.engine.per_example.bk.keeper import BookKeeper
from idpsgd.engine.per_example.bk.units import DIRECT, FALLBACK
from idpsgd.engine.per_example.norms import per_example_grad_norms
from support import per_example_grads
from test_bookkeeping import N, _check_equal, _data, _private

T, D, C = 5, 4, 3


class Positions(nn.Module):
    """Token embeddings plus a position embedding looked up with ids of batch 1, combined by ``how``."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(11, D)
        self.pos = nn.Embedding(T, D)
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        pid = torch.arange(ids.shape[1]).unsqueeze(0)  # (1, T), as BERT's and GPT-2's position_ids
        h = self.tok(ids)
        pos = self.pos(pid)
        if self.how == "add":
            h = h + pos
        elif self.how == "to_radd":  # GPT-2: position_embeds.to(device) + ...
            h = pos.to(h.device) + h
        elif self.how == "iadd":  # BERT (4.x): embeddings += position_embeddings
            h = h * 1.0
            h += pos
        elif self.how == "mul":
            h = h * torch.tanh(pos)
        elif self.how == "where":
            h = torch.where(ids.unsqueeze(-1) > 3, h, pos)
        elif self.how == "layer_norm":  # a covered layer on the shared value
            h = h + self.norm(pos * 2.0)
        elif self.how == "linear":  # two covered layers in a chain
            h = h + self.proj(self.norm(pos))
        elif self.how == "matmul":  # learned queries against the batch
            h = torch.softmax(h @ self.proj(pos).transpose(1, 2), -1) @ h
        elif self.how == "cat":  # a slice expanded to the batch, concatenated
            h = torch.cat([h, pos[:, :2].expand(ids.shape[0], -1, -1)], 1)
        return self.head(torch.tanh(self.norm(h))).mean(1)


@pytest.mark.parametrize("how", ["add", "to_radd", "iadd", "mul", "where", "layer_norm", "linear", "matmul", "cat"])
def test_a_batch_one_input_is_attributed_per_example(how):
    torch.manual_seed(0)
    model = Positions(how).double()
    paths = _check_equal(model, *_data((T,), ids=11), opacus=False)
    assert FALLBACK not in paths.values()


class Tokens(nn.Module):
    """A ViT-like embedding module: a class token and a position embedding used directly in its forward
    (optionally interpolated to the sequence length), and a covered submodule."""

    def __init__(self, interpolate=False):
        super().__init__()
        self.interpolate = interpolate
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.position_embeddings = nn.Parameter(torch.randn(1, 5, D))
        self.patches = nn.Linear(3, D)

    def forward(self, x):  # x (B, P, 3)
        e = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), self.patches(x)], 1)
        pos = self.position_embeddings
        if self.interpolate:  # as ViT's interpolate_pos_encoding
            grid = F.interpolate(pos[:, 1:].permute(0, 2, 1), size=e.shape[1] - 1, mode="linear")
            pos = torch.cat([pos[:, :1], grid.permute(0, 2, 1)], 1)
        return e + pos


class Classifier(nn.Module):
    def __init__(self, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embeddings(x)))[:, 0])


@pytest.mark.parametrize(("patches", "interpolate"), [(4, False), (6, True)])
def test_parameters_used_in_forward(patches, interpolate):
    torch.manual_seed(0)
    model = Classifier(Tokens(interpolate)).double()
    paths = _check_equal(model, *_data((patches, 3)), opacus=not interpolate)  # hooks: functorch on Tokens
    assert paths["embeddings"] == DIRECT and FALLBACK not in paths.values()


class Latents(nn.Module):
    """Perceiver-style learned latents expanded to the batch and fed to covered layers."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(1, 2, D))
        self.norm = nn.LayerNorm(D)
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(3, D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        q = self.q(self.norm(self.latents.expand(x.shape[0], -1, -1)))
        k = self.k(x)
        return self.head(torch.softmax(q @ k.transpose(1, 2), -1) @ k).mean(1)


def test_an_expanded_parameter_into_covered_layers():
    torch.manual_seed(0)
    paths = _check_equal(Latents().double(), *_data((4, 3)), opacus=False)
    assert paths["Latents"] == DIRECT


def test_a_module_whose_parameters_are_not_broadcast_shaped_is_a_direct_unit():
    # issue 36: whatever their shapes, parameters used directly next to trainable submodules are tracked
    # by provenance (exact per-example gradients where they meet the batch); before, a functorch fallback
    class Scaled(Tokens):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))  # (D,): not shaped (1, ...)

        def forward(self, x):
            return super().forward(x) * self.scale

    torch.manual_seed(0)
    paths = _check_equal(Classifier(Scaled()).double(), *_data((4, 3)))
    assert paths["embeddings"] == DIRECT


@pytest.mark.parametrize(
    ("make", "shape", "ids"), [(lambda: Positions("linear"), (T,), 11), (lambda: Classifier(Tokens()), (4, 3), None)]
)
@pytest.mark.parametrize("batch", [1, 0])
def test_batches_of_one_and_of_none(make, shape, ids, batch):
    """One example: nothing is shared (its gradient is the summed one); none: nothing to attribute."""
    torch.manual_seed(0)
    model = make().double()
    x, y = _data(shape, ids=ids)
    keeper = BookKeeper.attach(copy.deepcopy(model))
    keeper.active, keeper.loss_reduction = True, "sum"
    F.cross_entropy(keeper.model(x[:batch]), y[:batch], reduction="sum").backward()
    norms = keeper.norms()
    if batch:
        np.testing.assert_allclose(
            norms.numpy(), per_example_grads(copy.deepcopy(model), x[:1], y[:1]).norm(dim=1).numpy(), rtol=1e-12
        )
    else:
        assert norms.shape == (0,) and keeper.clipped_sum(torch.zeros(0, dtype=torch.float64)) == {}


class Misuse(Positions):
    def forward(self, ids):
        pid = torch.arange(ids.shape[1]).unsqueeze(0)
        h, pos = self.tok(ids), self.pos(pid)
        if self.how == "linear":  # the shared value as another layer's weight
            h = F.linear(h, pos[0, :D])
        elif self.how == "gather":  # rows picked per example
            h = h + pos[0, ids[:, 0] % T].unsqueeze(1)
        elif self.how == "batch_mean":  # combined with a reduction over the batch
            h = h + pos.sum() * h.mean()
        elif self.how == "rows":  # a (B, T, D) copy whose rows differ
            h = h + pos.expand(ids.shape[0], -1, -1).cumsum(0)
        return self.head(h).mean(1)


@pytest.mark.parametrize("how", ["linear", "gather"])
def test_uses_that_keep_the_examples_apart_are_attributed(how):
    """The shared value as another layer's weight (``F.linear``) or looked up per example: each example's
    gradient by its own backward through the operation (refused before, though each example's loss is its own)."""
    torch.manual_seed(0)
    _check_equal(Misuse(how).double(), *_data((T,), ids=11), opacus=False)


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("batch_mean", "in 'mul' meets a tensor whose rows are not each one example's: they come from 'mean'"),
        ("rows", "aligned row by row with the batch"),
    ],
)
def test_uses_that_cannot_be_attributed_are_refused(how, match):
    torch.manual_seed(0)
    model = Misuse(how).double()
    keeper = BookKeeper.attach(model)
    keeper.active = True
    x, _ = _data((T,), ids=11)
    with pytest.raises(RuntimeError, match=match):
        model(x)
    assert keeper.step_batch is None  # the forward's batch is forgotten after the error


def test_a_batch_one_input_computed_from_the_batch_is_refused():
    class Mixing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.head = nn.Linear(D, C)

        def forward(self, x):
            return self.head(x + self.lin(x.mean(0, keepdim=True)))  # couples the examples

    keeper = BookKeeper.attach(Mixing().double())
    keeper.active = True
    with pytest.raises(RuntimeError, match="layer 'lin' .*rows are not each one example's: they come from 'mean'"):
        keeper.model(torch.randn(N, D, dtype=torch.float64, requires_grad=True))


def test_a_submodule_called_outside_the_model_is_refused():
    """The batch is known only inside the model's forward: a direct unit or a batch-1 input outside it
    would be attributed to no example, and is refused at the step."""
    torch.manual_seed(0)
    model = Classifier(Tokens()).double()
    x = _data((4, 3))[0]
    keeper = BookKeeper.attach(model)
    keeper.active = True
    model.embeddings(x).sum().backward()
    with pytest.raises(RuntimeError, match="called outside the model's forward"):
        keeper.norms()
    positions = Positions("add").double()
    keeper = BookKeeper.attach(positions)
    keeper.active = True
    ids = _data((T,), ids=11)[0]
    (positions.tok(ids) + positions.pos(torch.arange(T).unsqueeze(0))).sum().backward()
    private = r"different batch sizes in one step \(the sizes are private.*inside the model's forward"
    with pytest.raises(ValueError, match=private) as refused:
        keeper.norms()
    assert "12" not in str(refused.value)  # the step's batch size is private


def test_engine_step_and_norm_pass():
    """Through the engine (a private step) and the individual-accounting norm pass."""
    torch.manual_seed(0)
    model = Positions("linear").double()
    x, y = _data((T,), ids=11)
    expected = per_example_grads(copy.deepcopy(model), x, y).norm(dim=1).numpy()
    engine, module, optimizer, loader = _private(copy.deepcopy(model), x, y, "bk")
    for xb, yb in loader:  # q = 1: every example in the one batch
        optimizer.zero_grad()
        F.cross_entropy(module(xb), yb).backward()
        optimizer.step()
    order = np.argsort(engine.clipping.last_indices.numpy())
    np.testing.assert_allclose(engine.clipping.last_norms.numpy()[order], expected, rtol=1e-10)
    norms, _ = per_example_grad_norms(model, [(x[:5], y[:5]), (x[5:], y[5:])])
    np.testing.assert_allclose(norms, expected, rtol=1e-10)


def test_copies_of_a_kept_model_are_plain():
    torch.manual_seed(0)
    model = Classifier(Tokens()).double()
    BookKeeper.attach(model).active = True
    x, _ = _data((4, 3))
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin(x).sum().backward()
        assert all(p.grad is not None for p in twin.parameters())


# --- shared values built to escape attribution: refused, or attributed right ---------------------------------
class BatchStatistic(nn.Module):
    """A covered layer fed a floating-point value of batch size 1 computed from the batch without a gradient
    (a statistic of the raw inputs, or the first example): every example's gradient would depend on the
    others beyond their clip norms."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        context = x.mean(0, keepdim=True) if self.how == "mean" else x[:1]
        return self.head(torch.tanh(x + self.lin(context))).mean(1)


@pytest.mark.parametrize("how", ["mean", "first"])
def test_a_floating_point_batch_one_input_is_refused(how):
    torch.manual_seed(0)
    keeper = BookKeeper.attach(BatchStatistic(how).double())
    keeper.active = True
    x, _ = _data((T, D))
    with pytest.raises(
        RuntimeError,
        match=r"layer 'lin' .*rows are not each one example's: they come from '(mean|__getitem__)'",
    ):
        keeper.model(x)


class _AddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        return g, g.sum(0, keepdim=True)


class Untracked(Positions):
    """The shared value reaches the batch through an operation __torch_function__ does not see."""

    def forward(self, ids):
        h = self.tok(ids)
        pos = self.pos(torch.arange(ids.shape[1]).unsqueeze(0))
        if self.how == "setitem":  # assigned into a batch tensor
            p = torch.zeros_like(h)
            p[:] = pos
            h = h + p
        elif self.how == "function":  # a custom autograd Function
            h = _AddFunction.apply(h, pos)
        elif self.how == "partly":  # one use tracked, one not
            p = torch.zeros_like(h)
            p[:] = pos
            h = h + pos + p
        return self.head(torch.tanh(h)).mean(1)


class UntrackedToken(Tokens):
    def forward(self, x):
        e = torch.cat([torch.zeros_like(x[:, :1, :1]).expand(-1, -1, D), self.patches(x)], 1)
        e[:, :1] = self.cls_token  # a direct unit's parameter assigned into the batch
        return e + self.position_embeddings[:, : e.shape[1]]


@pytest.mark.parametrize(
    ("make", "shape", "ids", "source"),
    [
        (lambda: Untracked("setitem"), (T,), 11, "'pos'"),
        (lambda: Untracked("function"), (T,), 11, "'pos'"),
        (lambda: Untracked("partly"), (T,), 11, "'pos'"),
        (lambda: Classifier(UntrackedToken()), (4, 3), None, "'embeddings.cls_token'"),
    ],
    ids=["setitem", "function", "partly", "direct-unit"],
)
def test_a_gradient_that_bypasses_the_tracking_is_refused(make, shape, ids, source):
    """Before, the part that bypassed the tracking was silently left out of every example's gradient (the
    parameter got noise only for it)."""
    torch.manual_seed(0)
    model = make().double()
    x, y = _data(shape, ids=ids)
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    with pytest.raises(
        RuntimeError,
        match=rf"part of the gradient of a value shared by the batch \(from {source}\) "
        "reached it through an operation book-keeping does not track",
    ):
        F.cross_entropy(model(x), y, reduction="sum").backward()


class ScaledBank(Positions):
    """The shared value is multiplied by a constant bank of K scales, K == the batch size, then summed over
    the bank: a constant whose leading dimension equals B is taken for the batch."""

    def __init__(self):
        super().__init__("add")
        self.register_buffer("scales", torch.linspace(0.5, 1.5, N, dtype=torch.float64).view(N, 1, 1))

    def forward(self, ids):
        pos = self.pos(torch.arange(ids.shape[1]).unsqueeze(0))
        return self.head(torch.tanh(self.tok(ids) + (pos * self.scales).sum(0, keepdim=True))).mean(1)


def test_a_constant_whose_leading_dimension_equals_the_batch_is_not_taken_for_it():
    torch.manual_seed(0)
    model = ScaledBank().double()
    x, y = _data((T,), ids=11)
    _check_equal(model, x, y, opacus=False)  # issue 36: exact by provenance (the bank is not the batch)
