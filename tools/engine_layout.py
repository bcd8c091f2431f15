"""The engine's sub-package layout (issue 49): check it, or rewrite imports that use an old module path.

``src/idpsgd/engine/`` is laid out so that its listing is the DP-SGD step (docs/inside-the-engine.md):
``sampling/ → per_example/ → clipping/ → noise/ → budget/``, with ``guards/`` and ``distributed/``
around it.  :data:`MOVES` maps every module that moved (old dotted path → new one).

    python tools/engine_layout.py            # check: exit 1 listing what is wrong
    python tools/engine_layout.py --fix      # rewrite old paths in src/, tests/, docs/, bench/, examples/, tools/

The check fails when an old module file still exists, a new one is missing, or a file still names an
old path: an absolute import or dotted name (``idpsgd.engine.sampler``, also in strings such as
``mock.patch("idpsgd.engine.optimizer.gaussian_like")``), a relative import inside the package that
resolves to an old module (``from .sampler import ...``), or a docs path (``engine/sampler.py``);
``--fix`` also re-derives relative docstring references (``:mod:`.sampler```).  Run
it after merging a branch that edited the engine in place: ``--fix`` rewrites those (relative imports
re-derived from each file's location), then the check must pass.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
ENGINE = "idpsgd.engine"

#: old module (relative to idpsgd.engine) -> new module (relative to idpsgd.engine)
MOVES: dict[str, str] = {
    # sampling: Poisson sampling of examples or users, one shard per rank
    "sampler": "sampling.sampler",
    "rank_balance": "sampling.rank_balance",
    # per-example norms: the modes' wrappers and the norm passes
    "wrap": "per_example.wrap",
    "unwrap": "per_example.unwrap",
    "ghost": "per_example.ghost",
    "norms": "per_example.norms",
    "user_norms": "per_example.user_norms",
    "per_sample_rules": "per_example.per_sample_rules",
    "bk": "per_example.bk",
    "bk.keeper": "per_example.bk.keeper",
    "bk.provenance": "per_example.bk.provenance",
    "bk.rules": "per_example.bk.rules",
    "bk.shared": "per_example.bk.shared",
    "bk.tied": "per_example.bk.tied",
    "bk.replay": "per_example.bk.replay",
    "bk.routing": "per_example.bk.routing",
    "machinery": "per_example.machinery",
    "output_hooks": "per_example.output_hooks",
    "per_example_autograd": "per_example.autograd",
    "layer_inputs": "guards.layer_inputs",
    "fingerprint": "guards.fingerprint",
    # clipping at c_i (a user's rows as one at user level)
    "clipping": "clipping.examples",
    "units": "clipping.users",
    # noise σ·c and the normalisation: the noisy optimizer and the run's random sources
    "optimizer": "noise.optimizer",
    "randomness": "noise.randomness",
    # the budget: the ledger, the filters, individual accounting, the journal of draws
    "accountant": "budget.accountant",
    "group_filter": "budget.group_filter",
    "filter": "budget.filter",
    "individual": "budget.individual",
    "sensitivity_check": "budget.sensitivity_check",
    "journal": "budget.journal",
    # guards around the step
    "step_guard": "guards.step_guard",
    "integrity": "guards.integrity",
    "batch_independence": "guards.batch_independence",
    "padding_check": "guards.padding_check",
    "decomposition": "guards.decomposition",
    # several processes: process group and DDP (the package itself), FSDP2, sharded checkpoints
    "distributed": "distributed",
    "fsdp": "distributed.fsdp",
    "sharded_checkpoint": "distributed.sharded_checkpoint",
}

#: old module -> the file it was, relative to src/idpsgd/engine (a package's __init__.py for packages)
OLD_FILES = {old: ("bk/__init__.py" if old == "bk" else old.replace(".", "/") + ".py") for old in MOVES}
OLD_FILES["distributed"] = "distributed.py"


def new_file(new: str) -> str:
    pkg = {"per_example.bk", "per_example.bk.rules", "distributed"}
    return new.replace(".", "/") + ("/__init__.py" if new in pkg else ".py")


SCANNED = ("src", "tests", "docs", "bench", "examples", "tools", "README.md", "mkdocs.yml", "Makefile")
SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".txt", ""}


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for f in sorted(path.rglob("*")):
                generated = "__pycache__" in f.parts or any(part.endswith(".egg-info") for part in f.parts)
                skip = generated or f.name == "CHANGELOG.md" or f.resolve() == Path(__file__).resolve()
                if f.is_file() and f.suffix in SUFFIXES and not skip:
                    yield f


NEW = {new for old, new in MOVES.items() if old != new}


def _longest_old(dotted: str) -> str | None:
    """The longest old module (relative to idpsgd.engine) that ``dotted`` (relative too) starts with;
    None for a path that is already new (``clipping.examples``: the old module ``clipping`` is a package now)."""
    if any(dotted == new or dotted.startswith(new + ".") for new in NEW):
        return None
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        if head in MOVES and MOVES[head] != head:
            return head
    return None


def _absolute(dotted: str) -> str:
    """``idpsgd.engine.<old>[.rest]`` → ``idpsgd.engine.<new>[.rest]`` (others unchanged)."""
    if not dotted.startswith(ENGINE + "."):
        return dotted
    rel = dotted[len(ENGINE) + 1 :]
    old = _longest_old(rel)
    if old is None:
        return dotted
    return f"{ENGINE}.{MOVES[old]}{rel[len(old) :]}"


ABSOLUTE = re.compile(r"\bidpsgd\.engine\.[A-Za-z_][\w.]*")
DOC_PATH = re.compile(r"\bengine/([a-z_]+(?:/[a-z_]+)?)\.py\b")
ROLE = re.compile(r":(?P<role>mod|func|class|meth|data|attr|exc|obj):`(?P<tilde>~?)(?P<dots>\.+)(?P<mod>[\w.]*)`")
RELATIVE = re.compile(r"^(?P<indent>[ \t]*)from (?P<dots>\.+)(?P<mod>[\w.]*) import (?P<names>\([^)]*\)|[^\n#]+)", re.M)


def module_of(path: Path) -> str | None:
    """The dotted module of a file under src/ (None elsewhere)."""
    try:
        rel = path.resolve().relative_to(SRC)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _resolve(package: str, dots: str, mod: str) -> str:
    base = package.split(".")
    up = len(dots) - 1
    base = base[: len(base) - up] if up else base
    return ".".join([*base, *([mod] if mod else [])])


def _relative(from_package: str, target: str) -> tuple[str, str]:
    """(dots, module) of a relative import of ``target`` from ``from_package``."""
    a, b = from_package.split("."), target.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    dots = "." * (len(a) - common + 1)
    return dots, ".".join(b[common:])


def rewrite_relative(text: str, old_pkg: str, new_pkg: str) -> str:
    """Relative imports of a file whose package was ``old_pkg`` (resolved there) re-derived for its
    package ``new_pkg``, old module paths replaced by new ones; an import that names no moved module in
    a file that did not move is left as it is."""

    def one(m: re.Match) -> str:
        target = _resolve(old_pkg, m["dots"], m["mod"])
        names = m["names"]
        inner = names.strip().strip("()")
        items = [n.strip() for n in inner.replace("\n", " ").split(",") if n.strip()]
        submodules = [f"{target}.{item.split(' as ')[0].strip()}" for item in items]
        if m["mod"] == "" or any(_absolute(full) != full for full in submodules):  # names that are modules
            groups: dict[str, list[str]] = {}
            for item in items:
                full = f"{target}.{item.split(' as ')[0].strip()}"
                moved = _absolute(full)
                groups.setdefault(moved.rsplit(".", 1)[0] if moved != full else target, []).append(item)
            if old_pkg == new_pkg and list(groups) == [target]:
                return m.group(0)
            lines = []
            for parent, group in groups.items():
                dots, mod = _relative(new_pkg, parent)
                lines.append(f"{m['indent']}from {dots}{mod} import {', '.join(group)}")
            return "\n".join(lines)
        moved = _absolute(target)
        if old_pkg == new_pkg and moved == target:
            return m.group(0)
        dots, mod = _relative(new_pkg, moved)
        return f"{m['indent']}from {dots}{mod} import {names}"

    def role(m: re.Match) -> str:
        target = _resolve(old_pkg, m["dots"], m["mod"])
        moved = _absolute(target)
        if old_pkg == new_pkg and moved == target:
            return m.group(0)
        dots, mod = _relative(new_pkg, moved)
        return f":{m['role']}:`{m['tilde']}{dots}{mod}`"

    return ROLE.sub(role, RELATIVE.sub(one, text))


ABS_FROM = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<mod>idpsgd\.engine[\w.]*) import (?P<names>\([^)]*\)|[^\n#]+)", re.M
)


def _split_module_names(m: re.Match) -> str:
    """``from idpsgd.engine[.pkg] import a, b`` where a name is a moved module: one import per new parent."""
    items = [n.strip() for n in m["names"].strip().strip("()").replace("\n", " ").split(",") if n.strip()]
    groups: dict[str, list[str]] = {}
    for item in items:
        full = f"{m['mod']}.{item.split(' as ')[0].strip()}"
        moved = _absolute(full)
        groups.setdefault(moved.rsplit(".", 1)[0] if moved != full else m["mod"], []).append(item)
    if list(groups) == [m["mod"]]:
        return m.group(0)
    return "\n".join(f"{m['indent']}from {parent} import {', '.join(g)}" for parent, g in groups.items())


#: a module named relative to ``idpsgd`` in a string (the package's lazy-import table: ``"engine.sampler"``)
LAZY = re.compile(r"(?P<q>[\"'])engine\.(?P<rest>[A-Za-z_][\w.]*)(?P=q)")


def rewrite_text(text: str) -> str:
    text = LAZY.sub(lambda m: m["q"] + _absolute(f"{ENGINE}.{m['rest']}")[len("idpsgd.") :] + m["q"], text)
    text = ABS_FROM.sub(_split_module_names, text)
    text = ABSOLUTE.sub(lambda m: _absolute(m.group(0)), text)

    def doc(m: re.Match) -> str:
        old = m.group(1).replace("/", ".")
        return f"engine/{new_file(MOVES[old])}" if old in MOVES and MOVES[old] != old else m.group(0)

    return DOC_PATH.sub(doc, text)


def problems() -> list[str]:
    out = []
    engine = SRC / "idpsgd" / "engine"
    for old, new in MOVES.items():
        if old != new and (engine / OLD_FILES[old]).exists():
            out.append(f"old module still there: engine/{OLD_FILES[old]} (moves to engine/{new_file(new)})")
        if not (engine / new_file(new)).exists():
            out.append(f"new module missing: engine/{new_file(new)}")
    for f in _files():
        text = f.read_text(encoding="utf-8", errors="replace")
        if rewrite_text(text) != text:
            out.append(f"{f.relative_to(ROOT)}: names an old engine module path")
        module = module_of(f)
        if module and f.suffix == ".py" and module.startswith("idpsgd"):
            pkg = _package(module, f)
            for m in RELATIVE.finditer(text):
                target = _resolve(pkg, m["dots"], m["mod"])
                rel = target[len(ENGINE) + 1 :] if target.startswith(ENGINE + ".") else None
                if rel is not None and _longest_old(rel) is not None and not (engine / new_file(rel)).exists():
                    out.append(f"{f.relative_to(ROOT)}: relative import of old module {target}")
    return out


def moved_packages() -> dict[Path, tuple[str, str]]:
    """Each moved module's new file -> (its package before the move, its package now)."""
    engine = SRC / "idpsgd" / "engine"
    out = {}
    for old, new in MOVES.items():
        old_file = OLD_FILES[old]
        if old_file == new_file(new):
            continue
        old_pkg = f"{ENGINE}.{old}" if old_file.endswith("__init__.py") else f"{ENGINE}.{old}".rsplit(".", 1)[0]
        new_pkg = f"{ENGINE}.{new}" if new_file(new).endswith("__init__.py") else f"{ENGINE}.{new}".rsplit(".", 1)[0]
        out[(engine / new_file(new)).resolve()] = (old_pkg, new_pkg)
    return out


def fix(moved: bool = False) -> list[Path]:
    """Rewrite old paths everywhere.  ``moved``: the files were just moved (``git mv``) and their relative
    imports still resolve from their old place: re-derive them (once, right after the move)."""
    changed = []
    packages = moved_packages() if moved else {}
    for f in _files():
        text = f.read_text(encoding="utf-8")
        new = text
        module = module_of(f) if f.suffix == ".py" else None
        if f.resolve() in packages:
            new = rewrite_relative(new, *packages[f.resolve()])
        elif module and module.startswith("idpsgd"):  # a file in place: its imports of moved modules
            pkg = _package(module, f)
            new = rewrite_relative(new, pkg, pkg)
        new = rewrite_text(new)
        if new != text:
            f.write_text(new, encoding="utf-8")
            changed.append(f)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", action="store_true", help="rewrite old module paths in place, then check")
    parser.add_argument(
        "--just-moved",
        action="store_true",
        help="with --fix: the moved files' relative imports still resolve from "
        "their old place (right after the git mv)",
    )
    args = parser.parse_args(argv)
    if args.fix:
        for f in fix(args.just_moved):
            print(f"rewrote {f.relative_to(ROOT)}")
    found = problems()
    for p in found:
        print(p)
    print("engine layout: OK" if not found else f"engine layout: {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
