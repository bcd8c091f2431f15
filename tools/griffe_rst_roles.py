"""Griffe extension for the API reference: the docstrings' reST roles as Markdown code.

The package's docstrings cite other objects with Sphinx roles (``:class:`~.accountant.GroupEpsilons```,
``:func:`idpsgd.assignment.assign```) and end a paragraph with ``::`` before an indented example.
mkdocstrings renders Markdown, so this extension rewrites each role to a code span of the name as
Sphinx would show it (``~`` keeps the last component) and ``::`` to ``:``.  Nothing else changes.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
LITERAL_MARKER = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _role(match: re.Match) -> str:
    tilde, target = match.groups()
    name = target.rsplit(".", 1)[-1] if tilde else target.lstrip(".")
    return f"`{name}`"


def markdown_from_rst_roles(text: str) -> str:
    """``:class:`~a.b.C``` -> `` `C` ``, ``:func:`a.f``` -> `` `a.f` ``, a closing ``::`` -> ``:``."""
    return LITERAL_MARKER.sub(":", ROLE.sub(_role, text))


class RstRoles(griffe.Extension):
    """Rewrite every docstring once the object tree is complete."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_from_rst_roles(obj.docstring.value)
