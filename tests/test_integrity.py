"""The released model holds only what the noisy step wrote (issue 29, items 2, 5, 6).

* un-noised writes to parameters, buffers (persistent or not) or extra state during a step's
  forward/backward pass, or during a per-example norm pass, are refused in every grad_sample_mode —
  Embedding(max_norm) at make_private and at the norm pass's entry, the others when they happen —
  and the step is not taken (no noise drawn, nothing charged); writes between steps are fine;
* the public layer paths are a function of the model only (the paths taken depend on the batch's
  shapes and are private);
* book-keeping leaves no trainable parameter with noise only (eval-mode fallback layers,
  weight_norm, parameters unfrozen after planning).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from idpsgd.engine import IndividualizedPrivacyEngine
from idpsgd.engine.guards.integrity import UnnoisedWriteError
from idpsgd.engine.per_example.bk.keeper import BY_SHAPES, BookKeeper
from idpsgd.engine.per_example.bk.units import FALLBACK, GHOST, PER_SAMPLE
from idpsgd.engine.per_example.norms import per_example_grad_norms
from idpsgd.validation import InvalidParameterError
from support import per_example_norms

MODES = ("hooks", "functorch", "ghost", "bk")
N = 8


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g)


def _private(model, mode, x=None, y=None, *, individual=False, optimizer=None, **kwargs):
    """(engine, module, optimizer, loss function, loader): every example in every batch (q = 1)."""
    x, y = _data() if x is None else (x, y)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=0)
    if individual:
        engine.enable_individual_accounting()
    out = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5) if optimizer is None else optimizer,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=N),
        budgets=np.full(N, 1e3),
        target_delta=1e-5,
        sample_rates=np.ones(N),
        clip_norms=np.ones(N),
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        **{"privacy_filter": None, "noise_multiplier": 1.0, **kwargs},
    )
    loss = out[2] if mode == "ghost" else F.cross_entropy
    return engine, out[0], out[1], loss, out[-1]


def _train(engine, module, optimizer, loss, loader, steps=1, between=None):
    for _ in range(steps):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss(module(xb), yb).backward()
            optimizer.step()
            if between is not None:
                between()


def _noise_state(engine):
    return engine._noise.get_state().clone()


# --- models with writes ------------------------------------------------------------------------------------
class _Tokens(nn.Module):
    def __init__(self, max_norm=None, bag=False):
        super().__init__()
        self.emb = (
            nn.EmbeddingBag(11, 5, max_norm=max_norm, mode="mean") if bag else nn.Embedding(11, 5, max_norm=max_norm)
        )
        self.out = nn.Linear(5, 2)
        self.bag = bag

    def forward(self, ids):
        h = self.emb(ids) if self.bag else self.emb(ids).mean(1)
        return self.out(torch.tanh(h))


class _NoGradWrite(nn.Module):
    """Writes its parameter in place under no_grad, from the batch, before using it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(1 + 1e-2 * x.abs().mean())
        return self.lin(x)


class _DataWrite(_NoGradWrite):
    """The same through .data (its own version counter: only the value fingerprint sees it)."""

    def forward(self, x):
        self.lin.weight.data.mul_(1 + 1e-2 * x.abs().mean())
        return self.lin(x)


class _Counter(_NoGradWrite):
    """A persistent buffer counting forward calls (in place)."""

    def __init__(self, persistent=True):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long), persistent=persistent)

    def forward(self, x):
        self.count += 1
        return self.lin(x)


class _RunningMean(_NoGradWrite):
    """A running mean of the inputs (rebinding the buffer), persistent or not."""

    def __init__(self, persistent=True):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4), persistent=persistent)

    def forward(self, x):
        # the previous batches' mean (using this batch's would couple its examples: bk refuses that in
        # the forward, by provenance, before the write is seen)
        out = self.lin(x - self.mean)
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return out


def _model(cls, *args, seed=0):
    torch.manual_seed(seed)
    return cls(*args)


# --- Embedding(max_norm) -----------------------------------------------------------------------------------
def test_embedding_max_norm_writes_the_rows_of_the_batch():
    """Why it is refused: the forward renormalises exactly the rows of the tokens in the batch."""
    model = _model(_Tokens, 1.0)
    with torch.no_grad():
        model.emb.weight.mul_(4)
    before = model.emb.weight.detach().clone()
    model(torch.tensor([[7, 7, 2]]))
    changed = torch.nonzero((model.emb.weight.detach() != before).any(1)).flatten().tolist()
    assert changed == [2, 7]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bag", [False, True])
def test_embedding_max_norm_is_refused_at_make_private_in_every_mode(mode, bag):
    model = _model(_Tokens, 1.0, bag)
    ids = torch.randint(0, 11, (N, 3))
    with pytest.raises(InvalidParameterError, match=r"emb: Embedding(Bag)?\(max_norm=1\).*in place"):
        _private(model, mode, ids, torch.zeros(N, dtype=torch.long))


def test_embedding_max_norm_is_refused_by_the_norm_passes():
    model = _model(_Tokens, 1.0)
    before = model.emb.weight.detach().clone()
    batch = (torch.randint(0, 11, (N, 3)), torch.zeros(N, dtype=torch.long))
    with pytest.raises(InvalidParameterError, match=r"emb: Embedding\(max_norm=1\)"):
        per_example_grad_norms(model, [batch])
    assert torch.equal(model.emb.weight, before)  # refused before any forward


# Opacus's functorch mode under float64 autocast
@pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")
def test_embedding_without_max_norm_trains_in_every_mode():
    for mode in MODES:
        model = _model(_Tokens)
        engine, *rest = _private(model, mode, torch.randint(0, 11, (N, 3)), torch.zeros(N, dtype=torch.long))
        _train(engine, *rest, steps=2)
        assert engine.steps == 2


# --- writes found at the step ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("cls", "what"),
    [
        (_NoGradWrite, r"parameter 'lin.weight' \(module 'lin', Linear\) was written in place"),
        (_DataWrite, r"parameter 'lin.weight' \(module 'lin', Linear\) had its values changed through .data"),
        (_Counter, r"persistent buffer 'count' \(module '\(root\)', _Counter\) was written in place"),
        (_RunningMean, r"persistent buffer 'mean' \(module '\(root\)', _RunningMean\) was replaced"),
    ],
)
def test_a_write_in_forward_refuses_the_step_in_every_mode(mode, cls, what):
    model = _model(cls)
    engine, module, optimizer, loss, loader = _private(model, mode)
    noise = _noise_state(engine)
    with pytest.raises(UnnoisedWriteError, match=what + r".*The step was not taken"):
        _train(engine, module, optimizer, loss, loader)
    assert engine.steps == 0 and engine.accountant.steps == 0  # nothing charged
    assert torch.equal(_noise_state(engine), noise)  # no noise drawn
    assert all(p.grad is None for p in model.parameters())  # nothing left to apply
    # the model holds the write: every later step and norm pass is refused
    with pytest.raises(UnnoisedWriteError, match="refused: earlier"):
        _train(engine, module, optimizer, loss, loader)
    with pytest.raises(UnnoisedWriteError, match="refused: earlier"):
        engine.per_example_grad_norms()
    assert engine.steps == 0


@pytest.mark.parametrize("cls", [_NoGradWrite, _DataWrite, _Counter, _RunningMean])
def test_a_write_in_forward_is_refused_by_the_norm_pass(cls):
    model = _model(cls)
    with pytest.raises(UnnoisedWriteError, match="during a per-example gradient norm pass.*norm pass was stopped"):
        per_example_grad_norms(model, [_data()])


def test_a_write_only_in_eval_mode_is_refused_by_individual_accountings_norm_pass():
    """The norm passes run the model in eval mode over every example: they are checked on their own."""

    class EvalCounter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, x):
            if not self.training:
                self.seen += x.detach().abs().sum(0)
            return x

    torch.manual_seed(0)
    model = nn.Sequential(EvalCounter(), nn.Linear(4, 2))
    _train(*_private(copy.deepcopy(model), "hooks"), steps=2)  # training alone is fine
    with pytest.raises(UnnoisedWriteError, match=r"persistent buffer '0.seen' \(module '0', EvalCounter\)"):
        _private(model, "hooks", individual=True)  # its first norm pass at make_private


class _PreviousBatch(_NoGradWrite):
    """Keeps the previous batch's mean input in a non-persistent buffer and adds it to the next inputs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("prev", torch.zeros(4), persistent=False)

    def forward(self, x):
        out = self.lin(x + self.prev)
        self.prev = x.detach().mean(0)
        return out


def test_a_non_persistent_buffer_written_in_forward_couples_steps():
    """Why non-persistent buffers are refused too: the next step's per-example gradient of an example
    depends on the examples of the previous batch (its influence there is not bounded by its c_j)."""
    grads = []
    for shift in (0.0, 10.0):  # two previous batches differing in one example
        model = _model(_PreviousBatch)
        x, _ = _data()
        x[3] += shift
        model(x)  # the previous step's forward
        F.cross_entropy(model(_data(1)[0][:1]), torch.tensor([1])).backward()
        grads.append(model.lin.weight.grad.clone())
    assert not torch.allclose(*grads)


@pytest.mark.parametrize("mode", MODES)
def test_a_non_persistent_buffer_written_in_forward_is_refused(mode):
    for cls, what in (
        (lambda: _Counter(False), r"non-persistent buffer 'count' .* written in place"),
        (lambda: _RunningMean(False), r"non-persistent buffer 'mean' .* replaced"),
        (_PreviousBatch, r"non-persistent buffer 'prev' .* replaced"),
    ):
        engine, *rest = _private(_model(cls), mode)
        with pytest.raises(UnnoisedWriteError, match=what + r".*The step was not taken"):
            _train(engine, *rest)
        assert engine.steps == 0
    with pytest.raises(UnnoisedWriteError, match=r"non-persistent buffer 'prev'.*norm pass was stopped"):
        per_example_grad_norms(_model(_PreviousBatch), [_data()])


@pytest.mark.parametrize("mode", MODES)
def test_writes_between_steps_are_allowed(mode):
    model = nn.Sequential(_model(nn.Linear, 4, 2))
    model.register_buffer("unused", torch.zeros(3), persistent=False)  # buffers the forward leaves alone
    saved = copy.deepcopy(model.state_dict())
    engine, *rest = _private(model, mode)

    def between():  # the user's writes after each step: a projection, a reload
        with torch.no_grad():
            model[0].weight.clamp_(-0.3, 0.3)
        model[0].bias.data.mul_(0.5)
        model.unused.add_(1)
        if engine.steps == 2:
            model.load_state_dict(saved)

    _train(engine, *rest, steps=3, between=between)
    assert engine.steps == 3


class _ExtraState(_NoGradWrite):
    """Keeps a statistic of the batch in its extra state (state_dict's '_extra_state')."""

    def __init__(self):
        super().__init__()
        self.largest = 0.0

    def get_extra_state(self):
        return {"largest": self.largest}

    def set_extra_state(self, state):
        self.largest = state["largest"]

    def forward(self, x):
        self.largest = torch.maximum(torch.as_tensor(self.largest), x.detach().abs().amax())  # no host read
        return self.lin(x)


@pytest.mark.parametrize("mode", MODES)
def test_extra_state_changed_in_forward_is_refused(mode):
    assert "_extra_state" in _model(_ExtraState).state_dict()  # released with model.pt
    engine, *rest = _private(_model(_ExtraState), mode)
    with pytest.raises(UnnoisedWriteError, match=r"extra state '_extra_state' \(module '\(root\)', _ExtraState\)"):
        _train(engine, *rest)
    with pytest.raises(UnnoisedWriteError, match="extra state '_extra_state'.*norm pass was stopped"):
        per_example_grad_norms(_model(_ExtraState), [_data()])


def test_extra_state_left_alone_trains():
    class Constant(_ExtraState):
        def forward(self, x):
            return self.lin(x)

    engine, *rest = _private(_model(Constant), "bk")
    _train(engine, *rest, steps=2)
    assert engine.steps == 2


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_write_in_a_forward_pre_hook_registered_before_make_private_is_refused(mode):
    """The snapshot is the first of the model's forward pre-hooks, not after the user's."""

    def record(module, args):  # e.g. input statistics kept by a hook, in state_dict
        module.seen.add_(args[0].detach().mean(0))

    class Plain(_NoGradWrite):
        def forward(self, x):  # no write in the forward itself
            return self.lin(x)

    model = _model(Plain)
    model.register_buffer("seen", torch.zeros(4))
    model.register_forward_pre_hook(record)
    engine, *rest = _private(model, mode)
    with pytest.raises(
        UnnoisedWriteError,
        match=r"persistent buffer 'seen' \(module '\(root\)', Plain\) was "
        "written in place",
    ):
        _train(engine, *rest)


class _SmallDataWrite(nn.Module):
    """A tiny `.data` write to one entry of a large frozen float32 table (below the rounding of its norm)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50_000, 64).requires_grad_(False)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        self.table.weight.data[7, 0] += 1e-3 * (x[0, 0] > -10).float()  # from the batch, no host read
        return self.lin(x)


def test_a_small_data_write_to_a_large_float32_table_is_refused():
    table = _model(_SmallDataWrite).table.weight.detach()
    before = torch.linalg.vector_norm(table)
    table[7, 0] += 1e-3
    assert torch.equal(torch.linalg.vector_norm(table), before)  # a float32 norm does not see it
    for mode in ("hooks", "bk"):
        engine, *rest = _private(_model(_SmallDataWrite), mode)
        with pytest.raises(UnnoisedWriteError, match=r"parameter 'table.weight'.*through .data"):
            _train(engine, *rest)


def test_the_engines_checkpoint_loads_between_steps(tmp_path):
    model = _model(nn.Linear, 4, 2)
    engine, module, optimizer, loss, loader = _private(model, "bk")
    _train(engine, module, optimizer, loss, loader)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=module, optimizer=optimizer)
    _train(engine, module, optimizer, loss, loader)
    engine2, module2, optimizer2, loss2, loader2 = _private(model, "bk")
    engine2.load_checkpoint(path=tmp_path / "c.pt", module=module2, optimizer=optimizer2)
    _train(engine2, module2, optimizer2, loss2, loader2)
    assert engine2.steps == 2


def test_the_check_snapshots_at_the_first_forward_of_a_logical_step():
    """With BatchMemoryManager a logical step has several forwards: a write in the first is still found."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    class FirstBatchWrite(_NoGradWrite):
        calls = 0

        def forward(self, x):
            FirstBatchWrite.calls += torch.is_grad_enabled()  # not the batch-independence check's no-grad passes
            if FirstBatchWrite.calls == 1:
                with torch.no_grad():
                    self.lin.bias.add_(x.mean())
            return self.lin(x)

    engine, module, optimizer, loss, loader = _private(_model(FirstBatchWrite), "hooks")
    with (
        pytest.raises(UnnoisedWriteError, match="'lin.bias'"),
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as memory,
    ):
        _train(engine, module, optimizer, loss, memory)
    assert FirstBatchWrite.calls >= 2 and engine.steps == 0


# --- public layer paths -----------------------------------------------------------------------------------
class _Seq(nn.Module):
    """A Linear over a padded sequence: T = the batch's longest sequence."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)  # d·p = 12: ghost when 2T² < 12 (T ≤ 2), per-sample otherwise
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)).sum(1))


def _padded(longest):
    g = torch.Generator().manual_seed(longest)
    x = torch.randn(N, 5, 3, generator=g)
    return x[:, :longest].contiguous(), torch.randint(0, 2, (N,), generator=g)


def test_public_layer_paths_do_not_depend_on_the_batch_shapes():
    runs = {}
    for longest in (1, 5):  # two datasets differing in their longest sequence only
        engine, *rest = _private(_model(_Seq), "bk", *_padded(longest))
        _train(engine, *rest)
        runs[longest] = engine
    assert runs[1].layer_paths == runs[5].layer_paths == {"proj": BY_SHAPES, "out": BY_SHAPES}
    assert runs[1].layer_paths_taken["proj"] == GHOST and runs[5].layer_paths_taken["proj"] == PER_SAMPLE
    for mode in ("hooks", "ghost"):
        engine, *_ = _private(_model(_Seq), mode, *_padded(3))
        assert engine.layer_paths == engine.layer_paths_taken and set(engine.layer_paths) == {"proj", "out"}


def test_the_training_report_holds_the_rule_and_keeps_the_paths_taken_private(tmp_path):
    from idpsgd.assignment import Budgets
    from idpsgd.data import load_dataset
    from idpsgd.training import TrainConfig, train

    digits = load_dataset("digits")
    budgets = Budgets.from_groups([1, 3], [0.5, 0.5], len(digits.y_train), 1e-5, seed=0)
    report = train(digits, budgets, TrainConfig(epochs=1, batch_size=256, progress=False, seed=0), tmp_path)
    rules = report["layer_paths"]
    assert set(rules.values()) <= {BY_SHAPES, GHOST, PER_SAMPLE} and BY_SHAPES in rules.values()
    taken = report["private"]["layer_paths_taken"]
    assert set(taken) == set(rules) and set(taken.values()) <= {GHOST, PER_SAMPLE, f"{GHOST} and {PER_SAMPLE}"}
    public = (tmp_path / "report.json").read_text()
    assert "layer_paths_taken" not in public and BY_SHAPES.split(",")[0] in public


# --- book-keeping leaves no trainable parameter with noise only --------------------------------------------
class _Cube(nn.Module):
    """A Conv3d (no book-keeping rule: Opacus's per-sample gradient, a fallback unit) before a Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 2)
        self.out = nn.Linear(2, 2)

    def forward(self, x):
        return self.out(self.conv(x.view(-1, 1, 2, 2, 1).expand(-1, 1, 2, 2, 2)).flatten(1))


def test_a_fallback_layer_in_eval_mode_is_refused_in_bk():
    model = _model(_Cube)
    engine, module, optimizer, loss, loader = _private(model, "bk")
    assert engine.layer_paths["conv"] == FALLBACK
    model.conv.eval()  # captured nothing: its parameters would get noise only
    noise = _noise_state(engine)
    with pytest.raises(RuntimeError, match=r"layer 'conv' \(Conv3d\) ran its forward in eval mode.*noise only"):
        _train(engine, module, optimizer, loss, loader)
    assert engine.steps == 0 and torch.equal(_noise_state(engine), noise)
    model.train()
    _train(engine, module, optimizer, loss, loader)
    assert engine.steps == 1


def _summed_cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def test_parametrized_weight_norm_is_trained_by_book_keeping():
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = _data()
    x = x.double()
    expect = per_example_norms(model, x, y, _summed_cross_entropy)
    norms, _ = per_example_grad_norms(copy.deepcopy(model), [(x, y)])
    np.testing.assert_allclose(norms, expect, rtol=1e-10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *rest = _private(model, "bk", x, y, noise_multiplier=1e-9)
    assert engine.layer_paths["0"] == FALLBACK
    _train(engine, *rest)
    trained = engine.clipping.last_norms.numpy()[np.argsort(engine.clipping.last_indices.numpy())]
    np.testing.assert_allclose(trained, expect, rtol=1e-10)  # the step clipped the true norms
    for name in ("0.parametrizations.weight.original0", "0.parametrizations.weight.original1"):
        assert (dict(model.named_parameters())[name] - before[name]).abs().max() > 1e-4, name  # trained


def test_deprecated_weight_norm_is_refused_by_book_keeping():
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):
        layer = nn.utils.weight_norm(nn.Linear(4, 2))
    with pytest.raises(InvalidParameterError, match=r"layer '0' \(Linear\).*weight_g, weight_v.*noise only"):
        _private(nn.Sequential(layer), "bk")


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_unfrozen_after_make_private_is_refused(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    engine, module, optimizer, loss, loader = _private(model, mode)
    _train(engine, module, optimizer, loss, loader)
    model[0].requires_grad_(True)  # ghost: outside the per-example norm; bk: noise only
    with pytest.raises((RuntimeError, ValueError), match="became trainable|Per sample gradient is not initialized"):
        _train(engine, module, optimizer, loss, loader)  # hooks, functorch: Opacus's own error
    assert engine.steps == 1


def test_the_norm_pass_plans_a_layer_unfrozen_since_anew():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = _data()
    x = x.double()
    model[0].requires_grad_(False)
    first, _ = per_example_grad_norms(model, [(x, y)])
    np.testing.assert_allclose(first, per_example_norms(model, x, y, _summed_cross_entropy), rtol=1e-10)
    model[0].requires_grad_(True)
    again, _ = per_example_grad_norms(model, [(x, y)])
    np.testing.assert_allclose(again, per_example_norms(model, x, y, _summed_cross_entropy), rtol=1e-10)
    assert BookKeeper.attach(model).rules == {"0": BY_SHAPES, "2": BY_SHAPES}


# --- a trainable parameter outside the noisy optimizer -------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_trainable_parameter_left_out_of_the_optimizer_is_refused(mode):
    """Its gradient stays in .grad un-noised after each step (hooks: the un-clipped sum; ghost: the clipped
    sum without noise); a second optimizer applying it would write the released model between steps,
    which the write check allows.  Refused at make_private; parameter groups and frozen layers are fine."""

    def fresh():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))

    model = fresh()
    x, y = _data()
    kwargs = {
        "data_loader": DataLoader(TensorDataset(x, y), batch_size=N),
        "budgets": np.full(N, 1e3),
        "target_delta": 1e-5,
        "sample_rates": np.ones(N),
        "clip_norms": np.ones(N),
        "max_grad_norm": 1.0,
        "grad_sample_mode": mode,
        "privacy_filter": None,
        "noise_multiplier": 1.0,
    }
    engine = IndividualizedPrivacyEngine(seed=0)
    with pytest.raises(
        InvalidParameterError,
        match=r"leaves out the module's trainable parameter\(s\) '2.weight', "
        r"'2.bias'.*freeze them",
    ):
        engine.make_private_with_parameters(
            module=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.5), **kwargs
        )
    model = fresh()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}]
    IndividualizedPrivacyEngine(seed=0).make_private_with_parameters(
        module=model, optimizer=torch.optim.SGD(groups, lr=0.5), **kwargs
    )
    model = fresh()
    model[2].requires_grad_(False)
    IndividualizedPrivacyEngine(seed=0).make_private_with_parameters(
        module=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.5), **kwargs
    )


# --- writes in backward, in norm passes and around refused steps -------------------------------------------
class _WriteInBackward(torch.autograd.Function):
    """The identity, whose backward writes a buffer from the output gradient (i.e. from the batch)."""

    @staticmethod
    def forward(ctx, x, buf):
        ctx.buf = buf
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.buf.add_(g.abs().sum())
        return g, None


class _BackwardWrite(_NoGradWrite):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        return _WriteInBackward.apply(self.lin(x), self.seen)


@pytest.mark.parametrize("mode", MODES)
def test_a_write_in_the_backward_pass_is_refused(mode):
    """Ghost mode runs two backward passes, bk one: the write is found before the noise in each."""
    engine, *rest = _private(_model(_BackwardWrite), mode)
    with pytest.raises(UnnoisedWriteError, match=r"persistent buffer 'seen'.*The step was not taken"):
        _train(engine, *rest)
    assert engine.steps == 0


def test_a_write_in_forward_is_refused_by_the_individual_filters_norm_pass():
    for mode in ("hooks", "bk"):
        with pytest.raises(UnnoisedWriteError, match=r"persistent buffer 'count'.*norm pass was stopped"):
            _private(_model(_Counter), mode, privacy_filter="individual")


def test_the_fingerprint_is_read_twice_per_logical_step(monkeypatch):
    """With BatchMemoryManager (several forwards per logical step) the parameters are read for the value
    fingerprint once at the first forward and once before the noise, not per physical batch."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from idpsgd.engine.guards import integrity

    reads = []
    original = integrity._fingerprint
    monkeypatch.setattr(integrity, "_fingerprint", lambda *args: reads.append(1) or original(*args))
    forwards = []
    model = _model(nn.Linear, 4, 2)
    model.register_forward_pre_hook(lambda m, args: forwards.append(1))
    engine, module, optimizer, loss, loader = _private(model, "bk")
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as memory:
        _train(engine, module, optimizer, loss, memory, steps=2)
    assert engine.steps == 2 and len(forwards) >= 2 * 3 and len(reads) == 2 * 2


def _unfreeze_refused_step(engine, module, optimizer, loss, loader, model, *, write=False):
    """One step refused because a layer was unfrozen after make_private (in bk: by the book-keeper, before
    the guard), then the layer frozen again."""
    model[2].requires_grad_(True)
    hook = model.register_forward_hook(lambda m, args, out: m.seen.add_(1.0) and None) if write else None
    try:  # (the hook: a write in this step's forward)
        with pytest.raises((RuntimeError, ValueError)) as refusal:
            _train(engine, module, optimizer, loss, loader)
    finally:
        model[2].requires_grad_(False)
        if hook is not None:
            hook.remove()
    return refusal.value


def _frozen_head():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model[2].requires_grad_(False)
    model.register_buffer("seen", torch.zeros(()))
    return model


@pytest.mark.parametrize("mode", MODES)
def test_writes_between_steps_after_a_refused_step_are_allowed(mode):
    """Before, a step refused outside the guard left the previous snapshot in place: a projection after it
    was taken for a write in the next step, and the model was marked for good."""
    model = _frozen_head()
    engine, module, optimizer, loss, loader = _private(model, mode)
    _train(engine, module, optimizer, loss, loader)
    _unfreeze_refused_step(engine, module, optimizer, loss, loader, model)
    with torch.no_grad():
        model[0].weight.clamp_(-0.3, 0.3)
    _train(engine, module, optimizer, loss, loader)
    assert engine.steps == 2


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_write_in_a_step_refused_before_the_guard_is_still_found(mode):
    model = _frozen_head()
    engine, module, optimizer, loss, loader = _private(model, mode)
    _train(engine, module, optimizer, loss, loader)
    refusal = _unfreeze_refused_step(engine, module, optimizer, loss, loader, model, write=True)
    assert isinstance(refusal, UnnoisedWriteError) and "persistent buffer 'seen'" in str(refusal)
    with pytest.raises(UnnoisedWriteError, match="refused: earlier"):
        _train(engine, module, optimizer, loss, loader)
    assert engine.steps == 1


def test_writes_are_refused_in_expanded_weights_mode_and_its_norm_passes_run():
    """grad_sample_mode="ew" (PyTorch's ExpandedWeights; a no_grad in-place write to a parameter fails in
    PyTorch there).  Before, its norm passes (individual accounting, the individual filter) failed with
    AttributeError: the wrapper has no hooks to disable."""
    for cls, what in (
        (_DataWrite, "through .data"),
        (_Counter, "persistent buffer 'count'"),
        (_PreviousBatch, "non-persistent buffer 'prev'"),
        (_ExtraState, "extra state"),
    ):
        engine, *rest = _private(_model(cls), "ew")
        with pytest.raises(UnnoisedWriteError, match=what):
            _train(engine, *rest)
    for kwargs in ({"individual": True}, {"privacy_filter": "individual"}):
        engine, *rest = _private(_model(nn.Sequential, nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), "ew", **kwargs)
        _train(engine, *rest, steps=2)
        assert engine.steps == 2 and engine.per_example_grad_norms()[0].shape == (N,)


# --- writes the guard finds: pre-forward and hooks, optimizer state, data-dependent permutations --------------
ALL_MODES = (*MODES, "ew")


def _refused(engine, rest, what):
    noise = _noise_state(engine)
    with pytest.raises(UnnoisedWriteError, match=what + r".*The step was not taken"):
        _train(engine, *rest)
    assert torch.equal(_noise_state(engine), noise)  # no noise drawn
    with pytest.raises(UnnoisedWriteError, match="refused: earlier"):
        _train(engine, *rest)


class _Warm(nn.Module):
    """``warm(x)``, called by the loop before the forward, runs a submodule and writes a buffer from the batch."""

    def __init__(self):
        super().__init__()
        self.act = nn.Tanh()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("stat", torch.zeros(4))

    def warm(self, x):
        with torch.no_grad():
            self.stat.copy_(self.act(x).mean(0))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_write_before_the_root_forward_is_refused(mode):
    """The snapshot is taken at the first call of *any* of the model's modules (before: at the root
    module's first call, after the write)."""
    model = _model(_Warm)
    engine, module, optimizer, loss, loader = _private(model, mode)
    _train(engine, module, optimizer, loss, loader)  # a plain step

    def step(xb, yb):
        optimizer.zero_grad()
        model.warm(xb)  # as module._module.warm(xb)
        loss(module(xb), yb).backward()
        optimizer.step()

    what = r"persistent buffer 'stat' \(module '\(root\)', _Warm\) was written in place"
    with pytest.raises(UnnoisedWriteError, match=what + r".*The step was not taken"):
        step(*next(iter(loader)))
    assert engine.steps == 1


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("registered", ["before", "after"])
def test_a_global_forward_pre_hook_that_writes_a_parameter_is_refused(mode, registered):
    """``register_module_forward_pre_hook``: global hooks run before every module's own hooks; the
    snapshot's hook is kept first of the global ones."""
    model = _model(nn.Linear, 4, 2)

    weight = model.weight  # (in ew mode the module holds an ExpandedWeight around it during the forward)

    def write(module, args):
        if module is model:
            with torch.no_grad():
                weight.add_(1e-3 * args[0].mean())

    handle = None
    try:
        if registered == "before":
            handle = torch.nn.modules.module.register_module_forward_pre_hook(write)
        engine, *rest = _private(model, mode)
        if registered == "after":
            handle = torch.nn.modules.module.register_module_forward_pre_hook(write)
        _refused(engine, rest, r"parameter 'weight' \(module '\(root\)', Linear\) was written in place")
    finally:
        handle.remove()
    assert engine.steps == 0


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_forward_pre_hook_on_the_module_make_private_returns_is_refused(mode):
    """The wrapper ``make_private`` returns runs its own hooks before the model's root module is called."""
    model = nn.Sequential(_model(nn.Linear, 4, 2))
    model.register_buffer("seen", torch.zeros(4))
    engine, module, *rest = _private(model, mode)

    def record(_wrapper, args):
        model.seen.add_(args[0].detach().mean(0))

    module.register_forward_pre_hook(record)
    what = r"persistent buffer 'seen' \(module '\(root\)', Sequential\) was written in place"
    _refused(engine, [module, *rest], what)


class _OptimizerWrite(_NoGradWrite):
    """A forward that writes the optimizer's state from the batch (released with the model in checkpoints)."""

    how = "in place"
    optimizer = None

    def forward(self, x):
        if self.optimizer is not None and self.optimizer.state:
            state = self.optimizer.state[self.optimizer.param_groups[0]["params"][0]]  # lin.weight (also in ew)
            buf = state["momentum_buffer"] if "momentum_buffer" in state else state["exp_avg"]
            if self.how == "in place":
                buf.add_(x.mean())
            elif self.how == ".data":
                buf.data[0, 0] += 1e-3 * (x[0, 0] > -10).float()  # from the batch, no host read
            else:  # a new entry
                state["seen"] = x.detach().mean()
        return self.lin(x)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize(
    ("opt", "how", "what"),
    [
        (
            "sgd",
            "in place",
            r"optimizer state 'momentum_buffer' of parameter 'lin.weight' \(SGD\) was written in place",
        ),
        ("adam", ".data", r"optimizer state 'exp_avg' of parameter 'lin.weight' \(Adam\) had its values changed"),
        ("adam", "new", r"optimizer state 'seen' of parameter 'lin.weight' \(Adam\) appeared"),
    ],
)
def test_a_write_to_the_optimizer_state_is_refused(mode, opt, how, what):
    model = _model(_OptimizerWrite)
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if opt == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.1)
    )
    engine, *rest = _private(model, mode, optimizer=optimizer)
    model.optimizer, model.how = optimizer, how
    _train(engine, *rest)  # the first step creates the state
    _refused(engine, rest, what)  # the second's forward writes it
    assert engine.steps == 1


class _OneUlp(nn.Module):
    """A forward that moves one entry of an optimizer state (Adam's ``exp_avg_sq``) or of a buffer by one unit in
    the last place, through ``.data`` (no version counter sees it), when the batch says so (kept a tensor)."""

    def __init__(self, where):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("scale", torch.full((3, 5), 0.3))
        self.where, self.optimizer = where, None

    def forward(self, x):
        if self.where == "buffer":
            target = self.scale.data
        elif self.optimizer is not None and self.optimizer.state:
            target = self.optimizer.state[self.optimizer.param_groups[0]["params"][0]]["exp_avg_sq"].data  # lin.weight
        else:
            target = None
        if target is not None:
            flat = target.view(-1)
            flat[1] = torch.where(x[0, 0] > -10, torch.nextafter(flat[1], flat[1] + 1), flat[1])
        return self.lin(x)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize(
    ("where", "what"),
    [
        ("optimizer", r"optimizer state 'exp_avg_sq' of parameter 'lin.weight' \(Adam\) had its values changed"),
        ("buffer", r"persistent buffer 'scale' \(module '\(root\)', _OneUlp\) had its values changed through .data"),
    ],
)
def test_a_one_ulp_write_through_data_is_refused(mode, where, what):
    model = _model(_OneUlp, where)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    engine, *rest = _private(model, mode, optimizer=optimizer)
    model.optimizer = optimizer
    if where == "optimizer":
        _train(engine, *rest)  # the first step creates the state
    _refused(engine, rest, what)


def test_the_optimizer_state_may_change_between_steps():
    """``optimizer.step()`` and writes between steps (loading an optimizer checkpoint) are allowed."""
    model = _model(nn.Linear, 4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    engine, *rest = _private(model, "bk", optimizer=optimizer)
    _train(engine, *rest)
    saved = copy.deepcopy(optimizer.state_dict())
    _train(engine, *rest, between=lambda: optimizer.load_state_dict(saved))
    assert engine.steps == 2


class _Swap(nn.Module):
    """Data-dependent writes through ``.data`` that the bit-pattern sum missed: a swap of two rows of a
    table, or the sign flips of a positive and a negative entry."""

    def __init__(self, how):
        super().__init__()
        self.table = nn.Embedding(6, 4).requires_grad_(False)  # e.g. a frozen table (released all the same)
        self.lin = nn.Linear(4, 2)
        self.how = how
        flat = self.table.weight.detach().reshape(-1)
        self.pair = [int(torch.nonzero(flat > 0)[0]), int(torch.nonzero(flat < 0)[0])]

    def forward(self, x):
        w, go = self.table.weight.data, x[0, 0] > -10  # "from the batch", kept a tensor (no host read)
        if self.how == "rows":
            w[[0, 1]] = torch.where(go, w[[1, 0]], w[[0, 1]])
        else:
            w.view(-1)[self.pair] *= torch.where(go, -1.0, 1.0)
        return self.lin(x)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("how", ["rows", "signs"])
def test_permutations_and_paired_sign_flips_through_data_are_refused(mode, how):
    engine, *rest = _private(_model(_Swap, how), mode)
    _refused(
        engine, rest, r"parameter 'table.weight' \(module 'table', Embedding\) had its values changed through .data"
    )
    with pytest.raises(UnnoisedWriteError, match="'table.weight'.*norm pass was stopped"):
        per_example_grad_norms(_model(_Swap, how), [_data()])


def _python_block_sums(tensors):
    """The block sums with Python integers: Σ_k u_k·b_k over each block of 1024 bit patterns of each tensor, the
    last block of each padded with zeros."""
    from idpsgd.engine.guards import fingerprint

    inner = [int(u) for u in fingerprint._inner(torch.device("cpu")).tolist()]
    widths = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int32}  # 8-byte entries as pairs of int32
    out = []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        bits = np.frombuffer(raw, dtype=widths[t.element_size()]).tolist()
        for start in range(0, len(bits), 1024):
            out.append(sum(u * b for u, b in zip(inner, bits[start : start + 1024], strict=False)))
    return out


def test_the_fingerprint_is_exact_and_position_weighted():
    """The block sums are Σ u_k·b_k exactly (checked with Python integers), for tensors larger than a chunk of the
    staging buffer and small ones packed together; every row swap, paired sign flip or one-bit change of one entry
    is found and names its tensor."""
    from idpsgd.engine.guards import fingerprint

    g = torch.Generator().manual_seed(0)
    span = fingerprint._ROWS["cpu"] * 1024
    tensors = [torch.randn(n, generator=g) for n in (span + 5, 3, span - 2000, 2000, 1024, span)]
    sums, starts = fingerprint.block_sums(tensors)
    assert sums.tolist() == _python_block_sums(tensors)
    assert starts == [
        0,
        span // 1024 + 1,
        span // 1024 + 2,
        2 * (span // 1024) + 1,
        2 * (span // 1024) + 3,
        2 * (span // 1024) + 4,
    ]
    for rows in (5, 2 * span // 64 + 3):  # packed with others; across chunks of the staging buffer
        table = torch.randn(rows, 64, generator=g)
        others = [torch.randn(7, generator=g), table, torch.randn(3000, generator=g)]
        before = fingerprint.Fingerprint.take(others)

        def changed(t, before=before, others=others):
            return before.changed(fingerprint.Fingerprint.take([others[0], t, others[2]]))

        for _ in range(10):
            i, j = torch.randperm(rows, generator=g)[:2].tolist()
            swapped = table.clone()
            swapped[[i, j]] = swapped[[j, i]]
            assert changed(swapped) == [1]
            flat = table.clone().view(-1)
            pos, neg = torch.nonzero(flat > 0).flatten(), torch.nonzero(flat < 0).flatten()
            k = int(torch.randint(0, min(len(pos), len(neg)), (1,), generator=g))
            flat[torch.stack([pos[k], neg[k]])] *= -1
            assert changed(flat.view_as(table)) == [1]
        flat = table.clone().view(-1)
        flat.view(torch.int32)[-1] ^= 1  # the last bit of the last entry
        assert changed(flat.view_as(table)) == [1]
        assert changed(table.clone()) == []
    # entries of every width packed into one chunk (on a CPU through the int32 staging: widened exactly), negative
    # bit patterns included
    mixed = [
        torch.randn(10, generator=g, dtype=torch.float64),
        torch.randn(1500, generator=g).to(torch.bfloat16),
        torch.randint(-128, 128, (7,), generator=g, dtype=torch.int8),
        torch.rand(9, generator=g) > 0.5,
        torch.randn(3, generator=g, dtype=torch.complex64),
        torch.randn(2, 5, generator=g).to(torch.float16),
        torch.tensor(3.0),
    ]
    sums, starts = fingerprint.block_sums(mixed)
    assert sums.tolist() == _python_block_sums(mixed)
    assert starts == [0, 1, 3, 4, 5, 6, 7]


def test_a_reused_fingerprint_layout_reads_the_tensors_of_now():
    """A fingerprint taken ``like`` an earlier one reuses its way of reading the tensors (bit views, chunk packing)
    only while every tensor's geometry is unchanged: a one-bit write through ``.data`` is still found; a storage
    swapped in (``p.data = ...``, between steps: allowed) is read, not the old storage the cached view holds, and a
    later write to the new storage is found; a non-contiguous tensor (its bits are a copy) is never cached."""
    from idpsgd.engine.guards import fingerprint

    g = torch.Generator().manual_seed(0)
    span = fingerprint._ROWS["cpu"] * 1024
    p = nn.Parameter(torch.randn(span + 7, generator=g))
    tensors = [torch.randn(5, generator=g), p, torch.randn(3, 300, generator=g)]
    first = fingerprint.Fingerprint.take(tensors)
    again = fingerprint.Fingerprint.take(tensors, like=first)
    assert again.layouts is first.layouts and first.changed(again) == []
    p.data.view(torch.int32)[span + 3] ^= 1  # one bit, in the second chunk
    written = fingerprint.Fingerprint.take(tensors, like=again)
    assert written.layouts is first.layouts and again.changed(written) == [1]
    assert written.groups[p.device][1].tolist() == _python_block_sums(tensors)
    p.data = p.data.clone()  # a new storage, the same values: read anew
    swapped = fingerprint.Fingerprint.take(tensors, like=written)
    assert swapped.layouts is not written.layouts and written.changed(swapped) == []
    p.data.view(torch.int32)[0] ^= 1
    assert swapped.changed(fingerprint.Fingerprint.take(tensors, like=swapped)) == [1]
    columns = torch.randn(300, 3, generator=g).t()  # not contiguous
    strided = fingerprint.Fingerprint.take([columns])
    assert strided.layouts == {} and strided.geometry is None
    columns[0, 0] = columns[0, 0].item() + 1.0
    assert strided.changed(fingerprint.Fingerprint.take([columns], like=strided)) == [0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fingerprint_on_cuda_is_the_cpus_and_finds_a_one_ulp_write():
    """On the tensors' device: the same block sums as on the CPU (exact in any reduction order), across chunks of
    the accelerator's staging buffer, and a one-ulp change names its tensor; CPU tensors (Adam's ``step``) beside."""
    from idpsgd.engine.guards import fingerprint

    g = torch.Generator().manual_seed(0)
    span = fingerprint._ACCELERATOR_ROWS * 1024
    cpu = [torch.randn(n, generator=g) for n in (3, span + 1500, 1024, 70)]
    cuda = [t.cuda() for t in cpu]
    assert torch.equal(fingerprint.block_sums(cuda)[0].cpu(), fingerprint.block_sums(cpu)[0])
    tensors = [*cuda, torch.tensor(5.0)]
    before = fingerprint.Fingerprint.take(tensors)
    assert before.changed(fingerprint.Fingerprint.take(tensors)) == []
    moved = cuda[1].clone()
    moved[span + 7] = torch.nextafter(moved[span + 7], moved[span + 7] + 1)
    assert before.changed(fingerprint.Fingerprint.take([cuda[0], moved, *tensors[2:]])) == [1]


def test_a_no_grad_forward_before_the_step_and_other_models_leave_the_guard_alone():
    """An evaluation forward under no_grad between steps (the snapshot is then taken there) and forwards of
    other models while the guard waits are fine; the global hook is gone once no guard waits."""
    from idpsgd.engine.guards import integrity

    model = _model(nn.Linear, 4, 2)
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    other.register_buffer("calls", torch.zeros(()))
    other.register_forward_hook(lambda m, a, o: m.calls.add_(1) and None)  # another model's own writes
    engine, *rest = _private(model, "bk")

    def between():
        with torch.no_grad():
            model(_data()[0])
            other(_data()[0])

    _train(engine, *rest, steps=3, between=between)
    _train(engine, *rest)
    assert engine.steps == 4 and float(other.calls) == 3
    guard = model.__dict__["_idpsgd_write_guard"]
    assert guard._armed and integrity._HOOK and _waits(guard._ref)  # for the next step's first call
    other(_data()[0])
    assert guard._armed and float(other.calls) == 4
    model(_data()[0])
    assert not guard._armed and not _waits(guard._ref)


def _waits(ref) -> bool:
    from idpsgd.engine.guards import integrity

    return any(r is ref for refs in integrity._WAITING.values() for r in refs)


def test_an_armed_guard_does_not_keep_its_model_or_the_global_hook_alive():
    import gc
    import weakref

    from idpsgd.engine.guards import integrity

    model = _model(nn.Linear, 4, 2)
    engine, *rest = _private(model, "hooks")
    _train(engine, *rest)
    guard = model.__dict__["_idpsgd_write_guard"]._ref
    assert integrity._HOOK and _waits(guard)  # armed for a next step that never comes
    ref = weakref.ref(model)
    del model, engine, rest
    gc.collect()
    assert ref() is None and not _waits(guard)
    nn.Linear(2, 2)(torch.zeros(1, 2))  # the idle hook removes itself at its next call, not inside the collection
    if not integrity._WAITING:  # no other test's model waits either: the global hook is gone
        assert not integrity._HOOK


def test_a_guard_collected_during_an_iteration_of_the_global_hooks_does_not_break_it():
    """A guard's finaliser runs at a garbage collection, which can come while code iterates torch's global forward
    pre-hooks (book-keeping's replay signature reads them at every forward): it must not remove the hook there
    ("OrderedDict mutated during iteration", seen in the suite); the idle hook removes itself at its next call."""
    import gc

    from idpsgd.engine.guards import integrity
    from idpsgd.engine.guards.integrity import WriteGuard

    model = nn.Linear(2, 2)
    WriteGuard.attach(model).arm()
    extra = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        walk = iter(torch.nn.modules.module._global_forward_pre_hooks)
        next(walk)
        del model.__dict__["_idpsgd_write_guard"]
        gc.collect()
        list(walk)  # raised before
    finally:
        extra.remove()
    nn.Linear(2, 2)(torch.zeros(1, 2))
    if not integrity._WAITING:  # no other test's guard waits: the idle hook is gone after its call
        assert not integrity._HOOK
