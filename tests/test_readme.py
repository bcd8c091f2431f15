"""The README is the front page: short, names the two set-up commands, and every link in it holds.

Its example runs with the docs' blocks (``tests/test_docs.py``, block ``readme-quickstart``).
"""

from __future__ import annotations

import re
import unicodedata

from doc_blocks import ROOT, blocks

README = ROOT / "README.md"
HEADING = re.compile(r"^#{1,6} (?P<title>.+?)(?: \{#(?P<id>[\w-]+)\})?\s*$", re.M)


def slug(title: str) -> str:
    """The anchor MkDocs' ``toc`` extension gives a heading (its default ``slugify``)."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", title)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {m["id"] or slug(m["title"]) for m in HEADING.finditer(text)}


def test_front_page_is_short_and_names_the_set_up_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "`make demo`" in text and "`make test`" in text
    assert [b.name for b in blocks("python") if b.path == "README.md"] == ["readme-quickstart"]


def test_front_page_links_point_at_files_and_headings():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert len(local) >= 15
    for link in local:
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.is_file(), f"README.md links to {link}: no such file"
        if anchor:
            assert anchor in anchors(path), f"README.md links to {link}: {target} has no heading #{anchor}"


def test_slug_matches_mkdocs():
    assert slug("Budgets from a column of a table (CSV data)") == "budgets-from-a-column-of-a-table-csv-data"
    assert slug('Private training at near non-private cost (book-keeping, `grad_sample_mode="bk"`)') == (
        "private-training-at-near-non-private-cost-book-keeping-grad_sample_modebk"
    )
    assert slug("Opacus 1.6 bugs met on the way") == "opacus-16-bugs-met-on-the-way"
