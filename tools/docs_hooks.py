"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``), run at every ``make docs``.

* The CLI reference (``docs/cli.md``) is generated from the argparse parsers themselves
  (:func:`idpsgd.cli.main.build_parser`, every command and sub-command), so it cannot drift from
  the code: the page holds a ``<!-- cli-reference -->`` marker that :func:`on_page_markdown`
  replaces with each parser's ``--help`` text.
* The figures under ``bench/results/*.png`` are served as ``bench-results/NAME.png`` without a
  copy in ``docs/`` (:func:`on_files`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_PAGE = "cli.md"
CLI_MARKER = "<!-- cli-reference -->"
HELP_WIDTH = 100  # columns of the rendered --help text (argparse reads $COLUMNS)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every sub-command of ``parser``, in registration order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _help_text(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_WIDTH)
    try:
        return parser.format_help().rstrip()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def cli_reference(parser: argparse.ArgumentParser | None = None, level: int = 2) -> str:
    """Markdown: one section per command (and per sub-command, one level deeper) with its full
    ``--help`` text (and its one-line summary where the help text lacks it); commands in
    ``idpsgd --help`` order."""
    if parser is None:
        from idpsgd.cli.main import build_parser

        parser = build_parser()
    parts = []
    for _name, summary, sub in _subcommands(parser):
        parts.append(f"{'#' * level} `{sub.prog}` {{#{sub.prog.replace(' ', '-')}}}\n")
        text = _help_text(sub)
        if summary and " ".join(summary.split()) not in " ".join(text.split()):
            parts.append(f"{summary}\n")
        parts.append(f"```text\n{text}\n```\n")
        if _subcommands(sub):
            parts.append(cli_reference(sub, level + 1))
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != CLI_PAGE:
        return markdown
    if markdown.count(CLI_MARKER) != 1:
        raise ValueError(f"docs/{CLI_PAGE} must hold the marker {CLI_MARKER} exactly once")
    return markdown.replace(CLI_MARKER, cli_reference())


def on_files(files, config):
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench-results/{png.name}", abs_src_path=str(png)))
    return files
