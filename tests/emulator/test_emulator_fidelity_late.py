"""Emulator fidelity: the module as it is when compiled, not as it was when wrapped.

PopTorch traces a wrapped model when it compiles (its first call, or ``compile()``), so a layer
replaced or a buffer reassigned on the user's module between ``trainingModel(...)`` and then
is what the device holds and trains (docs/poptorch-semantics.md §4.2). Expected values come from plain
torch doing the same math.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import ipuloop.emulator as poptorch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x, y):
        out = self.head(self.fc(x))
        return out, nn.functional.mse_loss(out, y)


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def reference(net: nn.Module, data: list, lr: float) -> nn.Module:
    """Plain torch: one SGD update per batch, on a copy of ``net``."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in data:
        _, loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return net


def test_layer_replaced_after_wrapping_is_trained():
    torch.manual_seed(0)
    net = Net()
    training = poptorch.trainingModel(
        net, poptorch.Options(), poptorch.optim.SGD(net.parameters(), lr=0.1)
    )
    old = net.fc
    net.fc = nn.Linear(4, 3)  # replaced after wrapping, before the first call compiles
    optimizer = poptorch.optim.SGD(net.parameters(), lr=0.1)  # over the new parameters
    training.setOptimizer(optimizer)
    start = copy.deepcopy(net)
    data = batches()
    for x, y in data:
        training(x, y)
    expected = reference(start, data, 0.1)
    assert not torch.equal(net.fc.weight, start.fc.weight)  # the new layer trained ...
    for name, p in net.named_parameters():  # ... as plain torch trains it
        torch.testing.assert_close(p, dict(expected.named_parameters())[name])
    assert type(old.weight) is nn.Parameter  # the replaced layer is the user's own again
    assert torch.equal(old.weight, old.weight.detach())  # and reading it needs no device


def test_parameter_replaced_after_wrapping_is_what_compile_uploads():
    torch.manual_seed(0)
    net = Net()
    training = poptorch.trainingModel(
        net, poptorch.Options(), poptorch.optim.SGD(net.parameters(), lr=0.1)
    )
    net.head.bias = nn.Parameter(torch.full((2,), 5.0))
    training.setOptimizer(poptorch.optim.SGD(net.parameters(), lr=0.1))
    start = copy.deepcopy(net)
    x, y = batches(1)[0]
    out, _ = training(x, y)
    with torch.no_grad():
        torch.testing.assert_close(out, start.head(start.fc(x)))  # ran on the new bias
    torch.testing.assert_close(net.head.bias, reference(start, [(x, y)], 0.1).head.bias)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, y):
        out = self.fc(x)
        return out, nn.functional.mse_loss(out, y)


def test_layer_with_buffers_replaced_after_wrapping_keeps_them_on_the_device():
    """A BatchNorm added after wrapping: its statistics are device buffers, updated once per
    micro-batch (not by the compile's trace), and the host reads them back."""
    torch.manual_seed(0)
    net = Normed()
    training = poptorch.trainingModel(
        net, poptorch.Options(), poptorch.optim.SGD(net.parameters(), lr=0.1)
    )
    net.fc = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    training.setOptimizer(poptorch.optim.SGD(net.parameters(), lr=0.1))
    start = copy.deepcopy(net)
    data = batches(2)
    for x, y in data:
        training(x, y)
    expected = reference(start, data, 0.1)
    bn = expected.fc[0]
    torch.testing.assert_close(net.fc[0].running_mean, bn.running_mean)
    torch.testing.assert_close(net.fc[0].running_var, bn.running_var)
    assert int(net.fc[0].num_batches_tracked) == 2
    torch.testing.assert_close(net.fc[1].weight, expected.fc[1].weight)


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x):
        return x + self.shift


def test_buffer_reassigned_after_wrapping_is_uploaded():
    net = Shifted()
    inference = poptorch.inferenceModel(net, poptorch.Options())
    net.shift = torch.full((4,), 2.0)  # before the first call: compiled as it is then
    x = torch.zeros(2, 4)
    assert torch.equal(inference(x), torch.full((2, 4), 2.0))
    net.shift = torch.full((4,), 3.0)  # after compiling: the device has it only when copied
    assert torch.equal(inference(x), torch.full((2, 4), 2.0))
    inference.copyWeightsToDevice()
    assert torch.equal(inference(x), torch.full((2, 4), 3.0))


def test_buffer_reassigned_with_another_shape_before_copy_weights_to_device():
    net = Shifted()
    inference = poptorch.inferenceModel(net, poptorch.Options())
    inference.compile(torch.zeros(2, 4))
    net.shift = torch.full((1,), 7.0)  # broadcasts: another shape, the same graph inputs
    inference.copyWeightsToDevice()
    assert torch.equal(inference(torch.zeros(2, 4)), torch.full((2, 4), 7.0))
