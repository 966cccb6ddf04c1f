"""device/optimizer_sync.py: a training model's optimizer and its device copy, driven by hand
with SGD in closed form: the copy steps the weights and holds the moments, the host reads
them through ``state_dict()`` only while attached or after a download, and ``set`` pushes
variable hyper-parameters and refuses constant ones. Through a wrapped model:
``test_emulator_optim.py`` and ``test_emulator_executor.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ipuloop.emulator as poptorch
from ipuloop.emulator.device.optimizer_sync import OptimizerSync


def owner():
    """What ``OptimizerSync`` reads of its executor."""
    return SimpleNamespace(_options=poptorch.Options(), _attached=True, _compiled=False)


def synced(optimizer, w):
    ex = owner()
    sync = OptimizerSync(ex, torch.nn.Linear(1, 1), optimizer)
    sync.upload([w])
    ex._compiled = True
    return ex, sync


def step(sync: OptimizerSync, w: torch.Tensor, grad: float) -> None:
    w.grad = torch.full_like(w, grad)
    sync.step()


def test_the_device_copy_steps_the_weights_and_holds_the_moments():
    w = torch.nn.Parameter(torch.ones(1))
    host = poptorch.optim.SGD([w], lr=0.5, momentum=0.5)
    ex, sync = synced(host, w)
    step(sync, w, 1.0)  # v = 1, w = 1 - 0.5
    step(sync, w, 1.0)  # v = 0.5 * 1 + 1 = 1.5, w = 0.5 - 0.75
    assert w.item() == -0.25 and w.grad is None  # gradients cleared after each update
    assert host.state == {}  # the moments are the device's
    assert sync.device is not host and sync.device.state[w]["momentum_buffer"].item() == 1.5
    # attached, the host's state_dict() reads the device's state
    assert host.state_dict()["state"][0]["momentum_buffer"].item() == 1.5
    ex._attached = False  # detached: the host's own state, until downloaded
    assert host.state_dict()["state"] == {}
    sync.download()
    assert host.state[w]["momentum_buffer"].item() == 1.5


def test_set_pushes_variable_hyperparameters():
    w = torch.nn.Parameter(torch.ones(1))
    host = poptorch.optim.SGD([w], lr=0.5)
    _, sync = synced(host, w)
    host.param_groups[0]["lr"] = 0.25  # lr passed explicitly: variable
    step(sync, w, 1.0)
    assert w.item() == 0.5  # not pushed yet: the device still has lr 0.5
    sync.set(host, [w])
    step(sync, w, 1.0)
    assert w.item() == 0.25


def test_set_refuses_a_change_of_a_constant():
    w = torch.nn.Parameter(torch.ones(1))
    host = poptorch.optim.SGD([w], lr=0.5)  # momentum not passed: constant
    _, sync = synced(host, w)
    host.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"\['momentum'\] are constant in the compiled graph"):
        sync.set(host, [w])


def test_the_loss_scale_is_the_optimizer_s():
    w = torch.nn.Parameter(torch.ones(1))
    _, sync = synced(poptorch.optim.SGD([w], lr=0.5, loss_scaling=128.0), w)
    assert sync.loss_scaling == 128.0 and sync.anchor_scalars() == {}
    step(sync, w, 128.0)  # the scaled gradient: poptorch.optim's step divides it back
    assert w.item() == 0.5


def test_no_optimizer_is_poptorch_s_default_sgd():
    model = torch.nn.Linear(1, 1)
    sync = OptimizerSync(owner(), model, None)
    assert type(sync.optimizer) is poptorch.optim.SGD
    assert sync.params() == list(model.parameters())


def test_a_torch_optimizer_keeps_its_own_state_dict():
    w = torch.nn.Parameter(torch.ones(1))
    host = torch.optim.SGD([w], lr=0.5, momentum=0.5)
    _, sync = synced(host, w)
    step(sync, w, 1.0)
    assert w.item() == 0.5 and host.state_dict()["state"] == {}  # not patched
