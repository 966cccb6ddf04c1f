"""The documentation is inside the repository, and what cites it finds what it cites.

Every ``docs/<page>.md §N`` a docstring, comment or page cites names a section (or a numbered
item) that page has; no file names a document that is not in the repository; the README
links every page of the site.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SEARCHED = ("ipuloop", "tests", "benchmarks", "docs", "examples")
CITATION = re.compile(r"(?:docs/)?(poptorch-semantics|reliability)\.md §(\d+)(?:\.(\d+))?")


def _texts():
    for folder in SEARCHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md") and "__pycache__" not in path.parts:
                yield path, path.read_text()
    yield ROOT / "README.md", (ROOT / "README.md").read_text()


def _has(page: str, section: str, item: str | None) -> bool:
    """``§N`` is a heading ``## N.``; ``§N.M`` a heading ``### N.M``, or item ``M.`` under the
    heading ``## N.``."""
    text = (DOCS / f"{page}.md").read_text()
    if item is None:
        return re.search(rf"^## {section}\. ", text, re.M) is not None
    if re.search(rf"^### {section}\.{item} ", text, re.M):
        return True
    part = re.search(rf"^## {section}\. .*?(?=^## |\Z)", text, re.M | re.S)
    return part is not None and re.search(rf"^{item}\. ", part.group(0), re.M) is not None


def test_every_citation_names_a_section_of_a_page_in_the_repository():
    cited = 0
    for path, text in _texts():
        for m in CITATION.finditer(text):
            if not m.group(0).startswith("docs/") and path.parent != DOCS:
                pytest.fail(
                    f"{path.relative_to(ROOT)}: {m.group(0)!r} does not say where the "
                    "page is: cite docs/<page>.md"
                )
            assert _has(m.group(1), m.group(2), m.group(3)), (
                f"{path.relative_to(ROOT)} cites {m.group(0)}, which docs/{m.group(1)}.md lacks"
            )
            cited += 1
        # "§2 items 1, 4 and 5": each item is a section of its own
        for m in re.finditer(
            r"(reliability|poptorch-semantics)\.md §(\d+) items? ([\d, and]+)", text
        ):
            for item in re.findall(r"\d+", m.group(3)):
                assert _has(m.group(1), m.group(2), item), (path, m.group(0), item)
    assert cited >= 25


def test_no_file_names_a_document_outside_the_repository():
    for path, text in _texts():
        for m in re.finditer(r"[\w./-]*(?:semantics|reliability)\.md", text):
            name = m.group(0)
            target = (ROOT / name) if "/" in name else (path.parent / name)
            assert target.resolve().is_file() and DOCS in target.resolve().parents, (
                f"{path.relative_to(ROOT)} names {name}, which is not a page of docs/"
            )


def test_the_readme_links_every_page():
    readme = (ROOT / "README.md").read_text()
    pages = [p for p in DOCS.glob("*.md") if p.name != "index.md"] + [DOCS / "api" / "index.md"]
    for page in pages:
        assert f"(docs/{page.relative_to(DOCS).as_posix()}" in readme, page.name
    assert len(readme.splitlines()) <= 160  # a front door: the rest is in docs/


def test_the_site_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert page.relative_to(DOCS).as_posix() in config, page


def test_every_test_the_docs_name_exists():
    """``test_x.py::test_name`` in a page (the reliability checks, where a change goes) names a
    test function of that file: renaming a test means updating the page that cites it."""
    named = 0
    for path in DOCS.rglob("*.md"):
        for file, name in re.findall(
            r"(?:tests/[\w/]*)?(test_\w+\.py)::(test_\w+)", path.read_text()
        ):
            (found,) = (ROOT / "tests").rglob(file)  # each basename once under tests/
            source = found.read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{path.name}: {file}::{name}"
            named += 1
    assert named >= 40
