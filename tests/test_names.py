"""Issue 41 (a layout a newcomer can walk), outside the engine's top level: every method and
accountant name spelled once (:mod:`idpsgd.names`), no import circle of any length (lazy imports
inside functions included), no private name imported from another module, and the renamed
``individual.py`` modules still importable under their old names, with a DeprecationWarning."""

from __future__ import annotations

import ast

from idpsgd import names
from support import import_cycles, import_edges, package_modules, private_imports

#: Constants and private imports allowed in the engine's top-level modules: none (issue 41 moved them
#: onto :mod:`idpsgd.names` and public names), kept as tables so an exception has to be written down.
ENGINE_LITERALS: dict[str, int] = {}
ENGINE_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


def test_no_import_circle_of_any_length_in_the_package():
    edges = import_edges()
    assert import_cycles(edges) == []
    # the user-level norm pass joins units and norms, so neither imports the other
    assert "idpsgd.engine.per_example.norms" not in edges["idpsgd.engine.clipping.users"]
    both = {"idpsgd.engine.per_example.norms", "idpsgd.engine.clipping.users"}
    assert both <= edges["idpsgd.engine.per_example.user_norms"]


def test_no_module_imports_another_modules_private_name():
    assert set(private_imports()) <= ENGINE_PRIVATE_IMPORTS


def _name_literals(tree) -> list[tuple[str, ...]]:
    """Tuples, lists and sets of two or more strings that are all method or accountant names."""
    known = set(names.PLAN_METHODS + names.PDP_METHODS + names.ACCOUNTANTS)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(values) == len(node.elts) and set(values) <= known:
                out.append(tuple(values))
    return out


def test_every_method_and_accountant_list_is_spelled_once_in_names():
    found = {}
    for m, f in package_modules().items():
        if m != "idpsgd.names":
            literals = _name_literals(ast.parse(f.read_text()))
            if literals:
                found[m] = len(literals)
    assert all(count <= ENGINE_LITERALS.get(m, 0) for m, count in found.items()), found


def test_the_names_derive_from_the_canonical_tuples():
    assert names.IDP_METHODS == ("uniform", "sample", "scale")
    assert names.ACCOUNTANTS == ("rdp", "pld", "prv")
    assert (*names.IDP_METHODS, "exclude", "sequential") == names.PLAN_METHODS
    assert set(names.FIXED_SIGMA_METHODS) < set(names.IDP_METHODS)
    assert set(names.INDIVIDUAL_ACCOUNTANTS) < set(names.ACCOUNTANTS)
    assert (*names.IDP_METHODS, "pdp-sgd") == names.AUDIT_METHODS
    assert names.one_of(names.ACCOUNTANTS) == "rdp, pld or prv"
    assert names.one_of(("rdp",)) == "rdp"


def test_the_old_public_names_are_the_canonical_ones():
    from idpsgd.accounting import ACCOUNTANTS
    from idpsgd.assignment import METHODS as ASSIGN
    from idpsgd.assignment.methods import FIXED_SIGMA_METHODS
    from idpsgd.audit.shadows import AUDIT_METHODS, PDP_AUDIT_METHODS
    from idpsgd.integrations.hf.arguments import ACCOUNTANTS as HF_ACCOUNTANTS
    from idpsgd.training.pdp import PDP_METHODS

    assert tuple(ACCOUNTANTS) == names.ACCOUNTANTS == HF_ACCOUNTANTS
    assert tuple(ASSIGN) == names.IDP_METHODS
    assert PDP_METHODS == names.PDP_METHODS
    assert FIXED_SIGMA_METHODS == names.FIXED_SIGMA_METHODS
    assert AUDIT_METHODS == names.AUDIT_METHODS and PDP_AUDIT_METHODS == names.PDP_AUDIT_METHODS
