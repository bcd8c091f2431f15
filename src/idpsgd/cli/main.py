"""Command-line interface: ``idpsgd <command> ...`` (also ``python -m idpsgd``).

Each command is a few lines over a library function.  Command names, flags and JSON keys are a
public contract (see README).  A bad argument exits with code 2 and prints one line naming the
argument, the value and what is allowed.
"""
from __future__ import annotations

import argparse
import sys

from ..validation import InvalidParameterError, UnreachableTargetError
from .registry import COMMANDS, _emit, _flag, _Parser


def build_parser() -> argparse.ArgumentParser:
    from . import (  # noqa: F401  (register)
        accounting_commands,
        per_instance_command,
        reproduce_command,
        train_commands,
    )

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
