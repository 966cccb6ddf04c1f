"""ProgressBar: what a fit prints, on a stream that is no terminal (plain lines)."""

from __future__ import annotations

import io

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, poptorch
from ipuloop.callbacks import ProgressBar


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _fit(opts, stream, *, metrics=True, epochs=1, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loop = Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)}
        if metrics
        else None,
        callbacks=[ProgressBar(every=1, stream=stream)],
        **kw,
    )
    loop.fit(
        DataLoader(_data(), batch_size=4),
        epochs=epochs,
        val_loader=DataLoader(_data(16), batch_size=4),
    )
    return loop, stream.getvalue()


def test_the_epoch_line_names_every_estimate_metrics_included():
    """Final returns each call's last micro-batch: train_loss and train_acc are estimates, the
    step lines' loss too; val_ values are exact."""
    opts = poptorch.Options().deviceIterations(4).outputMode(poptorch.OutputMode.Final)
    _, out = _fit(opts, io.StringIO())
    epoch = [ln for ln in out.splitlines() if ln.startswith("epoch 1:")]
    assert len(epoch) == 1
    assert epoch[0].endswith(
        "(estimates from the micro-batches the output mode returns: train_loss, train_acc)"
    )
    steps = [ln for ln in out.splitlines() if ln.startswith("epoch 1 step")]
    assert steps and all("(estimate)" in ln for ln in steps)


def test_exact_values_carry_no_mark():
    opts = poptorch.Options().deviceIterations(4)  # metrics: All, every micro-batch
    _, out = _fit(opts, io.StringIO())
    assert "estimate" not in out
