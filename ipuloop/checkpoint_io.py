"""Checkpoint files: atomic write, manifest, verification, load, and finding the newest.

A checkpoint is a folder ``<dirpath>/<name>/`` holding ``state.pt`` (``torch.save`` of
``Loop.state_dict()``: tensors, numbers, strings, lists and dicts only) and ``manifest.json``,
written last as the commit; a folder without a manifest is an interrupted save. Each file is
written by ``atomic_write`` (a temporary file next to it, fsync, ``os.replace``, fsync of the
folder), so a crash at any moment leaves every committed checkpoint whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .backend import backend_name, poptorch_module

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "STATE",
    "TMP_PREFIX",
    "CheckpointError",
    "atomic_write",
    "fsync_dir",
    "sha256",
    "dump",
    "plain_name",
    "read_manifest",
    "load_checkpoint",
    "write_checkpoint",
    "check_writable",
    "remove",
    "newest",
    "find_latest",
]

FORMAT_VERSION = "1.1"  # major.minor: readers reject a newer major version (1.1: epoch
# orders drawn as torch's DataLoader draws them, the base seed first)
MANIFEST, STATE = "manifest.json", "state.pt"
TMP_PREFIX = ".ipuloop-tmp-"  # every temporary file starts with this
CHUNK = 1 << 20  # bytes per write call
write_hook: Callable[[Path, int], None] | None = None  # tests: runs before each chunk


class CheckpointError(Exception):
    """A checkpoint file cannot be written or trusted: ``path`` names it, ``reason`` says why."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"{self.path}: {reason}")


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # makes renames and new entries in the folder durable
        finally:
            os.close(fd)
    except OSError as e:  # an I/O error: what was renamed into it may not be on disk
        raise CheckpointError(folder, f"cannot be synced to disk: {e}") from e


def file_mode() -> int:
    """The mode a new file gets from ``open()``: 0o666 less the process's umask (0o644 under the
    usual 022). ``mkstemp`` creates its files 0o600, which would hide them from the user's
    group and others where the umask lets them read. Read from ``/proc`` where it is (setting
    the umask to read it back races with other threads), else set and put back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, data: bytes) -> None:
    """The one write primitive: ``path`` ends with its old content or ``data``, never a mix."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)  # same filesystem
    except OSError as e:  # no inode left, no permission...
        raise CheckpointError(path, f"cannot be written: {e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode())  # mkstemp's 0600 would hide them from others
            for offset in range(0, len(data), CHUNK):
                if write_hook is not None:
                    write_hook(path, offset)
                f.write(data[offset : offset + CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # disk full, permissions...: name the file
            raise CheckpointError(path, f"cannot be written: {e}") from e
        raise
    fsync_dir(path.parent)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dump(manifest: dict[str, Any]) -> bytes:
    # The only serialization: a reader re-dumps what it parsed and requires the same bytes.
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def _folder(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.parent if p.name in (MANIFEST, STATE) and not p.is_dir() else p


def plain_name(name: str) -> bool:
    """A bare, visible file or folder name: nothing outside its folder, no temporary file."""
    return bool(name) and Path(name).name == name and not name.startswith(".")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (its folder or a file in it), verified:
    its own checksum and format version, then each file's size and SHA-256."""
    return _verified(path)[0]


def _verified(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, bytes]]:
    folder = _folder(path)
    if folder.is_file():
        raise CheckpointError(folder, f"is a file, not a checkpoint folder ({MANIFEST} + {STATE})")
    mpath = folder / MANIFEST
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            mpath,
            "missing: not a committed ipuloop checkpoint (an "
            "interrupted save, or a folder ipuloop did not write)",
        ) from None
    except OSError as e:
        raise CheckpointError(mpath, f"cannot be read: {e}") from None
    try:
        m = json.loads(raw)
        body = dict(m)
        claimed = body.pop("manifest_sha256")
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            mpath, f"not an ipuloop manifest (truncated, altered or foreign): {e!r}"
        ) from None
    if body.get("format") != "ipuloop-checkpoint":
        raise CheckpointError(mpath, "not an ipuloop manifest: no ipuloop format marker")
    major = str(body.get("format_version")).split(".")[0]
    if not major.isdigit() or int(major) > int(FORMAT_VERSION.split(".")[0]):
        raise CheckpointError(
            mpath,
            f"format version {body.get('format_version')} is newer "
            f"than this ipuloop reads ({FORMAT_VERSION}): upgrade ipuloop",
        )
    if raw != dump(m) or claimed != sha256(dump(body)):
        raise CheckpointError(mpath, "checksum mismatch: the manifest was altered or corrupted")
    files = body.get("files") or {}
    if STATE not in files:
        raise CheckpointError(mpath, f"lists no {STATE}")
    contents = {}
    for name, meta in files.items():
        fpath = folder / name
        if not plain_name(name):
            raise CheckpointError(mpath, f"lists a file outside its folder: {name!r}")
        try:
            data = contents[name] = fpath.read_bytes()
            size, digest = int(meta["bytes"]), str(meta["sha256"])
        except (OSError, TypeError, KeyError, ValueError) as e:
            raise CheckpointError(fpath, f"listed in the manifest but unreadable: {e!r}") from None
        if len(data) != size:
            raise CheckpointError(
                fpath, f"is {len(data)} bytes, the manifest says {size}: truncated or altered"
            )
        if sha256(data) != digest:
            raise CheckpointError(fpath, "SHA-256 differs from the manifest: altered or corrupted")
    return body, contents


def load_checkpoint(path: str | os.PathLike, *, backend: str | None = None) -> dict[str, Any]:
    """Verify the checkpoint at ``path`` and return its ``Loop.state_dict()``, on the CPU.

    Unpickling is ``torch.load(weights_only=True)``: a file that would run code is rejected.
    ``backend`` ("emulator" or "poptorch"): reject a checkpoint another backend wrote (what a
    resume does: optimizer and device random states do not carry over between backends).
    Without it, any backend's checkpoint loads, e.g. to take only its ``["model"]`` weights.
    """
    manifest, contents = _verified(path)
    data = contents[STATE]  # loads the bytes it verified, not a second read
    saved = manifest.get("backend")
    if backend is not None and saved is not None and saved != backend:
        raise CheckpointError(
            _folder(path) / MANIFEST,
            f"backend mismatch: written by the {saved!r} backend, and this process runs "
            f"{backend!r}. The optimizer and device random states of one do not carry over to "
            f"the other, so it cannot resume exactly: resume with IPULOOP_BACKEND={saved}, or "
            "start a new fit from its weights: model.load_state_dict(load_checkpoint(path)"
            '["model"]).',
        )
    spath = _folder(path) / STATE
    try:
        sd = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 (UnpicklingError, RuntimeError, EOFError...: all mean "untrusted")
        raise CheckpointError(spath, f"rejected by torch.load(weights_only=True): {e}") from None
    if not isinstance(sd, dict) or not {"model", "counters", "rng"} <= sd.keys():
        raise CheckpointError(spath, "not an ipuloop loop state (no model, counters or rng)")
    return sd


def provenance() -> dict[str, Any]:
    """Who wrote a checkpoint: the backend and the versions of ipuloop, torch and poptorch."""
    from .version import __version__

    return {
        "backend": backend_name(),
        "versions": {
            "ipuloop": __version__,
            "torch": torch.__version__,
            "poptorch": getattr(poptorch_module(), "__version__", None),
        },
    }


def write_checkpoint(folder: Path, data: bytes, fields: dict[str, Any]) -> None:
    """Write ``data`` as ``folder``'s state file, then commit it with a manifest holding
    ``fields``, the provenance and the file's size and SHA-256. Re-saving a name un-commits
    it first. Raises ``CheckpointError`` naming the file that could not be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        recommit = (folder / MANIFEST).exists()
        if recommit:  # re-saving a name: un-commit it first
            (folder / MANIFEST).unlink()
    except OSError as e:
        raise CheckpointError(folder, f"cannot be created: {e}") from e
    if recommit:
        fsync_dir(folder)
    atomic_write(folder / STATE, data)
    manifest = {
        "format": "ipuloop-checkpoint",
        "format_version": FORMAT_VERSION,
        **provenance(),
        **fields,
        "wall_time": time.time(),
        "files": {STATE: {"bytes": len(data), "sha256": sha256(data)}},
    }
    manifest["manifest_sha256"] = sha256(dump(manifest))
    atomic_write(folder / MANIFEST, dump(manifest))  # the commit
    fsync_dir(folder.parent)  # the new folder's own entry


def check_writable(folder: Path) -> None:
    """Create ``folder`` and write, sync, rename and delete a small file in it, as a save
    does: a folder that cannot hold checkpoints is a ``CheckpointError`` naming it and the
    system's reason, before any step rather than at the first save."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only file system...
        raise CheckpointError(folder, f"cannot be created as the checkpoint folder: {e}") from e
    probe = folder / f"{TMP_PREFIX}probe"  # a killed process's one goes at the next start
    try:
        atomic_write(probe, b"ipuloop")
    except CheckpointError as e:
        raise CheckpointError(
            folder, f"is not writable, so no checkpoint could be saved: {e.reason}"
        ) from e
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove(path / MANIFEST)  # un-commit first: a crash mid-delete leaves no broken commit
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _written(mpath: Path) -> tuple:
    """When the checkpoint of manifest ``mpath`` was written, as a sort key."""
    try:
        m = json.loads(mpath.read_bytes())
        return (float(m["wall_time"]), int(m["step"]), mpath.stat().st_mtime_ns)
    except (ValueError, TypeError, KeyError, OSError):
        return (math.inf, math.inf, 0)  # unreadable: possibly the newest, so suspect it


def newest(paths: list[str | os.PathLike]) -> Path:
    """The checkpoint of ``paths`` written last (by the time its manifest records)."""
    return max((Path(p) for p in paths), key=lambda p: _written(_folder(p) / MANIFEST))


def find_latest(dirpath: Path, *, include_tainted: bool = False) -> Path | None:
    """The newest valid checkpoint written in ``dirpath`` (by the time its manifest
    records), or None: this run's last save, never an older run's with a higher step.

    Found by scanning the manifests (no pointer file). A newer one that fails verification
    is skipped with a warning naming it and the one used instead.
    """
    if dirpath.is_file():
        raise CheckpointError(dirpath, "is a file, not a folder of checkpoints")
    if not dirpath.is_dir():
        return None
    found = [(_written(mpath), mpath.parent) for mpath in dirpath.glob(f"*/{MANIFEST}")]
    bad: list[str] = []
    for _, folder in sorted(found, key=lambda kf: kf[0], reverse=True):
        try:
            if read_manifest(folder).get("tainted") and not include_tainted:
                continue
        except CheckpointError as e:
            bad.append(str(e))
            continue
        if bad:
            warnings.warn(
                f"Skipped newer checkpoint(s) that failed verification "
                f"({'; '.join(bad)}); using {folder}.",
                stacklevel=2,
            )
        return folder
    if bad:
        warnings.warn(f"No valid checkpoint in {dirpath}: {'; '.join(bad)}.", stacklevel=2)
    return None
