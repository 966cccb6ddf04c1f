"""ModelCheckpoint features: several named checkpointers on one loop, each resumable, and the
best checkpoint (``best_path``, ``best_k``, ``load_best_at_end``)."""

from __future__ import annotations

from pathlib import Path

import helpers_train as H
import pytest
import torch
from launch import clean_env, command
from torch import nn
from torch.utils.data import DataLoader
import warm

from ipuloop import Callback, Loop
from ipuloop.callbacks.base import resume_path
from ipuloop.callbacks.checkpoint import ModelCheckpoint, load_checkpoint, read_manifest

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*samples are dropped each epoch",
    "ignore:val_loss covers",
    "ignore:ModelCheckpoint.*kept unranked",
)

N = H.samples_for(1, 2)  # 19 samples: 4 host calls of 4 (micro-batch 2, DI 1, GA 2) per epoch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class _ValScore(Callback):
    """Writes the log ``val_score`` at each validation: ``values[i]`` at the i-th."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def on_validation_end(self, loop) -> None:
        loop.state.logs["val_score"] = self.values[loop.state.epoch]


SCORES = [3.0, 1.0, 2.0, 4.0, 5.0]  # epoch 1 (its end: step 8) is the best, then epoch 2


def _two(root: Path) -> list[ModelCheckpoint]:
    """The best by val_score beside a frequent step save, as Lightning users pair them."""
    return [
        ModelCheckpoint(root / "best", name="best", monitor="val_score", save_top_k=2),
        ModelCheckpoint(
            root / "steps", name="steps", every_n_steps=1, every_n_epochs=None, save_top_k=2
        ),
    ]


def _fit(callbacks, epochs=4, **fit):
    loop, loader, ds = H.make_loop(1, 2, callbacks=[_ValScore(SCORES), *callbacks], n=N)
    loop.fit(loader, epochs, val_loader=DataLoader(ds, batch_size=2), **fit)
    return loop


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- several checkpointers ------------------------------------------------------------------------
def test_two_named_checkpointers_each_resume_their_own_state(tmp_path):
    """A top-k by val_score and a step save on one loop, each named: an interrupted fit
    resumed with resume_from="last" restores each one's kept list, and ends with the weights,
    checkpoints and best of an uninterrupted run."""
    ref_cbs = _two(tmp_path / "ref")
    ref = _fit(ref_cbs)
    first = _two(tmp_path / "run")
    _fit([*first, H.StopAt(10)])
    kept = {cb.name: [dict(e) for e in cb.kept] for cb in first}
    assert [e["name"] for e in kept["best"]] == ["epoch1-step4", "epoch2-step8"]
    second = _two(tmp_path / "run")
    loaded = {}

    class Loaded(Callback):
        def on_fit_start(self, loop) -> None:  # after the resume, before any step
            loaded.update({cb.name: [dict(e) for e in cb.kept] for cb in second})

    loop = _fit([*second, Loaded()], resume_from="last")
    assert loaded == kept  # each its own list
    for a, b in zip(second, ref_cbs):
        assert _names(a.dirpath) == _names(b.dirpath)
        assert [e["name"] for e in a.kept] == [e["name"] for e in b.kept]
    assert second[0].best_path.name == ref_cbs[0].best_path.name == "epoch2-step8"
    assert_same_weights(loop.model.state_dict(), ref.model.state_dict())


def test_resume_from_last_takes_the_newest_any_checkpointer_wrote(tmp_path):
    """With several checkpointers, "last" is the newest checkpoint any of them wrote (the
    time in its manifest), whichever is listed first."""
    cbs = _two(tmp_path)
    _fit([*cbs, H.StopAt(9)])  # best: epoch-end saves at steps 4 and 8; steps: ... 8, 9
    assert resume_path(cbs) == resume_path(cbs[::-1]) == tmp_path / "steps" / "epoch2-step9"
    cbs = _two(tmp_path / "b")
    _fit([*cbs, H.StopAt(8)])  # steps saves step 8, then best saves the epoch end of step 8
    newest = tmp_path / "b" / "best" / "epoch2-step8"
    assert (
        read_manifest(newest)["wall_time"]
        > read_manifest(tmp_path / "b" / "steps" / "epoch1-step8")["wall_time"]
    )
    assert resume_path(cbs) == resume_path(cbs[::-1]) == newest
    loop, loader, ds = H.make_loop(1, 2, callbacks=_two(tmp_path / "b"), n=N)
    with pytest.warns(UserWarning, match="no epoch to run: 2 epoch"):  # the epoch-end state
        loop.fit(loader, 2, val_loader=DataLoader(ds, batch_size=2), resume_from="last")
    assert loop.state.epoch == 2 and loop.state.epoch_step == 0


def test_duplicate_names_fail_when_the_loop_is_built(tmp_path):
    """Two checkpointers with the same name cannot be told apart in a checkpoint: a
    ValueError at Loop construction naming them and the name= argument. Two without names
    are told apart by their settings (tests/loop/test_newest_paths.py)."""
    model = nn.Linear(2, 2)
    Loop(
        model,
        loss_fn=nn.MSELoss(),
        callbacks=[ModelCheckpoint(tmp_path / "a"), ModelCheckpoint(tmp_path / "b")],
        progress=False,
    )
    pair = [ModelCheckpoint(tmp_path / "a", name="x"), ModelCheckpoint(tmp_path / "b", name="x")]
    with pytest.raises(
        ValueError,
        match=r"state_key 'ModelCheckpoint\[x\]' "
        r"\(ModelCheckpoint\('.*/a'.*\), "
        r"ModelCheckpoint\('.*/b'.*name=",
    ):
        Loop(model, loss_fn=nn.MSELoss(), callbacks=pair, progress=False)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        ModelCheckpoint(tmp_path, name="")


def test_checkpointers_writing_the_same_folders_are_refused(tmp_path):
    """Two named checkpointers with the same dirpath and filename would rotate out each
    other's checkpoints: a ValueError before any step. Other filenames may share a folder."""
    rec = H.Recorder()
    loop, loader, _ = H.make_loop(
        callbacks=[rec, ModelCheckpoint(tmp_path, name="a"), ModelCheckpoint(tmp_path, name="b")]
    )
    with pytest.raises(ValueError, match="would write the same checkpoint folders"):
        loop.fit(loader, 1)
    assert rec.losses == []
    loop, loader, _ = H.make_loop(
        callbacks=[
            ModelCheckpoint(tmp_path, name="a"),
            ModelCheckpoint(tmp_path, name="b", filename="s{step}", every_n_steps=2),
        ]
    )
    loop.fit(loader, 1)
    assert _names(tmp_path) == ["epoch1-step4", "s4"]


# -- the best checkpoint --------------------------------------------------------------------------
def test_best_path_score_and_best_k(tmp_path):
    """best_k maps each of the best save_top_k checkpoints to its score, best first (not the
    one kept only as the last); best_path and best_score are its first; last_path is the
    newest save. Without monitor there is no best."""
    ckpt = ModelCheckpoint(tmp_path, monitor="val_score", save_top_k=2)
    _fit([ckpt])
    assert ckpt.best_k == {tmp_path / "epoch2-step8": 1.0, tmp_path / "epoch3-step12": 2.0}
    assert list(ckpt.best_k) == [tmp_path / "epoch2-step8", tmp_path / "epoch3-step12"]
    assert ckpt.best_path == tmp_path / "epoch2-step8" and ckpt.best_score == 1.0
    assert ckpt.last_path == tmp_path / "epoch4-step16"
    unmonitored = ModelCheckpoint(tmp_path / "age")
    _fit([unmonitored], epochs=1)
    assert unmonitored.best_path is None and unmonitored.best_k == {}


def test_load_best_at_end_loads_the_best_weights_only(tmp_path):
    """load_best_at_end=True: when the fit ends, the model holds the best checkpoint's
    weights (bitwise), and validate (its executor still attached from the last epoch) and
    predict run them; the optimizer state and counters stay the last step's."""
    ckpt = ModelCheckpoint(tmp_path, monitor="val_score", load_best_at_end=True)
    loop, loader, ds = H.make_loop(1, 2, callbacks=[_ValScore(SCORES), ckpt], n=N)
    loop.fit(loader, 4, val_loader=DataLoader(ds, batch_size=2))
    best = load_checkpoint(ckpt.best_path)
    last = load_checkpoint(ckpt.last_path)
    assert ckpt.best_path.name == "epoch2-step8" and ckpt.last_path.name == "epoch4-step16"
    assert_same_weights(loop.model.state_dict(), best["model"])
    assert not torch.equal(best["model"]["net.0.weight"], last["model"]["net.0.weight"])
    assert loop.state.step == 16
    opt = loop.optimizer.state_dict()["state"]
    for i, s in last["optimizer"]["state"].items():
        assert torch.equal(opt[i]["exp_avg"], s["exp_avg"])  # the last step's moments
    fresh, _, _ = H.make_loop(1, 2, n=N, init_seed=9)
    fresh.model.load_state_dict(best["model"])
    data = DataLoader(ds, batch_size=2)
    assert loop.validate(data) == fresh.validate(data)
    assert torch.equal(loop.predict(data), fresh.predict(data))


def test_load_best_at_end_after_a_resume_reads_the_best_file(tmp_path):
    """The best saved before a resume (not in this process's memory) is read back from its
    checkpoint folder."""
    ckpt = ModelCheckpoint(tmp_path, monitor="val_score", load_best_at_end=True)
    _fit([ckpt, H.StopAt(10)])
    best = load_checkpoint(ckpt.best_path)
    ckpt = ModelCheckpoint(tmp_path, monitor="val_score", load_best_at_end=True)
    loop = _fit([ckpt], resume_from="last")
    assert ckpt.best_path.name == "epoch2-step8" and loop.state.step == 16
    assert_same_weights(loop.model.state_dict(), best["model"])


def test_load_best_at_end_needs_a_monitor_and_a_ranked_save(tmp_path):
    """Without monitor there is no best: refused at construction. With no ranked save (only
    unranked step saves) the model keeps the last weights, with a warning."""
    with pytest.raises(ValueError, match="load_best_at_end=True.*needs monitor="):
        ModelCheckpoint(tmp_path, load_best_at_end=True)
    ckpt = ModelCheckpoint(
        tmp_path, monitor="val_score", load_best_at_end=True, every_n_steps=1, every_n_epochs=None
    )
    with pytest.warns(UserWarning, match="no checkpoint is ranked.*keeps the last step"):
        loop = _fit([ckpt], epochs=1)
    assert_same_weights(loop.model.state_dict(), load_checkpoint(ckpt.last_path)["model"])


SCRIPT = r"""
import json, os, sys
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import ModelCheckpoint

out = sys.argv[1]
rank = int(os.environ["RANK"])
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 5, generator=g)
y = (x[:, 0] > 0).long()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))

class Score(Callback):
    def on_validation_end(self, loop):
        loop.state.logs["val_score"] = [2.0, 1.0, 3.0][loop.state.epoch]

ckpt = ModelCheckpoint(os.path.join(out, "ckpt"), monitor="val_score", load_best_at_end=True)
loop = Loop(model, poptorch.Options(), loss_fn=nn.CrossEntropyLoss(), seed=1, progress=False,
            optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            callbacks=[Score(), ckpt])
loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
loop.fit(loader, epochs=3, val_loader=DataLoader(TensorDataset(x, y), batch_size=4))
torch.save({"best": str(ckpt.best_path), "weights": loop.model.state_dict()},
           os.path.join(out, f"rank{rank}.pt"))
"""


@pytest.mark.slow
def test_every_instance_loads_the_best_weights(tmp_path):
    """Two processes (torchrun): each instance ends the fit with the best checkpoint's
    weights (instance 0 wrote it; the others hold the weights they saved with it)."""
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = warm.run(
        command(tmp_path / "script.py", str(tmp_path), processes=2),
        env=clean_env(IPULOOP_DIST_TIMEOUT="60", PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert results[0]["best"] == results[1]["best"] == str(tmp_path / "ckpt" / "epoch2-step16")
    best = load_checkpoint(results[0]["best"])["model"]
    for r in results:
        assert_same_weights(r["weights"], best)
