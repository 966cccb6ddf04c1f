"""Emulator fidelity: inputs edited in place, what the device trains, mixed float16/float32.

Expected values are the closed forms one PopTorch device run gives (docs/poptorch-semantics.md §2, §4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch

# torch 2.0's CPU has no float16 kernels for many backward and optimizer ops
# ("mse_backward_cpu_out" not implemented for 'Half'): the emulator computes float16 forward
# ops it lacks in float32, but not autograd's backward, so 16-bit training needs torch >= 2.1.
NEEDS_CPU_HALF_BACKWARD = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1),
    reason="torch < 2.1 has no float16 CPU kernels for backward and optimizer ops",
)


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
        return poptorch.identity_loss((self.w * x).sum(), reduction="none")


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


# ---------------------------------------------------------------------------------------------
# Mixed float16 / float32


@pytest.mark.parametrize("conv", [True, False])
@pytest.mark.parametrize(
    "act, weight",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_output_takes_the_activation_dtype(conv, act, weight):
    """PopTorch 3.4 half_float_test (float16 activations, float32 weights): the output has the
    activation's dtype whatever the weights' dtype; docs/poptorch-semantics.md §1 says mixed ops follow
    torch promotion, which torch's matmul and convolution do not define for mixed operands: we
    read the test as the rule for them."""
    torch.manual_seed(0)
    model = nn.Conv1d(4, 5, 2) if conv else nn.Linear(4, 5)
    x = torch.rand(2, 4, 4) if conv else torch.rand(2, 4)
    expected = model(x)
    model.to(weight)
    out = poptorch.inferenceModel(model)(x.to(act))
    assert out.dtype == act
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_cast_inside_forward_mixes_with_float32_weights():
    class CastInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x.half()), self.linear(x.float())

    half, full = poptorch.inferenceModel(CastInside())(torch.tensor([[3]], dtype=torch.uint8))
    assert half.dtype == torch.float16 and full.dtype == torch.float32


class Regress(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.linear(x)
        return out, nn.functional.mse_loss(out, y)


@NEEDS_CPU_HALF_BACKWARD
def test_float32_master_weights_train_on_float16_activations():
    """The float32 weights train through their float16 casts: the same updates as a torch loop
    that casts them itself."""
    model, ref = Regress(), Regress()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.rand(8, 4)
    y = (x.flip(1) * 2 - 1).half()
    x = x.half()
    losses = []
    for _ in range(60):
        out, loss = training(x, y)
        w, b = ref.linear.weight, ref.linear.bias
        ref_loss = nn.functional.mse_loss(nn.functional.linear(x, w.half(), b.half()), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert out.dtype == torch.float16 and loss.dtype == torch.float16
        assert torch.equal(loss, ref_loss.detach())
        losses.append(loss)
    assert losses[-1] < losses[0] / 2
    assert model.linear.weight.dtype == torch.float32  # the master weights stay float32
    assert torch.equal(model.linear.weight, ref.linear.weight)


@NEEDS_CPU_HALF_BACKWARD
def test_automatic_loss_scaling_and_partials_type_run():
    """Half partials are recorded (the host's kernels choose their accumulation: the math is
    the same as with float partials); automatic loss scaling raises the loss scale of these
    small gradients each step and trains to the statically scaled run's weights
    (docs/precision.md)."""

    def train(auto: bool, partials: torch.dtype) -> torch.Tensor:
        model = Regress().half()
        o = poptorch.Options()
        o.Training.setAutomaticLossScaling(auto)
        o.Precision.setPartialsType(partials)
        opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=128.0)
        training = poptorch.trainingModel(model, o, optimizer=opt)
        x, y = torch.rand(8, 4).half(), torch.rand(8, 4).half()
        for _ in range(5):
            training(x, y)
        if auto:
            assert training._opt.loss_scaling == 128.0 * 2**5
        return model.linear.weight.detach().clone()

    static = train(False, torch.half)
    assert torch.equal(static, train(False, torch.float))
    assert not torch.equal(static, Regress().half().linear.weight)
    torch.testing.assert_close(train(True, torch.half), static, rtol=0, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# The device runs the user's own tensors


def test_model_reached_through_a_closure_is_trained():
    """PopTorch fine_tuning_test: the loss module calls a network it does not own; the
    optimizer's parameters train, as in a plain torch loop."""
    torch.manual_seed(0)
    net, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    net.weight.requires_grad_(False)  # frozen, as a fine-tuning script does
    ref.weight.requires_grad_(False)

    class WithLoss(nn.Module):
        def forward(self, x, y):
            out = net(x)
            return out, nn.functional.mse_loss(out, y)

    training = poptorch.trainingModel(WithLoss(), optimizer=torch.optim.SGD([net.bias], lr=0.1))
    ref_opt = torch.optim.SGD([ref.bias], lr=0.1)
    x, y = torch.rand(4, 3), torch.rand(4, 2)
    frozen = net.weight.detach().clone()
    for _ in range(3):
        training(x, y)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    training.copyWeightsToHost()
    assert torch.equal(net.bias, ref.bias) and not torch.equal(net.bias, torch.zeros(2))
    assert torch.equal(net.weight, frozen)


def test_layer_replaced_before_wrapping_and_reached_as_a_global_is_trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[1] = nn.Linear(3, 2)  # replaced before wrapping
    head = model[1]

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x, y):
            return nn.functional.mse_loss(model(x), y)  # the global, not self.model

    wrapper = WithLoss()
    training = poptorch.trainingModel(wrapper, optimizer=torch.optim.SGD(head.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    training(torch.rand(4, 3), torch.rand(4, 2))
    assert training._dirty_host_weights  # the host is stale until read
    after = wrapper.model.state_dict()  # reading the wrapped module syncs
    assert not torch.equal(after["1.weight"], before["1.weight"])
    assert torch.equal(after["0.weight"], before["0.weight"])


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x):
        self.count += 1
        return x + self.count


def test_buffer_reassigned_before_copy_weights_to_device_is_what_the_device_gets():
    """PopTorch buffers_test / inplace_test: the host's buffer (even one of another dtype)
    reaches the device on copyWeightsToDevice."""
    model = Counter()
    inference = poptorch.inferenceModel(model)
    assert torch.equal(inference(torch.zeros(1, 2)), torch.ones(1, 2))
    model.count = torch.full((2,), 10.0, dtype=torch.float64)  # reassigned on the host
    assert torch.equal(inference(torch.zeros(1, 2)), torch.full((1, 2), 2.0))  # not pushed yet
    inference.copyWeightsToDevice()
    out = inference(torch.zeros(1, 2))
    assert torch.equal(out, torch.full((1, 2), 11.0)) and out.dtype == torch.float32
    assert torch.equal(model.count, torch.full((2,), 10.0, dtype=torch.float64))  # host's own


def test_a_failing_call_leaves_the_host_as_it_was():
    model = Counter()
    inference = poptorch.inferenceModel(model)
    inference(torch.zeros(1, 2))
    del model._buffers["count"]  # the compiled model's buffer is gone
    with pytest.raises(KeyError):
        inference(torch.zeros(1, 2))
    assert not poptorch.isRunningOnIpu() and torch.is_grad_enabled()
