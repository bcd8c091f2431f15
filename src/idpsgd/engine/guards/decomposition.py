"""Every mode proves its per-example decomposition: the per-example gradients add up to autograd's.

DP-SGD's sensitivity bound (Abadi et al. 2016; Boenisch et al. 2023, Alg. 3 line 6) holds for the
update only if the gradients that are clipped are the whole update: Σ_i g_i, over the examples of the
step, must be the gradient autograd computes for the summed loss.  A per-example rule that misses a
use of a parameter (a weight also used outside its own layer: ``l(x) + k·F.linear(x, l.weight)``, a
hand-tied LM head ``h @ emb.weight.T``, a forward hook reading ``layer.weight``), or a rule that reads
its inputs wrongly (the unfold of a channels-last convolution input, :mod:`..per_example.per_sample_rules`), breaks that
equation — silently: in ghost mode the missing gradient enters the update but not the norm the clip
factor comes from (issue 46 measured ‖ΔS‖ = 1.99 / 3.98 / 9.95 × c), in the per-sample modes it is
dropped from the update.  This module checks the equation, per parameter, before the noise:

* per-sample modes (``hooks``, ``functorch``, ``no_op``): Σ_i g_i (``p.grad_sample``, before clipping)
  against ``p.grad``, which Opacus's hooks leave as autograd's gradient of the reduced loss;
* ``ew``: PyTorch's ExpandedWeights computes per-example gradients for *every* use of a parameter
  inside the model's call and leaves ``p.grad`` unset; a ``p.grad`` that is not zero holds a use
  outside the call (e.g. a penalty on the weights added to the loss), which no row carries;
* ``ghost``: each layer's own Σ_i a_iᵀ b_i (Linear, Embedding: from the first backward pass's layer
  inputs and output gradients; the other layers: the rule's per-example gradients summed) against
  the first pass's ``p.grad`` (on FSDP2: the sums reduce-scattered into its shards,
  :class:`~..distributed.fsdp.ShardedDecompositionCheck`);
* ``bk``: no check here — book-keeping's provenance refuses any use of a parameter it cannot attribute
  to rows (:mod:`..per_example.bk.provenance`), and its fallback layers' autograd gradient is discarded.

The rows are compared in the precision they were computed in: a parameter's mismatch is
‖Σ_i g_i − G‖ > rtol · Σ_i ‖g_i‖, the right side over the whole model's per-example gradients (the
triangle inequality bounds both sums' rounding by the sum of the norms of the terms; a missing use of
the weight makes the left side of the order of the gradient itself).  A
mismatch refuses the step before the noise (:class:`DecompositionError`, raised by the step guard),
naming the parameter and the relative difference.

Cost and schedule (docs/performance.md, "The decomposition check"): the check runs at the steps of
the public, data-independent schedule :func:`due` — the first :data:`FIRST_STEPS` steps of a phase
and every step whose number is a power of two — where it costs one sum over the per-example
gradients (per-sample modes) or one extra product per Linear layer and a second pass of the
per-sample rule of the other layers (ghost).  ``every_step=True`` checks every step (on a phase's
optimizer: ``optimizer.guard.decomposition.every_step = True``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..opacus_compat import UnsupportedModuleError
from .integrity import local_tensor

#: how far the two sums may differ, relative to Σ_i ‖g_i‖, by the precision of the per-example rows:
#: float32 leaves room for TF32 convolutions and matmuls on GPUs (10-bit mantissa, ~5e-4 relative),
#: half precision for its own rounding (fp16 ~5e-4 per operation, bf16 ~4e-3); float64 for layers
#: whose functional rules compute in float32 inside (Gemma's RMSNorm under hooks: 2.2e-9 measured).
#: A missing use of a weight gives a difference of the order of its gradient: 1.88 in the tests.
RTOL = {torch.float64: 1e-6, torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
#: the first steps of a phase are all checked (a model's decomposition is a property of its code)
FIRST_STEPS = 8


class DecompositionError(UnsupportedModuleError):
    """The per-example gradients of a parameter do not add up to autograd's gradient of the summed
    loss: the step is refused before the noise (the CLI exits 2 with this line)."""


def due(step: int, first: int = FIRST_STEPS) -> bool:
    """Whether logical step ``step`` (1-based) of a phase is checked: the first ``first`` steps, then
    every step whose number is a power of two (a schedule of the step count only: public)."""
    return step <= first or step & (step - 1) == 0


def rtol(*dtypes: torch.dtype) -> float:
    """The tolerance of the least precise of ``dtypes`` (:data:`RTOL`)."""
    return max(RTOL.get(d, RTOL[torch.float32]) for d in dtypes)


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class DecompositionCheck:
    """One phase's decomposition check: the probes of its mode record what they compare, the step guard
    (:meth:`guard`) refuses a step with a mismatch before the noise.

    ``names``: parameter → its name in the user's module; ``ranks_average``: the model is in torch's
    ``DistributedDataParallel``, whose ``p.grad`` is the ranks' average (the local sums are all-reduced
    on checked steps)."""

    def __init__(self, names: dict[int, str], every_step: bool = False, ranks_average: bool = False):
        self.names, self.every_step, self.ranks_average = names, every_step, ranks_average
        self.step = 1  # the logical step about to be taken
        self.mismatch: str | None = None
        self._sums: dict[nn.Parameter, list] = {}  # ghost: parameter -> [layer sum, dtype]
        self._before: dict[nn.Parameter, torch.Tensor] = {}  # ghost: a p.grad left from before the pass
        self._open, self._n = False, 1
        #: ew: ``p.grad`` holds only the uses outside the per-example computation (module docstring)
        self.grad_is_outside = False
        #: no_op: the parameters autograd accumulated a gradient into since the last step (None: every
        #: parameter's ``p.grad`` is autograd's, as in the engine's own per-sample modes)
        self.touched: set[int] | None = None

    def compare_outside_uses(self) -> None:
        """ew: ``p.grad`` holds only the uses outside the per-example computation (compared with zero)."""
        self.grad_is_outside = True

    def watch_backward(self, params) -> None:
        """no_op: compare only the parameters a backward pass reached since the last step (autograd's
        post-accumulate hook marks each); the others' rows come from ``torch.func``, the user's own."""
        self.touched = seen = set()
        for p in params:
            p.register_post_accumulate_grad_hook(lambda q, seen=seen: seen.add(id(q)))

    def grads_zeroed(self) -> None:
        """The optimizer's ``zero_grad``: the next backward pass starts anew (no_op: nothing reached yet)."""
        if self.touched is not None:
            self.touched.clear()

    @property
    def due(self) -> bool:
        return self.every_step or due(self.step)

    # --- the comparison ---------------------------------------------------------------------------
    def judge(self, entries: list, per_example: list[torch.Tensor]) -> None:
        """Record the first mismatch among ``entries`` = [(parameter, its rows' sum, autograd's gradient
        or None, the rows' dtypes)], each relative to Σ_i ‖g_i‖ of the whole model (``per_example``: each
        parameter's per-example norms).  The whole model's norms are the scale because rounding follows the
        magnitude of the terms summed, not of the result: a parameter whose gradient cancels to zero
        (a key bias under softmax) has both sums at rounding level."""
        if not entries or (self.mismatch is not None and not self.ranks_average):
            return  # (with DDP every rank joins the collectives below, at every checked pass)
        device = entries[0][1].device
        norms = [_acc(n).reshape(-1).to(device) for n in per_example]
        if not norms:
            total = torch.zeros((), device=device)
        elif len({len(n) for n in norms}) == 1:
            total = torch.stack(norms).norm(dim=0).sum()
        else:  # (rows differ between parameters: the sum of the parameters' sums, an upper bound)
            total = torch.stack([n.sum() for n in norms]).sum()
        diffs, tols = [], []
        for _p, rows_sum, grad, dtypes in entries:
            rows_sum = _acc(rows_sum.detach())
            ref = torch.zeros_like(rows_sum) if grad is None else _acc(grad.detach()).to(rows_sum.device)
            if self.ranks_average:  # torch DDP: p.grad is the ranks' average
                import torch.distributed as dist

                rows_sum = rows_sum.clone()
                dist.all_reduce(rows_sum)
                rows_sum /= dist.get_world_size()
            diffs.append(torch.linalg.vector_norm((rows_sum - ref.reshape(rows_sum.shape)).double()))
            tols.append((rtol(*dtypes, ref.dtype), rows_sum.dtype))
        if self.ranks_average:
            import torch.distributed as dist

            total = total.clone()
            dist.all_reduce(total)
            total /= dist.get_world_size()
        if self.mismatch is not None:
            return
        scale, *diffs = torch.stack([total.double(), *diffs]).tolist()  # one device synchronisation
        self.verdict([p for p, *_ in entries], diffs, tols, scale)

    def verdict(self, params: list, diffs: list[float], tols: list, scale: float) -> None:
        """Record the first parameter of ``params`` whose difference ‖Σ_i g_i − G‖ (``diffs``) exceeds its
        tolerance (``tols``: (rtol, dtype of the rows' sum)) times ``scale`` = Σ_i ‖g_i‖."""
        if not math.isfinite(scale):  # an example overflowed (half precision): autograd's sum holds its inf/nan
            return  # and the optimizer leaves it out (factor 0); nothing to compare this pass with
        for p, diff, (tol, dtype) in zip(params, diffs, tols, strict=True):
            if diff <= tol * scale + 1e-30:  # nan/inf compare False: refused as well
                continue
            rel = diff / scale if scale > 0 else float("inf")
            name = self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
            self.mismatch_parameter = name
            self.mismatch = (
                f"parameter {name}'s per-example gradients do not add up to autograd's gradient of the summed "
                f"loss (difference {rel:.3g} of the examples' summed gradient norms > {tol:g} for {dtype}): a "
                "use of the parameter outside its own layer (e.g. F.linear(x, layer.weight), a tied head "
                "h @ emb.weight.T, a forward hook or a loss term reading the weight) or a per-example rule "
                "that reads its layer wrongly; the clipped update would not be bounded by the clip norm. The "
                "step was refused before the noise. Use the parameter through its own layer only, or "
                "grad_sample_mode='bk'"
            )
            return

    # --- per-sample modes (hooks, functorch, no_op, ew) ------------------------------------------
    def check_per_sample(self, params, loss_reduction: str) -> None:
        """Σ_i g_i of each parameter's ``p.grad_sample`` (one chunk per backward pass: a "mean" loss
        divided each pass's rows by its batch size) against ``p.grad``; with :attr:`grad_is_outside`
        (``ew``) ``p.grad`` holds only uses outside the per-example computation, compared with zero."""
        entries, per_example = [], []
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                continue
            chunks = gs if isinstance(gs, list) else [gs]
            total, norms = torch.zeros(p.shape, dtype=_acc(chunks[0]).dtype, device=chunks[0].device), []
            for g in chunks:
                n = len(g) if loss_reduction == "mean" else 1
                if len(g) == 0:
                    continue
                g = _acc(g)
                total = total + g.sum(0) / n
                norms.append(torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1) / n)
            if norms:
                per_example.append(torch.cat(norms))
            dtypes = [c.dtype for c in chunks]
            if self.grad_is_outside:
                outside = torch.zeros_like(total) if p.grad is None else _acc(p.grad).reshape(total.shape)
                entries.append((p, total, total + outside, dtypes))
            elif self.touched is None or id(p) in self.touched:
                entries.append((p, total, p.grad, dtypes))
            # no_op without a backward pass through the parameter (per-sample gradients from torch.func):
            # no autograd gradient to compare with; the rows are the user's own (docs/opacus.md)
        self.judge(entries, per_example)

    # --- ghost (two backward passes) -------------------------------------------------------------
    def open_pass(self, params) -> None:
        """At the first layer call of a checked ghost step: remember a ``p.grad`` left from before."""
        if self._open:
            return
        self._open, self._sums, self._before = True, {}, {}
        grads = [(p, local_tensor(p.grad).detach()) for p in params if p.grad is not None]  # (FSDP2: the shard)
        if grads:  # usually zeros (zero_grad before the forward): copied only where not (memory)
            device = grads[0][1].device
            peaks = torch.stack([g.abs().amax().float().to(device) for _, g in grads]).tolist()
            self._before = {p: g.clone() for (p, g), peak in zip(grads, peaks, strict=True) if peak != 0}

    def add_layer(self, module: nn.Module, activations, backprops: torch.Tensor, n: int, ghost: bool, sampler):
        """(Between :meth:`open_pass` and :meth:`close_pass`.)  Add the layer's own gradient Σ_i a_iᵀ b_i
        (``backprops`` already multiplied by ``n``, the batch size, for a "mean" loss) to its parameters'
        sums: closed forms for the ghost-norm layers (Linear, Embedding), the rule's per-example gradients
        summed for the others."""
        if not self._open:
            return
        dtype, self._n = backprops.dtype, n
        with torch.no_grad():
            if ghost and isinstance(module, nn.Linear):
                b = _acc(backprops).reshape(-1, backprops.shape[-1])
                a = _acc(activations[0]).reshape(-1, activations[0].shape[-1]).to(b.dtype)
                sums = {module.weight: b.T @ a}
                if module.bias is not None:
                    sums[module.bias] = b.sum(0)
            elif ghost and isinstance(module, nn.Embedding):
                ids = activations[0].reshape(-1)
                b = _acc(backprops).reshape(-1, module.embedding_dim)
                w = torch.zeros(module.weight.shape, dtype=b.dtype, device=b.device).index_add_(0, ids, b)
                if module.padding_idx is not None:
                    w[module.padding_idx] = 0  # autograd leaves the padding row's gradient zero
                sums = {module.weight: w}
            else:
                sums = {p: _acc(g).sum(0) for p, g in sampler(module, activations, backprops).items()}
        for p, s in sums.items():
            if not p.requires_grad:
                continue
            s = s / n
            if p in self._sums:
                self._sums[p][0] = self._sums[p][0] + s
            else:
                self._sums[p] = [s, dtype]

    def close_pass(self, params) -> None:
        """After the first backward pass of a checked ghost step (the per-example norms are formed):
        each parameter's layer sums against the pass's ``p.grad``; the norms from ``p._norm_sample``."""
        if not self._open:
            return
        if not self._sums:  # zero_grad between the forward and the backward pass: the pass starts from zero
            self._before = {}
            return
        self._open, n = False, self._n
        sums, before = self._sums, self._before
        self._sums, self._before = {}, {}
        entries, per_example = [], []
        for p in params:
            s, dtype = sums.get(p, (torch.zeros_like(p), p.dtype))
            grad = p.grad
            if grad is not None and p in before:
                grad = grad - before[p]
            entries.append((p, s, grad, [dtype]))
            norms = getattr(p, "_norm_sample", None)
            if norms is not None and norms.numel():
                per_example.append(norms / n)
        self.judge(entries, per_example)

    # --- the step guard --------------------------------------------------------------------------
    def guard(self) -> None:
        """Before the noise of a logical step: refuse it if a checked pass found a mismatch."""
        mismatch, name = self.mismatch, getattr(self, "mismatch_parameter", "")
        self.reset()
        self.step += 1
        if mismatch is not None:
            raise DecompositionError("module", name, mismatch)

    def reset(self) -> None:
        """Forget what this step recorded (after the guard, or a step refused elsewhere)."""
        self.mismatch, self._sums, self._before, self._open = None, {}, {}, False
        if self.touched is not None:
            self.touched.clear()


# --- how each mode's probes attach (the ``decomposition`` field of :class:`~..modes.GradSampleMode`) ---
def probe_per_sample(check: DecompositionCheck, wrapped, optimizer) -> None:
    """hooks, functorch, no_op: the optimizer compares Σ_i g_i with ``p.grad`` before clipping."""
    optimizer.use_decomposition(check)


def probe_user_rows(check: DecompositionCheck, wrapped, optimizer) -> None:
    """no_op: as :func:`probe_per_sample` for the parameters a backward pass of the step reached
    (autograd's gradient hook marks them); rows from ``torch.func`` with no backward pass are the user's."""
    check.watch_backward(optimizer.params)
    optimizer.use_decomposition(check)


def probe_expanded_weights(check: DecompositionCheck, wrapped, optimizer) -> None:
    """ew: as :func:`probe_per_sample`, ``p.grad`` holding only uses outside the model's call."""
    check.compare_outside_uses()
    optimizer.use_decomposition(check)


def probe_layers(check: DecompositionCheck, wrapped, optimizer) -> None:
    """ghost: the module adds each layer's own sum during the first backward pass; the optimizer's
    ``zero_grad`` (called between the two passes by Opacus's loss wrapper) compares them with ``p.grad``."""
    wrapped.use_decomposition(check)
    optimizer.use_decomposition(check)


__all__ = [
    "FIRST_STEPS",
    "RTOL",
    "DecompositionCheck",
    "DecompositionError",
    "due",
    "probe_expanded_weights",
    "probe_layers",
    "probe_per_sample",
    "probe_user_rows",
    "rtol",
]
