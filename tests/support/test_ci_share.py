"""CI's rule for which environment runs a test file (ci_share.py): fixed, complete, and the
loop's core on the SDK's torch."""

from __future__ import annotations

from pathlib import Path

import ci_share
import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_one_environment():
    files = [p for p in TESTS.rglob("test_*.py") if "fixtures" not in p.parts]
    assert len(files) > 100
    sides = {p: ci_share.side_of(p) for p in files}
    assert set(sides.values()) == {"sdk", "current"}


def test_the_loop_s_core_runs_on_the_sdk_s_torch():
    for name in (
        "loop/test_loop.py",
        "loop/test_resume_paths.py",
        "loop/test_processes.py",
        "loop/test_ipu_path.py",
        "data/test_differential_data.py",
    ):
        assert ci_share.side_of(TESTS / name) == "sdk", name
    assert ci_share.side_of(TESTS / "programs/test_examples.py") == "current"
    assert ci_share.side_of(TESTS / "docs/test_docs_lightning.py") == "sdk"


def test_a_folder_without_an_environment_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ci_share, "TESTS", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(RuntimeError, match="its folder has no CI environment"):
        ci_share.side_of(tmp_path / "elsewhere" / "test_x.py")


def test_a_test_that_needs_a_newer_torch_runs_on_the_current_one():
    class Item:
        def __init__(self, marked):
            self.marked = marked

        def get_closest_marker(self, name):
            return object() if self.marked and name == "newer_torch" else None

    assert ci_share._side(Item(True), "sdk") == "current"
    assert ci_share._side(Item(False), "sdk") == "sdk"
