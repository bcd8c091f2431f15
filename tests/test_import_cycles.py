"""No two idpsgd modules import each other, also through imports inside
functions (``accounting/accountants.py`` ↔ ``prv.py`` over ``_check_min_sigma`` and
``training/loop.py`` ↔ ``pdp.py`` over ``resolve_device`` did: the shared piece moved down a layer,
to ``accounting/events.py`` and ``training/device.py``)."""

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


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges = {m: set() for m in mods}
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
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges


def test_no_two_modules_import_each_other():
    edges = _imports(_modules())
    mutual = sorted({tuple(sorted((a, b))) for a, deps in edges.items() for b in deps if a in edges.get(b, ())})
    assert mutual == []
    assert "idpsgd.accounting.events" in edges["idpsgd.accounting.prv"]  # the shared check lives below both
    assert "idpsgd.training.device" in edges["idpsgd.training.pdp"]
