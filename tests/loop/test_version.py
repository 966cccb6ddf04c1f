"""``ipuloop.version``: the version the package reports (and checkpoints record) is the one
it is built as (``pyproject.toml``)."""

from __future__ import annotations

import re
from pathlib import Path

import ipuloop
from ipuloop.version import __version__

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_version_is_the_projects():
    project = PYPROJECT.read_text().split("[project]", 1)[1].split("\n[", 1)[0]
    built = re.search(r'^version\s*=\s*"([^"]+)"', project, re.M)
    assert built is not None and __version__ == built.group(1) == ipuloop.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
