"""Token routing in book-keeping: a mixture-of-experts dispatch known to be a row-by-row map.

In a token-level mixture of experts (Mixtral, Qwen2-MoE and the other copies of transformers' eager experts
dispatch) a router picks experts per token, data-dependently; the dispatch loops over the experts some token
picked, gathers their tokens' rows by index, applies the expert and adds the results back into the same rows
by the same index (``index_add_``).  Each token's output depends on its own hidden state, its own routing
(``top_k_index``, ``top_k_weights``) and the expert weights only: a row-by-row map, attributable to examples
as any row-wise layer is.  Provenance (:mod:`.provenance`) cannot see that operation by operation: which
experts are hit and how many tokens each gets are read into Python (``nonzero``, ``where``), values of the
whole batch, which it refuses in general since such a value could steer any computation.  This dispatch is
recognised by its code (a verbatim copy below, compared as :mod:`.rules` compares transformers' norms), so
those values provably only choose which rows are gathered and where they go back; its output gets the rows
of its token inputs.

Only a dispatch with no trainable parameter is handled here (the experts frozen, LoRA adapters elsewhere):
trainable experts are a fallback unit of the book-keeper (functorch per example).  A dispatch that caps the
tokens per expert across the batch (Switch Transformers' expert capacity), another implementation
(``grouped_mm``), or a load-balancing loss that averages router probabilities over the batch is not this
code: provenance follows it and refuses what mixes examples.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import provenance
from .intercept import override_forward, plain_forward
from .rules import same_code


def _eager_experts_forward(
    self,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:  # verbatim: transformers.models.mixtral.modeling_mixtral.MixtralExperts.forward (eager)
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


_ROW_MAPS = (_eager_experts_forward,)


def is_row_map(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a dispatch of :data:`_ROW_MAPS` (under transformers'
    ``use_experts_implementation``: its original forward, with the eager implementation configured)."""
    forward = type(module).forward
    original = getattr(forward, "__wrapped__", None)
    if original is not None:
        if getattr(getattr(module, "config", None), "_experts_implementation", None) not in (None, "eager"):
            return False
        forward = original
    return any(same_code(forward, known, names=("torch", "nn")) for known in _ROW_MAPS)


class RowMapForward:
    """A frozen row-by-row dispatch's ``forward`` while the book-keeper is attached: inside the model's forward,
    on token rows whose inputs all have the same rows of the batch, it runs untracked and its output gets those
    rows; otherwise (no forward in progress, inputs shared by the batch or of mixed rows) provenance follows it
    operation by operation, as any module."""

    def __init__(self, keeper, module: nn.Module):
        self.keeper, self.module = keeper, module

    def __call__(self, *args, **kwargs):
        module = self.module
        mode = provenance.current()
        if mode is None or not (self.keeper.active and torch.is_grad_enabled()):
            return type(module).forward(module, *args, **kwargs)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
        rows = [mode.tags.get(t) for t in leaves]
        first = rows[0] if rows else None
        aligned = (
            first is not None
            and first.known
            and first.dim == 0
            and all(r is not None and r.known and (r.dim, r.group) == (0, first.group) for r in rows)
            and all(t.dim() > 0 and t.shape[0] == leaves[0].shape[0] for t in leaves)
        )
        if not aligned:
            return type(module).forward(module, *args, **kwargs)
        mode.pause()
        try:
            out = type(module).forward(module, *args, **kwargs)
        finally:
            mode.resume()
        mode.tags[out] = first
        return out

    def __deepcopy__(self, memo):  # a copy (or a pickle) of the model gets its plain forward back
        return _Plain(memo.get(id(self.module), self.module))

    def __reduce__(self):
        return _Plain, (self.module,)


class _Plain:
    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def refuse_mixed_outputs(mode, output) -> None:
    """Refuse a named output of the model's forward (a ``ModelOutput`` field, a dict key) that requires a gradient
    and whose rows are of no single example, but the ``loss`` (a reduction of the per-example losses, which
    the engine scales as the loss reduction says): a Mixtral/Qwen2-MoE/Switch ``aux_loss``, the load-balancing
    loss that averages the router's probabilities over every token of the batch, makes each example's gradient
    depend on the others, and per-example clipping does not bound that."""
    if not isinstance(output, dict):
        return
    for name, value in output.items():
        if name == "loss" or not torch.is_tensor(value) or not value.requires_grad:
            continue
        rows = mode.tags.get(value)
        if rows is not None and not rows.known:
            raise provenance.RefusedRows(
                f"grad_sample_mode='bk': the model's output {name!r} mixes the examples of the batch (it comes from "
                f"{rows.mixed!r} across the batch dimension): a loss of the whole batch, such as a mixture of experts' "
                "load-balancing loss (the router's probabilities averaged over every token of the batch), makes each "
                "example's gradient depend on the others, which per-example clipping does not bound; turn it off "
                "(output_router_logits=False, or router_aux_loss_coef=0) or compute such a term per example"
            )


def install(keeper, model: nn.Module) -> list[nn.Module]:
    """Route every frozen row-by-row dispatch of ``model`` through :class:`RowMapForward`; the modules routed."""
    out = []
    for m in model.modules():
        if "forward" not in m.__dict__ and not any(p.requires_grad for p in m.parameters()) and is_row_map(m):
            override_forward(m, RowMapForward(keeper, m))
            out.append(m)
    return out


def remove(modules) -> None:
    for m in modules:
        plain_forward(m, RowMapForward)
