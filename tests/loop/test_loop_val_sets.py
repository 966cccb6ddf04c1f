"""Several validation sets: ``fit(val_loader=[a, b])`` or ``{"clean": a, "noisy": b}``.

Each set is validated in turn, in one validation (one on_validation_start and end), and logged
under its own names (a dict: ``val_loss/<name>``; a list: Lightning's
``val_loss/dataloader_idx_<i>``), equal to what validating that set alone logs; monitors watch
any of them; anything else is refused before the first step; a resume is exact.
"""

from __future__ import annotations

import csv
import os
import signal

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint

IN, CLASSES = 4, 3


def _loader(n: int, seed: int, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g)), batch_size)


def _loop(**kwargs) -> Loop:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    return Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=CLASSES)},
        progress=False,
        **kwargs,
    )


def _sets() -> dict[str, DataLoader]:
    return {"clean": _loader(12, 1), "noisy": _loader(10, 2)}  # (10: the last call padded)


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_each_set_is_logged_under_its_name_as_validating_it_alone(kind, tmp_path):
    sets = _sets()
    names = list(sets) if kind == "dict" else ["dataloader_idx_0", "dataloader_idx_1"]
    given = sets if kind == "dict" else list(sets.values())
    events = []

    class Record(Callback):
        def on_validation_start(self, loop):
            events.append("start")

        def on_validation_end(self, loop):
            events.append(sorted(k for k in loop.state.logs if k.startswith("val_")))

    loop = _loop(callbacks=[Record(), CSVLogger(tmp_path / "log.csv")])
    history = loop.fit(_loader(32, 0), epochs=2, val_loader=given, val_every_n_steps=3)
    keys = sorted(f"val_{m}/{n}" for n in names for m in ("loss", "acc"))
    # one validation per check: steps 3, 6, 9, 12, 15 and the epoch ends (steps 8 and 16)
    assert events == ["start", keys] * 7
    assert all(sorted(k for k in row if k.startswith("val_")) == keys for row in history)
    assert "val_loss" not in loop.state.logs
    with open(tmp_path / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert set(keys) <= set(rows[-1]) and float(rows[-1][keys[0]]) == history[-1][keys[0]]
    # each set's logs equal validating it alone with the same weights
    for name, loader in zip(names, sets.values()):
        alone = loop.validate(loader)
        assert alone == {
            "val_loss": history[-1][f"val_loss/{name}"],
            "val_acc": history[-1][f"val_acc/{name}"],
        }
    # validate() takes the same list or dict and returns every set's logs
    assert loop.validate(given) == {k: history[-1][k] for k in keys}


def test_each_set_has_its_own_metric_states():
    loop = _loop()
    loop.fit(_loader(16, 0), epochs=1, val_loader=_sets())
    clean, noisy = (loop._val_metrics.of(s)["acc"] for s in ("clean", "noisy"))
    assert clean is not noisy and all(loop.metrics["acc"] is not m for m in (clean, noisy))
    assert float(clean.compute()) == loop.state.logs["val_acc/clean"]
    assert float(noisy.compute()) == loop.state.logs["val_acc/noisy"]


@pytest.mark.parametrize(
    "given, error, says",
    [
        (torch.zeros(4, IN), TypeError, "val_loader=Tensor: wrap the tensors in a DataLoader"),
        ("data/val", TypeError, "val_loader=str"),
        ([], ValueError, "val_loader=[] (no set)"),
        ({}, ValueError, "val_loader={} (no set)"),
        ({1: "loader"}, TypeError, "a key 1 (int) in val_loader"),
        ({"a/b": "loader"}, ValueError, "a key 'a/b' in val_loader: rename it"),
        ("list-with-a-tensor", TypeError, "val_loader[1]=Tensor"),
    ],
)
def test_anything_else_is_refused_before_the_first_step(given, error, says):
    if given == "list-with-a-tensor":
        given = [_loader(4, 1), torch.zeros(4, IN)]
    if isinstance(given, dict) and given and next(iter(given.values())) == "loader":
        given = {k: _loader(4, 1) for k in given}
    loop = _loop()
    with pytest.raises(error, match="val_loader") as e:
        loop.fit(_loader(16, 0), epochs=1, val_loader=given)
    assert says in str(e.value)
    assert loop.state.step == 0 and loop.train_model is None
    with pytest.raises(error, match="loader"):
        loop.validate(given)


def test_monitors_watch_a_set_and_a_name_the_fit_never_writes_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"val_loss/clean, val_loss/noisy"):
        _loop(callbacks=[EarlyStopping("val_loss")]).fit(_loader(16, 0), 1, val_loader=_sets())
    with pytest.raises(ValueError, match="one val_loader"):
        _loop(callbacks=[EarlyStopping("val_loss/clean")]).fit(
            _loader(16, 0), 1, val_loader=_loader(8, 1)
        )
    with pytest.raises(ValueError, match=r"filename=.*val_loss/other"):
        _loop(callbacks=[ModelCheckpoint(tmp_path, filename="{step}-{val_loss/other:.2f}")]).fit(
            _loader(16, 0), 1, val_loader=_sets()
        )

    stop = EarlyStopping("val_acc/noisy", mode="max", patience=1, min_delta=1.0)
    ckpt = ModelCheckpoint(
        tmp_path / "ckpt",
        monitor="val_loss/clean",
        save_top_k=-1,
        filename="epoch{epoch}-step{step}-{val_loss/noisy:.4f}",
    )
    loop = _loop(callbacks=[stop, ckpt])
    history = loop.fit(_loader(16, 0), epochs=5, val_loader=_sets())
    assert len(history) == 2 and stop.stopped_epoch == 2  # a gain of 1.0 in accuracy: never
    assert ckpt.best_score == min(row["val_loss/clean"] for row in history)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [
        f"epoch{row['epoch']}-step{4 * row['epoch']}-{row['val_loss/noisy']:.4f}" for row in history
    ]


def _weights(loop: Loop) -> list[torch.Tensor]:
    return [p.detach().clone() for p in loop.model.parameters()]


def test_a_resume_at_an_epoch_end_is_exact(tmp_path):
    whole = _loop()
    expected = whole.fit(_loader(16, 0), epochs=3, val_loader=_sets())

    first = _loop(callbacks=[ModelCheckpoint(tmp_path)])
    first.fit(_loader(16, 0), epochs=1, val_loader=_sets())
    resumed = _loop(callbacks=[ModelCheckpoint(tmp_path)])
    got = resumed.fit(_loader(16, 0), epochs=3, val_loader=_sets(), resume_from="last")
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(_weights(whole), _weights(resumed)))


def test_a_checkpoint_taken_during_the_second_set_runs_the_whole_validation_again():
    whole = _loop()
    expected = whole.fit(_loader(16, 0), epochs=2, val_loader=_sets())

    saved = []

    class SaveInNoisy(Callback):  # during the validation of the second set, epoch 1
        def on_validation_step_end(self, loop):
            if loop.state.epoch == 0 and "val_loss/clean" in loop.state.logs and not saved:
                saved.append(loop.state_dict())

    _loop(callbacks=[SaveInNoisy()]).fit(_loader(16, 0), epochs=2, val_loader=_sets())
    assert saved
    resumed = _loop()
    resumed.load_state_dict(saved[0])
    got = resumed.fit(_loader(16, 0), epochs=2, val_loader=_sets())
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(_weights(whole), _weights(resumed)))


def test_a_list_of_one_logs_as_one_loader_as_in_lightning():
    loop = _loop()
    history = loop.fit(_loader(16, 0), epochs=1, val_loader=[_loader(8, 1)])
    assert "val_loss" in history[-1] and not any("/" in k for k in history[-1])
    assert loop.validate([_loader(8, 1)]) == loop.validate(_loader(8, 1))


class TermInSecondSet(Callback):
    """SIGTERM during the validation of the second set, at step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.before: object = None

    def on_validation_start(self, loop) -> None:
        self.before = loop.state.logs.get("val_loss/clean")

    def on_validation_step_end(self, loop) -> None:
        st = loop.state
        if st.step == self.at and st.logs.get("val_loss/clean") is not self.before:
            os.kill(os.getpid(), signal.SIGTERM)  # the first set's logs are this validation's


@pytest.mark.parametrize("at", [3, 4], ids=["step-validation", "epoch-end"])
def test_sigterm_in_the_second_set_resumes_exactly(tmp_path, at):
    """The checkpoint is taken inside the second set's validation (of a step, or of an epoch
    end); the resumed fit validates every set again from the first and ends as the
    uninterrupted fit, bitwise."""
    whole = _loop()
    expected = whole.fit(_loader(16, 0), epochs=2, val_loader=_sets(), val_every_n_steps=3)

    stopped = _loop(callbacks=[TermInSecondSet(at), ModelCheckpoint(tmp_path)])
    with pytest.raises(SystemExit) as e:
        stopped.fit(_loader(16, 0), epochs=2, val_loader=_sets(), val_every_n_steps=3)
    assert e.value.code == 143 and stopped.state.step == at
    resumed = _loop(callbacks=[ModelCheckpoint(tmp_path)])
    got = resumed.fit(
        _loader(16, 0), epochs=2, val_loader=_sets(), val_every_n_steps=3, resume_from="last"
    )
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(_weights(whole), _weights(resumed)))
