"""Per-layer rules of book-keeping clipping: per-example gradient norms and clipped sums from a layer's
input and output gradient, without the per-example gradient tensor where a ghost norm is cheaper.

For a layer with weight W applied at T positions (a Linear on a sequence, a convolution's output
positions), example i's weight gradient is G_i = Σ_t b_{i,t} a_{i,t}ᵀ, with a the layer's input at
position t (a convolution's unfolded patch) and b the gradient of the loss w.r.t. its output there.
Two ways to its norm (Li et al. 2022, "Large language models can be strong differentially private
learners", ghost norm; Bu, Mao & Xu 2022, "Scalable and efficient training of large convolutional
neural networks with differential privacy", mixed ghost clipping):

* **ghost norm** — ‖G_i‖²_F = Σ_{t,t'} (a_{i,t}·a_{i,t'}) (b_{i,t}·b_{i,t'}): two T×T Gram matrices,
  cost ∝ T²·(d + p) per example, nothing of size d·p;
* **per-sample gradient** — G_i itself (d·p numbers per example), cost ∝ T·d·p.

Bu, Mao & Xu's mixed rule takes the ghost norm when 2T² < d·p (per convolution group), else the
per-sample gradient; we apply it per layer and per backward pass (:meth:`Rule.prefers_ghost`).
In book-keeping the per-sample path costs no more time than the summed weight gradient it replaces
(the clipped sum Σ_i w_i G_i is then cheap), while a ghost layer adds its Gram matrices to an
ordinary weight gradient; the ghost norm is what keeps the memory of layers with few positions and
large d·p (fully connected layers, late convolutions) small.

Book-keeping (Bu, Wang, Zha & Karypis 2023, "Differentially private optimization on large model at
small cost", Alg. 1): one backward pass keeps what each layer needs — (a, b) for ghost layers, G_i
for per-sample layers — and once every layer's norm is known the clipped sum
Σ_i w_i G_i (w_i = min(1, c_i/‖g_i‖), each example's own c_i) is formed directly: for a ghost
layer as the layer's ordinary weight gradient with b_i scaled by w_i (one matrix product, or the
convolution's weight-gradient kernel), for a per-sample layer as Σ_i w_i G_i.  No second backward
pass; autograd never forms the un-clipped summed gradient of a covered parameter.

Each rule has: ``covers(module)`` (exact semantics known), ``forward`` (the layer's output and the
tensors to keep), ``backward_input`` (the gradient w.r.t. the layer's input, as PyTorch's own
kernel gives it), and — from the kept tensors of one backward pass, possibly several uses of the
layer (weight sharing, an RNN cell) — ``prefers_ghost``, ``per_sample`` (G_i per parameter),
``ghost_norm_sq`` and ``ghost_clipped_sum``.  Per-sample results are exact; ghost results equal
them up to floating-point rounding (tests/test_bookkeeping.py, float64).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: floats held at once by a chunk of per-example temporaries (unfolded patches, Gram matrices)
CHUNK_FLOATS = 1 << 23


def _chunks(n: int, per_example: int):
    """Slices of at most CHUNK_FLOATS / per_example examples (at least one)."""
    step = max(1, CHUNK_FLOATS // max(1, int(per_example)))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _gram_norm_sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_{t,t'} (a_t·a_t')(b_t·b_t') per example (and per group): a (..., T, d), b (..., T, p)."""
    if a.shape[-2] == 1:
        return (a * a).sum((-2, -1)) * (b * b).sum((-2, -1))
    return (torch.matmul(a, a.transpose(-1, -2)) * torch.matmul(b, b.transpose(-1, -2))).sum((-2, -1))


class Rule:
    """A layer type's book-keeping formulas (stateless; see the module docstring)."""

    #: ghost-capable (keeps (a, b) when the ghost norm is cheaper) or always per-sample
    ghost_capable = False
    #: the names of the layer's own parameters the rule trains (any other trainable parameter the
    #: layer owns is refused by the planner: it would get noise only)
    parameters: tuple[str, ...] = ("weight", "bias")

    @staticmethod
    def covers(module: nn.Module) -> bool:
        raise NotImplementedError

    def prepare(self, module, x):
        """Differentiable preprocessing outside the book-kept operation (default: none)."""
        return x

    def forward(self, module, x):
        """(output, tensors to keep for backward)."""
        raise NotImplementedError

    def backward_input(self, module, saved, g, need_input: bool):
        raise NotImplementedError

    def batch_size(self, saved) -> int:
        return int(saved[0].shape[0])

    # --- one backward pass ------------------------------------------------------------------
    def prefers_ghost(self, module, uses) -> bool:
        return False

    def per_sample(self, module, saved, g) -> dict[str, torch.Tensor]:
        """{parameter name: (B, *shape)} per-example gradients of this use (trainable parameters)."""
        raise NotImplementedError

    def ghost_norm_sq(self, module, uses) -> torch.Tensor:
        raise NotImplementedError

    def ghost_clipped_sum(self, module, uses, w) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def _add_into(total: dict, parts: dict) -> None:
    for k, v in parts.items():
        total[k] = v if k not in total else total[k] + v


def _trainable(module, name) -> bool:
    p = getattr(module, name, None)
    return isinstance(p, nn.Parameter) and p.requires_grad


def _own_forward(module, base) -> bool:
    """The module's forward is ``base``'s (a subclass that keeps the layer's semantics, e.g. Opacus's RNNLinear)."""
    return isinstance(module, base) and type(module).forward is base.forward


# --- Linear -------------------------------------------------------------------------------------
class LinearRule(Rule):
    """``nn.Linear`` on (B, d) or (B, *, d) inputs: positions T = product of the middle dimensions."""

    ghost_capable = True

    @staticmethod
    def covers(module):
        return _own_forward(module, nn.Linear)

    def forward(self, module, x):
        return F.linear(x, module.weight, module.bias), (x,)

    def backward_input(self, module, saved, g, need_input):
        return torch.matmul(g, module.weight) if need_input else None

    @staticmethod
    def _flat(saved, g):
        x = saved[0]
        b = x.shape[0]
        return x.reshape(b, -1, x.shape[-1]), g.reshape(b, -1, g.shape[-1])

    def prefers_ghost(self, module, uses):
        if not _trainable(module, "weight"):
            return False
        t = sum(self._flat(s, g)[0].shape[1] for s, g in uses)
        return 2 * t * t < module.in_features * module.out_features

    def per_sample(self, module, saved, g):
        a, b = self._flat(saved, g)
        out = {}
        if _trainable(module, "weight"):
            out["weight"] = torch.bmm(b.transpose(1, 2), a) if a.shape[1] > 1 else b[:, 0, :, None] * a[:, 0, None, :]
        if _trainable(module, "bias"):
            out["bias"] = b.sum(1)
        return out

    def _cat(self, uses):
        pairs = [self._flat(s, g) for s, g in uses]
        if len(pairs) == 1:
            return pairs[0]
        return torch.cat([a for a, _ in pairs], 1), torch.cat([b for _, b in pairs], 1)

    def ghost_norm_sq(self, module, uses):
        a, b = self._cat(uses)
        t = a.shape[1]
        out = a.new_zeros(a.shape[0])
        for s in _chunks(a.shape[0], 2 * t * t + t * (a.shape[2] + b.shape[2])):
            out[s] = _gram_norm_sq(a[s], b[s])
        if _trainable(module, "bias"):
            bias = b.sum(1)
            out = out + (bias * bias).sum(1)
        return out

    def ghost_clipped_sum(self, module, uses, w):
        out = {}
        for saved, g in uses:
            a, b = self._flat(saved, g)
            bw = b * w.to(b.dtype).view(-1, 1, 1)
            parts = {"weight": bw.reshape(-1, bw.shape[-1]).t() @ a.reshape(-1, a.shape[-1])}
            if _trainable(module, "bias"):
                parts["bias"] = bw.sum((0, 1))
            _add_into(out, parts)
        return out


# --- Convolutions -------------------------------------------------------------------------------
_CONV_FN = {1: F.conv1d, 2: F.conv2d}


class ConvRule(Rule):
    """``nn.Conv1d`` / ``nn.Conv2d``: any stride, padding (numbers, 'valid', 'same', any padding_mode),
    dilation and groups.  T = output positions, d = C_in/groups · kernel size, p = C_out/groups.

    Padding that is not a symmetric zero padding (``padding_mode`` reflect/replicate/circular, an
    odd total 'same' padding) is applied by :meth:`prepare` outside the book-kept operation, as an
    ordinary differentiable ``F.pad``, exactly as ``nn.ConvNd.forward`` does; the kept input is then
    the padded one."""

    ghost_capable = True

    @staticmethod
    def covers(module):
        return (_own_forward(module, nn.Conv1d) or _own_forward(module, nn.Conv2d)) and not module.transposed

    @staticmethod
    def _same_total(module):
        return [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]

    def padding(self, module) -> list[int]:
        """The symmetric zero padding of the book-kept convolution (after :meth:`prepare`)."""
        nd = len(module.kernel_size)
        if module.padding_mode != "zeros" or module.padding == "valid":
            return [0] * nd
        if module.padding == "same":
            total = self._same_total(module)
            return [t // 2 for t in total] if all(t % 2 == 0 for t in total) else [0] * nd
        return list(module.padding)

    def prepare(self, module, x):
        nd = len(module.kernel_size)
        if x.dim() != nd + 2:
            raise ValueError(f"book-keeping needs batched inputs for {type(module).__name__}; got shape "
                             f"{tuple(x.shape)}")
        if module.padding_mode != "zeros":
            return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        if module.padding == "same":
            total = self._same_total(module)
            if any(t % 2 for t in total):          # as PyTorch: the extra zero on the right/bottom side
                spec = []
                for t in reversed(total):
                    spec += [t // 2, t - t // 2]
                return F.pad(x, spec)
        return x

    def forward(self, module, x):
        out = _CONV_FN[len(module.kernel_size)](x, module.weight, module.bias, module.stride, self.padding(module),
                                                module.dilation, module.groups)
        return out, (x,)

    def _backward(self, module, x, g, weight, groups, mask):
        nd = len(module.kernel_size)
        return torch.ops.aten.convolution_backward(g, x, weight, None, list(module.stride), self.padding(module),
                                                   list(module.dilation), False, [0] * nd, groups, mask)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        return self._backward(module, saved[0], g, module.weight, module.groups, [True, False, False])[0]

    def _dims(self, module, g):
        """(groups, T, d, p) of one use."""
        groups = module.groups
        return (groups, int(math.prod(g.shape[2:])), module.in_channels // groups * int(math.prod(module.kernel_size)),
                module.out_channels // groups)

    def prefers_ghost(self, module, uses):
        if not _trainable(module, "weight"):
            return False
        _, _, d, p = self._dims(module, uses[0][1])
        t = sum(self._dims(module, g)[1] for _, g in uses)
        return 2 * t * t < d * p

    def per_sample(self, module, saved, g):
        out = {}
        if _trainable(module, "weight"):
            out["weight"] = self._per_sample_weight(module, saved[0], g)
        if _trainable(module, "bias"):
            out["bias"] = g.sum(tuple(range(2, g.dim())))
        return out

    def _per_sample_weight(self, module, x, g):
        """G_i for every example: the convolution's weight-gradient kernel on a chunk of k examples
        folded into the channel dimension (groups = k·groups), so no unfolded patches are formed."""
        n, w = x.shape[0], module.weight
        out = w.new_empty((n,) + tuple(w.shape))
        per_example = w.numel() + x[0].numel() + g[0].numel()
        step = max(1, min(32, CHUNK_FLOATS // max(1, per_example)))
        for start in range(0, n, step):
            k = min(step, n - start)
            xs = x[start:start + k].reshape((1, k * x.shape[1]) + tuple(x.shape[2:]))
            gs = g[start:start + k].reshape((1, k * g.shape[1]) + tuple(g.shape[2:]))
            wk = w.unsqueeze(0).expand((k,) + tuple(w.shape)).reshape((k * w.shape[0],) + tuple(w.shape[1:]))
            gw = self._backward(module, xs, gs, wk, k * module.groups, [False, True, False])[1]
            out[start:start + k] = gw.view((k,) + tuple(w.shape))
        return out

    def _unfold(self, module, x):
        """(B, groups, T, d) patches of the (padded) input; a Conv1d as a 1×L image."""
        pad = self.padding(module)
        if len(module.kernel_size) == 1:
            cols = F.unfold(x.unsqueeze(2), (1, module.kernel_size[0]), dilation=(1, module.dilation[0]),
                            padding=(0, pad[0]), stride=(1, module.stride[0]))
        else:
            cols = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=pad, stride=module.stride)
        b, dk, t = cols.shape
        return cols.view(b, module.groups, dk // module.groups, t).transpose(2, 3)

    def ghost_norm_sq(self, module, uses):
        groups, _, d, p = self._dims(module, uses[0][1])
        n = uses[0][1].shape[0]
        t_all = sum(self._dims(module, g)[1] for _, g in uses)
        out = uses[0][1].new_zeros(n)
        for s in _chunks(n, groups * (2 * t_all * t_all + t_all * (d + p))):
            a = torch.cat([self._unfold(module, saved[0][s]) for saved, _ in uses], 2)
            b = torch.cat([g[s].reshape(g[s].shape[0], groups, p, -1).transpose(2, 3) for _, g in uses], 2)
            out[s] = _gram_norm_sq(a, b).sum(1)
        if _trainable(module, "bias"):
            bias = sum(g.sum(tuple(range(2, g.dim()))) for _, g in uses)
            out = out + (bias * bias).sum(1)
        return out

    def ghost_clipped_sum(self, module, uses, w):
        out = {}
        for saved, g in uses:
            gw = g * w.to(g.dtype).view((-1,) + (1,) * (g.dim() - 1))
            parts = {"weight": self._backward(module, saved[0], gw, module.weight, module.groups,
                                              [False, True, False])[1]}
            if _trainable(module, "bias"):
                parts["bias"] = gw.sum((0,) + tuple(range(2, g.dim())))
            _add_into(out, parts)
        return out


# --- Embedding ----------------------------------------------------------------------------------
class EmbeddingRule(Rule):
    """``nn.Embedding`` (any index shape (B, *)): example i's gradient has one row per distinct token
    v, Σ_{t: id_t = v} b_t, so ‖G_i‖² = Σ_v ‖Σ_{t: id_t = v} b_t‖² — formed by a scatter-add over the
    (example, token) pairs, cost ∝ T·p; positions at ``padding_idx`` contribute nothing, as in
    PyTorch's embedding backward.  The clipped sum is the same scatter-add with b_i scaled by w_i.
    ``scale_grad_by_freq`` (a gradient that couples the examples of a batch) and ``sparse`` are not
    covered; ``max_norm`` is not covered either, and the engine refuses it in every mode
    (:func:`~.integrity.check_static_writes`: PyTorch renormalises the looked-up rows in place during
    the forward, an un-noised write to the released model)."""

    ghost_capable = True
    parameters = ("weight",)

    @staticmethod
    def covers(module):
        return (_own_forward(module, nn.Embedding) and not module.scale_grad_by_freq and not module.sparse
                and module.max_norm is None)

    def forward(self, module, ids):
        return F.embedding(ids, module.weight, module.padding_idx), (ids,)

    def backward_input(self, module, saved, g, need_input):
        return None

    def prefers_ghost(self, module, uses):
        return True

    def _flat(self, module, uses):
        """(ids (B, T), b (B, T, p)) over all uses, padding positions zeroed."""
        ids = torch.cat([s[0].reshape(s[0].shape[0], -1) for s, _ in uses], 1)
        b = torch.cat([g.reshape(g.shape[0], -1, g.shape[-1]) for _, g in uses], 1)
        if module.padding_idx is not None:
            b = b * (ids != module.padding_idx).unsqueeze(-1).to(b.dtype)
        return ids, b

    def ghost_norm_sq(self, module, uses):
        ids, b = self._flat(module, uses)
        n, t = ids.shape
        key = torch.arange(n, device=ids.device).unsqueeze(1) * module.num_embeddings + ids
        uniq, inv = torch.unique(key.reshape(-1), return_inverse=True)
        rows = b.new_zeros((uniq.numel(), b.shape[-1])).index_add_(0, inv, b.reshape(-1, b.shape[-1]))
        return b.new_zeros(n).index_add_(0, torch.div(uniq, module.num_embeddings, rounding_mode="floor"),
                                         (rows * rows).sum(1))

    def ghost_clipped_sum(self, module, uses, w):
        ids, b = self._flat(module, uses)
        bw = (b * w.to(b.dtype).view(-1, 1, 1)).reshape(-1, b.shape[-1])
        return {"weight": torch.zeros_like(module.weight).index_add_(0, ids.reshape(-1), bw)}


# --- Normalisation layers -----------------------------------------------------------------------
class _AffineNormRule(Rule):
    """Affine normalisation layers: y = x̂ ⊙ γ + β.  Example i's gradients are γ_i = Σ x̂ ⊙ b and
    β_i = Σ b over its positions — per-sample gradients of the size of γ (C numbers), always formed
    directly.  The forward and the input gradient are PyTorch's native kernels (their mean and
    inverse standard deviation are kept for x̂)."""

    def per_sample(self, module, saved, g):
        x, mean, rstd = saved
        xhat = self._xhat(module, x, mean, rstd)
        out = {}
        if _trainable(module, "weight"):
            out["weight"] = self._reduce(module, xhat * g)
        if _trainable(module, "bias"):
            out["bias"] = self._reduce(module, g)
        return out


class GroupNormRule(_AffineNormRule):
    """``nn.GroupNorm`` with ``affine=True``, and ``nn.InstanceNorm{1,2,3}d`` with ``affine=True`` and
    ``track_running_stats=False`` (instance normalisation is group normalisation with one group per
    channel: the same statistics per example and channel)."""


    @staticmethod
    def covers(module):
        if _own_forward(module, nn.GroupNorm):
            return module.affine
        for cls in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
            if _own_forward(module, cls):
                return module.affine and not module.track_running_stats
        return False

    @staticmethod
    def _groups(module):
        return module.num_groups if isinstance(module, nn.GroupNorm) else module.num_features

    def forward(self, module, x):
        if x.dim() < 2 or (not isinstance(module, nn.GroupNorm) and x.dim() != module._get_no_batch_dim() + 1):
            raise ValueError(f"book-keeping needs batched inputs for {type(module).__name__}; got shape "
                             f"{tuple(x.shape)}")
        n, c = x.shape[0], x.shape[1]
        out, mean, rstd = torch.ops.aten.native_group_norm(x.contiguous(), module.weight, module.bias, n, c,
                                                           int(math.prod(x.shape[2:])), self._groups(module),
                                                           module.eps)
        return out, (x, mean, rstd)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        x, mean, rstd = saved
        n, c = x.shape[0], x.shape[1]
        return torch.ops.aten.native_group_norm_backward(g.contiguous(), x.contiguous(), mean, rstd, module.weight, n, c,
                                                         int(math.prod(x.shape[2:])), self._groups(module),
                                                         [True, False, False])[0]

    def _xhat(self, module, x, mean, rstd):
        n = x.shape[0]
        grouped = x.reshape(n, self._groups(module), -1)
        return ((grouped - mean.reshape(n, -1, 1)) * rstd.reshape(n, -1, 1)).reshape(x.shape)

    @staticmethod
    def _reduce(module, t):
        return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)


class LayerNormRule(_AffineNormRule):
    """``nn.LayerNorm`` with ``elementwise_affine=True`` on (B, *, normalized_shape) inputs."""


    @staticmethod
    def covers(module):
        return _own_forward(module, nn.LayerNorm) and module.elementwise_affine

    def forward(self, module, x):
        if x.dim() <= len(module.normalized_shape):
            raise ValueError(f"book-keeping needs batched inputs for LayerNorm; got shape {tuple(x.shape)}")
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, list(module.normalized_shape), module.weight,
                                                           module.bias, module.eps)
        return out, (x, mean, rstd)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        x, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(g.contiguous(), x, list(module.normalized_shape), mean, rstd,
                                                         module.weight, module.bias, [True, False, False])[0]

    def _xhat(self, module, x, mean, rstd):
        return (x - mean) * rstd

    @staticmethod
    def _reduce(module, t):
        k = len(module.normalized_shape)
        middle = tuple(range(1, t.dim() - k))
        return t.sum(middle) if middle else t


#: the rules in the order they are tried
RULES: tuple[Rule, ...] = (LinearRule(), ConvRule(), EmbeddingRule(), GroupNormRule(), LayerNormRule())


def rule_for(module: nn.Module) -> Rule | None:
    """The rule covering ``module`` (None: not covered; Opacus's per-sample gradient then)."""
    for rule in RULES:
        if rule.covers(module):
            return rule
    return None
