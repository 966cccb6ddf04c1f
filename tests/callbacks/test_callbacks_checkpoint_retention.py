"""Checkpoint retention under crashes: docs/reliability.md §2 item 15, a Hypothesis state machine.

Rules: train k steps (saving at some of them), save between fits, crash during a save, resume
from the newest checkpoint in a new "process", all with ``save_top_k`` = k in {1, 2, 3}. A
crash is a snapshot of the checkpoint folder taken at a chosen I/O event of a save (a chunk
written, or a rotation's delete) and put back after the process "died": exactly what a SIGKILL
at that moment leaves, with no cleanup run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import helpers_train as H
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ipuloop import Callback
from ipuloop import checkpoint_io as ck
from ipuloop.callbacks.checkpoint import (
    CheckpointError,
    ModelCheckpoint,
    load_checkpoint,
    read_manifest,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*samples are dropped each epoch", "ignore:Not overwriting"
)

EPOCHS = 1000  # fits end by StopAfter, never by running out of epochs
MAX_EXAMPLES = int(os.environ.get("IPULOOP_RETENTION_EXAMPLES", "40"))


class Crash(BaseException):
    """The process dies here (not an Exception: nothing may catch and carry on)."""


# Where a save crashes: before its i-th chunk of state.pt, before the manifest's write (the
# commit), or before its i-th rotation delete (after the commit). Past the last one: no crash.
CRASH = st.none() | st.tuples(st.sampled_from(["state", "manifest", "rotate"]), st.integers(0, 11))


class Disk:
    """Counts a save's I/O events and crashes at the chosen one, snapshotting the folder."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        self.crash_at: tuple[str, int] | None = None  # (kind, index) in the running save
        self.events: dict[str, int] = {}
        self.snapshot: Path | None = None

    def event(self, kind: str) -> None:
        if self.crash_at is None:
            return
        if self.crash_at == (kind, self.events.get(kind, 0)):
            self.snapshot = Path(tempfile.mkdtemp(prefix="crash-"))
            shutil.copytree(self.dirpath, self.snapshot / "d")
            self.crash_at = None
            raise Crash
        self.events[kind] = self.events.get(kind, 0) + 1

    def restore(self) -> None:
        """The dead process's folder, as the crash left it."""
        shutil.rmtree(self.dirpath)
        shutil.copytree(self.snapshot / "d", self.dirpath)
        shutil.rmtree(self.snapshot)
        self.snapshot = None


DISK: Disk | None = None
_real_remove = ck.remove


def _write_hook(path: Path, offset: int) -> None:
    DISK.event("manifest" if path.name == ck.MANIFEST else "state")


def _remove(path: Path) -> None:
    DISK.event("rotate")  # a rotation's delete (counted only while a save runs)
    _real_remove(path)


class CrashableCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint whose next save crashes at ``crash_at`` (if the save gets there)."""

    crash_at: tuple[str, int] | None = None

    def save(self, loop, **kw):
        crash = self.crash_at
        if crash is not None and crash[0] == "manifest":
            crash = ("manifest", 0)  # it is one chunk
        DISK.events, DISK.crash_at = {}, crash
        self.crash_at = None
        try:
            return super().save(loop, **kw)
        finally:
            DISK.crash_at = None


class Steps(Callback):
    """Stops the fit after ``n`` steps; saves after the steps in ``save_at`` (1-based)."""

    order = 95  # after ModelCheckpoint

    def __init__(
        self, n: int, save_at: set[int], crash_at: tuple[str, int] | None, machine
    ) -> None:
        self.n, self.save_at, self.crash_at, self.machine = n, save_at, crash_at, machine
        self.done = 0

    def on_train_step_end(self, loop) -> None:
        self.done += 1
        if self.done in self.save_at:
            self.machine.save(crash_at=self.crash_at if self.done == max(self.save_at) else None)
        if self.done >= self.n:
            loop.stop()


def valid(dirpath: Path) -> dict[str, dict]:
    out = {}
    for p in dirpath.iterdir():
        try:
            out[p.name] = read_manifest(p)
        except CheckpointError:
            pass
    return out


class Retention(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dirpath = Path(tempfile.mkdtemp(prefix="retention-")) / "ckpt"
        self.dirpath.mkdir()
        global DISK
        DISK = Disk(self.dirpath)
        self.k = 1
        self.loop = self.ckpt = self.loader = None  # the live process, if any
        self.saved = False  # a save has succeeded
        self.last_step = -1  # step of the newest save that succeeded
        self.protected: str | None = None  # resumed from, and that fit has not ended well
        self.clean = True  # no crash left files since the last fit or save (which clean up)

    def teardown(self) -> None:
        shutil.rmtree(self.dirpath.parent, ignore_errors=True)

    # -- the process --------------------------------------------------------------------------
    def _process(self) -> None:
        self.ckpt = CrashableCheckpoint(
            self.dirpath, every_n_epochs=None, save_top_k=self.k, save_on_exception=False
        )
        self.steps = Steps(0, set(), None, self)
        self.loop, self.loader, _ = H.make_loop(callbacks=[self.ckpt, self.steps])

    def _fit(
        self, n: int, save_at: set[int], crash_at: tuple[str, int] | None, resume: bool = False
    ) -> None:
        self.steps.n, self.steps.crash_at, self.steps.done = n, crash_at, 0
        self.steps.save_at = {s for s in save_at if s <= n}
        try:
            self.loop.fit(self.loader, EPOCHS, resume_from="last" if resume else None)
        except Crash:
            self._died()
            return
        self.protected = None  # the fit ended: its resumed-from may be rotated out now
        self.clean = True

    def _died(self) -> None:
        DISK.restore()
        self.loop = self.ckpt = self.loader = None
        self.clean = False

    def save(self, crash_at: tuple[str, int] | None) -> None:
        self.ckpt.crash_at = crash_at
        folder = self.ckpt.save(self.loop)  # a Crash propagates: the process is dead
        self.saved = True
        self.last_step = self.loop.state.step
        assert folder is not None and folder.name in valid(self.dirpath)
        assert not list(self.dirpath.rglob(f"{ck.TMP_PREFIX}*"))  # clean save, no temp file
        if self.protected is not None:
            read_manifest(self.dirpath / self.protected)

    # -- rules --------------------------------------------------------------------------------
    @initialize(k=st.integers(1, 3))
    def start(self, k: int) -> None:
        self.k = k
        self._process()

    @precondition(lambda self: self.loop is not None)
    @rule(n=st.integers(1, 3), save_at=st.sets(st.integers(1, 3)), crash_at=CRASH)
    def train(self, n: int, save_at: set[int], crash_at: tuple[str, int] | None) -> None:
        self._fit(n, save_at, crash_at)

    @precondition(lambda self: self.loop is not None)
    @rule(crash_at=CRASH)
    def save_between_fits(self, crash_at: tuple[str, int] | None) -> None:
        try:
            self.save(crash_at)
        except Crash:
            self._died()
            return
        self.clean = True

    @precondition(lambda self: self.loop is not None)
    @rule()
    def kill(self) -> None:
        """The process dies between saves (nothing in flight)."""
        DISK.snapshot = Path(tempfile.mkdtemp(prefix="crash-"))
        shutil.copytree(self.dirpath, DISK.snapshot / "d")
        clean = self.clean
        self._died()
        self.clean = clean  # no save was running: nothing new left behind

    @precondition(lambda self: self.loop is None and self.saved)
    @rule(n=st.integers(1, 3), save_at=st.sets(st.integers(1, 3)), crash_at=CRASH)
    def resume(self, n: int, save_at: set[int], crash_at: tuple[str, int] | None) -> None:
        self._process()
        self.protected = self.ckpt.latest().name
        self._fit(n, save_at, crash_at, resume=True)

    @precondition(lambda self: self.loop is None and not self.saved)
    @rule()
    def start_over(self) -> None:
        """Nothing was ever saved: a new run in the same folder."""
        assert not valid(self.dirpath)
        self._process()

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def a_valid_checkpoint_exists_once_saved(self) -> None:
        if self.saved:
            assert valid(self.dirpath), sorted(os.listdir(self.dirpath))

    @invariant()
    def latest_is_valid(self) -> None:
        latest = ModelCheckpoint(self.dirpath).latest()
        if self.saved:
            assert latest is not None
            load_checkpoint(latest)
            assert read_manifest(latest)["step"] >= self.last_step

    @invariant()
    def resumed_from_is_kept(self) -> None:
        if self.protected is not None:
            read_manifest(self.dirpath / self.protected)  # raises if deleted or broken

    @invariant()
    def at_most_k_plus_one(self) -> None:
        names = set(valid(self.dirpath))
        # The resumed-from checkpoint is protected on top of the k + 1 (the k kept and the one
        # a crash cut off before its rotation) until its fit ends.
        extra = 1 if self.protected in names else 0
        assert len(names) <= self.k + 1 + extra, (self.k, sorted(names), self.protected)

    @invariant()
    def no_leftovers_after_clean_rules(self) -> None:
        if self.clean:
            assert not list(self.dirpath.rglob(f"{ck.TMP_PREFIX}*"))
            assert set(valid(self.dirpath)) == set(os.listdir(self.dirpath))


@pytest.mark.slow
def test_retention_state_machine(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(ck, "CHUNK", 4096)  # ~11 writes a state file: many crash points
    monkeypatch.setattr(ck, "write_hook", _write_hook)
    monkeypatch.setattr(ck, "remove", _remove)
    run_state_machine_as_test(
        Retention,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
