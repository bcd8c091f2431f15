"""The command registry: ``@command(name, help)`` and ``@arguments(add)`` register ``run(args) -> dict``;
``register_text(run, fn)`` its result's form for people (:data:`TEXTS`); ``@fills(fill)`` the defaults a
command derives from its other flags (:func:`settled`).  argparse's namespace is never written after parsing:
a command's derived values are a new namespace (:func:`with_flags`), a value passed on
(:class:`~.budget_args.CommandSeed`) or part of what it returns (:class:`Noted`).

Command modules import this module (never :mod:`.main`), so registration points one way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}
#: run -> its result as text for people (without ``--json``); a command without one prints its result's items
TEXTS: dict[Callable, Callable[[dict], str]] = {}
_ARGUMENTS: dict[Callable, Callable[[argparse.ArgumentParser], None]] = {}  # run -> add(parser), by @arguments
_FILLS: dict[Callable, Callable[[argparse.Namespace], argparse.Namespace]] = {}  # run -> fill(args), by @fills


def command(name: str, help: str):
    """Register ``run(args) -> dict`` with the ``add(parser)`` given by :func:`arguments` (applied first)."""

    def deco(run):
        COMMANDS[name] = (help, _ARGUMENTS.get(run, lambda p: None), run)
        return run

    return deco


def arguments(add: Callable[[argparse.ArgumentParser], None]):
    """Register ``add(parser)``, the flags of the command whose ``run`` this decorates (below :func:`command`)."""

    def deco(run):
        _ARGUMENTS[run] = add
        return run

    return deco


def fills(fill: Callable[[argparse.Namespace], argparse.Namespace]):
    """Register ``fill(args) -> namespace``: the parsed flags with the defaults the command derives from its
    other flags (or the data's header) in place, built with :func:`with_flags` before the command runs
    (below :func:`command`).  It derives and never refuses (the command refuses a wrong value in its own
    order): the command reads the filled namespace, and an error line names a filled value as the flag's."""

    def deco(run):
        _FILLS[run] = fill
        return run

    return deco


def settled(run: Callable, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` as ``run`` reads them: filled by its :func:`fills` function, else as parsed."""
    fill = _FILLS.get(run)
    return args if fill is None else fill(args)


def with_flags(args: argparse.Namespace, **values) -> argparse.Namespace:
    """A new namespace: ``args``'s flags with ``values`` in place (the parsed one is left as it is)."""
    return argparse.Namespace(**{**vars(args), **values})


@dataclass(frozen=True)
class Noted:
    """A command's result with the notes shown on stderr when it succeeds (which checkpoint a ``--resume``
    continued from, or that a new run started): returned to :func:`~.main.main`, which prints them on
    rank 0 before the result."""

    result: dict | None
    notes: tuple[str, ...] = ()


def register_text(run: Callable, fn: Callable[[dict], str]) -> None:
    """Register ``fn(result) -> str``, how ``run``'s result is printed for people."""
    TEXTS[run] = fn


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage as well by default)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def add_output_flags(p: argparse.ArgumentParser, default=False) -> None:
    """``--json`` and ``--show-private``: every command's parser gets them; a sub-command's parser with
    ``default=argparse.SUPPRESS`` (so that the flags work before and after the sub-command's name)."""
    p.add_argument("--json", action="store_true", default=default, help="print machine-readable JSON")
    p.add_argument(
        "--show-private",
        action="store_true",
        default=default,
        help="also print private values (exact statistics of per-example data); they are not "
        "covered by the privacy guarantee",
    )


class TypedStore(argparse.Action):
    """``store`` that also records which of the flag's spellings was typed (``args._typed[dest]``), so
    that an error names the flag as the user wrote it (an alias kept for one release)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        typed = dict(getattr(namespace, "_typed", {}))
        typed[self.dest] = option_string
        namespace._typed = typed


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def emit(result: dict, as_json: bool, text: Callable[[dict], str] | None = None) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=float))
    else:
        print(text(result) if text else "\n".join(f"{k}: {v}" for k, v in result.items()))


def count_label(report: dict) -> str:
    """The header of a group table's count column: what the group counts (users at user level)."""
    return "users" if report.get("privacy_unit") == "user" else "examples"
