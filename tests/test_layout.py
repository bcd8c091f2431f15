"""Issue 41: the package's layout — no import circle of any length, lazy in-function imports
included, and no private name imported from another module.

The package-wide checks need helper "names"'s branch (the audit circle, the CLI's and accounting's
private imports) and fail on the engine branch alone; the engine-only checks pass on their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "idpsgd").rglob("*.py"):
        name = ".".join(f.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Module import graph (``from . import x`` is an edge to ``x``) and the private names imported
    across modules as (importer, defining module, name)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, f in mods.items():
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    dep = full if full in mods else target
                    if dep in mods and dep != m:
                        edges[m].add(dep)
                    if (
                        dep == target
                        and target in mods
                        and alias.name.startswith("_")
                        and not alias.name.startswith("__")
                    ):
                        private.append((m, target, alias.name))
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges, private


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_circle_finder_finds_a_circle_of_three():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_through_the_engine():
    edges, _ = _imports(_modules())
    engine = [c for c in _circles(edges) if any(m.startswith("idpsgd.engine") for m in c)]
    assert engine == []


def test_no_private_name_imported_from_another_engine_module():
    _, private = _imports(_modules())
    assert [p for p in private if p[1].startswith("idpsgd.engine")] == []


# needs helper "names"'s branch (issue 41, outside the engine): fails on the engine branch alone
def test_no_import_circle_in_the_package():
    edges, _ = _imports(_modules())
    assert _circles(edges) == []


# needs helper "names"'s branch (issue 41, outside the engine): fails on the engine branch alone
def test_no_private_name_imported_from_another_module():
    _, private = _imports(_modules())
    assert private == []


def test_every_grad_sample_mode_has_one_record_that_builds_its_wrapper_and_optimizer():
    from idpsgd.engine.modes import ENGINE_MODES, MODES
    from idpsgd.engine.optimizer import IndividualizedDPOptimizer

    assert tuple(MODES) == ENGINE_MODES == ("hooks", "functorch", "ew", "ghost", "bk", "no_op")
    for name, record in MODES.items():
        assert record.name == name and issubclass(record.distributed_optimizer, record.optimizer)
    assert MODES["ghost"].returns_criterion and MODES["bk"].book_keeping
    assert MODES["no_op"].optimizer is IndividualizedDPOptimizer and not MODES["no_op"].engine_computes


def test_a_set_up_that_fails_while_building_leaves_the_engine_as_it_was(monkeypatch):
    """The rollback is complete: a first phase whose build fails leaves no ledger, clipping, noise
    source, sampler source or new seeds behind (issue 41: the noise and sampler sources were left
    set), and the next set-up works."""
    import pytest
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import idpsgd.engine.step as step
    from idpsgd.engine import IndividualizedPrivacyEngine

    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    engine = IndividualizedPrivacyEngine(accountant="rdp")  # seed followed from torch: drawn at set-up
    seeds = engine.seeds
    kwargs = dict(data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5, steps=2)
    built = step.PrivateDataLoader

    def broken(*args, **kwargs):
        raise RuntimeError("the loader could not be built")

    monkeypatch.setattr(step, "PrivateDataLoader", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    state = (engine.accountant, engine.budgets, engine.clipping, engine.noise_source, engine._sampler_rng)
    assert state == (None, None, None, None, None) and engine.seeds is seeds and engine.parameters is None
    monkeypatch.setattr(step, "PrivateDataLoader", built)
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert engine.accountant is not None and len(engine.accountant.phases) == 1 and engine.steps == 0
