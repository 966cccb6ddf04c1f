"""Emulator fidelity: inputs edited in place, what the device trains, mixed float16/float32.

Expected values are the closed forms one PopTorch device run gives (poptorch-semantics §2, §4).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch


def opts(di: int = 1) -> poptorch.Options:
    o = poptorch.Options()
    o.deviceIterations(di)
    return o


# ---------------------------------------------------------------------------------------------
# Inputs edited in place

class AddOne(nn.Module):
    def forward(self, x):
        x += 1
        return x * 2


class FillAndScale(nn.Module):
    """``fill_``, slice assignment and ``mul_`` on one input; returns the edited input."""

    def forward(self, x, y):
        y[:, :1] = 0
        y.mul_(3)
        x.fill_(5)
        return x, y


@pytest.mark.parametrize("di", [1, 2, 4])
def test_inference_input_edited_once_on_every_call(di):
    model = poptorch.inferenceModel(AddOne(), opts(di))
    x = torch.zeros(di * 2, 3)
    out = model(x)  # the first call also compiles: its trace must not edit x
    assert torch.equal(x, torch.ones(di * 2, 3))
    assert torch.equal(out, torch.full((di * 2, 3), 2.0))
    out = model(x)
    assert torch.equal(x, torch.full((di * 2, 3), 2.0))
    assert torch.equal(out, torch.full((di * 2, 3), 4.0))


@pytest.mark.parametrize("di", [1, 3])
def test_inference_fill_slice_and_mul_edit_each_micro_batch_once(di):
    model = poptorch.inferenceModel(FillAndScale(), opts(di))
    x, y = torch.zeros(di, 2), torch.ones(di, 2)
    out_x, out_y = model(x, y)
    expected_y = torch.tensor([[0.0, 3.0]] * di)
    assert torch.equal(y, expected_y) and torch.equal(out_y, expected_y)
    assert torch.equal(x, torch.full((di, 2), 5.0)) and torch.equal(out_x, x)


class TrainEdit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x.add_(1)
        return (self.w * x).sum()


@pytest.mark.parametrize("di", [1, 2])
def test_training_input_edited_once(di):
    model = poptorch.trainingModel(TrainEdit(), opts(di))
    x = torch.zeros(di, 1)
    model(x)
    assert torch.equal(x, torch.ones(di, 1))


def test_input_converted_for_the_device_gets_the_edit_back():
    """float64 inputs go to the device as float32 (§2.1); the edited values come back to the
    caller's float64 tensor, as PopTorch copies an edited input back to the host."""
    model = poptorch.inferenceModel(AddOne())
    x = torch.zeros(2, 3, dtype=torch.float64)
    model(x)
    assert torch.equal(x, torch.ones(2, 3, dtype=torch.float64))
