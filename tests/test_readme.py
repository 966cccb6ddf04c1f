"""The README's quickstart code runs as written, and its hook order is the loop's."""
from __future__ import annotations

import pathlib
import re

import ipuloop.callbacks.base as base

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def test_readme_example_runs(capsys):
    code = next(b for b in blocks("python") if "loop.fit" in b and "import" in b)
    exec(compile(code, "README.md", "exec"), {})
    loss, acc = capsys.readouterr().out.split()[-2:]
    assert 0 < float(loss) < 0.7 and float(acc) > 0.8


def test_readme_hook_order_matches_the_module_docstring():
    readme = re.search(r"```\n(\[first fit only: on_configure\].*?)```", README.read_text(),
                       re.S).group(1)
    block = re.search(r"::\n\n((?:    .*\n)+)", base.__doc__).group(1)  # the indented pseudocode
    doc_lines = [line[4:] for line in block.splitlines()]
    readme_lines = readme.splitlines()
    assert readme_lines[-1].startswith("on_exception")
    assert readme_lines[:-1] == doc_lines  # the same pseudocode, line for line


def test_readme_commands_are_the_ci_commands():
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest" in ci
    assert 'pip install -e ".[test]" && python -m pytest -q' in README.read_text()
    assert "python -m ipuloop.examples.mnist" in README.read_text()
