"""Per-example gradients of a module that ``torch.func`` cannot transform: one autograd pass per example.

A layer no rule or grad sampler covers gets its per-example gradients from ``torch.func`` (``vmap`` over
``grad`` of the module's forward: Opacus's ``ft_compute_per_sample_gradient``, book-keeping's whole-module
fallback).  A custom ``torch.autograd.Function`` written in the old style (a static ``forward(ctx, ...)``,
no ``setup_context``) cannot run under those transforms: torch raises.  Its per-example gradients are
still well defined (the module acts on each example alone), and plain autograd computes them exactly —
one backward pass per example of that module only, a Python loop over the examples, as the
whole-module fallback already does for data-dependent control flow.  Used for that case only.
"""

from __future__ import annotations

import torch


def functorch_refuses(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing to transform an ``autograd.Function`` without ``setup_context``."""
    return isinstance(exc, RuntimeError) and "setup_context" in str(exc)


def per_example_autograd(loss_of, params: dict, batch: int) -> dict:
    """{name: (B, *shape)}: for each example i, the gradient with respect to ``params`` of ``loss_of(i, leaves)``
    (``leaves``: the parameters as fresh leaves, by name), by ``torch.autograd.grad``; zero where a parameter
    does not reach example i's loss."""
    leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    rows: dict = {n: [] for n in leaves}
    with torch.enable_grad():
        for i in range(batch):
            grads = torch.autograd.grad(loss_of(i, leaves), list(leaves.values()), allow_unused=True)
            for (n, leaf), gi in zip(leaves.items(), grads, strict=True):
                rows[n].append(torch.zeros_like(leaf) if gi is None else gi)
    return {n: torch.stack(v) if v else leaves[n].new_zeros((0, *leaves[n].shape)) for n, v in rows.items()}


__all__ = ["functorch_refuses", "per_example_autograd"]
