"""Resume, frozen options, val_loss and ModelCheckpoint paths that must never end in a silently
wrong result: changed data factors, options changed by a callback, "last" in a shared folder,
partial micro-batches in validation, PopTorch's default optimizer, a different optimizer, and
filename templates.
"""

from __future__ import annotations

import warnings

import helpers_train as H
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ipuloop
from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks.checkpoint import CheckpointError, ModelCheckpoint, read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:.*samples are dropped each epoch")

N = H.samples_for(1, 2)  # 19 samples: 4 host calls of 4 (micro-batch 2, DI 1, GA 2) per epoch
EPOCHS = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _stopped_at(dirpath, stop: int, **kw) -> tuple[list[int], list[float]]:
    """A run (micro-batch 2, DI 1, GA 2, 19 samples) saved at every step and stopped at
    ``stop``; returns the indices it read and its losses."""
    rec = H.Recorder()
    ckpt = ModelCheckpoint(dirpath, every_n_steps=1, save_top_k=-1)
    loop, loader, ds = H.make_loop(1, 2, callbacks=[rec, ckpt, H.StopAt(stop)], n=N, **kw)
    rec.dataset = ds
    loop.fit(loader, EPOCHS)
    assert loop.state.step == stop
    return ds.log, rec.losses


def _resumed(di: int, ga: int, n: int = N, micro: int = H.MICRO, **kw):
    rec = H.Recorder()
    loop, _, ds = H.make_loop(di, ga, callbacks=[rec], n=n, init_seed=5, seed=6, **kw)
    rec.dataset = ds
    loader = DataLoader(ds, batch_size=micro, shuffle=True)
    return loop, loader, ds, rec


# -- 1. resume with changed factors ---------------------------------------------------------------
def test_mid_epoch_resume_with_whole_new_host_calls_continues_at_the_same_sample(tmp_path):
    rec = H.Recorder()
    ref_loop, loader, ds = H.make_loop(1, 2, callbacks=[rec], n=N)
    rec.dataset = ds
    ref_loop.fit(loader, 1)
    reference = ds.log  # epoch 0's order: 16 samples
    first, _ = _stopped_at(tmp_path, 2)  # 8 samples read
    assert first == reference[:8]
    loop, loader, ds2, rec2 = _resumed(2, 2)  # host calls of 8: the position is 1 of them
    with pytest.warns(UserWarning, match=r"epoch 0 after its 8 samples.*deviceIterations 1 -> 2"):
        loop.fit(loader, EPOCHS, resume_from=str(ModelCheckpoint(tmp_path).latest()))
    assert ds2.log[:8] == reference[8:16]  # the unseen half of epoch 0, neither skipped nor re-read
    # (each epoch read whole, as torch reads it: the 3 samples of its remainder read and dropped)
    assert len(ds2.log) == (N - 8) + N and len(rec2.losses) == 1 + 2
    assert loop.state.epoch == EPOCHS and loop.state.epoch_step == 0


@pytest.mark.parametrize(
    "change,named",
    [
        ({"di": 2}, "deviceIterations 1 -> 2"),
        ({"micro": 4}, "micro-batch size 2 -> 4"),
        ({"n": N + 4}, "dataset length 19 -> 23"),
    ],
)
def test_mid_epoch_resume_off_the_new_host_calls_fails_naming_each_change(tmp_path, change, named):
    _stopped_at(tmp_path, 3)  # 12 samples read: not a whole number of host calls of 8
    kw = {"di": 1, "ga": 2, **change}
    loop, loader, ds2, rec2 = _resumed(**kw)
    with pytest.raises(ValueError, match=rf"middle of epoch 0.*{named}.*after 12 of"):
        loop.fit(loader, EPOCHS, resume_from=str(ModelCheckpoint(tmp_path).latest()))
    assert rec2.losses == [] and ds2.log == []  # before any step, nothing read
    assert loop.state.epoch == 0  # the epoch that ran no step is not counted
    with pytest.raises(ValueError, match=named):  # the loaded state still cannot run with it
        loop.fit(loader, EPOCHS)
    assert loop.train_model is None or not loop.train_model.isCompiled()


def test_change_at_an_epoch_boundary_is_allowed_and_logged_once(tmp_path):
    ckpt = ModelCheckpoint(tmp_path, every_n_epochs=1)
    loop, loader, _ = H.make_loop(1, 2, callbacks=[ckpt], n=N)
    loop.fit(loader, 1)
    loop, loader, ds2, rec2 = _resumed(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit(loader, EPOCHS, resume_from=str(ModelCheckpoint(tmp_path).latest()))
    changes = [w for w in caught if "other factors" in str(w.message)]
    assert len(changes) == 1
    assert "start of epoch 1" in str(changes[0].message)
    assert "deviceIterations 1 -> 2" in str(changes[0].message)
    assert len(rec2.losses) == 2 and loop.state.update == 4 * 1 + 2 * 2


# -- 2. options fixed once ------------------------------------------------------------------------
def _fit_linear(di: int, callbacks=()) -> Loop:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    loop = Loop(
        nn.Linear(4, 3),
        ipuloop.poptorch.Options().deviceIterations(di),
        loss_fn=nn.CrossEntropyLoss(),
        callbacks=list(callbacks),
        progress=False,
        optimizer=None,
    )
    loop.fit(DataLoader(data, batch_size=2), epochs=2)
    return loop


class _OnConfigure(Callback):
    def on_configure(self, loop) -> None:
        loop.train_opts.deviceIterations(4)


class _OnFitStart(Callback):
    def on_fit_start(self, loop) -> None:
        loop.train_opts.deviceIterations(4)


def test_on_configure_sets_the_options_everything_uses():
    direct = _fit_linear(4)
    configured = _fit_linear(1, [_OnConfigure()])
    assert configured.train_opts.device_iterations == 4
    assert configured.state.counters() == direct.state.counters()  # 4 steps of 4 updates each
    assert configured.state.history == direct.state.history  # the same losses
    for a, b in zip(configured.model.parameters(), direct.model.parameters()):
        assert torch.equal(a, b)


def test_options_changed_after_they_froze_is_an_error():
    with pytest.raises(AttributeError, match="frozen") as err:
        _fit_linear(1, [_OnFitStart()])
    assert "on_configure" in "".join(getattr(err.value, "__notes__", []))


# -- 3. resume_from="last" ------------------------------------------------------------------------
def test_last_is_the_newest_written_and_a_fresh_fit_into_used_folder_warns(tmp_path):
    old = ModelCheckpoint(tmp_path, every_n_steps=1, every_n_epochs=None, save_top_k=-1)
    loop, loader, _ = H.make_loop(1, 2, callbacks=[old], n=N)
    loop.fit(loader, EPOCHS)  # an older run, up to step 8
    new = ModelCheckpoint(tmp_path, every_n_steps=1, every_n_epochs=None, save_top_k=1)
    loop, loader, _ = H.make_loop(1, 2, callbacks=[new, H.StopAt(3)], n=N, init_seed=3)
    with pytest.warns(UserWarning, match=rf"{tmp_path} already holds checkpoints"):
        loop.fit(loader, EPOCHS)
    assert read_manifest(ModelCheckpoint(tmp_path).latest())["step"] == 3
    rec = H.Recorder()
    resumed, loader, _ = H.make_loop(1, 2, callbacks=[rec, ModelCheckpoint(tmp_path)], n=N)
    resumed.fit(loader, EPOCHS, resume_from="last")
    assert len(rec.losses) == 2 * 4 - 3  # this run's step 3, not the old run's step 8


# -- 4. val_loss over every sample ----------------------------------------------------------------
def _val_data(n: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_val_loss_with_loss_fn_is_exact_over_every_sample():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    loop = Loop(model, loss_fn=nn.CrossEntropyLoss(), progress=False)
    data = _val_data()  # 10 samples in micro-batches of 4: the last one holds 2 and padding
    logs = loop.validate(DataLoader(data, batch_size=4))
    with torch.no_grad():
        exact = nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1])
    assert logs["val_loss"] == pytest.approx(float(exact), rel=1e-6)


class _WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y=None):
        out = self.lin(x)
        return out if y is None else (out, nn.functional.cross_entropy(out, y))


def test_val_loss_without_loss_fn_says_once_how_many_samples_it_covers():
    torch.manual_seed(0)
    model = _WithLoss()
    loop = Loop(model, progress=False)
    data = _val_data()
    with pytest.warns(UserWarning, match="val_loss covers 8 of the 10 validation samples"):
        logs = loop.validate(DataLoader(data, batch_size=4))
    with torch.no_grad():
        first8 = nn.functional.cross_entropy(model.lin(data.tensors[0][:8]), data.tensors[1][:8])
    assert logs["val_loss"] == pytest.approx(float(first8), rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        loop.validate(DataLoader(data, batch_size=4))


# -- 5. PopTorch's default optimizer resumes -------------------------------------------------------
def test_default_optimizer_run_resumes_exactly(tmp_path):
    default = lambda p: None
    ref = H.Recorder()
    loop, loader, _ = H.make_loop(1, 2, callbacks=[ref], n=N, optimizer=default)
    loop.fit(loader, EPOCHS)
    _stopped_at(tmp_path, 3, optimizer=default)
    loop2, loader, _, rec = _resumed(1, 2, optimizer=default)
    loop2.fit(loader, EPOCHS, resume_from=str(ModelCheckpoint(tmp_path).latest()))
    assert rec.losses == ref.losses[3:]
    for a, b in zip(loop2.model.parameters(), loop.model.parameters()):
        assert torch.equal(a, b)


# -- 6. a different optimizer fails before any step ------------------------------------------------
def _two_groups(p):
    p = list(p)
    return poptorch.optim.AdamW([{"params": p[:2]}, {"params": p[2:], "lr": 0.01}], lr=0.02)


@pytest.mark.parametrize(
    "optimizer,named",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), r"AdamW with 1 parameter group.*\[4\].*SGD"),
        (_two_groups, r"AdamW with 1 parameter group\(s\) of \[4\].*AdamW with 2 of \[2, 2\]"),
    ],
)
def test_resume_into_another_optimizer_fails_before_any_step(tmp_path, optimizer, named):
    _stopped_at(tmp_path, 3)
    names = sorted(p.name for p in tmp_path.iterdir())
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1)
    rec = H.Recorder()
    loop, loader, _ = H.make_loop(1, 2, callbacks=[rec, ckpt], n=N, optimizer=optimizer)
    before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    with pytest.raises(ValueError, match=named):
        loop.fit(loader, EPOCHS, resume_from="last")
    assert rec.losses == [] and loop.state.step == 0  # nothing restored, nothing run
    for k, v in loop.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no checkpoint written


# -- 7. ModelCheckpoint ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"filename": "epoch{epoch}-step{stpe}"}, r"\{stpe\}.*neither a counter"),
        ({"filename": "runs/step{step}"}, "no path separator"),
        (
            {"filename": "step{step}-{train_loss:.3f}", "every_n_steps": 10},
            r"\{train_loss\}, a log written at the end of an epoch",
        ),
        ({"filename": "epoch{epoch}"}, r"has no \{step\}"),
        ({"filename": "step{step:q}"}, "cannot be formatted"),
        ({"filename": "step{}"}, "names only"),
    ],
)
def test_filename_checked_at_construction(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        ModelCheckpoint(tmp_path, **kw)


def test_monitored_step_saves_before_the_first_validation(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path,
        monitor="val_loss",
        save_top_k=1,
        every_n_steps=2,
        every_n_epochs=None,
        filename="step{step}",
    )
    loop, loader, ds = H.make_loop(1, 2, callbacks=[ckpt], n=N)
    with pytest.warns(UserWarning, match="val_loss.*no such log yet at step 2"):
        loop.fit(loader, 3, val_loader=DataLoader(ds, batch_size=2))
    # Every save is a step save: before the first validation, or with an earlier step's
    # val_loss (the validation at step 4 scored the weights of step 4, saved before it ran).
    # None is ranked: only the last is kept, and there is no best.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step12"]
    assert ckpt.best_path is None and ckpt.best_k == {}
    assert all(e["score"] != e["score"] for e in ckpt.kept)  # NaN: unranked


def test_a_file_as_the_checkpoint_folder_is_a_checkpoint_error(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("not a folder")
    with pytest.raises(CheckpointError, match="is a file"):
        ModelCheckpoint(f)
    ckpt = ModelCheckpoint(tmp_path / "later")
    (tmp_path / "later").write_text("became a file")
    loop, loader, _ = H.make_loop(1, 2, callbacks=[ckpt], n=N)
    with pytest.raises(CheckpointError, match="is a file"):
        loop.fit(loader, 1, resume_from="last")


def test_one_state_is_not_saved_under_two_names(tmp_path):
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=4, every_n_epochs=1, save_top_k=-1)
    loop, loader, _ = H.make_loop(1, 2, callbacks=[ckpt], n=N)
    loop.fit(loader, EPOCHS)  # 4 steps per epoch: the step save and the epoch save coincide
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch1-step4", "epoch2-step8"]
    assert [e["name"] for e in ckpt.kept] == ["epoch1-step4", "epoch2-step8"]


def test_a_checkpoint_with_the_older_exact_flag_loads_naming_its_estimates():
    """Checkpoints written before ``estimated`` hold ``train_loss_exact`` in their history
    and logs (0.0: the train values are estimates): they load, the flag read as names."""
    loop, loader, _ = H.make_loop(1, 2, n=N)
    loop.fit(loader, 2)
    sd = loop.state_dict()
    sd["history"] = [{**h, "train_loss_exact": 0.0} for h in sd["history"]]
    sd["logs"] = {**sd["logs"], "train_loss_exact": 1.0}
    again, loader, _ = H.make_loop(1, 2, n=N)
    again.load_state_dict(sd)
    assert [h["estimated"] for h in again.state.history] == ["loss train_loss"] * 2
    assert not any("train_loss_exact" in h for h in again.state.history)
    assert "train_loss_exact" not in again.state.logs and "estimated" not in again.state.logs
    assert again.fit(loader, 3)[-1]["epoch"] == 3  # and the fit goes on
