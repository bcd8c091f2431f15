"""Book-keeping's plan of a model: which unit keeps each module owning trainable parameters.

:func:`plan_layers` walks the model as Opacus's ``GradSampleModule`` does and gives each such module its
rule (:mod:`.rules`, a covered layer), :class:`Routed` (a covered layer's subclass whose forward calls
the base class's), :data:`DIRECT_UNIT` (own parameters used directly in its forward) or None (a fallback
unit); parameters shared with anything but covered layers are refused here, before anything is attached.
:func:`summarize_paths` puts the layers' paths in one line.
"""

from __future__ import annotations

from opacus.grad_sample import GradSampleModule
from torch import nn
from torch.nn.utils import parametrize

from ....validation import InvalidParameterError
from .rules import routed_rule, rule_for

#: plan_layers' kind for a module whose own parameters are used directly in its forward (:class:`~.units.DirectUnit`)
DIRECT_UNIT = "direct"


class Routed:
    """The plan of a covered layer's subclass whose own forward calls the base class's
    (:func:`~.rules.routed_rule`): its rule applies where that forward's operation meets the weight."""

    def __init__(self, rule, fn, pos):
        self.rule, self.fn, self.pos = rule, fn, pos

    def __repr__(self):
        return f"Routed({type(self.rule).__name__} at {getattr(self.fn, '__name__', self.fn)})"


_BASES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv1d, nn.Conv2d)


def _unit_kind(module: nn.Module, rule):
    """How a module owning trainable parameters is book-kept: its rule; ``DIRECT_UNIT`` when no rule and no
    Opacus grad sampler covers it, it has trainable submodules (functorch over the whole module would
    take them off their own rules), and each own trainable parameter has a leading dimension of 1 —
    shaped to broadcast over the batch, as ViT's class token (1, 1, d) and position embedding
    (1, N, d): own parameters tracked through its forward; else None (a fallback unit: Opacus's grad
    sampler, or functorch over the whole module, which any forward of independent examples allows)."""
    if rule is not None or type(module) in GradSampleModule.GRAD_SAMPLERS:
        return rule
    routed = routed_rule(module)
    if routed is not None:
        return Routed(*routed)
    if isinstance(module, _BASES) and type(module).forward not in {b.forward for b in _BASES}:
        return DIRECT_UNIT  # a layer's subclass with a forward of its own (FalconLinear: x @ W.T + b)
    mine = {id(p) for p in module.parameters(recurse=False)}
    if any(p.requires_grad and id(p) not in mine for p in module.parameters()):
        return DIRECT_UNIT  # own parameters used directly, trainable submodules on their own rules
    return None


def _check_rule_parameters(name: str, module: nn.Module, rule) -> None:
    extra = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad and n not in rule.parameters]
    if extra:
        raise InvalidParameterError(
            "module",
            f"layer {name!r} ({type(module).__name__}) with trainable parameter(s) {', '.join(extra)}",
            f"grad_sample_mode='bk' trains only {', '.join(rule.parameters)} of this layer type, so they would "
            "receive noise only (e.g. the deprecated torch.nn.utils.weight_norm's weight_g/weight_v: use "
            "torch.nn.utils.parametrizations.weight_norm, which book-keeping trains as a fallback layer); or "
            "freeze them",
        )


def _aliases_only(module: nn.Module) -> bool:
    """Whether every parameter ``module`` registers itself is also a parameter of one of its submodules (Opacus's
    ``RenameParamsMixin``: DPLSTM's ``weight_ih_l0`` is its cell's ``l0.ih.weight``, an RNNLinear): the module
    is a container whose submodules own the parameters (functorch over it would reparametrize the alias only,
    and the cells would keep the real ones: per-example gradients of zero)."""
    own = list(module.parameters(recurse=False))
    if not own:
        return False
    below = {id(p) for child in module.children() for p in child.parameters()}
    return all(id(p) in below for p in own)


def plan_layers(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(name, module, rule, ``DIRECT_UNIT`` or None for a fallback unit) for every module owning trainable
    parameters, as Opacus's ``GradSampleModule`` walks a model (a module reached twice is planned
    once); a module with a parametrization (``torch.nn.utils.parametrize``, e.g.
    ``parametrizations.weight_norm``: its parameters live in ``parametrizations.<name>.original*``)
    is one fallback unit with its whole subtree.  A parameter shared by covered layers is tied (cross
    terms, :mod:`.tied`); one shared with any other unit is refused, as is a covered layer owning
    a trainable parameter its rule does not train (it would get noise only)."""
    plan, owner, seen = [], {}, set()

    def walk(module, prefix):
        if id(module) in seen:
            return
        seen.add(id(module))
        parametrized = parametrize.is_parametrized(module)
        if not parametrized and _aliases_only(module):  # Opacus's DPLSTM/DPGRU/DPRNN: a container
            for child_name, child in module.named_children():
                walk(child, f"{prefix}.{child_name}" if prefix else child_name)
            return
        if any(p.requires_grad for p in module.parameters(recurse=False)) or (
            parametrized and any(p.requires_grad for p in module.parameters())
        ):
            rule = None if parametrized else rule_for(module)
            name = prefix or type(module).__name__
            if rule is not None:
                _check_rule_parameters(name, module, rule)
            kind = None if parametrized else _unit_kind(module, rule)
            if isinstance(kind, Routed):
                _check_rule_parameters(name, module, kind.rule)
            whole = kind is None and type(module) not in GradSampleModule.GRAD_SAMPLERS
            params = module.parameters(recurse=whole)
            covered = kind is not None and kind != DIRECT_UNIT
            for p in params:
                if not p.requires_grad:
                    continue
                if id(p) in owner and not (covered and owner[id(p)][1]):
                    raise InvalidParameterError(
                        "module",
                        f"a parameter shared by {owner[id(p)][0]!r} and {name!r}",
                        "grad_sample_mode='bk' ties parameters only between layers it covers (Linear, Embedding, "
                        "...); use grad_sample_mode='hooks'",
                    )
                owner.setdefault(id(p), (name, covered))
            plan.append((name, module, kind))
            if whole:
                return
        for child_name, child in module.named_children():
            walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    walk(model, "")
    return plan


def summarize_paths(paths: dict[str, str]) -> str:
    """One line: which layers take which path."""
    groups: dict[str, list[str]] = {}
    for name, path in paths.items():
        groups.setdefault(path, []).append(name)
    return "; ".join(f"{path}: {', '.join(names)}" for path, names in groups.items()) or "no trainable layers"
