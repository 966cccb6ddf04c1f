"""The documentation's prose stays readable in its source: in ``README.md`` and every page
under ``docs/``, no prose paragraph over 90 words and no prose line over 120 characters.

Prose is every line outside a fenced code block (from a line opening with three backticks or
three tildes to the next) that is not blank and is none of: a table row (starts with ``|``), a
heading (``#``), HTML or an HTML comment (``<``), a link reference definition (``[name]:
target``) or an image (``![``). A paragraph is a run of prose lines; a blank line or any other
line ends it, and a list item (``-``, ``*``, ``+``, ``1.``) or an admonition (``!!!``) starts a
new one, its indented continuation lines belonging to it. Words are what ``str.split`` gives.

Tables, code and the tables the benchmarks write (``benchmarks/*.md``) are exempt: their lines
are as long as their content.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_WORDS = 90
MAX_CHARS = 120

_FENCE = re.compile(r"^\s*(```|~~~)")
_NOT_PROSE = re.compile(r"^\s*(\||#|<|\[[^\]]+\]:\s|!\[)")
_STARTS_ONE = re.compile(r"^\s*([-*+]|\d+[.)]|!!!)\s+")


def paragraphs(text: str) -> list[tuple[int, list[str]]]:
    """The prose paragraphs of a Markdown text, each with its first line's number."""
    found: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        prose = (
            not fenced and not _FENCE.match(line) and line.strip() and not _NOT_PROSE.match(line)
        )
        if current and (not prose or _STARTS_ONE.match(line)):
            found.append((start, current))
            current = []
        if prose:
            start = start if current else number
            current.append(line)
    if current:
        found.append((start, current))
    return found


def test_paragraphs_are_told_apart():
    text = (
        "One two\nthree.\n\n```python\nx = 1\n\nlong code\n```\n| a | b |\n# Head\n"
        "- item one\n  goes on\n- item two\n<!-- note -->\n[ref]: https://example.com\nlast\n"
    )
    assert paragraphs(text) == [
        (1, ["One two", "three."]),
        (11, ["- item one", "  goes on"]),
        (13, ["- item two"]),
        (16, ["last"]),
    ]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_paragraphs_and_lines_are_short(path):
    long_lines, long_paragraphs = [], []
    for start, lines in paragraphs(path.read_text()):
        long_lines += [
            f"line {start + i}: {len(line)} characters"
            for i, line in enumerate(lines)
            if len(line) > MAX_CHARS
        ]
        words = sum(len(line.split()) for line in lines)
        if words > MAX_WORDS:
            long_paragraphs.append(f"paragraph at line {start}: {words} words")
    assert not long_lines and not long_paragraphs, (long_lines, long_paragraphs)
