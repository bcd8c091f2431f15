"""Command-line interface: ``idpsgd <command> ...`` (also ``python -m idpsgd``).

Each command is a few lines over a library function.  Command names, flags and JSON keys are a
public contract (see docs/cli.md).  A bad argument exits with code 2 and prints one line naming the
argument, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings

from ..io import CheckpointError
from ..validation import InvalidParameterError, UnreachableTargetError, shown_value
from .registry import COMMANDS, TEXTS, Noted, Parser, add_output_flags, flag_name, settled
from .registry import emit as _emit  # a module global: tests replace it to capture the output

#: the modules whose import registers the commands (registry.COMMANDS), in the order of ``idpsgd --help``
COMMAND_MODULES = (
    "accounting_commands",
    "audit_command",
    "finetune_command",
    "per_instance_command",
    "report_command",
    "reproduce_command",
    "train_commands",
)
_NUMBER = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)
_ARGPARSE_ERRORS = (  # argparse's wording -> ours: "--flag=value is invalid: what is allowed"
    (re.compile(r"^argument (?P<flag>[^:/ ]+)(?:/\S+)?: invalid float value: (?P<value>.*)$"), "must be a number"),
    (re.compile(r"^argument (?P<flag>[^:/ ]+)(?:/\S+)?: invalid int value: (?P<value>.*)$"), "must be an integer"),
    (
        re.compile(
            r"^argument (?P<flag>[^:/ ]+)(?:/\S+)?: invalid choice: (?P<value>'.*?') \(choose from (?P<allowed>.*)\)$"
        ),
        "must be one of {allowed}",
    ),
)


class _CliParser(Parser):
    """One error line naming the flag as typed and its value; ``--lr -1e-3`` and ``--budgets -1,2``
    read as values (argparse takes only plain negative numbers such as ``-1`` for values)."""

    def _parse_optional(self, arg_string):
        if _NUMBER.match(arg_string):  # no flag of ours starts with a digit: a negative value
            return None
        return super()._parse_optional(arg_string)

    def error(self, message):
        for pattern, allowed in _ARGPARSE_ERRORS:
            m = pattern.match(message)
            if m:
                choices = m.groupdict().get("allowed")
                message = f"{m['flag']}={m['value']} is invalid: " + allowed.format(
                    allowed=choices.replace("'", "") if choices else ""
                )
                break
        else:
            m = re.match(r"^argument (?P<flag>[^:/ ]+)(?:/\S+)?: expected one argument$", message)
            if m:
                message = f"{m['flag']} needs a value"
        super().error(message)


class _HelpFormatter(argparse.HelpFormatter):
    """Help texts show the defaults the parser really uses: a help without a stated default gets
    ``(default %(default)s)``, filled in by argparse from the action's default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default %(default)s)"


#: a library's name for a value -> the flag of the command that feeds it (an error names what the user typed)
LIBRARY_FLAGS = {
    "finetune": {
        "output_dir": "out",
        "resume_from_checkpoint": "resume",
        "train_dataset": "data",
        "eval_dataset": "eval_data",
        "max_grad_norm": "clip_norm",
        "num_train_epochs": "epochs",
        "per_device_train_batch_size": "physical_batch_size",
    },
}
_PLAIN = (str, int, float, bool)


def refusal_line(exc: InvalidParameterError, args, positionals=()) -> str:
    """An :class:`InvalidParameterError` as the CLI's one line: the flag the user typed (a library's
    argument name mapped to its flag), the value as typed when the error holds an object (``Users``,
    ``PrivacyArguments``) or a library name, ``--flag is missing`` for a value not given, and a name
    that is no flag of the command left as it is (never a made-up ``--flag``)."""
    text = str(exc)
    rest = text[len(exc.name) :] if text.startswith(exc.name) else f"={exc.value} is invalid: {exc.allowed}"
    name = LIBRARY_FLAGS.get(args.command, {}).get(exc.name, exc.name)
    if name in positionals:
        return f"{name}{rest}"
    if not hasattr(args, name):  # no flag of this command: the library's own name
        return f"{exc.name}{rest}"
    shown, given = getattr(args, "_typed", {}).get(name) or flag_name(name), getattr(args, name)
    if exc.value is None and given in (None, False):
        verb = exc.allowed.startswith(("is ", "are "))
        return f"{shown} {exc.allowed}" if verb else f"{shown} is missing: {exc.allowed}"
    if given is None:  # a flag the user did not give: the value came from elsewhere (a data column)
        return f"{exc.name}{rest}"
    if name != exc.name or not isinstance(exc.value, _PLAIN):  # the value as the user typed it
        if given is True or given is False:
            return f"{shown} is invalid: {exc.allowed}"
        return f"{shown}={shown_value(given)} is invalid: {exc.allowed}"
    return f"{shown}{rest}"


def _other_rank() -> int:
    """This process's rank under torchrun when it is not rank 0 (else 0): rank 0 speaks for the run."""
    import os

    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return 0
    return int(os.environ.get("RANK", "0"))


def _flagged_message(message: str, args) -> str:
    """``budgets=1e-09 cannot be met ...`` -> ``--budgets=1e-09 cannot be met ...`` when ``budgets`` is a flag."""
    m = re.match(r"^(\w+)=", message)
    if m and hasattr(args, m[1]) and not message.startswith("--"):
        return flag_name(m[1]) + message[len(m[1]) :]
    return message


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    for module in COMMAND_MODULES:  # each registers its commands on import
        importlib.import_module(f".{module}", __package__)

    parser = _CliParser(
        prog="idpsgd",
        formatter_class=_HelpFormatter,
        description="Individualized privacy for DP-SGD: assign a privacy budget per "
        "example, train to it, account for and audit the privacy each example received.",
    )
    parser.add_argument("--version", action="version", version=f"idpsgd {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_CliParser, metavar="COMMAND")
    parser.positionals = {}  # command -> its positional arguments (named without "--" in errors)
    for name, (help_text, add, _run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        add(p)
        parser.positionals[name] = {a.dest for a in p._actions if not a.option_strings}
        add_output_flags(p)
    return parser


class _OnceAfterSuccess:
    """Warnings whose message starts with ``prefix``, shown once and only when the command succeeds.

    The engine warns "Secure RNG turned off" once per engine (as Opacus), and a command may train many
    models (the demo's four runs, an audit's shadow models, PDP rounds, an experiment's repetitions):
    the command shows it once, on one line, after its result — and not at all when it ends with an
    error (a bad input's error stays the one line on stderr).  Filters (``-W``, a test runner's) still
    decide first whether a warning is shown at all."""

    def __init__(self, prefix: str, command: str = ""):
        self.prefix, self.held, self.command = prefix, None, command

    def __enter__(self):
        self.original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not str(message).startswith(self.prefix):
                return self.original(message, category, filename, lineno, file, line)
            if self.held is None:
                self.held = (message, category, filename, lineno, file)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self.original
        return False

    def show(self) -> None:
        """The held warning as the CLI's one line, ``idpsgd COMMAND: warning: ...`` (no source path)."""
        if self.held is not None:
            message, _category, _filename, _lineno, file = self.held
            text = " ".join(str(message).split())
            (file or sys.stderr).write(f"idpsgd {self.command}: warning: {text}\n")


class _OneLineWarnings:
    """Every other warning as one line ``idpsgd COMMAND: warning: ...`` on stderr — never Python's
    ``file:line: UserWarning:`` followed by the source line.  Through ``warnings.formatwarning`` (the
    documented hook): filters still decide what is shown, and code that records warnings still gets them."""

    def __init__(self, command: str):
        self.command = command

    def __enter__(self):
        self.original = warnings.formatwarning

        def one_line(message, category, filename, lineno, line=None):
            return f"idpsgd {self.command}: warning: {' '.join(str(message).split())}\n"

        warnings.formatwarning = one_line
        return self

    def __exit__(self, *exc):
        warnings.formatwarning = self.original
        return False


def main(argv=None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `idpsgd` alone: the list of commands, as `idpsgd --help` (asked for, not an error)
        parser.print_help(sys.stdout)
        return 0
    from ..data import DatasetFileError
    from ..engine.per_example.bk.provenance import RefusedRows
    from ..engine.per_example.machinery import MachineryRefusal

    _help, _add, run = COMMANDS[args.command]
    held = _OnceAfterSuccess("Secure RNG turned off", args.command)
    split = _OnceAfterSuccess("csv without test.csv", args.command)  # data.HIDDEN_SPLIT_WARNING
    try:
        with _OneLineWarnings(args.command), held, split:
            args = settled(run, args)  # the flags as the command reads them (its derived defaults filled in)
            result = run(args)
    except InvalidParameterError as exc:
        if not _other_rank():  # under torchrun every rank refuses the same arguments: rank 0 says it once
            line = refusal_line(exc, args, parser.positionals.get(args.command, ()))
            sys.stderr.write(f"idpsgd {args.command}: error: {line}\n")
        return 2
    except DatasetFileError as exc:  # names the file; the flag that led there is --data-dir
        where = f"--data-dir={args.data_dir!r}: " if getattr(args, "data_dir", None) else ""
        sys.stderr.write(f"idpsgd {args.command}: error: {where}{exc}\n")
        return 2
    except (UnreachableTargetError, FileNotFoundError, CheckpointError) as exc:
        sys.stderr.write(f"idpsgd {args.command}: error: {_flagged_message(str(exc), args)}\n")
        return 2
    # book-keeping: a model whose examples' rows mix (the operation named); the engine's per-example machinery
    except (RefusedRows, MachineryRefusal) as exc:  # failing on a layer (the layer and the error named)
        sys.stderr.write(f"idpsgd {args.command}: error: {exc}\n")
        return 2
    notes = ()
    if isinstance(result, Noted):  # e.g. which checkpoint a --resume continued from
        result, notes = result.result, result.notes
    for note in notes:
        if not _other_rank():
            sys.stderr.write(f"idpsgd {args.command}: {note}\n")
    split.show()
    held.show()
    if result is not None:
        if not getattr(args, "show_private", False):
            result = {k: v for k, v in result.items() if k != "private"}
        text = TEXTS.get(run)
        _emit(result, getattr(args, "json", False), text)
    return 0
