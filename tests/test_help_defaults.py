"""Help texts show the defaults the code uses (issue 17).

Two checks over every command's parser:

1. every option with a default states that default in its rendered ``--help`` text (the very value
   argparse will use, e.g. ``(default 30)``), and
2. the parser's defaults equal the defaults of the library functions and dataclasses they feed
   (``TrainConfig``, ``run_per_instance``, ``run_heo_table1``, ``PdpOptions``, ...), so that the CLI
   and the library never disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

import pytest

from idpsgd.cli.main import build_parser
from idpsgd.cli.registry import COMMANDS

PARSER = build_parser()


def _subparsers(parser) -> dict:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return dict(action.choices) if action else {}


COMMAND_PARSERS = _subparsers(PARSER)
#: every command's parser, and every sub-command's ("reproduce heo-table1")
SUBPARSERS = {
    **COMMAND_PARSERS,
    **{f"{c} {s}": q for c, p in COMMAND_PARSERS.items() for s, q in _subparsers(p).items()},
}
TRAINING = ("train", "demo", "per-instance", "audit")


def _options(command):
    return [a for a in SUBPARSERS[command]._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _has_default(action) -> bool:
    return action.default not in (None, False, argparse.SUPPRESS)


def _rendered_help(parser, action) -> str:
    return parser._get_formatter()._expand_help(action)


def _same(token: str, default) -> bool:
    token = token.rstrip(",.:;")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return float(token) == float(default)
        except ValueError:
            return False
    return token == str(default)


CASES = [(c, a.dest) for c in SUBPARSERS for a in _options(c) if _has_default(a)]


@pytest.mark.parametrize(("command", "dest"), CASES, ids=[f"{c}:{d}" for c, d in CASES])
def test_help_states_the_default_argparse_uses(command, dest):
    parser = SUBPARSERS[command]
    action = next(a for a in _options(command) if a.dest == dest)
    text = _rendered_help(parser, action)
    stated = re.findall(r"default:?\s+([^\s;)]+)", text)
    assert any(_same(t, action.default) for t in stated), (
        f"idpsgd {command} {action.option_strings[0]}: default {action.default!r}, help says {stated}: {text!r}"
    )


def test_every_command_is_checked():
    assert set(COMMAND_PARSERS) == set(COMMANDS)
    assert len(CASES) >= 50


def _dataclass_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _signature_defaults(fn) -> dict:
    return {
        k: v.default for k, v in inspect.signature(fn).parameters.items() if v.default is not inspect.Parameter.empty
    }


def _library_defaults():
    """(commands, dest, library default, where) for every flag that feeds a library default."""
    from idpsgd.accounting import account_from_norms, calibrate_noise_multiplier, epsilon_sgm
    from idpsgd.assignment import assign
    from idpsgd.engine import IndividualAccountingOptions
    from idpsgd.engine.budget.filter import FilterOptions
    from idpsgd.experiments import load
    from idpsgd.training import TrainConfig, train
    from idpsgd.training.pdp import PdpOptions
    from idpsgd.training.per_instance import run_per_instance

    rows = []
    cfg = _dataclass_defaults(TrainConfig)
    for name in (
        "epochs",
        "batch_size",
        "lr",
        "momentum",
        "clip_norm",
        "device",
        "grad_sample_mode",
        "accountant",
        "model",
    ):
        rows.append((TRAINING, name, cfg[name], f"TrainConfig.{name}"))
    pi = _signature_defaults(run_per_instance)
    for name in (
        "runs",
        "alpha",
        "update_rule",
        "epsilon",
        "delta",
        "checkpoint_every",
        "p",
        "unlearning_beta",
        "target_set",
        "failure",
    ):
        rows.append((("per-instance",), name, pi[name], f"run_per_instance({name}=)"))
    rows.append((("per-instance",), "samples", ",".join(map(str, pi["samples"])), "run_per_instance(samples=)"))
    for exp in load().values():  # every experiment's options (and --model) default to its run function's
        run = _signature_defaults(exp.run)
        for name in [o.name for o in exp.options if not isinstance(run[o.name], bool)] + ["model"]:
            rows.append(((f"reproduce {exp.name}",), name, run[name], f"{exp.run.__name__}({name}=)"))
    rows.append(
        (("train",), "release_epsilon", _signature_defaults(train)["release_epsilon"], "train(release_epsilon=)")
    )
    ind = _dataclass_defaults(IndividualAccountingOptions)
    for name in ("refreshes_per_epoch", "rounding", "rounding_step", "validate_subset"):
        rows.append((("train",), name, ind[name], f"IndividualAccountingOptions.{name}"))
    pdp = _dataclass_defaults(PdpOptions)
    for name in ("threshold_loss", "w1", "rounds"):
        rows.append((("train",), name, pdp[name], f"PdpOptions.{name}"))
    flt = _dataclass_defaults(FilterOptions)
    for dest, name in (
        ("filter_order", "order"),
        ("filter_extend", "extend"),
        ("filter_refreshes_per_epoch", "refreshes_per_epoch"),
        ("filter_rounding_step", "rounding_step"),
    ):
        rows.append((("train",), dest, flt[name], f"FilterOptions.{name}"))
    # (account's --rounding and --rounding-step default to what the norms file records)
    rows.append(
        (
            ("account",),
            "accountant",
            _signature_defaults(account_from_norms)["accountant"],
            "account_from_norms(accountant=)",
        )
    )
    rows.append(
        (("epsilon",), "accountant", _signature_defaults(epsilon_sgm)["accountant"], "epsilon_sgm(accountant=)")
    )
    rows.append(
        (
            ("noise-multiplier",),
            "accountant",
            _signature_defaults(calibrate_noise_multiplier)["accountant"],
            "calibrate_noise_multiplier(accountant=)",
        )
    )
    rows.append((("assign",), "accountant", _signature_defaults(assign)["accountant"], "assign(accountant=)"))
    if "audit" in SUBPARSERS:
        from idpsgd.audit import AuditOptions

        aud = _dataclass_defaults(AuditOptions)
        for name in ("attack", "shadow_models", "lira_mode", "lira_variance", "canaries", "canary_kind", "confidence"):
            rows.append((("audit",), name, aud[name], f"AuditOptions.{name}"))
    return [(c, dest, value, where) for commands, dest, value, where in rows for c in commands if c in SUBPARSERS]


LIBRARY = _library_defaults()


@pytest.mark.parametrize(("command", "dest", "value", "where"), LIBRARY, ids=[f"{c}:{d}" for c, d, _, _ in LIBRARY])
def test_cli_defaults_are_the_library_defaults(command, dest, value, where):
    actions = {a.dest: a for a in _options(command)}
    assert dest in actions, f"idpsgd {command} has no option for {where}"
    default = actions[dest].default
    if command == "audit":  # defaults that differ for a language model (--data) are filled in by the command
        from idpsgd.cli.audit_command import CLASSIC_DEFAULTS

        if dest in CLASSIC_DEFAULTS:
            assert default is None
            default = CLASSIC_DEFAULTS[dest]
    assert default == value, (
        f"idpsgd {command} {actions[dest].option_strings[0]} defaults to {actions[dest].default!r}, "
        f"{where} to {value!r}"
    )
