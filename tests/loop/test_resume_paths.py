"""Checkpoint and resume paths off the common one: 16-bit optimizer state, a cancelled step,
step saves beside a validation monitor, swapped parameter groups, a preemption or exception
before the filename's log exists, an unwritable folder, and TensorBoard after a resume.

Each resume is compared with a run that was never interrupted, bitwise.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import helpers_train as H
import pytest
from torch_versions import newer_torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, CancelStep, Loop, poptorch
from ipuloop.integrations.tensorboard import TensorBoardLogger
from ipuloop.callbacks.checkpoint import (
    CheckpointError,
    ModelCheckpoint,
    load_checkpoint,
    read_manifest,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*samples are dropped each epoch", "ignore:val_loss covers"
)

N = H.samples_for(1, 2)  # 19 samples: 4 host calls of 4 (micro-batch 2, DI 1, GA 2) per epoch
EPOCHS = 2

# torch 2.0's CPU has no float16 kernels for backward and optimizer ops (as test_precision.py)
NEEDS_CPU_HALF_BACKWARD = newer_torch(
    "torch < 2.1 has no float16 CPU kernels for backward and optimizer ops"
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# -- 16-bit weights with a stateful optimizer -----------------------------------------------------
def _data(n: int = 96, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8, shuffle=True)


def _half_loop(optimizer, batch_norm: bool, callbacks=()) -> Loop:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if batch_norm else []
    model = nn.Sequential(nn.Linear(8, 16), *norm, nn.ReLU(), nn.Linear(16, 2))
    return Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=optimizer(model.parameters()),
        precision="16-true",
        seed=1,
        progress=False,
        callbacks=list(callbacks),
    )


ADAMW = ("AdamW", lambda p: poptorch.optim.AdamW(p, lr=1e-2))
MOMENTUM = ("SGD momentum", lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9))


@NEEDS_CPU_HALF_BACKWARD
@pytest.mark.parametrize(
    "optimizer,batch_norm,stop",
    [
        (ADAMW, False, 8),
        (ADAMW, True, 8),
        (MOMENTUM, False, 8),
        (MOMENTUM, True, 8),
        (ADAMW, True, 6),  # an epoch-end save, taken after validation (read back from the host)
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else str(v),
)
def test_16_true_with_optimizer_state_resumes_bitwise(tmp_path, optimizer, batch_norm, stop):
    """precision="16-true": the optimizer's float32 moments of float16 weights are restored in
    float32 (not cast to float16, where small second moments become 0), so a resumed fit ends
    with bitwise the weights of an uninterrupted one; 6 steps per epoch."""
    ref = _half_loop(optimizer[1], batch_norm)
    ref.fit(_data(), 3, val_loader=_data(seed=1))
    first = _half_loop(
        optimizer[1], batch_norm, [ModelCheckpoint(tmp_path, every_n_steps=1), H.StopAt(stop)]
    )
    first.fit(_data(), 3, val_loader=_data(seed=1))
    saved = load_checkpoint(ModelCheckpoint(tmp_path).latest())["optimizer"]["state"]
    assert all(
        v.dtype == torch.float32 for s in saved.values() for k, v in s.items() if k != "step"
    )  # the moments are checkpointed as the device holds them
    resumed = _half_loop(optimizer[1], batch_norm, [ModelCheckpoint(tmp_path, every_n_steps=1)])
    resumed.fit(_data(), 3, val_loader=_data(seed=1), resume_from="last")
    assert resumed.state.step == ref.state.step == 18
    assert_same_weights(resumed.model, ref.model)
    state = resumed.optimizer.state_dict()["state"]
    assert all(
        v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k != "step"
    )


# -- a checkpoint loaded after validate() ---------------------------------------------------------
def test_load_state_dict_after_validate_validates_the_loaded_weights(tmp_path):
    """Loop.load_state_dict after a validate() (its inference executor still attached, with
    the old weights): the next validate runs the loaded weights."""
    ckpt = ModelCheckpoint(tmp_path)
    trained, loader, ds = H.make_loop(1, 2, callbacks=[ckpt], n=N)
    trained.fit(loader, 1)
    val = DataLoader(ds, batch_size=2)
    loop, _, _ = H.make_loop(1, 2, n=N, init_seed=9)
    before = loop.validate(val)
    loop.load_state_dict(load_checkpoint(ckpt.latest()))
    after = loop.validate(val)
    assert after == trained.validate(val) and after != before


# -- CancelStep, then a mid-epoch checkpoint ------------------------------------------------------
class _CancelOnce(Callback):
    """Cancels, once, the step after step ``at`` of epoch 0 (its host batch is read)."""

    def __init__(self, at: int) -> None:
        self.at, self.done = at, False

    def on_train_step_start(self, loop) -> None:
        if not self.done and loop.state.epoch == 0 and loop.state.step == self.at:
            self.done = True
            raise CancelStep


def test_a_cancelled_step_counts_as_read_in_the_resume_position(tmp_path):
    """A step cancelled in on_train_step_start read its host batch: the checkpoint's position
    (epoch_step) counts it, so the resumed fit reads and trains exactly what the uninterrupted
    run did after the checkpoint (same batches, same number of steps, same weights)."""
    ref = H.Recorder()
    loop, loader, ds = H.make_loop(1, 2, callbacks=[ref, _CancelOnce(1)], n=N)
    ref.dataset = ds
    loop.fit(loader, EPOCHS)
    assert loop.state.step == 2 * 4 - 1  # one of the 8 batches did not run

    first = H.Recorder()
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, save_top_k=-1)
    loop1, loader, ds1 = H.make_loop(
        1, 2, callbacks=[first, _CancelOnce(1), ckpt, H.StopAt(2)], n=N
    )
    first.dataset = ds1
    loop1.fit(loader, EPOCHS)  # batches 0 (step 1), 1 (cancelled), 2 (step 2), then stop
    assert loop1.state.step == 2 and loop1.state.epoch_step == 3

    second = H.Recorder()
    loop2, loader, ds2 = H.make_loop(1, 2, callbacks=[second], n=N, init_seed=5, seed=6)
    second.dataset = ds2
    loop2.fit(loader, EPOCHS, resume_from=str(ckpt.latest()))
    assert ds1.log + ds2.log == ds.log  # every sample read once, as in the uninterrupted run
    assert first.losses + second.losses == ref.losses
    assert loop2.state.counters() == loop.state.counters()
    assert_same_weights(loop2.model, loop.model)


# -- step saves beside a validation monitor -------------------------------------------------------
class _ValScore(Callback):
    """Writes the log ``val_score`` at each validation: ``values[i]`` at the i-th."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.i = values, 0

    def on_validation_end(self, loop) -> None:
        loop.state.logs["val_score"] = self.values[self.i]
        self.i += 1


def test_step_saves_are_not_ranked_by_an_earlier_steps_validation(tmp_path):
    """monitor="val_score" with step and epoch saves: only the epoch-end saves (whose weights
    the validation scored) are ranked; a mid-epoch step save carries the previous epoch's
    value, which its weights never produced, so it is unranked (kept as the last only) and
    cannot push out the checkpoint that did score it."""
    ckpt = ModelCheckpoint(
        tmp_path, monitor="val_score", save_top_k=1, every_n_steps=2, every_n_epochs=1
    )
    loop, loader, ds = H.make_loop(1, 2, callbacks=[_ValScore([1.0, 2.0]), ckpt], n=N)
    with pytest.warns(UserWarning, match="val_score.*kept unranked"):
        loop.fit(loader, EPOCHS, val_loader=DataLoader(ds, batch_size=2))
    # epoch 0 scored 1.0 (the best), epoch 1 2.0; step 6 carried 1.0 along but is not ranked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch1-step4", "epoch2-step8"]
    assert ckpt.best_path == tmp_path / "epoch1-step4" and ckpt.best_score == 1.0
    assert read_manifest(tmp_path / "epoch1-step4")["score"] == 1.0


# -- parameter groups in another order ------------------------------------------------------------
def _linear_loop(groups, callbacks=()) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    params = {"weight": model.weight, "bias": model.bias}
    opt = poptorch.optim.SGD([{"params": [params[g]]} for g in groups], lr=0.1, momentum=0.9)
    return Loop(
        model,
        poptorch.Options(),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=opt,
        progress=False,
        callbacks=list(callbacks),
    )


def _linear_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (32,), generator=g)), batch_size=4)


def test_swapped_parameter_groups_are_refused_before_any_step(tmp_path):
    """A checkpoint of groups [weight], [bias] resumed into [bias], [weight] (same counts) is
    a ValueError naming each group's saved and current parameter shapes, before anything is
    restored or run; the saved order resumes."""
    _linear_loop(["weight", "bias"], [ModelCheckpoint(tmp_path, every_n_steps=1), H.StopAt(3)]).fit(
        _linear_data(), 1
    )
    rec = H.Recorder()
    loop = _linear_loop(["bias", "weight"], [rec])
    before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    path = ModelCheckpoint(tmp_path).latest()
    with pytest.raises(
        ValueError,
        match=r"group 0: saved \[\[3, 6\]\], now \[\[3\]\]; "
        r"group 1: saved \[\[3\]\], now \[\[3, 6\]\]",
    ):
        loop.fit(_linear_data(), 1, resume_from=str(path))
    assert rec.losses == [] and loop.state.step == 0
    for k, v in loop.model.state_dict().items():
        assert torch.equal(v, before[k])
    same = _linear_loop(["weight", "bias"])
    same.fit(_linear_data(), 1, resume_from=str(path))
    assert same.state.step == 8


def test_a_checkpoint_without_group_shapes_still_loads(tmp_path):
    """Checkpoints written before the shapes were recorded resume as before (group sizes
    checked only)."""
    _linear_loop(["weight", "bias"], [ModelCheckpoint(tmp_path, every_n_steps=1), H.StopAt(3)]).fit(
        _linear_data(), 1
    )
    sd = load_checkpoint(ModelCheckpoint(tmp_path).latest())
    assert sd.pop("optimizer_shapes") == [[[3, 6]], [[3]]]
    loop = _linear_loop(["weight", "bias"])
    loop.load_state_dict(sd)
    loop.fit(_linear_data(), 1)
    assert loop.state.step == 8


# -- a preemption or exception save when the filename's log does not exist yet --------------------
FILENAME = "epoch{epoch}-step{step}-{val_loss:.3f}"  # the docstring's example


class _At(Callback):
    """At the start of step ``step`` + 1: SIGTERM to this process, or raise."""

    def __init__(self, step: int, what: str) -> None:
        self.step, self.what = step, what

    def on_train_step_start(self, loop) -> None:
        if loop.state.step == self.step:
            if self.what == "term":
                os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler sets a flag
            else:
                raise RuntimeError("boom")


@pytest.mark.parametrize("at,name", [(2, "epoch0-step3"), (6, "epoch1-step7")])
def test_sigterm_save_is_written_without_a_missing_or_stale_log(tmp_path, at, name):
    """SIGTERM with {val_loss} in the filename: in the first epoch (no val_loss yet) or the
    second (val_loss scored other weights), the checkpoint is saved without that field, a
    warning says so, the process still exits 143, and the checkpoint resumes exactly."""
    rec1 = H.Recorder()
    ckpt = ModelCheckpoint(tmp_path, filename=FILENAME)
    loop, loader, ds = H.make_loop(callbacks=[rec1, _At(at, "term"), ckpt])
    with pytest.warns(
        UserWarning,
        match=r"names val_loss.*preemption checkpoint is saved "
        rf"without it, as '{name}'",
    ), pytest.raises(SystemExit) as e:
        loop.fit(loader, EPOCHS, val_loader=DataLoader(ds, batch_size=2))
    assert e.value.code == 143
    assert ckpt.latest() == tmp_path / name and read_manifest(ckpt.latest())["step"] == at + 1
    rec2 = H.Recorder()
    loop2, loader, ds = H.make_loop(
        callbacks=[rec2, ModelCheckpoint(tmp_path, filename=FILENAME)], init_seed=3
    )
    loop2.fit(loader, EPOCHS, val_loader=DataLoader(ds, batch_size=2), resume_from="last")
    ref = H.Recorder()
    loop3, loader, ds = H.make_loop(callbacks=[ref])
    loop3.fit(loader, EPOCHS, val_loader=DataLoader(ds, batch_size=2))
    assert rec1.losses + rec2.losses == ref.losses
    assert_same_weights(loop2.model, loop3.model)


def test_exception_save_is_written_without_a_missing_log(tmp_path):
    """An exception in the first epoch with {val_loss} in the filename: the exception
    checkpoint is written (named without val_loss) and the original exception propagates.
    Only SIGTERM and exception saves fall back: a regular save naming a log the fit never
    writes is still a ValueError naming it."""
    ckpt = ModelCheckpoint(tmp_path, filename=FILENAME)
    loop, loader, ds = H.make_loop(callbacks=[_At(2, "raise"), ckpt])
    with pytest.warns(UserWarning, match="exception checkpoint is saved without it"), pytest.raises(
        RuntimeError, match="boom"
    ):
        loop.fit(loader, EPOCHS, val_loader=DataLoader(ds, batch_size=2))
    m = read_manifest(tmp_path / "epoch0-step2-exception")
    assert m["exception"] == "RuntimeError" and m["step"] == 2
    # A regular save still fails on a log the fit never writes (here: no val_loader)
    loop, loader, _ = H.make_loop(
        callbacks=[
            ModelCheckpoint(tmp_path / "regular", filename=FILENAME, save_on_exception=False)
        ]
    )
    with pytest.raises(ValueError, match="no log 'val_loss' at epoch 1, step 4"):
        loop.fit(loader, EPOCHS)


# -- an unwritable checkpoint folder --------------------------------------------------------------
def _refuse(monkeypatch, error: OSError) -> None:
    """Make every new file fail as the system would (as root, chmod does not stop writes)."""

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(tempfile, "mkstemp", refuse)


@pytest.mark.parametrize("how", ["chmod", "read-only file system"])
def test_an_unwritable_folder_fails_when_the_fit_starts(tmp_path, monkeypatch, how):
    """A folder no checkpoint can be written to is a CheckpointError naming it and the
    system's reason when the fit starts, before any step (not after an epoch)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder without write permission")
        folder.chmod(0o555)
        reason = "Permission denied"
    else:
        _refuse(monkeypatch, OSError(30, "Read-only file system"))
        reason = "Read-only file system"
    rec = H.Recorder()
    loop, loader, _ = H.make_loop(callbacks=[rec, ModelCheckpoint(folder)])
    try:
        with pytest.raises(CheckpointError, match=rf"{folder}: is not writable.*{reason}"):
            loop.fit(loader, EPOCHS)
    finally:
        folder.chmod(0o755)
    assert rec.losses == [] and loop.state.step == 0


# -- TensorBoard after a resume -------------------------------------------------------------------
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(log_dir) -> dict:
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class _Crash(Callback):
    order = 95  # after the logger wrote the step

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, loop) -> None:
        if loop.state.step == self.step:
            raise RuntimeError("crash")


@pytest.mark.parametrize("every_n_steps,crash", [(3, 5), (4, 6)])
def test_tensorboard_after_a_resume_shows_each_update_once(tmp_path, every_n_steps, crash):
    """Crash after the last checkpoint, resume: TensorBoard reads exactly the scalars of an
    uninterrupted run (the crashed run's updates after its checkpoint purged, those at the
    checkpoint's own update kept once). Checkpoints at step 3 (mid-epoch) and step 4 (the
    epoch's last step, before its epoch logs); DI 2: two updates per step."""

    def run(log_dir, callbacks, **fit):
        loop, loader, ds = H.make_loop(2, 1, callbacks=[TensorBoardLogger(log_dir), *callbacks])
        loop.fit(loader, 3, val_loader=DataLoader(ds, batch_size=2), **fit)

    run(tmp_path / "ref", [])
    ckpts = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="crash"):
        run(
            tmp_path / "run",
            [
                ModelCheckpoint(
                    ckpts, every_n_steps=every_n_steps, every_n_epochs=None, save_on_exception=False
                ),
                _Crash(crash),
            ],
        )
    time.sleep(1.1)  # a new process's event file: its name (the time in seconds) sorts after
    run(
        tmp_path / "run",
        [ModelCheckpoint(ckpts, every_n_steps=every_n_steps, every_n_epochs=None)],
        resume_from="last",
    )
    ref, got = _scalars(tmp_path / "ref"), _scalars(tmp_path / "run")
    assert set(got) == set(ref)
    for tag in ref:
        if tag == "samples_per_second":  # a time: the same updates, other values
            assert [s for s, _ in got[tag]] == [s for s, _ in ref[tag]]
        else:
            assert got[tag] == ref[tag], tag
