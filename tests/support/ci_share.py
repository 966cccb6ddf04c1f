"""CI's two environments run one suite between them (.ci/run), each test file in the
environment a fixed rule gives it, the same in every run.

The rule is the file's folder (``FOLDERS``), with a few files placed apart (``FILES``):

- ``sdk`` (Python 3.8, torch 2.0.1, as PopTorch 3.4 pins): the loop's core, ``loop/`` (the
  Loop, resume, several processes, the IPU path, the checkpoint format, the signal stress
  repeats) and ``data/`` (the data path), on the torch a real IPU system runs; the programs,
  ``programs/`` (the ecosystem's programs, the model garden, the benchmarks' smoke tests),
  which need that environment's packages, and ``docs/test_docs_lightning.py``
  (Lightning's IPU strategy), for the same reason;
- ``current`` (Python 3.11, the current torch, as a laptop without an IPU runs the emulator):
  the emulator's own tests, ``emulator/``, and its tools', ``emulate/``; the callbacks, the
  integrations, the pages (``docs/``), the harness (``support/``), the examples
  (``programs/test_examples*.py``) and ``programs/test_gpu_bench.py``.

A test marked ``newer_torch`` (tests/support/torch_versions.py: it needs torch >= 2.1, and the
SDK's would skip it) runs in ``current`` whatever its folder.

Both environments collect the whole suite; a test whose file the rule gives the other one is
passed over, neither run nor reported. Outside CI (no ``IPULOOP_CI_SIDE``) nothing changes. A
new folder under tests/ must be given an environment here: collection fails until it is.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

# Read once and taken out of the environment: a pytest a test starts in a subprocess runs what
# it is given, all of it
SIDE = os.environ.pop("IPULOOP_CI_SIDE", "")
TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {
    "loop": "sdk",
    "data": "sdk",
    "emulator": "current",
    "emulate": "current",
    "programs": "sdk",
    "callbacks": "current",
    "integrations": "current",
    "docs": "current",
    "support": "current",
}
FILES = {  # fnmatch patterns, relative to tests/
    "docs/test_docs_lightning.py": "sdk",
    "programs/test_examples*.py": "current",
    "programs/test_gpu_bench.py": "current",
}
if SIDE and SIDE not in set(FOLDERS.values()):
    raise RuntimeError(f"IPULOOP_CI_SIDE={SIDE!r}: one of {sorted(set(FOLDERS.values()))}")


def side_of(path: Path) -> str:
    """The environment the test file at ``path`` runs in."""
    relative = path.resolve().relative_to(TESTS)
    for pattern, side in FILES.items():
        if fnmatch.fnmatch(relative.as_posix(), pattern):
            return side
    folder = relative.parts[0] if len(relative.parts) > 1 else ""
    if folder not in FOLDERS:
        raise RuntimeError(
            f"tests/{relative.as_posix()}: its folder has no CI environment: "
            "give it one in tests/support/ci_share.py (FOLDERS)"
        )
    return FOLDERS[folder]


def select(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests this environment runs, in their order; every file's side is checked, so a
    folder without an environment fails collection in both."""
    sides = {path: side_of(path) for path in {item.path for item in items}}
    return [item for item in items if _side(item, sides[item.path]) == SIDE]


def _side(item: pytest.Item, folder_side: str) -> str:
    # a test that needs a newer torch than the SDK's runs on the current one, wherever it is
    return "current" if item.get_closest_marker("newer_torch") else folder_side
