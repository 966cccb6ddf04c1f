"""A module rebuilt after its model compiled (a submodule replaced by a new one with the same
names, as re-parallelizing a Transformers model does): PopTorch copies the weights by name into
its compiled graph, the emulator runs the module on the tensors it bound at compile. Attaching
(or copying the weights to the device) refuses it, naming the tensor, instead of running the
new submodule on the host's stale tensors and training nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ipuloop import emulator as poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.norm = nn.BatchNorm1d(1, affine=False)  # buffers only

    def forward(self, x, y):
        out = self.norm(self.fc(x))
        return out, nn.functional.mse_loss(out, y)


def _compiled():
    torch.manual_seed(0)
    model = Net()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    training(torch.randn(4, 2), torch.zeros(4, 1))
    training.detachFromDevice()
    return model, training


def test_a_rebuilt_submodule_is_refused_at_attach():
    model, training = _compiled()
    rebuilt = nn.Linear(2, 1)
    rebuilt.load_state_dict(model.fc.state_dict())
    model.fc = rebuilt  # same names, new tensors
    with pytest.raises(poptorch.Error, match=r"'fc.weight' is not the tensor it had when it"):
        training.attachToDevice()


def test_a_rebuilt_buffer_holder_is_refused_at_copy_weights_to_device():
    model, training = _compiled()
    training.attachToDevice()
    model.norm = nn.BatchNorm1d(1, affine=False)
    with pytest.raises(poptorch.Error, match=r"'norm.running_mean' is not the tensor"):
        training.copyWeightsToDevice()


def test_the_bound_module_attaches_again_with_buffers_reassigned_in_place():
    model, training = _compiled()
    model.norm.running_mean = torch.ones(1)  # a buffer reassigned on its own module: followed
    training.attachToDevice()
    training(torch.randn(4, 2), torch.zeros(4, 1))
