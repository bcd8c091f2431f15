"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``), run at every ``make docs``.

* The CLI reference (``docs/cli.md``) is generated from the argparse parsers themselves
  (:func:`idpsgd.cli.main.build_parser`, every command and sub-command), so it cannot drift from
  the code: the page holds a ``<!-- cli-reference -->`` marker that :func:`on_page_markdown`
  replaces with each parser's ``--help`` text.
* The table of refused Opacus options (``docs/opacus.md``) is written into the page itself, between
  the markers ``<!-- opacus-refusals:begin -->`` and ``<!-- opacus-refusals:end -->``, so that the page
  read in the repository shows it too; it is generated from
  :data:`idpsgd.engine.opacus_compat.REFUSALS` (the table the engine builds its refusal messages from)
  by ``python tools/docs_hooks.py`` (rewrites the block), and the build fails when the block differs
  from ``REFUSALS`` (as does ``tests/test_docs.py``).
* The figures under ``bench/results/*.png`` are served as ``bench-results/NAME.png`` without a
  copy in ``docs/`` (:func:`on_files`).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_PAGE = "cli.md"
CLI_MARKER = "<!-- cli-reference -->"
HELP_WIDTH = 100  # columns of the rendered --help text (argparse reads $COLUMNS)
OPACUS_PAGE = "opacus.md"
REFUSALS_BEGIN = "<!-- opacus-refusals:begin (generated from REFUSALS by python tools/docs_hooks.py) -->"
REFUSALS_END = "<!-- opacus-refusals:end -->"


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


def _option_cell(option: str) -> str:
    """An option as code where it is code: ``a=1 / b=2`` whole, else each ``name=value`` token."""
    tokens = option.split()
    if all(t == "/" or "=" in t or t.startswith('"') for t in tokens):
        return " / ".join(f"`{part.strip()}`" for part in option.split(" / "))
    return " ".join(f"`{t}`" if re.fullmatch(r"\w+=\S*", t) else t for t in tokens)


def refusals_table() -> str:
    """Markdown: every entry of :data:`idpsgd.engine.opacus_compat.REFUSALS` (option, error, reason)."""
    from idpsgd.engine.opacus_compat import REFUSALS

    rows = ["| Opacus option | raises | why |", "| --- | --- | --- |"]
    for r in REFUSALS:
        reason = r.reason.replace("|", "\\|")
        rows.append(f"| {_option_cell(r.option)} | `{r.error.__name__}` | {reason} |")
    return "\n".join(rows) + "\n"


def refusals_block(page: str) -> str:
    """The table between the page's refusal markers (ValueError unless each marker is there once)."""
    if page.count(REFUSALS_BEGIN) != 1 or page.count(REFUSALS_END) != 1:
        raise ValueError(f"docs/{OPACUS_PAGE} must hold {REFUSALS_BEGIN} and {REFUSALS_END} once each")
    return page.split(REFUSALS_BEGIN, 1)[1].split(REFUSALS_END, 1)[0].strip("\n") + "\n"


def write_refusals(path: Path | None = None) -> bool:
    """Rewrite the refusal table of ``docs/opacus.md`` from ``REFUSALS``; whether it changed."""
    path = path or ROOT / "docs" / OPACUS_PAGE
    page = path.read_text()
    old = refusals_block(page)
    new = refusals_table()
    if old == new:
        return False
    head, rest = page.split(REFUSALS_BEGIN, 1)
    tail = rest.split(REFUSALS_END, 1)[1]
    path.write_text(f"{head}{REFUSALS_BEGIN}\n{new}{REFUSALS_END}{tail}")
    return True


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == CLI_PAGE:
        if markdown.count(CLI_MARKER) != 1:
            raise ValueError(f"docs/{CLI_PAGE} must hold the marker {CLI_MARKER} exactly once")
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if page.file.src_uri == OPACUS_PAGE and refusals_block(markdown) != refusals_table():
        raise ValueError(
            f"docs/{OPACUS_PAGE}'s table of refused options differs from idpsgd.engine.opacus_compat.REFUSALS: "
            "run python tools/docs_hooks.py to rewrite it"
        )
    return markdown


def on_files(files, config):
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench-results/{png.name}", abs_src_path=str(png)))
    return files


if __name__ == "__main__":  # python tools/docs_hooks.py: rewrite docs/opacus.md's refusal table from REFUSALS
    print("docs/opacus.md:", "refusal table rewritten" if write_refusals() else "refusal table up to date")
