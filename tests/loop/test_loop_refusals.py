"""What the loop refuses, or now does instead of refusing: each refusal names the argument, the
value received and a fix that works.

A float64 model (``model.double()``), a parameter group added to the optimizer during a fit,
and a second ``fit`` with another micro-batch size (the loop wraps the model again).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, Loop, poptorch

IN, CLASSES, N = 4, 3, 32


def _data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    )


def _model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, CLASSES))


def _loop(model: nn.Module, optimizer=None, **kwargs) -> Loop:
    opts = poptorch.Options().deviceIterations(2)
    if optimizer is None:
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    return Loop(
        model, opts, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer, progress=False, **kwargs
    )


# -- a float64 model -------------------------------------------------------------------------------
def test_a_float64_model_is_refused_naming_model_float():
    model = _model().double()
    with pytest.raises(TypeError, match=r"model\.float\(\)") as e:
        _loop(model)
    assert "0.weight" in str(e.value) and "float64" in str(e.value)


def test_the_float_model_trains_after_model_float():
    model = _model().double().float()
    _loop(model).fit(DataLoader(_data(), batch_size=2), epochs=1)


# -- a parameter group added during the fit --------------------------------------------------------
class AddGroup(Callback):
    def __init__(self, params: list) -> None:
        self.params = params

    def on_train_step_end(self, loop) -> None:
        if loop.state.step == 2:
            loop.optimizer.add_param_group({"params": self.params, "lr": 0.1})


class RaiseLr(Callback):
    def on_train_step_end(self, loop) -> None:
        if loop.state.step == 2:
            loop.optimizer.param_groups[1]["lr"] = 0.1


def test_a_group_added_mid_fit_is_refused_with_a_fix_that_works():
    model = _model()
    first, second = list(model[0].parameters()), list(model[3].parameters())
    loop = _loop(model, poptorch.optim.SGD(first, lr=0.1), callbacks=[AddGroup(second)])
    with pytest.raises(ValueError, match="parameter group") as e:
        loop.fit(DataLoader(_data(), batch_size=2), epochs=1)
    message = str(e.value)
    assert "add_param_group" in message and "lr=0.0" in message
    assert "pass them explicitly to the optimizer's constructor" not in message

    # the fix it names: every group from the start, the late one at lr=0.0, raised later
    model = _model()
    before = [p.detach().clone() for p in model[3].parameters()]
    optimizer = poptorch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.0}], lr=0.1
    )
    seen = []

    class Watch(Callback):
        def on_train_step_end(self, loop) -> None:
            if loop.state.step == 2:
                seen.append([p.detach().clone() for p in model[3].parameters()])

    loop = _loop(model, optimizer, callbacks=[RaiseLr(), Watch()])
    loop.fit(DataLoader(_data(), batch_size=2), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, seen[0]))  # frozen while lr=0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, model[3].parameters()))


def test_the_emulator_names_the_fix_for_a_group_added_after_the_wrap():
    model = nn.Linear(IN, CLASSES)
    extra = nn.Parameter(torch.zeros(3))
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(_WithLoss(model), optimizer=optimizer)
    x, y = _data(4).tensors
    wrapped(x, y)
    optimizer.add_param_group({"params": [extra], "lr": 0.1})
    with pytest.raises(ValueError, match="parameter group") as e:
        wrapped.setOptimizer(optimizer)
    assert "lr=0.0" in str(e.value) and "destroy()" in str(e.value)
    assert "pass them explicitly" not in str(e.value)


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return out, nn.functional.cross_entropy(out, y)


# -- a second fit with another micro-batch size ----------------------------------------------------
def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_second_fit_with_another_micro_batch_size_wraps_the_model_again():
    """The weights, the momentum and the device's random stream (dropout) carry over: the
    same as resuming from a checkpoint of the first fit with the new loader."""
    model = _model(dropout=0.3)
    loop = _loop(model, poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loop.fit(DataLoader(_data(), batch_size=2), epochs=1)
    first = loop.train_model
    with pytest.warns(UserWarning, match="micro-batch size 4.*compiled for 2.*compiled again"):
        loop.fit(DataLoader(_data(), batch_size=4), epochs=2)
    assert loop.train_model is not first and loop.state.epoch == 2

    ref = _model(dropout=0.3)
    a = _loop(ref, poptorch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    a.fit(DataLoader(_data(), batch_size=2), epochs=1)
    resumed_model = _model(dropout=0.3)
    b = _loop(resumed_model, poptorch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9))
    b.load_state_dict(a.state_dict())
    with pytest.warns(UserWarning, match="other factors"):
        b.fit(DataLoader(_data(), batch_size=4), epochs=2)
    assert all(torch.equal(x, y) for x, y in zip(_weights(model), _weights(resumed_model)))
    assert loop.state.history == b.state.history


class _MySGD(torch.optim.SGD):
    """A subclass: no poptorch.optim twin, so its momentum stays on the device."""


def test_another_micro_batch_size_with_device_only_optimizer_state_names_the_fix():
    model = _model()
    loop = _loop(model, _MySGD(model.parameters(), lr=0.1, momentum=0.9))
    loop.fit(DataLoader(_data(), batch_size=2), epochs=1)
    with pytest.raises(ValueError, match="train_loader: micro-batch size 4") as e:
        loop.fit(DataLoader(_data(), batch_size=4), epochs=2)
    assert "batch_size=2" in str(e.value) and "poptorch.optim.SGD" in str(e.value)
    loop.fit(DataLoader(_data(), batch_size=2), epochs=2)  # the size it compiled for: trains


def test_another_micro_batch_size_with_a_torch_optimizer_s_twin_carries_its_state_over():
    """torch.optim.SGD with momentum runs as its poptorch.optim twin, whose state the host
    reads back: wrapping the model again for another micro-batch size keeps it, as a resume
    from a checkpoint of the first fit with the new loader does."""
    model = _model()
    loop = _loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loop.fit(DataLoader(_data(), batch_size=2), epochs=1)
    with pytest.warns(UserWarning, match="compiled again"):
        loop.fit(DataLoader(_data(), batch_size=4), epochs=2)
    ref = _model()
    a = _loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    a.fit(DataLoader(_data(), batch_size=2), epochs=1)
    resumed = _model()
    b = _loop(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9))
    b.load_state_dict(a.state_dict())
    with pytest.warns(UserWarning, match="other factors"):
        b.fit(DataLoader(_data(), batch_size=4), epochs=2)
    assert all(torch.equal(x, y) for x, y in zip(_weights(model), _weights(resumed)))
    # and the momentum mattered: with it restarted from zero the weights end elsewhere
    fresh = _model()
    c = _loop(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    c.load_weights(a.model.state_dict())
    c.state.epoch = 1
    c.fit(DataLoader(_data(), batch_size=4), epochs=2)
    assert not all(torch.equal(x, y) for x, y in zip(_weights(model), _weights(fresh)))
