"""The emulator finds the loss, raises PopTorch's errors and matches inputs as PopTorch does.

* the loss: PopTorch's loss pass over the traced graph (folded intermediate identity losses,
  several independent losses, no loss, a final loss that the outputs only use);
* errors PopTorch raises when it compiles or runs a model, in its words;
* inputs bound to ``forward``'s signature and matched by structure, key and shape.
"""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipuloop.emulator as poptorch


def sgd_step(model: nn.Module, loss_fn, *inputs, lr: float = 0.1) -> nn.Module:
    """``model`` after one plain torch SGD step on ``loss_fn(model, *inputs)``."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    loss_fn(ref, *inputs).backward()
    opt.step()
    return ref


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))


def trained(model: nn.Module, *inputs, options=None) -> tuple[nn.Module, object]:
    """``model`` after one emulated training call, and the call's outputs."""
    training = poptorch.trainingModel(
        model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    out = training(*inputs)
    training.copyWeightsToHost()
    return model, out


X, Y = torch.randn(4, 3), torch.randn(4, 2)


# -- the loss ---------------------------------------------------------------------------------


class PartialLoss(nn.Module):
    """Returns an intermediate identity loss that feeds the final one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 2)

    def forward(self, x, y):
        partial = poptorch.identity_loss(self.fc(x) - y, reduction="mean")
        return partial, poptorch.identity_loss(partial * partial * 5, reduction="mean")


def test_identity_loss_feeding_the_final_one_is_not_a_second_loss():
    expected = sgd_step(PartialLoss(), lambda m, x, y: 5 * (m.fc(x) - y).mean() ** 2, X, Y)
    model, (partial, loss) = trained(PartialLoss(), X, Y)
    assert torch.allclose(loss, 5 * partial**2)
    assert same_weights(model, expected)  # trained on the final loss only


def test_two_losses_without_identity_loss_are_multiple_independent_losses():
    class Two(PartialLoss):
        def forward(self, x, y):
            out = self.fc(x)
            return out, F.mse_loss(out, y) + F.l1_loss(out, y) * 5

    with pytest.raises(
        poptorch.Error,
        match=re.escape(
            "Multiple independent losses found in graph. Graph must have one final loss. Wrap "
            "final graph loss in poptorch.identity_loss."
        ),
    ):
        poptorch.trainingModel(Two())(X, Y)


def test_two_losses_wrapped_in_identity_loss_are_one_loss():
    class Two(PartialLoss):
        def forward(self, x, y):
            out = self.fc(x)
            return out, poptorch.identity_loss(
                F.mse_loss(out, y) + F.l1_loss(out, y), reduction="mean"
            )

    expected = sgd_step(Two(), lambda m, x, y: F.mse_loss(m.fc(x), y) + F.l1_loss(m.fc(x), y), X, Y)
    assert same_weights(trained(Two(), X, Y)[0], expected)


def test_a_scalar_that_is_no_loss_op_is_not_a_loss():
    class Scalar(PartialLoss):
        def forward(self, x, y):
            out = self.fc(x)
            return out, ((out - y) ** 2).mean()  # PopTorch sees no loss here

    with pytest.raises(poptorch.Error, match="^Couldn't find a loss in graph!"):
        poptorch.trainingModel(Scalar())(X, Y)


def test_a_loss_that_feeds_no_output_is_dead_code():
    class Dead(PartialLoss):
        def forward(self, x, y):
            out = self.fc(x)
            F.l1_loss(out, y)  # unused: not a second loss
            return out, F.mse_loss(out, y)

    expected = sgd_step(Dead(), lambda m, x, y: F.mse_loss(m.fc(x), y), X, Y)
    assert same_weights(trained(Dead(), X, Y)[0], expected)


def test_a_final_loss_the_outputs_only_use_is_the_one_trained():
    class Masked(PartialLoss):
        def forward(self, x, y):
            out = self.fc(x)
            loss = F.mse_loss(out, y)
            return out, loss * 10  # the graph's loss is `loss`; the output is another tensor

    expected = sgd_step(Masked(), lambda m, x, y: F.mse_loss(m.fc(x), y), X, Y)
    options = poptorch.Options().deviceIterations(2)  # one update per micro-batch of 2
    model = Masked()
    training = poptorch.trainingModel(
        model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    first = training(X[:2].repeat(2, 1), Y[:2].repeat(2, 1))[1]
    reference = Masked()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(reference.fc(X[:2]), Y[:2]).backward()
        opt.step()
    training.copyWeightsToHost()
    assert same_weights(model, reference)
    assert first.shape == ()  # Final: the last micro-batch's returned value
    assert same_weights(trained(Masked(), X, Y)[0], expected)


# -- errors PopTorch raises ---------------------------------------------------------------------


class Looped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        out = poptorch.for_loop(2, lambda t: self.fc(t), [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")


def test_for_loop_in_a_training_model_raises():
    with pytest.raises(
        poptorch.Error, match=re.escape("poptorch.for_loop() is only supported in inference")
    ):
        poptorch.trainingModel(Looped())(X)
    model = Looped()
    out, _ = poptorch.inferenceModel(model)(X)  # inference compiles it
    with torch.no_grad():
        assert torch.allclose(out, model.fc(model.fc(X)))


def test_an_op_after_a_block_ended_belongs_to_no_block():
    class AfterBlock(nn.Module):
        def forward(self, x):
            with poptorch.Block(ipu_id=0):
                x = x * 4
            return x * 4

    options = poptorch.Options().deviceIterations(2)
    options.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    model = poptorch.inferenceModel(AfterBlock(), options)
    with pytest.raises(
        poptorch.Error, match="^No active Block, all the ops must belong to a Block"
    ):
        model.compile(torch.randn(2, 5))
    assert not model.isCompiled()


def test_ops_inside_blocks_and_before_the_first_one_are_accepted():
    class Blocks(nn.Module):
        def forward(self, x):
            x = x + 1  # before the first block: IPU 0
            with poptorch.Block(ipu_id=0):
                x = x * 2
            with poptorch.Block(ipu_id=1):
                x = x * 3
            return x

    model = poptorch.inferenceModel(Blocks(), poptorch.Options().deviceIterations(2))
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 12.0))


class BufferModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("y", torch.tensor([2.0]))


def test_a_buffer_removed_in_forward_raises():
    class Removes(BufferModel):
        def forward(self, x):
            if "y" in self._buffers:
                del self._buffers["y"]
            return x + 1

    with pytest.raises(
        poptorch.Error,
        match=re.escape("Buffer y is removed from the model when calling the forward method."),
    ):
        poptorch.inferenceModel(Removes())(torch.tensor([5.0]))


def test_a_buffer_reassigned_in_forward_raises():
    class Reassigns(BufferModel):
        def forward(self, x):
            self.y = x + 1
            return x

    with pytest.raises(
        poptorch.Error,
        match=re.escape(
            "Buffer y is reassigned within the model when calling the forward method. This is "
            "not supported. Consider using self.y.copy_(src) to copy data from a source tensor, "
            "where src is the name of the source tensor."
        ),
    ):
        poptorch.inferenceModel(Reassigns())(torch.tensor([5.0]))


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x, y):
        out = self.fc(x)
        with torch.no_grad():
            self.count += 1
        return out, F.mse_loss(out, y)


def test_replicas_broadcasting_buffers_cannot_update_them():
    options = poptorch.Options().replicationFactor(2)
    with pytest.raises(
        poptorch.Error,
        match=re.escape(
            "PopTorch does not support broadcasting buffers. If your model is able to tolerate "
            "buffers becoming out of sync between replicas, you can disable buffer broadcasting "
            "using poptorch.Options.broadcastBuffers(False)."
        ),
    ):
        poptorch.trainingModel(Counting(), options)(X, Y)
    model = Counting()
    options = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    poptorch.trainingModel(model, options)(X, Y)
    assert model.count.item() == 1.0  # replica 0's buffer


def test_batchnorm_statistics_under_replicas_are_not_buffer_writes():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x, y):
            out = self.model(x)
            return out, F.mse_loss(out, y)

    training = poptorch.trainingModel(WithLoss(), poptorch.Options().replicationFactor(2))
    training(X, Y)
    training.copyWeightsToHost()
    assert model[1].num_batches_tracked.item() == 1


def test_zero_sized_inputs_raise():
    model = poptorch.inferenceModel(nn.Identity())
    with pytest.raises(
        poptorch.Error,
        match=re.escape("Zero-sized tensors are unsupported (Got shape [0, 2, 5, 5])."),
    ):
        model(torch.randn(0, 2, 5, 5))


@pytest.mark.parametrize("training", [True, False])
def test_backward_on_outputs_raises(training):
    class Model(PartialLoss):
        def forward(self, x, y):
            out = self.fc(x)
            return out, F.mse_loss(out, y)

    wrap = poptorch.trainingModel if training else poptorch.inferenceModel
    out, loss = wrap(Model())(X, Y)
    for t in (out, loss):
        with pytest.raises(
            poptorch.Error,
            match=re.escape(
                "backward() cannot be called explicitly on outputs of a PopTorch model."
            ),
        ):
            t.backward()


def test_a_cpu_tensor_meeting_graph_tensors_raises():
    class Legacy(nn.Module):
        def forward(self, x):
            return torch.index_select(x, 0, torch.LongTensor([1, 0]))

    model = poptorch.inferenceModel(Legacy())
    with pytest.raises(
        poptorch.Error,
        match=re.escape("Expected an IPU tensor but got tensor(device=cpu, shape=[2], dtype=Long)"),
    ):
        model.compile(torch.rand(4))


def test_tensors_made_in_the_graph_or_moved_to_it_are_accepted():
    class Made(nn.Module):
        def forward(self, x):
            host = torch.LongTensor([1, 0]) + 0  # ops on host tensors alone run on the host
            index = torch.tensor([1, 0]) + host.to(x.device)
            return torch.index_select(x, 0, index // 2)

    x = torch.rand(4)
    assert torch.equal(poptorch.inferenceModel(Made())(x), x[[1, 0]])


def test_log_cycle_count_needs_ipu_hardware():
    options = poptorch.Options().logCycleCount(True)
    model = poptorch.inferenceModel(nn.Identity(), options)
    with pytest.raises(
        poptorch.Error,
        match=re.escape("Cycle count logging is only supported on actual IPU hardware."),
    ):
        model(torch.ones(2))


# -- inputs -----------------------------------------------------------------------------------


class Optional(nn.Module):
    def forward(self, t1, t2, t3=torch.ones(1), t4=torch.zeros(1)):
        return t1 * t3 + t2 * t4


def test_inputs_are_bound_with_forward_defaults():
    model = poptorch.inferenceModel(Optional())
    t1, t2, t4 = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0])
    assert model(t1, t2).item() == 1.0
    assert model(t1, t2, t4=t4).item() == 9.0  # the default t4 was an input of the graph
    assert model(t4=t4, t1=t1, t2=t2).item() == 9.0
    with pytest.raises(
        poptorch.Error,
        match=re.escape("Shape mismatch for t4: expected torch.Size([1]) but got torch.Size([2])"),
    ):
        model(t1, t2, t4=torch.ones(2))


def test_a_mandatory_argument_missing_raises():
    with pytest.raises(poptorch.Error, match="^Mandatory parameter t2 missing"):
        poptorch.inferenceModel(Optional())(torch.ones(1))


def test_dicts_are_matched_by_key():
    class Divide(nn.Module):
        def forward(self, d):
            return d["x"] / d["y"]

    model = poptorch.inferenceModel(Divide())
    x, y = torch.tensor([1.0]), torch.tensor([2.0])
    assert model({"x": x, "y": y}).item() == 0.5
    assert model({"y": y, "x": x}).item() == 0.5
    with pytest.raises(poptorch.Error, match=re.escape("Missing arguments: x.")):
        model({"y": y})
    with pytest.raises(poptorch.Error, match=re.escape("Unexpected arguments: z.")):
        model({"x": x, "y": y, "z": y})


class Args(collections.OrderedDict):
    pass


def test_dict_subclasses_keep_their_type_and_are_split_into_their_tensors():
    seen = []

    class Model(nn.Module):
        def forward(self, args):
            seen.append(type(args))
            return args["a"] * 2 + args["b"]

    model = poptorch.inferenceModel(Model(), poptorch.Options().deviceIterations(2))
    args = Args(b=torch.randn(4, 2), a=torch.randn(4, 2))
    assert torch.allclose(model(args), args["a"] * 2 + args["b"])
    assert seen and all(t is Args for t in seen)


def test_a_changed_shape_is_reported_as_torch_sizes():
    class Add(nn.Module):
        def forward(self, t):
            return t[0] + t[1]

    model = poptorch.inferenceModel(Add())
    model((torch.tensor([1.0]), torch.tensor([2.0])))
    with pytest.raises(
        poptorch.Error,
        match=re.escape(
            "Shape mismatch for t[0]: expected torch.Size([1]) but got torch.Size([2])"
        ),
    ):
        model((torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])))


def test_missing_keyword_arguments_and_type_mismatches():
    class Model(nn.Module):
        def forward(self, a, *rest, z=None, u=3, **more):
            out = a * u + sum(rest)
            return out if z is None else out + z + sum(more.values())

    class Wrapper(Model):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    a, z, m = torch.ones(2), torch.ones(2), torch.ones(2)
    model = poptorch.inferenceModel(Model())
    assert torch.equal(model(a, a, z=z, m=m), torch.full((2,), 6.0))
    with pytest.raises(
        poptorch.Error,
        match=re.escape(
            "Type mismatch for z: expected <class 'torch.Tensor'> but got <class 'NoneType'>"
        ),
    ):
        model(a, a, m=m)
    with pytest.raises(poptorch.Error, match=re.escape("Missing arguments: m.")):
        model(a, a, z=z)
    with pytest.raises(poptorch.Error, match=re.escape("mismatch for u: expected 3 but got 5")):
        model(a, a, z=z, m=m, u=5)
    wrapped = poptorch.inferenceModel(Wrapper())
    wrapped(a, a, z=z, m=m)
    with pytest.raises(poptorch.Error, match=re.escape("Missing arguments: z.")):
        wrapped(a, a, m=m)
