"""``idpsgd reproduce NAME``: one paper's headline experiment as one command.

A thin dispatcher over :data:`idpsgd.experiments.EXPERIMENTS`: each experiment gets a sub-command
with the common flags (``--dataset``, ``--data-dir``, ``--model``, ``--out``, ``--overwrite``,
``--no-progress``) and its own options, whose defaults are its run function's defaults.  The
command checks every option, opens the run folder, loads the data, runs the experiment and lets it
write its files (public or private, :class:`~idpsgd.runfolder.RunFolder`).
"""

from __future__ import annotations

import argparse

from ..experiments import load
from .registry import add_output_flags, arguments, command, flag_name, register_text


def _add_option(p: argparse.ArgumentParser, option, default) -> None:
    if isinstance(default, bool):
        if default:  # --no-NAME switches a default-on part off
            p.add_argument(
                "--no-" + flag_name(option.name)[2:], dest="no_" + option.name, action="store_true", help=option.help
            )
        else:
            p.add_argument(flag_name(option.name), action="store_true", help=option.help)
        return
    kind = option.type or (type(default) if default is not None else str)
    p.add_argument(flag_name(option.name), type=kind, default=default, help=option.help)


def _datasets_help(exp) -> str:
    named = [d for d in exp.paper_models if d != "digits"]
    listed = ", ".join(["digits (bundled)", *named[:-1]]) + (f" or {named[-1]}" if named else "")
    return f"{listed} (default %(default)s)"


def _model_help(exp) -> str:
    if exp.model_help:
        return exp.model_help
    if not exp.paper_models:
        return "model name (default: the library's model for the dataset)"
    paper = ", ".join(f"{m} for {d}" for d, m in exp.paper_models.items())
    return f"model name (default: the paper's model: {paper}; the library's model for the dataset otherwise)"


def _experiment_parser(p: argparse.ArgumentParser, exp) -> None:
    defaults = exp.defaults()
    p.add_argument("--dataset", default="digits", help=_datasets_help(exp))
    p.add_argument("--data-dir", help="folder with the dataset's files (all but digits)")
    p.add_argument(
        "--num-classes",
        type=int,
        help="K: the class count of a csv dataset (labels 0..K-1; required for csv, never read from the rows)",
    )
    p.add_argument("--model", help=_model_help(exp))
    for option in exp.options:
        _add_option(p, option, defaults[option.name])
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="a progress bar on stderr (default: on a terminal; --no-progress: none)",
    )
    p.add_argument("--out", required=True, help=exp.out_help)
    p.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
    add_output_flags(p, default=argparse.SUPPRESS)  # the command's parser sets the defaults


def _reproduce_args(p):
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True, parser_class=type(p))
    for exp in load().values():
        e = sub.add_parser(
            exp.name, help=exp.help, description=exp.description or exp.help, formatter_class=p.formatter_class
        )
        _experiment_parser(e, exp)


def _options(args, exp) -> dict:
    """The run function's keywords from ``args``, each checked."""
    defaults = exp.defaults()
    kwargs = {}
    for option in exp.options:
        default = defaults[option.name]
        value = (not getattr(args, "no_" + option.name)) if default is True else getattr(args, option.name)
        if option.check is not None:
            option.check(option.name, value)
        kwargs[option.name] = value
    return kwargs


def _check_model(name) -> None:
    from ..models import MODELS
    from ..validation import InvalidParameterError

    if name is not None and name not in MODELS:
        raise InvalidParameterError("model", name, f"must be one of {sorted(MODELS)}")


def _help_text() -> str:
    return f"reproduce a paper's headline experiment: {', '.join(load())} (see idpsgd reproduce --help)"


@command("reproduce", _help_text())
@arguments(_reproduce_args)
def reproduce_cmd(args):
    from ..data import load_dataset
    from ..runfolder import RunFolder

    exp = load()[args.experiment]
    kwargs = _options(args, exp)
    _check_model(args.model)
    out = RunFolder(args.out, overwrite=args.overwrite)
    try:
        data = load_dataset(args.dataset, args.data_dir, num_classes=args.num_classes)
        if exp.takes_folder():
            kwargs["out"] = out
        r = exp.run(data, model=args.model, progress=args.progress is not False, **kwargs)
    except BaseException:
        out.discard_if_unused()
        raise
    files = exp.write(out, r)
    result = {
        "experiment": exp.name,
        **{k: v for k, v in r.items() if k != "private"},
        "out": str(out.path),
        "files": files,
    }
    if isinstance(r.get("private"), dict):  # shown with --show-private; per-example arrays only in files
        result["private"] = {k: v for k, v in r["private"].items() if k != "per_example"}
    return result


def _text(r) -> str:
    exp = load()[r["experiment"]]
    if exp.text is not None:
        return exp.text(r)
    return "\n".join(f"{k}: {v}" for k, v in r.items())


register_text(reproduce_cmd, _text)
