"""CI's two environments run one suite between them (.ci/run): each test file runs once, in
whichever environment reaches it first, unless it belongs to one of them.

Both environments collect the whole suite and run it side by side. Before a file's first test,
an environment claims the file in a folder both see (``IPULOOP_CI_SHARE``), one claim per file
and pass (the ``-m`` expression, so a file's ``threads`` tests are claimed apart from its
others); a file the other environment claimed first is passed over, its tests neither run nor
reported here. Each environment runs the files that belong to it first, then the shared ones,
those with the most slow tests first, so that the two end close together whatever the tests
cost. Outside CI (no ``IPULOOP_CI_SHARE``) nothing changes.

Which files belong to one environment (``IPULOOP_CI_SIDE``):
- ``sdk`` (Python 3.8, torch 2.0.1, as PopTorch 3.4 pins): the emulator's own tests, which
  mirror PopTorch on the torch it runs on, and ``test_mixed_float.py`` (the emulator device's
  rule for float16 and float32 operands, whose host kernels differ by torch); the ecosystem
  programs, the model garden and benchmarks/overhead.py, which need that environment's
  packages; test_hardening.py, whose stress repeats time signals against a child process's
  start, which this Python and torch make in about half the time;
- ``current`` (the current torch): benchmarks/gpu.py's tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Read once and taken out of the environment: a pytest a test starts in a subprocess runs what
# it is given, all of it
SHARE = os.environ.pop("IPULOOP_CI_SHARE", None)
SIDE = os.environ.pop("IPULOOP_CI_SIDE", "")
BELONGS = {
    "sdk": (
        "test_emulator_",
        "test_mixed_float",
        "test_ecosystem_",
        "test_model_garden",
        "test_docs_lightning",
        "test_benchmarks",
        "test_hardening",
    ),
    "current": ("test_gpu_bench",),
}
if SHARE and SIDE not in BELONGS:
    raise RuntimeError(f"IPULOOP_CI_SIDE={SIDE!r}: one of {sorted(BELONGS)}")

_decided: dict[Path, bool] = {}


def belongs_to(path: Path) -> str | None:
    """The environment the test file at ``path`` belongs to, or None (either)."""
    for side, prefixes in BELONGS.items():
        if path.name.startswith(prefixes):
            return side
    return None


def order(items: list[pytest.Item]) -> None:
    """Files that belong here first, then the shared ones by their count of slow tests (most
    first), then the rest (another environment's, passed over); each file's tests in order."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def rank(path: Path) -> tuple[int, int]:
        side = belongs_to(path)
        slow = sum(1 for i in files[path] if i.get_closest_marker("slow"))
        return (0 if side == SIDE else 2 if side else 1, -slow)

    items[:] = [i for path in sorted(files, key=rank) for i in files[path]]


def runs_here(item: pytest.Item) -> bool:
    """Whether this environment runs ``item``'s file: it belongs here, or this environment
    claimed it first for this pass."""
    path = item.path
    if path not in _decided:
        side = belongs_to(path)
        _decided[path] = side == SIDE if side else _claim(item.config, path)
    return _decided[path]


def _claim(config: pytest.Config, path: Path) -> bool:
    assert SHARE is not None
    passes = config.option.markexpr or "all"
    name = f"{passes}::{path.relative_to(config.rootpath)}".replace("/", "__").replace(" ", "_")
    claim = Path(SHARE) / name
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return claim.read_text().strip() == SIDE
    with os.fdopen(fd, "w") as f:
        f.write(SIDE)
    return True
