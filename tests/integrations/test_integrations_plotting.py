"""``python -m ipuloop.integrations.plotting``: curves from a real CSVLogger file; a clear failure
on other files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, poptorch
from ipuloop.callbacks import CSVLogger
from ipuloop.integrations.plotting import main, read_csv

pytest.importorskip("matplotlib")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def log_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plot") / "logs.csv"
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
        callbacks=[CSVLogger(path, every_n_steps=1)],
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    loop.fit(loader, epochs=3, val_loader=loader)
    return path, loop


def test_series_are_read_against_updates(log_file):
    path, loop = log_file
    series = read_csv(str(path))
    # every step (the epoch rows repeat the last step's loss at the same update)
    assert sorted({u for u, _ in series["loss"]}) == [2 * s for s in range(1, 13)]
    assert [u for u, _ in series["val_acc"]] == [8, 16, 24]  # every epoch
    assert series["val_loss"][-1][1] == pytest.approx(loop.state.history[-1]["val_loss"])


def test_writes_a_png_with_one_panel_per_quantity(log_file, tmp_path, capsys):
    path, _ = log_file
    out = tmp_path / "curves.png"
    assert main([str(path), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}: loss, acc"
    import matplotlib.image

    image = matplotlib.image.imread(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.shape[1] > image.shape[0] > 100  # two panels side by side


def test_module_entry_point(log_file, tmp_path):
    path, _ = log_file
    out = tmp_path / "c.png"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "ipuloop.integrations.plotting", str(path), "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 1000


@pytest.mark.parametrize(
    "content,message",
    [
        (
            b"",
            "not a CSVLogger file: its header must begin with epoch,step,update, found 'an empty",
        ),
        (
            b"a,b\n1,2\n",
            "not a CSVLogger file: its header must begin with epoch,step,update, found 'a,b'",
        ),
        (b"epoch,step,update,loss\n", "a CSVLogger file with no rows"),
        (b"epoch,step,update,loss\n1,2,4,abc\n", "line 2: could not convert string to float"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not a CSVLogger file (not text"),
    ],
)
def test_not_a_csvlogger_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(content)
    assert main([str(bad), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()


def test_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.csv")]) == 2
    err = capsys.readouterr().err
    assert "No such file or directory" in err and str(tmp_path / "nope.csv") in err
    assert err.count("\n") == 1


def test_missing_matplotlib_names_the_extra(log_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([str(log_file[0]), "-o", str(tmp_path / "x.png")]) == 2
    assert 'pip install "ipuloop[plot]"' in capsys.readouterr().err


def test_mnist_example_csv_option_plots(tmp_path, monkeypatch):
    from ipuloop.examples import mnist

    def tiny(data_dir, train):  # one host call of training data (40 x 10 x 10), 32 test images
        n = 4000 if train else 32
        g = torch.Generator().manual_seed(int(train))
        return TensorDataset(
            torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
        )

    monkeypatch.setattr(mnist, "load_mnist", tiny)
    logs = tmp_path / "logs.csv"
    assert mnist.main(["--epochs", "2", "--inference-iterations", "4", "--csv", str(logs)]) == 0
    series = read_csv(str(logs))
    assert sorted({u for u, _ in series["loss"]}) == [10, 20]  # 10 device iterations a step
    assert [u for u, _ in series["train_accuracy"]] == [10, 20]
    assert main([str(logs), "-o", str(tmp_path / "m.png")]) == 0


def test_a_log_with_estimates_plots_them_labelled(tmp_path, monkeypatch):
    """Under OutputMode.Final the CSV's ``estimated`` column names the estimates: it is read as
    names, not as a curve, and their curves are labelled "(estimate)"."""
    path = tmp_path / "final.csv"
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 2))
    Loop(
        model,
        poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.Final),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        progress=False,
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
        callbacks=[CSVLogger(path, every_n_steps=1)],
    ).fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=2)
    from ipuloop.integrations import plotting

    assert "estimated" not in read_csv(str(path))
    assert plotting.estimates(str(path)) == {"loss", "train_loss", "train_acc"}
    import matplotlib.axes

    labels = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, *a, **k: labels.append(k.get("label")) or plot(self, *a, **k),
    )
    assert main([str(path), "-o", str(tmp_path / "c.png")]) == 0
    assert sorted(labels) == [
        "loss (step, estimate)",
        "train_acc (estimate)",
        "train_loss (estimate)",
    ]
