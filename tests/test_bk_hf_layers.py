"""Book-keeping on the layers of Hugging Face models, mixed precision, and frozen weights (issue 30, items 3-5).

* Rules for transformers' ``Conv1D`` (GPT-2) and the weight-only normalisations (``nn.RMSNorm``,
  ``LlamaRMSNorm`` and its copies, ``T5LayerNorm``, ``GemmaRMSNorm``, GPT-OSS's scale-then-cast form):
  in float64, per-example norms and clipped sums equal an example-by-example backward pass, one
  engine step equals hooks mode, and the book-kept forward is the module's, bit for bit.
* GPT-2, BERT, Llama and ViT built from tiny configs: no layer on the fallback except ViT's
  embeddings (parameters used directly in forward: another rule's job), and the per-example norms of
  the whole models equal per-example autograd.
* bf16 / fp16 autocast: outputs and input gradients are the module's under autocast, norms within
  half-precision tolerance of float32, a step close to the float32 step; a ``GradScaler`` changes no
  clipping decision; overflowed examples are left out, nothing else changes; refusals.
* LoRA (peft) and frozen bases: only trainable parameters are covered, frozen weights get no
  weight-gradient computation, and GPT-2 + LoRA trains with per-example budgets (Scale).
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from idpsgd.engine import IndividualizedPrivacyEngine
from idpsgd.engine.per_example.bk.keeper import BookKeeper
from idpsgd.engine.per_example.bk.plan import plan_layers
from idpsgd.engine.per_example.bk.rules import Conv1DRule, ScaleNormRule, rule_for
from idpsgd.engine.per_example.bk.units import FALLBACK, GHOST, PER_SAMPLE

transformers = pytest.importorskip("transformers")
import hf_architectures as hf
from support import per_example_grads
from test_bookkeeping import N, _check_equal, _data  # the float64 harness of the other rules

B = 6  # examples of the whole-model checks
T = 5  # their sequence length


def _low_precision_supported(dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
        return True
    except (RuntimeError, AssertionError):
        return False


HALF = [
    pytest.param(d, marks=pytest.mark.skipif(not _low_precision_supported(d), reason=f"no CPU autocast for {d}"))
    for d in (torch.bfloat16, torch.float16)
]


# --- the forms of the layers, from transformers itself ------------------------------------------
def _norm_classes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {
        "llama": LlamaRMSNorm,
        "mistral": MistralRMSNorm,
        "qwen2": Qwen2RMSNorm,
        "gpt_oss": GptOssRMSNorm,
        "t5": T5LayerNorm,
        "gemma": GemmaRMSNorm,
    }


def _norm(kind, dim=6):
    if kind == "torch":
        layer = nn.RMSNorm(dim, eps=1e-5)
    elif kind == "torch_2d":
        layer = nn.RMSNorm([3, dim])
    else:
        layer = _norm_classes()[kind](dim, eps=1e-5)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)  # non-trivial scales (Gemma: 1 + w)
    return layer


def _conv1d(nf, nx):
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(nf, nx)
    with torch.no_grad():
        layer.bias.uniform_(-0.5, 0.5)
    return layer


@pytest.mark.parametrize(("seq", "hidden", "expect"), [((), 9, GHOST), ((7,), 4, PER_SAMPLE), ((2,), 30, GHOST)])
def test_conv1d_rule(seq, hidden, expect):
    """GPT-2's Conv1D (a Linear with a transposed weight): ghost norm or per-sample gradient by shape."""
    torch.manual_seed(0)
    model = nn.Sequential(
        _conv1d(hidden, 5), nn.Tanh(), nn.Flatten(), nn.Linear(hidden * int(np.prod(seq)), 3)
    ).double()
    assert isinstance(rule_for(model[0]), Conv1DRule)
    paths = _check_equal(model, *_data((*seq, 5)))
    assert paths["0"] == expect


@pytest.mark.parametrize("kind", ["torch", "torch_2d", "llama", "mistral", "qwen2", "gpt_oss", "t5", "gemma"])
def test_weight_only_norm_rules(kind):
    """RMSNorm forms: exact per-example norms and clipped sums in float64, and one step equal to hooks."""
    torch.manual_seed(0)
    norm = _norm(kind)
    assert isinstance(rule_for(norm), ScaleNormRule)
    shape = (3, 5) if kind == "torch_2d" else (4, 5)
    model = nn.Sequential(nn.Linear(5, 6), norm, nn.Tanh(), nn.Flatten(), nn.Linear(int(np.prod(shape[:-1])) * 6, 3))
    model = model.double()
    # "sum" reduction: these forms compute in float32 inside, where a "mean" loss's 1/B output gradients
    # round differently from the per-example reference's (plain training rounds the same way as bk)
    paths = _check_equal(model, *_data(shape), reduction="sum")
    assert paths["1"] == PER_SAMPLE


class _NotLlama(nn.Module):
    """Looks like LlamaRMSNorm (same attributes, same name pattern) but computes (1 + w) · x / rms(x)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (1 + self.weight) * hidden_states.to(input_dtype)


def test_layers_are_matched_by_what_they_compute_not_by_name():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class RenamedLlamaRMSNorm(LlamaRMSNorm):  # same forward under another name: covered
        pass

    class LlamaRMSNormVariant(LlamaRMSNorm):  # Llama's name, another forward: not covered
        forward = _NotLlama.forward

    assert isinstance(rule_for(RenamedLlamaRMSNorm(4)), ScaleNormRule)
    assert rule_for(LlamaRMSNormVariant(4)) is None and rule_for(_NotLlama(4)) is None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), _NotLlama(6), nn.Tanh(), nn.Flatten(), nn.Linear(24, 3)).double()
    paths = _check_equal(model, *_data((4, 5)), reduction="sum")  # the fallback (Opacus's functorch) is exact too
    assert paths["1"] == FALLBACK


def _modules_under_test():
    return [
        _conv1d(7, 6),
        _norm("llama"),
        _norm("gpt_oss"),
        _norm("t5"),
        _norm("gemma"),
        _norm("torch"),
        nn.Linear(6, 6),
        nn.LayerNorm(6),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_book_kept_forward_and_input_gradient_are_the_modules(dtype):
    """Bit for bit: the output and the input gradient of every new rule equal the plain module's."""
    torch.manual_seed(0)
    for layer in _modules_under_test():
        layer = layer.to(dtype)
        x = torch.randn(3, 4, 6, dtype=dtype)
        g = torch.randn_like(layer(x))
        plain = copy.deepcopy(layer)
        x1 = x.clone().requires_grad_(True)
        out1 = plain(x1)
        out1.backward(g)
        keeper = BookKeeper.attach(layer)
        keeper.active = True
        x2 = x.clone().requires_grad_(True)
        out2 = layer(x2)
        out2.backward(g)
        assert keeper.paths and FALLBACK not in keeper.paths.values(), type(layer).__name__
        assert out2.dtype == out1.dtype and torch.equal(out2, out1), type(layer).__name__
        assert torch.equal(x2.grad, x1.grad), type(layer).__name__
        keeper.detach()


# --- whole Hugging Face models ------------------------------------------------------------------
def _gpt2():
    return hf.tiny_model("gpt2", vocab_size=40, n_positions=16, n_embd=16, tie_word_embeddings=False)


def _llama():
    return hf.tiny_model(
        "llama",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        max_position_embeddings=16,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def _bert():
    return hf.tiny_model(
        "bert", vocab_size=40, hidden_size=16, num_hidden_layers=1, intermediate_size=24, max_position_embeddings=16
    )


def _vit():
    return hf.tiny_model("vit", hidden_size=16, num_hidden_layers=1, intermediate_size=24)


def _batch(kind, n=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "vit":
        return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g)}, torch.randint(0, 3, (n,), generator=g)
    ids = torch.randint(1, 40, (n, T), generator=g)
    # explicit per-example positions: the models' default (1, T) positions broadcast over the batch
    inputs = {"input_ids": ids, "position_ids": torch.arange(T).expand(n, T)}
    if kind == "bert":
        inputs["token_type_ids"] = torch.zeros_like(ids)
        return inputs, torch.randint(0, 3, (n,), generator=g)
    return inputs, ids


def _per_example_loss(model, inputs, targets):
    logits = model(**inputs).logits
    if logits.dim() == 3:  # a language model: next-token loss, averaged over each example's tokens
        return nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets[:, 1:], reduction="none").mean(1)
    return nn.functional.cross_entropy(logits, targets, reduction="none")


def _slice(inputs, i):
    return {k: v[i : i + 1] for k, v in inputs.items()}


MODELS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit}


@pytest.mark.parametrize("kind", list(MODELS))
def test_hf_models_have_no_fallback_layer_here(kind):
    """Every layer of the four models on a rule (ViT's embeddings: a direct unit, its class token and
    position embedding used directly in forward), none on Opacus's fallback."""
    torch.manual_seed(0)
    fallbacks = [name for name, _, rule in plan_layers(MODELS[kind]()) if rule is None]
    assert fallbacks == [], fallbacks


@pytest.mark.parametrize("kind", list(MODELS))
def test_hf_model_per_example_norms_and_clipped_sum_equal_autograd(kind):
    """Float64, whole models: the book-keeper's per-example norms and clipped sum equal an
    example-by-example backward pass."""
    torch.manual_seed(0)
    model = MODELS[kind]().double().train()
    inputs, targets = _batch(kind)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(B):
        model.zero_grad()
        _per_example_loss(model, _slice(inputs, i), targets[i : i + 1]).sum().backward()
        rows.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]))
    grads = torch.stack(rows)
    model.zero_grad()
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    _per_example_loss(model, inputs, targets).sum().backward()
    norms = keeper.norms()
    torch.testing.assert_close(norms, grads.norm(dim=1), rtol=1e-9, atol=1e-12)
    factors = (0.5 * grads.norm(dim=1).mean() / (norms + 1e-6)).clamp(max=1.0)  # about half clipped
    sums = keeper.clipped_sum(factors)
    flat = torch.cat([sums.get(p, torch.zeros_like(p)).reshape(-1) for p in params])
    torch.testing.assert_close(flat, (factors[:, None] * grads).sum(0), rtol=1e-9, atol=1e-12)


# --- mixed precision ----------------------------------------------------------------------------
class _Tokens(nn.Module):
    """Embedding, GPT-2's Conv1D, LlamaRMSNorm, LayerNorm, Linear, GemmaRMSNorm: the layer types of the models."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.c1 = _conv1d(12, 8)
        self.rms = _norm("llama", 12)
        self.ln = nn.LayerNorm(12)
        self.lin = nn.Linear(12, 12)
        self.gemma = _norm("gemma", 12)
        self.head = nn.Linear(12, 3)

    def forward(self, ids):
        h = self.rms(self.c1(self.emb(ids)))
        return self.head(self.gemma(torch.tanh(self.lin(self.ln(h)))).mean(1))


class _Image(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 4, 3, stride=2)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.head = nn.Linear(36, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inorm(self.conv2(torch.relu(self.gn(self.conv(x)))))).flatten(1))


def _tokens():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Tokens(), torch.randint(0, 20, (N, 7), generator=g), torch.randint(0, 3, (N,), generator=g)


def _image():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Image(), torch.randn(N, 3, 8, 8, generator=g), torch.randint(0, 3, (N,), generator=g)


TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative, per-example norms vs float32


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("make", [_tokens, _image])
def test_autocast_book_keeping_is_the_module_under_autocast(make, dtype):
    """Under autocast the book-kept model's loss and input gradient are the plain model's, bit for bit;
    per-example norms (float32) are within half-precision tolerance of float32 autograd, and the
    un-clipped sum is autocast's own summed gradient up to half-precision rounding (autocast's
    gradient itself may be further from float32's: 4 % on the first convolution of _Image in bf16)."""
    model, x, y = make()
    ref = per_example_grads(model, x, y).norm(dim=1)
    losses, input_grads = [], []
    for book_kept in (False, True):
        m = copy.deepcopy(model)
        if book_kept:
            keeper = BookKeeper.attach(m)
            keeper.active, keeper.loss_reduction = True, "sum"
        xi = x.clone().requires_grad_(True) if x.is_floating_point() else x
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(m(xi), y, reduction="sum")
        loss.backward()
        losses.append(loss)
        input_grads.append(xi.grad if x.is_floating_point() else None)
        if not book_kept:
            amp_grad = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    assert torch.equal(losses[0], losses[1])
    if x.is_floating_point():
        assert torch.equal(input_grads[0], input_grads[1])
    assert FALLBACK not in keeper.paths.values()
    norms = keeper.norms()
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, ref, rtol=TOL[dtype], atol=0)
    sums = keeper.clipped_sum(torch.ones_like(norms))
    assert all(v.dtype == torch.float32 for v in sums.values())
    flat = torch.cat([sums[p].reshape(-1) for p in m.parameters()])
    assert (flat - amp_grad).norm() <= TOL[dtype] * amp_grad.norm()


def _run(model, x, y, mode, *, dtype=None, scaler=None, steps=1, clips=None, rates=None, reduction="mean", **kwargs):
    """``steps`` private steps over the N examples (q = 1 unless ``rates``), σ = 0.01, lr 0.5; returns
    (engine, trained copy of the model)."""
    import contextlib

    model = copy.deepcopy(model)
    engine = IndividualizedPrivacyEngine(seed=3)
    engine_model, opt, *rest = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=N),
        budgets=np.full(N, 1e4),
        target_delta=1e-5,
        sample_rates=np.ones(N) if rates is None else rates,
        clip_norms=np.ones(N) if clips is None else clips,
        noise_multiplier=0.01,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        privacy_filter=None,
        loss_reduction=reduction,
        **kwargs,
    )
    criterion = (
        rest[0]
        if mode == "ghost"
        else lambda out, target: nn.functional.cross_entropy(out, target, reduction=reduction)
    )
    for _ in range(steps):
        for xb, yb in rest[-1]:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss = criterion(engine_model(xb), yb)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return engine, model


def _norms_in_dataset_order(engine):
    order = np.argsort(engine.clipping.last_indices.numpy())
    return torch.as_tensor(engine.clipping.last_norms.numpy()[order])


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["bk", "hooks", "ghost", "functorch"])
def test_autocast_training_step_in_every_mode(mode, dtype):
    """A private step under autocast: per-example norms within tolerance of float32 autograd and the
    update close to the float32 step's (same batch, same noise); parameters stay float32."""
    model, x, y = _tokens()
    ref = per_example_grads(model, x, y).norm(dim=1)
    clips = np.where(np.arange(N) % 2 == 0, 0.5, 2.0) * ref.numpy()  # half the examples clipped
    eng32, m32 = _run(model, x, y, mode, clips=clips)
    engh, mh = _run(model, x, y, mode, dtype=dtype, clips=clips)
    torch.testing.assert_close(_norms_in_dataset_order(engh).float(), ref, rtol=TOL[dtype], atol=0)
    assert all(p.dtype == torch.float32 for p in mh.parameters())
    before = _flat(model)
    step32, steph = _flat(m32) - before, _flat(mh) - before
    assert (steph - step32).norm() <= 2 * TOL[dtype] * step32.norm()
    assert engh.steps == eng32.steps == 1


def test_grad_scaler_changes_no_clipping_decision():
    """A GradScaler's scale is divided out before clipping: in float32 (where scaling by 2^k is exact)
    the norms and the update of two steps equal those without a scaler, while the scale grows (the
    scaler sees no overflow of the private gradients); under fp16 autocast the norms are within fp16
    tolerance of float32 and the same examples are clipped."""
    model, x, y = _image()
    ref = per_example_grads(model, x, y).norm(dim=1)
    clips = np.where(np.arange(N) % 2 == 0, 0.5, 2.0) * ref.numpy()
    clipped = torch.as_tensor(clips) < ref
    assert clipped.any() and not clipped.all()
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)):
        engine, trained = _run(model, x, y, "bk", scaler=scaler, clips=clips, steps=2)
        results.append((_norms_in_dataset_order(engine), _flat(trained)))
    assert scaler.get_scale() == 2.0**12  # grown after each of the two steps
    (n0, p0), (n1, p1) = results
    torch.testing.assert_close(n1, n0, rtol=1e-6, atol=0)
    torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7)
    if _low_precision_supported(torch.float16):
        engine, _ = _run(model, x, y, "bk", dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"), clips=clips)
        norms = _norms_in_dataset_order(engine)
        torch.testing.assert_close(norms, ref, rtol=TOL[torch.float16], atol=0)
        assert torch.equal(torch.as_tensor(clips) < norms, clipped)


@pytest.mark.parametrize(("mode", "scaled"), [("bk", False), ("bk", True), ("hooks", False)])
def test_an_overflowed_example_is_left_out_and_the_step_is_charged(mode, scaled):
    """fp16: an example whose activations overflow (inf/nan gradient) contributes nothing; the step is
    taken, noised and charged, and equals the step without that example (same noise)."""
    if not _low_precision_supported(torch.float16):
        pytest.skip("no CPU autocast for float16")
    model, x, y = _image()
    x = x.clone()
    x[3] *= 1e6  # beyond float16's range: inf after autocast's cast
    rates = np.ones(N)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    # "sum" reduction: the output gradients do not depend on the batch size (12 here, 11 below)
    engine, with_inf = _run(
        model, x, y, mode, dtype=torch.float16, scaler=scaler, expected_batch_size=N, reduction="sum"
    )
    norms = _norms_in_dataset_order(engine)
    assert torch.isinf(norms[3]) and torch.isfinite(np.delete(norms, 3)).all()
    assert torch.isfinite(_flat(with_inf)).all() and engine.steps == 1
    if scaled:
        assert scaler.get_scale() == 2.0**8  # no backoff: the scaler saw no private overflow
    rates[3] = 1e-12  # the same run without example 3
    engine_without, without = _run(
        model, x, y, mode, dtype=torch.float16, rates=rates, expected_batch_size=N, reduction="sum"
    )
    torch.testing.assert_close(np.delete(norms, 3), _norms_in_dataset_order(engine_without), rtol=1e-6, atol=0)
    torch.testing.assert_close(_flat(with_inf), _flat(without), rtol=1e-6, atol=1e-7)


def test_grad_scaler_refusals():
    if not _low_precision_supported(torch.float16):
        pytest.skip("no CPU autocast for float16")
    model, x, y = _image()
    overflowing = x.clone()
    overflowing[3] *= 1e6
    with pytest.raises(RuntimeError, match="'ghost' cannot leave it out"):  # ghost: no nan parameters either
        _run(model, overflowing, y, "ghost", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="grad_sample_mode='bk' only"):
        _run(model, x, y, "hooks", dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))

    scaler = torch.amp.GradScaler("cpu")
    original = scaler.step

    def unscale_first(opt, *args, **kwargs):  # as clip_grad_norm_ recipes do
        scaler.unscale_(opt)
        return original(opt, *args, **kwargs)

    scaler.step = unscale_first
    with pytest.raises(RuntimeError, match="unscale_"):
        _run(model, x, y, "bk", dtype=torch.float16, scaler=scaler)

    uncovered = nn.Sequential(nn.Conv3d(3, 2, 1), nn.Flatten(), nn.Linear(2 * 8 * 8, 3))  # Conv3d: fallback
    with pytest.raises(RuntimeError, match="fallback layers"):
        _run(uncovered, x[:, :, None], y, "bk", dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))


def _bk_with_rate(model, x, y, rate):
    """(engine, module, optimizer, loader): bk on (x, y), every example at sampling rate ``rate``, clip norm 1, a
    small noise, no privacy filter (the GradScaler tests' set-up)."""
    n = len(y)
    engine = IndividualizedPrivacyEngine(seed=3)
    module, opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=n),
        budgets=np.full(n, 1e4),
        target_delta=1e-5,
        sample_rates=np.full(n, rate),
        clip_norms=np.ones(n),
        noise_multiplier=0.01,
        max_grad_norm=1.0,
        grad_sample_mode="bk",
        privacy_filter=None,
    )
    return engine, module, opt, loader


@pytest.mark.parametrize("zero_grad_first", [True, False])
def test_grad_scaler_takes_the_noise_only_step_of_an_empty_batch(zero_grad_first):
    """An empty Poisson batch skips the forward and backward pass (a noise-only step): no backward pass leaves
    the GradScaler marker's zero ``.grad``, and the scaler's ``update()`` refused ("No inf checks were
    recorded"). The marker is set when the empty batch is drawn and again by ``zero_grad``, whichever order the
    loop takes."""
    torch.manual_seed(0)
    n = 2
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
    engine, module, opt, loader = _bk_with_rate(model, x, y, 0.5)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.zeros(()))  # the scale is made by the first scale(): a first empty batch calls none
    sizes = []
    for _ in range(6):
        for xb, yb in loader:
            if zero_grad_first:
                opt.zero_grad(set_to_none=True)
            sizes.append(len(xb))
            if len(xb):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(module(xb), yb)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if not zero_grad_first:
                opt.zero_grad(set_to_none=True)
    assert 0 in sizes and engine.steps == len(sizes)  # empty batches were drawn, and every step was taken
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- LoRA and frozen weights --------------------------------------------------------------------
def _lora(kind, targets, r=4):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = MODELS[kind]()
    return peft.get_peft_model(
        base,
        peft.LoraConfig(r=r, lora_alpha=8, target_modules=targets, lora_dropout=0.1, fan_in_fan_out=kind == "gpt2"),
    )


@pytest.mark.parametrize(
    ("kind", "targets"), [("gpt2", ["c_attn", "c_fc"]), ("llama", ["q_proj", "v_proj", "down_proj"])]
)
def test_lora_covers_only_the_adapters(kind, targets):
    model = _lora(kind, targets)
    plan = plan_layers(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert plan and all(rule is not None for _, _, rule in plan)  # no fallback
    assert {
        f"{name}.{p}" for name, module, _ in plan for p, q in module.named_parameters(recurse=False) if q.requires_grad
    } == trainable
    assert all(".lora_A." in name or ".lora_B." in name for name, _, _ in plan)
    keeper = BookKeeper.attach(model)
    assert all("forward" not in m.__dict__ for name, m in model.named_modules() if name.endswith("base_layer"))
    keeper.detach()


class _ShapeLog(TorchDispatchMode):
    """The shapes of every matrix-product and convolution-gradient result computed inside it."""

    OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "convolution_backward")

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in self.OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if torch.is_tensor(t):
                    self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize(("kind", "targets"), [("gpt2", ["c_attn", "c_proj", "c_fc"]), ("llama", ["q_proj", "o_proj"])])
def test_frozen_weights_cost_no_weight_gradient(kind, targets):
    """A private bk step on a LoRA model: no matrix product anywhere in the backward pass or the step
    produces a tensor of a frozen weight's shape (autograd computes only the input gradient of a frozen
    layer), the frozen parameters get no .grad and do not move; the adapters do."""
    model = _lora(kind, targets).train()
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    frozen_shapes = {tuple(p.shape) for p in frozen.values() if p.dim() == 2} | {
        tuple(p.shape)[::-1] for p in frozen.values() if p.dim() == 2
    }
    adapter_shapes = {tuple(p.shape) for p in model.parameters() if p.requires_grad}
    assert not frozen_shapes & adapter_shapes  # distinguishable shapes
    inputs, ids = _batch(kind, n=4)
    dataset = TensorDataset(inputs["input_ids"], ids)
    engine = IndividualizedPrivacyEngine(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module, opt, loader = engine.make_private_with_parameters(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        data_loader=DataLoader(dataset, batch_size=4),
        budgets=np.full(4, 1e4),
        target_delta=1e-5,
        sample_rates=np.ones(4),
        clip_norms=np.ones(4),
        noise_multiplier=0.01,
        max_grad_norm=1.0,
        grad_sample_mode="bk",
        privacy_filter=None,
    )
    xb, yb = next(iter(loader))
    log = _ShapeLog()
    with log:
        loss = _per_example_loss(module, {"input_ids": xb}, yb).mean()
        loss.backward()
        opt.step()
    assert adapter_shapes & log.shapes  # the adapters' gradients
    assert not frozen_shapes & log.shapes, frozen_shapes & log.shapes
    assert all(p.grad is None for p in frozen.values())
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in frozen)
    assert all(not torch.equal(after[n], before[n]) for n in before if n not in frozen)


def test_gpt2_with_lora_trains_with_per_example_budgets():
    """GPT-2 (Conv1D base layers, peft's fan_in_fan_out) + LoRA, bk mode, two consent groups (ε = 1, 8)
    with Scale: it trains, only the adapters move, and each group's ε is within its budget."""
    model = _lora("gpt2", ["c_attn", "c_fc"]).train()
    n = 16
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (n, T), generator=g)
    budgets = np.where(np.arange(n) < n // 2, 1.0, 8.0)
    engine = IndividualizedPrivacyEngine(seed=0)
    module, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        data_loader=DataLoader(TensorDataset(ids, ids), batch_size=8),
        budgets=budgets,
        target_delta=1e-5,
        method="scale",
        steps=3,
        max_grad_norm=1.0,
        grad_sample_mode="bk",
    )
    assert FALLBACK not in engine.layer_paths.values()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    while engine.steps < 3:
        for xb, yb in loader:
            opt.zero_grad()
            _per_example_loss(module, {"input_ids": xb}, yb).mean().backward()
            opt.step()
            if engine.steps == 3:
                break
    moved = {k for k, v in model.named_parameters() if not torch.equal(v, before[k])}
    assert moved and all("lora_" in k for k in moved)
    eps = engine.get_epsilon(1e-5)
    assert list(eps.budgets) == [1.0, 8.0] and np.all(eps.per_group <= eps.budgets + 1e-6)


@pytest.mark.parametrize("dtype", HALF[:1])
def test_llama_with_lora_under_bf16_autocast(dtype):
    """Llama + LoRA under bf16 autocast in bk: a step runs, and the per-example norms are within bf16
    tolerance of float32 autograd."""
    model = _lora("llama", ["q_proj", "v_proj"]).train()
    for m in model.modules():  # no dropout: the float32 reference must see the same network
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    inputs, ids = _batch("llama", n=4)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(4):
        model.zero_grad()
        _per_example_loss(model, _slice(inputs, i), ids[i : i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in params]))
    ref = torch.stack(rows).norm(dim=1)
    model.zero_grad()
    keeper = BookKeeper.attach(model)
    keeper.active, keeper.loss_reduction = True, "sum"
    with torch.autocast("cpu", dtype=dtype):
        loss = _per_example_loss(model, inputs, ids).sum()
    loss.backward()
    torch.testing.assert_close(keeper.norms(), ref, rtol=TOL[dtype], atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float16_with_a_grad_scaler_on_cuda():
    """The GradScaler path on the device it is for: float16 autocast, ``GradScaler("cuda")``, book-keeping; the
    steps are taken and charged, the parameters stay finite and move, and the scale never backs off (the scaler
    sees only the data-independent marker gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).cuda()
    x, y = torch.randn(N, 6, device="cuda"), torch.randint(0, 3, (N,), device="cuda")
    before = [p.detach().clone() for p in model.parameters()]
    engine, module, opt, loader = _bk_with_rate(model, x, y, 1.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    for _ in range(3):
        for xb, yb in loader:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(module(xb), yb)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert engine.steps == 3 and scaler.get_scale() >= 2.0**10
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(after, before, strict=True))
