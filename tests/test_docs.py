"""The documentation stays true: its python blocks run, its commands parse, its references exist.

The site itself is built by ``make docs`` (``mkdocs build --strict``: broken links, anchors and API
names fail); these tests need no docs dependencies.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex

import numpy as np
import pytest

from doc_blocks import ROOT, blocks, doc_block

# named blocks that another test file runs, with its own assertions
RUN_ELSEWHERE = {"opacus-port": "test_opacus_port.py"}


def _check_byo(ns, out):
    engine, budgets = ns["engine"], ns["budgets"]
    eps = engine.get_epsilon().per_group
    values = np.unique(budgets.epsilons)
    assert engine.steps > 0
    assert eps.shape == values.shape and np.all(eps <= values + 1e-9) and np.all(eps > 0.5 * values)
    ind = np.asarray(ns["eps_i"])
    assert ind.shape == (len(budgets),) and np.all(ind <= budgets.epsilons + 1e-9)


def _check_readme(ns, out):
    eps = ns["engine"].get_epsilon()
    assert np.allclose(eps.budgets, [1.0, 3.0]) and np.all(eps.per_group <= eps.budgets + 1e-9)
    assert np.all(eps.per_group > 0.9 * eps.budgets) and ns["engine"].steps > 0
    assert "epsilon" in out.lower() or "ε" in out


def _check_budgets(ns, out):
    groups = ns["groups"]
    assert out.count("sigma=") == 3 and "Budgets(n=1000, groups=3" in out
    assert str(groups.epsilons[0]) not in out.split("uniform")[0]  # the reprs never list per-example values
    a = ns["a"]  # the last assignment (scale): each group within its budget
    assert all(g.epsilon <= g.budget + 1e-9 for g in a.groups)


def _check_individual(ns, out):
    eps_i = ns["eps_i"]
    assert ns["tracker"].kind == "guarantee" and out.startswith("guarantee")
    assert eps_i.shape == (400,) and np.all(eps_i <= 2.0 + 1e-9) and eps_i.min() < eps_i.max()


def _check_noise_budgets(ns, out):
    eps = ns["engine"].get_epsilon(1e-5).per_group  # each group at its own budget (issue 38: they did nothing)
    assert np.all(eps <= [1.0, 2.0, 3.0]) and np.all(eps >= 0.999 * np.array([1.0, 2.0, 3.0]))
    assert ns["engine"].steps == 30 and len(set(out.splitlines()[0].split(","))) == 3


def _check_user_level(ns, out):
    engine, budgets = ns["engine"], ns["budgets"]
    eps = engine.get_epsilon()
    assert engine.steps > 0 and engine.parameters.privacy_unit == "user"
    assert np.all(eps.per_group <= np.unique(budgets.epsilons) + 1e-9)
    assert "users" in out and "examples" not in out  # the groups count users (issue 48)


CHECKS = {
    "user-level": _check_user_level,
    "opacus-noise-budgets": _check_noise_budgets,
    "byo": _check_byo,
    "readme-quickstart": _check_readme,
    "budgets": _check_budgets,
    "individual-accounting": _check_individual,
}
RUNNABLE = [b for b in blocks("python") if b.name is not None and b.name not in RUN_ELSEWHERE]


def test_every_python_block_is_marked():
    unmarked = [b.where for b in blocks("python") if b.tag is None]
    assert not unmarked, (
        f"python blocks without a <!-- doc-test: NAME --> or <!-- doc-test: skip: REASON --> line: {unmarked}"
    )
    skipped = [b for b in blocks("python") if b.skip_reason is not None]
    assert all(len(b.skip_reason) > 10 for b in skipped), [b.where for b in skipped]


def test_block_names_are_unique_and_checked():
    names = [b.name for b in blocks("python") if b.name is not None]
    assert len(names) == len(set(names)), names
    assert set(CHECKS) <= set(names) and set(RUN_ELSEWHERE) <= set(names)
    for name, test_file in RUN_ELSEWHERE.items():
        assert f'doc_block("{name}")' in (ROOT / "tests" / test_file).read_text()


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_doc_block_runs(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__doc_block__"}
    exec(compile(block.code, block.where, "exec"), ns)
    check = CHECKS.get(block.name)
    if check is not None:
        check(ns, capsys.readouterr().out)


# --- commands -----------------------------------------------------------------------------------
ENV = re.compile(r"^(?:\w+=\S*\s+)+")
PLACEHOLDER = re.compile(r"[\[\]|<>]|\.\.\.|…|\b[A-Z][A-Z_0-9]*\b")


def _commands():
    """(where, argv) of every concrete ``idpsgd ...`` command in the docs: each line of a bash block,
    and each inline code span with a flag and without placeholders (``DIR``, ``[--flag]``, ``a|b``, ``...``)."""
    out = []
    for b in blocks("bash"):
        for raw in b.code.replace("\\\n", " ").splitlines():
            line = ENV.sub("", raw.strip())
            if line.startswith("idpsgd "):
                out.append((b.where, line))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = FENCED.sub("", path.read_text(encoding="utf-8"))
        for raw in re.findall(r"`([^`]+)`", text):
            span = ENV.sub("", " ".join(raw.split()))
            if span.startswith("idpsgd ") and " -" in span and not PLACEHOLDER.search(span):
                out.append((str(path.relative_to(ROOT)), span))
    return out


FENCED = re.compile(r"^```.*?^```", re.M | re.S)
COMMANDS = _commands()


def test_docs_hold_commands():
    assert len(COMMANDS) >= 12, COMMANDS


def _flags(parser) -> set[str]:
    """The option strings of a parser and of all its sub-commands' parsers."""
    out = {flag for action in parser._actions for flag in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
    return out


def test_documented_flags_exist():
    """Synopses too (``idpsgd train --method uniform|sample ... [--epochs N]``): every ``--flag`` the
    docs put after ``idpsgd COMMAND`` is one of that command's flags."""
    from idpsgd.cli.main import build_parser

    parser = build_parser()
    commands = {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }
    checked = 0
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8").replace(CLI_REFERENCE_MARKER, "")
        for span in re.findall(r"`([^`]+)`", FENCED.sub("", text)) + [b.code for b in blocks("bash")]:
            for m in re.finditer(r"idpsgd ([a-z][a-z-]+)((?:[^`\n]|\\\n)*)", span):
                if m[1] in commands:
                    unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m[2])) - _flags(commands[m[1]])
                    assert not unknown, f"{path.name}: `idpsgd {m[1]}` has no flag(s) {sorted(unknown)}"
                    checked += 1
    assert checked >= 30


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_documented_command_parses(where, command, capsys):
    """Every concrete command in the docs is accepted by the CLI's parser (flags, choices, types)."""
    from idpsgd.cli.main import build_parser

    argv = shlex.split(command)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in argv or "--version" in argv):
            return
        pytest.fail(f"{where}: `{command}` does not parse: {capsys.readouterr().err.strip()} (exit {exc.code})")
    assert args.command == argv[0]


def test_documented_benchmarks_exist_and_every_benchmark_is_documented():
    registered = set()
    for path in (ROOT / "bench").glob("bench_*.py"):
        registered |= set(re.findall(r"@bench\s*\ndef bench_(\w+)", path.read_text()))
    named = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = path.read_text(encoding="utf-8")
        for names in re.findall(r"bench/run\.py((?: [a-z][a-z0-9_]*)+)", text):
            named |= set(names.split())
        if path.name == "performance.md":  # its table of benchmarks: the first column's names
            for cell in re.findall(r"^\| (`[^|]*?) \|", text, re.M):
                named |= set(re.findall(r"`([a-z0-9_]+)`", cell))
    assert named == registered, (sorted(named - registered), sorted(registered - named))  # each bench documented


OTHER_TOOLS_FLAGS = {"--nproc-per-node", "--no-deps", "--target"}  # torchrun's; pip's (make test-opacus)
SCRIPTS = ("examples/*.py", "bench/*.py", "tests/opacus_suite/run.py", "tools/*.py")  # scripts the docs name


def test_every_documented_flag_exists():
    """Every ``--flag`` in the docs' code belongs to the CLI, an example, a benchmark script or the
    Opacus-suite runner (or to torchrun / pip, named in ``OTHER_TOOLS_FLAGS``)."""
    from idpsgd.cli.main import build_parser

    known = _flags(build_parser()) | OTHER_TOOLS_FLAGS
    for script in (path for pattern in SCRIPTS for path in ROOT.glob(pattern)):
        known |= set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', script.read_text(encoding="utf-8")))
    unknown, seen = [], 0
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = FENCED.sub("", path.read_text(encoding="utf-8"))
        code = re.findall(r"`([^`]+)`", text) + [
            b.code for b in blocks("bash") if b.path == str(path.relative_to(ROOT))
        ]
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(code)):
            seen += 1
            if flag not in known:
                unknown.append(f"{path.name}: {flag}")
    assert seen >= 100 and not unknown, unknown


CLI_REFERENCE_MARKER = "<!-- cli-reference -->"


# --- the generated CLI reference ----------------------------------------------------------------
def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "tools" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_covers_every_command_and_flag():
    from idpsgd.cli.main import build_parser

    hooks = _hooks()
    text = hooks.cli_reference()
    parser = build_parser()
    todo = [parser]
    seen = 0
    while todo:
        p = todo.pop()
        for name, _summary, sub in hooks._subcommands(p):
            assert f"`{sub.prog}`" in text, name
            section = text.split(f"`{sub.prog}`", 1)[1]
            for action in sub._actions:
                for flag in action.option_strings:
                    assert flag in section, (sub.prog, flag)
            seen += 1
            todo.append(sub)
    assert seen >= 15  # the commands and the reproduce experiments
    page = (ROOT / "docs" / hooks.CLI_PAGE).read_text()
    assert page.count(hooks.CLI_MARKER) == 1


def test_refusals_table_is_generated_from_the_engine():
    """docs/opacus.md's table of refused Opacus options is REFUSALS itself, one row per entry."""
    from idpsgd.engine.opacus_compat import REFUSALS

    hooks = _hooks()
    rows = hooks.refusals_table().strip().splitlines()[2:]
    assert len(rows) == len(REFUSALS)
    for row, refusal in zip(rows, REFUSALS, strict=True):
        assert f"`{refusal.error.__name__}`" in row and refusal.reason in row
    page = (ROOT / "docs" / hooks.OPACUS_PAGE).read_text()
    # the table is in the page as read in the repository (the README links there), exactly REFUSALS
    assert hooks.refusals_block(page) == hooks.refusals_table(), "run python tools/docs_hooks.py"
    for refusal in REFUSALS:
        assert refusal.reason.replace("|", "\\|") in page


def test_rst_roles_become_code_spans():
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rst_roles", ROOT / "tools" / "griffe_rst_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    convert = module.markdown_from_rst_roles
    assert convert("a :class:`~.accountant.GroupEpsilons` b") == "a `GroupEpsilons` b"
    assert (
        convert(":func:`idpsgd.assignment.assign`, :meth:`make_private`")
        == "`idpsgd.assignment.assign`, `make_private`"
    )
    assert convert("as in Opacus::\n\n    code") == "as in Opacus:\n\n    code"
    assert convert("ratio 1::2 stays") == "ratio 1::2 stays"


def test_doc_block_lookup_names_its_page():
    assert "make_private" in doc_block("byo")
    with pytest.raises(AssertionError, match="0 python blocks"):
        doc_block("no-such-block")


def test_the_version_is_one_and_the_changelog_has_its_release():
    """Issue 38: pyproject's version, idpsgd.__version__ and a CHANGELOG release section agree (the docs'
    "in idpsgd 0.1.0 ..." notes refer to an earlier release, not the installed one)."""
    import idpsgd

    version = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert idpsgd.__version__ == version != "0.1.0"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M)
    assert changelog.index("## [Unreleased]") < changelog.index(f"## [{version}]") < changelog.index("## [0.1.0]")
