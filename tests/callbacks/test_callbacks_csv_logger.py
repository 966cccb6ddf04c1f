"""CSVLogger: one row per epoch or per N steps, each on disk when written, resume."""

from __future__ import annotations

import csv

import pytest
from test_callbacks_early_stopping import loader, make_loop  # the same tiny regression

from ipuloop import Callback
from ipuloop.callbacks import CSVLogger


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    return header, rows


def test_one_row_per_epoch_matches_the_history(tmp_path):
    path = tmp_path / "logs" / "m.csv"
    loop = make_loop([CSVLogger(path)])
    history = loop.fit(loader(), epochs=3, val_loader=loader(8, seed=1))
    header, rows = read(path)
    assert header == [
        "epoch",
        "step",
        "update",
        "loss",
        "train_loss",
        "val_loss",
    ]  # every value exact (Sum): no column names estimates
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert [int(r["step"]) for r in rows] == [4, 8, 12]
    assert [int(r["update"]) for r in rows] == [8, 16, 24]  # 2 device iterations per step
    for r, h in zip(rows, history):
        assert float(r["val_loss"]) == h["val_loss"] and float(r["train_loss"]) == h["train_loss"]


def test_step_rows_and_a_header_rewritten_for_new_keys(tmp_path):
    class Late(Callback):  # a key that first appears in epoch 2
        order = 0

        def on_epoch_end(self, loop):
            if loop.state.epoch >= 2:
                loop.state.logs["extra"] = 7.0

    path = tmp_path / "m.csv"
    make_loop([CSVLogger(path, every_n_steps=2), Late()]).fit(loader(), epochs=2)
    header, rows = read(path)
    assert header == ["epoch", "step", "update", "loss", "train_loss", "extra"]
    assert [(r["epoch"], r["step"]) for r in rows] == [
        ("0", "2"),
        ("0", "4"),
        ("1", "4"),
        ("1", "6"),
        ("1", "8"),
        ("2", "8"),
    ]
    step_rows = [rows[i] for i in (0, 1, 3, 4)]
    assert all(r["loss"] and not r["train_loss"] and not r["extra"] for r in step_rows)
    assert rows[2]["extra"] == "" and rows[5]["extra"] == "7.0"


def test_each_row_is_on_disk_when_written(tmp_path):
    path = tmp_path / "m.csv"
    seen = []

    class Peek(Callback):
        order = 60  # after CSVLogger

        def on_epoch_end(self, loop):
            seen.append(len(read(path)[1]))

    make_loop([CSVLogger(path), Peek()]).fit(loader(), epochs=3)
    assert seen == [1, 2, 3]


def test_resume_appends_and_a_new_fit_truncates(tmp_path):
    path = tmp_path / "m.csv"
    a = make_loop([CSVLogger(path)])
    a.fit(loader(), epochs=2)
    sd = a.state_dict()
    a.fit(loader(), epochs=3)  # a row written after the checkpoint, which the resume redoes
    assert len(read(path)[1]) == 3
    b = make_loop([CSVLogger(path)])
    b.load_state_dict(sd)
    b.fit(loader(), epochs=4)
    assert [int(r["epoch"]) for r in read(path)[1]] == [1, 2, 3, 4]
    make_loop([CSVLogger(path)]).fit(loader(), epochs=1)
    assert [int(r["epoch"]) for r in read(path)[1]] == [1]


def test_bad_every_n_steps():
    with pytest.raises(
        ValueError, match="every_n_steps must be an int >= 1 or None. Received: every_n_steps=0"
    ):
        CSVLogger("x.csv", every_n_steps=0)


def test_a_column_names_the_estimates_under_final(tmp_path):
    """OutputMode.Final returns each call's last micro-batch: the step's loss and the epoch's
    train_loss are estimates, and the rows name them in one column."""
    import torch

    from ipuloop import Loop, poptorch
    from test_callbacks_early_stopping import Net

    path = tmp_path / "m.csv"
    model = Net()
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.Final),
        progress=False,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=[CSVLogger(path, every_n_steps=2)],
    )
    history = loop.fit(loader(), epochs=2, val_loader=loader(8, seed=1))
    header, rows = read(path)
    assert "estimated" in header
    epoch_rows = [r for r in rows if r["train_loss"]]
    step_rows = [r for r in rows if not r["train_loss"]]
    assert [r["estimated"] for r in epoch_rows] == ["loss train_loss"] * 2
    assert {r["estimated"] for r in step_rows} == {"loss"}  # a step row holds no train_ value
    assert all(h["estimated"] == "loss train_loss" for h in history)  # val_loss is exact
