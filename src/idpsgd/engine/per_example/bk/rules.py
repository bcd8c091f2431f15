"""Per-layer rules of book-keeping clipping: per-example gradient norms and clipped sums from a layer's
input and output gradient, without the per-example gradient tensor where a ghost norm is cheaper.

For a layer with weight W applied at T positions, example i's weight gradient is
G_i = Σ_t b_{i,t} a_{i,t}ᵀ (a the layer's input at position t, b the loss gradient w.r.t. its
output there).  Its norm is either the **ghost norm** ‖G_i‖²_F = Σ_{t,t'} (a_{i,t}·a_{i,t'})
(b_{i,t}·b_{i,t'}) (Li et al. 2022; cost ∝ T²·(d + p), nothing of size d·p) or that of the
**per-sample gradient** G_i (cost ∝ T·d·p); Bu, Mao & Xu 2022's mixed rule takes the ghost norm when
2T² < d·p, per layer and per backward pass (:meth:`Rule.prefers_ghost`).  The clipped sum
Σ_i min(1, c_i/‖g_i‖) G_i is then formed directly (Bu, Wang, Zha & Karypis 2023, Alg. 1): a ghost
layer's ordinary weight gradient with b_i scaled, or Σ_i w_i G_i — no second backward pass.

This module owns one :class:`Rule` per layer kind (``covers``, ``forward``, ``backward_input``,
``per_sample``, ``ghost_norm_sq``, ``ghost_clipped_sum``); transformers' layers are matched by what
their forward computes (:func:`_same_code`), never by name; norms and sums accumulate in float32
(:func:`acc`), half-precision inputs cast as autocast would (:func:`autocast_input`).  The covered
layers and the mixed-precision rules: ``docs/performance.md``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: floats held at once by a chunk of per-example temporaries (unfolded patches, Gram matrices)
CHUNK_FLOATS = 1 << 23

_HALF = (torch.float16, torch.bfloat16)


def acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` ready for accumulation: float32 if it is half precision (kept under autocast), else as is."""
    return t.float() if t.dtype in _HALF else t


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


#: (operation, device type, autocast dtype, input dtype, weight dtype) -> the dtype autocast computes in
_AUTOCAST_DTYPE: dict = {}
_PROBES = {  # each layer's own operation on one-element tensors of the input's and the weight's dtypes
    "linear": lambda x, w: F.linear(x.new_ones(1, 1), w.new_ones(1, 1)),
    "addmm": lambda x, w: torch.addmm(w.new_ones(1), x.new_ones(1, 1), w.new_ones(1, 1)),
    "conv1d": lambda x, w: F.conv1d(x.new_ones(1, 1, 1), w.new_ones(1, 1, 1)),
    "conv2d": lambda x, w: F.conv2d(x.new_ones(1, 1, 1, 1), w.new_ones(1, 1, 1, 1)),
    "layer_norm": lambda x, w: F.layer_norm(x.new_ones(1, 2), (2,), w.new_ones(2), w.new_ones(2)),
    "group_norm": lambda x, w: F.group_norm(x.new_ones(1, 2, 1), 1, w.new_ones(2), w.new_ones(2)),
    "instance_norm": lambda x, w: F.instance_norm(x.new_ones(1, 1, 2), weight=w.new_ones(1), bias=w.new_ones(1)),
}


def autocast_input(x: torch.Tensor, op: str, weight: torch.Tensor) -> torch.Tensor:
    """``x`` cast to the dtype ``torch.autocast`` runs ``op`` in for inputs like ``x`` and ``weight``
    (unchanged outside autocast).  Autocast's lists differ by device (CPU keeps ``layer_norm`` in
    the input's dtype, CUDA runs it in float32; both run ``linear`` in the autocast dtype), so the
    dtype is read off the operation itself, once per (device, dtypes).  The cast is an ordinary
    differentiable one, applied before the book-kept operation: autograd casts the input gradient
    back, as autocast's own casts do."""
    if not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        return x
    device = x.device.type
    key = (op, device, torch.get_autocast_dtype(device), x.dtype, weight.dtype)
    dtype = _AUTOCAST_DTYPE.get(key)
    if dtype is None:
        with torch.no_grad():
            dtype = _AUTOCAST_DTYPE[key] = _PROBES[op](x.detach(), weight.detach()).dtype
    return x if dtype == x.dtype else x.to(dtype)


def _same_code(fn, reference, names=("torch",)) -> bool:
    """``fn`` compiles to the same code as ``reference`` (a verbatim copy of a known forward) and sees
    the same objects under the global ``names`` it uses: it computes exactly what ``reference`` does."""
    code, want = getattr(fn, "__code__", None), reference.__code__
    if code is None or getattr(fn, "__closure__", None) or getattr(fn, "__defaults__", None) != reference.__defaults__:
        return False
    fields = (
        "co_code",
        "co_consts",
        "co_names",
        "co_varnames",
        "co_argcount",
        "co_posonlyargcount",
        "co_kwonlyargcount",
    )
    return all(getattr(code, f) == getattr(want, f) for f in fields) and all(
        fn.__globals__.get(n) is reference.__globals__[n] for n in names
    )


def chunks(n: int, per_example: int):
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
    #: a ghost-capable layer that always takes the ghost norm (its ``per_sample``, if any, serves only
    #: the cross terms of tied parameters, :mod:`.tied`)
    always_ghost = False
    #: the names of the layer's own parameters the rule trains (any other trainable parameter the
    #: layer owns is refused by the planner: it would get noise only)
    parameters: tuple[str, ...] = ("weight", "bias")

    @staticmethod
    def covers(module: nn.Module) -> bool:
        raise NotImplementedError

    def trailing(self, module) -> int | None:
        """How many trailing dimensions the layer's operation acts on (a row-wise layer: any dimensions
        before them are rows, wherever the batch dimension is among them); None when the operation
        needs the batch as its leading dimension (convolutions, group normalisation)."""
        return None

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


def add_into(total: dict, parts: dict) -> None:
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
    #: the weight's layout: (out, in) as ``nn.Linear``, or (in, out) as transformers' ``Conv1D``
    transposed = False
    #: the operation autocast sees (:func:`autocast_input`)
    amp_op = "linear"

    @staticmethod
    def covers(module):
        return _own_forward(module, nn.Linear)

    def trailing(self, module):
        return 1

    def prepare(self, module, x):
        return autocast_input(x, self.amp_op, module.weight)

    def forward(self, module, x):
        return F.linear(x, module.weight, module.bias), (x,)

    def backward_input(self, module, saved, g, need_input):
        return torch.matmul(g, module.weight) if need_input else None

    @staticmethod
    def flat_factors(saved, g):
        """(a (B, T, d), b (B, T, p)): one record's input and output gradient with the positions in one
        dimension; example i's weight gradient is Σ_t b_it a_itᵀ (Li et al. 2022, the ghost norm's factors)."""
        x = saved[0]
        b = x.shape[0]
        return x.reshape(b, -1, x.shape[-1]), g.reshape(b, -1, g.shape[-1])

    def _weight_of(self, a, b):
        """Σ over the rows of (a (n, d), b (n, p)) of the weight gradient in the weight's layout."""
        return a.t() @ b if self.transposed else b.t() @ a

    def prefers_ghost(self, module, uses):
        if not _trainable(module, "weight"):
            return False
        t = sum(self.flat_factors(s, g)[0].shape[1] for s, g in uses)
        return 2 * t * t < module.weight.numel()

    def per_sample(self, module, saved, g):
        a, b = self.flat_factors(saved, g)
        a, b = acc(a), acc(b)
        out = {}
        if _trainable(module, "weight"):
            left, right = (a, b) if self.transposed else (b, a)
            out["weight"] = (
                torch.bmm(left.transpose(1, 2), right) if a.shape[1] > 1 else left[:, 0, :, None] * right[:, 0, None, :]
            )
        if _trainable(module, "bias"):
            out["bias"] = b.sum(1)
        return out

    def joined_factors(self, uses):
        """:meth:`flat_factors` of every use of the layer, joined along the positions."""
        pairs = [self.flat_factors(s, g) for s, g in uses]
        if len(pairs) == 1:
            return pairs[0]
        return torch.cat([a for a, _ in pairs], 1), torch.cat([b for _, b in pairs], 1)

    def ghost_norm_sq(self, module, uses):
        a, b = self.joined_factors(uses)
        t = a.shape[1]
        out = a.new_zeros(a.shape[0], dtype=acc_dtype(a.dtype))
        for s in chunks(a.shape[0], 2 * t * t + t * (a.shape[2] + b.shape[2])):
            out[s] = _gram_norm_sq(acc(a[s]), acc(b[s]))
        if _trainable(module, "bias"):
            bias = acc(b).sum(1)
            out = out + (bias * bias).sum(1)
        return out

    def ghost_inner(self, module, uses, name, m):
        """⟨G_i, M_i⟩ for explicit per-example tensors M (B, *shape) of parameter ``name``: Σ_t b_tᵀ M a_t
        (weight) or Σ_t b_t·M (bias) from the kept factors (for tied parameters, :mod:`.tied`)."""
        a, b = (acc(t) for t in self.joined_factors(uses))
        m = acc(m).to(a.dtype)
        if name == "bias":
            return (b.sum(1) * m).sum(1)
        out = a.new_zeros(a.shape[0])
        for s in chunks(a.shape[0], a.shape[1] * a.shape[2]):
            out[s] = (torch.matmul(b[s], m[s]) * a[s]).sum((1, 2))
        return out

    def ghost_clipped_sum(self, module, uses, w):
        out = {}
        for saved, g in uses:
            a, b = self.flat_factors(saved, g)
            # half precision: float32 copies, a chunk of examples at a time
            parts_of = (
                chunks(a.shape[0], a.shape[1] * (a.shape[2] + b.shape[2])) if a.dtype in _HALF else (slice(None),)
            )
            for s in parts_of:
                bw = acc(b[s]) * w[s].to(acc_dtype(b.dtype)).view(-1, 1, 1)
                parts = {"weight": self._weight_of(acc(a[s]).reshape(-1, a.shape[-1]), bw.reshape(-1, bw.shape[-1]))}
                if _trainable(module, "bias"):
                    parts["bias"] = bw.sum((0, 1))
                add_into(out, parts)
        return out


# Verbatim copies (compared by compiled code, :func:`_same_code`): never reformat or "fix" them.
def _conv1d_forward(self, x):  # verbatim: transformers.pytorch_utils.Conv1D.forward
    size_out = x.size()[:-1] + (self.nf,)  # noqa: RUF005  (verbatim)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x


class Conv1DRule(LinearRule):
    """transformers' ``Conv1D`` (GPT-2, GPT, ...): ``addmm(bias, x, W)`` with W stored (in, out), a
    Linear with a transposed weight; matched by its forward's code (:func:`_same_code`), so
    transformers is never imported.  The same ghost norm and clipped sum as :class:`LinearRule`,
    the per-example gradients in the (in, out) layout."""

    transposed = True
    amp_op = "addmm"

    @staticmethod
    def covers(module):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        return (
            isinstance(weight, nn.Parameter)
            and weight.dim() == 2
            and isinstance(bias, nn.Parameter)
            and _same_code(type(module).forward, _conv1d_forward)
        )

    def forward(self, module, x):
        size_out = (*x.size()[:-1], module.nf)
        return torch.addmm(module.bias, x.view(-1, x.size(-1)), module.weight).view(size_out), (x,)

    def backward_input(self, module, saved, g, need_input):
        return torch.matmul(g, module.weight.t()) if need_input else None


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
        return [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]

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
            raise ValueError(
                f"book-keeping needs batched inputs for {type(module).__name__}; got shape {tuple(x.shape)}"
            )
        x = autocast_input(x, f"conv{nd}d", module.weight)
        if module.padding_mode != "zeros":
            return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        if module.padding == "same":
            total = self._same_total(module)
            if any(t % 2 for t in total):  # as PyTorch: the extra zero on the right/bottom side
                spec = []
                for t in reversed(total):
                    spec += [t // 2, t - t // 2]
                return F.pad(x, spec)
        return x

    def forward(self, module, x):
        out = _CONV_FN[len(module.kernel_size)](
            x, module.weight, module.bias, module.stride, self.padding(module), module.dilation, module.groups
        )
        return out, (x,)

    def _backward(self, module, x, g, weight, groups, mask):
        nd = len(module.kernel_size)
        return torch.ops.aten.convolution_backward(
            g,
            x,
            weight,
            None,
            list(module.stride),
            self.padding(module),
            list(module.dilation),
            False,
            [0] * nd,
            groups,
            mask,
        )

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        return self._backward(module, saved[0], g, module.weight.to(g.dtype), module.groups, [True, False, False])[0]

    def _dims(self, module, g):
        """(groups, T, d, p) of one use."""
        groups = module.groups
        return (
            groups,
            int(math.prod(g.shape[2:])),
            module.in_channels // groups * int(math.prod(module.kernel_size)),
            module.out_channels // groups,
        )

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
            out["bias"] = acc(g).sum(tuple(range(2, g.dim())))
        return out

    def _per_sample_weight(self, module, x, g):
        """G_i for every example: the convolution's weight-gradient kernel on a chunk of k examples
        folded into the channel dimension (groups = k·groups), so no unfolded patches are formed."""
        n, w = x.shape[0], module.weight
        out = w.new_empty((n, *tuple(w.shape)))
        per_example = w.numel() + x[0].numel() + g[0].numel()
        step = max(1, min(32, CHUNK_FLOATS // max(1, per_example)))
        for start in range(0, n, step):
            k = min(step, n - start)
            xs = acc(x[start : start + k]).reshape((1, k * x.shape[1], *tuple(x.shape[2:])))
            gs = acc(g[start : start + k]).reshape((1, k * g.shape[1], *tuple(g.shape[2:])))
            wk = w.unsqueeze(0).expand((k, *tuple(w.shape))).reshape((k * w.shape[0], *tuple(w.shape[1:])))
            gw = self._backward(module, xs, gs, wk, k * module.groups, [False, True, False])[1]
            out[start : start + k] = gw.view((k, *tuple(w.shape)))
        return out

    def _unfold(self, module, x):
        """(B, groups, T, d) patches of the (padded) input; a Conv1d as a 1×L image."""
        pad = self.padding(module)
        if len(module.kernel_size) == 1:
            cols = F.unfold(
                x.unsqueeze(2),
                (1, module.kernel_size[0]),
                dilation=(1, module.dilation[0]),
                padding=(0, pad[0]),
                stride=(1, module.stride[0]),
            )
        else:
            cols = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=pad, stride=module.stride)
        b, dk, t = cols.shape
        return cols.view(b, module.groups, dk // module.groups, t).transpose(2, 3)

    def ghost_norm_sq(self, module, uses):
        groups, _, d, p = self._dims(module, uses[0][1])
        n = uses[0][1].shape[0]
        t_all = sum(self._dims(module, g)[1] for _, g in uses)
        out = uses[0][1].new_zeros(n, dtype=acc_dtype(uses[0][1].dtype))
        for s in chunks(n, groups * (2 * t_all * t_all + t_all * (d + p))):
            a = torch.cat([self._unfold(module, acc(saved[0][s])) for saved, _ in uses], 2)
            b = torch.cat([acc(g[s]).reshape(g[s].shape[0], groups, p, -1).transpose(2, 3) for _, g in uses], 2)
            out[s] = _gram_norm_sq(a, b).sum(1)
        if _trainable(module, "bias"):
            bias = sum(acc(g).sum(tuple(range(2, g.dim()))) for _, g in uses)
            out = out + (bias * bias).sum(1)
        return out

    def ghost_clipped_sum(self, module, uses, w):
        out = {}
        for saved, g in uses:
            gw = acc(g) * w.to(acc_dtype(g.dtype)).view((-1,) + (1,) * (g.dim() - 1))
            parts = {
                "weight": self._backward(
                    module, acc(saved[0]), gw, module.weight.to(gw.dtype), module.groups, [False, True, False]
                )[1]
            }
            if _trainable(module, "bias"):
                parts["bias"] = gw.sum((0, *tuple(range(2, g.dim()))))
            add_into(out, parts)
        return out


# --- Embedding ----------------------------------------------------------------------------------
class EmbeddingRule(Rule):
    """``nn.Embedding`` (any index shape (B, *)): example i's gradient has one row per distinct token
    v, Σ_{t: id_t = v} b_t, so ‖G_i‖² = Σ_v ‖Σ_{t: id_t = v} b_t‖² — formed by a scatter-add over the
    (example, token) pairs, cost ∝ T·p; positions at ``padding_idx`` contribute nothing, as in
    PyTorch's embedding backward.  The clipped sum is the same scatter-add with b_i scaled by w_i.
    ``scale_grad_by_freq`` (a gradient that couples the examples of a batch) and ``sparse`` are not
    covered; ``max_norm`` is not covered either, and the engine refuses it in every mode
    (:func:`~...guards.integrity.check_static_writes`: PyTorch renormalises the looked-up rows in place during
    the forward, an un-noised write to the released model)."""

    ghost_capable = True
    always_ghost = True
    parameters = ("weight",)

    @staticmethod
    def covers(module):
        return _own_forward(module, nn.Embedding) and EmbeddingRule.semantics(module)

    @staticmethod
    def semantics(module):
        return not module.scale_grad_by_freq and not module.sparse and module.max_norm is None

    def trailing(self, module):
        return 0

    def forward(self, module, ids):
        return F.embedding(ids, module.weight, module.padding_idx), (ids,)

    def backward_input(self, module, saved, g, need_input):
        return None

    def prefers_ghost(self, module, uses):
        return True

    def token_gradients(self, module, uses):
        """(ids (B, T), b (B, T, p)) over all uses, padding positions zeroed."""
        ids = torch.cat([s[0].reshape(s[0].shape[0], -1) for s, _ in uses], 1)
        b = torch.cat([acc(g).reshape(g.shape[0], -1, g.shape[-1]) for _, g in uses], 1)
        if module.padding_idx is not None:
            b = b * (ids != module.padding_idx).unsqueeze(-1).to(b.dtype)
        return ids, b

    def ghost_norm_sq(self, module, uses):
        ids, b = self.token_gradients(module, uses)
        n, _t = ids.shape
        key = torch.arange(n, device=ids.device).unsqueeze(1) * module.num_embeddings + ids
        uniq, inv = torch.unique(key.reshape(-1), return_inverse=True)
        rows = b.new_zeros((uniq.numel(), b.shape[-1])).index_add_(0, inv, b.reshape(-1, b.shape[-1]))
        return b.new_zeros(n).index_add_(
            0, torch.div(uniq, module.num_embeddings, rounding_mode="floor"), (rows * rows).sum(1)
        )

    def per_sample(self, module, saved, g):
        """G_i (B, V, d): row v of example i is the sum of its output gradients at token v (used where a
        tied parameter's cross term has no ghost rule, a chunk of examples at a time)."""
        ids, b = self.token_gradients(module, [(saved, g)])
        n, v = ids.shape[0], module.num_embeddings
        key = (torch.arange(n, device=ids.device).unsqueeze(1) * v + ids).reshape(-1)
        rows = b.new_zeros((n * v, b.shape[-1])).index_add_(0, key, b.reshape(-1, b.shape[-1]))
        return {"weight": rows.view(n, v, -1)}

    def ghost_inner(self, module, uses, name, m):
        """⟨G_i, M_i⟩ = Σ_t e_t·M_i[x_t] for explicit per-example tensors M (B, V, d) (tied parameters)."""
        ids, b = self.token_gradients(module, uses)
        b = acc(b)
        m = acc(m).to(b.dtype)
        picked = torch.gather(m, 1, ids.unsqueeze(-1).expand(-1, -1, m.shape[-1]))
        return (picked * b).sum((1, 2))

    def ghost_clipped_sum(self, module, uses, w):
        ids, b = self.token_gradients(module, uses)
        bw = (b * w.to(b.dtype).view(-1, 1, 1)).reshape(-1, b.shape[-1])
        return {"weight": torch.zeros_like(module.weight, dtype=bw.dtype).index_add_(0, ids.reshape(-1), bw)}


# --- Normalisation layers -----------------------------------------------------------------------
class _AffineNormRule(Rule):
    """Affine normalisation layers: y = x̂ ⊙ γ + β.  Example i's gradients are γ_i = Σ x̂ ⊙ b and
    β_i = Σ b over its positions — per-sample gradients of the size of γ (C numbers), always formed
    directly.  The forward and the input gradient are PyTorch's native kernels (their mean and
    inverse standard deviation are kept for x̂)."""

    def per_sample(self, module, saved, g):
        x, mean, rstd = (acc(t) for t in saved)
        g = acc(g)
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

    def prepare(self, module, x):
        return autocast_input(x, "group_norm" if isinstance(module, nn.GroupNorm) else "instance_norm", module.weight)

    def forward(self, module, x):
        if x.dim() < 2 or (not isinstance(module, nn.GroupNorm) and x.dim() != module._get_no_batch_dim() + 1):
            raise ValueError(
                f"book-keeping needs batched inputs for {type(module).__name__}; got shape {tuple(x.shape)}"
            )
        n, c = x.shape[0], x.shape[1]
        out, mean, rstd = torch.ops.aten.native_group_norm(
            x.contiguous(),
            module.weight,
            module.bias,
            n,
            c,
            int(math.prod(x.shape[2:])),
            self._groups(module),
            module.eps,
        )
        return out, (x, mean, rstd)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        x, mean, rstd = saved
        n, c = x.shape[0], x.shape[1]
        return torch.ops.aten.native_group_norm_backward(
            g.contiguous(),
            x.contiguous(),
            mean,
            rstd,
            module.weight,
            n,
            c,
            int(math.prod(x.shape[2:])),
            self._groups(module),
            [True, False, False],
        )[0]

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

    def trailing(self, module):
        return len(module.normalized_shape)

    def prepare(self, module, x):
        return autocast_input(x, "layer_norm", module.weight)

    def forward(self, module, x):
        if x.dim() <= len(module.normalized_shape):
            raise ValueError(f"book-keeping needs batched inputs for LayerNorm; got shape {tuple(x.shape)}")
        out, mean, rstd = torch.ops.aten.native_layer_norm(
            x, list(module.normalized_shape), module.weight, module.bias, module.eps
        )
        return out, (x, mean, rstd)

    def backward_input(self, module, saved, g, need_input):
        if not need_input:
            return None
        x, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(
            g.contiguous(),
            x,
            list(module.normalized_shape),
            mean,
            rstd,
            module.weight,
            module.bias,
            [True, False, False],
        )[0]

    def _xhat(self, module, x, mean, rstd):
        return (x - mean) * rstd

    @staticmethod
    def _reduce(module, t):
        k = len(module.normalized_shape)
        middle = tuple(range(1, t.dim() - k))
        return t.sum(middle) if middle else t


# --- Weight-only normalisations (RMSNorm and its Hugging Face forms) ----------------------------
# Verbatim copies of transformers' forwards (compared by compiled code, :func:`_same_code`; never called).
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
        return all(_same_code(getattr(cls, name, None), ref) for name, ref in self.references)

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
        return _own_forward(module, nn.RMSNorm) and module.elementwise_affine

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
        if not _trainable(module, "weight"):
            return {}
        return {"weight": acc(self.form(module).weight_grads(module, saved[0], g))}


#: the rules in the order they are tried
RULES: tuple[Rule, ...] = (
    LinearRule(),
    ConvRule(),
    EmbeddingRule(),
    GroupNormRule(),
    LayerNormRule(),
    Conv1DRule(),
    ScaleNormRule(),
)


def rule_for(module: nn.Module) -> Rule | None:
    """The rule covering ``module`` (None: not covered; Opacus's per-sample gradient then)."""
    for rule in RULES:
        if rule.covers(module):
            return rule
    return None


def _calls_super(fn, base: type) -> bool:
    """``fn`` calls the base class's forward: ``super().forward(x)``, or ``Base.forward(self, x)`` by name
    (``nn.LayerNorm.forward(self, x)``)."""
    code = getattr(fn, "__code__", None)
    names = code.co_names if code is not None else ()
    return "forward" in names and ("super" in names or base.__name__ in names)


#: (rule, base class, the functional operation its forward calls, the position of the weight in it)
ROUTED = (
    (LinearRule(), nn.Linear, F.linear, 1),
    (EmbeddingRule(), nn.Embedding, F.embedding, 1),
    (LayerNormRule(), nn.LayerNorm, F.layer_norm, 2),
)


def routed_rule(module: nn.Module):
    """(rule, functional operation, weight position) for a subclass of a covered layer with a forward
    of its own that calls the base class's (``super().forward(ids) * scale``: Gemma's and BART's scaled
    word embeddings, OPT's learned positions; ``nn.LayerNorm.forward(self, x)``): the rule applies where the base
    forward's operation meets the module's own weight (:mod:`.provenance` routes it); None otherwise."""
    if rule_for(module) is not None:
        return None
    for rule, base, fn, pos in ROUTED:
        if (
            isinstance(module, base)
            and type(module).forward is not base.forward
            and _calls_super(type(module).forward, base)
            and (base is not nn.Embedding or EmbeddingRule.semantics(module))
            and (base is not nn.LayerNorm or module.elementwise_affine)
        ):
            return rule, fn, pos
    return None
