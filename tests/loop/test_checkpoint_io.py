"""``ipuloop.checkpoint_io``: the atomic write, the committed checkpoint (state file, then its
manifest) read back verified, and the newest valid one of a folder."""

from __future__ import annotations

import io
import os
import stat
from itertools import count
from types import SimpleNamespace

import pytest
import torch

from ipuloop import checkpoint_io as ck


def _state_bytes(step: int = 0) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.arange(3.0)}, "counters": {"step": step}, "rng": {}}, buf)
    return buf.getvalue()


@pytest.fixture
def clock(monkeypatch):
    """``time.time()`` in checkpoint_io: 1, 2, 3..., so each save is later than the last."""
    ticks = count(1)
    monkeypatch.setattr(ck, "time", SimpleNamespace(time=lambda: float(next(ticks))))


def test_atomic_write_round_trips_readable_by_others_with_no_temporary_file(tmp_path):
    path = tmp_path / "f"
    ck.atomic_write(path, b"old")
    ck.atomic_write(path, b"new" * 1000)
    assert path.read_bytes() == b"new" * 1000
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_that_raises_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch, error):
    path = tmp_path / "f"
    ck.atomic_write(path, b"old")

    def fail(target, offset: int) -> None:
        if offset >= 4:  # after the first chunk is written
            raise error

    monkeypatch.setattr(ck, "CHUNK", 4)
    monkeypatch.setattr(ck, "write_hook", fail)
    if isinstance(error, OSError):  # the disk's error, naming the file
        with pytest.raises(ck.CheckpointError, match=r"f: cannot be written: .*No space") as e:
            ck.atomic_write(path, b"new content")
        assert e.value.path == str(path)
    else:  # anything else as it is
        with pytest.raises(KeyboardInterrupt):
            ck.atomic_write(path, b"new content")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_a_written_checkpoint_loads_verified_with_its_manifest(tmp_path):
    data = _state_bytes(step=5)
    ck.write_checkpoint(tmp_path / "c", data, {"step": 5, "epoch": 1})
    m = ck.read_manifest(tmp_path / "c" / ck.MANIFEST)  # the folder or a file in it
    assert (m["step"], m["epoch"], m["format_version"]) == (5, 1, ck.FORMAT_VERSION)
    assert m["files"] == {ck.STATE: {"bytes": len(data), "sha256": ck.sha256(data)}}
    assert m["backend"] == "emulator" and m["versions"]["torch"] == torch.__version__
    sd = ck.load_checkpoint(tmp_path / "c")
    assert torch.equal(sd["model"]["w"], torch.arange(3.0)) and sd["counters"] == {"step": 5}
    ck.write_checkpoint(tmp_path / "c", _state_bytes(step=6), {"step": 6})  # re-saved
    assert ck.load_checkpoint(tmp_path / "c")["counters"] == {"step": 6}
    with pytest.raises(ck.CheckpointError, match="backend mismatch"):
        ck.load_checkpoint(tmp_path / "c", backend="poptorch")


def test_an_altered_state_file_or_an_uncommitted_folder_is_refused(tmp_path):
    ck.write_checkpoint(tmp_path / "c", _state_bytes(), {"step": 0})
    state = tmp_path / "c" / ck.STATE
    state.write_bytes(state.read_bytes()[:-1] + b"x")
    with pytest.raises(ck.CheckpointError, match="SHA-256 differs") as e:
        ck.load_checkpoint(tmp_path / "c")
    assert e.value.path == str(state)
    (tmp_path / "c" / ck.MANIFEST).unlink()  # an interrupted save
    with pytest.raises(ck.CheckpointError, match="missing: not a committed"):
        ck.read_manifest(tmp_path / "c")


def test_find_latest_is_the_last_written_valid_untainted_one(tmp_path, clock):
    assert ck.find_latest(tmp_path / "none") is None
    ck.write_checkpoint(tmp_path / "high", _state_bytes(), {"step": 9})
    ck.write_checkpoint(tmp_path / "low", _state_bytes(), {"step": 2})  # written later
    ck.write_checkpoint(tmp_path / "bad", _state_bytes(), {"step": 3, "tainted": True})
    assert ck.find_latest(tmp_path) == tmp_path / "low"
    assert ck.find_latest(tmp_path, include_tainted=True) == tmp_path / "bad"
    given = [tmp_path / "high", tmp_path / "low" / ck.MANIFEST]  # folders or files in them
    assert ck.newest(given) == given[1]
    (tmp_path / "low" / ck.STATE).write_bytes(b"altered")
    with pytest.warns(UserWarning, match=r"Skipped newer checkpoint.*low.*; using .*high"):
        assert ck.find_latest(tmp_path) == tmp_path / "high"
    with pytest.raises(ck.CheckpointError, match="is a file, not a folder"):
        ck.find_latest(tmp_path / "high" / ck.STATE)


def test_check_writable_names_a_folder_that_cannot_hold_checkpoints(tmp_path):
    ck.check_writable(tmp_path / "new" / "folder")
    assert list((tmp_path / "new" / "folder").iterdir()) == []  # its probe file removed
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ck.CheckpointError, match="cannot be created as the checkpoint folder"):
        ck.check_writable(tmp_path / "file")


@pytest.mark.parametrize(
    "name,plain",
    [
        ("a", True),
        ("epoch0-step1", True),
        ("", False),
        (".x", False),
        ("../a", False),
        ("a/b", False),
        (ck.TMP_PREFIX + "1", False),
    ],
)
def test_plain_name(name, plain):
    assert ck.plain_name(name) is plain


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_a_written_file_gets_the_mode_open_would_give(tmp_path, umask, mode):
    """Not mkstemp's 0600: 0666 less the umask, as ``open()`` gives a new file."""
    old = os.umask(umask)
    try:
        assert ck.file_mode() == mode
        ck.atomic_write(tmp_path / "f", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == mode
