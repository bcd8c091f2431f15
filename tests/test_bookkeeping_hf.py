"""Book-keeping on tiny Hugging Face models built from configs (no download), in float64: GPT-2 (tied
wte/lm_head, position embeddings of batch 1), BERT (position embeddings of batch 1), Llama with
tied embeddings, and ViT (class token and position embedding used in forward).

Per-example norms and clipped sums equal per-example autograd; Scale training with per-example
budgets runs in bk mode and each step equals Opacus's hooks and functorch modes (for GPT-2 and
BERT, whose batch-1 position ids Opacus cannot handle, those get the ids expanded to the batch —
the same model)."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")

import hf_architectures as hf
from idpsgd import Budgets, IndividualizedPrivacyEngine
from idpsgd.engine.per_example.bk.keeper import BookKeeper
from idpsgd.engine.per_example.bk.units import DIRECT, FALLBACK
from support import per_example_grads

N, B, T, V = 16, 8, 9, hf.V


def _gpt2():
    return hf.tiny_model("gpt2")


def _bert():
    return hf.tiny_model("bert")


def _llama():  # tied embeddings, two key-value heads
    return hf.tiny_model("llama", num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=True)


def _vit():  # 16 × 16 images: 16 patches and the class token
    return hf.tiny_model("vit", image_size=16)


MODELS = {"gpt2": (_gpt2, "lm"), "bert": (_bert, "cls"), "llama_tied": (_llama, "lm"), "vit": (_vit, "image")}


def _build(name):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return MODELS[name][0]().double().train()


def _data(kind):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (N, T), generator=g)
    labels = torch.randint(0, 3, (N,), generator=g)
    if kind == "lm":
        return ids, ids
    if kind == "cls":
        return ids, labels
    return torch.randn((N, 3, 16, 16), generator=g, dtype=torch.float64), labels


def _per_example_loss(model, kind, x, y, expand_positions=False):
    """One loss per example: the mean next-token loss (language models) or the cross-entropy."""
    if kind == "image":
        return nn.functional.cross_entropy(model(pixel_values=x).logits, y, reduction="none")
    extra = {"position_ids": torch.arange(x.shape[1]).expand(x.shape[0], -1)} if expand_positions else {}
    logits = model(input_ids=x, **extra).logits
    if kind == "cls":
        return nn.functional.cross_entropy(logits, y, reduction="none")
    tokens = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="none")
    return tokens.view(x.shape[0], -1).mean(1)


@pytest.mark.parametrize("name", list(MODELS))
def test_per_example_norms_and_clipped_sums_equal_autograd(name):
    model = _build(name)
    kind = MODELS[name][1]
    x, y = _data(kind)
    x, y = x[:6], y[:6]
    ref = copy.deepcopy(model)
    grads = per_example_grads(
        ref, x, y, lambda m, xi, yi: _per_example_loss(m, kind, xi, yi).sum(), list(ref.parameters())
    )
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    _per_example_loss(model, kind, x, y).sum().backward()
    norms = keeper.norms()
    torch.testing.assert_close(norms, grads.norm(dim=1), rtol=1e-10, atol=1e-12)
    w = torch.linspace(0.2, 1.0, len(x), dtype=torch.float64)
    sums = keeper.clipped_sum(w)
    flat = torch.cat([sums.get(p, torch.zeros_like(p)).reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(flat, (w[:, None] * grads).sum(0), rtol=1e-10, atol=1e-12)
    covered = [p for layer in keeper.layers for p in layer.params.values()]
    covered += [p for unit in keeper.direct for p in unit.params.values()]
    # autograd formed no summed gradient for them (the GradScaler marker holds zeros: BookKeeper.mark_for_grad_scaler)
    assert covered and all(p.grad is None or (p is keeper._marker and not p.grad.any()) for p in covered)


@pytest.mark.parametrize("name", list(MODELS))
def test_layer_paths(name):
    model = _build(name)
    keeper = BookKeeper.attach(model)
    paths = keeper.paths
    fallback = {n for n, path in paths.items() if path == FALLBACK}
    assert not fallback, fallback  # every layer of the four models on a book-keeping rule (issue 30)
    if name in ("gpt2", "llama_tied"):
        embeddings = "transformer.wte" if name == "gpt2" else "model.embed_tokens"
        assert f"tied with {embeddings!r}" in paths["lm_head"] and "cross term" not in paths["lm_head"]
    if name == "vit":
        assert paths["vit.embeddings"] == DIRECT


def _train(model, kind, mode, *, expand_positions=False, steps=2):
    """Scale with per-example budgets (ε = 1 and 8), Poisson batches; the parameters after ``steps`` steps."""
    model = copy.deepcopy(model)
    x, y = _data(kind)
    budgets = Budgets.from_array(np.where(np.arange(N) % 2 == 0, 1.0, 8.0), 1e-5)
    engine = IndividualizedPrivacyEngine(accountant="rdp", seed=3)
    module, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        budgets=budgets,
        method="scale",
        steps=steps,
        grad_sample_mode=mode,
    )
    for step, (xb, yb) in enumerate(loader):
        optimizer.zero_grad()
        _per_example_loss(module, kind, xb, yb, expand_positions=expand_positions).mean().backward()
        optimizer.step()
        if step + 1 == steps:
            break
    assert engine.steps == steps
    return [p.detach().clone() for p in model.parameters()], engine


@pytest.mark.parametrize("name", list(MODELS))
def test_scale_training_with_budgets_equals_hooks_and_functorch(name):
    model = _build(name)
    kind = MODELS[name][1]
    after, engine = _train(model, kind, "bk")
    if name in ("gpt2", "llama_tied"):  # the rule is public, how the cross term was computed private
        assert "cross term: ghost" in engine.layer_paths_taken["lm_head"]
        assert "cross term" not in engine.layer_paths["lm_head"]
    eps = engine.get_epsilon()  # each group within its budget, ε = 1 below ε = 8
    assert list(eps.budgets) == [1.0, 8.0] and 0 < eps.per_group[0] < eps.per_group[1] == eps
    assert np.all(eps.per_group <= eps.budgets)
    before = [p.detach() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    for mode in ("hooks", "functorch"):
        ref, _ = _train(model, kind, mode, expand_positions=kind != "image")
        for a, b in zip(after, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_autocast_norms_and_scale_step(name):
    """Under bf16 autocast (CPU) the four models' per-example norms — the tied cross terms, batch-1
    inputs and direct parameters included — are within bf16 rounding of float32 autograd, and a Scale
    step with per-example budgets runs in bk and keeps every group within its budget."""
    model = _build(name).float()
    kind = MODELS[name][1]
    x, y = _data(kind)
    x, y = x[:6], (y[:6].float() if kind == "image" else y[:6])
    if kind == "image":
        x = x.float()
    ref = copy.deepcopy(model)
    y_ref = y.long() if kind == "image" else y
    loss = lambda m, xi, yi: _per_example_loss(m, kind, xi, yi).sum()  # noqa: E731
    expected = per_example_grads(ref, x, y_ref, loss, list(ref.parameters())).norm(dim=1)
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _per_example_loss(model, kind, x, y.long() if kind == "image" else y).sum()
    loss.backward()
    norms = keeper.norms()
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, expected, rtol=3e-2, atol=1e-4)
    keeper.clear()
    keeper.active = False
    budgets = Budgets.from_array(np.where(np.arange(N) % 2 == 0, 1.0, 8.0), 1e-5)
    xs, ys = _data(kind)
    if kind == "image":
        xs = xs.float()
    engine = IndividualizedPrivacyEngine(seed=3, accountant="rdp")  # not about the accountant: no PRV calibration
    module, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(xs, ys), batch_size=B),
        budgets=budgets,
        method="scale",
        steps=1,
        grad_sample_mode="bk",
    )
    for xb, yb in loader:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _per_example_loss(module, kind, xb, yb).mean()
        loss.backward()
        optimizer.step()
        break
    assert engine.steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    eps = engine.get_epsilon()
    assert np.all(eps.per_group <= eps.budgets)


@pytest.mark.parametrize("name", list(MODELS))
def test_no_shared_value_leaves_the_models_forward(name):
    """The batch-independent values book-keeping tracks (SharedTensor) stay inside the forward: outputs,
    hidden states, attentions and the key/value cache are plain tensors."""
    from idpsgd.engine.per_example.bk.shared import SharedTensor

    def tensors(obj, seen):
        if isinstance(obj, torch.Tensor):
            seen.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                tensors(item, seen)
        elif isinstance(obj, dict):
            for item in obj.values():
                tensors(item, seen)
        elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
            tensors(vars(obj), seen)
        return seen

    model = _build(name)
    BookKeeper.attach(model).active = True
    kind = MODELS[name][1]
    x, _ = _data(kind)
    extra = {"pixel_values": x} if kind == "image" else {"input_ids": x}
    if kind == "lm":
        extra["use_cache"] = True
    out = model(**extra, output_hidden_states=True, output_attentions=True)
    found = tensors(out.to_tuple(), [])
    assert len(found) > 3 and not any(isinstance(t, SharedTensor) for t in found)
