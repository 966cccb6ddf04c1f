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


def test_a_fit_prints_its_summary_before_the_first_step():
    opts = poptorch.Options().deviceIterations(4)
    loop, out = _fit(opts, io.StringIO())
    lines = out.splitlines()
    first_step = next(i for i, ln in enumerate(lines) if ln.startswith("epoch 1 step"))
    summary = loop.state.summary.splitlines()
    assert lines[: len(summary)] == summary and len(summary) < first_step + 1
    assert summary[0].startswith("fit: the emulator")
    assert "  batch: micro 4 x DI 4 x GA 1 x RF 1 = 16 samples a host call" in summary
    assert "  epoch: 4 steps, 16 optimizer updates; output mode All" in summary
    assert loop.summary(DataLoader(_data(), batch_size=4)) == loop.state.summary


def test_progress_false_prints_nothing(capsys):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loop = Loop(model, loss_fn=nn.CrossEntropyLoss(), progress=False)
    loop.fit(DataLoader(_data(), batch_size=4), epochs=1)
    assert capsys.readouterr().out == ""
    assert loop.state.summary.startswith("fit:")  # still there for whoever asks


def test_a_resume_says_the_file_and_where_it_continues(tmp_path):
    from ipuloop.callbacks import ModelCheckpoint

    def loop_with(stream):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return Loop(
            model,
            poptorch.Options().deviceIterations(2),
            loss_fn=nn.CrossEntropyLoss(),
            optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
            callbacks=[
                ProgressBar(every=100, stream=stream),
                ModelCheckpoint(tmp_path, every_n_steps=3),
            ],
        )

    loader = DataLoader(_data(), batch_size=4)  # 8 steps of 2 updates an epoch
    first = io.StringIO()
    loop_with(first).fit(loader, epochs=2, max_steps=11)
    assert "resumed" not in first.getvalue()
    ckpt = ModelCheckpoint(tmp_path).latest()  # saved at step 9
    again = io.StringIO()
    loop_with(again).fit(loader, epochs=2, resume_from="last")
    line = f"  resumed from {ckpt}: epoch 2 at its step 2 of 8 (after step 9, update 18)"
    assert line in again.getvalue().splitlines()
    assert again.getvalue().index(line) < again.getvalue().index("epoch 2:")  # before it runs
