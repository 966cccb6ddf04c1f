"""device/inputs.py: a host call's inputs as the device receives them, in closed form: the
batch dimension against the host-call factor, the conversions of ``prepare``, the shortcut
``as_ready`` takes, and in-place edits copied back (``write_back``)."""

from __future__ import annotations

import pytest
import torch

from ipuloop.emulator.device import inputs

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "n,di,ga,rf,g,fits",
    [
        (12, 2, 3, 2, 1, True),  # DI * RF * GA = 12
        (24, 2, 3, 2, 1, True),
        (18, 2, 3, 2, 1, False),
        (6, 2, 3, 2, 2, True),  # one replica group of 2 reads each input: DI * GA = 6
        (6, 1, 1, 1, 1, True),
    ],
)
def test_check_batch_wants_a_multiple_of_the_host_call_factor(n, di, ga, rf, g, fits):
    leaves = [torch.zeros(n, 2), "not a tensor"]
    if fits:
        inputs.check_batch(leaves, di, ga, rf, g)
    else:
        with pytest.raises(AssertionError, match=rf"batch dimension \({n}\) must be a multiple"):
            inputs.check_batch(leaves, di, ga, rf, g)


def test_a_scalar_input_counts_as_one_sample():
    inputs.check_batch([torch.tensor(3.0)], 1, 1, 1, 1)
    with pytest.raises(AssertionError, match=r"= 2 because"):
        inputs.check_batch([torch.tensor(3.0)], 2, 1, 1, 1)


def test_prepare_sends_float64_and_bfloat16_as_float32_detached_and_contiguous():
    x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3).t().requires_grad_()
    got = inputs.prepare(x, CPU, on_cpu=True)
    assert got.dtype == torch.float32 and not got.requires_grad and got.is_contiguous()
    assert torch.equal(got, x.detach().float())
    b = inputs.prepare(torch.tensor([1.5], dtype=torch.bfloat16), CPU, on_cpu=True)
    assert b.dtype == torch.float32 and b.item() == 1.5


def test_prepare_leaves_what_needs_nothing_as_it_is():
    x = torch.arange(4, dtype=torch.int32)
    assert inputs.prepare(x, CPU, on_cpu=True) is x
    half = torch.ones(2, dtype=torch.float16)
    assert inputs.prepare(half, CPU, on_cpu=True) is half  # an IPU type: kept
    assert inputs.prepare("label", CPU, on_cpu=True) == "label"


def test_ready_shapes_is_none_where_prepare_would_convert():
    fast = [(torch.Size([2, 3]), torch.float32), (torch.Size([2]), torch.int64)]
    assert inputs.ready_shapes(fast, on_cpu=True) is fast
    assert inputs.ready_shapes(fast, on_cpu=False) is None
    assert inputs.ready_shapes(None, on_cpu=True) is None
    assert inputs.ready_shapes([(torch.Size([2]), torch.float64)], on_cpu=True) is None


def test_as_ready_takes_only_plain_contiguous_tensors_of_the_compiled_kinds():
    ready = [(torch.Size([2, 3]), torch.float32)]
    x = torch.ones(2, 3)
    assert inputs.as_ready((x,), ready) == [x]
    for other in (
        torch.ones(3, 2),  # shape
        torch.ones(2, 3, dtype=torch.float64),  # dtype
        torch.ones(3, 2).t(),  # not contiguous
        torch.ones(2, 3, requires_grad=True),
        torch.nn.Parameter(torch.ones(2, 3)),  # not a plain tensor
    ):
        assert inputs.as_ready((other,), ready) is None
    assert inputs.as_ready((x, x), ready) is None  # not the compiled count


def test_write_back_copies_only_the_inputs_the_device_edited():
    given = [torch.zeros(2), torch.zeros(2)]
    converted = [g.clone() for g in given]
    versions = [c._version for c in converted]
    converted[0].add_(5.0)  # edited in place on the device
    inputs.write_back(list(zip(given, converted, versions)))
    assert given[0].tolist() == [5.0, 5.0] and given[1].tolist() == [0.0, 0.0]
