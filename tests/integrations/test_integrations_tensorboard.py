"""TensorBoardLogger: the event file holds the logged scalars (read with TensorBoard's reader)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, poptorch
from ipuloop.callbacks import LRScheduler
from ipuloop.integrations.tensorboard import TensorBoardLogger

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def fit(log_dir, groups=1):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    params = list(model.parameters())
    opt = torch.optim.SGD(
        params if groups == 1 else [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}],
        lr=0.1,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=opt,
        progress=False,
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
        callbacks=[LRScheduler(sched), TensorBoardLogger(log_dir)],
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=8)  # 4 steps of 2 updates per epoch
    history = loop.fit(loader, epochs=2, val_loader=loader)
    return loop, history


def scalars(log_dir):
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_step_epoch_lr_and_throughput_scalars(tmp_path):
    loop, history = fit(tmp_path)
    s = scalars(tmp_path)
    assert set(s) == {
        "loss",
        "lr",
        "samples_per_second",
        "train_loss",
        "train_acc",
        "val_loss",
        "val_acc",
    }
    assert [step for step, _ in s["loss"]] == [2, 4, 6, 8, 10, 12, 14, 16]  # updates done
    assert s["loss"][-1][1] == pytest.approx(loop.state.logs["loss"])
    for key in ("train_loss", "train_acc", "val_loss", "val_acc"):
        assert s[key] == [(8, pytest.approx(history[0][key])), (16, pytest.approx(history[1][key]))]
    # StepLR halves the LR every 4 updates; each step's LR is recorded at its first update
    assert s["lr"] == [(u, pytest.approx(0.1 * 0.5 ** (u // 4))) for u in range(0, 16, 2)]
    assert len(s["samples_per_second"]) == 8 and all(v > 0 for _, v in s["samples_per_second"])


def test_one_lr_scalar_per_parameter_group(tmp_path):
    fit(tmp_path, groups=2)
    s = scalars(tmp_path)
    assert "lr" not in s
    assert s["lr/group0"][0][1] == pytest.approx(0.1) and s["lr/group1"][0][1] == pytest.approx(0.5)


def test_missing_tensorboard_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r'pip install "ipuloop\[tensorboard\]"'):
        TensorBoardLogger("runs")


def test_estimates_are_written_under_their_own_tags(tmp_path):
    """Under OutputMode.Final the training values come from each call's last micro-batch: they
    are written as ``<name>_estimate``, never under the exact values' tags."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.Final),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
        callbacks=[TensorBoardLogger(tmp_path)],
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    history = loop.fit(loader, epochs=2, val_loader=loader)
    s = scalars(tmp_path)
    assert {"loss_estimate", "train_loss_estimate", "train_acc_estimate", "val_loss"} <= set(s)
    assert not {"loss", "train_loss", "train_acc", "estimated"} & set(s)
    assert [v for _, v in s["train_acc_estimate"]] == pytest.approx(
        [h["train_acc"] for h in history]
    )
