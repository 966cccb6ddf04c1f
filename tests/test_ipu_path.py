"""What the loop does on real PopTorch 3.4, where the emulator used to be more forgiving.

Each test pins a PopTorch behaviour the emulator now has (its source line cited) and the
loop's use of it: reading weights after a detach, precision, optimizer state, inference
options, custom batch samplers, distributed slices, the backend fallback, learning rates,
the IPU count and recomputation checkpoints.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks.checkpoint import ModelCheckpoint, load_checkpoint

IN, OUT = 6, 3


class Net(nn.Module):
    """A model-with-loss: (output, loss) with labels, output without."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Linear(8, OUT))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else (out, self.loss(out, labels))


def data(n: int = 32, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def make_loop(**kw) -> Loop:
    model = Net()
    kw.setdefault("optimizer", poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return Loop(model, kw.pop("opts", None), progress=False, **kw)


# -- 1. weights are never read from a detached executor ---------------------------------------
def test_copy_weights_to_host_on_a_detached_model_is_an_error():
    """PopTorch's ``copyWeightsToHost`` checks only ``isCompiled()`` and then runs
    ``poptorch_core.copyWeightsToHost_impl(self._executable, ...)`` (``_poplar_executor.py``,
    ``PoplarExecutor.copyWeightsToHost``): on a detached model that reads a device the process
    no longer holds, so the emulator raises; ``detachFromDevice`` already copied them back
    (``self.copyWeightsToHostIfNeeded()`` before ``poptorch_core.detachFromDevice``)."""
    model = Net()
    train = poptorch.trainingModel(model, poptorch.Options(),
                                   poptorch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(4)[:]
    train(x, y)
    train.detachFromDevice()
    trained = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(poptorch.Error, match="detached"):
        train.copyWeightsToHost()
    assert not train.copyWeightsToHostIfNeeded()  # the detach synced: nothing to read
    assert all(torch.equal(a, b) for a, b in zip(trained, model.parameters()))


class _After(Callback):
    """Runs ``action(loop)`` at ``on_validation_end`` of the first epoch."""

    def __init__(self, action) -> None:
        self.action = action

    def on_validation_end(self, loop):
        if loop.state.epoch == 0:
            self.action(loop)


def _sigterm(loop):
    loop._on_sigterm()  # what the SIGTERM handler does


def _fail(loop):
    raise RuntimeError("boom")


@pytest.mark.parametrize("when", ["epoch_end", "sigterm", "exception", "after_fit"])
def test_checkpoints_after_validation_hold_the_trained_weights(tmp_path, when):
    """A save after validation (epoch end, SIGTERM, an exception) or after ``fit`` finds the
    training model detached (the inference model ran); the weights it holds are the host's."""
    ckpt = ModelCheckpoint(tmp_path, every_n_epochs=1 if when == "epoch_end" else None)
    action = {"sigterm": _sigterm, "exception": _fail}.get(when)
    loop = make_loop(callbacks=[ckpt] + ([_After(action)] if action else []))
    if when == "sigterm":
        with pytest.raises(SystemExit):
            loop.fit(DataLoader(data(), batch_size=4), epochs=2, val_loader=DataLoader(data(8)))
    elif when == "exception":
        with pytest.raises(RuntimeError, match="boom"):
            loop.fit(DataLoader(data(), batch_size=4), epochs=2, val_loader=DataLoader(data(8)))
    else:
        loop.fit(DataLoader(data(), batch_size=4), epochs=1, val_loader=DataLoader(data(8)))
    assert not loop.train_model.isAttachedToDevice()
    saved = loop.state_dict()["model"] if when == "after_fit" else \
        load_checkpoint(sorted(tmp_path.glob("*/manifest.json"))[0].parent)["model"]
    host = loop.model.state_dict()
    assert saved.keys() == host.keys()
    assert all(torch.equal(saved[k], host[k]) for k in host)
    assert not torch.equal(host["net.0.weight"], Net().state_dict()["net.0.weight"])  # trained
