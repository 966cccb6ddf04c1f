"""mixed_float.py: operand types as an IPU takes them (float16 and float32 operands in one op,
int32 indices), the rule the emulator's device and the loop's "16-mixed" advice both run, in
closed form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ipuloop.mixed_float import MixedFloat


def test_mixed_float_operands_take_the_first_floating_operand_s_dtype():
    """torch refuses a float16 input to a float32 weight in a matmul; under the mode the
    weight is cast to the activation's dtype and the result has it, with the gradient in the
    weight's own dtype. The result equals the float32 product rounded to float16."""
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float16)
    w = torch.tensor([[0.5, -1.0], [0.25, 3.0]], requires_grad=True)
    with pytest.raises(RuntimeError):
        F.linear(x, w)
    mode = MixedFloat()
    with mode:
        y = F.linear(x, w)
    assert mode.cast
    assert y.dtype == torch.float16
    assert torch.equal(y.float(), torch.tensor([[-1.5, 6.25]]))
    y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32
    assert torch.equal(w.grad, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))


def test_ops_torch_promotes_are_left_as_they_are():
    mode = MixedFloat()
    with mode:
        y = torch.ones(2, dtype=torch.float16) + torch.ones(2)  # torch promotes: float32
    assert y.dtype == torch.float32 and not mode.cast


def test_int32_targets_run_as_int64():
    """An IPU's integers are int32: a loss the host refuses for int32 targets gets them as
    int64, with the same value."""
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    targets = torch.tensor([0, 1], dtype=torch.int32)
    mode = MixedFloat()
    with mode:
        got = F.nll_loss(F.log_softmax(logits, dim=1), targets)
    assert torch.equal(got, F.nll_loss(F.log_softmax(logits, dim=1), targets.long()))


def test_an_error_that_is_no_dtype_mix_is_raised_as_it_is():
    with MixedFloat(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        torch.ones(2, 3) @ torch.ones(2, 3)
