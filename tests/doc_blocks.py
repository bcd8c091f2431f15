"""The python blocks of the documentation (README.md and docs/**/*.md) that the tests run.

Every python block is marked on the line before it: ``<!-- doc-test: NAME -->`` runs it (as written,
in a fresh namespace, from a temporary folder) and names it for :func:`doc_block`;
``<!-- doc-test: skip: REASON -->`` says why it cannot run here (e.g. it needs ``torchrun``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!-- doc-test: (?P<tag>.*?) -->\s*\Z")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    code: str
    tag: str | None  # the doc-test marker's text, None when unmarked

    @property
    def skip_reason(self) -> str | None:
        return self.tag[len("skip:") :].strip() if self.tag and self.tag.startswith("skip:") else None

    @property
    def name(self) -> str | None:
        return None if self.tag is None or self.skip_reason is not None else self.tag

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(lang: str | None = None) -> list[Block]:
    """Every fenced block of the documentation (of one language), in file order."""
    out = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            marker = MARKER.search(text[max(0, m.start() - 200) : m.start()])
            out.append(
                Block(
                    str(path.relative_to(ROOT)),
                    text.count("\n", 0, m.start()) + 1,
                    m["lang"],
                    m["code"],
                    marker["tag"].strip() if marker else None,
                )
            )
    return [b for b in out if lang is None or b.lang == lang]


def doc_block(name: str) -> str:
    """The code of the python block marked ``<!-- doc-test: NAME -->`` (exactly one in the docs)."""
    found = [b for b in blocks("python") if b.name == name]
    assert len(found) == 1, f"the docs hold {len(found)} python blocks marked doc-test: {name} (expected one)"
    return found[0].code
