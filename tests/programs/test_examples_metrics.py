"""What the MNIST example prints per epoch: ``train_accuracy`` is that epoch's own accuracy.

The example logs a torchmetrics accuracy over the predictions the model made on the training
batches while it trained (OutputMode.All: every sample). Each epoch's value must cover that
epoch alone; an accumulation over all epochs so far reads too low once the model is good
(e.g. 0.93 for an epoch whose own accuracy is 0.97).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, backend_name, poptorch


@pytest.mark.skipif(
    backend_name() != "emulator", reason="reads each micro-batch's predictions with a forward hook"
)
def test_train_accuracy_is_per_epoch_over_every_training_prediction():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(dim=1)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    seen: list[tuple[torch.Tensor, int]] = []  # (predictions of one micro-batch, epoch)
    stepping = [None]  # the epoch while a training step runs, else None (compile, probe)

    def record(module, inputs, output):
        if stepping[0] is not None:
            seen.append((output.detach().argmax(dim=1), stepping[0]))

    model.register_forward_hook(record)

    class Steps(Callback):
        def on_train_step_start(self, loop):
            stepping[0] = loop.state.epoch

        def on_train_step_end(self, loop):
            stepping[0] = None

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    loop = Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5),
        metrics={"accuracy": torchmetrics.Accuracy("multiclass", num_classes=3)},
        callbacks=[Steps()],
        progress=False,
    )
    hist = loop.fit(DataLoader(TensorDataset(x, y), batch_size=4), epochs=3)
    per_epoch = []
    for e in range(3):
        preds = torch.cat([p for p, k in seen if k == e])
        assert len(preds) == len(y)  # every training prediction of the epoch, in order
        per_epoch.append((preds == y).double().mean().item())
    assert per_epoch[0] < per_epoch[2]  # it learns, so a cumulative value would differ
    for e in range(3):
        assert abs(hist[e]["train_accuracy"] - per_epoch[e]) < 1e-6
