"""The built wheel ships ``py.typed``, so type checkers read ipuloop's annotations."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_py_typed(tmp_path):
    pytest.importorskip("setuptools")  # built here without network: no build isolation
    src = tmp_path / "src"  # a clean copy: no build/ folder left in the checkout, none reused
    shutil.copytree(REPO / "ipuloop", src / "ipuloop", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("ipuloop-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ipuloop/py.typed" in names
    assert "ipuloop/integrations/plotting.py" in names and "ipuloop/callbacks/base.py" in names
    assert "ipuloop/emulate/_binding/poptorch.py" in names  # python -m ipuloop.emulate's workers
