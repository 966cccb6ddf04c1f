"""device/unsupported.py: the torch ops PopTorch's compiler refuses, with its errors, checked
call by call (``check``); the same ops with what the compiler takes pass. Programs that
trace them are in ``test_emulator_fidelity_checks.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from ipuloop.emulator.device.unsupported import REFUSED, check
from ipuloop.emulator.errors import Error

x = torch.tensor([0, 2, 1])


@pytest.mark.parametrize(
    "func,args,kwargs,match",
    [
        (F.one_hot, (x,), {}, "OneHot num classes must be specified"),
        (F.one_hot, (x, -1), {}, "OneHot num classes must be specified"),
        (torch.bincount, (x,), {}, "Bincount `minlength` must be specified"),
        (torch.Tensor.bincount, (x, None, 0), {}, "Bincount `minlength`"),
        (F.interpolate, (torch.ones(1, 1, 4),), {"mode": "linear"}, "upsample_linear1d"),
        (F.interpolate, (torch.ones(1, 1, 2, 2, 2), None, 2, "trilinear"), {}, "trilinear3d"),
    ],
)
def test_refused_with_popart_s_words(func, args, kwargs, match):
    with pytest.raises(Error, match=match):
        check(func, args, kwargs)


@pytest.mark.parametrize(
    "func,args,kwargs",
    [
        (F.one_hot, (x, 3), {}),
        (F.one_hot, (x,), {"num_classes": 3}),
        (torch.bincount, (x,), {"minlength": 4}),
        (F.interpolate, (torch.ones(1, 1, 4),), {"scale_factor": 2}),  # nearest
        (torch.Tensor.__getitem__, (torch.ones(3), torch.tensor([0, 2])), {}),  # int indices
        (torch.add, (x, x), {}),  # an op the table does not name
    ],
)
def test_what_the_compiler_takes_passes(func, args, kwargs):
    check(func, args, kwargs)


@pytest.mark.parametrize(
    "func,args",
    [
        (torch.nonzero, (x,)),
        (torch.Tensor.nonzero, (x,)),
        (torch.masked_select, (x, x > 0)),
        (torch.Tensor.__getitem__, (torch.ones(3), torch.tensor([True, False, True]))),
        (torch.Tensor.__getitem__, (torch.ones(3, 2), (torch.tensor([True, False, True]), 0))),
    ],
)
def test_ops_whose_output_shape_depends_on_values_are_dynamic(func, args):
    """Their output's shape depends on the values: torch's own exception for it, as
    PopTorch's dispatcher raises."""
    with pytest.raises(DynamicOutputShapeException):
        check(func, args, {})


def test_the_table_names_each_refused_op_once_per_spelling():
    assert {torch.nonzero, torch.Tensor.nonzero, F.one_hot, F.interpolate} <= set(REFUSED)
