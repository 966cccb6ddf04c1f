"""EarlyStopping: scripted logs, a real fit, resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, State, poptorch
from ipuloop.callbacks import EarlyStopping

NAN, INF = math.nan, math.inf


class FakeLoop:
    """What EarlyStopping reads: state.logs and state.epoch; records stop()."""

    def __init__(self) -> None:
        self.state = State()
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def stop_epoch(cb: EarlyStopping, values: list[float]) -> int | None:
    """Feed one value per epoch; the 1-based epoch after which it stopped."""
    loop = FakeLoop()
    for v in values:
        loop.state.epoch += 1
        loop.state.logs = {"val_loss": v, "loss": 0.0}
        cb.on_epoch_end(loop)
        if loop.stopped:
            return loop.state.epoch
    return None


@pytest.mark.parametrize(
    "kw,values,stop",
    [
        ({"patience": 2}, [5, 4, 4, 4.5, 3], 4),
        ({"patience": 2}, [5, 4, 4, 3, 3.5, 3.2], 6),  # an improvement resets the count
        ({"patience": 1}, [5, 4, 3, 2], None),
        ({"patience": 2, "min_delta": 0.5}, [5, 4.8, 4.6, 4.0], 3),  # 0.4 is not enough
        ({"patience": 1, "mode": "max"}, [1, 2, 2], 3),
        ({"patience": 3, "mode": "max"}, [1, 2, 3, 4], None),
        ({"patience": 5}, [5, NAN], 2),  # non-finite stops at once
        ({"patience": 5}, [5, INF], 2),
        ({"patience": 2, "check_finite": False}, [5, NAN, NAN], 3),  # NaN is just no improvement
    ],
)
def test_scripted_logs(kw, values, stop, capsys):
    cb = EarlyStopping("val_loss", **kw)
    assert stop_epoch(cb, values) == stop
    assert cb.stopped_epoch == stop
    if stop is not None:
        assert f"EarlyStopping: stopping after epoch {stop}" in capsys.readouterr().out


def test_state_dict_resumes_the_count():
    values = [5, 4, 4, 4, 4]
    first = EarlyStopping(patience=3)
    assert stop_epoch(first, values[:3]) is None  # one epoch without improvement so far
    second = EarlyStopping(patience=3)
    second.load_state_dict(first.state_dict())
    assert stop_epoch(second, values[3:]) == 2  # two more epochs make three


def test_missing_monitor_lists_the_logs():
    loop = FakeLoop()
    loop.state.logs = {"loss": 1.0, "train_loss": 1.0}
    with pytest.raises(ValueError, match=r"monitor='val_acc'.*Available: \['loss', 'train_loss'\]"):
        EarlyStopping("val_acc").on_epoch_end(loop)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"mode": "low"}, "mode must be"),
        ({"patience": 0}, "patience must be an int >= 1"),
        ({"min_delta": -0.1}, "min_delta must be >= 0"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        EarlyStopping(**kw)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, x, y):
        out = self.lin(x).squeeze(-1)
        return out, nn.functional.mse_loss(out, y)


def make_loop(callbacks, lr=0.05):
    model = Net()
    return Loop(
        model,
        poptorch.Options().deviceIterations(2),
        progress=False,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        callbacks=callbacks,
    )


def loader(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=2)


def test_real_fit_stops_when_val_loss_stalls():
    loop = make_loop([EarlyStopping("val_loss", patience=2)], lr=0.0)  # val_loss never moves
    history = loop.fit(loader(), epochs=10, val_loader=loader(8, seed=1))
    assert len(history) == 3 and loop.state.epoch == 3  # best at 1, then 2 without improvement
