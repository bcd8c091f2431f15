"""Command-line interface: ``idpsgd <command> ...`` (also ``python -m idpsgd``).

Each command is a few lines over a library function.  Command names, flags and JSON keys are a
public contract (see README).  A bad argument exits with code 2 and prints one line naming the
argument, the value and what is allowed.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from .validation import InvalidParameterError, UnreachableTargetError

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}


def command(name: str, help: str):
    """Register ``run(args) -> dict`` with an ``add(parser)`` attribute set by :func:`arguments`."""
    def deco(run):
        COMMANDS[name] = (help, getattr(run, "_add", lambda p: None), run)
        return run
    return deco


def arguments(add: Callable[[argparse.ArgumentParser], None]):
    def deco(run):
        run._add = add
        return run
    return deco


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage as well by default)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _emit(result: dict, as_json: bool, text: Callable[[dict], str] | None = None) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=float))
    else:
        print(text(result) if text else "\n".join(f"{k}: {v}" for k, v in result.items()))


def build_parser() -> argparse.ArgumentParser:
    from . import commands, train_commands  # noqa: F401  (register the commands)

    parser = _Parser(prog="idpsgd", description="Individualized privacy for DP-SGD.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add, _run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def main(argv=None) -> int:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    _help, _add, run = COMMANDS[args.command]
    try:
        result = run(args)
    except InvalidParameterError as exc:
        sys.stderr.write(f"idpsgd {args.command}: error: {_flag(exc.name)}{str(exc)[len(exc.name):]}\n")
        return 2
    except (UnreachableTargetError, FileNotFoundError) as exc:
        sys.stderr.write(f"idpsgd {args.command}: error: {exc}\n")
        return 2
    if result is not None:
        text = getattr(run, "_text", None)
        _emit(result, getattr(args, "json", False), text)
    return 0
