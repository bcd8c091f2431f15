"""Weight-only normalisations, y = k(x) ⊙ w: ``nn.RMSNorm`` and the RMSNorm forms of Hugging Face models
(Llama, OLMo, T5, Gemma), matched by their forward's compiled code (:func:`~.base.same_code`), never by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Rule, acc, own_forward, same_code, trainable


# --- Weight-only normalisations (RMSNorm and its Hugging Face forms) ----------------------------
# Verbatim copies of transformers' forwards (compared by compiled code, :func:`same_code`; never called).
def _llama_rms_forward(self, hidden_states):  # LlamaRMSNorm and ~140 copies (Mistral, Qwen2/3, Phi-3, ...)
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _olmo_rms_forward(self, hidden_states):  # OlmoRMSNorm, Olmo2/3, GptOssRMSNorm, ... (cast after the scale)
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _t5_norm_forward(self, hidden_states):  # T5LayerNorm, LongT5, Switch Transformers, UDOP, Pix2Struct, ...
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)

    return self.weight * hidden_states


def _gemma_rms_norm(self, x):  # GemmaRMSNorm._norm (Gemma, Gemma 2/3, RecurrentGemma, ...)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _gemma_rms_forward(self, x):  # GemmaRMSNorm.forward: y = k(x) (1 + w)
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


class _ScaleNorm:
    """One form of weight-only normalisation y = combine(w, k(x)) with ∂y/∂w = k elementwise (before
    a final cast): ``factor`` and ``combine`` are the form's forward split at the weight, op for op."""

    references: tuple = ()  # (method name, verbatim copy) pairs the class's methods must match

    def matches(self, module) -> bool:
        cls = type(module)
        return all(same_code(getattr(cls, name, None), ref) for name, ref in self.references)

    def forward(self, module, x, w):
        return self.combine(module, w, self.factor(module, x), x)

    def weight_grads(self, module, x, g):
        """Each example's weight gradient (B, *weight.shape): autograd through ``combine`` with one copy
        of the weight per example, so in the module's own dtypes and roundings (Gemma's is float32)."""
        k = self.factor(module, x)
        w = module.weight.detach()
        view = (x.shape[0],) + (1,) * (k.dim() - 1 - w.dim()) + tuple(w.shape)
        copies = w.expand(view).clone().requires_grad_(True)
        with torch.enable_grad():
            out = self.combine(module, copies, k, x)
        return torch.autograd.grad(out, copies, g)[0].reshape((x.shape[0], *tuple(w.shape)))


class _LlamaRMS(_ScaleNorm):
    references = (("forward", _llama_rms_forward),)

    def factor(self, module, x):
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        return (h * torch.rsqrt(variance + module.variance_epsilon)).to(x.dtype)

    def combine(self, module, w, k, x):
        return w * k


class _OlmoRMS(_LlamaRMS):
    references = (("forward", _olmo_rms_forward),)

    def factor(self, module, x):
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(variance + module.variance_epsilon)

    def combine(self, module, w, k, x):
        return (w * k).to(x.dtype)


class _T5Norm(_LlamaRMS):
    references = (("forward", _t5_norm_forward),)

    def factor(self, module, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = x * torch.rsqrt(variance + module.variance_epsilon)
        if module.weight.dtype in [torch.float16, torch.bfloat16]:
            h = h.to(module.weight.dtype)
        return h


class _GemmaRMS(_ScaleNorm):
    references = (("forward", _gemma_rms_forward), ("_norm", _gemma_rms_norm))

    def factor(self, module, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)

    def combine(self, module, w, k, x):
        return (k * (1.0 + w.float())).type_as(x)


class _TorchRMS(_ScaleNorm):
    """``nn.RMSNorm``: ``F.rms_norm(x, normalized_shape, w, eps)`` = rms_norm(x, ..., None, eps) ⊙ w."""

    def matches(self, module):
        return own_forward(module, nn.RMSNorm) and module.elementwise_affine

    def factor(self, module, x):
        return F.rms_norm(x, module.normalized_shape, None, module.eps)

    def forward(self, module, x, w):
        return F.rms_norm(x, module.normalized_shape, w, module.eps)

    def weight_grads(self, module, x, g):
        prod = acc(g) * acc(self.factor(module, x))
        middle = tuple(range(1, prod.dim() - module.weight.dim()))
        return prod.sum(middle) if middle else prod


_FORM_OF_CLASS: dict = {}


class ScaleNormRule(Rule):
    """Weight-only normalisations y = w ⊙ k(x) (RMSNorm: k(x) = x / rms(x), over the last dimensions):
    ``nn.RMSNorm``, and transformers' ``LlamaRMSNorm`` (with its copies in other models),
    ``OlmoRMSNorm`` (scale before the cast back), ``T5LayerNorm`` and ``GemmaRMSNorm``
    (y = k(x) ⊙ (1 + w)), each recognised by its forward's code.  Example i's gradient is
    Σ_positions k(x) ⊙ b — d numbers per example, always formed directly (autograd through the form's
    last step with one copy of w per example: the module's own dtypes, e.g. Gemma's float32).  The
    forward is the form's own sequence of operations (float32 inside, as the module); the input
    gradient is autograd's on that same sequence, recomputed in the backward pass (an elementwise
    forward more; exactly the module's input gradient)."""

    parameters = ("weight",)
    _torch = _TorchRMS()
    _forms = (_LlamaRMS(), _OlmoRMS(), _T5Norm(), _GemmaRMS())

    def form(self, module) -> _ScaleNorm | None:
        if self._torch.matches(module):
            return self._torch
        cls = type(module)
        if cls not in _FORM_OF_CLASS:  # code comparisons once per class
            _FORM_OF_CLASS[cls] = next((f for f in self._forms if f.matches(module)), None)
        return _FORM_OF_CLASS[cls]

    def covers(self, module):
        weight = getattr(module, "weight", None)
        return isinstance(weight, nn.Parameter) and self.form(module) is not None

    def trailing(self, module):
        return module.weight.dim()

    def forward(self, module, x):
        if x.dim() < 2:
            raise ValueError(
                f"book-keeping needs batched inputs for {type(module).__name__}; got shape {tuple(x.shape)}"
            )
        return self.form(module).forward(module, x, module.weight), (x,)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        with torch.enable_grad():
            x = saved[0].detach().requires_grad_(True)
            out = self.form(module).forward(module, x, module.weight.detach())
        return torch.autograd.grad(out, x, g)[0]

    def per_sample(self, module, saved, g):
        if not trainable(module, "weight"):
            return {}
        return {"weight": acc(self.form(module).weight_grads(module, saved[0], g))}
